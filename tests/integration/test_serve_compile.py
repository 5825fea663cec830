"""`copt serve --compile`: decode steps through torch.compile'd decoder layers give transformers' greedy tokens."""

from __future__ import annotations

import pytest

from tests.integration.test_serve_helpers import eval_prompts, hf_greedy

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


def test_compiled_decode_layers_match_hf_greedy(fixtures):
    from torch._dynamo.utils import counters

    from clusteropt_cli.core.serve.engine import Engine, EngineConfig, GenerationRequest

    prompts = eval_prompts(fixtures, 3, seed=5)
    expected = hf_greedy(fixtures.teacher, prompts, 12)
    counters.clear()
    engine = Engine(EngineConfig(model=str(fixtures.teacher), device="cpu", max_batch_size=4, max_model_len=256,
                                 compile=True))
    with engine:
        assert engine.runner.compiled_layers == 4
        assert engine.runner.fused_projections == 8  # q/k/v and gate/up of each layer run as one GEMM each
        # the layers' KV caches are module buffers, so no layer reads step.caches[layer_idx]
        attn = engine.runner.decoder.layers[2].self_attn
        assert attn.copt_k_cache.data_ptr() == engine.runner.caches[2][0].data_ptr()
        results = engine.generate([GenerationRequest(prompt_ids=p, max_new_tokens=12, ignore_eos=True)
                                   for p in prompts])
        alone = engine.generate([GenerationRequest(prompt_ids=prompts[0], max_new_tokens=12, ignore_eos=True)])
    assert [r.output_ids for r in results] == expected
    assert alone[0].output_ids == expected[0]
    # one graph for all four layers per shape family (batch > 1, batch 1, ...), not one per layer
    assert 1 <= counters["stats"]["unique_graphs"] <= 4
