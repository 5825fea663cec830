"""The shared fixture models are trained, not random, and share one tokenizer."""

from __future__ import annotations

import json
import math


def test_fixture_models_are_trained(fixtures):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.fixture_models import SEQ_LEN, _blocks, eval_loss

    tokenizer = AutoTokenizer.from_pretrained(fixtures.tokenizer)
    ids = tokenizer(fixtures.eval_text.read_text())["input_ids"]
    blocks = _blocks(ids, SEQ_LEN)[:16]
    random_loss = math.log(len(tokenizer))
    losses = {}
    for name in ("teacher", "student", "draft"):
        model = AutoModelForCausalLM.from_pretrained(getattr(fixtures, name))
        losses[name] = eval_loss(model, blocks)
        recorded = json.loads((getattr(fixtures, name) / "fixture.json").read_text())
        assert recorded["eval_loss"] < recorded["eval_loss_random_init"] - 1.0
    # clearly below a random model (ln V = 6.93 nats), and the teacher is the strongest
    assert losses["teacher"] < random_loss - 2.0, losses
    assert losses["student"] < random_loss - 0.8, losses
    assert losses["draft"] < random_loss - 1.5, losses
    assert losses["teacher"] < losses["student"]


def test_fixture_models_share_a_tokenizer(fixtures):
    from transformers import AutoTokenizer

    vocabularies = [AutoTokenizer.from_pretrained(getattr(fixtures, n)).get_vocab() for n in ("teacher", "student",
                                                                                            "draft")]
    assert vocabularies[0] == vocabularies[1] == vocabularies[2]
    tokenizer = AutoTokenizer.from_pretrained(fixtures.teacher)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == "<|user|>\nhi<|end|>\n<|assistant|>\n"
    assert "<think>" in tokenizer.get_vocab()
    assert fixtures.eval_text.read_text()[:2000] not in fixtures.train_text.read_text()
