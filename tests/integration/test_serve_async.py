"""Async scheduling: greedy decode stretches fed on the device give transformers' greedy tokens, and the stretch
ends cleanly when a sequence finishes, is cancelled or a new request arrives."""

from __future__ import annotations

import threading

import pytest

from tests.integration.test_serve_helpers import eval_prompts, hf_greedy

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


def _engine(fixtures, **kw):
    from clusteropt_cli.core.serve.engine import Engine, EngineConfig

    kw.setdefault("async_scheduling", True)
    return Engine(EngineConfig(model=str(fixtures.teacher), device="cpu", max_batch_size=8, max_model_len=256,
                               compile=False, **kw))


def test_chained_greedy_decoding_matches_hf(fixtures):
    from clusteropt_cli.core.serve.engine import GenerationRequest

    prompts = eval_prompts(fixtures, 5, seed=21)
    lengths = [3, 9, 16, 16, 24]  # sequences finish at different steps: stretches end, drain and start again
    expected = [out[:n] for out, n in zip(hf_greedy(fixtures.teacher, prompts, max(lengths)), lengths, strict=True)]
    with _engine(fixtures) as engine:
        results = engine.generate([GenerationRequest(prompt_ids=p, max_new_tokens=n, ignore_eos=True)
                                   for p, n in zip(prompts, lengths, strict=True)])
        alone = engine.generate([GenerationRequest(prompt_ids=prompts[4], max_new_tokens=24, ignore_eos=True)])
        stats = engine.stats
    assert [r.output_ids for r in results] == expected
    assert [r.finish_reason for r in results] == ["length"] * 5
    assert alone[0].output_ids == expected[4]
    assert stats.chained_steps > 20  # the overlapped path ran (not the step-by-step one)
    assert stats.running == 0 and len(engine._free_slots) == engine.num_slots  # every slot came back


def test_stretch_ends_for_cancellation_and_new_arrivals(fixtures):
    from clusteropt_cli.core.serve.engine import GenerationRequest

    prompts = eval_prompts(fixtures, 3, seed=22)
    expected = hf_greedy(fixtures.teacher, prompts, 40)
    with _engine(fixtures) as engine:
        long_run = engine.submit(GenerationRequest(prompt_ids=prompts[0], max_new_tokens=40, ignore_eos=True))
        doomed = engine.submit(GenerationRequest(prompt_ids=prompts[1], max_new_tokens=40, ignore_eos=True))
        seen = threading.Event()

        def cancel_after_a_few() -> None:
            for i, _chunk in enumerate(doomed):
                if i == 3:
                    doomed.cancel()
                    seen.set()
                    return

        worker = threading.Thread(target=cancel_after_a_few)
        worker.start()
        assert seen.wait(30)
        late = engine.submit(GenerationRequest(prompt_ids=prompts[2], max_new_tokens=40, ignore_eos=True))
        worker.join(30)
        results = [long_run.result(60), doomed.result(60), late.result(60)]
    assert results[0].output_ids == expected[0]  # untouched by the other's cancellation and the late arrival
    assert results[1].finish_reason == "abort"
    assert results[1].output_ids == expected[1][: len(results[1].output_ids)]
    assert results[2].output_ids == expected[2]  # admitted and prefilled mid-way, then decoded exactly


def test_stretch_that_runs_to_the_end_of_the_context(fixtures):
    """The step launched ahead of the last token of a full context must stay inside the KV cache."""
    from clusteropt_cli.core.serve.engine import Engine, EngineConfig, GenerationRequest

    prompt = eval_prompts(fixtures, 1, min_len=50, max_len=51, seed=23)[0]
    expected = hf_greedy(fixtures.teacher, [prompt], 64 - len(prompt))[0]
    engine = Engine(EngineConfig(model=str(fixtures.teacher), device="cpu", max_batch_size=2, max_model_len=64,
                                 compile=False, async_scheduling=True))
    with engine:
        result = engine.generate([GenerationRequest(prompt_ids=prompt, max_new_tokens=500, ignore_eos=True)])[0]
    assert result.finish_reason == "length" and len(prompt) + len(result.output_ids) == 64
    assert result.output_ids == expected


@pytest.mark.parametrize(("attention", "compiled"), [("flex", False), ("flex", True), ("math", True)])
def test_decode_attention_variants_give_hf_greedy_tokens(fixtures, attention, compiled):
    """decode_attention="flex" (FlexAttention with a score_mod over the context bucket) and "math" (plain tensor
    ops) instead of masked SDPA: the same greedy tokens as transformers with the compiled decode layers; eager
    layers fall back to SDPA."""
    from clusteropt_cli.core.serve.engine import Engine, EngineConfig, GenerationRequest

    prompts = eval_prompts(fixtures, 4, seed=23)
    lengths = [5, 12, 20, 20]
    expected = [out[:n] for out, n in zip(hf_greedy(fixtures.teacher, prompts, max(lengths)), lengths, strict=True)]
    config = EngineConfig(model=str(fixtures.teacher), device="cpu", max_batch_size=8, max_model_len=256,
                          compile=compiled, decode_attention=attention)
    with Engine(config) as engine:
        results = engine.generate([GenerationRequest(prompt_ids=p, max_new_tokens=n, ignore_eos=True)
                                   for p, n in zip(prompts, lengths, strict=True)])
        assert engine.runner.compiled_layers == (4 if compiled else 0)
        # flex only inside compiled layers (eager FlexAttention materializes the scores): masked SDPA otherwise
        assert engine.runner.decode_attention == (attention if compiled else "sdpa")
    assert [r.output_ids for r in results] == expected


class _StepLog:
    """Stands in for an event loop and an event in the engine's wake-ups (as the split server's engine core does)
    and records, in order, each wake-up and each prefill forward with the engine's decode-step count."""

    def __init__(self, engine) -> None:
        self.engine, self.entries = engine, []

    def call_soon_threadsafe(self, fn, *args) -> None:
        self.entries.append(("wake", self.engine.stats.decode_steps))
        fn(*args)

    def is_set(self) -> bool:
        return False  # every push wakes again (a consumer that always took what it was given)

    def set(self) -> None:
        pass


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decode_tokens_reach_consumers_before_the_steps_prefill(fixtures, async_scheduling):
    """In a step that decodes some sequences and prefills a new one, the decoded tokens are handed to their
    consumers before the prefill runs, not after it (on an 8B model a prefill step takes tens of ms)."""
    from clusteropt_cli.core.serve.engine import GenerationRequest

    first, second = eval_prompts(fixtures, 2, seed=24)
    with _engine(fixtures, async_scheduling=async_scheduling) as engine:
        log = _StepLog(engine)
        forward_packed = engine.runner.forward_packed

        def logged_prefill(packed, wanted):
            log.entries.append(("prefill", engine.stats.decode_steps))
            return forward_packed(packed, wanted)

        engine.runner.forward_packed = logged_prefill
        running = engine.submit(GenerationRequest(prompt_ids=first, max_new_tokens=40, ignore_eos=True))
        running.add_step_listener(log, log)
        for i, _chunk in enumerate(running):
            if i == 3:
                break
        late = engine.submit(GenerationRequest(prompt_ids=second, max_new_tokens=4, ignore_eos=True))
        late.result(60)
        running.result(60)
    prefills = [i for i, entry in enumerate(log.entries) if entry[0] == "prefill"]
    assert len(prefills) >= 2  # the first request's prefill, then the late one's next to a decode
    late_prefill = prefills[1]
    decodes_before = log.entries[late_prefill][1]
    assert decodes_before > 3
    # the wake-up just before the late prefill carries the token decoded in the same step
    assert log.entries[late_prefill - 1] == ("wake", decodes_before)
