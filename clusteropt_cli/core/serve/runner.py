"""The model side of the engine: a transformers causal LM run with copt's own KV cache (paged or slots).

The model code is transformers' own; only attention is ours. We register an attention function
(`copt_slots`) in transformers' `AttentionInterface`, so every layer hands us its rotated query/key/value
and we (1) write key/value into the cache and (2) attend over the sequence's cached prefix. The paged cache
(`allocate_paged`) is one pool of blocks per layer plus a block table per row (BlockTables); the slot cache
(`allocate`) one `max_len` slot per row. Either way:

* packed steps: the tokens of several sequences (prefill chunks, speculative verification windows) are
  concatenated into one `[1, T]` row; each segment attends causally to its own slot only;
* decode steps: `[B, 1]` with row i = slot i for slots 0..B-1 (slots not decoding write a scratch column, or the
  scratch block, and are ignored), so attention reads the cache in place (paged: a Triton kernel follows the block
  tables); static shapes, so that on CUDA a step is captured once per slot-count (and context-length) bucket and
  replayed as a CUDA graph. Slots are handed out lowest first.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

ATTN_NAME = "copt_slots"


@dataclass
class Segment:
    """A run of consecutive tokens of one sequence inside a packed step."""

    slot: int
    start: int  # position of the first token (= tokens already in the slot's cache)
    length: int
    offset: int  # where the segment starts in the packed row


@dataclass
class StepContext:
    """What the attention function needs for one forward: the caches and the layout of the step."""

    caches: list[tuple[Any, Any]]
    mode: str  # "packed", "decode" or "fresh" (a captured prefill of segments starting at 0: PrefillGraph)
    segments: list[Segment] = field(default_factory=list)
    masks: list[Any] = field(default_factory=list)  # packed: per-segment bool mask or None (pure causal)
    slot_ids: Any = None  # decode: [B] long, arange(B) (row i is slot i)
    positions: Any = None  # decode: [B] long (the scratch column for rows whose slot is not decoding)
    mask: Any = None  # decode: [B, 1, 1, L] bool (None with flex decode attention); fresh: [1, 1, T, T] bool
    kv_len: int = 0  # decode: L, the context bucket
    # decode: "sdpa" (masked SDPA), "flex" (FlexAttention over the bucket) or "math" (plain tensor ops: two small
    # matmuls around a masked softmax that inductor fuses)
    attention: str = "sdpa"
    window_masks: dict[int, Any] = field(default_factory=dict)  # decode: sliding window → [B, 1, 1, L] bool
    scratch_pos: int = 0  # decode: the position rows of slots that are not decoding carry
    # decode, paged kernel: positions with those rows at 0, so that they read one key (their output is not used)
    attend_positions: Any = None
    # paged KV cache (caches are block pools [blocks + 1, block_size, KVH, D]; the last block is the scratch block)
    paged: bool = False
    block_tables: Any = None  # [rows + 1, max blocks] long: row r's logical block j is physical block [r, j]
    write_block: Any = None  # [tokens] long: the block each token of the step is written to
    write_offset: Any = None  # [tokens] long: its place in that block
    read_blocks: list[Any] = field(default_factory=list)  # packed: per segment, the blocks it attends over
    # packed, paged, with a variable-length attention kernel (ModelRunner.varlen): (kernel, cu_seq_q, cu_seq_k,
    # max_q, max_k) — every segment attends in one call per layer instead of one SDPA per segment
    varlen: Any = None
    # fresh (a captured variable-length prefill, PrefillGraph with a kernel): [keys] long, each segment's keys' places
    # in the pool flattened to [blocks × block_size] (cached ones and this step's), in cu_seq_k's order
    key_index: Any = None


def _slot_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, copt_step=None,
                    **kwargs):
    """transformers attention interface: query [B, H, T, D], key/value [B, KVH, T, D] → ([B, T, H, D], None)."""
    import torch

    step: StepContext = copt_step
    if step is None:
        raise RuntimeError("copt_slots attention needs the copt engine's step context (copt_step=...)")
    k_cache = getattr(module, "copt_k_cache", None)  # set by ModelRunner.allocate (a module buffer: compiles once)
    if k_cache is None:
        k_cache, v_cache = step.caches[module.layer_idx]
    else:
        v_cache = module.copt_v_cache
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        from clusteropt_cli.core.serve.attention import check_layer_kwargs

        check_layer_kwargs(module, kwargs)
    if getattr(module, "copt_window", None) is not None or getattr(module, "copt_softcap", None) is not None:
        from clusteropt_cli.core.serve.attention import windowed_slot_attention

        return windowed_slot_attention(module, query, key, value, step, k_cache, v_cache, scaling), None
    if step.mode == "fresh":
        return _fresh_attention(query, key, value, step, k_cache, v_cache, scaling), None
    if step.paged:
        return _paged_attention(query, key, value, step, k_cache, v_cache, scaling), None
    num_heads, kv_heads = query.shape[1], key.shape[1]
    if step.mode == "decode":
        # slot-major: row i is slot i, so the cache is attended in place (a view, no per-step gather of K/V)
        batch = query.shape[0]
        k_cache[step.slot_ids, :, step.positions] = key[:, :, 0]
        v_cache[step.slot_ids, :, step.positions] = value[:, :, 0]
        keys = k_cache[:batch, :, : step.kv_len]
        values = v_cache[:batch, :, : step.kv_len]
        return _decode_attend(query, keys, values, step, scaling), None

    groups = num_heads // kv_heads
    outs = []
    for seg, mask in zip(step.segments, step.masks, strict=True):
        end = seg.start + seg.length
        sl = slice(seg.offset, seg.offset + seg.length)
        k_cache[seg.slot, :, seg.start : end] = key[0, :, sl]
        v_cache[seg.slot, :, seg.start : end] = value[0, :, sl]
        keys = k_cache[seg.slot : seg.slot + 1, :, :end]
        values = v_cache[seg.slot : seg.slot + 1, :, :end]
        outs.append(_segment_attend(query[:, :, sl], keys, values, mask, groups, scaling))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2), None


def _decode_attend(query, keys, values, step: StepContext, scaling):
    """One query per sequence over its context bucket: query [B, H, 1, D], keys/values [B, KVH, L, D] (any strides)
    → [B, 1, H, D], by the step's decode attention (flex, math or masked SDPA)."""
    import torch
    import torch.nn.functional as F

    if step.attention == "flex":
        return _flex_decode(query, keys, values, step.positions, scaling)
    batch, num_heads, head_dim = query.shape[0], query.shape[1], query.shape[-1]
    kv_heads = keys.shape[1]
    # fold the GQA group into the query-length axis (no K/V repeat needed)
    q = query.reshape(batch, kv_heads, num_heads // kv_heads, head_dim)
    if step.attention == "math":
        scale = scaling if scaling is not None else head_dim**-0.5
        scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale  # [B, KVH, G, L]
        probs = scores.masked_fill(~step.mask, float("-inf")).softmax(dim=-1).to(values.dtype)
        out = torch.matmul(probs, values)
    else:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=step.mask, scale=scaling)
    return out.reshape(batch, num_heads, 1, head_dim).transpose(1, 2)


def _segment_attend(q, keys, values, mask, groups: int, scaling):
    """A packed segment's queries [1, H, T, D] over its sequence's keys/values [1, KVH, L, D]: causal (mask None, a
    segment starting at position 0) or under its mask."""
    import torch.nn.functional as F

    if groups > 1:
        keys = keys.repeat_interleave(groups, dim=1)
        values = values.repeat_interleave(groups, dim=1)
    if mask is None:
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scaling)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling)


def _pool_write(pool, block, offset, values) -> None:
    """pool[block, offset] = values (cast to the pool's dtype; FP8 pools are written as bytes). An indexed
    assignment on the pool itself, as the slot cache does: compiled, it stays an in-place scatter (an index_copy_
    of a reshaped view was functionalized into a copy of the whole pool per layer and step)."""
    import torch

    if pool.dtype == torch.float8_e4m3fn:
        pool.view(torch.uint8)[block, offset] = values.to(pool.dtype).view(torch.uint8)
    else:
        pool[block, offset] = values.to(pool.dtype)


def _pool_read(pool, blocks, dtype):
    """pool[blocks] in `dtype` (blocks: an index tensor of any shape)."""
    import torch

    if pool.dtype == torch.float8_e4m3fn:
        return pool.view(torch.uint8)[blocks].view(pool.dtype).to(dtype)
    return pool[blocks].to(dtype)


def _paged_attention(query, key, value, step: StepContext, k_pool, v_pool, scaling):
    """Attention over a paged cache: write this step's keys/values where the block tables say, then attend each
    sequence over its own blocks. query [B, H, T, D], key/value [B, KVH, T, D] → [B, T, H, D]."""
    import torch

    num_heads, head_dim = query.shape[1], query.shape[-1]
    kv_heads = key.shape[1]
    block_size = k_pool.shape[1]
    if step.mode == "decode":
        batch = query.shape[0]
        _pool_write(k_pool, step.write_block, step.write_offset, key[:, :, 0])
        _pool_write(v_pool, step.write_block, step.write_offset, value[:, :, 0])
        if step.attention == "paged":  # the fused kernel reads the blocks in place (paged_attention.py)
            from clusteropt_cli.core.serve.paged_attention import paged_decode_attention

            scale = scaling if scaling is not None else head_dim**-0.5
            positions = step.positions if step.attend_positions is None else step.attend_positions
            out = paged_decode_attention(query[:, :, 0], k_pool, v_pool, step.block_tables, positions,
                                         step.kv_len // block_size, scale)
            return out[:, None]
        blocks = step.block_tables[:batch, : step.kv_len // block_size]
        keys = _pool_read(k_pool, blocks, query.dtype).view(batch, step.kv_len, kv_heads, head_dim).transpose(1, 2)
        values = _pool_read(v_pool, blocks, query.dtype).view(batch, step.kv_len, kv_heads, head_dim).transpose(1, 2)
        return _decode_attend(query, keys, values, step, scaling)

    groups = num_heads // kv_heads
    _pool_write(k_pool, step.write_block, step.write_offset, key[0].transpose(0, 1))
    _pool_write(v_pool, step.write_block, step.write_offset, value[0].transpose(0, 1))
    if step.varlen is not None:
        return _varlen_attention(query, key, value, step, k_pool, v_pool, scaling)
    outs = []
    for seg, mask, blocks in zip(step.segments, step.masks, step.read_blocks, strict=True):
        end = seg.start + seg.length
        span = blocks.shape[0] * block_size
        keys = _pool_read(k_pool, blocks, query.dtype).view(span, kv_heads, head_dim)[:end].transpose(0, 1)[None]
        values = _pool_read(v_pool, blocks, query.dtype).view(span, kv_heads, head_dim)[:end].transpose(0, 1)[None]
        q = query[:, :, seg.offset : seg.offset + seg.length]
        outs.append(_segment_attend(q, keys, values, mask, groups, scaling))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2)


def _varlen_attention(query, key, value, step: StepContext, k_pool, v_pool, scaling):
    """A packed paged step's attention in one variable-length kernel call: queries [T, H, D] of every segment,
    keys/values [sum of (start + length), KVH, D] — a segment that starts at position 0 attends to this step's own
    keys, one that continues a sequence (a later prompt chunk, a prefix-cache hit, a speculative window) to its
    blocks read from the pool (this step's keys already written) —, causal aligned to the end of each segment's
    keys (query i of a segment sees the keys up to its own position). → [1, T, H, D]."""
    import torch

    kernel, cu_q, cu_k, max_q, max_k = step.varlen
    head_dim, kv_heads = key.shape[-1], key.shape[1]
    block_size = k_pool.shape[1]
    own_k, own_v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, KVH, D]
    if all(seg.start == 0 for seg in step.segments):
        keys, values = own_k, own_v
    else:
        k_parts, v_parts = [], []
        for seg, blocks in zip(step.segments, step.read_blocks, strict=True):
            if seg.start == 0:
                k_parts.append(own_k[seg.offset : seg.offset + seg.length])
                v_parts.append(own_v[seg.offset : seg.offset + seg.length])
                continue
            end, span = seg.start + seg.length, blocks.shape[0] * block_size
            k_parts.append(_pool_read(k_pool, blocks, query.dtype).view(span, kv_heads, head_dim)[:end])
            v_parts.append(_pool_read(v_pool, blocks, query.dtype).view(span, kv_heads, head_dim)[:end])
        keys, values = torch.cat(k_parts), torch.cat(v_parts)
    out = kernel(query[0].transpose(0, 1), keys, values, cu_q, cu_k, max_q, max_k, scaling)
    return out[None]


def flash_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scaling):
    """FlashAttention-2's variable-length forward (PyTorch's own build): q [Tq, H, D], k/v [Tk, KVH, D] (grouped
    heads natively), cu_q/cu_k int32 [segments + 1], causal aligned bottom-right → [Tq, H, D]."""
    import torch

    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False,
                                                   scale=scaling)[0]


def reference_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scaling):
    """flash_varlen's result by one SDPA per segment under an explicit mask (any device and dtype): the check
    flash_varlen passes before the runner uses it, and the CPU tests' stand-in."""
    import torch
    import torch.nn.functional as F

    groups = q.shape[1] // k.shape[1]
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    outs = []
    for i in range(len(bounds_q) - 1):
        qs = q[bounds_q[i] : bounds_q[i + 1]].transpose(0, 1)[None]
        ks = k[bounds_k[i] : bounds_k[i + 1]].transpose(0, 1)[None]
        vs = v[bounds_k[i] : bounds_k[i + 1]].transpose(0, 1)[None]
        n_q, n_k = qs.shape[2], ks.shape[2]
        mask = torch.arange(n_k, device=q.device)[None, :] <= torch.arange(n_q, device=q.device)[:, None] + n_k - n_q
        if groups > 1:
            ks, vs = ks.repeat_interleave(groups, dim=1), vs.repeat_interleave(groups, dim=1)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scaling)[0].transpose(0, 1))
    return torch.cat(outs)


def varlen_kernel_for(device: Any, dtype: Any, num_heads: int, kv_heads: int, head_dim: int) -> tuple[Any, str]:
    """(flash_varlen, "") where it serves this model on this device and gives reference_varlen's result on a
    check with grouped heads, one segment from position 0 and one continuing a sequence; (None, why) otherwise."""
    import torch

    if device.type != "cuda":
        return None, "not on CUDA"
    if dtype not in (torch.float16, torch.bfloat16) or head_dim % 8 or head_dim > 256 or num_heads % kv_heads:
        return None, f"FlashAttention does not take {dtype} with head size {head_dim}"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return None, "FlashAttention needs compute capability 8.0"
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        lengths_q, lengths_k = [5, 3], [5, 9]  # the second segment: 3 new tokens after 6 cached ones
        q = torch.randn(sum(lengths_q), num_heads, head_dim, device=device, dtype=dtype, generator=gen)
        k = torch.randn(sum(lengths_k), kv_heads, head_dim, device=device, dtype=dtype, generator=gen)
        v = torch.randn(sum(lengths_k), kv_heads, head_dim, device=device, dtype=dtype, generator=gen)
        cu_q = torch.tensor([0, 5, 8], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, 5, 14], dtype=torch.int32, device=device)
        got = flash_varlen(q, k, v, cu_q, cu_k, 5, 9, head_dim**-0.5)
        want = reference_varlen(q.float(), k.float(), v.float(), cu_q, cu_k, 5, 9, head_dim**-0.5)
        error = (got.float() - want).abs().max().item()
    except Exception as exc:  # noqa: BLE001 - the per-segment path serves instead
        return None, f"{type(exc).__name__}: {exc}"
    if not error < 2e-2:
        return None, f"the variable-length kernel differs from the reference by {error:.3g}"
    return flash_varlen, ""


def _fresh_attention(query, key, value, step: StepContext, k_pool, v_pool, scaling):
    """A captured prefill step (PrefillGraph). The keys/values are written to their blocks (padding tokens to the
    scratch block); then, with a variable-length kernel (step.varlen), each segment attends to its keys gathered
    from the pool (step.key_index: a continued prompt's cached ones too); without, the segments all start at
    position 0 and every query attends to this step's own keys under step.mask [1, 1, T, T] (causal within its
    segment; None: one segment)."""
    _pool_write(k_pool, step.write_block, step.write_offset, key[0].transpose(0, 1))
    _pool_write(v_pool, step.write_block, step.write_offset, value[0].transpose(0, 1))
    if step.varlen is not None:  # every segment's keys read back from the pool (cached ones too), one kernel call
        kernel, cu_q, cu_k, max_q, max_k = step.varlen
        kv_heads, head_dim = key.shape[1], key.shape[-1]
        keys = k_pool.view(-1, kv_heads, head_dim).index_select(0, step.key_index).to(query.dtype)
        values = v_pool.view(-1, kv_heads, head_dim).index_select(0, step.key_index).to(query.dtype)
        return kernel(query[0].transpose(0, 1), keys, values, cu_q, cu_k, max_q, max_k, scaling)[None]
    # mask None: one segment (its padding after it: causal attention leaves the real tokens alone)
    return _segment_attend(query, key, value, step.mask, query.shape[1] // key.shape[1], scaling).transpose(1, 2)


def _flex_decode(query, keys, values, positions, scaling):
    """Decode attention through FlexAttention: row b attends its bucket up to positions[b] (a score_mod instead of
    the boolean mask, which confines SDPA to its memory-efficient kernel: 16.5 µs per layer at batch 1 on the H200,
    1B shape). Compiled, inductor emits its flex-decoding kernel; eager (CPU tests) runs the reference math.
    Returns [B, 1, H, D]."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    def keep_cached(score, b, h, q_idx, kv_idx):
        return torch.where(kv_idx <= positions[b], score, -float("inf"))

    out = flex_attention(query, keys, values, score_mod=keep_cached, enable_gqa=query.shape[1] != keys.shape[1],
                         scale=scaling)
    return out.transpose(1, 2)


_OWN_CODES = itertools.count()


def own_code(func: Any) -> Any:
    """A copy of a Python function with a code object of its own.

    Dynamo keeps its compiled entries, and counts them against `recompile_limit` (8), per code object. Compiling
    transformers' `LlamaDecoderLayer.forward` itself would share one cache among every engine of the process (tests,
    benchmarks, a server that reloads): each engine adds entries for its own model (parameter shapes, the fused
    projections' classes, decode attention kind), and once eight exist dynamo silently runs the layer EAGERLY —
    compiled_layers still says compiled, the flex decode path runs FlexAttention unfused (eager FlexAttention
    then fails inside a CUDA graph capture), the others just lose their fusion. One copy per runner keeps each engine's
    entries (a few: batch 1 and the dynamic batch per layer kind) to itself."""
    import types

    code = func.__code__
    code = code.replace(co_name=f"{code.co_name}_copt{next(_OWN_CODES)}")
    copy = types.FunctionType(code, func.__globals__, code.co_name, func.__defaults__, func.__closure__)
    copy.__kwdefaults__ = func.__kwdefaults__
    copy.__qualname__ = getattr(func, "__qualname__", code.co_name)
    copy.__dict__.update(getattr(func, "__dict__", {}))
    return copy


_SDPA_BACKENDS: list[Any] | None = None


def _sdpa_backends():
    """Flash / memory-efficient / math SDPA, never cuDNN.

    On Hopper with a recent cuDNN, torch puts cuDNN attention first, and cuDNN builds (tens of ms of host time)
    and caches an execution graph per distinct (batch, query length, key length): every packed prefill segment
    has its own length, so prefill would spend seconds building graphs. Flash/efficient kernels take any shape.
    """
    global _SDPA_BACKENDS
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if _SDPA_BACKENDS is None:
        _SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel(_SDPA_BACKENDS)


def register_attention() -> None:
    """Make `copt_slots` a valid transformers attention implementation (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _slot_attention)


def resolve_dtype_name(name: str, device: str, config_dtype: Any) -> str:
    """The engine's dtype as "bf16", "fp16" or "fp32": 'auto' keeps the checkpoint's half precision on GPU (bf16
    for fp32 checkpoints) and fp32 on CPU. Needs no torch (copt advise sizes the engine's KV cache with it)."""
    if name != "auto":
        return name
    if device == "cpu":
        return "fp32"
    stored = str(config_dtype or "").removeprefix("torch.")
    return {"bfloat16": "bf16", "float16": "fp16"}.get(stored, "bf16")


def resolve_dtype(name: str, device: str, config_dtype: Any):
    """The torch dtype of resolve_dtype_name."""
    import torch

    table = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    return table[resolve_dtype_name(name, device, config_dtype)]


def _length_buckets(max_len: int) -> list[int]:
    buckets, size = [], 128
    while size < max_len:
        buckets.append(size)
        size *= 2
    buckets.append(max_len)
    return buckets


def batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes decode graphs are captured for: 1, 2, 4, 8, then multiples of 16 up to max_batch."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    sizes += list(range(16, max_batch, 16))
    sizes.append(max_batch)
    return sorted(set(sizes))


class BlockTables:
    """Every row's block table, on the device (read by attention and by captured graphs in place) and mirrored on
    the host (where packed steps compute their write positions). Updates are queued and applied in one copy before
    the next forward (`flush`). A draft model's runner shares its target's tables (same blocks, own pools)."""

    def __init__(self, rows: int, max_blocks: int, scratch_block: int, device: Any):
        import torch

        self.scratch_block, self.max_blocks = scratch_block, max_blocks
        self.host = torch.full((rows + 1, max_blocks), scratch_block, dtype=torch.long)
        self.device = torch.full((rows + 1, max_blocks), scratch_block, dtype=torch.long, device=device)
        self._pending: list[tuple[int, int, int]] = []

    def set(self, row: int, first: int, blocks: list[int]) -> None:
        """Row `row`'s logical blocks first, first+1, ... are the physical `blocks`."""
        if first + len(blocks) > self.max_blocks:
            raise ValueError(f"a block table holds {self.max_blocks} blocks; asked for {first + len(blocks)}")
        for j, b in enumerate(blocks):
            self._pending.append((row, first + j, b))

    def clear(self, row: int) -> None:
        """Point the whole row at the scratch block (a finished sequence's stale entries are never read; this keeps
        tests and dumps readable and costs one copy)."""
        self._pending.append((row, -1, self.scratch_block))

    def flush(self) -> None:
        import torch

        if not self._pending:
            return
        whole = [(r, b) for r, c, b in self._pending if c < 0]
        cells = [(r, c, b) for r, c, b in self._pending if c >= 0]
        self._pending = []
        for r, b in whole:
            self.host[r].fill_(b)
            self.device[r].fill_(b)
        if cells:
            update = torch.tensor(cells, dtype=torch.long).t().contiguous()
            self.host[update[0], update[1]] = update[2]
            moved = update.to(self.device.device)
            self.device.index_put_((moved[0], moved[1]), moved[2])


def decode_compile_modes(compile_mode: str, device_type: str) -> tuple[str | None, str | None]:
    """torch.compile modes of the decode layers: (larger batches, batch 1). "auto" gives batch-1 steps (one
    matrix-vector product per weight, bound by memory bandwidth) inductor's autotuned kernels on CUDA — a Triton
    template where it reads faster than cuBLAS, the norms fused into the products — and keeps the default mode for
    larger batches, whose start-up would grow with every batch bucket."""
    mode = None if compile_mode in ("default", "auto") else compile_mode
    if compile_mode == "auto" and device_type == "cuda":
        return mode, "max-autotune-no-cudagraphs"
    return mode, mode


def compile_kwargs(mode: str | dict | None) -> dict:
    """torch.compile's keyword for a decode compile mode: a mode name, or a dict of inductor options."""
    return {"options": mode} if isinstance(mode, dict) else {"mode": mode}


class ModelRunner:
    """One model, its KV cache (a block pool with block tables, or `num_slots` × `max_len` slots) and its forward
    passes. Rows of a decode step are the engine's rows ("slots") in both layouts."""

    def __init__(self, model_path: str, *, device: str, dtype: str = "auto", num_slots: int | None, max_len: int | None,
                 cuda_graphs: bool = False, compile_decode: bool = False, compile_mode: str = "default",
                 decode_attention: str = "sdpa", trust_remote_code: bool = False):
        import torch
        from transformers import AutoConfig

        register_attention()
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.dtype = resolve_dtype(dtype, device, getattr(config, "dtype", None))
        self.device = torch.device(device)
        from clusteropt_cli.core.models import pretrained_causal_lm

        model = pretrained_causal_lm(model_path, dtype=self.dtype, attn_implementation="sdpa",
                                     trust_remote_code=trust_remote_code)
        model.to(self.device).eval()
        model.requires_grad_(False)
        # quantized checkpoints (compressed-tensors): FP8 layers on FP8 GEMMs, packed/int8 weights dequantized
        # (visibly) — transformers would do that in a hook on the top-level forward, which the engine never calls
        from clusteropt_cli.core.serve.quantized import prepare_quantized_model

        self.quantized = prepare_quantized_model(model, self.dtype)
        self.fp8_linears = self.quantized.fp8_linears
        self.fp8_kernels = self.quantized.fp8_kernels
        notice = self.quantized.notice(model_path, str(self.dtype).removeprefix("torch."))
        if notice:
            import sys

            print(notice, file=sys.stderr, flush=True)
        from clusteropt_cli.core.serve.fusion import fuse_projections

        self.fused_projections = fuse_projections(model)  # q/k/v and gate/up as one GEMM each
        self.max_len = int(max_len or min(int(getattr(text_config, "max_position_embeddings", 2048)), 4096))
        # per-layer sliding windows and soft-caps (the caller checked the architecture is native: runner_for)
        from clusteropt_cli.core.serve.architectures import apply_to_model, inspect_architecture

        self.architecture = inspect_architecture(config, self.max_len)
        if not self.architecture.native:
            raise RuntimeError(f"copt's slot attention cannot serve this model: {self.architecture.reason}")
        apply_to_model(model, self.architecture, self.max_len)
        from clusteropt_cli.core.serve.attention import RING_SLACK, ring_length

        modules = self._attention_modules_of(model)
        self.rings = [ring_length(getattr(m, "copt_window", None), self.max_len) for m in modules]
        self.rings += [None] * (int(text_config.num_hidden_layers) - len(self.rings))
        for module, ring in zip(modules, self.rings, strict=False):
            module.copt_ring = ring
        # with rings, one forward writes at most RING_SLACK tokens of a sequence (longer chunks are split)
        self.max_segment = RING_SLACK if any(self.rings) else None
        self.windows = sorted({(m.copt_window, m.copt_ring) for m in modules if m.copt_window is not None},
                              key=lambda wr: (wr[0], wr[1] or 0))
        self.final_softcap = self.architecture.final_softcap
        try:
            model.set_attn_implementation(ATTN_NAME)
        except Exception:  # noqa: BLE001 - older/custom models: set it on the config directly
            model.config._attn_implementation = ATTN_NAME
        for module in model.modules():
            cfg = getattr(module, "config", None)
            if cfg is not None and getattr(cfg, "_attn_implementation", ATTN_NAME) != ATTN_NAME:
                cfg._attn_implementation = ATTN_NAME
        self.model = model
        self.config = text_config
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.vocab_size = int(text_config.vocab_size)
        self.num_layers = int(text_config.num_hidden_layers)
        self.num_heads = int(text_config.num_attention_heads)
        self.kv_heads = int(getattr(text_config, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(text_config, "head_dim", None) or text_config.hidden_size // self.num_heads)
        self.num_slots = 0
        self.caches: list[tuple[Any, Any]] = []
        self.paged = False
        self.tables: BlockTables | None = None
        if num_slots is not None:
            self.allocate(num_slots)
        self.kv_lengths = _length_buckets(self.max_len)
        self.use_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        self._graphs: dict[tuple[int, int], _DecodeGraph] = {}
        self._graph_pool = None
        self.moe_layers = 0  # expert modules on copt's graph-capturable experts (capture_graphs)
        self._prefill_graphs: list[PrefillGraph] = []  # by token bucket, smallest first (capture_prefill_graphs)
        self.prefill_graph_error: str | None = None
        self.prefill_graph_steps = 0  # packed steps replayed from a prefill graph
        self._eager_forwards: list[tuple[Any, Any]] = []
        self.compile_mode = compile_mode
        if decode_attention not in ("sdpa", "flex", "math", "paged"):
            raise ValueError(f"decode_attention must be sdpa, flex, math or paged, not {decode_attention!r}")
        self.compiled_layers = self._compile_decode_layers() if compile_decode else 0
        # FlexAttention and the plain-ops form pay only compiled (eager, they are several unfused kernels or
        # materialize the scores): masked SDPA otherwise
        # the paged kernel (paged_attention.py) runs compiled or not; it needs the paged cache (allocate_paged)
        self.decode_attention = decode_attention if (self.compiled_layers or decode_attention == "paged") else "sdpa"
        if decode_attention == "paged":
            from clusteropt_cli.core.serve.paged_attention import register

            register()  # defined before any compile traces a layer that calls it

    def allocate(self, num_slots: int) -> None:
        """Allocate the static KV cache: num_slots sequences of max_len tokens (+ one scratch slot)."""
        import torch

        self.num_slots = int(num_slots)
        if getattr(self, "decode_attention", None) == "paged":  # the slot layout has no block tables
            self.decode_attention = "math" if self.compiled_layers else "sdpa"
        self.scratch_pos = self.max_len  # decode rows of slots that are not decoding write this column
        # a full layer keeps max_len positions per slot, a short sliding window a ring (attention.ring_length)
        self.caches = []
        for ring in self.rings:
            shape = (self.num_slots + 1, self.kv_heads, (ring or self.max_len) + 1, self.head_dim)
            self.caches.append((torch.zeros(shape, dtype=self.dtype, device=self.device),
                                torch.zeros(shape, dtype=self.dtype, device=self.device)))
        # each attention module holds its own layer's cache as a buffer: the layers then differ only in their
        # tensors, so one compiled decode graph serves all of them (no specialization on layer_idx)
        for module in self._attention_modules():
            k, v = self.caches[module.layer_idx]
            module.register_buffer("copt_k_cache", k, persistent=False)
            module.register_buffer("copt_v_cache", v, persistent=False)
        from clusteropt_cli.core.serve.device_sampling import SlotSampler

        # per-slot sampling state on the device (compiled with the decode layers: one fused kernel per variant)
        self.sampler = SlotSampler(self.num_slots, self.vocab_size, self.device,
                                   compiled=bool(getattr(self, "compiled_layers", 0)) and self.device.type == "cuda")

    @property
    def can_page(self) -> bool:
        """Whether this model's cache can be paged: every layer keeps its whole context (a sliding-window ring
        keeps the slot layout)."""
        return not any(self.rings)

    def allocate_paged(self, num_rows: int, num_blocks: int, block_size: int, kv_dtype: Any = None,
                       tables: BlockTables | None = None) -> None:
        """Allocate a paged KV cache: per layer a pool of `num_blocks` blocks of `block_size` tokens (+ a scratch
        block that rows which are not decoding write to), and `num_rows` block tables (or share `tables`)."""
        import torch

        if not self.can_page:
            raise RuntimeError("a model with sliding-window rings keeps the slot KV cache")
        self.paged = True
        self.num_slots = int(num_rows)
        self.block_size = int(block_size)
        self.num_blocks = int(num_blocks)
        self.scratch_pos = self.max_len
        self.kv_dtype = kv_dtype or self.dtype
        max_blocks = -(-self.max_len // self.block_size)
        self.tables = tables or BlockTables(self.num_slots, max_blocks, self.num_blocks, self.device)
        shape = (self.num_blocks + 1, self.block_size, self.kv_heads, self.head_dim)
        self.caches = [(torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                        torch.zeros(shape, dtype=self.kv_dtype, device=self.device)) for _ in range(self.num_layers)]
        for module in self._attention_modules():
            k, v = self.caches[module.layer_idx]
            module.register_buffer("copt_k_cache", k, persistent=False)
            module.register_buffer("copt_v_cache", v, persistent=False)
        # packed steps' attention in one variable-length kernel per layer (None: one SDPA per segment)
        self.varlen, self.varlen_reason = (varlen_kernel_for(self.device, self.dtype, self.num_heads, self.kv_heads,
                                                             self.head_dim) if not self.windows else
                                           (None, "sliding-window layers"))
        self._set_paged_decode_buckets()
        from clusteropt_cli.core.serve.device_sampling import SlotSampler

        self.sampler = SlotSampler(self.num_slots, self.vocab_size, self.device,
                                   compiled=bool(getattr(self, "compiled_layers", 0)) and self.device.type == "cuda")

    def _paged_kernel_available(self) -> bool:
        """The paged Triton kernel (paged_attention.py) runs here: CUDA with triton."""
        if self.device.type != "cuda":
            return False
        from clusteropt_cli.core.serve.paged_attention import triton_available

        return triton_available()

    def _set_paged_decode_buckets(self) -> None:
        """The paged cache's decode context buckets (whole blocks). The paged kernel reads each row's own blocks,
        whatever the bucket (which only bounds them): one bucket serves every context, so decode graphs are captured
        per batch size only (vLLM's way), not 11 times over at a 131,072-token context. The other attentions read
        the whole bucket: powers of two up to the context."""
        span = -(-self.max_len // self.block_size) * self.block_size
        if self.decode_attention == "paged" and not self.windows and self._paged_kernel_available():
            self.kv_lengths = [span]
        else:
            self.kv_lengths = sorted({min(span, -(-n // self.block_size) * self.block_size)
                                      for n in _length_buckets(self.max_len)})

    def _attention_modules(self) -> list[Any]:
        return self._attention_modules_of(self.model)

    @staticmethod
    def _attention_modules_of(model: Any) -> list[Any]:
        layers = getattr(model.get_decoder(), "layers", None) or []
        mods = [getattr(layer, "self_attn", None) for layer in layers]
        if not mods or any(m is None or not isinstance(getattr(m, "layer_idx", None), int) for m in mods):
            return []  # unknown layout: attention reads step.caches[layer_idx]
        return mods

    def _compile_decode_layers(self) -> int:
        """torch.compile each decoder layer's forward for decode steps (packed prefill stays eager: its segment
        layout changes every step). With the caches as module buffers the layers share one compiled graph
        (dynamic batch and context length; batch 1 compiles separately), so compiling costs about one layer's
        worth, not the model's. Returns the number of layers wrapped (0: not a decoder-layer model)."""
        import types

        import torch

        layers = getattr(self.decoder, "layers", None)
        if not layers or not self._attention_modules():
            return 0
        mode, one_mode = decode_compile_modes(self.compile_mode, self.device.type)
        own = None  # this runner's private copy of the layer forward (see own_code), shared by its layers
        for layer in layers:
            eager = layer.forward
            func = getattr(eager, "__func__", None)
            if own is None or func is not own[0]:
                own = (func, own_code(func) if hasattr(func, "__code__") else None)
            target = eager if own[1] is None else types.MethodType(own[1], layer)
            compiled = torch.compile(target, dynamic=True, **compile_kwargs(mode))
            compiled_one = compiled if one_mode == mode else torch.compile(target, dynamic=True,
                                                                           **compile_kwargs(one_mode))

            def forward(*args, _eager=eager, _compiled=compiled, _one=compiled_one, **kwargs):
                step = kwargs.get("copt_step")
                if step is not None and step.mode == "decode":
                    hidden = args[0] if args else kwargs["hidden_states"]
                    return (_one if hidden.shape[0] == 1 else _compiled)(*args, **kwargs)
                return _eager(*args, **kwargs)

            layer.forward = forward
            self._eager_forwards.append((layer, eager))
        return len(layers)

    def _uncompile(self) -> None:
        """Back to the eager decoder layers (a compile that fails at capture must not fail serving)."""
        for layer, eager in self._eager_forwards:
            layer.forward = eager
        self._eager_forwards = []
        self.compiled_layers = 0
        self.decode_attention = "sdpa"
        if self.paged:  # SDPA reads the whole bucket: back to buckets by length
            self._set_paged_decode_buckets()

    # ---- sizes -------------------------------------------------------------------------------------------
    @staticmethod
    def kv_bytes_per_token_of(config: Any, dtype_bytes: int, max_len: int | None = None) -> int:
        """KV bytes per token of a slot; with `max_len`, averaged over a slot of that many tokens whose short
        sliding-window layers keep only their ring (rounded up)."""
        heads = getattr(config, "num_attention_heads", None)
        if not heads:  # no attention heads (recurrent models): size like one hidden-width K and V per layer
            per_layer = 2 * int(config.hidden_size) * dtype_bytes
            return per_layer * int(config.num_hidden_layers)
        heads = int(heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        per_layer = 2 * kv_heads * head_dim * dtype_bytes
        layers = int(config.num_hidden_layers)
        if max_len:
            from clusteropt_cli.core.serve.architectures import inspect_architecture
            from clusteropt_cli.core.serve.attention import ring_length

            arch = inspect_architecture(config, max_len)
            if arch.native and arch.sliding_layers:
                columns = sum(ring_length(w, max_len) or max_len for w in arch.windows)
                return -(-per_layer * columns // max_len)
        return per_layer * layers

    # ---- forwards ----------------------------------------------------------------------------------------
    def _hidden(self, input_ids, position_ids, step: StepContext):
        with _sdpa_backends():
            out = self.decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False, copt_step=step)
        return out.last_hidden_state

    def forward_packed(self, chunks: list[tuple[int, int, list[int]]], logits_for: list[list[int]]):
        """Run segments (slot, start, token_ids) packed into one row.

        `logits_for[i]` lists the indices (within chunk i) whose next-token logits are wanted; returns one
        float32 tensor [sum(len(logits_for[i])), V] in that order.
        """
        import torch

        if self.max_segment and any(len(tokens) > self.max_segment for _, _, tokens in chunks):
            return self._forward_split(chunks, logits_for)
        graph = self._prefill_graph_for(chunks, logits_for)
        if graph is not None:
            self.prefill_graph_steps += 1
            return graph.run(chunks, logits_for)
        segments, masks, ids, pos, rows = [], [], [], [], []
        offset = 0
        varlen = self.varlen if self.paged else None
        for (slot, start, tokens), wanted in zip(chunks, logits_for, strict=True):
            n = len(tokens)
            if start + n > self.max_len:
                raise ValueError(f"sequence of {start + n} tokens exceeds the cache length {self.max_len}")
            segments.append(Segment(slot=slot, start=start, length=n, offset=offset))
            if start == 0 or varlen is not None:
                masks.append(None)
            else:
                q_pos = torch.arange(start, start + n, device=self.device)[:, None]
                masks.append(torch.arange(start + n, device=self.device)[None, :] <= q_pos)
            ids.extend(tokens)
            pos.extend(range(start, start + n))
            rows.extend(offset + i for i in wanted)
            offset += n
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        position_ids = torch.tensor([pos], dtype=torch.long, device=self.device)
        step = StepContext(caches=self.caches, mode="packed", segments=segments, masks=masks)
        if self.paged:
            self._page_packed(step, pos)
        if varlen is not None:
            ends = [seg.start + seg.length for seg in segments]
            bounds = torch.tensor([[0, *itertools.accumulate(seg.length for seg in segments)],
                                   [0, *itertools.accumulate(ends)]], dtype=torch.int32).to(self.device)
            step.varlen = (varlen, bounds[0], bounds[1], max(seg.length for seg in segments), max(ends))
        with torch.inference_mode():
            hidden = self._hidden(input_ids, position_ids, step)[0]
            if not rows:
                return torch.empty(0, self.vocab_size, device=self.device)
            picked = hidden.index_select(0, torch.tensor(rows, dtype=torch.long, device=self.device))
            return self._logits(picked)

    def _prefill_graph_for(self, chunks: list[tuple[int, int, list[int]]], logits_for: list[list[int]]):
        """The captured prefill graph that can run this packed step, or None (eager): every segment wants at most its
        last token's logits, and the smallest token bucket whose graph takes the step's segments (PrefillGraph.fits:
        their number, tokens, and where they start) holds it."""
        if not self._prefill_graphs:
            return None
        for (_slot, _start, tokens), wanted in zip(chunks, logits_for, strict=True):
            if wanted and wanted != [len(tokens) - 1]:
                return None
        return next((g for g in self._prefill_graphs if g.fits(chunks)), None)

    def capture_prefill_graphs(self, max_tokens: int) -> int:
        """Capture prefill graphs for token buckets up to `max_tokens` (at most PREFILL_GRAPH_MAX_TOKENS): a short
        prompt's prefill is a few ms of GPU work under tens of ms of Python and kernel launches (about 25 ms for 32
        tokens on the 1B shape on an H200 host), so the time to first token is the host's; a loaded server's packed
        2,048-token step took 28 ms eager on the 1B shape for 11 ms of kernels. Needs the paged cache in the model's
        dtype, attention without sliding windows and CUDA graphs. With the variable-length kernel (runner.varlen)
        one graph per bucket takes packed, new and resumed prompts alike; if capturing those fails, the masked ones
        (PrefillGraph) are tried. Returns how many (0: eager prefill)."""
        import torch

        self._prefill_graphs = []
        if not (self.use_graphs and self.paged and not self.windows
                and not self.max_segment and self.kv_dtype == self.dtype):
            return 0
        from clusteropt_cli.core.serve.moe import grouped_gemm_on_device

        if self.moe_layers and not grouped_gemm_on_device(self.dtype, self.device.type):  # prompts: host offsets
            self.prefill_graph_error = "MoE experts below bf16 read their routing on the host: prefill runs eagerly"
            return 0
        buckets = [b for b in PREFILL_GRAPH_BUCKETS if b <= min(max_tokens, PREFILL_GRAPH_MAX_TOKENS)]
        kinds = [[(b, False, self.varlen) for b in buckets]] if self.varlen is not None else []
        kinds.append([(b, single, None) for single, cap in ((True, PREFILL_GRAPH_MAX_TOKENS),
                                                             (False, PREFILL_GRAPH_MAX_PACKED))
                      for b in buckets if b <= cap])
        import warnings

        for kind in kinds:
            pool = torch.cuda.graph_pool_handle()  # their own: a decode graph's temporaries never meet a prefill's
            rows = PREFILL_GRAPH_VARLEN_SEGMENTS if kind[0][2] is not None else PREFILL_GRAPH_SEGMENTS
            try:
                with torch.inference_mode():  # the largest first: the smaller ones reuse its memory
                    logits = torch.zeros(rows, self.vocab_size, dtype=torch.float32, device=self.device)
                    graphs = [PrefillGraph(self, b, pool, single=single, kernel=kernel, logits=logits)
                              for b, single, kernel in sorted(kind, key=lambda k: -k[0])]
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - the next kind, or the eager prefill, still serves
                torch.cuda.synchronize()
                self.prefill_graph_error = f"{type(exc).__name__}: {exc}"
                warnings.warn(f"capturing the prefill graphs failed ({self.prefill_graph_error})", stacklevel=2)
                continue
            self._prefill_graphs = sorted(graphs, key=lambda g: (g.tokens, g.single))
            return len(graphs)
        return 0

    def _page_packed(self, step: StepContext, positions: list[int]) -> None:
        """A packed step's places in the paged cache: where each token is written (one index for the step) and
        which blocks each segment attends over (one host-to-device copy for both)."""
        import torch

        tables = self.tables
        tables.flush()
        bs = self.block_size
        host = tables.host
        pos = torch.tensor(positions, dtype=torch.long)
        rows = torch.cat([torch.full((seg.length,), seg.slot, dtype=torch.long) for seg in step.segments])
        reads = [host[seg.slot, : -(-(seg.start + seg.length) // bs)] for seg in step.segments]
        n = len(positions)
        moved = torch.cat([host[rows, pos // bs], pos % bs, *reads]).to(self.device)
        step.paged, step.block_tables = True, tables.device
        step.write_block, step.write_offset = moved[:n], moved[n : 2 * n]
        step.read_blocks = list(torch.split(moved[2 * n :], [len(r) for r in reads]))

    def _forward_split(self, chunks: list[tuple[int, int, list[int]]], logits_for: list[list[int]]):
        """forward_packed in rounds of at most max_segment tokens per sequence (a windowed layer's ring holds
        the window and one such piece); the logits come back in the order asked."""
        import torch

        m = self.max_segment
        found: list[dict[int, Any]] = [{} for _ in chunks]
        rounds = max(-(-len(tokens) // m) for _, _, tokens in chunks)
        for j in range(rounds):
            lo, hi = j * m, (j + 1) * m
            members = [i for i, (_, _, tokens) in enumerate(chunks) if len(tokens) > lo]
            sub = [(chunks[i][0], chunks[i][1] + lo, chunks[i][2][lo:hi]) for i in members]
            wanted = [sorted(w - lo for w in logits_for[i] if lo <= w < hi) for i in members]
            logits = self.forward_packed(sub, wanted)
            row = 0
            for i, rows in zip(members, wanted, strict=True):
                for w in rows:
                    found[i][w + lo] = logits[row]
                    row += 1
        picked = [found[i][w] for i, wanted in enumerate(logits_for) for w in wanted]
        return torch.stack(picked) if picked else torch.empty(0, self.vocab_size, device=self.device)

    def _kv_bucket(self, max_position: int) -> int:
        for size in self.kv_lengths:
            if max_position < size:
                return size
        return self.max_len

    def _decode_eager(self, input_ids, positions, kv_len: int, out=None):
        """Decode rows 0..B-1 = slots 0..B-1 (B = len(input_ids)); returns float32 logits [B, V] (written into
        `out` when given)."""
        import torch

        rows = torch.arange(input_ids.shape[0], device=self.device)
        mask = None
        if self.decode_attention not in ("flex", "paged"):
            mask = (torch.arange(kv_len, device=self.device)[None, :] <= positions[:, None])[:, None, None, :]
        step = StepContext(caches=self.caches, mode="decode", slot_ids=rows, positions=positions, mask=mask,
                           kv_len=kv_len, attention=self.decode_attention, scratch_pos=self.scratch_pos)
        if self.paged:  # where each row's token goes: its block (the scratch block for rows not decoding)
            bs, table = self.block_size, self.tables.device
            column = (positions // bs).clamp(max=table.shape[1] - 1)
            block = table[: input_ids.shape[0]].gather(1, column[:, None])[:, 0]
            idle = positions >= self.scratch_pos
            block = torch.where(idle, self.tables.scratch_block, block)
            step.paged, step.block_tables = True, table
            step.write_block, step.write_offset = block, positions % bs
            if self.decode_attention == "paged":  # rows not decoding attend one key, not the bucket's
                step.attend_positions = torch.where(idle, 0, positions)
        if self.windows:
            from clusteropt_cli.core.serve.attention import decode_window_mask

            step.window_masks = {w: decode_window_mask(positions, kv_len, w, self.scratch_pos, ring)
                                 for w, ring in self.windows}
        hidden = self._hidden(input_ids[:, None], positions[:, None], step)
        return self._logits(hidden[:, -1], out)

    def _logits(self, hidden, out=None):
        """float32 next-token logits of hidden states [N, hidden] (with the model's final soft-capping, if any),
        written into `out` when given (the CUDA graphs' shared logits buffer)."""
        if out is not None and not self.final_softcap:
            return out.copy_(self.lm_head(hidden))  # the float32 conversion in the copy
        logits = self.lm_head(hidden).float()
        if self.final_softcap:
            import torch

            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits if out is None else out.copy_(logits)

    def forward_decode(self, slots: list[int], positions: list[int], tokens: list[int]):
        """One token for each of len(slots) sequences; returns float32 logits [len(slots), V] in that order."""
        import torch

        n = len(slots)
        rows = max(slots) + 1
        kv_len = self._kv_bucket(max(positions))
        if self.tables is not None:
            self.tables.flush()
        with torch.inference_mode():
            logits = None
            if self.use_graphs:
                graph = self._graph_for(rows, kv_len)
                if graph is not None:
                    logits = graph.run(slots, positions, tokens)
            if logits is None:
                ids = torch.zeros(rows, dtype=torch.long)
                pos = torch.full((rows,), self.scratch_pos, dtype=torch.long)
                index = torch.tensor(slots, dtype=torch.long)
                ids[index] = torch.tensor(tokens, dtype=torch.long)
                pos[index] = torch.tensor(positions, dtype=torch.long)
                logits = self._decode_eager(ids.to(self.device), pos.to(self.device), kv_len)
            if rows == n and slots[0] == 0 and slots == sorted(slots):  # rows already in slot order
                return logits[:n]
            return logits.index_select(0, torch.tensor(slots, dtype=torch.long, device=self.device))

    def decode_sample(self, slots: list[int], positions: list[int], tokens: list[int]):
        """One decode step and its tokens chosen by the slots' sampling settings, on the device (a device tensor
        [len(slots)]; with CUDA graphs, the decode graph and the sampling graph replayed back to back)."""
        import torch

        sampler = self.sampler
        _plain, sort, penalize = sampler.flags(slots)
        rows = max(slots) + 1
        if self.tables is not None:
            self.tables.flush()
        with torch.inference_mode():
            if self.use_graphs:
                kv_len = self._kv_bucket(max(positions))
                graph = self._graph_for(rows, kv_len)
                if graph is not None:
                    graph.run(slots, positions, tokens)
                    out = sampler.graph_sample(self.logits_buf[: graph.batch], graph.batch, sort, penalize)
                    return out.index_select(0, torch.tensor(slots, dtype=torch.long, device=self.device))
            logits = self.forward_decode(slots, positions, tokens)
            return sampler.sample(logits, slots, [p + 1 for p in positions])

    # the largest batch bucket whose sampling graph chooses the first tokens after a prefill (a step finishing more
    # prompts samples them eagerly)
    GRAPHED_FIRST_TOKEN_ROWS = 64
    graphed_first_tokens = True  # off: the eager path (benchmarks compare both)
    staged_first_tokens = True  # off: the rows of the slots themselves, up to GRAPHED_FIRST_TOKEN_ROWS (benchmarks)

    def sample_first_tokens(self, logits, slots: list[int], positions: list[int]):
        """The tokens chosen from prefill logits [n, V] (rows of `slots`, choosing the token at `positions`) through
        a captured sampling graph, or None where there is none (no CUDA graphs, more than GRAPHED_FIRST_TOKEN_ROWS
        rows): the caller samples eagerly. Slots whose bucket is the rows' own sample in place (the graph of the
        smallest bucket above max(slots)); others are staged (copied to the first-token stage's rows 0..n-1), so a
        step at 256 running sequences samples its few first tokens through a graph of a few rows, not of 256."""
        if not (self.use_graphs and self.graphed_first_tokens and getattr(self, "logits_buf", None) is not None):
            return None
        if self.sampler.graph_error is not None:
            return None
        if logits.untyped_storage().data_ptr() == self.logits_buf.untyped_storage().data_ptr():
            return None  # a decode graph's own output (a view of the buffer): never copied onto itself
        n, rows = len(slots), max(slots) + 1
        needed = next((b for b in self._batch_buckets if b >= n), None)
        bucket = next((b for b in self._batch_buckets if b >= rows), None)
        if needed is None or needed > self.GRAPHED_FIRST_TOKEN_ROWS:
            return None
        stage = self.first_token_stage if self.staged_first_tokens else None
        if bucket == needed or (stage is None and bucket is not None and bucket <= self.GRAPHED_FIRST_TOKEN_ROWS):
            return self.sampler.sample_through_rows(self.logits_buf, logits, slots, positions, bucket)
        if stage is None:
            return None
        return self.sampler.sample_staged(stage, logits, slots, positions, needed)

    @property
    def can_copy_prefix(self) -> bool:
        """Every layer keeps all positions (a sliding-window ring may have overwritten a shared prefix); a paged
        cache shares prompts through its prefix cache instead."""
        return not self.paged and not any(getattr(self, "rings", None) or [])

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of slot src's KV cache to slot dst (a shared prompt)."""
        import torch

        with torch.inference_mode():
            for k, v in self.caches:
                k[dst, :, :length].copy_(k[src, :, :length])
                v[dst, :, :length].copy_(v[src, :, :length])

    def start_chain(self, slots: list[int], positions: list[int], tokens: list[int]) -> DecodeChain:
        """Decode steps for these slots whose inputs stay on the device (see DecodeChain)."""
        return DecodeChain(self, slots, positions, tokens)

    # ---- CUDA graphs -------------------------------------------------------------------------------------
    def _graph_for(self, batch: int, kv_len: int) -> _DecodeGraph | None:
        bucket = next((b for b in self._batch_buckets if b >= batch), None)
        if bucket is None:
            return None
        key = (bucket, kv_len)
        graph = self._graphs.get(key)
        if graph is None:
            graph = _DecodeGraph(self, bucket, kv_len)
            self._graphs[key] = graph
        return graph

    def capture_graphs(self, max_batch: int) -> int:
        """Capture decode graphs for every (batch bucket, context bucket), largest first; returns how many."""
        import torch

        self._batch_buckets = batch_buckets(max_batch)
        if not self.use_graphs:
            return 0
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        from clusteropt_cli.core.serve.moe import use_capturable_experts

        # MoE experts below bf16 read their routing on the host: decode steps compute them densely (moe.py)
        self.moe_layers = use_capturable_experts(self.model, max(self._batch_buckets))
        # every decode graph writes its logits here (rows 0..bucket-1): one sampling graph per batch bucket reads them
        with torch.inference_mode():  # as the sampler's state: its kernels see inference tensors on every path
            self.logits_buf = torch.zeros(max(self._batch_buckets), self.vocab_size, dtype=torch.float32,
                                          device=self.device)
        try:
            with torch.inference_mode():
                for kv_len in reversed(self.kv_lengths):
                    for bucket in reversed(self._batch_buckets):
                        self._graph_for(bucket, kv_len)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a model whose step cannot be captured still serves, eagerly
            import warnings

            self._graphs.clear()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            if self.compiled_layers:  # retry with the eager layers before giving up on graphs
                warnings.warn(f"compiled decode failed at CUDA graph capture ({type(exc).__name__}: {exc}); "
                              "capturing the eager layers", stacklevel=2)
                self.compile_error = f"{type(exc).__name__}: {exc}"
                self._uncompile()
                return self.capture_graphs(max_batch)
            warnings.warn(f"CUDA graph capture failed ({type(exc).__name__}: {exc}); decoding eagerly", stacklevel=2)
            self.graph_error = f"{type(exc).__name__}: {exc}"
            self.use_graphs = False
            return 0
        with torch.inference_mode():  # its own fallbacks (uncompiled, eager): never costs the decode graphs
            self.capture_sampling_graphs()
        torch.cuda.synchronize()
        return len(self._graphs)

    def capture_sampling_graphs(self) -> None:
        """Capture the sampling step of every batch bucket and variant (selection mode: plain, top-k thresholds,
        top-p candidates, both, or the sort; penalties) up front, so the first sampled request does not pay a
        compile and capture. Rows are inactive: nothing is counted."""
        import warnings

        sampler = self.sampler
        sampler.graph_pool = self._graph_pool
        sampler.active.zero_()
        sampler.capture_graphs(self.logits_buf, self._batch_buckets)
        self.capture_first_token_stage()
        try:  # and the eager path the prefill rows take, so the first sampled requests do not compile either
            sampler.warm_eager(self.logits_buf)
        except Exception as exc:  # noqa: BLE001 - the requests would meet the same error: let them report it
            warnings.warn(f"warming the eager sampling path failed ({type(exc).__name__}: {exc})", stacklevel=2)

    def capture_first_token_stage(self) -> None:
        """The first-token stage (sample_first_tokens) and its sampling graphs, every bucket up to
        GRAPHED_FIRST_TOKEN_ROWS and variant, captured up front as the decode steps' are."""
        from clusteropt_cli.core.serve.device_sampling import SlotSampler

        sampler = self.sampler
        buckets = [b for b in self._batch_buckets if b <= self.GRAPHED_FIRST_TOKEN_ROWS]
        self.first_token_stage = None
        if not buckets or sampler.graph_error is not None:
            return
        stage = SlotSampler.stage_for(sampler, max(buckets))
        stage.nucleus_error = sampler.nucleus_error
        stage.capture_graphs(stage.logits, buckets)
        if stage.graph_error is None:
            self.first_token_stage = stage

    first_token_stage: Any = None  # capture_first_token_stage: the rows the first tokens are staged in
    compile_error: str | None = None

    @property
    def attention_path(self) -> str:
        """What serves attention, for the start-up info."""
        cache = "paged" if self.tables is not None else "slot"
        packed = "; packed steps: FlashAttention varlen" if self.varlen is not None else ""
        return f"copt {cache} attention ({self.architecture.describe()}{packed})"

    graph_error: str | None = None

    _batch_buckets: list[int] = []
    varlen: Any = None  # allocate_paged: the variable-length attention kernel of packed steps (None: per segment)
    varlen_reason = "slot cache"


class _DecodeGraph:
    """One captured decode step over slots 0..batch-1 for a fixed context bucket."""

    def __init__(self, runner: ModelRunner, batch: int, kv_len: int):
        import torch

        self.runner, self.batch = runner, batch
        dev = runner.device
        self.input_ids = torch.zeros(batch, dtype=torch.long, device=dev)
        self.positions = torch.full((batch,), runner.scratch_pos, dtype=torch.long, device=dev)
        self.host = torch.zeros(2, batch, dtype=torch.long).pin_memory()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up kernels / allocator outside the capture
                runner._decode_eager(self.input_ids, self.positions, kv_len)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=runner._graph_pool):
            self.logits = runner._decode_eager(self.input_ids, self.positions, kv_len,
                                               out=runner.logits_buf[:batch])
            self.greedy = greedy_tokens(self.logits)  # every row's argmax, in the graph (used by DecodeChain)
            # the sampling graph's inputs: the position of the token each row chooses, and which rows decode
            sampler = runner.sampler
            sampler.position[:batch].copy_(self.positions + 1)
            sampler.active[:batch].copy_(self.positions != runner.scratch_pos)

    def run(self, slots: list[int], positions: list[int], tokens: list[int]):
        import torch

        host = self.host
        host[0].zero_()
        host[1].fill_(self.runner.scratch_pos)
        index = torch.tensor(slots, dtype=torch.long)
        host[0, index] = torch.tensor(tokens, dtype=torch.long)
        host[1, index] = torch.tensor(positions, dtype=torch.long)
        self.input_ids.copy_(host[0], non_blocking=True)
        self.positions.copy_(host[1], non_blocking=True)
        self.graph.replay()
        return self.logits


# captured prefill steps (ModelRunner.capture_prefill_graphs): token buckets. With FlashAttention's variable-length
# kernel (CUDA) one kind of graph takes up to PREFILL_GRAPH_VARLEN_SEGMENTS segments and PREFILL_GRAPH_MAX_TOKENS
# tokens, segments that continue a sequence too (their cached keys read from the pool: at most as many as the bucket
# has tokens). Without it: one segment (causal attention) up to PREFILL_GRAPH_MAX_TOKENS, or up to
# PREFILL_GRAPH_SEGMENTS segments starting at position 0 up to PREFILL_GRAPH_MAX_PACKED tokens under a block-diagonal
# mask (slower attention than the causal kernel: a loss past ~1k tokens on the 8B shape, where an eager step's GPU
# time exceeds its host time).
PREFILL_GRAPH_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)
PREFILL_GRAPH_MAX_TOKENS = 2048
PREFILL_GRAPH_MAX_PACKED = 1024
PREFILL_GRAPH_SEGMENTS = 8
PREFILL_GRAPH_VARLEN_SEGMENTS = 32


class PrefillGraph:
    """One captured packed prefill of up to `tokens` tokens (paged cache). Per step the host fills one staging row —
    token ids, positions, block and offset of every token, the rows whose logits are wanted and the attention
    layout — copied to the device in one transfer.

    With a variable-length kernel (`kernel`: runner.varlen) the step holds up to PREFILL_GRAPH_VARLEN_SEGMENTS
    segments, each starting anywhere (a prompt resumed, a prefix-cache hit) as long as their cached keys are at
    most `tokens`; the layout is each token's place in the pool for its segment's keys and the cumulative query and
    key lengths (padding tokens: one segment of their own over the scratch block, then empty segments). Without
    one, the segments start at position 0 and attend under a mask built in the graph: causal (`single`) or
    block-diagonal causal (up to PREFILL_GRAPH_SEGMENTS, padding tokens a segment each)."""

    def __init__(self, runner: ModelRunner, tokens: int, pool: Any, capture: bool = True, single: bool = False,
                 kernel: Any = None, logits: Any = None):
        """`logits`: the float32 [rows, vocabulary] buffer the step's logits go to (graphs of one kind share one:
        one step runs at a time, and run() copies its rows out)."""
        import torch

        self.runner, self.tokens, self.single, self.kernel = runner, tokens, single, kernel
        self.rows = PREFILL_GRAPH_VARLEN_SEGMENTS if kernel is not None else PREFILL_GRAPH_SEGMENTS
        self.keys = 2 * tokens if kernel is not None else 0  # the step's own keys and as many cached ones
        dev = runner.device
        width = 5 * tokens + self.keys + 2 * (self.rows + 2) + self.rows
        self.host = torch.zeros(width, dtype=torch.long)
        self.staged = torch.zeros(width, dtype=torch.long, device=dev)
        self.logits = (logits if logits is not None
                       else torch.zeros(self.rows, runner.vocab_size, dtype=torch.float32, device=dev))
        self.graph = self.copied = None
        if not capture:  # the same step layout and body, run eagerly (the CPU tests check it against forward_packed)
            return
        self.host = self.host.pin_memory()
        self.copied = torch.cuda.Event()  # the last staging copy: the pinned row is not refilled before it is done
        self._fill([], [])
        self.staged.copy_(self.host)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up kernels / allocator outside the capture
                self._body()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self._body()

    def fits(self, chunks: list[tuple[int, int, list[int]]]) -> bool:
        """Whether this graph can run the step (the caller checked the logits asked: none or the last token's)."""
        if len(chunks) > self.rows or sum(len(tokens) for _, _, tokens in chunks) > self.tokens:
            return False
        if self.kernel is not None:
            return sum(start for _, start, _ in chunks) <= self.keys - self.tokens
        return all(start == 0 for _, start, _ in chunks) and (len(chunks) == 1) == self.single

    def _split(self, row: Any) -> tuple[Any, ...]:
        """(ids, pos, seg, block, offset, key_index, cu_q, cu_k, wanted) over a staging row (the pinned host one or
        the device's) — seg: the mask's segment ids (masked graphs); key_index, cu_q, cu_k: the kernel's layout."""
        t, k, r = self.tokens, self.keys, self.rows + 2
        parts = [row[i * t : (i + 1) * t] for i in range(5)]
        at = 5 * t
        key_index, cu_q, cu_k = row[at : at + k], row[at + k : at + k + r], row[at + k + r : at + k + 2 * r]
        return (*parts, key_index, cu_q, cu_k, row[at + k + 2 * r :])

    def _body(self) -> None:
        import torch

        ids, pos, seg, block, offset, key_index, cu_q, cu_k, wanted = self._split(self.staged)
        step = StepContext(caches=self.runner.caches, mode="fresh", paged=True,
                           block_tables=self.runner.tables.device, write_block=block, write_offset=offset)
        if self.kernel is not None:
            step.varlen = (self.kernel, cu_q.to(torch.int32), cu_k.to(torch.int32), self.tokens, self.keys)
            step.key_index = key_index
        elif not self.single:
            step.mask = ((seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None]))[None, None]
        hidden = self.runner._hidden(ids[None], pos[None], step)[0]
        self.runner._logits(hidden.index_select(0, wanted), out=self.logits)

    def _fill(self, chunks: list[tuple[int, int, list[int]]], logits_for: list[list[int]]) -> int:
        """Write the step's layout into the pinned staging row; returns how many logits rows it asks for."""
        import torch

        t, runner = self.tokens, self.runner
        bs = runner.block_size
        tables = runner.tables.host
        scratch = runner.tables.scratch_block
        ids, pos, seg, block, offset, key_index, cu_q, cu_k, wanted = self._split(self.host)
        ids.zero_()
        pos.zero_()
        seg.copy_(torch.arange(-1, -t - 1, -1))  # padding: a segment of its own per token (masked graphs)
        block.fill_(scratch)
        offset.zero_()
        key_index.fill_(scratch * bs)
        wanted.zero_()
        at = keys_at = n_rows = 0
        for i, ((slot, start, tokens), rows) in enumerate(zip(chunks, logits_for, strict=True)):
            n = len(tokens)
            span = torch.arange(start, start + n)
            ids[at : at + n] = torch.tensor(tokens, dtype=torch.long)
            pos[at : at + n] = span
            seg[at : at + n] = i
            block[at : at + n] = tables[slot, span // bs]
            offset[at : at + n] = span % bs
            if self.kernel is not None:
                cached = torch.arange(start + n)
                key_index[keys_at : keys_at + start + n] = tables[slot, cached // bs] * bs + cached % bs
                keys_at += start + n
                cu_q[i + 1], cu_k[i + 1] = at + n, keys_at
            for r in rows:
                wanted[n_rows] = at + r
                n_rows += 1
            at += n
        if self.kernel is not None:  # empty segments, then the padding over the scratch block's first place
            cu_q[len(chunks) + 1 : -1], cu_k[len(chunks) + 1 : -1] = at, keys_at
            cu_q[-1], cu_k[-1] = t, keys_at + t - at
        return n_rows

    def run(self, chunks: list[tuple[int, int, list[int]]], logits_for: list[list[int]]):
        """Replay for this step (the caller checked it fits: ModelRunner._prefill_graph_for); returns float32
        logits [rows asked, V], a copy (the next replay reuses the buffer)."""
        import torch

        self.runner.tables.flush()
        if self.copied is not None:
            self.copied.synchronize()
        n_rows = self._fill(chunks, logits_for)
        with torch.inference_mode():
            self.staged.copy_(self.host, non_blocking=self.graph is not None)
            if self.graph is None:
                self._body()
            else:
                self.copied.record()
                self.graph.replay()
            return self.logits[:n_rows].clone()


def greedy_tokens(logits: Any) -> Any:
    """argmax over the vocabulary of [rows, vocab] logits, the same indices as logits.argmax(-1) (first maximum),
    in two stages: the maxima of vocabulary chunks, then the best chunk. One row's plain argmax is a single-block
    reduction (27 µs over a 128k vocabulary on an H200); chunked, every SM takes part."""
    rows, vocab = logits.shape
    chunks = next((c for c in (256, 128, 64, 32, 16) if vocab % c == 0 and vocab // c >= 64), 1)
    if chunks == 1:
        return logits.argmax(-1)
    values, within = logits.reshape(rows, chunks, vocab // chunks).max(-1)
    best = values.argmax(-1, keepdim=True)  # the first chunk holding the maximum: the first maximum overall
    return (best * (vocab // chunks) + within.gather(-1, best)).squeeze(-1)


class DecodeChain:
    """Decode steps fed on the device: each step's token (the in-graph argmax for plain greedy rows, the sampling
    graph's choice otherwise) becomes the next step's input without a host round trip, so the engine can launch step k+1
    before it reads step k's tokens and handle them (emit, stop checks, streaming) while the GPU runs (vLLM calls
    this overlap async scheduling). Rows are slots, as in forward_decode; rows of slots outside the chain stay on
    the scratch column."""

    def __init__(self, runner: ModelRunner, slots: list[int], positions: list[int], tokens: list[int]):
        import torch

        self.runner = runner
        dev = runner.device
        rows = max(slots) + 1
        if runner.use_graphs:  # the graph of this many rows reads the whole bucket: size the inputs to it
            rows = next((b for b in runner._batch_buckets if b >= rows), rows)
        self.index = torch.tensor(slots, dtype=torch.long, device=dev)
        self.ids = torch.zeros(rows, dtype=torch.long, device=dev)
        self.positions = torch.full((rows,), runner.scratch_pos, dtype=torch.long, device=dev)
        self.ids[self.index] = torch.tensor(tokens, dtype=torch.long, device=dev)
        self.positions[self.index] = torch.tensor(positions, dtype=torch.long, device=dev)
        self.max_position = max(positions)
        self.slots = list(slots)
        self.plain, self.sort, self.penalize = runner.sampler.flags(slots)
        self.cuda = dev.type == "cuda"
        # two pinned buffers: the step in flight writes one while the engine reads the other
        self._host = [torch.empty(len(slots), dtype=torch.long, pin_memory=self.cuda) for _ in range(2)]
        self._flip = 0

    def launch(self) -> PendingTokens:
        """Run one step on the current inputs and advance them to its greedy tokens (all on the device)."""
        import torch

        runner = self.runner
        kv_len = runner._kv_bucket(self.max_position)
        if runner.tables is not None:
            runner.tables.flush()
        graph = runner._graph_for(len(self.ids), kv_len) if runner.use_graphs else None
        with torch.inference_mode():
            if graph is not None:
                graph.input_ids.copy_(self.ids)
                graph.positions.copy_(self.positions)
                graph.graph.replay()
                if self.plain:
                    chosen = graph.greedy.index_select(0, self.index)
                else:
                    out = runner.sampler.graph_sample(runner.logits_buf[: graph.batch], graph.batch, self.sort,
                                                      self.penalize)
                    chosen = out.index_select(0, self.index)
            else:
                logits = runner._decode_eager(self.ids, self.positions, kv_len).index_select(0, self.index)
                if self.plain:
                    chosen = logits.argmax(-1)
                else:
                    chosen = runner.sampler.sample_rows(logits, self.slots, self.index,
                                                        self.positions.index_select(0, self.index) + 1)
            self.ids.index_copy_(0, self.index, chosen)
            self.positions.index_add_(0, self.index, torch.ones_like(chosen))
            self.max_position += 1
            host = self._host[self._flip]
            self._flip ^= 1
            if not self.cuda:
                host.copy_(chosen)
                return PendingTokens(host, None)
            host.copy_(chosen, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            return PendingTokens(host, done)


@dataclass
class PendingTokens:
    """The greedy tokens of a launched chain step, one per slot of the chain (in its order)."""

    host: Any
    done: Any  # a CUDA event, or None when the copy already happened

    def tokens(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()  # releases the GIL while the GPU finishes the step
        return self.host.tolist()
