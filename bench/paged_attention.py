"""Per-call time of paged decode attention against today's slot-cache decode attention (one layer, one step).

    python3 bench/paged_attention.py --out $OUT/paged_attention.json          (≤ 8 minutes on the H200)
    python3 bench/paged_attention.py --cpu-smoke --out /tmp/pa.json          (tiny shapes on CPU: checks the script)

For each shape (Llama-3.2-1B: H=32, KVH=8, D=64; Llama-3.1-8B: H=32, KVH=8, D=128), batch B and context C, bf16,
block size 16 (pools with shuffled physical blocks), each timed as a CUDA graph replayed --iters times (CUDA events):
  op        copt::paged_decode_attention (the Triton kernels), every row at position C-1 (full context)
  op_ragged the same, rows at positions uniform in [0, C): a paged row reads only its own blocks
  op_fp8    the op over float8_e4m3fn pools (FP8 KV cache), full context
  sdpa      today's slot path (runner._slot_attention, decode): the query's GQA group folded into the query axis,
            F.scaled_dot_product_attention over a contiguous [B, KVH, C, D] cache with the [B, 1, 1, C] bool mask
  math      the same in plain matmul/softmax (float32 scores), runner's "math" attention
  gather    the op's CPU reference on CUDA (gather the table's blocks into float32, mask, softmax)
For B <= --sweep-max-batch it also times the kernels at fixed split counts (splits_sweep_us, next to the
splits_chosen by paged_attention.choose_splits), the data to tune MIN_SPLIT_TOKENS and PROGRAMS_PER_SM from.
Configurations whose buffers do not fit in the free GPU memory are skipped (marked in the table); the gather
reference needs float32 copies of the whole bucket and is the first to go. Every configuration checks the op against
the sdpa output of the same keys (max abs error). A final section compiles a function calling the op
(torch.compile(dynamic=True, fullgraph=True)), checks it against eager at two batch sizes and captures it into a CUDA
graph, and records whether torch's kernel-mutation analysis fell back to cloning every input.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import COPY_BW, log, time_graph  # noqa: E402

SHAPES = {"1b": dict(heads=32, kv_heads=8, dim=64), "8b": dict(heads=32, kv_heads=8, dim=128)}


def time_call(fn, device: str, iters: int) -> tuple[float, str]:
    """µs per call of fn (bench/common.py's CUDA-graph timer)."""
    seconds, mode = time_graph(fn, device, iters)
    return 1e6 * seconds, mode


def free_bytes(device: str) -> int:
    import torch

    if device != "cuda":
        return 8 << 30
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    return free


def make_pools(batch, ctx, kv_heads, dim, block_size, dtype, device, seed=0):
    """K/V pools of exactly the blocks the batch needs (+1), physical blocks shuffled across rows."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    per_row = (ctx + block_size - 1) // block_size
    pool_blocks = batch * per_row + 1
    k_pool = torch.randn(pool_blocks, block_size, kv_heads, dim, device=device, dtype=dtype, generator=gen)
    v_pool = torch.randn(pool_blocks, block_size, kv_heads, dim, device=device, dtype=dtype, generator=gen)
    perm = torch.randperm(pool_blocks, device=device, generator=gen)[: batch * per_row]
    tables = perm.view(batch, per_row).to(torch.int32).contiguous()
    return k_pool, v_pool, tables, per_row


def run_config(shape_name, batch, ctx, args, device) -> dict:
    import torch
    import torch.nn.functional as F

    from clusteropt_cli.core.serve import paged_attention as pa

    shape = SHAPES[shape_name] if not args.cpu_smoke else dict(heads=8, kv_heads=2, dim=32)
    heads, kv_heads, dim = shape["heads"], shape["kv_heads"], shape["dim"]
    groups = heads // kv_heads
    dtype = torch.bfloat16
    block_size = args.block_size
    scale = dim**-0.5
    row = {"shape": shape_name, "batch": batch, "context": ctx, "block_size": block_size, **shape}
    kv_bytes = 2 * batch * ctx * kv_heads * dim * 2  # K and V, bf16, the keys a full-context step must read
    row["kv_bytes"] = kv_bytes
    if 2.2 * kv_bytes > free_bytes(device):  # pools + the contiguous slot cache of the same keys
        row["skipped"] = "does not fit"
        return row
    iters = max(10, min(args.iters, int(args.target_s / max(kv_bytes / 3e12, 2e-6))))
    row["iters"] = iters
    gen = torch.Generator(device=device).manual_seed(1)
    query = torch.randn(batch, heads, dim, device=device, dtype=dtype, generator=gen)
    k_pool, v_pool, tables, num_blocks = make_pools(batch, ctx, kv_heads, dim, block_size, dtype, device)
    full = torch.full((batch,), ctx - 1, dtype=torch.int64, device=device)
    ragged = torch.randint(0, ctx, (batch,), generator=gen, device=device)
    pa.register()
    op = torch.ops.copt.paged_decode_attention.default

    with torch.no_grad():
        out = op(query, k_pool, v_pool, tables, full, num_blocks, scale)
        row["op_us"], row["op_mode"] = time_call(lambda: op(query, k_pool, v_pool, tables, full, num_blocks, scale),
                                                 device, iters)
        row["op_tb_s"] = kv_bytes / (row["op_us"] / 1e6) / 1e12
        row["op_of_copy_bw"] = kv_bytes / (row["op_us"] / 1e6) / COPY_BW
        if device == "cuda" and pa.triton_available():
            sms = pa._sm_count(query.device)
            row["splits_chosen"] = pa.choose_splits(batch, kv_heads, num_blocks * block_size, sms)
            if batch <= args.sweep_max_batch:  # per-call time at fixed split counts (tunes MIN_SPLIT_TOKENS)
                row["splits_sweep_us"] = {
                    s: time_call(lambda s=s: pa.triton_paged_decode_attention(
                        query, k_pool, v_pool, tables, full, num_blocks, scale, num_splits=s), device, iters)[0]
                    for s in (1, 2, 4, 8, 16, 32, 64) if s <= num_blocks}
        row["op_ragged_us"], _ = time_call(
            lambda: op(query, k_pool, v_pool, tables, ragged, num_blocks, scale), device, iters)
        if args.fp8 and hasattr(torch, "float8_e4m3fn"):
            try:
                k8, v8 = k_pool.to(torch.float8_e4m3fn), v_pool.to(torch.float8_e4m3fn)
                out8 = op(query, k8, v8, tables, full, num_blocks, scale)
                row["op_fp8_us"], _ = time_call(lambda: op(query, k8, v8, tables, full, num_blocks, scale), device,
                                                iters)
                ref8 = pa.reference_paged_decode_attention(query[:1], k8, v8, tables[:1], full[:1], num_blocks, scale)
                row["op_fp8_max_err_row0"] = float((out8[:1].float() - ref8.float()).abs().max())
                k8 = v8 = out8 = None
            except Exception as exc:  # noqa: BLE001
                row["op_fp8_error"] = f"{type(exc).__name__}: {exc}"[:300]

        gather_bytes = 2 * batch * num_blocks * block_size * kv_heads * dim * 4 * 2  # float32 gathers + their views
        if gather_bytes < 0.8 * free_bytes(device):
            try:
                row["gather_us"], _ = time_call(lambda: pa.reference_paged_decode_attention(
                    query, k_pool, v_pool, tables, full, num_blocks, scale), device, max(5, iters // 4))
            except (RuntimeError, MemoryError):  # torch.cuda.OutOfMemoryError is a RuntimeError
                row["gather_us"] = None
                row["gather_skipped"] = "out of memory"
        else:
            row["gather_skipped"] = "does not fit"
        if device == "cuda":
            torch.cuda.empty_cache()

        # today's slot cache: [B, KVH, C, D] contiguous, the bucket masked by position
        k_cache = k_pool[tables.long()].reshape(batch, num_blocks * block_size, kv_heads, dim)[:, :ctx]
        k_cache = k_cache.permute(0, 2, 1, 3).contiguous()
        k_pool = None  # free the pool before the second copy
        v_cache = v_pool[tables.long()].reshape(batch, num_blocks * block_size, kv_heads, dim)[:, :ctx]
        v_cache = v_cache.permute(0, 2, 1, 3).contiguous()
        v_pool = None
        mask = (torch.arange(ctx, device=device)[None, :] <= full[:, None])[:, None, None, :]
        q4 = query.reshape(batch, kv_heads, groups, dim)

        def sdpa():
            return F.scaled_dot_product_attention(q4, k_cache, v_cache, attn_mask=mask, scale=scale)

        def math_attention():
            scores = torch.matmul(q4, k_cache.transpose(-1, -2)).float() * scale
            probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1).to(v_cache.dtype)
            return torch.matmul(probs, v_cache)

        expected = sdpa().reshape(batch, heads, dim)
        row["op_max_abs_err_vs_sdpa"] = float((out.float() - expected.float()).abs().max())
        row["sdpa_us"], row["sdpa_mode"] = time_call(sdpa, device, iters)
        try:
            row["math_us"], _ = time_call(math_attention, device, iters)
        except Exception as exc:  # noqa: BLE001 - the float32 scores of a big batch may not fit
            row["math_us"], row["math_error"] = None, f"{type(exc).__name__}"[:100]
        row["speedup_vs_sdpa"] = row["sdpa_us"] / row["op_us"]
    return row


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def compile_check(device: str, args) -> dict:
    """The op inside a compiled (dynamic=True, fullgraph) function, against eager at two batch sizes, replayed as a
    CUDA graph; whether torch's triton mutation analysis fell back to cloning all inputs (a full K/V pool copy)."""
    import torch

    from clusteropt_cli.core.serve import paged_attention as pa

    pa.register()
    capture = _Capture()
    logging.getLogger("torch._higher_order_ops.triton_kernel_wrap").addHandler(capture)
    heads, kv_heads, dim = (32, 8, 64) if not args.cpu_smoke else (8, 2, 32)
    result: dict = {}

    def layer(query, k_pool, v_pool, tables, positions, num_blocks: int):
        out = pa.paged_decode_attention(query * 1.0, k_pool, v_pool, tables, positions, num_blocks, dim**-0.5)
        return out + 1.0

    try:
        compiled = torch.compile(layer, dynamic=True, fullgraph=True)
        errs = []
        for batch in (3, 17):
            k_pool, v_pool, tables, num_blocks = make_pools(batch, 300, kv_heads, dim, 16, torch.bfloat16, device)
            query = torch.randn(batch, heads, dim, device=device, dtype=torch.bfloat16)
            positions = torch.randint(0, 300, (batch,), device=device)
            with torch.no_grad():
                got = compiled(query, k_pool, v_pool, tables, positions, num_blocks)
                want = layer(query, k_pool, v_pool, tables, positions, num_blocks)
                errs.append(float((got.float() - want.float()).abs().max()))
                result["graph_us"], result["graph_mode"] = time_call(
                    lambda: compiled(query, k_pool, v_pool, tables, positions, num_blocks), device, 20)  # noqa: B023
        result["max_abs_err_vs_eager"] = max(errs)
        result["ok"] = max(errs) < 5e-2 and result["graph_mode"] in ("cuda-graph", "eager-cpu")
    except Exception as exc:  # noqa: BLE001 - reported, not fatal to the timing table
        result["ok"] = False
        result["error"] = f"{type(exc).__name__}: {exc}"[:500]
        traceback.print_exc()
    result["mutation_analysis_fell_back"] = any("assuming every input is mutated" in m for m in capture.messages)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON results file")
    parser.add_argument("--shapes", default="1b,8b", help="comma list of 1b, 8b")
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--contexts", default="512,2048,8192,32768")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=200, help="replays per timing (fewer for the largest cases)")
    parser.add_argument("--target-s", type=float, default=0.3, help="aim for about this long per timing")
    parser.add_argument("--sweep-max-batch", type=int, default=8,
                        help="time fixed split counts 1..64 for batches up to this (0: no sweep)")
    parser.add_argument("--no-fp8", dest="fp8", action="store_false", help="skip the FP8-pool timing")
    parser.add_argument("--no-compile-check", dest="compile_check", action="store_false")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU (checks the script)")
    args = parser.parse_args()

    import torch

    device = "cuda" if torch.cuda.is_available() and not args.cpu_smoke else "cpu"
    if device == "cpu" and not args.cpu_smoke:
        parser.error("no CUDA device: run on a GPU, or pass --cpu-smoke")
    if args.cpu_smoke:
        args.batches, args.contexts, args.iters = "1,3", "40,100", 3
    from clusteropt_cli.core.serve import paged_attention as pa

    info = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__,
            "triton": pa.triton_available() and __import__("triton").__version__, "kernel": device == "cuda"
            and pa.triton_available(), "block_n": pa.BLOCK_N, "min_split_tokens": pa.MIN_SPLIT_TOKENS}
    rows = []
    for shape in args.shapes.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            for ctx in (int(c) for c in args.contexts.split(",")):
                log(f"{shape} B={batch} C={ctx}")
                try:
                    rows.append(run_config(shape, batch, ctx, args, device))
                except Exception as exc:  # noqa: BLE001 - one failed case must not lose the others
                    traceback.print_exc()
                    rows.append({"shape": shape, "batch": batch, "context": ctx,
                                 "error": f"{type(exc).__name__}: {exc}"[:500]})
                if device == "cuda":
                    torch.cuda.empty_cache()
    compiled = compile_check(device, args) if args.compile_check else None
    result = {"info": info, "rows": rows, "compile": compiled}
    tmp = args.out.with_suffix(args.out.suffix + ".tmp")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(args.out)

    def fmt(v, spec=".1f"):
        return "-" if v is None else format(v, spec)

    print(f"{'shape':5} {'B':>4} {'ctx':>6} {'op µs':>9} {'TB/s':>5} {'ragged':>9} {'fp8':>9} {'sdpa µs':>9} "
          f"{'math µs':>9} {'gather µs':>10} {'x sdpa':>6} {'err':>8}")
    for r in rows:
        if "skipped" in r or "error" in r:
            print(f"{r['shape']:5} {r['batch']:>4} {r['context']:>6} {r.get('skipped') or r.get('error')[:80]}")
            continue
        print(f"{r['shape']:5} {r['batch']:>4} {r['context']:>6} {fmt(r['op_us']):>9} {fmt(r['op_tb_s'], '.2f'):>5} "
              f"{fmt(r['op_ragged_us']):>9} {fmt(r.get('op_fp8_us')):>9} {fmt(r['sdpa_us']):>9} "
              f"{fmt(r.get('math_us')):>9} {fmt(r.get('gather_us')):>10} {fmt(r['speedup_vs_sdpa'], '.2f'):>6} "
              f"{fmt(r['op_max_abs_err_vs_sdpa'], '.1e'):>8}")
    if compiled is not None:
        print(f"compiled (dynamic, fullgraph) + CUDA graph: {json.dumps(compiled)}")
    print(f"wrote {args.out}")
    if any("error" in r for r in rows) or (compiled is not None and not compiled.get("ok")):
        sys.exit(1)


if __name__ == "__main__":
    main()
