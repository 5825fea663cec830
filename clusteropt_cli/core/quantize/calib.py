"""Calibration and evaluation text: read and validate up front, before any model is loaded."""

from __future__ import annotations

import json
from pathlib import Path

from clusteropt_cli.errors import BadInputError


def read_calibration_texts(path: str | Path, num_samples: int, flag: str = "--calib") -> list[str]:
    """The first `num_samples` non-empty samples of a .txt (one per line) or .jsonl (`text` field) file."""
    path = Path(path)
    if not path.is_file():
        raise BadInputError(f"{flag} {path}: no such file.", hint="Pass a .txt (one sample a line) or .jsonl file.")
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise BadInputError(f"{flag} {path} is not UTF-8 text ({exc.reason} at byte {exc.start}).",
                            hint="Pass a UTF-8 .txt or .jsonl file.") from None
    texts: list[str] = []
    if path.suffix.lower() in (".jsonl", ".json"):
        for lineno, line in enumerate(raw.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise BadInputError(f"{flag} {path}: line {lineno} is not valid JSON ({exc.msg}).",
                                    hint='Write one JSON object a line, e.g. {"text": "..."}.') from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise BadInputError(f"{flag} {path}: line {lineno} has no string 'text' field.",
                                    hint='Write one JSON object a line, e.g. {"text": "..."}.')
            if record["text"].strip():
                texts.append(record["text"])
            if len(texts) >= num_samples:
                break
    else:
        texts = [line for line in raw.splitlines() if line.strip()][:num_samples]
    if not texts:
        raise BadInputError(f"{flag} {path} holds no text samples.",
                            hint="Give at least one non-empty line (.txt) or record with 'text' (.jsonl).")
    return texts


def read_eval_text(path: str | Path, flag: str = "--eval") -> str:
    """The whole evaluation text (perplexity is measured over blocks of it)."""
    path = Path(path)
    if not path.is_file():
        raise BadInputError(f"{flag} {path}: no such file.", hint="Pass a plain text file.")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise BadInputError(f"{flag} {path} is not UTF-8 text ({exc.reason} at byte {exc.start}).",
                            hint="Pass a UTF-8 text file.") from None
    if not text.strip():
        raise BadInputError(f"{flag} {path} is empty.", hint="Pass a text file with some held-out text.")
    return text
