"""Sampling on the device: distributions (chi-square), counter-based seeds, penalties, suppression, speculation,
and the engine's seeded reproducibility under concurrent load."""

from __future__ import annotations

import pytest

from clusteropt_cli.core.serve.engine import Engine, EngineConfig, GenerationRequest

# chi-square critical values at p = 0.001 by degrees of freedom: a correct sampler fails 1 run in 1000
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def _rows(n: int, vocab: int, **settings):
    """choose_tokens' per-row arguments for n rows (seeds 0..n-1 unless given)."""
    import torch

    seeds = torch.as_tensor(settings.pop("seeds", range(n)), dtype=torch.long)
    pos = torch.as_tensor(settings.pop("positions", [7] * n), dtype=torch.long)
    full = lambda v, dt=torch.float32: torch.full((n,), v, dtype=dt)  # noqa: E731
    return dict(temperature=full(settings.get("temperature", 1.0)), top_p=full(settings.get("top_p", 1.0)),
                top_k=full(settings.get("top_k", 0), torch.long), min_p=full(settings.get("min_p", 0.0)),
                seed_lo=seeds & 0xFFFFFFFF, seed_hi=seeds >> 32, position=pos)


def _chi2(tokens, expected, n: int) -> float:
    import torch

    counts = torch.bincount(tokens, minlength=len(expected)).double()
    kept = expected > 0
    assert counts[~kept].sum() == 0, "a token outside the allowed set was drawn"
    exp = expected[kept].double() * n
    return float(((counts[kept] - exp) ** 2 / exp).sum())


def _check(logits_row, n: int, expected, **settings):
    import torch

    from clusteropt_cli.core.serve.device_sampling import choose_tokens

    args = _rows(n, logits_row.shape[0], **settings)
    sort = settings.get("top_p", 1.0) < 1 or settings.get("top_k", 0) > 0 or settings.get("min_p", 0) > 0
    scaled = logits_row[None, :].expand(n, -1) / args["temperature"][:, None]
    tokens = choose_tokens(scaled, args["temperature"], args["top_p"], args["top_k"], args["min_p"],
                           args["seed_lo"], args["seed_hi"], args["position"], sort)
    dof = int((expected > 0).sum()) - 1
    stat = _chi2(tokens, expected, n)
    assert stat < CHI2_999[dof], f"chi-square {stat:.1f} over {dof} dof for {settings}"
    return tokens, torch


@pytest.fixture(scope="module")
def logits_row():
    import torch

    return torch.tensor([2.0, 1.2, 0.9, 0.3, 0.0, -0.4, -1.0, -3.0])


def test_temperature_top_k_top_p_min_p_follow_their_distributions(logits_row):
    import torch

    t = 0.7
    p = torch.softmax(logits_row / t, -1)
    # temperature alone, over seeds and (separately) over positions of one seed
    _check(logits_row, 4000, p, temperature=t)
    _check(logits_row, 4000, p, temperature=t, seeds=[123] * 4000, positions=range(4000))
    # top-k 3
    k3 = torch.zeros_like(p)
    k3[:3] = p[:3] / p[:3].sum()
    _check(logits_row, 4000, k3, temperature=t, top_k=3)
    # top-p: the smallest prefix whose mass reaches 0.8
    cum = p.cumsum(0)
    keep = int((cum < 0.8).sum()) + 1
    tp = torch.zeros_like(p)
    tp[:keep] = p[:keep] / p[:keep].sum()
    _check(logits_row, 4000, tp, temperature=t, top_p=0.8)
    # min-p 0.1: tokens with at least a tenth of the top probability
    mp = torch.where(p >= 0.1 * p.max(), p, torch.zeros_like(p))
    _check(logits_row, 4000, mp / mp.sum(), temperature=t, min_p=0.1)
    # the test can fail: temperature 1 samples do not pass as temperature 0.7 samples
    with pytest.raises(AssertionError, match="chi-square"):
        _check(logits_row, 4000, p, temperature=1.0)


def test_noise_depends_on_seed_and_position_only():
    import torch

    from clusteropt_cli.core.serve.device_sampling import choose_tokens, exponential_noise

    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    args = _rows(6, 50, seeds=[5, 5, 9, 1 << 40, 3, 5], positions=[10, 11, 10, 10, 2, 10])
    together = choose_tokens(logits, args["temperature"], args["top_p"], args["top_k"], args["min_p"],
                             args["seed_lo"], args["seed_hi"], args["position"], False)
    for i in range(6):  # each row alone gives the token it got in the batch
        one = {k: v[i : i + 1] for k, v in args.items()}
        alone = choose_tokens(logits[i : i + 1], one["temperature"], one["top_p"], one["top_k"], one["min_p"],
                              one["seed_lo"], one["seed_hi"], one["position"], False)
        assert int(alone) == int(together[i])
    ids = torch.arange(50)[None, :]
    e = exponential_noise(args["seed_lo"], args["seed_hi"], args["position"], ids)
    assert torch.equal(e[0], e[5]) and not torch.equal(e[0], e[1]) and not torch.equal(e[0], e[2])
    big = exponential_noise(torch.arange(2000), torch.zeros(2000, dtype=torch.long), torch.zeros(2000).long(), ids)
    assert abs(float(big.mean()) - 1.0) < 0.02 and abs(float(big.var()) - 1.0) < 0.05  # Exp(1)


def test_penalties_bias_and_suppression():
    import torch

    from clusteropt_cli.core.serve.device_sampling import choose_tokens, process_logits

    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5, 0.0, 3.0]] * 2)
    counts = torch.tensor([[0, 2, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.int32)
    prompt_mask = torch.tensor([[True, False, False, False, False, False]] * 2)
    f = lambda *v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    stop_ids = torch.tensor([[5, -1], [5, -1]])
    bias_ids = torch.tensor([[3, 0], [0, 0]])
    bias_vals = f(10.0, 0.0).expand(2, 2) * torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    out = process_logits(logits, f(1.0, 2.0), torch.tensor([12, 12]), torch.tensor([10, 10]),
                         torch.tensor([3, 0]), stop_ids, bias_ids, bias_vals, f(0.5, 0.0), f(0.25, 0.0),
                         f(2.0, 1.0), counts, prompt_mask, True)
    # row 0: repetition 2 on prompt token 0 and generated 1, 2; frequency 0.25 × count; presence 0.5; bias +10 on
    # token 3; token 5 (a stop id) suppressed: 2 generated < min_tokens 3
    expected0 = [1.0 / 2, -1.0 * 2 - 0.5 - 0.5, 2.0 / 2 - 0.25 - 0.5, 10.5, 0.0, float("-inf")]
    assert torch.allclose(out[0], torch.tensor(expected0))
    assert torch.allclose(out[1], logits[1] / 2.0)  # row 1: nothing but temperature 2
    # every token suppressed: a token comes out, never NaN
    dead = torch.full((3, 6), float("-inf"))
    for sort in (False, True):
        tok = choose_tokens(dead, f(1.0, 0.0, 0.7), f(0.9, 1.0, 1.0), torch.tensor([2, 0, 0]), f(0.0, 0.0, 0.1),
                            torch.tensor([1, 2, 3]), torch.zeros(3).long(), torch.tensor([4, 4, 4]), sort)
        assert ((tok >= 0) & (tok < 6)).all()


def test_speculative_acceptance_keeps_the_target_distribution():
    import torch

    from clusteropt_cli.core.serve.device_sampling import RowSettings, choose_tokens, speculative_accept

    target = torch.log(torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]]))
    q = torch.tensor([[0.1, 0.1, 0.7, 0.1], [0.4, 0.1, 0.4, 0.1]])
    gen = torch.Generator().manual_seed(0)
    trials, first = 3000, []
    settings = RowSettings(temperature=1.0)
    positions = torch.tensor([20, 21, 22])
    for trial in range(trials):
        args = {k: v for k, v in _rows(3, 4, seeds=[trial] * 3).items() if k != "position"}
        draft = [int(torch.multinomial(q[0], 1, generator=gen)), 2]
        first.append(speculative_accept(target, args, positions, draft, q, settings)[0])
    stat = _chi2(torch.tensor(first), torch.tensor([0.5, 0.2, 0.2, 0.1]), trials)
    assert stat < CHI2_999[3]  # the target p, not the draft q
    # a deterministic drafter (prompt lookup): the same tokens as sampling without speculation
    args = {k: v for k, v in _rows(3, 4, seeds=[77] * 3).items() if k != "position"}
    own = choose_tokens(target, args["temperature"], args["top_p"], args["top_k"], args["min_p"], args["seed_lo"],
                        args["seed_hi"], positions, False).tolist()
    assert speculative_accept(target, args, positions, own[:2], None, settings) == own
    wrong = [own[0], (own[1] + 1) % 4]
    assert speculative_accept(target, args, positions, wrong, None, settings) == own[:2]


@pytest.fixture(scope="module")
def engine(fixtures):
    import torch

    torch.set_num_threads(1)
    eng = Engine(EngineConfig(model=str(fixtures.teacher), max_batch_size=8, max_model_len=256))
    eng.start()
    yield eng
    eng.stop()


def test_seeded_requests_give_the_same_text_under_concurrent_load(engine):
    prompt = list(range(40, 60))
    seeded = dict(prompt_ids=prompt, max_new_tokens=24, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = engine.generate([GenerationRequest(**seeded)])[0].output_ids
    others = [GenerationRequest(prompt_ids=list(range(3, 3 + 7 * i)), max_new_tokens=30 + i, ignore_eos=True,
                                temperature=t, top_k=k, presence_penalty=pp, seed=None)
              for i, (t, k, pp) in enumerate([(0.0, 0, 0.0), (1.0, 0, 0.0), (0.7, 5, 0.0), (1.2, 0, 0.5),
                                               (0.0, 0, 1.0)], start=1)]
    before = engine.stats.chained_steps
    # in the middle of a batch (another slot, other neighbours), and again submitted after the others started
    mixed = engine.generate(others[:3] + [GenerationRequest(**seeded)] + others[3:])
    assert mixed[3].output_ids == alone
    handles = [engine.submit(r) for r in others]
    late = engine.submit(GenerationRequest(**seeded))
    assert late.result(timeout=120).output_ids == alone
    for h in handles:
        h.result(timeout=120)
    assert engine.stats.chained_steps > before  # sampled stretches run with async scheduling too
    other_seed = engine.generate([GenerationRequest(**{**seeded, "seed": 99})])[0].output_ids
    assert other_seed != alone


def test_bias_penalties_and_min_tokens_in_the_engine(engine, fixtures):
    from tests.integration.test_serve_helpers import eval_prompts, hf_greedy

    prompt = list(range(40, 60))
    for temperature in (0.0, 1.0):
        forced = engine.generate([GenerationRequest(prompt_ids=prompt, max_new_tokens=8, temperature=temperature,
                                                    logit_bias={17: 100.0}, ignore_eos=True, seed=3)])[0]
        assert forced.output_ids == [17] * 8
    distinct = engine.generate([GenerationRequest(prompt_ids=prompt, max_new_tokens=20, frequency_penalty=100.0,
                                                  ignore_eos=True)])[0]
    assert len(set(distinct.output_ids)) == 20
    eos = sorted(engine.eos_ids)[0]
    early = engine.generate([GenerationRequest(prompt_ids=prompt, max_new_tokens=10, min_tokens=6, temperature=1.0,
                                               logit_bias={eos: 100.0}, seed=5)])[0]
    assert early.num_output_tokens == 6 and early.finish_reason == "stop"  # EOS only once 6 tokens exist
    # plain greedy stays HF's greedy
    prompts = eval_prompts(fixtures, 3, seed=5)
    expected = hf_greedy(fixtures.teacher, prompts, 12)
    results = engine.generate([GenerationRequest(prompt_ids=p, max_new_tokens=12) for p in prompts])
    assert [r.output_ids for r in results] == expected


def _hf_logprobs(model_dir, ids: list[int], temperature: float = 1.0):
    """log_softmax(logits / T) of the HF model at every position of `ids` ([len(ids), V])."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits / temperature, -1)


def test_logprobs_equal_hf_for_greedy_sampled_and_prompt_positions(engine, fixtures):
    import torch

    prompt = list(range(40, 60))
    for temperature in (0.0, 0.7):
        r = engine.generate([GenerationRequest(prompt_ids=prompt, max_new_tokens=6, temperature=temperature,
                                               seed=11, logprobs=3, prompt_logprobs=2, ignore_eos=True)])[0]
        ref = _hf_logprobs(fixtures.teacher, prompt + r.output_ids, temperature or 1.0)
        assert len(r.logprobs) == len(r.output_ids) == 6
        for i, (tok, lp, top) in enumerate(r.logprobs):
            row = ref[len(prompt) - 1 + i]
            assert tok == r.output_ids[i] and lp == pytest.approx(float(row[tok]), abs=1e-4)
            values, ids = row.topk(3)
            assert [t for t, _ in top] == ids.tolist()
            assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)
            if temperature == 0:
                assert tok == top[0][0]  # greedy: the chosen token is the most likely
        # prompt logprobs: raw model distribution, None for the first token
        assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == len(prompt)
        raw = _hf_logprobs(fixtures.teacher, prompt)
        for j in range(1, len(prompt)):
            tok, lp, top = r.prompt_logprobs[j]
            assert tok == prompt[j] and lp == pytest.approx(float(raw[j - 1, tok]), abs=1e-4)
            assert [t for t, _ in top] == raw[j - 1].topk(2).indices.tolist()
    # prompt logprobs alone (echo with max_tokens 0): nothing generated
    only = engine.generate([GenerationRequest(prompt_ids=prompt, max_new_tokens=0, prompt_logprobs=0)])[0]
    assert only.output_ids == [] and only.finish_reason == "length" and len(only.prompt_logprobs) == len(prompt)
    assert torch.isfinite(torch.tensor([e[1] for e in only.prompt_logprobs[1:]])).all()


def test_n_choices_share_the_prompt_prefill(engine, fixtures):
    from tests.integration.test_serve_helpers import eval_prompts

    prompt = eval_prompts(fixtures, 1, min_len=40, max_len=60, seed=9)[0]
    solo = [engine.generate([GenerationRequest(prompt_ids=prompt, max_new_tokens=10, temperature=1.0, seed=s,
                                               ignore_eos=True)])[0].output_ids for s in (1, 2, 3)]
    before_shared, before_prompt = engine.stats.prompt_tokens_shared, engine.stats.prompt_tokens
    leader = engine.submit(GenerationRequest(prompt_ids=prompt, max_new_tokens=10, temperature=1.0, seed=1,
                                             ignore_eos=True))
    others = [engine.submit(GenerationRequest(prompt_ids=prompt, max_new_tokens=10, temperature=1.0, seed=s,
                                              ignore_eos=True), share_prompt_with=leader) for s in (2, 3)]
    shared = [h.result(timeout=120).output_ids for h in [leader, *others]]
    assert shared == solo  # sharing the prompt's KV cache changes nothing in what is generated
    # the paged cache shares whole blocks (the solo runs cached them: the leader finds them too); every choice
    # computes the tokens after its last full block, the prompt's last token included
    cached = (len(prompt) - 1) // engine.pool.block_size * engine.pool.block_size
    assert engine.stats.prompt_tokens_shared - before_shared == 2 * cached
    assert engine.stats.prompt_tokens - before_prompt == 3 * (len(prompt) - cached)
