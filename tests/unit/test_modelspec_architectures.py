"""advise's model spec across the architectures copt serves: exact parameter counts (total and MoE-active)
against transformers' own modules, per-layer sliding windows as transformers' masks apply them, and KV-cache
sizes that stop growing at the window."""

from __future__ import annotations

import pytest

from clusteropt_cli.core.advise.memory import infer_memory, kv_cache_bytes
from clusteropt_cli.core.advise.plan import InferPlan, Target
from clusteropt_cli.core.advise.timing import infer_time
from clusteropt_cli.hardware import get_gpu
from clusteropt_cli.modelspec import load_model_spec, spec_from_config

GiB = 1024**3


def _families() -> dict:
    import transformers as T

    common = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, pad_token_id=0)
    moe = dict(num_experts_per_tok=2)
    return {
        "llama": T.LlamaConfig(**common),
        "llama-tied": T.LlamaConfig(**common, tie_word_embeddings=True),
        "mistral": T.MistralConfig(**common, sliding_window=32),
        "gemma": T.GemmaConfig(**common),
        "gemma2": T.Gemma2Config(**common, sliding_window=32),
        "gemma3": T.Gemma3TextConfig(**common, sliding_window=32),
        "gemma3-pattern2": T.Gemma3TextConfig(**common, sliding_window=32, sliding_window_pattern=2),
        "qwen2": T.Qwen2Config(**common),
        "qwen2-sliding": T.Qwen2Config(**common, use_sliding_window=True, sliding_window=32, max_window_layers=4),
        "qwen3": T.Qwen3Config(**common),
        "phi3": T.Phi3Config(**common, sliding_window=32),
        "mixtral": T.MixtralConfig(**common, **moe, num_local_experts=4),
        "qwen2-moe": T.Qwen2MoeConfig(**common, **moe, num_experts=4, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=48, use_sliding_window=True, sliding_window=32,
                                      max_window_layers=5),
        "qwen3-moe": T.Qwen3MoeConfig(**common, **moe, num_experts=8, moe_intermediate_size=32,
                                      decoder_sparse_step=2, mlp_only_layers=[4]),
    }


FAMILIES = list(_families())


def _hf_counts(config) -> tuple[int, int]:
    """(total, active) parameters of transformers' own module tree: expert tensors count top-k / experts."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = expert = 0
    for name, param in model.named_parameters():  # shared (tied) parameters are listed once
        total += param.numel()
        if ".experts." in name:
            expert += param.numel()
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 1
    active = total - expert + expert * config.num_experts_per_tok // experts if expert else total
    return total, active


@pytest.mark.parametrize("name", FAMILIES)
def test_parameter_counts_match_transformers(name):
    config = _families()[name]
    spec = spec_from_config(config.to_dict(), name)
    total, active = _hf_counts(config)
    assert spec.exact
    assert spec.num_params == total
    assert spec.num_active_params == active
    assert spec.is_moe == (active < total)


@pytest.mark.parametrize("name", FAMILIES)
def test_layer_windows_match_the_engine_and_transformers(name):
    """The spec's per-layer windows equal the serve engine's (derived from transformers' config object), also for
    a config.json written before `layer_types` existed (the family's pattern keys only)."""
    from clusteropt_cli.core.serve.architectures import layer_windows

    config = _families()[name]
    expected = layer_windows(config)
    raw = config.to_dict()
    spec = spec_from_config(raw, name)
    assert list(spec.layer_windows or [None] * spec.num_layers) == expected
    raw.pop("layer_types", None)
    assert list(spec_from_config(raw, name).layer_windows or [None] * spec.num_layers) == expected


def test_hybrid_windows_of_gemma_and_qwen():
    families = _families()
    assert spec_from_config(families["gemma2"].to_dict()).layer_windows == (32, None) * 3
    assert spec_from_config(families["gemma3"].to_dict()).layer_windows == (32,) * 5 + (None,)
    assert spec_from_config(families["qwen2-sliding"].to_dict()).layer_windows == (None,) * 4 + (32, 32)
    assert spec_from_config(families["qwen2"].to_dict()).layer_windows == ()  # use_sliding_window false
    mistral = spec_from_config(families["mistral"].to_dict())
    assert mistral.num_sliding_layers == 6 and mistral.summary()["sliding_window"] == [32]


# Gemma-3-270M's text shape: 18 layers (every 6th global), 1 KV head of 256, a 512-token window
GEMMA3_270M_SHAPE = {
    "model_type": "gemma3_text", "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144,
    "sliding_window": 512, "sliding_window_pattern": 6, "max_position_embeddings": 32768,
}


def test_sliding_window_kv_of_a_512_window_gemma():
    """8 × 16k-token sequences: 3 global layers hold 16,512 tokens each, 15 local layers 512 — 0.44 GiB, not the
    2.27 GiB of 18 full layers."""
    spec = spec_from_config(GEMMA3_270M_SHAPE, "gemma-3-270m")
    assert spec.num_sliding_layers == 15
    plan = InferPlan(batch=8, prompt_len=16384, gen_len=128)
    per_layer_token = 2 * 1 * 256 * 2  # K and V, one head of 256, bf16
    local = 8 * 15 * 512 * per_layer_token
    full = 8 * 3 * (16384 + 128) * per_layer_token
    assert kv_cache_bytes(spec, plan) == local + full
    assert kv_cache_bytes(spec, plan) / GiB == pytest.approx(0.4365, abs=1e-3)
    assert spec.kv_cache_bytes_per_seq(16512, 2, windowed=False) * 8 / GiB == pytest.approx(2.268, abs=1e-3)
    # vLLM keeps the window as well; copt's engine a ring of the window + one 2048-token prefill chunk
    assert kv_cache_bytes(spec, plan.with_(continuous_batching=True, engine="vllm")) == local + full
    copt = kv_cache_bytes(spec, plan.with_(continuous_batching=True, engine="copt"))
    assert copt == 8 * 15 * (512 + 2047) * per_layer_token + full
    target = Target(get_gpu("h200"))
    assert infer_memory(spec, plan, target).breakdown["kv_cache"] == local + full
    # short prompts: every layer holds the whole context
    short = InferPlan(batch=8, prompt_len=256, gen_len=128)
    assert kv_cache_bytes(spec, short) == 8 * 18 * 384 * per_layer_token


def test_sliding_window_attention_flops_stop_at_the_window():
    spec = spec_from_config(GEMMA3_270M_SHAPE, "gemma-3-270m")
    per_key = 2.0 * spec.num_heads * 2 * spec.head_dim
    assert spec.attention_flops_per_token(100) == per_key * 18 * 100
    assert spec.attention_flops_per_token(16384) == per_key * (3 * 16384 + 15 * 512)


def test_moe_decode_reads_the_routed_experts():
    """Mixtral-8x7B: 46.7B parameters, 12.9B active per token (Mistral AI's figures). A batch-1 decode step reads
    the active weights (2 of 8 experts per layer) but of its untied input embedding only the row it looks up; a
    batch of 64 routes to every expert and reads them all."""
    spec = load_model_spec("mixtral-8x7b")
    assert spec.num_params / 1e9 == pytest.approx(46.7, abs=0.05)
    assert spec.num_active_params / 1e9 == pytest.approx(12.9, abs=0.05)
    target = Target(get_gpu("h200"))
    plan = InferPlan(batch=1, prompt_len=128, gen_len=128, continuous_batching=True, engine="vllm")
    one = infer_time(spec, plan, target).figures
    kv = kv_cache_bytes(spec, plan, 128 + 64)
    table = 2 * spec.embedding_params  # 32,000 x 4,096 bf16: looked up, not read
    assert not spec.tie_word_embeddings and table == 2 * 32000 * 4096
    assert one["decode_bytes_per_step"] == pytest.approx(2 * spec.num_active_params - table + 2 * 4096 + kv, rel=1e-9)
    two = infer_time(spec, plan.with_(batch=2), target).figures["decode_bytes_per_step"]
    assert 2 * spec.num_active_params - table + 2 * kv < two < 2 * spec.num_params  # a second token: ~1.7 experts
    full = infer_time(spec, plan.with_(batch=64), target).figures["decode_bytes_per_step"]
    assert full == pytest.approx(2 * spec.num_params - table + 64 * (2 * 4096 + kv), rel=1e-3)
