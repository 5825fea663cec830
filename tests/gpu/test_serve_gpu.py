"""copt serve's engine on a CUDA GPU: decode steps as CUDA graphs over compiled decoder layers with merged
q/k/v and gate/up projections, and prompts through the captured prefill steps, in fp32, give transformers' greedy
tokens, also with async scheduling (greedy steps fed on the device through the graphs); the CPU tests check the same
paths without graphs."""

from __future__ import annotations

import pytest

from tests.integration.test_serve_helpers import eval_prompts, hf_greedy

pytestmark = pytest.mark.gpu


def engine_greedy_matches_hf(fixtures, device: str, async_scheduling: bool = False,
                             decode_attention: str = "sdpa") -> None:
    from clusteropt_cli.core.serve.engine import Engine, EngineConfig, GenerationRequest

    prompts = eval_prompts(fixtures, 7, seed=11)  # six at once, then the last alone
    expected = hf_greedy(fixtures.teacher, prompts, 16)
    on_gpu = device == "cuda"
    engine = Engine(EngineConfig(model=str(fixtures.teacher), device=device, dtype="fp32", max_batch_size=8,
                                 max_model_len=256, kv_cache_tokens=8 * 256, cuda_graphs=on_gpu, compile=True,
                                 async_scheduling=async_scheduling, decode_attention=decode_attention))
    with engine:
        assert engine.runner.fused_projections == 8 and engine.runner.compiled_layers == 4
        if on_gpu:
            assert engine.stats.graphs_captured > 0 and engine.runner.compile_error is None
        results = engine.generate([GenerationRequest(prompt_ids=p, max_new_tokens=16, ignore_eos=True)
                                   for p in prompts[:6]])
        # a prompt not seen before (a repeat would hit the prefix cache and prefill eagerly): the batch-1 graphs
        alone = engine.generate([GenerationRequest(prompt_ids=prompts[6], max_new_tokens=16, ignore_eos=True)])
    assert [r.output_ids for r in results] == expected[:6]
    assert alone[0].output_ids == expected[6]
    if on_gpu:  # the prompts were prefilled by captured prefill steps (several segments, then one)
        assert engine.stats.prefill_graphs > 0 and engine.runner.prefill_graph_error is None
        assert engine.runner.prefill_graph_steps >= 2
    if async_scheduling:
        assert engine.stats.chained_steps > 0  # decode steps fed on the device, through the captured graphs
    if on_gpu and decode_attention != "sdpa":
        assert engine.runner.compile_error is None  # compiled inside the captured layers (no eager fallback)
        assert engine.runner.decode_attention == decode_attention


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_compiled_graphs_with_merged_projections_match_hf_greedy_on_gpu(fixtures, async_scheduling):
    import torch

    assert torch.cuda.is_available()
    engine_greedy_matches_hf(fixtures, "cuda", async_scheduling)


@pytest.mark.parametrize("decode_attention", ["flex", "math"])
def test_decode_attention_variants_through_graphs_match_hf_greedy_on_gpu(fixtures, decode_attention):
    import torch

    assert torch.cuda.is_available()
    engine_greedy_matches_hf(fixtures, "cuda", async_scheduling=True, decode_attention=decode_attention)


def test_poison_requests_leave_the_engine_serving_on_gpu(fixtures):
    """The hostile payloads of the serve robustness suite against the CUDA engine (graphs, compiled layers, device
    sampling): each is refused with 400 naming its field while six streams complete, and the engine stays
    healthy (a device-side assert would have killed the CUDA context)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import torch

    from clusteropt_cli.core.serve.engine import Engine, EngineConfig, GenerationRequest, InvalidRequestError
    from tests.integration.test_serve_hostile import POISON, in_process, stream

    assert torch.cuda.is_available()
    engine = Engine(EngineConfig(model=str(fixtures.teacher), device="cuda", dtype="fp32", max_batch_size=16,
                                 max_model_len=256, kv_cache_tokens=16 * 256))
    vocab = None
    with engine, in_process(engine) as url:
        vocab = engine.runner.vocab_size
        pool = ThreadPoolExecutor(7)
        streams = [pool.submit(stream, url, {"prompt": f"def f{i}(x):", "max_tokens": 64, "temperature": 0,
                                             "ignore_eos": True}, {}) for i in range(6)]
        sampled = pool.submit(stream, url, {"prompt": "import os", "max_tokens": 64, "temperature": 0.9, "seed": 3,
                                            "min_tokens": 8, "stop_token_ids": [5, 6], "ignore_eos": True}, {})
        poison = [
            (POISON, "stop_token_ids"),
            ({"prompt": "x", "max_tokens": 4, "min_tokens": 2, "temperature": 1.0,
              "stop_token_ids": list(range(vocab))}, "stop_token_ids"),
            ({"prompt": [1, vocab + 5], "max_tokens": 4}, "prompt"),
            ({"prompt": [[1, 2], [3, -7]], "max_tokens": 4}, "prompt"),
            ({"prompt": "x", "max_tokens": 4, "seed": 2**64}, "seed"),
            ({"prompt": "x", "max_tokens": 4, "logit_bias": {str(vocab * 4): 100}}, "logit_bias"),
        ]
        for body, param in poison:
            r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        with pytest.raises(InvalidRequestError):
            engine.submit(GenerationRequest(prompt_ids=[1, 2], max_new_tokens=4, min_tokens=2,
                                            stop_token_ids=[999999]))
        results = [f.result(timeout=300) for f in streams] + [sampled.result(timeout=300)]
        assert [r["finish_reason"] for r in results] == ["length"] * 7
        assert all(r["error"] is None for r in results)
        assert engine.error is None and httpx.get(url + "/health").status_code == 200
        after = httpx.post(url + "/v1/completions", json={"prompt": "def g():", "max_tokens": 8, "ignore_eos": True},
                           timeout=60)
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 8
