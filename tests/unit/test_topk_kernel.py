"""The two-pass Triton top-k behind the TOP_K sampling thresholds (core/serve/topk_kernel.py): under the Triton
interpreter (CPU tensors, in a subprocess: TRITON_INTERPRET must be set before triton is imported) it gives
torch.topk's values on rows with -inf, ties and a vocabulary that is not a multiple of its chunk; off CUDA
top_values is torch.topk."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

INTERPRETER_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
from clusteropt_cli.core.serve import topk_kernel as tk
gen = torch.Generator().manual_seed(0)
results = []
# a partial last chunk of 1 element (2049) and of 1,904 (6000, k = 128); rows that fill their chunks (4096)
for rows, vocab, k in ((2, 4096, 64), (1, 2049, 16), (1, 6000, 128)):
    x = torch.randn(rows, vocab, generator=gen) * 3
    x[0, : vocab // 3] = float("-inf")  # masked tokens (logit_bias, min_tokens)
    x[-1, 100:300] = x[-1, 7]  # a run of ties around the threshold
    got = tk._triton_top_values(x, k)
    want = x.topk(k, dim=-1, sorted=True).values
    entries = True
    if (rows, vocab) in ((2, 4096), (1, 2049)):  # with token ids, in a stable sort's order (slow here: two cases)
        # the first case with per-row temperatures applied in the first pass (the sampler's 1 / temperature)
        scale = 1.0 / torch.tensor([0.7, 1.3][:rows]) if rows == 2 else None
        values, ids = tk._triton_top_entries(x, k, scale)
        scaled = x if scale is None else x * scale[:, None]
        sorted_values, order = scaled.sort(dim=-1, descending=True, stable=True)
        entries = torch.equal(values, sorted_values[:, :k]) and torch.equal(ids, order[:, :k])
    results.append({"rows": rows, "vocab": vocab, "k": k, "equal": bool(torch.equal(got, want)),
                    "entries": bool(entries)})
print(json.dumps(results))
"""


def test_triton_top_values_under_the_interpreter():
    pytest.importorskip("triton")
    import triton.language as tl

    if not hasattr(tl, "topk"):
        pytest.skip("this triton has no tl.topk (the sampler uses torch.topk then)")
    from tests.triton_interpreter import run_interpreted

    results = run_interpreted(INTERPRETER_SCRIPT)
    assert len(results) == 3 and all(r["equal"] and r["entries"] for r in results), results


def test_top_values_is_torch_topk_off_cuda():
    from clusteropt_cli.core.serve.topk_kernel import top_values

    x = torch.randn(3, 5000)
    assert torch.equal(top_values(x, 64), x.topk(64, dim=-1).values)
    assert torch.equal(top_values(x[:, :40], 40), x[:, :40].topk(40, dim=-1).values)  # k = the vocabulary


def test_top_k_kernels_compile_for_an_h100_class_gpu():
    """top_entries' two Triton passes over 64-bit keys lower to cubins for sm_90 ahead of time (no GPU needed; the
    value passes run on the GPU in bench/gpu_topk.py)."""
    pytest.importorskip("triton")
    import triton.language as tl

    if not hasattr(tl, "topk"):
        pytest.skip("this triton has no tl.topk")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from clusteropt_cli.core.serve import topk_kernel as tk

    tk._build()
    entry_pieces, entry_final = tk._kernels["entries"]
    piece_sig = {"x_ptr": "*fp32", "scale_ptr": "*fp32", "out_ptr": "*i64", "vocab": "i32", "stride": "i32",
                 "num_pieces": "i32",
                 "CHUNK": "constexpr", "K": "constexpr"}
    cases = [(entry_pieces, piece_sig, {"CHUNK": tk.CHUNK, "K": 64}, 4),
             (entry_final, {"cand_ptr": "*i64", "val_ptr": "*fp32", "idx_ptr": "*i64", "n": "i32", "P": "constexpr",
                            "K": "constexpr"}, {"P": 4096, "K": 64}, 8)]
    for fn, sig, constexprs, warps in cases:
        out = compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                      options={"num_warps": warps})
        assert len(out.asm["cubin"]) > 1000
