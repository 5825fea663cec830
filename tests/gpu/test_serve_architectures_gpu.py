"""The architecture matrix on a CUDA GPU: every family copt's engine serves natively (sliding-window and hybrid
local/global layers, soft-capping, q/k norm, qkv bias, MoE) gives transformers' greedy tokens beyond the window
through CUDA graphs over compiled decoder layers and async scheduling, in fp32 (the CPU matrix runs eagerly)."""

from __future__ import annotations

import pytest

from tests.integration.test_serve_architectures import (
    FAMILIES,
    MAX_BATCH_TOKENS,
    NEW_TOKENS,
    _hf_greedy,
    _prompts,
    build_family_dirs,
)

pytestmark = pytest.mark.gpu

MOE_FAMILIES = {"mixtral-sliding", "qwen2moe-sliding", "qwen3moe-sliding"}


@pytest.fixture(scope="module")
def family_dirs(fixtures, tmp_path_factory):
    return build_family_dirs(fixtures.tokenizer, tmp_path_factory.mktemp("architectures-gpu"))


@pytest.mark.parametrize("decode_attention", ["math", "flex"])
@pytest.mark.parametrize("name", FAMILIES)
def test_native_families_through_graphs_match_hf_greedy_on_gpu(family_dirs, name, decode_attention):
    import torch
    from transformers import AutoConfig

    from clusteropt_cli.core.serve.engine import Engine, EngineConfig, GenerationRequest

    assert torch.cuda.is_available()
    prompts = _prompts(int(AutoConfig.from_pretrained(family_dirs[name]).vocab_size))
    expected, gap = _hf_greedy(family_dirs[name], prompts)  # transformers on CPU, fp32
    assert gap > 1e-3
    engine = Engine(EngineConfig(model=str(family_dirs[name]), device="cuda", dtype="fp32", max_batch_size=4,
                                 max_model_len=128, max_batch_tokens=MAX_BATCH_TOKENS, cuda_graphs=True,
                                 compile=True, async_scheduling=True, decode_attention=decode_attention))
    with engine:
        assert engine.stats.graphs_captured > 0 and engine.runner.compile_error is None
        assert engine.runner.compiled_layers == 4 and engine.runner.decode_attention == decode_attention
        assert (engine.runner.moe_layers > 0) == (name in MOE_FAMILIES)
        results = engine.generate([GenerationRequest(prompt_ids=p, max_new_tokens=NEW_TOKENS, ignore_eos=True)
                                   for p in prompts])
        alone = engine.generate([GenerationRequest(prompt_ids=prompts[0], max_new_tokens=NEW_TOKENS,
                                                   ignore_eos=True)])
    assert [r.output_ids for r in results] == expected
    assert alone[0].output_ids == expected[0]  # the batch-1 graph too


@pytest.mark.parametrize("name", ["mistral-sliding", "gemma2-hybrid", "gemma3-hybrid", "qwen2moe-sliding"])
def test_windowed_rings_through_graphs_match_hf_greedy_on_gpu(family_dirs, name, monkeypatch):
    """Windowed layers in rings of window + 7 columns (prompts wrap around them), decoded through the graphs."""
    import torch
    from transformers import AutoConfig

    from clusteropt_cli.core.serve import attention
    from clusteropt_cli.core.serve.engine import Engine, EngineConfig, GenerationRequest

    assert torch.cuda.is_available()
    monkeypatch.setattr(attention, "RING_SLACK", 8)
    prompts = _prompts(int(AutoConfig.from_pretrained(family_dirs[name]).vocab_size))
    expected, _ = _hf_greedy(family_dirs[name], prompts)
    engine = Engine(EngineConfig(model=str(family_dirs[name]), device="cuda", dtype="fp32", max_batch_size=4,
                                 max_model_len=128, max_batch_tokens=MAX_BATCH_TOKENS, cuda_graphs=True,
                                 compile=True, async_scheduling=True))
    with engine:
        assert engine.stats.graphs_captured > 0 and engine.runner.compile_error is None
        assert any(engine.runner.rings)
        results = engine.generate([GenerationRequest(prompt_ids=p, max_new_tokens=NEW_TOKENS, ignore_eos=True)
                                   for p in prompts])
    assert [r.output_ids for r in results] == expected


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_moe_decode_below_bf16_is_captured(family_dirs, dtype):
    """transformers' experts below bf16 read their routing on the host, which capture refuses: copt's dense experts
    (moe.py) keep the decode steps in graphs over the compiled layers."""
    from clusteropt_cli.core.serve.engine import Engine, EngineConfig, GenerationRequest

    engine = Engine(EngineConfig(model=str(family_dirs["mixtral-sliding"]), device="cuda", dtype=dtype,
                                 max_batch_size=4, max_model_len=128, max_batch_tokens=MAX_BATCH_TOKENS,
                                 cuda_graphs=True, compile=True))
    with engine:
        assert engine.stats.graphs_captured > 0 and engine.runner.compile_error is None
        assert engine.runner.moe_layers == 4
        results = engine.generate([GenerationRequest(prompt_ids=[5, 6, 7], max_new_tokens=8, ignore_eos=True)])
    assert len(results[0].output_ids) == 8


@pytest.mark.parametrize("name", sorted(MOE_FAMILIES))
def test_bf16_moe_decode_through_graphs(family_dirs, name):
    """bf16, the dtype MoE checkpoints ship in: transformers' grouped GEMM keeps the routing on the GPU, so the
    decode steps are captured over compiled layers; batch-1 and batched graphs give the tokens the eager engine
    gives wherever bf16's top-2 logits are apart."""
    from transformers import AutoConfig

    from clusteropt_cli.core.serve.engine import Engine, EngineConfig, GenerationRequest

    prompts = _prompts(int(AutoConfig.from_pretrained(family_dirs[name]).vocab_size))
    outputs = {}
    for graphs in (False, True):
        engine = Engine(EngineConfig(model=str(family_dirs[name]), device="cuda", dtype="bf16", max_batch_size=4,
                                     max_model_len=128, max_batch_tokens=MAX_BATCH_TOKENS, cuda_graphs=graphs,
                                     compile=graphs))
        with engine:
            if graphs:
                assert engine.stats.graphs_captured > 0 and engine.runner.compile_error is None
                assert engine.runner.moe_layers > 0  # bf16 runs transformers' grouped GEMM inside the graphs
            results = engine.generate([GenerationRequest(prompt_ids=p, max_new_tokens=NEW_TOKENS, ignore_eos=True)
                                       for p in prompts])
        outputs[graphs] = [r.output_ids for r in results]
    assert all(len(ids) == NEW_TOKENS for ids in outputs[True])
    # bf16 rounding differs between compiled and eager layers: the first tokens agree, later ones may drift on ties
    assert [ids[:2] for ids in outputs[True]] == [ids[:2] for ids in outputs[False]]
