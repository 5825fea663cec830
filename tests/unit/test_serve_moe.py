"""copt's MoE experts: the dense form CUDA graphs capture gives transformers' outputs, and dispatches by rows."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
T = pytest.importorskip("transformers")

from clusteropt_cli.core.serve import moe  # noqa: E402

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)
CONFIGS = {
    "mixtral": lambda: T.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
    "qwen2moe": lambda: T.Qwen2MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                         shared_expert_intermediate_size=64),
    "qwen3moe": lambda: T.Qwen3MoeConfig(**COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48),
}


def _model(name: str):
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=torch.float32).eval()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_dense_experts_equal_transformers_eager_experts(name):
    model = _model(name)
    experts = moe.experts_modules(model)
    assert len(experts) == 2
    module = experts[0]
    torch.manual_seed(1)
    rows = torch.randn(6, 64)
    index = torch.stack([torch.randperm(module.num_experts)[:2] for _ in range(6)])
    weights = torch.rand(6, 2)
    index[5, 1] = module.num_experts  # an expert-parallel sentinel: contributes nothing
    model.config._experts_implementation = "eager"
    with torch.no_grad():
        expected = module(rows[:5], index[:5], weights[:5])
        got = moe.dense_experts_forward(module, rows, index, weights)
        alone = moe.dense_experts_forward(module, rows[5:], index[5:, :1], weights[5:, :1])
    torch.testing.assert_close(got[:5], expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[5:], alone, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_model_logits_unchanged_and_dispatch_by_rows(name, monkeypatch):
    model = _model(name)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(ids).logits
    dense_calls = []
    real = moe.dense_experts_forward
    monkeypatch.setattr(moe, "dense_experts_forward", lambda *a: dense_calls.append(a[1].shape[0]) or real(*a))
    assert moe.use_capturable_experts(model, dense_rows=18) == 2
    assert model.config._experts_implementation == moe.IMPLEMENTATION
    with torch.no_grad():
        dense = model(ids).logits  # 18 rows: dense in both layers
        assert dense_calls == [18, 18]
        moe.use_capturable_experts(model, dense_rows=17)
        grouped = model(ids).logits  # more rows than dense_rows: transformers' grouped path
    assert dense_calls == [18, 18]
    torch.testing.assert_close(dense, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grouped, expected, rtol=1e-4, atol=1e-5)


def test_dense_models_have_no_experts():
    config = T.LlamaConfig(**COMMON)
    model = T.AutoModelForCausalLM.from_config(config)
    assert moe.use_capturable_experts(model, dense_rows=64) == 0
