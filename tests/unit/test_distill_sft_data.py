"""SFT examples: chat template, loss only on the completion tokens."""

from __future__ import annotations

import pytest

from clusteropt_cli.core.distill.sft import IGNORE_INDEX, build_sft_dataset, encode_example

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizer(fixtures):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(fixtures.tokenizer)


def test_labels_cover_exactly_the_completion(tokenizer):
    completion = "<think>\nadd 2 and 3\n</think>\n5"
    ex = encode_example(tokenizer, "What is 2+3?", completion, max_len=256)
    ids, labels = ex["input_ids"], ex["labels"]
    n_prompt = sum(1 for x in labels if x == IGNORE_INDEX)
    assert tokenizer.decode(ids[:n_prompt]) == "<|user|>\nWhat is 2+3?<|end|>\n<|assistant|>\n"
    assert tokenizer.decode(labels[n_prompt:]) == completion + "<|end|>\n"
    assert labels[n_prompt:] == ids[n_prompt:]
    assert all(x == IGNORE_INDEX for x in labels[:n_prompt])
    # the prompt part is tokenized exactly as the engine sees it at generation time
    gen_prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], tokenize=False,
                                               add_generation_prompt=True)
    assert ids[:n_prompt] == tokenizer(gen_prompt, add_special_tokens=False)["input_ids"]


def test_dataset_pads_right_with_ignored_labels_and_drops_overlong_prompts(tokenizer):
    rows = [{"prompt": "short", "completion": "x = 1"},
            {"prompt": "a longer prompt " * 3, "completion": "def f():\n    return 2"},
            {"prompt": "word " * 200, "completion": "never fits"}]
    data = build_sft_dataset(rows, tokenizer, max_len=48)
    assert len(data) == 2 and data.dropped == 1
    assert data.input_ids.shape == data.labels.shape and data.input_ids.shape[1] <= 48
    first = data[0]
    pad = tokenizer.pad_token_id
    real = int((first["input_ids"] != pad).sum())
    assert (first["labels"][real:] == IGNORE_INDEX).all()
    assert data.num_tokens == data.num_completion_tokens > 0
