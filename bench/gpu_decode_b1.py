"""Where batch-1 decode time goes on the H200, and which GEMV formulation reaches the bandwidth floor.

    python3 bench/gpu_decode_b1.py --out $OUT/decode_b1.json          (≤ 4 minutes)
    python3 bench/gpu_decode_b1.py --shape 8b --cases cublas_fused_m1,triton_fused_m1,autotuned_fused_m1 --out b1.json
    python3 bench/gpu_decode_b1.py --cpu-smoke --out /tmp/b1.json     (tiny shapes: checks the script)

triton_fused: a hand-written Triton GEMV (BLOCK_N rows per program) with the fastest of a few configurations per
weight shape, each shape also timed against cuBLAS alone.

copt serve's batch-1 decode measured 1.89 ms/token (floor 0.58 ms = 2.47 GB of bf16 weights / 4.26 TB/s), of which
~1.6 ms is GPU time of the captured step, and the 112 linear layers alone took 0.90 ms at one token in a CUDA graph
(bench/gpu_fp8.py): cuBLAS at M=1 reaches about half the copy bandwidth. This bench times, each as a CUDA graph
of the same 112 Llama-3.2-1B-shaped weight matrices (+ the 128k-vocab LM head) at M = 1 (and 4):
  cublas          x @ W.T (torch.nn.functional.linear), what eager and the default compile run
  compiled        the same under torch.compile (inductor may pick its own GEMM templates)
  autotuned       torch.compile(mode="max-autotune-no-cudagraphs") (Triton GEMM/GEMV templates autotuned)
  reduction       (x[:, None, :] * W).sum(-1) under torch.compile: inductor emits a fused reduction kernel that
                  streams W once (the gpt-fast formulation)
  fp8_reduction   the same over e4m3 weights with per-channel scales (half the bytes; FP8 checkpoints)
plus cublas, reduction and autotuned over fused q/k/v and gate/up matrices (64 GEMVs instead of 112, the same
bytes; copt serve merges them since 2026-11-30),
and reports each against the bytes it must read (achieved TB/s, fraction of 4.26 TB/s). The copt serve step itself
is timed by bench/gpu_serve.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import COPY_BW, LLAMA_1B_SHAPE, LLAMA_8B_SHAPE, time_graph  # noqa: E402

# (hidden, intermediate, layers, heads, kv heads, head dim, vocabulary) of the Llama-3.2-1B and Llama-3.1-8B shapes
MODEL_SHAPES = {name: (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["num_attention_heads"],
                       c["num_key_value_heads"], c["head_dim"], c["vocab_size"])
                for name, c in (("1b", LLAMA_1B_SHAPE), ("8b", LLAMA_8B_SHAPE))}
SMOKE = (64, 128, 2, 4, 2, 16, 512)
PLAN = [(name, rows) for rows in (1, 4) for name in ("cublas", "compiled", "reduction", "fp8_reduction")]
# autotuning compiles and benchmarks templates per weight shape (minutes): last, so the rest always runs
PLAN += [("cublas_fused", 1), ("reduction_fused", 1), ("triton_fused", 1), ("autotuned", 1), ("autotuned_fused", 1),
         ("autotuned", 4)]


def shapes(smoke: bool, fused: bool = False, shape: str = "1b") -> list[tuple[int, int]]:
    """(out, in) of every linear of a decode step: q, k, v, o, gate, up, down per layer, then the LM head.
    fused: q/k/v as one matrix and gate/up as one (4 GEMVs per layer instead of 7, same bytes)."""
    h, i, layers, heads, kv, hd, vocab = SMOKE if smoke else MODEL_SHAPES[shape]
    per_layer = [(heads * hd, h), (kv * hd, h), (kv * hd, h), (h, heads * hd), (i, h), (i, h), (h, i)]
    if fused:
        per_layer = [((heads + 2 * kv) * hd, h), (h, heads * hd), (2 * i, h), (h, i)]
    return per_layer * layers + [(vocab, h)]


TRITON_CONFIGS = [(bn, bk, w) for bn in (4, 8, 16) for bk in (256, 512) for w in (4, 8)]


def triton_gemv():
    """A hand-written batch-1 GEMV (y = W x, W row-major [N, K] bf16): each program reads BLOCK_N whole rows,
    BLOCK_K columns at a time, and reduces them in fp32. Returns run(x, w, config) -> y [1, N]."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, w_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_ok = cols < K
            x = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :],
                        mask=row_ok[:, None] & col_ok[None, :], other=0.0, eviction_policy="evict_first")
            acc += w.to(tl.float32) * x[None, :]
        tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=row_ok)

    def run(x, w, config):
        block_n, block_k, warps = config
        n, k = w.shape
        y = torch.empty(1, n, device=w.device, dtype=w.dtype)
        kernel[(triton.cdiv(n, block_n),)](x, w, y, n, k, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
        return y

    return run


def run_triton_case(weights: list, device: str) -> dict:
    """The Triton GEMV with, per distinct weight shape, the fastest of TRITON_CONFIGS (each timed alone as a
    CUDA graph of 20 calls), then the whole step as one graph."""
    import torch
    import torch.nn.functional as F
    from common import time_graph

    run = triton_gemv()
    x_of = {w.shape[1]: torch.randn(1, w.shape[1], device=device, dtype=torch.bfloat16) for w in weights}
    best, per_shape = {}, {}
    t0 = time.perf_counter()
    with torch.no_grad():
        for w in weights:
            shape = tuple(w.shape)
            if shape in best:
                continue
            timings = {}
            for config in TRITON_CONFIGS:
                try:
                    seconds, _ = time_graph(lambda w=w, c=config: [run(x_of[w.shape[1]], w, c) for _ in range(20)],
                                            device, iters=10)
                    timings[config] = seconds / 20
                except Exception as exc:  # noqa: BLE001 - a config that does not compile is skipped
                    timings[config] = float("inf")
                    print(f"  config {config} on {shape}: {type(exc).__name__}", flush=True)
            cublas_s, _ = time_graph(lambda w=w: [F.linear(x_of[w.shape[1]], w) for _ in range(20)], device, iters=10)
            best[shape] = min(timings, key=timings.get)
            per_shape[f"{shape[0]}x{shape[1]}"] = {
                "best_config": list(best[shape]), "triton_us": 1e6 * timings[best[shape]],
                "cublas_us": 1e6 * cublas_s / 20, "bytes": w.numel() * 2,
                "triton_of_copy_bandwidth": w.numel() * 2 / timings[best[shape]] / COPY_BW,
                "cublas_of_copy_bandwidth": w.numel() * 2 / (cublas_s / 20) / COPY_BW}
        outs: list = []

        def step():
            outs.clear()
            for w in weights:
                outs.append(run(x_of[w.shape[1]], w, best[tuple(w.shape)]))

        seconds, mode = time_graph(step, device, iters=50)
        w, x = weights[-1], x_of[weights[-1].shape[1]]
        ref = F.linear(x.float(), w.float())
        rel_err = float((outs[-1].float() - ref).abs().max() / ref.abs().max().clamp(min=1e-6))
    read = sum(w.numel() * w.element_size() for w in weights)
    return {"ms": 1e3 * seconds, "mode": mode, "bytes_read": read, "tb_s": read / seconds / 1e12,
            "of_copy_bandwidth": read / seconds / COPY_BW, "max_rel_error_lm_head": rel_err,
            "per_shape": per_shape, "setup_s": time.perf_counter() - t0}


def run_case(name: str, weights: list, scales: list | None, rows: int, device: str) -> dict:
    import torch
    import torch.nn.functional as F

    dtype = torch.bfloat16
    xs = {}
    for w in weights:
        xs.setdefault(w.shape[1], torch.randn(rows, w.shape[1], device=device, dtype=dtype))

    def linear(x, w):
        return F.linear(x, w)

    def reduction(x, w):
        return (x[:, None, :].float() * w[None, :, :].float()).sum(-1).to(x.dtype)

    def fp8_reduction(x, w, s):
        return ((x[:, None, :].float() * w[None, :, :].float()).sum(-1) * s).to(x.dtype)

    if name == "cublas":
        op = linear
    elif name == "compiled":
        op = torch.compile(linear, dynamic=False)
    elif name == "autotuned":
        op = torch.compile(linear, dynamic=False, mode="max-autotune-no-cudagraphs")
    elif name == "reduction":
        op = torch.compile(reduction, dynamic=False)
    elif name == "fp8_reduction":
        op = torch.compile(fp8_reduction, dynamic=False)
    else:
        raise ValueError(name)
    outs: list = []

    def step():
        outs.clear()
        for j, w in enumerate(weights):
            x = xs[w.shape[1]]
            outs.append(op(x, w, scales[j]) if scales is not None else op(x, w))

    t0 = time.perf_counter()
    with torch.no_grad():
        seconds, mode = time_graph(step, device, iters=50)
        ms = 1e3 * seconds
        # correctness against the bf16 matmul of the same (dequantized) weights, on the LM head
        w, x = weights[-1], xs[weights[-1].shape[1]]
        ref = F.linear(x.float(), (w.float() * scales[-1][:, None]) if scales is not None else w.float())
        got = outs[-1].float()
        rel_err = float((got - ref).abs().max() / ref.abs().max().clamp(min=1e-6))
    read = sum(w.numel() * w.element_size() for w in weights)
    return {"ms": ms, "mode": mode, "bytes_read": read, "tb_s": read / (ms / 1e3) / 1e12,
            "of_copy_bandwidth": read / (ms / 1e3) / COPY_BW, "max_rel_error_lm_head": rel_err,
            "setup_s": time.perf_counter() - t0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--budget-s", type=float, default=220.0)
    parser.add_argument("--shape", default="1b", choices=sorted(MODEL_SHAPES), help="model shape (default 1b)")
    parser.add_argument("--cases", default="", help="comma-separated case keys to run, e.g. cublas_fused_m1, "
                        "autotuned_fused_m1 (default: all)")
    args = parser.parse_args()
    import torch

    device = "cpu" if args.cpu_smoke else "cuda"
    torch._dynamo.config.recompile_limit = 64  # one specialization per weight shape and row count
    started = time.perf_counter()
    torch.manual_seed(0)
    wanted = {c for c in args.cases.split(",") if c}
    plan = [(name, rows) for name, rows in PLAN if not wanted or f"{name}_m{rows}" in wanted]
    unknown = wanted - {f"{name}_m{rows}" for name, rows in PLAN}
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}")
    dims = shapes(args.cpu_smoke, shape=args.shape)
    weights = [torch.randn(o, i, device=device, dtype=torch.bfloat16) * 0.02 for o, i in dims]
    results: dict = {"bench": "gpu_decode_b1", "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                     "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                     "shape": "smoke" if args.cpu_smoke else args.shape, "linears": len(weights),
                     "floor_ms_bf16": 1e3 * sum(w.numel() * 2 for w in weights) / COPY_BW,
                     "cases": {}}
    fp8_weights = fp8_scales = None
    if hasattr(torch, "float8_e4m3fn") and any(name == "fp8_reduction" for name, _ in plan):
        fp8_scales = [w.float().abs().amax(dim=1) / 448.0 for w in weights]
        fp8_weights = [(w.float() / s[:, None]).to(torch.float8_e4m3fn) for w, s in zip(weights, fp8_scales,
                                                                                        strict=True)]
    fused_weights = [torch.randn(o, i, device=device, dtype=torch.bfloat16) * 0.02
                     for o, i in shapes(args.cpu_smoke, fused=True, shape=args.shape)
                     ] if any(name.endswith("_fused") for name, _ in plan) else []
    for name, rows in plan:
        key = f"{name}_m{rows}"
        if time.perf_counter() - started > args.budget_s:
            results["cases"][key] = {"skipped": "time budget"}
            continue
        try:
            if name == "fp8_reduction":
                if fp8_weights is None:
                    continue
                results["cases"][key] = run_case(name, fp8_weights, fp8_scales, rows, device)
            elif name == "triton_fused":
                if device != "cuda":
                    continue
                results["cases"][key] = run_triton_case(fused_weights, device)
                for shape, row in results["cases"][key]["per_shape"].items():
                    print(f"  {shape:>12}: triton {row['triton_us']:7.1f} us ({row['triton_of_copy_bandwidth']:.0%})"
                          f" {row['best_config']}, cublas {row['cublas_us']:7.1f} us "
                          f"({row['cublas_of_copy_bandwidth']:.0%})", flush=True)
            elif name.endswith("_fused"):
                results["cases"][key] = run_case(name.removesuffix("_fused"), fused_weights, None, rows, device)
            else:
                results["cases"][key] = run_case(name, weights, None, rows, device)
        except Exception as exc:  # noqa: BLE001 - recorded, the next case runs
            results["cases"][key] = {"error": f"{type(exc).__name__}: {exc}",
                                     "traceback": traceback.format_exc()[-1500:]}
        case = results["cases"][key]
        if "ms" in case:
            print(f"{key:22s} {case['ms']:7.3f} ms  {case['tb_s']:5.2f} TB/s  "
                  f"({case['of_copy_bandwidth']:.0%} of copy)  err {case['max_rel_error_lm_head']:.1e}  "
                  f"[{case['mode']}]", flush=True)
        else:
            print(f"{key:22s} {case.get('error', case.get('skipped'))}", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
    print(f"floor (bf16 weights / copy bandwidth): {results['floor_ms_bf16']:.3f} ms; results: {args.out}")


if __name__ == "__main__":
    main()
