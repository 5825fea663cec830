"""The teacher/student vocabulary check (config and tokenizer files only; no weights)."""

from __future__ import annotations

import json
import shutil

import pytest

from clusteropt_cli.core.distill.vocab import check_vocab_compatible
from clusteropt_cli.errors import BadInputError

pytest.importorskip("transformers")


def _foreign_tokenizer(path, text):
    """A tokenizer of the same size as the fixture's, trained on other text: the same ids mean other tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=["<|endoftext|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([text[::-1]], trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>").save_pretrained(path)


def _config_only(fixtures, tmp_path, name, **changes):
    config = json.loads((fixtures.student / "config.json").read_text())
    config.update(changes)
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


def test_same_tokenizer_passes(fixtures):
    check = check_vocab_compatible(fixtures.teacher, fixtures.student)
    assert (check.teacher_vocab_size, check.student_vocab_size, check.tokenizer_size) == (1024, 1024, 1024)
    assert check.shared_logits == 1024 and check.student_has_tokenizer


def test_different_tokenizer_of_the_same_size_is_refused(fixtures, tmp_path):
    student = tmp_path / "student"
    shutil.copytree(fixtures.student, student)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (student / name).unlink(missing_ok=True)
    _foreign_tokenizer(student, fixtures.train_text.read_text()[:100_000])
    with pytest.raises(BadInputError, match="different tokenizers") as info:
        check_vocab_compatible(fixtures.teacher, student)
    assert "distill traces" in info.value.hint  # the text-only route is offered


def test_vocab_size_mismatch_is_refused_but_padding_is_not(fixtures, tmp_path):
    with pytest.raises(BadInputError, match="vocab_size 1024 but --student has 512"):
        check_vocab_compatible(fixtures.teacher, _config_only(fixtures, tmp_path, "narrow.json", vocab_size=512))
    # an embedding padded beyond the tokenizer (as Qwen sizes do) keeps ids aligned: compare the shared 1024
    padded = check_vocab_compatible(fixtures.teacher, _config_only(fixtures, tmp_path, "pad.json", vocab_size=1088))
    assert padded.shared_logits == 1024 and not padded.student_has_tokenizer


def test_teacher_without_tokenizer_is_refused(fixtures, tmp_path):
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    shutil.copy(fixtures.teacher / "config.json", teacher / "config.json")
    with pytest.raises(BadInputError, match="no tokenizer"):
        check_vocab_compatible(teacher, fixtures.student)


def test_onpolicy_input_check_reads_eval_data_before_the_tokenizers(fixtures, tmp_path, monkeypatch):
    """check_onpolicy_inputs is every up-front check, --eval-data included (distill_onpolicy calls it too): an empty
    held-out file is refused before the tokenizers are loaded for the vocabulary check."""
    from clusteropt_cli.core.distill import vocab
    from clusteropt_cli.core.distill.onpolicy import check_onpolicy_inputs
    from clusteropt_cli.recipe.load import load_settings

    def loaded(*_args, **_kwargs):
        raise AssertionError("the tokenizers were loaded")

    monkeypatch.setattr(vocab, "check_vocab_compatible", loaded)
    prompts, empty = tmp_path / "p.txt", tmp_path / "held_out.txt"
    prompts.write_text("def f(x):\n")
    empty.write_text("\n")
    settings = load_settings("distill", None, None, {"mode": "onpolicy", "teacher": str(fixtures.teacher),
                                                     "student": str(fixtures.student), "prompts": str(prompts),
                                                     "eval_data": str(empty)})
    with pytest.raises(BadInputError, match=r"--eval-data .*held_out\.txt is empty"):
        check_onpolicy_inputs(settings)
