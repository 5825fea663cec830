"""Paged decode attention: one query token per sequence against K/V held in a pool of fixed-size blocks.

    paged_decode_attention(query, k_pool, v_pool, block_tables, positions, num_blocks, scale) -> [B, H, D]

query [B, H, D] (H = KVH * G: grouped-query attention); k_pool/v_pool [NB, BS, KVH, D] in query's dtype or
float8_e4m3fn (an FP8 KV cache, converted exactly for the math, no scale); block_tables [R >= B, MB] int32/int64
(row b's logical block j is physical block block_tables[b, j]); positions [B] int64: row b attends keys
0..positions[b] (its new key/value is already in the pool). Only table columns < num_blocks are read, and a row reads
only the blocks it needs (positions[b] // BS + 1). A row with positions[b] >= num_blocks * BS (a scratch row the
caller ignores) attends the first num_blocks * BS keys: no out-of-bounds read, the output is not meaningful. Physical
block ids outside the pool are clamped into it. Softmax in float32; returns query's dtype.

The op is `torch.ops.copt.paged_decode_attention`, a `torch.library.triton_op`: torch.compile (inductor, dynamic
shapes) sees through it, and the CUDA path launches only kernels (no host synchronisation), so it captures into CUDA
graphs. On CUDA with triton it runs the flash-decoding kernels of paged_attention_kernels.py (split-K over the
sequence, the splits chosen from the batch, the KV heads and the bucket so a batch of one still fills the GPU);
elsewhere (CPU, or no triton) the reference below: gather the table's blocks, mask, softmax.

Nothing here imports torch or triton at module level (`copt --help` stays light). `register()` defines the op once;
`paged_decode_attention` calls it, but a caller that compiles a function using the op with fullgraph=True should call
`register()` before compiling (defining an operator cannot be traced).
"""

import math
import os
from typing import Any

OP_NAME = "copt::paged_decode_attention"
# stage-1 tile: tokens of one sequence per inner-loop step (spans pages when the block size is smaller)
BLOCK_N = 64
# one split handles at least this many keys (one stage-1 tile; bench/paged_attention.py's split sweep on the H200,
# batch 1: 64 keys per split was fastest at 512 keys, 6.5 µs against 9.8 µs for 256 keys per split)
MIN_SPLIT_TOKENS = 64
MAX_SPLITS = 64
# programs per streaming multiprocessor that stage 1 aims for
PROGRAMS_PER_SM = 2

_OP: Any = None
_SM_COUNT: dict[int, int] = {}
# the Triton kernels (paged_attention_kernels.py), loaded by load_kernels(): module globals, so that torch finds them
# in the op's source (torch._library.triton.get_inner_triton_kernels keys its compile caches on their source)
paged_decode_stage1: Any = None
paged_decode_stage2: Any = None


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install: the reference serves
        return False
    return True


def load_kernels() -> None:
    """Import the Triton kernels into this module (needs triton)."""
    global paged_decode_stage1, paged_decode_stage2
    if paged_decode_stage1 is None:
        from clusteropt_cli.core.serve import paged_attention_kernels as kernels

        paged_decode_stage1, paged_decode_stage2 = kernels.paged_decode_stage1, kernels.paged_decode_stage2


def reference_paged_decode_attention(query, k_pool, v_pool, block_tables, positions, num_blocks: int, scale: float):
    """The op in plain tensor ops (the CPU path and the check of the kernels): gather the row's first num_blocks
    table blocks into [B, num_blocks * BS, KVH, D], mask keys past positions[b], softmax in float32."""
    import torch

    batch, heads, dim = query.shape
    pool_blocks, block_size, kv_heads, _ = k_pool.shape
    groups = heads // kv_heads
    cap = num_blocks * block_size
    table = block_tables[:batch, :num_blocks].long().clamp(0, pool_blocks - 1)
    keys = k_pool[table].reshape(batch, cap, kv_heads, dim).float()
    values = v_pool[table].reshape(batch, cap, kv_heads, dim).float()
    q = query.float().reshape(batch, kv_heads, groups, dim)
    scores = torch.matmul(q, keys.permute(0, 2, 3, 1)) * scale  # [B, KVH, G, cap]
    last = positions.clamp(0, cap - 1)
    visible = torch.arange(cap, device=query.device)[None, :] <= last[:, None]  # [B, cap]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1)
    out = torch.matmul(probs, values.permute(0, 2, 1, 3))  # [B, KVH, G, D]
    return out.reshape(batch, heads, dim).to(query.dtype)


def _sm_count(device) -> int:
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def choose_splits(batch, kv_heads: int, cap: int, sm_count: int):
    """Splits of each sequence's keys in stage 1: enough programs (batch * kv_heads * splits) to give every SM
    PROGRAMS_PER_SM of them, but no split shorter than MIN_SPLIT_TOKENS of the bucket and at most MAX_SPLITS. `batch`
    and `cap` may be symbolic (torch.compile, dynamic shapes): sym_min/sym_max keep the choice an expression instead
    of a guard."""
    import torch

    want = (sm_count * PROGRAMS_PER_SM + batch * kv_heads - 1) // (batch * kv_heads)
    by_length = torch.sym_max(1, (cap + MIN_SPLIT_TOKENS - 1) // MIN_SPLIT_TOKENS)
    return torch.sym_max(1, torch.sym_min(torch.sym_min(want, by_length), MAX_SPLITS))


def _is_one(value) -> bool:
    """True only when value is statically 1 (a plain int, or a symbol known to be 1); never adds a guard."""
    if isinstance(value, int):
        return value == 1
    try:
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return bool(statically_known_true(value == 1))
    except Exception:
        return False


def triton_paged_decode_attention(query, k_pool, v_pool, block_tables, positions, num_blocks: int, scale: float,
                                  num_splits=None):
    """Launch the Triton kernels (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1). num_splits: the stage-1
    split count (default: choose_splits)."""
    import torch
    from torch.library import wrap_triton

    load_kernels()
    batch = query.shape[0]
    # model constants become kernel constexprs (a symbolic size here is specialised: one compile per model)
    heads, dim = int(query.shape[1]), int(query.shape[2])
    pool_blocks, block_size, kv_heads = k_pool.shape[0], int(k_pool.shape[1]), int(k_pool.shape[2])
    groups = heads // kv_heads
    cap = num_blocks * block_size
    if query.stride(-1) != 1:
        query = query.contiguous()
    if k_pool.stride(-1) != 1:
        k_pool = k_pool.contiguous()
    if v_pool.stride(-1) != 1:
        v_pool = v_pool.contiguous()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    if positions.stride(0) != 1:
        positions = positions.contiguous()
    if num_splits is None:
        sm_count = _sm_count(query.device) if query.device.type == "cuda" else 8
        num_splits = choose_splits(batch, kv_heads, cap, sm_count)
    out = torch.empty((batch, heads, dim), dtype=query.dtype, device=query.device)
    if isinstance(batch, int) and batch == 0:
        return out
    block_d = triton_next_power_of_2(dim)
    block_g = max(16, triton_next_power_of_2(groups))
    single = _is_one(num_splits)
    if single:
        mid_o = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=query.device)
        mid_lse = torch.empty((1, 1, 1), dtype=torch.float32, device=query.device)
    else:
        mid_o = torch.empty((batch, heads, num_splits, dim), dtype=torch.float32, device=query.device)
        mid_lse = torch.empty((batch, heads, num_splits), dtype=torch.float32, device=query.device)
    # the interpreter (TRITON_INTERPRET=1, CPU tests) runs tl.dot through numpy, which mishandles bfloat16
    f32_dot = query.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
    if os.environ.get("TRITON_INTERPRET") == "1":  # interpreted kernels launch directly (older torch refuses to wrap)
        stage1, stage2 = paged_decode_stage1, paged_decode_stage2
    else:
        stage1, stage2 = wrap_triton(paged_decode_stage1), wrap_triton(paged_decode_stage2)
    stage1[(batch, kv_heads, num_splits)](
        query, k_pool, v_pool, block_tables, positions, out, mid_o, mid_lse,
        query.stride(0), query.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        cap, pool_blocks, num_splits, scale,
        G=groups, HEAD_DIM=dim, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=BLOCK_N, PAGE=block_size,
        SINGLE=single, F32_DOT=f32_dot, num_warps=4, num_stages=2,
    )
    if not single:
        # a compiled decode step's batch is symbolic, so one split (every batch of 33 rows or more on 8 KV heads and
        # 132 SMs) is known only at run time: stage 1 then writes the output and stage 2's grid is empty (a launch
        # of no programs is skipped, in a CUDA graph too), instead of a merge pass over the batch per layer
        merge_rows = batch * torch.sym_min(num_splits - 1, 1)
        stage2[(merge_rows, heads)](
            mid_o, mid_lse, positions, out,
            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
            out.stride(0), out.stride(1),
            cap, num_splits,
            HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_N=BLOCK_N, num_warps=4,
        )
    return out


def triton_next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 2 ** math.ceil(math.log2(n))


def register():
    """Define torch.ops.copt.paged_decode_attention once (idempotent); returns the op."""
    global _OP
    if _OP is not None:
        return _OP
    import torch
    from torch.library import triton_op

    use_triton = triton_available()
    if use_triton:
        load_kernels()

    def paged_decode_attention_impl(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                                    block_tables: torch.Tensor, positions: torch.Tensor, num_blocks: int,
                                    scale: float) -> torch.Tensor:
        if use_triton and query.device.type == "cuda":
            return triton_paged_decode_attention(query, k_pool, v_pool, block_tables, positions, num_blocks, scale)
        return reference_paged_decode_attention(query, k_pool, v_pool, block_tables, positions, num_blocks, scale)

    triton_op(OP_NAME, mutates_args=())(paged_decode_attention_impl)
    _OP = torch.ops.copt.paged_decode_attention.default
    return _OP


def check_inputs(query, k_pool, v_pool, block_tables, positions, num_blocks: int) -> None:
    """Shape/dtype checks (ValueError), run by paged_decode_attention outside torch.compile; the op itself trusts
    its inputs so it stays traceable."""
    import torch

    if query.dim() != 3 or k_pool.dim() != 4 or k_pool.shape != v_pool.shape:
        raise ValueError(f"query must be [B, H, D] and k_pool/v_pool [NB, BS, KVH, D] alike; got {tuple(query.shape)}"
                         f", {tuple(k_pool.shape)}, {tuple(v_pool.shape)}")
    batch, heads, dim = query.shape
    _, block_size, kv_heads, pool_dim = k_pool.shape
    if pool_dim != dim or heads % kv_heads:
        raise ValueError(f"head dim {dim} vs pool {pool_dim}; {heads} query heads not a multiple of {kv_heads}")
    if block_size & (block_size - 1):
        raise ValueError(f"block size {block_size} is not a power of two")
    if k_pool.dtype not in (query.dtype, torch.float8_e4m3fn) or v_pool.dtype != k_pool.dtype:
        raise ValueError(f"pool dtype {k_pool.dtype}/{v_pool.dtype} with query {query.dtype}")
    if block_tables.dim() != 2 or block_tables.shape[0] < batch or block_tables.dtype not in (torch.int32,
                                                                                             torch.int64):
        raise ValueError(f"block_tables must be int32/int64 [R >= {batch}, MB]; got {block_tables.dtype} "
                         f"{tuple(block_tables.shape)}")
    if not 1 <= num_blocks <= block_tables.shape[1]:
        raise ValueError(f"num_blocks {num_blocks} outside 1..{block_tables.shape[1]} (table columns)")
    if positions.shape != (batch,):
        raise ValueError(f"positions must be [{batch}]; got {tuple(positions.shape)}")


def paged_decode_attention(query, k_pool, v_pool, block_tables, positions, num_blocks: int, scale: float):
    """query [B, H, D] against the paged pools → [B, H, D] in query's dtype (see the module docstring)."""
    op = _OP
    if op is None:
        import torch

        if torch.compiler.is_compiling():
            raise RuntimeError("paged_decode_attention: call clusteropt_cli.core.serve.paged_attention.register() "
                               "before torch.compile traces a function that uses it (an operator cannot be defined "
                               "while tracing)")
        op = register()
    import torch

    if not torch.compiler.is_compiling():
        check_inputs(query, k_pool, v_pool, block_tables, positions, num_blocks)
    return op(query, k_pool, v_pool, block_tables, positions, num_blocks, scale)
