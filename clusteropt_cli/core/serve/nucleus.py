"""Top-p without sorting the vocabulary: Gumbel-max with rejection of candidates outside the nucleus.

A sampled row draws token = argmax over the nucleus of s(v) = x(v) - log E(v) (device_sampling's Gumbel-max). The
nucleus is a prefix of the vocabulary ranked by x (largest first, ties in token order: the order a stable sort
gives): token c is in it when the mass of the tokens ranked before it is at most top_p × the total mass. So:

1. c = argmax of s over the whole vocabulary (every SM: the same kernels as temperature-only sampling);
2. c in the nucleus → c is the answer (nothing in the nucleus scores higher). That holds with probability at least
   top_p, whatever the distribution, so most rows stop here;
3. otherwise the nucleus lies before c: the next candidate is the argmax of s over the tokens ranked before c, and
   so on until a candidate is in the nucleus (the top-ranked token always is). Each round is one pass over the row.

Steps 1–2 are tensor ops (choose_tokens' TOP_P mode). Step 3 runs only for the rows that need it: on CUDA one Triton
program per row that returns at once when its row is done (a data-dependent loop inside a CUDA graph without a
host round trip), on CPU a loop over those rows. The token is the one the full sort gives; masses are summed in
another order than the sort's running sum, so a row whose nucleus boundary is within float rounding of top_p can
differ (as between any two summation orders).
"""

from __future__ import annotations

from typing import Any

BLOCK = 2048
_STATE: dict[str, Any] = {}


def mass_before(x, top, c):
    """(The unnormalized mass exp(x - top) of the tokens ranked before token c — larger x, or equal x and a
    smaller id —, the row's total mass) of each row: x [B, V], top [B, 1] (the row's largest x, 0 when not
    finite), c [B] → two [B]. Row sums over one pass (one fused reduction compiled)."""
    import torch

    ids = torch.arange(x.shape[-1], device=x.device)[None, :]
    xc = x.gather(1, c[:, None])
    before = (x > xc) | ((x == xc) & (ids < c[:, None]))
    w = torch.exp(x - top)
    return torch.where(before, w, torch.zeros_like(w)).sum(-1), w.sum(-1)


def rounds_torch(x, s, c, todo, top, total, top_p):
    """Step 3 for the rows marked `todo`, one row at a time (CPU, or CUDA without Triton: reads the flags on the
    host). x, s [B, V]; c [B] long (the first candidates, not in their nucleus); top (the rows' largest x), total
    (their mass exp(x - top), top taken as 0 when not finite), top_p [B] → tokens [B]."""
    import torch

    out = c.clone()
    ids = torch.arange(x.shape[-1], device=x.device)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    for b in torch.nonzero(todo).flatten().tolist():
        w = torch.exp(x[b] - top[b])
        limit = top_p[b] * total[b]
        cand, first = int(c[b]), True
        while True:
            xc = x[b, cand]
            before = (x[b] > xc) | ((x[b] == xc) & (ids < cand))
            if not first and bool(torch.where(before, w, torch.zeros_like(w)).sum() <= limit):
                break
            first = False
            scores = torch.where(before, s[b], torch.full_like(s[b], float("-inf")))
            best = scores.max()
            if not bool(before.any()) or not bool(best > float("-inf")):
                break
            cand = int(torch.nonzero(scores == best)[0])  # the first maximum
        out[b] = cand
    return out


def _kernel():
    """The Triton kernel of step 3 (built on first use; Triton is imported only here)."""
    if "kernel" in _STATE:
        return _STATE["kernel"]
    import triton
    import triton.language as tl

    @triton.jit
    def nucleus_rounds(x_ptr, s_ptr, tok_ptr, todo_ptr, top_ptr, total_ptr, p_ptr, vocab, stride,
                       BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = row.to(tl.int64) * stride
        cand = tl.load(tok_ptr + row)
        top = tl.load(top_ptr + row)
        top = tl.where(tl.abs(top) < float("inf"), top, 0.0)  # not finite (NaN included): 0, as the torch ops
        limit = tl.load(p_ptr + row) * tl.load(total_ptr + row)
        going = tl.load(todo_ptr + row) != 0
        first = tl.zeros([], tl.int32) + 1
        while going:
            xc = tl.load(x_ptr + base + cand)
            mass = tl.zeros([BLOCK], dtype=tl.float32)
            best_s = tl.full([BLOCK], float("-inf"), tl.float32)
            best_i = tl.full([BLOCK], -1, tl.int64)
            for start in range(0, vocab, BLOCK):
                idx = start + tl.arange(0, BLOCK)
                inside = idx < vocab
                xv = tl.load(x_ptr + base + idx, mask=inside, other=float("-inf"))
                sv = tl.load(s_ptr + base + idx, mask=inside, other=float("-inf"))
                before = inside & ((xv > xc) | ((xv == xc) & (idx < cand)))
                mass += tl.where(before, tl.exp(xv - top), 0.0)
                sb = tl.where(before, sv, float("-inf"))
                better = sb > best_s  # strict: a lane keeps its first maximum
                best_s = tl.where(better, sb, best_s)
                best_i = tl.where(better, idx.to(tl.int64), best_i)
            inside_nucleus = (tl.sum(mass, axis=0) <= limit) & (first == 0)
            top_s = tl.max(best_s, axis=0)
            nxt = tl.min(tl.where((best_s == top_s) & (best_i >= 0), best_i, vocab), axis=0)  # first maximum
            stop = inside_nucleus | (nxt >= vocab)
            cand = tl.where(stop, cand, nxt)
            going = stop == 0
            first = first * 0
        tl.store(tok_ptr + row, cand)

    _STATE["kernel"] = nucleus_rounds
    return nucleus_rounds


def rounds_triton(x, s, c, todo, top, total, top_p):
    """Step 3 on CUDA: one Triton program per row; a row not marked `todo` (int32) keeps its candidate and returns
    at once. Writes the tokens into `c` (contiguous) and returns it."""
    kernel = _kernel()
    x, s = x.contiguous(), s.contiguous()
    kernel[(x.shape[0],)](x, s, c, todo.contiguous(), top.contiguous(), total.contiguous(), top_p.contiguous(),
                          x.shape[-1], x.stride(0), BLOCK=BLOCK, num_warps=8)
    return c


def triton_error() -> str | None:
    """Why the Triton kernel cannot be used here (None: it can)."""
    if "error" not in _STATE:
        try:
            _kernel()
            _STATE["error"] = None
        except Exception as exc:  # noqa: BLE001 - no Triton: the sampler sorts for top-p instead
            _STATE["error"] = f"{type(exc).__name__}: {exc}"
    return _STATE["error"]


def nucleus_rounds(x, s, c, todo, top, total, top_p):
    """Step 3: the first candidate of every row marked `todo` replaced by the argmax of s over its nucleus (on
    CUDA in place of c). x, s [B, V]; c [B] long; todo [B] (int32 or bool); top (the rows' largest x), total
    (their mass exp(x - top), top taken as 0 when not finite), top_p [B]."""
    if x.is_cuda and triton_error() is None:
        try:
            return rounds_triton(x, s, c.contiguous(), todo, top, total, top_p)
        except Exception as exc:  # noqa: BLE001 - the kernel does not build here: the torch rounds (host reads)
            _STATE["error"] = f"{type(exc).__name__}: {exc}"
    if x.is_cuda:
        import torch

        if torch.cuda.is_current_stream_capturing():  # the torch rounds read the host: not inside a CUDA graph
            raise RuntimeError(f"top-p rounds need Triton inside a CUDA graph ({_STATE.get('error')})")
    return rounds_torch(x, s, c, todo, top, total, top_p)
