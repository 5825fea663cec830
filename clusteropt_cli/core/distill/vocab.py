"""Teacher/student compatibility: logit distillation compares distributions token by token, so both models must
use the same tokenizer (same token → id mapping) and produce logits over the same ids. Checked up front, from the
config and tokenizer files only (no weights loaded)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from clusteropt_cli.errors import BadInputError
from clusteropt_cli.modelspec import has_tokenizer_files


@dataclass(frozen=True)
class VocabCheck:
    """The result of a successful check: how many logit columns both models share."""

    teacher_vocab_size: int
    student_vocab_size: int
    tokenizer_size: int
    shared_logits: int  # compare logits[..., :shared_logits]
    student_has_tokenizer: bool


def read_config(path: Path) -> dict:
    """config.json of a model directory (or a config.json path)."""
    from clusteropt_cli.modelspec import read_config_json

    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.is_file():
        raise BadInputError(f"Cannot read the model config {config_path}: no such file.",
                            hint="Pass a Hugging Face model directory that contains config.json.")
    return read_config_json(config_path)


def _vocab_size(config: dict) -> int | None:
    if "vocab_size" in config:
        return int(config["vocab_size"])
    text = config.get("text_config") or {}
    return int(text["vocab_size"]) if "vocab_size" in text else None


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise BadInputError(f"Cannot load the tokenizer in {path}: {str(exc).splitlines()[0]}",
                            hint="The model directory needs its tokenizer files (tokenizer.json, ...).") from exc


def check_vocab_compatible(teacher_dir: Path, student: Path, student_config: dict | None = None,
                           *, flag_teacher: str = "--teacher", flag_student: str = "--student") -> VocabCheck:
    """Refuse (BadInputError) unless teacher and student share a tokenizer and logit vocabulary.

    `student` is a model directory or a config.json; `student_config` overrides reading it (preset configs).
    A student without tokenizer files will be trained with the teacher's tokenizer.
    """
    teacher_dir, student = Path(teacher_dir), Path(student)
    teacher_vocab = _vocab_size(read_config(teacher_dir))
    student_vocab = _vocab_size(student_config if student_config is not None else read_config(student))
    if not has_tokenizer_files(teacher_dir):
        raise BadInputError(f"{flag_teacher} {teacher_dir} has no tokenizer files.",
                            hint="The teacher directory must hold its tokenizer (save it with save_pretrained).")
    t_tok = load_tokenizer(teacher_dir)
    t_vocab = t_tok.get_vocab()
    student_tok_present = has_tokenizer_files(student)
    if student_tok_present:
        s_vocab = load_tokenizer(student).get_vocab()
        if s_vocab != t_vocab:
            only_t = len(set(t_vocab) - set(s_vocab))
            only_s = len(set(s_vocab) - set(t_vocab))
            moved = sum(1 for tok, i in t_vocab.items() if tok in s_vocab and s_vocab[tok] != i)
            raise BadInputError(
                f"{flag_teacher} and {flag_student} use different tokenizers ({len(t_vocab)} vs {len(s_vocab)} "
                f"tokens; {only_t} only in the teacher, {only_s} only in the student, {moved} with different ids): "
                "their next-token distributions cannot be compared.",
                hint="Logit distillation needs one shared vocabulary: pick a student of the teacher's family, or "
                     "use 'copt distill traces' + 'copt distill sft', which only needs text.")
    if teacher_vocab is None or student_vocab is None:
        raise BadInputError("A model config has no vocab_size.", hint="Pass causal-LM configs with vocab_size.")
    size = len(t_vocab)
    if teacher_vocab != student_vocab and min(teacher_vocab, student_vocab) < size:
        raise BadInputError(
            f"{flag_teacher} has vocab_size {teacher_vocab} but {flag_student} has {student_vocab} "
            f"(tokenizer: {size} tokens): the logits cover different token ids.",
            hint="Give the student the teacher's vocab_size (and tokenizer), or use 'copt distill traces' + "
                 "'copt distill sft'.")
    if max(teacher_vocab, student_vocab) < size:
        raise BadInputError(f"The models' vocab_size ({teacher_vocab}) is smaller than the tokenizer ({size}).",
                            hint="Resize the embeddings to the tokenizer before distilling.")
    return VocabCheck(teacher_vocab, student_vocab, size, min(teacher_vocab, student_vocab), student_tok_present)
