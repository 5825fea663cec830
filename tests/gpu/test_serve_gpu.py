"""copt serve's engine on a CUDA GPU: decode steps as CUDA graphs over compiled decoder layers with merged
q/k/v and gate/up projections, in fp32, give transformers' greedy tokens, also with async scheduling (greedy
steps fed on the device through the graphs); the CPU tests check the same paths without graphs."""

from __future__ import annotations

import pytest

from tests.integration.test_serve_helpers import eval_prompts, hf_greedy

pytestmark = pytest.mark.gpu


def engine_greedy_matches_hf(fixtures, device: str, async_scheduling: bool = False,
                             decode_attention: str = "sdpa") -> None:
    from clusteropt_cli.core.serve.engine import Engine, EngineConfig, GenerationRequest

    prompts = eval_prompts(fixtures, 6, seed=11)
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
                                   for p in prompts])
        alone = engine.generate([GenerationRequest(prompt_ids=prompts[1], max_new_tokens=16, ignore_eos=True)])
    assert [r.output_ids for r in results] == expected
    assert alone[0].output_ids == expected[1]  # the batch-1 graph too
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
