"""Architecture matrix: copt serve's engine gives transformers' greedy tokens for every family it accepts, on
prompts several times longer than any sliding window, or serves the model through its visible fallback.

Each family is a tiny random-weight config built with transformers (no downloads), saved with the fixture
tokenizer. fp32 on CPU. The engine runs its real scheduler: the prompts are submitted together, prefilled in
chunks smaller than the prompts (chunk starts fall inside and across windows) and decoded as one batch whose rows
sit at different positions (per-row window masks)."""

from __future__ import annotations

import random

import pytest

from clusteropt_cli.core.serve.architectures import NATIVE_MODEL_TYPES, inspect_architecture, layer_windows

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOW = 16
PROMPT_LENGTHS = (61, 50, 9)  # 3.8x, 3.1x and half the window
NEW_TOKENS = 10
MAX_BATCH_TOKENS = 24  # prefill chunks of at most 24 tokens across the three prompts
MAX_LEN = {"llama-dynamic-rope": 96}  # --max-model-len (128 otherwise)


def _configs(vocab: int, bos: int, eos: int, pad: int) -> dict:
    """name → (transformers config, expected model_type). Four layers each so hybrid patterns mix both kinds."""
    import transformers as T

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, initializer_range=0.1)
    moe = dict(num_experts_per_tok=2)
    return {
        "llama-untied": T.LlamaConfig(**common, tie_word_embeddings=False),
        "llama-tied": T.LlamaConfig(**common, tie_word_embeddings=True),
        "mistral-sliding": T.MistralConfig(**common, sliding_window=WINDOW),
        "gemma": T.GemmaConfig(**common, tie_word_embeddings=False),  # tied, a random model echoes its input
        # hybrid local/global, attention and final logit soft-capping
        "gemma2-hybrid": T.Gemma2Config(**common, sliding_window=WINDOW, query_pre_attn_scalar=16),
        # hybrid local/global (1 global every 2 layers), separate local rotary base, q/k norm
        "gemma3-hybrid": T.Gemma3TextConfig(**common, sliding_window=WINDOW, query_pre_attn_scalar=16,
                                            sliding_window_pattern=2),
        # qkv bias; layers >= max_window_layers use the window
        "qwen2-bias-sliding": T.Qwen2Config(**common, use_sliding_window=True, sliding_window=WINDOW,
                                            max_window_layers=2),
        "qwen3-qknorm": T.Qwen3Config(**common),
        "qwen3-qknorm-sliding": T.Qwen3Config(**common, use_sliding_window=True, sliding_window=WINDOW,
                                              max_window_layers=1),
        "phi3-sliding": T.Phi3Config(**common, sliding_window=WINDOW),
        "mixtral-sliding": T.MixtralConfig(**common, **moe, num_local_experts=4, sliding_window=WINDOW),
        "qwen2moe-sliding": T.Qwen2MoeConfig(**common, **moe, num_experts=4, moe_intermediate_size=32,
                                             shared_expert_intermediate_size=64, use_sliding_window=True,
                                             sliding_window=WINDOW, max_window_layers=4),
        "qwen3moe-sliding": T.Qwen3MoeConfig(**common, **moe, num_experts=4, moe_intermediate_size=32,
                                             use_sliding_window=True, sliding_window=WINDOW),
    }


# seeds whose reference has no near-tie (the smallest top-1/top-2 logit gap is checked in every test)
SEEDS = {"qwen2-bias-sliding": 2, "cohere2-hybrid": 2}

# families outside the verified set: served through transformers' own attention and cache, with a notice
FALLBACK = ("cohere2-hybrid", "llama-dynamic-rope", "mamba-recurrent")


def _fallback_configs(vocab: int, bos: int, eos: int, pad: int) -> dict:
    import transformers as T

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, bos_token_id=bos, eos_token_id=eos,
                  pad_token_id=pad, initializer_range=0.1)
    return {
        "cohere2-hybrid": T.Cohere2Config(**common, head_dim=16, max_position_embeddings=512, sliding_window=WINDOW,
                                          sliding_window_pattern=2, logit_scale=1.0),
        # dynamic NTK scaling recomputes the rotary frequencies from the longest position in a step (the engine's
        # scratch column at --max-model-len would switch it on for every row)
        "llama-dynamic-rope": T.LlamaConfig(**common, head_dim=16,
                                            max_position_embeddings=MAX_LEN["llama-dynamic-rope"],
                                            rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                             "rope_theta": 10000.0}),
        # no attention at all: a recurrent state the model keeps in `cache_params` (every step recomputed)
        "mamba-recurrent": T.MambaConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, state_size=8,
                                         bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
                                         initializer_range=0.1, tie_word_embeddings=False),
    }


@pytest.fixture(scope="module")
def family_dirs(fixtures, tmp_path_factory):
    """name → directory of a saved tiny random model of that family (with the fixture tokenizer)."""
    return build_family_dirs(fixtures.tokenizer, tmp_path_factory.mktemp("architectures"))


def build_family_dirs(tokenizer_dir, root) -> dict:
    """Save a tiny random fp32 model of every family (native and fallback) under root; name → directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = (len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    dirs = {}
    for name, config in {**_configs(*ids), **_fallback_configs(*ids)}.items():
        torch.manual_seed(SEEDS.get(name, 0))
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None  # the comparisons run a fixed number of tokens
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        dirs[name] = root / name
    return dirs


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


def _hf_greedy(model_dir, prompts):
    """transformers' generate(), greedy, one prompt at a time; also the smallest top-1/top-2 logit gap seen."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs, gap = [], float("inf")
    with torch.inference_mode():
        for ids in prompts:
            res = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
            outs.append(res.sequences[0, len(ids):].tolist())
            for logits in res.logits:
                top = logits[0].float().topk(2).values
                gap = min(gap, float(top[0] - top[1]))
    return outs, gap


def _engine_greedy(model_dir, prompts, **config):
    from clusteropt_cli.core.serve.engine import Engine, EngineConfig, GenerationRequest

    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="fp32", max_batch_size=4,
                                 max_model_len=MAX_LEN.get(model_dir.name, 128), max_batch_tokens=MAX_BATCH_TOKENS,
                                 **config))
    engine.start()
    try:
        results = engine.generate([GenerationRequest(prompt_ids=p, max_new_tokens=NEW_TOKENS, ignore_eos=True)
                                   for p in prompts], timeout=300)
    finally:
        engine.stop()
    return [r.output_ids for r in results], engine


# merged projection groups per family: 4 layers × (q/k/v + gate/up); MoE layers only q/k/v
MERGED = {name: 8 for name in ("llama-untied", "llama-tied", "mistral-sliding", "gemma", "gemma2-hybrid",
                               "gemma3-hybrid", "qwen2-bias-sliding", "qwen3-qknorm", "qwen3-qknorm-sliding")}
MERGED.update({"phi3-sliding": 0, "mixtral-sliding": 4, "qwen2moe-sliding": 4, "qwen3moe-sliding": 4})

FAMILIES = ["llama-untied", "llama-tied", "mistral-sliding", "gemma", "gemma2-hybrid", "gemma3-hybrid",
            "qwen2-bias-sliding", "qwen3-qknorm", "qwen3-qknorm-sliding", "phi3-sliding", "mixtral-sliding",
            "qwen2moe-sliding", "qwen3moe-sliding"]


@pytest.mark.parametrize("name", FAMILIES)
def test_native_engine_matches_hf_greedy_beyond_the_window(family_dirs, name, capfd):
    from transformers import AutoConfig

    from clusteropt_cli.core.serve.runner import ModelRunner

    config = AutoConfig.from_pretrained(family_dirs[name])
    arch = inspect_architecture(config, 128)
    assert arch.native, arch.reason
    prompts = _prompts(int(config.vocab_size))
    expected, gap = _hf_greedy(family_dirs[name], prompts)
    assert gap > 1e-3, f"near-tie in the reference ({gap:.2e}): the comparison would be decided by rounding"
    assert max(len(set(out)) for out in expected) > 2, "degenerate reference output"
    got, engine = _engine_greedy(family_dirs[name], prompts)
    assert isinstance(engine.runner, ModelRunner)  # served natively, by copt's slot attention
    # q/k/v merged in every layer (phi-3's are merged in the checkpoint), gate/up in the dense MLPs
    assert engine.runner.fused_projections == MERGED[name]
    assert engine.runner.attention_path.startswith(("copt slot attention", "copt paged attention"))
    assert "transformers' own attention" not in capfd.readouterr().err
    assert got == expected


@pytest.mark.slow
@pytest.mark.parametrize(("name", "ring_slack"), [("gemma2-hybrid", None), ("mistral-sliding", None),
                                                  ("gemma3-hybrid", 8)])
def test_compiled_decode_layers_keep_the_windows(family_dirs, name, ring_slack, monkeypatch):
    """Decode steps through torch.compile'd layers (the GPU default) attend through the same windows, rings and
    soft-caps: windowed and full layers share the compiled layer forward."""
    from transformers import AutoConfig

    from clusteropt_cli.core.serve import attention

    if ring_slack:
        monkeypatch.setattr(attention, "RING_SLACK", ring_slack)
    prompts = _prompts(int(AutoConfig.from_pretrained(family_dirs[name]).vocab_size))
    expected, _ = _hf_greedy(family_dirs[name], prompts)
    got, engine = _engine_greedy(family_dirs[name], prompts, compile=True, decode_attention="math")
    assert engine.runner.compiled_layers == 4 and engine.runner.decode_attention == "math"
    assert got == expected


WINDOWED = ["mistral-sliding", "gemma2-hybrid", "gemma3-hybrid", "qwen2-bias-sliding", "phi3-sliding",
            "qwen2moe-sliding"]


@pytest.mark.parametrize("name", WINDOWED)
def test_windowed_layers_in_rings_match_hf_greedy(family_dirs, name, monkeypatch):
    """With a ring of window + 7 columns per windowed layer (RING_SLACK 8 instead of 2048): prompts wrap around it
    several times, 24-token prefill chunks are split into pieces of 8, decode reads the ring through its mask."""
    from transformers import AutoConfig

    from clusteropt_cli.core.serve import attention

    monkeypatch.setattr(attention, "RING_SLACK", 8)
    prompts = _prompts(int(AutoConfig.from_pretrained(family_dirs[name]).vocab_size))
    expected, _ = _hf_greedy(family_dirs[name], prompts)
    got, engine = _engine_greedy(family_dirs[name], prompts)
    runner = engine.runner
    columns = [k.shape[2] for k, _ in runner.caches]
    windowed = [w is not None for w in runner.architecture.windows]
    assert any(windowed)
    assert columns == [WINDOW + 8 if w else 128 + 1 for w in windowed]  # ring + scratch; max_len + scratch
    assert engine.kv_cache_bytes == 2 * (engine.num_slots + 1) * 2 * 16 * 4 * sum(columns)  # K+V, 2 heads of 16, fp32
    assert got == expected


def test_rings_with_speculative_rejections(family_dirs, monkeypatch):
    """A draft model's rejected tokens are rewritten in the ring at the same columns: still HF's tokens."""
    from clusteropt_cli.core.serve import attention

    monkeypatch.setattr(attention, "RING_SLACK", 8)
    prompts = _prompts(1024)[:2]
    expected, _ = _hf_greedy(family_dirs["gemma2-hybrid"], prompts)
    got, engine = _engine_greedy(family_dirs["gemma2-hybrid"], prompts,
                                 draft_model=str(family_dirs["mistral-sliding"]), num_speculative_tokens=3)
    assert engine.stats.spec_drafted > engine.stats.spec_accepted
    assert got == expected


def test_ring_sizing_counts_only_the_ring(family_dirs, monkeypatch):
    """The engine sizes its slots from the bytes a slot really takes (rings on windowed layers)."""
    from transformers import AutoConfig

    from clusteropt_cli.core.serve import attention
    from clusteropt_cli.core.serve.runner import ModelRunner

    config = AutoConfig.from_pretrained(family_dirs["gemma2-hybrid"])  # layers: window 16, full, window 16, full
    per_layer = 2 * 2 * 16 * 4
    assert ModelRunner.kv_bytes_per_token_of(config, 4) == 4 * per_layer
    assert ModelRunner.kv_bytes_per_token_of(config, 4, 128) == 4 * per_layer  # 16 + 2047 columns: no ring
    monkeypatch.setattr(attention, "RING_SLACK", 8)
    assert ModelRunner.kv_bytes_per_token_of(config, 4, 128) == -(-per_layer * (2 * 128 + 2 * 23) // 128)


def test_windowed_layers_really_are_windowed(family_dirs):
    """The windowed families' engines attend through their windows (so the parity above is not a no-op)."""
    from clusteropt_cli.core.serve.runner import ModelRunner

    runner = ModelRunner(str(family_dirs["gemma2-hybrid"]), device="cpu", dtype="fp32", num_slots=1, max_len=128)
    windows = [m.copt_window for m in runner._attention_modules()]
    assert windows == [WINDOW, None, WINDOW, None]
    assert [m.copt_softcap for m in runner._attention_modules()] == [50.0] * 4
    assert runner.final_softcap == 30.0
    # the whole window never bites within a cache shorter than the window: plain causal attention then
    short = ModelRunner(str(family_dirs["mistral-sliding"]), device="cpu", dtype="fp32", num_slots=1, max_len=WINDOW)
    assert [m.copt_window for m in short._attention_modules()] == [None] * 4


@pytest.mark.parametrize("name", FALLBACK)
def test_unverified_architectures_fall_back_visibly_and_stay_correct(family_dirs, name, capfd):
    from transformers import AutoConfig

    from clusteropt_cli.core.serve.fallback import TransformersRunner

    config = AutoConfig.from_pretrained(family_dirs[name])
    assert not inspect_architecture(config, MAX_LEN.get(name, 128)).native
    prompts = _prompts(int(config.vocab_size))
    expected, gap = _hf_greedy(family_dirs[name], prompts)
    assert gap > 1e-3
    got, engine = _engine_greedy(family_dirs[name], prompts)
    assert isinstance(engine.runner, TransformersRunner)
    assert "fallback" in engine.runner.attention_path
    assert "transformers' own attention and KV cache" in capfd.readouterr().err
    assert got == expected


def test_fallback_rewinds_rejected_speculative_tokens(family_dirs):
    """An unrelated draft model proposes tokens the target mostly rejects: the fallback steps its caches (sliding
    layers included) back to the accepted prefix every time and stays exact."""
    name = "cohere2-hybrid"
    prompts = _prompts(1024)[:2]
    expected, _ = _hf_greedy(family_dirs[name], prompts)
    got, engine = _engine_greedy(family_dirs[name], prompts, draft_model=str(family_dirs["llama-untied"]),
                                 num_speculative_tokens=3)
    assert engine.stats.spec_drafted > engine.stats.spec_accepted  # rejections happened
    assert got == expected


def test_layer_windows_follow_transformers_masks():
    import transformers as T

    common = dict(num_hidden_layers=4)
    assert layer_windows(T.LlamaConfig(**common)) == [None] * 4
    assert layer_windows(T.MistralConfig(**common, sliding_window=512)) == [512] * 4
    assert layer_windows(T.Gemma2Config(**common, sliding_window=512)) == [512, None, 512, None]
    assert layer_windows(T.Gemma3TextConfig(num_hidden_layers=7, sliding_window=512)) == [512] * 5 + [None] + [512]
    assert layer_windows(T.Qwen2Config(**common, sliding_window=64)) == [None] * 4  # use_sliding_window=False
    assert layer_windows(T.Qwen2Config(**common, use_sliding_window=True, sliding_window=64,
                                       max_window_layers=3)) == [None] * 3 + [64]
    assert layer_windows(T.Qwen2MoeConfig(**common)) == [None] * 4  # sliding_window 0 when off
    assert layer_windows(T.Qwen3MoeConfig(**common, use_sliding_window=True, sliding_window=64)) == [64] * 4


def test_inspect_refuses_what_slot_attention_cannot_do():
    import transformers as T

    assert "gemma3_text" in NATIVE_MODEL_TYPES
    arch = inspect_architecture(T.Cohere2Config(num_hidden_layers=2))
    assert not arch.native and "cohere2" in arch.reason
    bidirectional = T.Gemma3TextConfig(num_hidden_layers=2, use_bidirectional_attention=True)
    assert "bidirectional" in inspect_architecture(bidirectional).reason
    odd = T.Qwen2Config(num_hidden_layers=2, layer_types=["full_attention", "linear_attention"])
    assert "linear_attention" in inspect_architecture(odd).reason
    dynamic = T.LlamaConfig(num_hidden_layers=2, max_position_embeddings=2048,
                            rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    assert not inspect_architecture(dynamic, max_len=4096).native
    assert "--max-model-len of at most 2047" in inspect_architecture(dynamic, max_len=4096).reason
    assert inspect_architecture(dynamic, max_len=1024).native  # the scaling never engages within the cache
    assert inspect_architecture(T.Gemma2Config(num_hidden_layers=2)).attn_softcap == 50.0
    multimodal = T.Gemma3Config(text_config={"num_hidden_layers": 2})
    assert "multimodal" in inspect_architecture(multimodal).reason


def test_slot_attention_refuses_a_window_it_was_not_given():
    from types import SimpleNamespace

    from clusteropt_cli.core.serve.attention import check_layer_kwargs

    module = SimpleNamespace(layer_idx=3, copt_window_declared=None, copt_softcap=None)
    with pytest.raises(RuntimeError, match="sliding window of 512"):
        check_layer_kwargs(module, {"sliding_window": 512})
    with pytest.raises(RuntimeError, match="soft-capping"):
        check_layer_kwargs(module, {"softcap": 50.0})
    check_layer_kwargs(SimpleNamespace(copt_window_declared=512, copt_softcap=50.0),
                       {"sliding_window": 512, "softcap": 50.0})


@pytest.mark.slow
def test_copt_serve_announces_the_fallback_and_answers_exactly(family_dirs):
    """Through the server: the fallback is announced on stderr and the completion is transformers' greedy."""
    import httpx

    from tests.integration.test_serve_helpers import running_server

    model = family_dirs["cohere2-hybrid"]
    prompt = _prompts(1024)[0]
    expected, _ = _hf_greedy(model, [prompt])
    with running_server(model, "--max-model-len", "128") as (url, proc):
        body = {"model": str(model), "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
                "return_token_ids": True, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == expected[0]
    err = proc.stderr.read()
    assert "model type 'cohere2' is not one copt's slot attention is verified for" in err
    assert "attention: transformers' own attention and cache" in err
