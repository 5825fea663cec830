"""choose_tokens' selection modes give the tokens of the full-vocabulary sort they replace: the top-k threshold mode
(torch.topk, no sort) and the fused sort path against a private copy of the previous sort-based implementation,
over random rows, seeds, positions, top_k / top_p / min_p values and ties."""

from __future__ import annotations

import pytest


def _reference_choose(scaled, temperature, top_p, top_k, min_p, seed_lo, seed_hi, position, sort: bool):
    """The previous choose_tokens (eager): a stable descending sort of the whole vocabulary for top-k / top-p /
    min-p, Gumbel-max with the counter noise; kept here as the reference the package is checked against."""
    import torch

    from clusteropt_cli.core.serve.device_sampling import exponential_noise
    from clusteropt_cli.core.serve.runner import greedy_tokens

    noisy = temperature > 0
    if sort:
        values, order = scaled.sort(dim=-1, descending=True, stable=True)
        top = values[:, :1]
        w = torch.exp(values - torch.where(torch.isfinite(top), top, torch.zeros_like(top)))
        cum = w.cumsum(-1)
        ranks = torch.arange(values.shape[-1])[None, :]
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, values.shape[-1]))
        keep = (((cum - w) <= top_p[:, None] * cum[:, -1:]) & (ranks < k[:, None])
                & (w >= min_p[:, None] * w[:, :1]))
        e = exponential_noise(seed_lo, seed_hi, position, order)
        rows = noisy[:, None]
        scores = torch.where(rows & keep, values - torch.log(e),
                             torch.where(rows, torch.full_like(values, float("-inf")), values))
        pick = greedy_tokens(scores)
        return order.gather(-1, pick[:, None]).squeeze(-1)
    ids = torch.arange(scaled.shape[-1])[None, :]
    e = exponential_noise(seed_lo, seed_hi, position, ids)
    return greedy_tokens(torch.where(noisy[:, None], scaled - torch.log(e), scaled))


def _logits(gen, rows: int, vocab: int, kind: str):
    """[rows, vocab] scaled logits: continuous, heavily tied (quarter steps), peaked, with -inf entries, or
    degenerate (constant rows, all -inf rows)."""
    import torch

    x = torch.randn(rows, vocab, generator=gen) * 2.0
    if kind == "ties":
        x = torch.round(x * 4) / 4
    elif kind == "peaked":
        x = x * 4.0
    elif kind == "masked":
        x[torch.rand(rows, vocab, generator=gen) < 0.3] = float("-inf")
    elif kind == "degenerate":
        x[0::3] = 0.5
        x[1::3] = float("-inf")
    return x


def _args(gen, rows: int, **fixed):
    import torch

    temperature = torch.where(torch.rand(rows, generator=gen) < 0.15, 0.0, 1.0)  # some greedy rows in the mix
    seeds = torch.randint(0, 1 << 62, (rows,), generator=gen)
    out = dict(temperature=temperature, top_p=torch.ones(rows), top_k=torch.zeros(rows, dtype=torch.long),
               min_p=torch.zeros(rows), seed_lo=seeds & 0xFFFFFFFF, seed_hi=seeds >> 32,
               position=torch.randint(0, 5000, (rows,), generator=gen))
    for key, value in fixed.items():
        out[key] = value if isinstance(value, torch.Tensor) else torch.full_like(out[key], value)
    return out


def _both(scaled, args, mode):
    from clusteropt_cli.core.serve.device_sampling import choose_tokens

    order = ("temperature", "top_p", "top_k", "min_p", "seed_lo", "seed_hi", "position")
    new = choose_tokens(scaled, *(args[k] for k in order), mode)
    old = _reference_choose(scaled, *(args[k] for k in order), True)
    return new, old


def _check_tie_order(gen, scaled, top_k, mode) -> None:
    """On tied rows, every row sampled: `mode` gives the sort's tokens, and a top-k one larger would not (the
    check has teeth)."""
    import torch

    args = _args(gen, scaled.shape[0], top_k=top_k, temperature=1.0)
    new, old = _both(scaled, args, mode)
    assert torch.equal(new, old)
    wrong = _reference_choose(scaled, args["temperature"], args["top_p"], args["top_k"] + 1, args["min_p"],
                              args["seed_lo"], args["seed_hi"], args["position"], True)
    assert not torch.equal(new, wrong)


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("kind", ["continuous", "ties", "peaked", "masked", "degenerate"])
@pytest.mark.parametrize("vocab", [3000, 600])
def test_top_k_threshold_mode_equals_the_full_sort(kind, vocab, wide):
    """TOP_K (every k up to TOP_K_SMALL, or at least the vocabulary) and TOP_K_WIDE (up to TOP_K_CAP)."""
    import torch

    from clusteropt_cli.core.serve.device_sampling import TOP_K, TOP_K_CAP, TOP_K_SMALL, TOP_K_WIDE

    gen = torch.Generator().manual_seed(vocab + len(kind))
    rows = 96
    scaled = _logits(gen, rows, vocab, kind)
    cap = min(TOP_K_CAP if wide else TOP_K_SMALL, vocab)
    TOP_K = TOP_K_WIDE if wide else TOP_K  # noqa: N806 - the mode under test
    ks = torch.tensor([0, 1, 2, 50, cap, vocab, vocab + 7, -1], dtype=torch.long)
    top_k = ks[torch.arange(rows) % len(ks)]
    top_k[5::len(ks)] = torch.randint(1, cap + 1, (len(top_k[5::len(ks)]),), generator=gen)
    for min_p in (0.0, 0.05, 0.6):
        args = _args(gen, rows, top_k=top_k, min_p=min_p)
        new, old = _both(scaled, args, TOP_K)
        assert torch.equal(new, old), f"rows {torch.nonzero(new != old).flatten().tolist()} differ (min_p {min_p})"
        # the check can fail: a top-k mask that ignores the tie order picks other tokens on tied rows
    if kind == "ties":
        _check_tie_order(gen, scaled, top_k, TOP_K)


@pytest.mark.parametrize("kind", ["continuous", "ties", "peaked", "masked", "degenerate"])
@pytest.mark.parametrize("vocab", [3000, 40])
def test_top_k_draw_modes_equal_the_full_sort(kind, vocab):
    """TOP_K_DRAW (every sampled row with 0 < top_k <= TOP_K_SMALL, greedy rows mixed in, min-p) and TOP_K_P_DRAW
    (top-p too): the token drawn among each row's TOP_K_SMALL largest entries is the full sort's, ties and all -inf
    rows included."""
    import torch

    from clusteropt_cli.core.serve.device_sampling import TOP_K_DRAW, TOP_K_P_DRAW, TOP_K_SMALL

    gen = torch.Generator().manual_seed(vocab + 3 * len(kind))
    rows = 96
    scaled = _logits(gen, rows, vocab, kind)
    ks = torch.tensor([1, 2, 3, 17, 50, TOP_K_SMALL], dtype=torch.long)
    top_k = ks[torch.arange(rows) % len(ks)]
    top_k[4::len(ks)] = torch.randint(1, TOP_K_SMALL + 1, (len(top_k[4::len(ks)]),), generator=gen)
    ps = torch.tensor([1.0, 0.95, 0.9, 0.5, 1e-6])
    top_p = ps[torch.arange(rows) % len(ps)]
    for min_p in (0.0, 0.05, 0.6):
        args = _args(gen, rows, top_k=top_k, min_p=min_p)
        new, old = _both(scaled, args, TOP_K_DRAW)
        assert torch.equal(new, old), f"rows {torch.nonzero(new != old).flatten().tolist()} differ (min_p {min_p})"
        args = _args(gen, rows, top_k=top_k, top_p=top_p, min_p=min_p)  # TOP_K_P_DRAW: top-p within the top-k
        new, old = _both(scaled, args, TOP_K_P_DRAW)
        assert torch.equal(new, old), f"rows {torch.nonzero(new != old).flatten().tolist()} differ (min_p {min_p})"
    if kind == "ties":  # the check can fail: a draw that ignores the tie order picks other tokens on tied rows
        _check_tie_order(gen, scaled, top_k, TOP_K_DRAW)


def test_top_entries_are_a_stable_sorts_first_entries():
    """topk_kernel.top_entries (torch keys off CUDA): the values and token ids of a stable descending sort, with
    ties, -inf, -0.0 against 0.0 and k at least the vocabulary."""
    import torch

    from clusteropt_cli.core.serve.topk_kernel import top_entries

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 3000, generator=gen)
    x[0, :1000] = float("-inf")
    x[1, 100:400] = x[1, 7]
    x[2, ::3], x[2, 1::3] = 0.0, -0.0
    x[3] = torch.round(x[3] * 2)
    for k, width in ((64, 3000), (16, 3000), (40, 40)):
        values, ids = top_entries(x[:, :width], k)
        sorted_values, order = x[:, :width].sort(dim=-1, descending=True, stable=True)
        assert torch.equal(ids, order[:, :k]) and torch.equal(values, sorted_values[:, :k])


@pytest.mark.parametrize("kind", ["continuous", "ties", "peaked", "masked", "degenerate"])
def test_sort_mode_equals_the_previous_sort(kind):
    import torch

    from clusteropt_cli.core.serve.device_sampling import SORT

    gen = torch.Generator().manual_seed(7 + len(kind))
    rows, vocab = 120, 2000
    scaled = _logits(gen, rows, vocab, kind)
    ps = torch.tensor([1.0, 1e-6, 0.1, 0.5, 0.9, 0.95, 0.999])
    top_p = ps[torch.arange(rows) % len(ps)]
    ks = torch.tensor([0, 0, 1, 40, 1500, vocab + 3], dtype=torch.long)
    top_k = ks[torch.arange(rows) % len(ks)]
    for min_p in (0.0, 0.02):
        args = _args(gen, rows, top_p=top_p, top_k=top_k, min_p=min_p)
        new, old = _both(scaled, args, SORT)
        assert torch.equal(new, old)
        assert torch.equal(_both(scaled, args, True)[0], old)  # True: the sort mode


@pytest.mark.parametrize("with_top_k", [False, True])
@pytest.mark.parametrize("kind", ["continuous", "ties", "peaked", "masked", "degenerate"])
def test_top_p_candidate_mode_equals_the_full_sort(kind, with_top_k):
    """Top-p without a sort: the first Gumbel-max candidate checked against the nucleus, then the rounds over the
    tokens ranked before it (many rows need several: small top_p on flat rows)."""
    import torch

    from clusteropt_cli.core.serve import nucleus
    from clusteropt_cli.core.serve.device_sampling import TOP_K_P, TOP_K_WIDE_P, TOP_P, choose_tokens

    gen = torch.Generator().manual_seed(11 + len(kind))
    rows, vocab = 140, 2500
    scaled = _logits(gen, rows, vocab, kind)
    ps = torch.tensor([1.0, 1e-6, 0.05, 0.3, 0.5, 0.9, 0.95])
    top_p = ps[torch.arange(rows) % len(ps)]
    ks = torch.tensor([0, 1, 3, 40, 700, 1024, vocab + 1, 0, 0], dtype=torch.long)  # 9 values: crosses the 7 p's
    top_k = ks[torch.arange(rows) % len(ks)] if with_top_k else torch.zeros(rows, dtype=torch.long)
    mode = TOP_K_WIDE_P if with_top_k else TOP_P
    if with_top_k:  # and TOP_K_P over the k it is exact for (up to TOP_K_SMALL, or at least the vocabulary)
        small = torch.where((top_k > 64) & (top_k <= vocab), top_k % 64, top_k)
        args = _args(gen, rows, top_p=top_p, top_k=small, min_p=0.03)
        new, old = _both(scaled, args, TOP_K_P)
        assert torch.equal(new, old), f"rows {torch.nonzero(new != old).flatten().tolist()} differ"
    calls = []
    rounds = nucleus.rounds_torch

    def counted(x, s, c, todo, *rest):
        calls.append(int(todo.sum()))
        return rounds(x, s, c, todo, *rest)

    nucleus.rounds_torch = counted
    try:
        for min_p in (0.0, 0.03):
            args = _args(gen, rows, top_p=top_p, top_k=top_k, min_p=min_p)
            new, old = _both(scaled, args, mode)
            assert torch.equal(new, old), f"rows {torch.nonzero(new != old).flatten().tolist()} differ"
    finally:
        nucleus.rounds_torch = rounds
    assert sum(calls) > 10  # the rounds ran for rows whose first candidate was outside the nucleus
    # without the rounds (the first candidate kept) the tokens are other ones
    args = _args(gen, rows, top_p=top_p, top_k=top_k)
    order = ("temperature", "top_p", "top_k", "min_p", "seed_lo", "seed_hi", "position")
    unchecked = choose_tokens(scaled, *(args[k] for k in order), mode, perturb=None)
    nucleus.rounds_torch = lambda x, s, c, *rest: c
    try:
        skipped = choose_tokens(scaled, *(args[k] for k in order), mode)
    finally:
        nucleus.rounds_torch = rounds
    assert not torch.equal(unchecked, skipped)


def test_top_p_rounds_kernel_equals_the_torch_rounds(tmp_path):
    """The Triton kernel of the rounds (CUDA's path), run by Triton's interpreter on the CPU, gives the torch
    rounds' tokens."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    script = tmp_path / "rounds.py"
    script.write_text(
        "import torch\n"
        "from clusteropt_cli.core.serve.nucleus import rounds_torch, rounds_triton\n"
        "from clusteropt_cli.core.serve.device_sampling import KERNELS, row_argmax\n"
        "g = torch.Generator().manual_seed(5)\n"
        "for vocab, quant in ((3000, False), (5000, True)):\n"
        "    x = torch.randn(24, vocab, generator=g) * 2\n"
        "    x = torch.round(x * 4) / 4 if quant else x\n"
        "    x[3] = 0.25\n"
        "    top = x.amax(-1, keepdim=True)\n"
        "    t = torch.ones(24)\n"
        "    seeds = torch.arange(24) * 7919\n"
        "    x[5, :7] = float('-inf')\n"
        "    s = KERNELS['nucleus'](x, top, torch.zeros(24), t, seeds, seeds * 0, torch.arange(24))\n"
        "    c = row_argmax(s)\n"
        "    p = torch.tensor([1e-6, 0.05, 0.3, 0.6] * 6)\n"
        "    todo, total = KERNELS['todo'](x, top, c, p, t)\n"
        "    assert int(todo.sum()) >= 6, int(todo.sum())\n"
        "    a = rounds_torch(x, s, c, todo, top[:, 0], total, p)\n"
        "    b = rounds_triton(x, s, c.clone(), todo, top[:, 0], total, p)\n"
        "    assert torch.equal(a, b), (a.tolist(), b.tolist())\n"
        "    assert not torch.equal(a, c)\n"
        "print('ok')\n")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(sys.path))
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-3000:]


def test_plain_mode_equals_the_previous_plain_path():
    import torch

    from clusteropt_cli.core.serve.device_sampling import PLAIN, choose_tokens, temperature_or_one

    gen = torch.Generator().manual_seed(3)
    raw = _logits(gen, 64, 1000, "ties")
    args = _args(gen, 64)
    args["temperature"] = torch.where(args["temperature"] > 0, torch.rand(64, generator=gen) + 0.3, 0.0)
    scale = 1.0 / temperature_or_one(args["temperature"])
    order = ("temperature", "top_p", "top_k", "min_p", "seed_lo", "seed_hi", "position")
    new = choose_tokens(raw, *(args[k] for k in order), PLAIN, scale=scale)
    old = _reference_choose(raw * scale[:, None], *(args[k] for k in order), False)
    assert torch.equal(new, old)


@pytest.mark.parametrize("kind", ["ties", "continuous"])
def test_draw_modes_apply_the_temperature_as_the_sort_path_does(kind):
    """The draw modes take undivided logits and each row's 1 / temperature (applied in top_entries' first pass and
    in the row's mass): the same tokens as the full sort over the divided logits, at temperatures 0.3–1.3 with
    greedy rows mixed in (the check can fail: a draw that kept the raw values, or divided the mass differently)."""
    import torch

    from clusteropt_cli.core.serve.device_sampling import (
        TOP_K_DRAW,
        TOP_K_P_DRAW,
        choose_tokens,
        temperature_or_one,
    )

    gen = torch.Generator().manual_seed(11 + len(kind))
    rows = 64
    raw = _logits(gen, rows, 3000, kind)
    top_k = torch.randint(1, 65, (rows,), generator=gen)
    top_p = torch.tensor([1.0, 0.95, 0.6, 0.3])[torch.arange(rows) % 4]
    order = ("temperature", "top_p", "top_k", "min_p", "seed_lo", "seed_hi", "position")
    for mode, p in ((TOP_K_DRAW, None), (TOP_K_P_DRAW, top_p)):
        args = _args(gen, rows, top_k=top_k, **({"top_p": p} if p is not None else {}))
        args["temperature"] = torch.where(args["temperature"] > 0, torch.rand(rows, generator=gen) + 0.3, 0.0)
        scale = 1.0 / temperature_or_one(args["temperature"])
        new = choose_tokens(raw, *(args[k] for k in order), mode, scale=scale)
        want = _reference_choose(raw * scale[:, None], *(args[k] for k in order), True)
        assert torch.equal(new, want), f"mode {mode}: rows {torch.nonzero(new != want).flatten().tolist()} differ"
        undivided = _reference_choose(raw, *(args[k] for k in order), True)
        assert not torch.equal(undivided, want)  # the temperatures change the draw: the check means something


def test_rows_pick_the_cheapest_exact_mode():
    from clusteropt_cli.core.serve.device_sampling import (
        PLAIN,
        SORT,
        TOP_K,
        TOP_K_CAP,
        TOP_K_DRAW,
        TOP_K_P,
        TOP_K_P_DRAW,
        TOP_K_SMALL,
        TOP_K_WIDE,
        TOP_K_WIDE_P,
        TOP_P,
        RowSettings,
        selection_for,
    )

    assert RowSettings(temperature=0.0, top_p=0.5, top_k=5).selection == PLAIN  # greedy: argmax
    assert RowSettings(temperature=1.0).selection == PLAIN
    assert RowSettings(temperature=1.0, top_k=50).selection == TOP_K_DRAW
    assert RowSettings(temperature=1.0, top_k=50, min_p=0.1).selection == TOP_K_DRAW
    assert RowSettings(temperature=1.0, min_p=0.1).selection == TOP_K
    assert RowSettings(temperature=1.0, top_k=TOP_K_SMALL).selection == TOP_K_DRAW
    assert RowSettings(temperature=1.0, top_k=TOP_K_SMALL + 1).selection == TOP_K_WIDE
    assert RowSettings(temperature=1.0, top_k=TOP_K_CAP).selection == TOP_K_WIDE
    assert RowSettings(temperature=1.0, top_k=TOP_K_CAP + 1).selection == SORT
    assert RowSettings(temperature=1.0, top_p=0.95).selection == TOP_P
    assert RowSettings(temperature=1.0, top_p=0.95, min_p=0.1).selection == TOP_P
    assert RowSettings(temperature=1.0, top_p=0.95, top_k=50).selection == TOP_K_P_DRAW
    assert selection_for([RowSettings(temperature=1.0, top_p=0.95, top_k=50),
                          RowSettings(temperature=1.0, top_k=9)]) == TOP_K_P_DRAW
    assert RowSettings(temperature=1.0, top_p=0.95, top_k=100).selection == TOP_K_WIDE_P
    assert RowSettings(temperature=1.0, top_p=0.95, top_k=TOP_K_CAP + 1).selection == SORT
    top_p, top_k, min_p = (RowSettings(temperature=1.0, top_p=0.9), RowSettings(temperature=1.0, top_k=9),
                           RowSettings(temperature=1.0, min_p=0.2))
    assert selection_for([top_p, min_p, RowSettings()]) == TOP_P and selection_for([top_k, min_p]) == TOP_K
    # TOP_K_DRAW: every sampled row has a small top-k (greedy rows may join; a plain sampled row may not)
    assert selection_for([top_k, RowSettings(), RowSettings(temperature=0.0, top_k=500)]) == TOP_K_DRAW
    assert selection_for([top_k, RowSettings(temperature=1.0)]) == TOP_K
    assert selection_for([top_p, top_k]) == TOP_K_P
    wide = RowSettings(temperature=1.0, top_k=200)
    assert selection_for([top_k, wide]) == TOP_K_WIDE and selection_for([top_p, wide]) == TOP_K_WIDE_P


def test_a_single_row_sorts_for_a_wide_top_k_on_cuda_only(monkeypatch):
    """On CUDA one row's wide top-k (torch.topk of TOP_K_CAP values) runs as the sort (cheaper there for one row);
    more rows, or a CPU, keep the mode. TOP_K (the Triton top-64) stays TOP_K for one row, and becomes the wide
    mode where that kernel is unavailable. Every mode draws the same token (test_top_k_threshold_mode_...)."""
    from types import SimpleNamespace

    import torch

    from clusteropt_cli.core.serve import topk_kernel
    from clusteropt_cli.core.serve.device_sampling import (
        PLAIN,
        SORT,
        SORT_ROWS,
        TOP_K,
        TOP_K_P,
        TOP_K_WIDE,
        TOP_K_WIDE_P,
        TOP_P,
        SlotSampler,
    )

    sampler = SlotSampler(4, 32, torch.device("cpu"))
    cuda, cpu = SimpleNamespace(type="cuda"), torch.device("cpu")
    monkeypatch.setattr(topk_kernel, "kernel_error", lambda: None)
    monkeypatch.setattr("clusteropt_cli.core.serve.nucleus.triton_error", lambda: None)
    assert sampler.mode(TOP_K_WIDE, cuda, SORT_ROWS) == SORT
    assert sampler.mode(TOP_K_WIDE, cuda, SORT_ROWS + 1) == TOP_K_WIDE
    assert sampler.mode(TOP_K_WIDE, cpu, 1) == TOP_K_WIDE and sampler.mode(TOP_K_WIDE, cuda) == TOP_K_WIDE
    assert sampler.mode(TOP_K, cuda, 1) == TOP_K and sampler.mode(TOP_K_P, cuda, 1) == TOP_K_P
    assert sampler.mode(PLAIN, cuda, 1) == PLAIN
    assert sampler.mode(TOP_P, cpu, 1) == TOP_P
    monkeypatch.setattr(topk_kernel, "kernel_error", lambda: "no tl.topk")
    assert sampler.mode(TOP_K, cuda, 4) == TOP_K_WIDE and sampler.mode(TOP_K_P, cuda, 4) == TOP_K_WIDE_P
    assert sampler.mode(TOP_K, cuda, 1) == SORT and sampler.mode(TOP_K, cpu, 1) == TOP_K


def test_the_sampler_mixes_modes_per_step_and_keeps_the_sorted_tokens():
    """SlotSampler: a step's mode is the cheapest its rows allow together; each row's token is the one the
    previous full sort gave it (penalties and min_tokens suppression on), and a top-k row gives the same token
    whether its step ran in the top-k mode, next to a top-p row (top-k + top-p mode) or in the sort mode."""
    import torch

    from clusteropt_cli.core.serve.device_sampling import (
        SORT,
        TOP_K,
        TOP_K_WIDE_P,
        RowSettings,
        SlotSampler,
        process_logits,
    )

    vocab = 1500
    sampler = SlotSampler(5, vocab, torch.device("cpu"))
    rows = [RowSettings(temperature=0.8, top_k=40, seed=11, presence_penalty=0.4, min_tokens=3, stop_ids=(2,)),
            RowSettings(temperature=1.0, min_p=0.05, seed=12),
            RowSettings(temperature=0.0, repetition_penalty=1.3),
            RowSettings(temperature=1.2, top_p=0.9, top_k=100, seed=13),
            RowSettings(temperature=1.0, top_k=2000, seed=14)]
    for slot, settings in enumerate(rows):
        sampler.assign(slot, settings, [5, 6, 7])
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=gen) * 3
    positions = [4, 9, 4, 6]
    assert sampler.flags([0, 1, 2])[1] == TOP_K and sampler.flags([0, 3])[1] == TOP_K_WIDE_P  # row 3: top_k 100
    assert sampler.flags([0, 3, 4])[1] == SORT  # a top-k above TOP_K_CAP
    counts = sampler.counts.clone()
    top_k_step = sampler.sample(logits[:3], [0, 1, 2], positions[:3])
    with torch.inference_mode():  # the sampler's state only changes there (inference tensors)
        sampler.counts.copy_(counts)
    sort_step = sampler.sample(torch.cat([logits, logits[:1]]), [0, 1, 2, 3, 4], positions + [5])[:4]
    with torch.inference_mode():
        sampler.counts.copy_(counts)
    mixed_step = sampler.sample(logits, [0, 1, 2, 3], positions)
    assert torch.equal(top_k_step, sort_step[:3]) and torch.equal(mixed_step, sort_step)
    a = sampler._rows(torch.arange(4))
    pos = torch.tensor(positions)
    scaled = process_logits(logits, a["temperature"], pos, a["prompt_len"], a["min_tokens"], a["stop_ids"],
                            a["bias_ids"], a["bias_vals"], a["presence"], a["frequency"], a["repetition"], counts[:4],
                            sampler.prompt_mask[:4], True)
    old = _reference_choose(scaled, a["temperature"], a["top_p"], a["top_k"], a["min_p"], a["seed_lo"],
                            a["seed_hi"], pos, True)
    assert torch.equal(sort_step, old)
    assert int(sort_step[0]) != 2  # the stop id is suppressed before min_tokens


def test_sampling_graph_spends_no_rounds_on_inactive_rows():
    """The sampling graph's rows outside the step (stale settings, scratch logits) take no top-p rounds."""
    import torch

    from clusteropt_cli.core.serve import nucleus
    from clusteropt_cli.core.serve.device_sampling import TOP_P, RowSettings, SlotSampler

    sampler = SlotSampler(2, 800, torch.device("cpu"))
    for slot in range(2):
        sampler.assign(slot, RowSettings(temperature=1.0, top_p=1e-6, seed=slot), [1])
    logits = torch.randn(2, 800, generator=torch.Generator().manual_seed(1)) * 0.1  # flat: the rounds are needed
    seen = []
    rounds = nucleus.rounds_torch

    def counted(x, s, c, todo, *rest):
        seen.append(todo.tolist())
        return rounds(x, s, c, todo, *rest)

    nucleus.rounds_torch = counted
    try:
        with torch.inference_mode():  # the sampler's state only changes there (inference tensors)
            sampler.active.copy_(torch.tensor([True, False]))
        tokens = sampler.graph_sample(logits, 2, TOP_P, False).clone()
        with torch.inference_mode():
            sampler.active.fill_(True)
        both = sampler.graph_sample(logits, 2, TOP_P, False).clone()
    finally:
        nucleus.rounds_torch = rounds
    assert seen == [[1, 0], [1, 1]]
    assert int(tokens[0]) == int(both[0]) == int(logits[0].argmax())  # top_p 1e-6: the top token


def test_top_p_rounds_kernel_compiles_for_an_h100_class_gpu():
    """The Triton kernel lowers to a cubin for sm_90 (ahead of time: no GPU needed)."""
    pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from clusteropt_cli.core.serve.nucleus import BLOCK, _kernel

    sig = {"x_ptr": "*fp32", "s_ptr": "*fp32", "tok_ptr": "*i64", "todo_ptr": "*i32", "top_ptr": "*fp32",
           "total_ptr": "*fp32", "p_ptr": "*fp32", "vocab": "i32", "stride": "i32", "BLOCK": "constexpr"}
    out = compile(ASTSource(fn=_kernel(), signature=sig, constexprs={"BLOCK": BLOCK}),
                  target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    assert len(out.asm["cubin"]) > 1000


def _kind(value):
    """What torch.compile guards on for one argument: None or not, a tensor's rank, dtype, whether its first
    dimension is 1 (specialised), whether it is a view of another tensor, its strides (the batch dimension's
    size aside: every call here has one vocabulary) and whether it is an inference tensor (its dispatch keys), or
    the Python type."""
    import torch

    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dim(), value.dtype, value.dim() > 0 and value.shape[0] == 1, value._base is not None,
                value.stride(), value.is_inference())
    return type(value).__name__


def test_start_up_warms_every_variant_the_eager_sampling_path_calls():
    """The compiled sampling kernels the prefill rows call (eager, one or several rows, every selection mode and
    penalty) are all called at start-up — by the graph captures or by warm_eager — with the same argument kinds,
    so the first sampled requests never wait for a compile while the engine holds every running request."""
    import torch

    from clusteropt_cli.core.serve.device_sampling import KERNELS, SELECTION_MODES, RowSettings, SlotSampler

    seen: set = set()

    def recording(name, fn):
        def call(*args, **kwargs):
            seen.add((name, tuple(_kind(a) for a in args), tuple(sorted((k, _kind(v)) for k, v in kwargs.items()))))
            return fn(*args, **kwargs)
        return call

    vocab = 50
    sampler = SlotSampler(8, vocab, torch.device("cpu"))
    sampler.perturb = {name: recording(name, fn) for name, fn in KERNELS.items()}
    with torch.inference_mode():  # the runner's logits buffer, as capture_graphs makes it
        buf = torch.randn(8, vocab)
    sampler.capture_graphs(buf, [1, 2, 4, 8])  # what runner.capture_sampling_graphs does (eager on a CPU)
    assert sampler.warm_eager(buf) == 2 * len(SELECTION_MODES) * 3
    # one compiled variant for a batch of one and one for any other batch: every other argument layout would be
    # another recompile, and past dynamo's limit (8) a kernel silently runs uncompiled (seen on the GPU: the
    # nucleus check got a strided `top` from the top-k modes and `active` as None or a tensor)
    def guarded(kinds):  # a view or not is no guard of dynamo's (sizes, strides and dtypes are)
        return tuple(k[:4] + k[5:] if isinstance(k, tuple) else k for k in kinds)

    variants = {name: len({(guarded(args), guarded(v for _, v in kwargs)) for kernel, args, kwargs in seen
                           if kernel == name}) for name in KERNELS}
    assert all(count <= 2 for count in variants.values()), variants
    warmed, seen = set(seen), seen
    seen.clear()
    requests = [RowSettings(temperature=1.0), RowSettings(temperature=0.8, top_k=20),
                RowSettings(temperature=1.0, top_p=0.9), RowSettings(temperature=1.0, top_p=0.9, top_k=5),
                RowSettings(temperature=1.0, min_p=0.1), RowSettings(temperature=0.7, presence_penalty=0.5),
                RowSettings(temperature=0.7, logit_bias={3: 2.0}), RowSettings(temperature=0.7, min_tokens=2,
                                                                                stop_ids=(4,)),
                RowSettings(temperature=1.0, top_k=100), RowSettings(temperature=1.0, top_p=0.9, top_k=100)]
    for settings in requests:
        for slot in range(8):
            sampler.assign(slot, RowSettings(**{**settings.__dict__, "seed": slot}), [1, 2, 3])
        for rows in (1, 3, 8):
            with torch.inference_mode():  # a prefill's logits: the engine steps under inference mode
                logits = torch.randn(rows, vocab)
            sampler.sample(logits, list(range(rows)), [5] * rows)
    assert seen and seen <= warmed, sorted(seen - warmed, key=str)


def test_first_tokens_through_the_sampling_rows_equal_the_eager_path():
    """The first tokens after a prefill go through the sampling graph's rows on CUDA (SlotSampler
    .sample_through_rows: the rows copied to their slots in the shared buffer, only they active): the same tokens
    and the same penalty counts as the eager path, for every kind of request, with slots out of order and stale
    rows in the buffer."""
    import torch

    from clusteropt_cli.core.serve.device_sampling import RowSettings, SlotSampler

    vocab, slots, positions = 300, [5, 2, 6], [9, 4, 7]
    cases = [RowSettings(temperature=1.0), RowSettings(temperature=0.7, top_p=0.8),
             RowSettings(temperature=1.0, top_k=20), RowSettings(temperature=1.0, top_k=30, top_p=0.9),
             RowSettings(temperature=0.9, top_k=200), RowSettings(temperature=1.0, min_p=0.1),
             RowSettings(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2),
             RowSettings(temperature=1.0, logit_bias={7: 50.0}), RowSettings(temperature=0.0)]
    eager, graphed = SlotSampler(8, vocab, torch.device("cpu")), SlotSampler(8, vocab, torch.device("cpu"))
    staged = SlotSampler(8, vocab, torch.device("cpu"))
    stage = SlotSampler.stage_for(staged, 4)
    with torch.inference_mode():
        buffer = torch.randn(8, vocab)  # stale rows: what the last decode step left there
        stage.logits.normal_()
    gen = torch.Generator().manual_seed(3)
    for case in cases:
        for i, slot in enumerate(slots):
            mixed = case if i != 2 else cases[(cases.index(case) + 1) % len(cases)]  # another kind in the step
            for sampler in (eager, graphed, staged):
                sampler.assign(slot, RowSettings(**{**mixed.__dict__, "seed": 40 + slot}), [1, 2, 3, 7])
        with torch.inference_mode():
            logits = torch.randn(len(slots), vocab, generator=gen) * 2
        want = eager.sample(logits, slots, positions)
        got = graphed.sample_through_rows(buffer, logits, slots, positions, bucket=8)
        assert torch.equal(want, got), case
        # staged: the rows copied to the stage's rows 0..2 (row 3 stale from the case before), counts copied back
        assert torch.equal(want, staged.sample_staged(stage, logits, slots, positions, bucket=4)), case
        # the penalty counts of the rows that read them (the graphs also count rows with only a logit_bias; a
        # request with penalties starts from zero), and no other row counted
        read = [slot for slot in range(8) if eager.settings[slot] is not None and eager.settings[slot].has_penalties]
        assert torch.equal(eager.counts[read], graphed.counts[read]), case
        assert torch.equal(eager.counts[read], staged.counts[read]), case
        untouched = [slot for slot in range(8) if slot not in slots]
        assert not graphed.counts[untouched].any()
        assert not staged.counts[untouched].any()


def test_first_tokens_of_high_slots_are_staged_in_a_few_rows(monkeypatch):
    """ModelRunner.sample_first_tokens: slots within the rows' own bucket sample in place; a few first tokens of
    high slots (a step at 200 running sequences) go through the stage's graph of their own count; more than
    GRAPHED_FIRST_TOKEN_ROWS rows, or no stage and high slots, fall back to the eager path (None). Every path
    chooses the eager path's tokens."""
    import torch

    from clusteropt_cli.core.serve.device_sampling import RowSettings, SlotSampler
    from clusteropt_cli.core.serve.runner import ModelRunner, batch_buckets

    vocab, rows = 64, 256
    runner = ModelRunner.__new__(ModelRunner)
    runner.use_graphs, runner._batch_buckets = True, batch_buckets(rows)
    runner.sampler, eager = SlotSampler(rows, vocab, torch.device("cpu")), SlotSampler(rows, vocab, torch.device("cpu"))
    with torch.inference_mode():
        runner.logits_buf = torch.zeros(rows, vocab)
    runner.first_token_stage = SlotSampler.stage_for(runner.sampler, 64)
    calls: list[str] = []
    for name in ("sample_through_rows", "sample_staged"):
        method = getattr(SlotSampler, name)
        monkeypatch.setattr(SlotSampler, name, lambda self, *a, _m=method, _n=name, **k: (calls.append(_n),
                                                                                          _m(self, *a, **k))[1])
    gen = torch.Generator().manual_seed(0)
    for slots, path in (([0, 1], "sample_through_rows"), ([200, 7, 131], "sample_staged"),
                        (list(range(100, 165)), None)):
        for slot in slots:
            for sampler in (runner.sampler, eager):
                sampler.assign(slot, RowSettings(temperature=1.0, top_p=0.9, seed=slot), [1, 2])
        with torch.inference_mode():
            logits = torch.randn(len(slots), vocab, generator=gen)
        positions = [3] * len(slots)
        calls.clear()
        got = runner.sample_first_tokens(logits, slots, positions)
        assert calls == ([path] if path else []), slots
        if path:
            assert torch.equal(got, eager.sample(logits, slots, positions)), slots
        else:
            assert got is None
    runner.first_token_stage = None  # no stage: high slots sample eagerly
    assert runner.sample_first_tokens(logits[:2], [200, 7], [3, 3]) is None
