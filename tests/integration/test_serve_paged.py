"""The paged KV cache: greedy output equal to transformers' generate with paging, prefix-cache hits and forced
preemption (tiny pools); a shared prefix stored once; admission by free blocks; block accounting that never leaks
under cancellation; FP8 KV blocks with their quality cost measured."""

from __future__ import annotations

import random
import time

import pytest

from tests.integration.test_serve_helpers import eval_prompts, hf_greedy

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


def _engine(fixtures, **kw):
    from clusteropt_cli.core.serve.engine import Engine, EngineConfig

    settings = dict(model=str(fixtures.teacher), device="cpu", max_batch_size=8, max_model_len=256, compile=False,
                    block_size=4)
    settings.update(kw)
    return Engine(EngineConfig(**settings))


def _requests(prompts, lengths, **kw):
    from clusteropt_cli.core.serve.engine import GenerationRequest

    return [GenerationRequest(prompt_ids=p, max_new_tokens=n, ignore_eos=True, **kw)
            for p, n in zip(prompts, lengths, strict=True)]


def _assert_no_leak(engine):
    pool = engine.pool
    pool.check()
    assert pool.num_free == pool.num_blocks and not any(pool.ref), "blocks still held after every request ended"
    assert len(engine._free_slots) == engine.num_slots


def test_paged_greedy_matches_hf_with_prefix_hits(fixtures):
    prompts = eval_prompts(fixtures, 6, min_len=10, max_len=40, seed=5)
    shared = eval_prompts(fixtures, 1, min_len=30, max_len=31, seed=6)[0]
    prompts += [shared + p[:7] for p in prompts[:3]]  # three prompts that share a 30-token prefix
    lengths = [12, 5, 20, 9, 16, 3, 14, 14, 14]
    expected = [out[:n] for out, n in zip(hf_greedy(fixtures.teacher, prompts, max(lengths)), lengths, strict=True)]
    with _engine(fixtures) as engine:
        assert engine.pool is not None and engine.runner.paged  # the default layout
        first = engine.generate(_requests(prompts, lengths))
        hits_before = engine.pool.stats.hits
        again = engine.generate(_requests(prompts, lengths))  # everything but the last block of each prompt cached
        stats = engine.stats
        _assert_no_leak(engine)
    assert [r.output_ids for r in first] == expected
    assert [r.output_ids for r in again] == expected
    assert engine.pool.stats.hits - hits_before >= sum((len(p) - 1) // 4 * 4 for p in prompts)
    assert stats.prefix_cache_hits == engine.pool.stats.hits and stats.prefix_cache_queries > stats.prefix_cache_hits


def test_shared_prefix_is_stored_once(fixtures):
    from clusteropt_cli.core.serve.engine import GenerationRequest

    prefix = eval_prompts(fixtures, 1, min_len=41, max_len=42, seed=8)[0][:40]  # 10 full blocks of 4
    tails = eval_prompts(fixtures, 5, min_len=3, max_len=9, seed=9)
    with _engine(fixtures) as engine:
        engine.generate([GenerationRequest(prompt_ids=prefix + [11], max_new_tokens=1, ignore_eos=True)])
        handles = [engine.submit(GenerationRequest(prompt_ids=prefix + t, max_new_tokens=40, ignore_eos=True))
                   for t in tails]
        deadline = time.monotonic() + 60
        while any(not h._seq.out for h in handles) and time.monotonic() < deadline:
            time.sleep(0.01)
        tables = [list(h._seq.blocks[:10]) for h in handles if not h.done]
        refs = [engine.pool.ref[b] for b in tables[0]] if tables else []
        for h in handles:
            h.result(60)
        _assert_no_leak(engine)
    assert len(tables) >= 2 and all(t == tables[0] for t in tables), "the prefix's blocks differ between requests"
    assert all(r >= len(tables) for r in refs)  # one physical copy, referenced by every running request


def test_preemption_recomputes_and_keeps_greedy_and_seeded_outputs(fixtures):
    prompts = eval_prompts(fixtures, 6, min_len=20, max_len=40, seed=11)
    lengths = [40, 36, 30, 44, 25, 38]
    expected = [out[:n] for out, n in zip(hf_greedy(fixtures.teacher, prompts, max(lengths)), lengths, strict=True)]
    # 36 blocks of 4 = 144 tokens: one sequence of max_model_len 128 fits, six of ~75 tokens do not
    with _engine(fixtures, max_model_len=128, kv_cache_tokens=144) as engine:
        greedy = engine.generate(_requests(prompts, lengths))
        preempted_greedy = engine.stats.preemptions
        sampled = engine.generate(_requests(prompts, lengths, temperature=0.9, top_p=0.95, seed=3,
                                            frequency_penalty=0.5))
        preempted = engine.stats.preemptions
        _assert_no_leak(engine)
    with _engine(fixtures, max_model_len=128) as roomy:
        reference = roomy.generate(_requests(prompts, lengths, temperature=0.9, top_p=0.95, seed=3,
                                             frequency_penalty=0.5))
        assert roomy.stats.preemptions == 0
    assert preempted_greedy > 0 and preempted > preempted_greedy
    assert [r.output_ids for r in greedy] == expected
    assert [r.output_ids for r in sampled] == [r.output_ids for r in reference]


def test_prompt_logprobs_survive_preemption_during_prefill(fixtures):
    """A sequence preempted in the middle of its chunked prefill computes its prompt again: its prompt logprobs
    are those of a roomy engine, one per prompt token (not the recomputed positions twice), with their ranks."""
    prompts = eval_prompts(fixtures, 6, min_len=60, max_len=90, seed=7)

    def requests():
        return _requests(prompts, [20] * len(prompts), prompt_logprobs=2)

    with _engine(fixtures, max_model_len=128, kv_cache_tokens=144, max_batch_tokens=16) as engine:
        tight = engine.generate(requests())
        assert engine.stats.preemptions > 0
        _assert_no_leak(engine)
    with _engine(fixtures, max_model_len=128) as roomy:
        reference = roomy.generate(requests())
        assert roomy.stats.preemptions == 0
    for prompt, got, want in zip(prompts, tight, reference, strict=True):
        assert got.output_ids == want.output_ids
        assert len(got.prompt_logprobs) == len(got.prompt_ranks) == len(prompt)
        assert got.prompt_ranks == want.prompt_ranks and got.prompt_ranks[0] is None
        for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
            assert a[0] == b[0] and a[1] == pytest.approx(b[1], abs=1e-4)
        for (tok, _lp, top), rank in zip(got.prompt_logprobs[1:], got.prompt_ranks[1:], strict=True):
            assert rank >= 1 and (rank == 1) == (tok == top[0][0])  # rank 1: the most likely token


@pytest.mark.parametrize("caching", [True, False])
def test_admission_by_free_blocks(fixtures, caching):
    from clusteropt_cli.core.serve.engine import GenerationRequest

    prompt = eval_prompts(fixtures, 1, min_len=16, max_len=17, seed=12)[0][:15]  # 4 blocks of 4 tokens
    requests = [GenerationRequest(prompt_ids=prompt, max_new_tokens=2, ignore_eos=True) for _ in range(30)]
    # 40 blocks: 10 private copies of the prompt at once; with the first 3 blocks shared, 20 (one block each)
    with _engine(fixtures, max_batch_size=32, max_model_len=64, kv_cache_tokens=160,
                 enable_prefix_caching=caching) as engine:
        results = engine.generate(requests)
        peak = engine.stats.peak_running
        _assert_no_leak(engine)
    assert all(r.finish_reason == "length" for r in results)
    if caching:
        assert peak > 10 and engine.pool.stats.hits > 0
    else:
        assert peak == 10 and engine.pool.stats.hits == 0


def test_block_accounting_survives_a_cancel_soak(fixtures):
    from clusteropt_cli.core.serve.engine import GenerationRequest

    rng = random.Random(4)
    prompts = eval_prompts(fixtures, 12, min_len=5, max_len=50, seed=13)
    with _engine(fixtures, max_model_len=96, kv_cache_tokens=200, max_batch_size=6) as engine:
        handles = []
        for i in range(120):
            p = prompts[i % len(prompts)]
            if i % 3 == 0:  # shared prefixes, so cancels also hit shared and cached blocks
                p = prompts[0][:24] + p[:8]
            handles.append(engine.submit(GenerationRequest(prompt_ids=p, max_new_tokens=rng.randint(1, 40),
                                                           ignore_eos=True, temperature=rng.choice([0, 0.8]),
                                                           seed=i)))
            if rng.random() < 0.5:
                time.sleep(rng.random() * 0.01)
                rng.choice(handles).cancel()
        for h in handles:
            h.result(120)
        _assert_no_leak(engine)
        reasons = {h.result().finish_reason for h in handles}
    assert reasons <= {"length", "abort"} and "abort" in reasons


def test_n_choices_share_the_prompt_through_the_prefix_cache(fixtures):
    from clusteropt_cli.core.serve.engine import GenerationRequest

    prompt = eval_prompts(fixtures, 1, min_len=33, max_len=34, seed=14)[0]
    with _engine(fixtures) as engine:
        first = engine.submit(GenerationRequest(prompt_ids=prompt, max_new_tokens=6, temperature=0.8, seed=1))
        others = [engine.submit(GenerationRequest(prompt_ids=prompt, max_new_tokens=6, temperature=0.8, seed=s),
                                share_prompt_with=first) for s in (2, 3)]
        for h in [first, *others]:
            h.result(60)
        shared = engine.stats.prompt_tokens_shared
        _assert_no_leak(engine)
    assert shared == 2 * ((len(prompt) - 1) // 4 * 4)


def test_fp8_kv_blocks_cost_little_quality(fixtures):
    """Teacher-forced prompt logprobs through FP8 KV blocks against the model-dtype cache: the measured cost."""
    import math

    from clusteropt_cli.core.serve.engine import GenerationRequest

    prompts = eval_prompts(fixtures, 6, min_len=30, max_len=60, seed=15)

    def logprobs(engine):
        out = engine.generate([GenerationRequest(prompt_ids=p, max_new_tokens=1, prompt_logprobs=1) for p in prompts])
        return [[(tok, lp, top[0][0]) for tok, lp, top in r.prompt_logprobs[1:]] for r in out]

    with _engine(fixtures) as engine:
        base = logprobs(engine)
    with _engine(fixtures, kv_cache_dtype="fp8") as engine:
        assert str(engine.runner.caches[0][0].dtype) == "torch.float8_e4m3fn"
        assert engine.kv_cache_bytes == sum(k.numel() * 2 for k, _ in engine.runner.caches)  # one byte each
        fp8 = logprobs(engine)
    pairs = [(b, f) for rb, rf in zip(base, fp8, strict=True) for b, f in zip(rb, rf, strict=True)]
    nll_base = -sum(b[1] for b, _ in pairs) / len(pairs)
    nll_fp8 = -sum(f[1] for _, f in pairs) / len(pairs)
    top1 = sum(b[2] == f[2] for b, f in pairs) / len(pairs)
    ppl_ratio = math.exp(nll_fp8 - nll_base)
    print(f"fp8 KV: perplexity ratio {ppl_ratio:.4f}, top-1 agreement {top1:.3f} over {len(pairs)} tokens")
    assert ppl_ratio < 1.05 and top1 > 0.9
    assert fp8 != base  # the cache really is FP8 (a no-op would match exactly)


def test_slot_layout_still_serves(fixtures):
    prompts = eval_prompts(fixtures, 3, seed=16)
    expected = hf_greedy(fixtures.teacher, prompts, 8)
    with _engine(fixtures, kv_layout="slots") as engine:
        assert engine.pool is None and not engine.runner.paged
        results = engine.generate(_requests(prompts, [8, 8, 8]))
    assert [r.output_ids for r in results] == [e[:8] for e in expected]


def test_paged_decode_op_matches_hf(fixtures):
    """decode_attention paged: the registered op (its CPU reference here; the Triton kernels on CUDA)."""
    prompts = eval_prompts(fixtures, 4, seed=17)
    lengths = [10, 17, 6, 12]
    expected = [out[:n] for out, n in zip(hf_greedy(fixtures.teacher, prompts, max(lengths)), lengths, strict=True)]
    with _engine(fixtures, decode_attention="paged") as engine:
        assert engine.runner.decode_attention == "paged"
        results = engine.generate(_requests(prompts, lengths))
        _assert_no_leak(engine)
    assert [r.output_ids for r in results] == expected


def test_fp8_kv_blocks_are_refused_without_fp8_hardware(fixtures, monkeypatch):
    import torch

    from clusteropt_cli.errors import BadInputError

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    engine = _engine(fixtures, device="cuda", kv_cache_dtype="fp8")
    with pytest.raises(BadInputError, match="compute capability 8.9"):
        engine.load()  # refused before anything touches the (absent) GPU


def test_a_length_planned_too_long_is_shortened_to_the_measured_pool(fixtures, monkeypatch, capfd):
    """The default length is planned before loading; when the memory measured after loading holds less (a quantized
    checkpoint dequantized at load), the engine serves the longest power of two that fits instead of failing."""
    from clusteropt_cli.core.serve.loading import EngineLoading

    monkeypatch.setattr(EngineLoading, "_planned_kv_budget", lambda self, *a: (10**9, 1, "planned"))
    prompt = eval_prompts(fixtures, 1, seed=18)[0]
    with _engine(fixtures, max_model_len=None, kv_cache_tokens=300) as engine:
        assert engine.max_model_len == 256 and engine.pool.num_blocks == 75
        result = engine.generate(_requests([prompt], [6]))[0]
    assert result.output_ids == hf_greedy(fixtures.teacher, [prompt], 6)[0]
    assert "shortened to what the memory measured after loading holds" in capfd.readouterr().err
