"""Token selection on the device, per row, for every request mix (vLLM's sampling parameters).

Every KV-cache slot has a row of sampling state on the device (`SlotSampler`): temperature, top-p, top-k, min-p,
presence/frequency/repetition penalties, `logit_bias`, the `min_tokens` stop-token suppression, a 64-bit seed,
and (for the penalties) the counts of the tokens the request generated. A step's tokens are chosen from the
step's logits with tensor ops only (`choose_tokens`), so the selection is captured in a CUDA graph next to the
decode step and chained decode steps feed sampled tokens back without a host round trip.

Randomness without generators: a row samples with the Gumbel-max trick in its exponential form,
token = argmax_v p(v) / E(v) with E(v) ~ Exp(1), and E(v) is a counter-based hash of (seed, position, v). The
noise a request sees depends on nothing but its own seed and the position of the token, so the same seed gives
the same text whatever else is batched with it (and whichever path — CUDA graph, eager, speculative — chose the
token). Requests without a seed get one drawn from the engine's random stream.

Restricted sampling takes the cheapest exact way the step's rows allow (`selection_for`): top-k (k up to
TOP_K_CAP) and min-p mask the vocabulary with thresholds from the row's largest values — the k-th largest score, the
ties at it kept in token order as a stable sort ranks them; 64 values from a two-pass Triton top-k where every k is
at most TOP_K_SMALL (topk_kernel.py), else one torch.topk of TOP_K_CAP —; top-p checks the Gumbel-max winner
against the nucleus and draws again from the tokens ranked before it when it falls outside (core/serve/nucleus.py:
no sort, and no bound on the nucleus' size needed); both together chain the two. Only a top-k above TOP_K_CAP sorts
the vocabulary (and top-p where the nucleus kernel is missing). Every mode draws the token the full sort would.

Logprobs are those of the distribution the token is sampled from before truncation: the logits after
`logit_bias`, `min_tokens` suppression, the penalties and the temperature (1 for greedy rows), log-softmaxed;
top-k / top-p / min-p then restrict which tokens can be drawn but do not renormalize the reported logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

M32 = 0xFFFFFFFF
_MIX = 0x045D9F3B  # < 2**31: every product of a 32-bit value stays inside int64
_GOLD = 0x61C88647
_SALT_ACCEPT = 0x2545F491  # speculative acceptance draws
_SALT_DRAFT = 0x5BD1E995  # the draft model's own samples
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
MAX_STOP_IDS = 64  # stop token ids suppressed for min_tokens (EOS ids included)
LOGPROB_FLOOR = -9999.0  # JSON has no -inf: suppressed tokens report this


def _hash32(x):
    """A 32-bit integer mix (values held in int64, all intermediate products below 2**63)."""
    x = ((x >> 16) ^ x) * _MIX & M32
    x = ((x >> 16) ^ x) * _MIX & M32
    return (x >> 16) ^ x


def exponential_noise(seed_lo, seed_hi, position, token_ids):
    """Exp(1) noise E(seed, position, token): seed_lo/seed_hi/position [B] int64, token_ids [B, V] or [1, V]
    int64 → [B, V] float32. Counter-based: no state, independent of the batch the row is in."""
    import torch

    k1 = _hash32(seed_lo ^ _hash32(position & M32))
    key = _hash32(seed_hi ^ _hash32(k1 + 1)) ^ k1  # per row
    h = _hash32(((token_ids * _GOLD) & M32) ^ key[:, None])  # one mixing round per element
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)  # (0, 1), 24 bits
    return -torch.log(u)


def uniform_draw(seed_lo, seed_hi, position):
    """One U(0,1) per row for (seed, position) — speculative acceptance tests. [B] int64 → [B] float32."""
    import torch

    k = _hash32(_hash32(seed_lo ^ _SALT_ACCEPT) ^ _hash32((seed_hi ^ _hash32(position & M32)) & M32))
    return ((k >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)


def penalized_logits(x, counts, prompt_mask, presence, frequency, repetition):
    """vLLM's penalties: repetition over prompt and generated tokens, frequency and presence over generated ones.
    Pointwise only (one fused kernel compiled)."""
    import torch

    c = counts.float()
    generated = c > 0
    rep = repetition[:, None]
    x = torch.where(generated | prompt_mask, torch.where(x > 0, x / rep, x * rep), x)
    return x - frequency[:, None] * c - presence[:, None] * generated.float()


def process_logits(logits, temperature, position, prompt_len, min_tokens, stop_ids, bias_ids, bias_vals, presence,
                   frequency, repetition, counts, prompt_mask, penalize: bool, divide: bool = True,
                   penalties=penalized_logits, inv_temperature=None):
    """Logits [B, V] → the processed logits the row samples from, divided by the temperature (1 for greedy rows;
    not divided with divide=False: choose_tokens then scales them inside its fused kernel). `penalize` adds
    logit_bias, min_tokens suppression and (with counts) the penalties. `inv_temperature`: the rows' factors
    1 / temperature_or_one(temperature) when already at hand (the sampler keeps them per row)."""
    import torch

    x = logits.float()
    if penalize:
        if counts is not None:
            x = penalties(x, counts, prompt_mask, presence, frequency, repetition)
        x = x.scatter_add(1, bias_ids, bias_vals)
        early = (position - prompt_len) < min_tokens  # tokens generated before this one < min_tokens
        block = torch.where(early[:, None] & (stop_ids >= 0), float("-inf"), 0.0)
        x = x.scatter_add(1, stop_ids.clamp_min(0), block)
    if not divide:
        return x
    if inv_temperature is None:
        inv_temperature = 1.0 / temperature_or_one(temperature)
    return x * inv_temperature[:, None]  # the same product the fused kernel forms


def temperature_or_one(temperature):
    import torch

    return torch.where(temperature > 0, temperature, torch.ones_like(temperature))


def perturbed_scores(scores, scale, temperature, seed_lo, seed_hi, position):
    """Gumbel-perturbed log-scores: scores - log E(seed, position, token) on sampled rows (temperature > 0), the
    scores unchanged on the others (greedy rows). The argmax of a sampled row is a sample from softmax(scores)
    (log p - log E: the Gumbel-max trick); of a greedy row, its argmax. Pointwise only: torch.compile fuses it
    into one kernel (the token ids and the row flags included)."""
    import torch

    scores = scores * scale[:, None]  # 1 / temperature (the division fused here)
    ids = torch.arange(scores.shape[-1], device=scores.device)[None, :]
    e = exponential_noise(seed_lo, seed_hi, position, ids)
    return torch.where((temperature > 0)[:, None], scores - torch.log(e), scores)


def sorted_weights(values):
    """Unnormalized probabilities of rows sorted largest first: exp(value - the row's largest), the largest taken
    as 0 when it is not finite (a row of -inf gives zeros, never NaN). Pointwise (one fused kernel compiled)."""
    import torch

    top = values[:, :1]
    return torch.exp(values - torch.where(torch.isfinite(top), top, torch.zeros_like(top)))


def perturbed_sorted(values, w, cum, top_p, top_k, min_p, temperature, seed_lo, seed_hi, position, order):
    """perturbed_scores over rows sorted largest first (values, their unnormalized probabilities w and the
    running sums cum), with the tokens outside top-k, the top-p nucleus and the min-p floor set to -inf on sampled
    rows. Pointwise only (one fused kernel compiled)."""
    import torch

    ranks = torch.arange(values.shape[-1], device=values.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, values.shape[-1]))
    keep = (((cum - w) <= top_p[:, None] * cum[:, -1:]) & (ranks < k[:, None])
            & (w >= min_p[:, None] * w[:, :1]))  # the smallest prefix whose mass reaches top_p, top k, min-p
    e = exponential_noise(seed_lo, seed_hi, position, order)
    noisy_rows = (temperature > 0)[:, None]
    return torch.where(noisy_rows & keep, values - torch.log(e),
                       torch.where(noisy_rows, torch.full_like(values, float("-inf")), values))


def perturbed_top_k(scores, top, kth, need, tie_rank, limited, min_p, temperature, seed_lo, seed_hi, position):
    """perturbed_scores over unsorted rows with the tokens outside top-k and the min-p floor set to -inf on sampled
    rows — the same tokens perturbed_sorted keeps when top_p is 1, found without sorting the vocabulary. `top`: the
    row's largest score; `kth`: its k-th largest (ties counted); `need`: how many tokens equal to kth top-k keeps
    (k minus those above it: the ties in token order, as a stable sort ranks them); `tie_rank`: the running count
    of scores equal to kth in token order; `limited`: rows where 0 < top_k < vocab. Pointwise (one fused kernel)."""
    import torch

    top_f = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.exp(scores - top_f)  # the sorted path's weights, token by token
    in_top_k = (~limited[:, None]) | (scores > kth) | ((scores == kth) & (tie_rank <= need[:, None]))
    keep = in_top_k & (w >= min_p[:, None] * torch.exp(top - top_f))
    ids = torch.arange(scores.shape[-1], device=scores.device)[None, :]
    e = exponential_noise(seed_lo, seed_hi, position, ids)
    noisy_rows = (temperature > 0)[:, None]
    return torch.where(noisy_rows & keep, scores - torch.log(e),
                       torch.where(noisy_rows, torch.full_like(scores, float("-inf")), scores))


def drawn_scores(values, ids, top_k, min_p, temperature, seed_lo, seed_hi, position, total=None, top_p=None):
    """TOP_K_DRAW's perturbed scores over each row's largest entries only — `values` [B, K] in a stable sort's order
    and their token `ids` [B, K] (topk_kernel.top_entries): ranks from top_k on and the min-p floor set to -inf on
    sampled rows, the others perturbed by the same noise as the vocabulary-wide modes (per token id); greedy rows
    keep their values. With `total` (the row's whole mass exp(x - top): row_mass) and `top_p` (TOP_K_P_DRAW), a
    candidate also needs the mass ranked before it to be at most top_p × total (rows with top_p 1: every rank).
    Pointwise but for a cumulative sum over the K candidates (compiled)."""
    import torch

    top = values[:, :1]
    top_f = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.exp(values - top_f)
    rank = torch.arange(values.shape[-1], device=values.device)[None, :]
    keep = (rank < top_k[:, None]) & (w >= min_p[:, None] * torch.exp(top - top_f))
    if total is not None:
        before = w.cumsum(-1) - w  # the mass ranked before each candidate: the sort's, over its first K entries
        keep = keep & ((top_p[:, None] >= 1.0) | (before <= top_p[:, None] * total[:, None]))
    e = exponential_noise(seed_lo, seed_hi, position, ids)
    noisy_rows = (temperature > 0)[:, None]
    return torch.where(noisy_rows & keep, values - torch.log(e),
                       torch.where(noisy_rows, torch.full_like(values, float("-inf")), values))


def _drawn_id(ids, scores):
    """The candidate id with the largest score per row (the first maximum, in sorted order)."""
    return ids.gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)


def drawn_token(values, ids, top_k, min_p, temperature, seed_lo, seed_hi, position):
    """TOP_K_DRAW's token per row: the candidate with the largest drawn_scores — the scores, their argmax and the
    id's gather in one compiled kernel."""
    return _drawn_id(ids, drawn_scores(values, ids, top_k, min_p, temperature, seed_lo, seed_hi, position))


def drawn_token_p(values, ids, total, top_k, top_p, min_p, temperature, seed_lo, seed_hi, position):
    """TOP_K_P_DRAW's token per row: drawn_token with the row's mass and top-p (compiled on its own: one argument
    layout per kernel)."""
    return _drawn_id(ids, drawn_scores(values, ids, top_k, min_p, temperature, seed_lo, seed_hi, position, total,
                                       top_p))


def row_mass(x, top, scale):
    """The unnormalized mass exp(x × scale - top) of each row [B] (top [B, 1] its largest x × scale, taken as 0
    when not finite; scale [B] the factors still to apply, 1 / temperature): one fused reduction compiled."""
    import torch

    top_f = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    return torch.exp(x * scale[:, None] - top_f).sum(-1)


def nucleus_scores(x, top, min_p, temperature, seed_lo, seed_hi, position):
    """The TOP_P mode's perturbed scores over unsorted rows, the min-p floor applied on sampled rows; `top`
    [B, 1] the row's largest x. Pointwise (one fused kernel compiled)."""
    import torch

    top_f = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    keep = torch.exp(x - top_f) >= min_p[:, None] * torch.exp(top - top_f)
    ids = torch.arange(x.shape[-1], device=x.device)[None, :]
    e = exponential_noise(seed_lo, seed_hi, position, ids)
    noisy_rows = (temperature > 0)[:, None]
    return torch.where(noisy_rows & keep, x - torch.log(e),
                       torch.where(noisy_rows, torch.full_like(x, float("-inf")), x))


def nucleus_todo(x, top, c, top_p, temperature, active=None):
    """(Sampled rows whose first candidate c lies outside the top-p nucleus — the mass ranked before it exceeds
    top_p × the total; never on top_p >= 1 rows, nor on rows not `active` when given — as int32 [B], the total
    unnormalized mass exp(x - top) [B]). One fused reduction compiled."""
    import torch

    from clusteropt_cli.core.serve.nucleus import mass_before

    top_f = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    before, total = mass_before(x, top_f, c)
    todo = (temperature > 0) & (top_p < 1) & (before > top_p * total)
    return (todo if active is None else todo & active).to(torch.int32), total


def row_max(x):
    """The largest value of each row, [B, 1], in two stages like runner.greedy_tokens (every SM on one row)."""
    rows, vocab = x.shape
    chunks = next((c for c in (256, 128, 64, 32, 16) if vocab % c == 0 and vocab // c >= 64), 1)
    if chunks == 1:
        return x.amax(-1, keepdim=True)
    return x.reshape(rows, chunks, vocab // chunks).amax(-1).amax(-1, keepdim=True)


def row_argmax(scores):
    """argmax per row, first maximum (runner.greedy_tokens: two stages, so a single row uses every SM)."""
    from clusteropt_cli.core.serve.runner import greedy_tokens

    return greedy_tokens(scores)


# How choose_tokens restricts the sampled rows (the sampler picks one per step from the rows' settings):
PLAIN = 0  # temperature only: Gumbel-max over the vocabulary
TOP_K = 1  # top-k (k <= TOP_K_SMALL) and min-p: thresholds from the TOP_K_SMALL largest (topk_kernel.py), no sort
TOP_P = 2  # top-p and min-p (no top-k): Gumbel-max candidates checked against the nucleus (core/serve/nucleus.py)
TOP_K_P = 3  # top-k (k <= TOP_K_SMALL), top-p and min-p: TOP_K's thresholds, then TOP_P's candidates
SORT = 4  # anything (a top-k above TOP_K_CAP; top-p where the TOP_P kernel is missing): one sort of the vocabulary
TOP_K_WIDE = 5  # TOP_K for a top-k up to TOP_K_CAP (or >= vocab): thresholds from torch.topk of TOP_K_CAP values
TOP_K_WIDE_P = 6  # TOP_K_P for a top-k up to TOP_K_CAP (or >= vocab)
# every sampled row has 0 < top_k <= TOP_K_SMALL and no top-p (min-p allowed; greedy rows may join): the token is
# drawn among the row's TOP_K_SMALL largest entries (topk_kernel.top_entries: values and token ids), with no pass
# over the vocabulary after them
TOP_K_DRAW = 7
TOP_K_P_DRAW = 8  # TOP_K_DRAW where some sampled row also has a top_p: one more pass, the rows' whole mass
SELECTION_MODES = (PLAIN, TOP_K, TOP_P, TOP_K_P, SORT, TOP_K_WIDE, TOP_K_WIDE_P, TOP_K_DRAW, TOP_K_P_DRAW)
TOP_K_SMALL = 64
TOP_K_CAP = 1024
# on CUDA, steps of at most this many rows sort instead of TOP_K_WIDE / TOP_K_WIDE_P: in the captured sampling graph
# on an H200 (128k vocabulary) one row took 81 µs to sort against 118 µs for top-k and 125 µs for top-k + top-p;
# at 64 rows top-k was 1.8× faster than the sort (TOP_K's Triton top-64 of one row: 20 µs against the sort's 56)
SORT_ROWS = 1

# the pointwise pieces choose_tokens and process_logits call (SlotSampler compiles each into one fused kernel)
KERNELS = {"plain": perturbed_scores, "sorted": perturbed_sorted, "weights": sorted_weights,
           "top_k": perturbed_top_k, "draw": drawn_token, "draw_p": drawn_token_p, "mass": row_mass,
           "nucleus": nucleus_scores, "todo": nucleus_todo, "penalties": penalized_logits}


def selection_mode(sort) -> int:
    """choose_tokens' `sort` argument as a mode: False → PLAIN, True → SORT (always exact), else the mode."""
    if isinstance(sort, bool):
        return SORT if sort else PLAIN
    return int(sort)


def selection_for(rows) -> int:
    """The cheapest mode that is exact for every one of these rows (RowSettings): PLAIN when none restricts its
    sampling, TOP_K_DRAW (TOP_K_P_DRAW with a top-p) when every sampled row has a top-k up to TOP_K_SMALL, TOP_K for
    top-k up to TOP_K_SMALL and min-p (TOP_K_WIDE up to TOP_K_CAP), TOP_P for top-p and min-p,
    TOP_K_P (TOP_K_WIDE_P) for both (in one row or across rows), SORT for a larger top-k."""
    restricted = [r for r in rows if r.needs_sort]
    if not restricted:
        return PLAIN
    sampled = [r for r in rows if r.temperature > 0]
    if all(0 < r.top_k <= TOP_K_SMALL for r in sampled):
        return TOP_K_P_DRAW if any(r.top_p < 1.0 for r in sampled) else TOP_K_DRAW
    if any(r.top_k > TOP_K_CAP for r in restricted):
        return SORT
    top_k = any(r.top_k > 0 for r in restricted)
    wide = any(r.top_k > TOP_K_SMALL for r in restricted)
    top_p = any(r.top_p < 1.0 for r in restricted)
    if top_p:
        return (TOP_K_WIDE_P if wide else TOP_K_P) if top_k else TOP_P
    return TOP_K_WIDE if wide else TOP_K


def top_k_bounds(scaled, top_k, cap: int = TOP_K_CAP):
    """The TOP_K modes' thresholds: (the row's largest score [B, 1], its k-th largest [B, 1], how many of the
    scores equal to the k-th top-k keeps [B], their running count in token order [B, V], limited [B]). The
    min(cap, V) largest values per row (topk_kernel.top_values) instead of a sort of V; exact for top_k <= cap."""
    import torch

    from clusteropt_cli.core.serve.topk_kernel import top_values

    vocab = scaled.shape[-1]
    cap = min(cap, vocab)
    vals = top_values(scaled, cap)
    kth = vals.gather(1, (top_k.clamp(1, cap) - 1)[:, None])
    need = top_k - (vals > kth).sum(-1)  # everything above the k-th is inside the top `cap` values
    tie_rank = (scaled == kth).cumsum(-1, dtype=torch.int32)
    # contiguous like row_max's: torch.compile guards on strides, and each layout would be one more recompile
    return vals[:, :1].clone(memory_format=torch.contiguous_format), kth, need, tie_rank, (top_k > 0) & (top_k < vocab)


def choose_tokens(scaled, temperature, top_p, top_k, min_p, seed_lo, seed_hi, position, sort,
                  perturb=None, scale=None, active=None):
    """One token per row from processed logits: greedy rows (temperature 0) take the argmax, the others sample
    (Gumbel-max over the exponential noise of (seed, position)), restricted by top-k, top-p and min-p as `sort`
    says (a mode: PLAIN; TOP_K_DRAW — exact when every sampled row has 0 < top_k <= TOP_K_SMALL and top_p 1;
    TOP_K_P_DRAW — when every sampled row has 0 < top_k <= TOP_K_SMALL; TOP_K (TOP_K_WIDE) — exact when every
    row's top_k is at most TOP_K_SMALL (TOP_K_CAP) or at least the vocabulary and its top_p is 1; TOP_P — exact
    when no row has a top_k; TOP_K_P (TOP_K_WIDE_P) — exact when every row's top_k is at most TOP_K_SMALL
    (TOP_K_CAP) or at least the vocabulary; SORT, exact for every row; False/True: PLAIN/SORT; selection_for
    picks it). A row whose every logit is -inf gives a token, never NaN. `perturb`: the KERNELS,
    compiled or not. `scale`: per-row factors still to apply to `scaled` (1 / temperature, when process_logits
    did not divide; PLAIN and the draw modes). `active` [B] bool: rows whose token is used (the others may get
    any token: TOP_P spends no rounds on them)."""
    import torch

    fns = perturb or KERNELS
    mode = selection_mode(sort)
    if mode == SORT:
        values, order = scaled.sort(dim=-1, descending=True, stable=True)  # ties keep index order (first max)
        w = fns["weights"](values)
        cum = w.cumsum(-1)
        pick = row_argmax(fns["sorted"](values, w, cum, top_p, top_k, min_p, temperature, seed_lo, seed_hi,
                                        position, order))
        return order.gather(-1, pick[:, None]).squeeze(-1)
    if mode in (TOP_K_DRAW, TOP_K_P_DRAW):
        from clusteropt_cli.core.serve.topk_kernel import top_entries

        if scale is None:  # one argument layout per compiled kernel: always a tensor
            scale = torch.ones_like(temperature)
        # the temperature applied inside top_entries' first pass: its values are the divided logits
        values, ids = top_entries(scaled, min(TOP_K_SMALL, scaled.shape[-1]), scale)
        if mode == TOP_K_DRAW:
            return fns["draw"](values, ids, top_k, min_p, temperature, seed_lo, seed_hi, position)
        total = fns["mass"](scaled, values[:, :1], scale)
        return fns["draw_p"](values, ids, total, top_k, top_p, min_p, temperature, seed_lo, seed_hi, position)
    if mode in (TOP_K, TOP_K_P, TOP_K_WIDE, TOP_K_WIDE_P):
        cap = TOP_K_CAP if mode in (TOP_K_WIDE, TOP_K_WIDE_P) else TOP_K_SMALL
        top, kth, need, tie_rank, limited = top_k_bounds(scaled, top_k, cap)
        scores = fns["top_k"](scaled, top, kth, need, tie_rank, limited, min_p, temperature, seed_lo, seed_hi,
                              position)
    if mode in (TOP_K, TOP_K_WIDE):
        return row_argmax(scores)
    if mode in (TOP_P, TOP_K_P, TOP_K_WIDE_P):
        from clusteropt_cli.core.serve.nucleus import nucleus_rounds

        if mode == TOP_P:
            top = row_max(scaled)
            scores = fns["nucleus"](scaled, top, min_p, temperature, seed_lo, seed_hi, position)
        first = row_argmax(scores)
        if active is None:  # always a tensor: None and a tensor would be two compiled variants of the kernel
            active = torch.ones(temperature.shape, dtype=torch.bool, device=temperature.device)
        todo, total = fns["todo"](scaled, top, first, top_p, temperature, active)
        return nucleus_rounds(scaled, scores, first, todo, top[:, 0], total, top_p)
    if scale is None:
        scale = torch.ones_like(temperature)
    return row_argmax(fns["plain"](scaled, scale, temperature, seed_lo, seed_hi, position))


def sample_kernel(logits, temperature, top_p, top_k, min_p, seed_lo, seed_hi, position, prompt_len, min_tokens,
                  stop_ids, bias_ids, bias_vals, presence, frequency, repetition, counts, prompt_mask,
                  sort, penalize: bool, perturb=None, inv_temperature=None, active=None):
    """process_logits + choose_tokens (PLAIN applies the temperature inside its fused noise kernel, the draw modes
    inside top_entries' first pass)."""
    fns = perturb or KERNELS
    plain = selection_mode(sort) in (PLAIN, TOP_K_DRAW, TOP_K_P_DRAW)
    if inv_temperature is None:
        inv_temperature = 1.0 / temperature_or_one(temperature)
    scaled = process_logits(logits, temperature, position, prompt_len, min_tokens, stop_ids, bias_ids, bias_vals,
                            presence, frequency, repetition, counts, prompt_mask, penalize, divide=not plain,
                            penalties=fns["penalties"], inv_temperature=inv_temperature)
    return choose_tokens(scaled, temperature, top_p, top_k, min_p, seed_lo, seed_hi, position, sort, perturb,
                         inv_temperature if plain else None, active)


@dataclass
class RowSettings:
    """The sampling settings of one request, as the sampler state stores them."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    stop_ids: tuple[int, ...] = ()  # suppressed while fewer than min_tokens tokens were generated

    @property
    def needs_sort(self) -> bool:
        return self.temperature > 0 and (self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0)

    @property
    def selection(self) -> int:
        """The choose_tokens mode this row needs (selection_for)."""
        return selection_for([self])

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0

    @property
    def penalized(self) -> bool:
        """Needs process_logits' penalize branch (bias, suppression or penalties)."""
        return bool(self.logit_bias) or self.min_tokens > 0 or self.has_penalties

    @property
    def greedy_plain(self) -> bool:
        """The argmax of the raw logits (the decode graph's own greedy tokens)."""
        return self.temperature <= 0 and not self.penalized


def split_seed(seed: int) -> tuple[int, int]:
    s = int(seed) % (1 << 64)
    return s & M32, s >> 32


def _in_inference_mode(method):
    """Run a SlotSampler method under torch.inference_mode: its state tensors are inference tensors (made under
    it), so they can only change there, and every compiled kernel sees inference tensors whichever path calls it —
    torch.compile guards on the dispatch keys, and a normal tensor on one path and an inference tensor on another
    (the captured graphs' views of the state; the prefill rows' forward output) compiled every kernel twice."""
    import functools

    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        import torch

        with torch.inference_mode():
            return method(*args, **kwargs)

    return wrapped


class SlotSampler:
    """Sampling state for `num_rows` KV-cache slots on the device, and the step's token selection.

    Row i is slot i, as in the runner's decode steps. `position` and `active` are inputs of the captured sampling
    graphs (the position of the token being chosen, and which rows decode in this step)."""

    def __init__(self, num_rows: int, vocab: int, device: Any, compiled: bool = False):
        import torch

        self.num_rows, self.vocab, self.device = num_rows, vocab, device
        with torch.inference_mode():  # inference tensors, as the engine's (see _in_inference_mode)
            self._allocate(num_rows, vocab, device)
        self.settings: list[RowSettings | None] = [None] * num_rows
        # the noise and the masking as one fused pointwise kernel (the reductions, topk and sort stay eager ops)
        self.perturb = ({name: torch.compile(fn, dynamic=True) for name, fn in KERNELS.items()} if compiled
                        else None)
        self._graphs: dict[tuple[int, bool, bool], Any] = {}
        self.graph_error: str | None = None
        self.compile_error: str | None = None
        self.nucleus_error: str | None = None  # why TOP_P steps sort instead (None: they do not)

    def _allocate(self, num_rows: int, vocab: int, device: Any) -> None:
        import torch

        f = dict(dtype=torch.float32, device=device)
        i = dict(dtype=torch.long, device=device)
        # temperature, top_p, min_p, presence, frequency, repetition, 1 / temperature (1 for greedy rows)
        self.fparams = torch.zeros(num_rows, 7, **f)
        self.fparams[:, [1, 5, 6]] = 1.0
        self.iparams = torch.zeros(num_rows, 5, **i)  # top_k, seed_lo, seed_hi, prompt_len, min_tokens
        self.stop_ids = torch.full((num_rows, MAX_STOP_IDS), -1, **i)
        self.bias_ids = torch.zeros(num_rows, MAX_LOGIT_BIAS, **i)
        self.bias_vals = torch.zeros(num_rows, MAX_LOGIT_BIAS, **f)
        self.counts = torch.zeros(num_rows, vocab, dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros(num_rows, vocab, dtype=torch.bool, device=device)
        self.position = torch.zeros(num_rows, **i)
        self.active = torch.zeros(num_rows, dtype=torch.bool, device=device)
        self.out = torch.zeros(num_rows, **i)

    # ---- state -------------------------------------------------------------------------------------------
    @_in_inference_mode
    def assign(self, slot: int, settings: RowSettings, prompt_ids: list[int]) -> None:
        """Install a request's settings in its slot's row (once per request, at admission)."""
        import torch

        s = settings
        lo, hi = split_seed(s.seed)
        temperature = torch.tensor([s.temperature], dtype=torch.float32)
        inverse = 1.0 / temperature_or_one(temperature)  # float32, as process_logits divides
        self.fparams[slot] = torch.cat([temperature, torch.tensor(
            [s.top_p, s.min_p, s.presence_penalty, s.frequency_penalty, s.repetition_penalty], dtype=torch.float32),
            inverse])
        self.iparams[slot] = torch.tensor([s.top_k, lo, hi, len(prompt_ids), s.min_tokens], dtype=torch.long)
        if s.penalized:
            stops = list(s.stop_ids)[:MAX_STOP_IDS] if s.min_tokens else []
            row = torch.full((MAX_STOP_IDS,), -1, dtype=torch.long)
            if stops:
                row[: len(stops)] = torch.tensor(stops, dtype=torch.long)
            self.stop_ids[slot] = row
            ids = torch.zeros(MAX_LOGIT_BIAS, dtype=torch.long)
            vals = torch.zeros(MAX_LOGIT_BIAS, dtype=torch.float32)
            bias = list((s.logit_bias or {}).items())[:MAX_LOGIT_BIAS]
            if bias:
                ids[: len(bias)] = torch.tensor([int(k) for k, _ in bias], dtype=torch.long)
                vals[: len(bias)] = torch.tensor([float(v) for _, v in bias], dtype=torch.float32)
            self.bias_ids[slot] = ids
            self.bias_vals[slot] = vals
            if s.has_penalties:
                self.counts[slot].zero_()
                self.prompt_mask[slot].zero_()
                if s.repetition_penalty != 1.0 and prompt_ids:
                    self.prompt_mask[slot, torch.tensor(sorted(set(prompt_ids)), device=self.device)] = True
        self.settings[slot] = s

    @_in_inference_mode
    def restore_counts(self, slot: int, token_ids: list[int]) -> None:
        """Count tokens a request generated before it got this row (resumed after a preemption) for its penalties."""
        import torch

        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        self.counts[slot].index_put_((ids,), torch.ones_like(ids, dtype=torch.int32), accumulate=True)

    def _rows(self, index):
        """The kernel's per-row arguments for the rows `index` (a slice for graphs, a long tensor otherwise)."""
        fp, ip = self.fparams[index], self.iparams[index]
        return dict(temperature=fp[:, 0], top_p=fp[:, 1], min_p=fp[:, 2], presence=fp[:, 3], frequency=fp[:, 4],
                    repetition=fp[:, 5], inv_temperature=fp[:, 6], top_k=ip[:, 0], seed_lo=ip[:, 1],
                    seed_hi=ip[:, 2], prompt_len=ip[:, 3], min_tokens=ip[:, 4], stop_ids=self.stop_ids[index],
                    bias_ids=self.bias_ids[index], bias_vals=self.bias_vals[index])

    def flags(self, slots: list[int]) -> tuple[bool, int, bool]:
        """(plain greedy for every row, the selection mode the rows need — selection_for: falsy when no row
        restricts its sampling —, any row needs penalize)."""
        rows = [self.settings[s] for s in slots]
        return all(r.greedy_plain for r in rows), selection_for(rows), any(r.penalized for r in rows)

    def mode(self, sort, device, rows: int | None = None) -> int:
        """The selection mode to run: the top-p modes become SORT where their kernel is not available (CUDA without
        Triton, or a failed capture: nucleus_error); TOP_K, TOP_K_P and the draw modes their wide forms where the
        Triton top-k is not (topk_kernel.kernel_error); on CUDA a single row's wide top-k sorts (SORT_ROWS: one
        row's torch.topk costs more than its sort). Every mode draws the same token."""
        from clusteropt_cli.core.serve.nucleus import triton_error

        mode = selection_mode(sort)
        cuda = device.type == "cuda"
        if mode in (TOP_K, TOP_K_P, TOP_K_DRAW, TOP_K_P_DRAW) and cuda:
            from clusteropt_cli.core.serve.topk_kernel import kernel_error

            if kernel_error():  # torch.topk of 64 values costs what the wide modes' topk does
                mode = TOP_K_WIDE_P if mode in (TOP_K_P, TOP_K_P_DRAW) else TOP_K_WIDE
        if mode in (TOP_P, TOP_K_P, TOP_K_WIDE_P) and (self.nucleus_error or (cuda and triton_error())):
            return SORT
        if mode in (TOP_K_WIDE, TOP_K_WIDE_P) and cuda and rows is not None and rows <= SORT_ROWS:
            return SORT
        return mode

    def count_penalties(self, slots: list[int]) -> bool:
        return any(self.settings[s].has_penalties for s in slots)

    # ---- selection ---------------------------------------------------------------------------------------
    @_in_inference_mode
    def sample(self, logits, slots: list[int], positions: list[int], *, logprobs: bool = False):
        """Tokens for rows of `logits` [n, V] belonging to `slots`, each choosing the token at `positions[i]`.
        Updates the penalty counts. Returns a device tensor [n] (and, with `logprobs`, the processed logprobs
        [n, V] as a second value)."""
        import torch

        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        return self.sample_rows(logits, slots, index, pos, logprobs=logprobs)

    @_in_inference_mode
    def sample_rows(self, logits, slots: list[int], index, pos, *, logprobs: bool = False):
        """sample() with the slots and positions already on the device (index, pos: [n] long)."""
        import torch

        _plain, sort, penalize = self.flags(slots)
        sort = self.mode(sort, logits.device, logits.shape[0])
        args = self._rows(index)
        counts = prompt_mask = None
        count = penalize and self.count_penalties(slots)
        if count:
            counts, prompt_mask = self.counts.index_select(0, index), self.prompt_mask.index_select(0, index)
        if not logprobs:
            tokens = sample_kernel(logits, position=pos, counts=counts, prompt_mask=prompt_mask, sort=sort,
                                   penalize=penalize, perturb=self.perturb, **args)
            lp = None
        else:
            scaled = process_logits(logits, args["temperature"], pos, args["prompt_len"], args["min_tokens"],
                                    args["stop_ids"], args["bias_ids"], args["bias_vals"], args["presence"],
                                    args["frequency"], args["repetition"], counts, prompt_mask, penalize,
                                    penalties=(self.perturb or KERNELS)["penalties"],
                                    inv_temperature=args["inv_temperature"])
            tokens = choose_tokens(scaled, args["temperature"], args["top_p"], args["top_k"], args["min_p"],
                                   args["seed_lo"], args["seed_hi"], pos, sort, self.perturb)
            lp = torch.log_softmax(scaled, -1).nan_to_num(nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR)
        if count:
            self.counts.index_put_((index, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)
        return (tokens, lp) if logprobs else tokens

    @_in_inference_mode
    def warm_eager(self, logits_rows) -> int:
        """Run the eager sampling path (prefill rows, steps without a graph) once per selection mode and penalty
        variant, at one row and at two: torch.compile specialises a batch of one and compiles the batch dimension
        at its first larger call, and the captured graphs pass their arguments differently. Without this the first
        sampled requests after start-up wait seconds for compilation, and with them every running request.
        Returns the calls made; sampler state is unchanged."""
        import torch

        if self.perturb is None:
            return 0
        calls = 0
        for rows in (1, 2):
            logits = logits_rows[:rows].float().clone()  # as the forward hands them over: no view of a buffer
            index = torch.arange(rows, device=self.device)
            pos = torch.zeros(rows, dtype=torch.long, device=self.device)
            args = self._rows(index)
            counted = self.counts.index_select(0, index), self.prompt_mask.index_select(0, index)
            for selection in SELECTION_MODES:
                mode = self.mode(selection, logits_rows.device, rows)
                for penalize, (counts, prompt_mask) in ((False, (None, None)), (True, (None, None)),
                                                        (True, counted)):
                    sample_kernel(logits, position=pos, counts=counts, prompt_mask=prompt_mask,
                                  sort=mode, penalize=penalize, perturb=self.perturb, **args)
                    calls += 1
        return calls

    @_in_inference_mode
    def sample_through_rows(self, buffer, logits, slots: list[int], positions: list[int], bucket: int):
        """sample() through graph_sample: the rows of `logits` [n, V] go to rows `slots` of `buffer` (the runner's
        shared logits buffer, [>= bucket, V]), only those rows are active, and the sampling graph of `bucket` rows
        (> max(slots)) chooses their tokens — one replay instead of the eager path's launches, the same tokens
        (counter-based noise; every mode draws the same token) and the same penalty counts. The decode graphs set
        position and active for their own rows at every replay."""
        import torch

        _plain, sort, penalize = self.flags(slots)
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        buffer.index_copy_(0, index, logits.float())
        self.position.index_copy_(0, index, torch.tensor(positions, dtype=torch.long, device=self.device))
        self.active[:bucket].zero_()
        self.active.index_fill_(0, index, True)
        return self.graph_sample(buffer[:bucket], bucket, sort, penalize).index_select(0, index)

    # the per-row state a staged step copies (the penalty state only when a row is penalized)
    _STATE_ROWS = ("fparams", "iparams")
    _PENALTY_ROWS = ("stop_ids", "bias_ids", "bias_vals", "counts", "prompt_mask")

    @_in_inference_mode
    def sample_staged(self, stage: SlotSampler, logits, slots: list[int], positions: list[int], bucket: int):
        """sample() through the sampling graph of `stage` (a SlotSampler of at least `bucket` rows with a
        `logits` buffer): the rows' settings and logits copied to the stage's rows 0..n-1, only they active, so
        the replay costs what `bucket` >= n rows cost whatever the slots' numbers. The same tokens (the noise is
        keyed by seed and position, not by row) and, copied back, the same penalty counts."""
        import torch

        n = len(slots)
        _plain, sort, penalize = self.flags(slots)
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        names = self._STATE_ROWS + (self._PENALTY_ROWS if penalize else ())
        for name in names:
            getattr(stage, name)[:n].copy_(getattr(self, name).index_select(0, index))
        stage.logits[:n].copy_(logits)
        stage.position[:n].copy_(torch.tensor(positions, dtype=torch.long, device=self.device))
        stage.active[:bucket].zero_()
        stage.active[:n].fill_(True)
        tokens = stage.graph_sample(stage.logits[:bucket], bucket, sort, penalize)[:n].clone()
        if penalize:
            self.counts.index_copy_(0, index, stage.counts[:n])
        return tokens

    @classmethod
    def stage_for(cls, sampler: SlotSampler, rows: int) -> SlotSampler:
        """A stage of `rows` rows for sample_staged: its own state, logits buffer and graphs, `sampler`'s
        compiled kernels and graph pool."""
        import torch

        stage = cls(rows, sampler.vocab, sampler.device)
        stage.perturb = sampler.perturb
        stage.graph_pool = getattr(sampler, "graph_pool", None)
        with torch.inference_mode():
            stage.logits = torch.zeros(rows, sampler.vocab, dtype=torch.float32, device=sampler.device)
        return stage

    @_in_inference_mode
    def processed(self, logits, slots: list[int], positions: list[int]):
        """Processed logits (temperature applied) of rows [n, V] — the speculative path's distributions."""
        import torch

        _plain, _sort, penalize = self.flags(slots)
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        a = self._rows(index)
        return process_logits(logits, a["temperature"], pos, a["prompt_len"], a["min_tokens"], a["stop_ids"],
                              a["bias_ids"], a["bias_vals"], a["presence"], a["frequency"], a["repetition"], None,
                              None, penalize), a, pos

    # ---- CUDA graphs: rows 0..batch-1 read the shared logits buffer ---------------------------------------
    @_in_inference_mode
    def graph_sample(self, logits_rows, batch: int, sort, penalize: bool):
        """Sample rows 0..batch-1 from `logits_rows` (the runner's shared logits buffer, [batch, V]) into
        self.out[:batch], counting tokens of active rows; position/active rows are inputs. `sort`: the selection
        mode (flags()). Replays a captured graph when one exists for (batch, mode, penalize); eager otherwise."""
        import torch

        sort = self.mode(sort, logits_rows.device, batch)
        key = (batch, sort, penalize)
        graph = self._graphs.get(key)
        if graph is None and self.graph_error is None and logits_rows.is_cuda:
            try:
                graph = self._capture(logits_rows, batch, sort, penalize)
            except Exception as exc:  # noqa: BLE001 - sampling still works: sorted, uncompiled, then eagerly
                torch.cuda.synchronize()
                from clusteropt_cli.core.serve import topk_kernel

                if sort in (TOP_K, TOP_K_P) and topk_kernel.kernel_error() is None:  # the Triton top-k set aside
                    topk_kernel.disable(f"{type(exc).__name__}: {exc}")
                    return self.graph_sample(logits_rows, batch, sort, penalize)
                if sort in (TOP_P, TOP_K_P, TOP_K_WIDE_P):  # top-p rows sort their vocabulary from now on
                    self.nucleus_error = f"{type(exc).__name__}: {exc}"
                    return self.graph_sample(logits_rows, batch, SORT, penalize)
                if self.perturb is not None:
                    self.compile_error = f"{type(exc).__name__}: {exc}"
                    self.perturb = None
                    self._graphs.clear()
                    return self.graph_sample(logits_rows, batch, sort, penalize)
                self.graph_error = f"{type(exc).__name__}: {exc}"
        if graph is not None:
            graph.replay()
        else:
            self._graph_body(logits_rows, batch, sort, penalize)
        return self.out[:batch]

    def capture_graphs(self, buffer, buckets: list[int]) -> None:
        """Capture the sampling graph of every bucket (largest first), selection mode and penalty variant over
        rows of `buffer`, so no request pays a compile and capture."""
        for bucket in sorted(buckets, reverse=True):
            for mode in SELECTION_MODES:
                for penalize in (False, True):
                    self.graph_sample(buffer[:bucket], bucket, mode, penalize)

    def _graph_body(self, logits_rows, batch: int, sort: int, penalize: bool) -> None:
        import torch

        rows = slice(0, batch)
        args = self._rows(rows)
        counts = self.counts[rows] if penalize else None
        prompt_mask = self.prompt_mask[rows] if penalize else None
        tokens = sample_kernel(logits_rows, position=self.position[rows], counts=counts, prompt_mask=prompt_mask,
                               sort=sort, penalize=penalize, perturb=self.perturb, active=self.active[rows], **args)
        self.out[rows].copy_(tokens)
        if penalize:
            self.counts[rows].scatter_add_(1, tokens[:, None], self.active[rows, None].to(torch.int32))

    def _capture(self, logits_rows, batch: int, sort: int, penalize: bool):
        import torch

        counts_before = self.counts[:batch].clone() if penalize else None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile / warm up outside the capture
                self._graph_body(logits_rows, batch, sort, penalize)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=getattr(self, "graph_pool", None)):
            self._graph_body(logits_rows, batch, sort, penalize)
        if counts_before is not None:  # the warm-up runs counted tokens: undo
            self.counts[:batch].copy_(counts_before)
        self._graphs[(batch, sort, penalize)] = graph
        return graph


# ---- speculative decoding ----------------------------------------------------------------------------------
def truncated_probs(scaled, top_p, top_k, min_p):
    """The normalized distribution choose_tokens samples from (top-k, top-p, min-p applied) — [B, V]."""
    import torch

    vocab = scaled.shape[-1]
    top = scaled.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    values, order = scaled.sort(-1, descending=True)
    w = torch.exp(values - top)
    cum = w.cumsum(-1)
    drop = (cum - w) > top_p[:, None] * cum[:, -1:]
    ranks = torch.arange(vocab, device=scaled.device)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    drop = drop | (ranks[None, :] >= k[:, None]) | (w < min_p[:, None] * w[:, :1])
    w = w.masked_fill(drop, 0.0)
    probs = torch.zeros_like(w).scatter(-1, order, w)
    return probs / probs.sum(-1, keepdim=True).clamp_min(1e-30)


def _expand(args: dict[str, Any], n: int, key: str):
    return args[key][:1].expand(n) if args[key].shape[0] == 1 else args[key]


def speculative_accept(scaled, args: dict[str, Any], positions, draft_tokens: list[int], draft_probs,
                       settings: RowSettings) -> list[int]:
    """Speculative verification of one sequence on its processed target logits `scaled` [k+1, V] (rows at the
    positions of the k drafts and the bonus token; `args` the sampler's row settings of these rows). Returns the
    tokens to append: accepted drafts plus one.

    Greedy: drafts are kept while they equal the target's argmax (token-for-token the target's greedy output).
    Sampling with a deterministic drafter (prompt lookup, draft_probs None): the target's own sample at each
    position (the same Gumbel noise as a plain decode step) is compared with the draft; equal → accepted. That is
    the rejection rule for a one-hot proposal (accept with p(d), else sample p without d) and gives the same
    tokens as decoding without speculation. With a draft model (draft_probs [k, V], the distributions the drafts
    were drawn from): accept d with probability min(1, p(d)/q(d)), on rejection sample normalize(max(0, p - q)),
    and the bonus token from p (Leviathan et al. / Chen et al.): the output follows the target's distribution."""
    import torch

    k = len(draft_tokens)
    if settings.temperature <= 0:
        best = scaled.argmax(-1).tolist()
        out = []
        for i in range(k):
            out.append(best[i])
            if best[i] != draft_tokens[i]:
                return out
        out.append(best[k])
        return out
    n = k + 1
    seed_lo, seed_hi = _expand(args, n, "seed_lo"), _expand(args, n, "seed_hi")
    own = choose_tokens(scaled, _expand(args, n, "temperature"), _expand(args, n, "top_p"),
                        _expand(args, n, "top_k"), _expand(args, n, "min_p"), seed_lo, seed_hi, positions,
                        sort=settings.needs_sort).tolist()
    if draft_probs is None:
        out = []
        for i in range(k):
            out.append(own[i])
            if own[i] != draft_tokens[i]:
                return out
        out.append(own[k])
        return out
    p = truncated_probs(scaled, _expand(args, n, "top_p"), _expand(args, n, "top_k"), _expand(args, n, "min_p"))
    q = draft_probs.to(p.dtype)
    d = torch.tensor(draft_tokens, dtype=torch.long, device=p.device)
    p_d = p[:k].gather(1, d[:, None])[:, 0]
    q_d = q.gather(1, d[:, None])[:, 0].clamp_min(1e-20)
    u = uniform_draw(seed_lo[:k], seed_hi[:k], positions[:k])
    accept = (u < (p_d / q_d).clamp(max=1.0)).tolist()
    out = []
    for i, token in enumerate(draft_tokens):
        if accept[i]:
            out.append(token)
            continue
        residual = (p[i] - q[i]).clamp_min(0.0)
        if float(residual.sum()) <= 0:
            residual = p[i]
        noise = exponential_noise(seed_lo[i : i + 1], seed_hi[i : i + 1], positions[i : i + 1],
                                  torch.arange(p.shape[-1], device=p.device)[None, :])
        out.append(int((residual[None, :] / noise).argmax(-1)))
        return out
    out.append(own[k])
    return out


def draft_sample(scaled, args: dict[str, Any], positions):
    """The draft model's sampled tokens and the distributions they were drawn from (rows [B, V]); its noise is
    salted so that it is independent of the target's at the same position."""
    import torch

    probs = truncated_probs(scaled, args["top_p"], args["top_k"], args["min_p"])
    ids = torch.arange(scaled.shape[-1], device=scaled.device)[None, :]
    noise = exponential_noise(args["seed_lo"] ^ _SALT_DRAFT, args["seed_hi"], positions, ids)
    return (probs / noise).argmax(-1), probs
