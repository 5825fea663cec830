"""Triton kernels of paged decode attention (see paged_attention.py, which imports this module only where triton
imports; nothing else should import it directly).

Flash-decoding over block tables, in two stages:
  stage 1  grid (B, KVH, splits): one program per sequence, KV head and split of the sequence's keys. It loads the
           G query heads that share the KV head together (a [BLOCK_G, D] tile, so each K/V tile is read once per KV
           head, not once per query head), walks its share of the keys BLOCK_N tokens at a time (each token's
           physical block looked up in the row's block table, so a tile may span several pages), and keeps an online
           softmax in float32. With one split it writes the normalised output; otherwise the partial output and its
           log-sum-exp. The two products run on the query's dtype (bf16/fp16 tensor cores; FP8 keys and values are
           converted exactly), or in float32 with F32_DOT (float32 queries, and the Triton interpreter, whose numpy
           dot does not handle bfloat16).
  stage 2  grid (B, H): merges the splits of one sequence and head (log-sum-exp weighting). Not launched with one
           split (its grid is empty when the count is known only at run time: stage 1 then writes the output).
Row b reads keys 0..min(positions[b], num_blocks*BS - 1) only: the table columns past positions[b] // BS are never
touched. Physical block ids are clamped into the pool, so a scratch row's stale table cannot read out of bounds.
"""

import triton
import triton.language as tl


@triton.jit
def paged_decode_stage1(
    Q, K, V, Tables, Pos, Out, MidO, MidLse,
    stride_qb, stride_qh,
    stride_kn, stride_kt, stride_kh,
    stride_vn, stride_vt, stride_vh,
    stride_tb,
    stride_ob, stride_oh,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
    cap, num_pool_blocks, num_splits, sm_scale,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, SINGLE: tl.constexpr, F32_DOT: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    pos = tl.load(Pos + b).to(tl.int64)
    pos = tl.minimum(tl.maximum(pos, 0), cap - 1)
    length = pos + 1
    per_split = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, length)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < G
    d_mask = d < HEAD_DIM
    heads = kvh * G + g
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if F32_DOT:
        q = q.to(tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # log2(e): exp2 below

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    table = Tables + b * stride_tb
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        page = tl.load(table + n // PAGE, mask=n_mask, other=0).to(tl.int64)
        page = tl.minimum(tl.maximum(page, 0), num_pool_blocks - 1)
        slot = n % PAGE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(K + page[:, None] * stride_kn + slot[:, None] * stride_kt + kvh * stride_kh + d[None, :],
                    mask=kv_mask, other=0.0).to(q.dtype)
        if F32_DOT:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        # float32 whatever width the scale arrives in (inductor passes Python floats as fp64, which would turn the
        # running maximum into fp64 inside the loop)
        qk = tl.where(n_mask[None, :], (qk * qk_scale).to(tl.float32), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + page[:, None] * stride_vn + slot[:, None] * stride_vt + kvh * stride_vh + d[None, :],
                    mask=kv_mask, other=0.0).to(q.dtype)
        if F32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
        m_i = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    if SINGLE:
        out = acc / l_i[:, None]
        tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(Out.dtype.element_ty),
                 mask=out_mask)
    elif num_splits == 1:  # one split known only at run time (a compiled, dynamic batch): no stage 2 follows
        out = acc / l_i[:, None]
        tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(Out.dtype.element_ty),
                 mask=out_mask)
    else:
        if start < end:
            mid = MidO + b * stride_mb + heads * stride_mh + split * stride_ms
            tl.store(mid[:, None] + d[None, :], acc / l_i[:, None], mask=out_mask)
            # log-sum-exp in base 2 (the scores above are in log2 units)
            tl.store(MidLse + b * stride_lb + heads * stride_lh + split, m_i + tl.log2(l_i), mask=g_mask)


@triton.jit
def paged_decode_stage2(
    MidO, MidLse, Pos, Out,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
    stride_ob, stride_oh,
    cap, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    pos = tl.load(Pos + b).to(tl.int64)
    pos = tl.minimum(tl.maximum(pos, 0), cap - 1)
    length = pos + 1
    per_split = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
    used = tl.cdiv(length, per_split)  # splits that saw at least one key

    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    base = b * stride_mb + h * stride_mh
    lse_base = b * stride_lb + h * stride_lh
    m = float("-inf")
    total = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s in range(0, used):
        lse = tl.load(MidLse + lse_base + s)
        o = tl.load(MidO + base + s * stride_ms + d, mask=d_mask, other=0.0)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        total = total * alpha + w
        acc = acc * alpha + w * o
        m = m_new
    tl.store(Out + b * stride_ob + h * stride_oh + d, (acc / total).to(Out.dtype.element_ty), mask=d_mask)
