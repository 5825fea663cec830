"""Reading the text and JSON-lines files users pass (data, calibration, prompts, traces), with errors that
name the flag, the file and the line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from clusteropt_cli.errors import BadInputError


def check_regular_file(path: Path, flag: str, hint: str) -> None:
    """A regular file (or a link to one): a missing path, a directory, a pipe or a device is a BadInputError naming
    `flag` (a pipe would block the read forever, /dev/zero fill the memory)."""
    try:
        if path.is_file():
            return
        exists = path.exists()
    except (OSError, RuntimeError):  # a link loop, a name too long
        exists = True
    if not exists:
        raise BadInputError(f"{flag} {path}: no such file (it does not exist).", hint=hint)
    kind = "a directory" if path.is_dir() else "not a regular file (a pipe, a device or a link loop)"
    raise BadInputError(f"{flag} {path} is {kind}.", hint=hint)


def read_text_file(path: str | Path, flag: str, hint: str) -> str:
    """The whole file as UTF-8 text; a missing or undecodable file is a BadInputError naming `flag`."""
    path = Path(path)
    check_regular_file(path, flag, hint)
    try:
        return path.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors write one) is not text
    except UnicodeDecodeError as exc:
        raise BadInputError(f"{flag} {path} is not UTF-8 text ({exc.reason} at byte {exc.start}).",
                            hint=hint) from None


def jsonl_rows(path: str | Path, flag: str, hint: str, problems: list[str] | None = None) -> list[tuple[int, Any]]:
    """(line number, parsed value) for every non-empty line of a .jsonl file.

    A line that is not JSON raises a BadInputError naming it, or, when `problems` is given, is recorded there
    ("line N: not valid JSON (...)") and skipped, so a caller can report every problem at once.
    """
    rows = []
    for number, line in enumerate(read_text_file(path, flag, hint).splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append((number, json.loads(line)))
        except (ValueError, RecursionError) as exc:  # not JSON, a number too long, nested too deep
            why = exc.msg if isinstance(exc, json.JSONDecodeError) else (
                "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:120])
            if problems is None:
                raise BadInputError(f"{flag} {path}: line {number} is not valid JSON ({why}).",
                                    hint=hint) from None
            problems.append(f"line {number}: not valid JSON ({why})")
    return rows


def string_field(row: Any, *names: str) -> str | None:
    """The first of `names` that holds a string in a JSON object (None otherwise)."""
    if not isinstance(row, dict):
        return None
    for name in names:
        if isinstance(row.get(name), str):
            return row[name]
    return None
