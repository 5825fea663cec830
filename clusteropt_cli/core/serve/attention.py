"""Slot attention for layers that are not plain causal attention: sliding windows and attention soft-capping.

runner._slot_attention hands a layer here when its attention module carries a window (`copt_window`) or a
soft-cap (`copt_softcap`), set at start-up by architectures.apply_to_model. The masks follow transformers'
(masking_utils.sliding_window_overlay): query position q sees key position k when q - window < k <= q. Soft-capping
follows Gemma-2's eager attention: scores = tanh(scores / cap) * cap before the mask, softmax in float32.

A windowed layer whose window is much shorter than the cache keeps a ring per slot instead of the whole context:
`ring_length(window, max_len)` = window + RING_SLACK - 1 columns (+ the scratch column), position p in column
p mod ring. One forward writes at most RING_SLACK tokens of a sequence (ModelRunner.forward_packed splits longer
prefill chunks), so a chunk and the window before it are always in the ring together. Windowed prefill reads only
the keys inside the window of its chunk; windowed decode masks the bucket (or the ring, once the bucket is longer).
"""

from __future__ import annotations

from typing import Any


def check_layer_kwargs(module: Any, kwargs: dict[str, Any]) -> None:
    """Refuse a forward whose attention settings differ from the ones the engine derived from the config (a model
    that asks for a window or soft-cap the engine did not set up must stop, not attend without it)."""
    given = kwargs.get("sliding_window")
    if given is not None and int(given) != getattr(module, "copt_window_declared", None):
        raise RuntimeError(f"layer {getattr(module, 'layer_idx', '?')} asks for a sliding window of {given}; the "
                           f"engine set up {getattr(module, 'copt_window_declared', None)}: refusing to attend "
                           "differently")
    cap = kwargs.get("softcap")
    if cap is not None and cap != getattr(module, "copt_softcap", None):
        raise RuntimeError(f"layer {getattr(module, 'layer_idx', '?')} asks for attention soft-capping {cap}, which "
                           "the engine did not set up")


# tokens one forward may write per sequence into a windowed layer's ring (the GPU prefill chunk budget)
RING_SLACK = 2048


def ring_length(window: int | None, max_len: int) -> int | None:
    """Columns of a windowed layer's ring (None: the layer keeps the whole context, as a full layer does)."""
    if window is None:
        return None
    ring = window + RING_SLACK - 1
    return ring if ring < max_len else None


def _attend(q, keys, values, mask, scaling, softcap):
    """q [B, H, T, D]; keys/values [B, H, L, D] (already repeated for GQA); mask [B or 1, 1, T, L] bool."""
    import torch
    import torch.nn.functional as F

    if softcap is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1, dtype=torch.float32).to(values.dtype)
    return torch.matmul(probs, values)


def decode_window_mask(positions: Any, kv_len: int, window: int, scratch_pos: int, ring: int | None = None) -> Any:
    """[B, 1, 1, L] bool: row b sees keys positions[b] - window < k <= positions[b]. Rows on the scratch column
    (slots not decoding) see everything, as with the causal mask, so they never softmax an empty row.

    With a ring shorter than the bucket, L = ring and column r holds position q - ((q - r) mod ring) for query q:
    visible while that is within the window and not negative (a column the sequence has not reached yet holds a
    previous sequence's key)."""
    import torch

    scratch = (positions >= scratch_pos)[:, None]
    q = positions[:, None]
    if ring is not None and kv_len > ring:
        back = (q - torch.arange(ring, device=positions.device)[None, :]).remainder(ring)
        return (scratch | ((back < window) & (back <= q)))[:, None, None, :]
    keys = torch.arange(kv_len, device=positions.device)[None, :]
    return (scratch | ((keys <= q) & (keys > q - window)))[:, None, None, :]


def windowed_slot_attention(module, query, key, value, step, k_cache, v_cache, scaling):
    """The slot attention of a windowed and/or soft-capped layer: query [B, H, T, D], key/value [B, KVH, T, D]
    → [B, T, H, D]."""
    import torch

    window = getattr(module, "copt_window", None)
    softcap = getattr(module, "copt_softcap", None)
    ring = getattr(module, "copt_ring", None)
    num_heads, head_dim = query.shape[1], query.shape[-1]
    kv_heads = key.shape[1]
    groups = num_heads // kv_heads
    if step.mode == "decode":
        batch = query.shape[0]
        columns = step.positions
        if ring is not None:  # the scratch column sits after the ring
            columns = torch.where(step.positions >= step.scratch_pos, ring, step.positions.remainder(ring))
        k_cache[step.slot_ids, :, columns] = key[:, :, 0]
        v_cache[step.slot_ids, :, columns] = value[:, :, 0]
        span = step.kv_len if ring is None else min(step.kv_len, ring)
        keys = k_cache[:batch, :, :span]
        values = v_cache[:batch, :, :span]
        if window is not None:
            mask = step.window_masks[window]
        elif step.mask is not None:
            mask = step.mask
        else:
            mask = (torch.arange(step.kv_len, device=query.device)[None, :] <= step.positions[:, None])[:, None,
                                                                                                       None, :]
        # one query per sequence: fold the GQA group into the query-length axis (no K/V repeat needed)
        q = query.reshape(batch, kv_heads, groups, head_dim)
        out = _attend(q, keys, values, mask, scaling, softcap)
        return out.reshape(batch, num_heads, 1, head_dim).transpose(1, 2)

    outs = []
    for seg in step.segments:
        end = seg.start + seg.length
        sl = slice(seg.offset, seg.offset + seg.length)
        low = 0 if window is None else max(0, seg.start - window + 1)  # the first key any query here can see
        if ring is None:
            k_cache[seg.slot, :, seg.start : end] = key[0, :, sl]
            v_cache[seg.slot, :, seg.start : end] = value[0, :, sl]
            keys = k_cache[seg.slot : seg.slot + 1, :, low:end]
            values = v_cache[seg.slot : seg.slot + 1, :, low:end]
        else:
            if end - low > ring:
                raise RuntimeError(f"a segment of {seg.length} tokens does not fit the {ring}-column ring of a "
                                   f"{window}-token window")
            written = torch.arange(seg.start, end, device=query.device).remainder(ring)
            k_cache[seg.slot, :, written] = key[0, :, sl]
            v_cache[seg.slot, :, written] = value[0, :, sl]
            read = torch.arange(low, end, device=query.device).remainder(ring)
            keys = k_cache[seg.slot, :, read][None]
            values = v_cache[seg.slot, :, read][None]
        if groups > 1:
            keys = keys.repeat_interleave(groups, dim=1)
            values = values.repeat_interleave(groups, dim=1)
        q_pos = torch.arange(seg.start, end, device=query.device)[:, None]
        k_pos = torch.arange(low, end, device=query.device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask = mask & (k_pos > q_pos - window)
        outs.append(_attend(query[:, :, sl], keys, values, mask[None, None], scaling, softcap))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2)
