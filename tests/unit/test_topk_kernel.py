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
for rows, vocab, k in ((1, 5000, 64), (2, 4096, 64), (1, 2049, 16), (1, 6000, 128)):
    x = torch.randn(rows, vocab, generator=gen) * 3
    x[0, : vocab // 3] = float("-inf")  # masked tokens (logit_bias, min_tokens)
    x[-1, 100:300] = x[-1, 7]  # a run of ties around the threshold
    got = tk._triton_top_values(x, k)
    want = x.topk(k, dim=-1, sorted=True).values
    results.append({"rows": rows, "vocab": vocab, "k": k, "equal": bool(torch.equal(got, want))})
print(json.dumps(results))
"""


def test_triton_top_values_under_the_interpreter():
    pytest.importorskip("triton")
    import triton.language as tl

    if not hasattr(tl, "topk"):
        pytest.skip("this triton has no tl.topk (the sampler uses torch.topk then)")
    from tests.triton_interpreter import run_interpreted

    results = run_interpreted(INTERPRETER_SCRIPT)
    assert len(results) == 4 and all(r["equal"] for r in results), results


def test_top_values_is_torch_topk_off_cuda():
    from clusteropt_cli.core.serve.topk_kernel import top_values

    x = torch.randn(3, 5000)
    assert torch.equal(top_values(x, 64), x.topk(64, dim=-1).values)
    assert torch.equal(top_values(x[:, :40], 40), x[:, :40].topk(40, dim=-1).values)  # k = the vocabulary
