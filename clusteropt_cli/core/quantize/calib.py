"""Calibration and evaluation text: read and validate up front, before any model is loaded."""

from __future__ import annotations

from pathlib import Path

from clusteropt_cli.core.textfiles import jsonl_rows, read_text_file, string_field
from clusteropt_cli.errors import BadInputError


def read_calibration_texts(path: str | Path, num_samples: int, flag: str = "--calib") -> list[str]:
    """The first `num_samples` non-empty samples of a .txt (one per line) or .jsonl (`text` field) file."""
    path = Path(path)
    hint = 'Pass a UTF-8 .txt file (one sample a line) or .jsonl with one {"text": "..."} a line.'
    texts: list[str] = []
    if path.suffix.lower() in (".jsonl", ".json"):
        for lineno, record in jsonl_rows(path, flag, hint):
            text = string_field(record, "text")
            if text is None:
                raise BadInputError(f"{flag} {path}: line {lineno} has no string 'text' field.", hint=hint)
            if text.strip():
                texts.append(text)
            if len(texts) >= num_samples:
                break
    else:
        texts = [line for line in read_text_file(path, flag, hint).splitlines() if line.strip()][:num_samples]
    if not texts:
        raise BadInputError(f"{flag} {path} holds no text samples.",
                            hint="Give at least one non-empty line (.txt) or record with 'text' (.jsonl).")
    return texts


def read_eval_text(path: str | Path, flag: str = "--eval") -> str:
    """The whole evaluation text (perplexity is measured over blocks of it)."""
    text = read_text_file(path, flag, hint="Pass a UTF-8 text file with some held-out text.")
    if not text.strip():
        raise BadInputError(f"{flag} {path} is empty.", hint="Pass a text file with some held-out text.")
    return text
