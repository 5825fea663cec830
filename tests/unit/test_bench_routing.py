"""bench/gpu_serve_models.py's routing probe of a built MoE shape: the distinct experts a decode step of N rows
would read, next to uniform routing's expectation, and a prefill's busiest-expert load; a router that sends every
token to the same experts shows as k distinct experts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import gpu_serve_models as bench  # noqa: E402

TINY_MOE = dict(bench.SHAPES["qwen3moe16l"], hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=16, num_experts=16,
                num_experts_per_tok=2, vocab_size=8192, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _model(shape: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(shape)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields)).eval()


def test_moe_shapes_are_told_from_dense_ones() -> None:
    assert bench.moe_experts(bench.SHAPES["qwen3moe16l"]) == (128, 8)
    assert bench.moe_experts(bench.SHAPES["8b"]) is None


def test_a_random_router_spreads_and_a_constant_one_does_not() -> None:
    model = _model(TINY_MOE)
    spread = bench.routing_spread(model, TINY_MOE, rows=(1, 8, 32), prompt_len=8)
    assert spread["uniform_distinct"] == {1: 2.0, 8: 10.5, 32: 15.8}
    assert len(spread["layers"]) == 2
    assert spread["mean_distinct"][1] == 2
    assert 7 <= spread["mean_distinct"][8] <= 14 and spread["mean_distinct"][32] >= 13
    assert spread["decode_steps"] == 4 and spread["decode_mean_distinct"][1] == 2  # sampled decode steps' rows
    assert 7 <= spread["decode_mean_distinct"][8] <= 14 and spread["decode_mean_distinct"][32] >= 13
    for gate in (m for name, m in model.named_modules() if name.endswith("mlp.gate")):
        torch.nn.init.zeros_(gate.weight)  # every expert scores the same for every token: the first k win
    same = bench.routing_spread(model, TINY_MOE, rows=(1, 8, 32), prompt_len=8)
    assert same["mean_distinct"] == {1: 2, 8: 2, 32: 2}
    assert same["decode_mean_distinct"] == {1: 2, 8: 2, 32: 2}
    assert all(layer["prefill_max_over_mean"] == 8.0 for layer in same["layers"])  # 2 of 16 experts take it all


def test_routing_is_probed_for_each_kind_of_prompt_the_script_sends(monkeypatch) -> None:
    """The script's own "t<id>" words and, where Faker gives guidellm's English words, those (their ids lie below
    FILLER_FROM, after the punctuation and the number words)."""
    model = _model(TINY_MOE)
    calls = []
    monkeypatch.setattr(bench, "routing_spread", lambda m, s, **kw: calls.append(kw) or {"ok": True})
    monkeypatch.setattr(bench, "english_words", lambda: [])
    assert bench.routing_by_text(model, TINY_MOE) == {"t_words": {"ok": True}}
    monkeypatch.setattr(bench, "english_words", lambda: [f"w{i}" for i in range(900)])
    assert set(bench.routing_by_text(model, TINY_MOE)) == {"t_words", "english_words"}
    first = 1 + 11 + bench.NUMBER_WORDS
    assert calls[-1] == {"ids_from": first, "ids_to": first + 900}
