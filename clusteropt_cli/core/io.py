"""Atomic outputs: write into a temporary sibling, then rename; never clobber without overwrite."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from clusteropt_cli.errors import BadInputError


def check_output_dir(path: Path, overwrite: bool) -> None:
    """Refuse early (before any work) when the output exists and --overwrite was not given."""
    if path.exists() and not overwrite:
        raise BadInputError(f"Output {path} already exists.", hint="Pass --overwrite to replace it.")
    if path.exists() and not path.is_dir():
        raise BadInputError(f"Output {path} exists and is not a directory.", hint="Choose another --output.")


@contextmanager
def atomic_output_dir(path: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory next to `path`; on success it replaces `path`, on failure it is removed."""
    path = Path(path)
    check_output_dir(path, overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if path.exists():
        backup = path.parent / f".{path.name}.old-{os.getpid()}"
        os.replace(path, backup)
        os.replace(tmp, path)
        shutil.rmtree(backup, ignore_errors=True)
    else:
        os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    """Write a file through a temporary sibling and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
