"""Output safety for every command that writes, and atomic outputs.

The rule (one function, `check_output`, called by every command before any work):
  - an output never equals, contains or lies inside an input (model, tokenizer, draft, data, calib, eval, recipe),
    symlinks resolved;
  - an existing non-empty output directory is replaced only with --overwrite, and only when copt wrote it (it holds
    the marker file OUTPUT_MARKER) or it is empty; otherwise copt refuses and names what it would delete;
  - nothing is deleted before the inputs are validated, and a replacement is atomic: the new output is written
    beside the old one (`atomic_output_dir`) or the old one is moved aside and restored when the run fails
    (`replacing_output_dir`), so a failed run leaves the old output intact.
Temporary siblings (`.OUT.tmp-*`) carry an owner file (pid, host, process start time); a later run removes those
whose owning process is gone (`clean_stale_temp_dirs`).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from clusteropt_cli.errors import BadInputError, DiskFullError

OUTPUT_MARKER = ".copt-output.json"  # in every output directory copt writes: --overwrite may replace it
TMP_OWNER = ".copt-tmp-owner.json"  # in every temporary directory: who may clean it up when its run died
_SHOWN = 5


def _resolved(path: str | Path, flag: str = "") -> Path:
    """The absolute path with every link followed; a link loop (or a name the system refuses) is bad input."""
    try:
        return Path(path).expanduser().resolve()
    except (RuntimeError, OSError) as exc:  # RuntimeError: Python 3.11's "Symlink loop"
        raise BadInputError(f"{flag + ' ' if flag else ''}{path}: cannot follow its links ({exc}).",
                            hint="Remove the link loop, or give another path.") from None


def _listing(path: Path) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def check_output(output: str | Path, inputs: Mapping[str, str | Path | None] | None = None, *,
                 overwrite: bool = False, kind: str = "dir", resume: bool = False, flag: str = "--output",
                 can_resume: bool = False) -> None:
    """Refuse, before any work, an output that would destroy something the user did not ask to replace.

    `inputs`: flag → path of every input of the command (None and non-paths such as preset names are skipped).
    `kind`: "dir" (an output directory) or "file". `resume`: the run continues an existing output directory;
    `can_resume`: the command has --resume (the hint names it).
    """
    out_given = Path(output).expanduser()
    out = _resolved(out_given, flag)
    check_parent_is_directory(out, flag, output)
    for in_flag, given in (inputs or {}).items():
        if given is None or str(given) == "":
            continue
        path = Path(str(given)).expanduser()
        if not os.path.lexists(path):
            continue
        inp = _resolved(path, in_flag)
        if out == inp:
            relation = "is"
        elif out in inp.parents:
            relation = "contains"
        elif inp in out.parents:
            relation = "lies inside"
        else:
            continue
        raise BadInputError(f"{flag} {output} {relation} the input {in_flag} {given}; copt never writes over its "
                            "inputs.", hint=f"Choose a {flag} outside every input"
                            + (" (e.g. a new sibling directory)." if kind == "dir" else "."))
    if not os.path.lexists(out_given):
        if kind == "file":
            _check_writable(out.parent, flag, output)
        return
    if kind == "file":
        if out.is_dir():
            raise BadInputError(f"{flag} {output} is a directory.", hint=f"Give a file name for {flag}.")
        if not overwrite:
            raise BadInputError(f"{flag} {output} already exists.",
                                hint="Pass --overwrite to replace it, or choose another name.")
        return
    if not out.is_dir():
        raise BadInputError(f"{flag} {output} exists and is not a directory.", hint=f"Choose another {flag}.")
    here = Path.cwd().resolve()
    if out == here or out in here.parents:  # replacing it would move the directory this process (and shell) is in
        raise BadInputError(f"{flag} {output} is " + ("the current directory" if out == here else
                                                     "a parent of the current directory")
                            + "; copt writes a new output beside it and swaps them, which it cannot do to the "
                              "directory it runs in.",
                            hint=f"Give {flag} a new subdirectory (e.g. {flag} out), or run copt from elsewhere.")
    if _is_empty(out):
        return
    if resume:
        if not (out / OUTPUT_MARKER).is_file():
            raise BadInputError(f"{flag} {output} was not written by copt (it has no {OUTPUT_MARKER}); --resume "
                                f"continues only a copt output, and would write into: {_listing(out)}.",
                                hint=f"Resume from the {flag} of the earlier copt run, or choose a new {flag}.")
        writer = _marker_command(out)
        if writer is not None and writer not in RESUMABLE_COMMANDS:
            raise BadInputError(f"{flag} {output} was written by 'copt {writer}'; --resume continues the checkpoints "
                                f"of a training run ({', '.join(RESUMABLE_COMMANDS)}) and would write over its files.",
                                hint=f"Choose a new {flag}.")
        return
    if not overwrite:
        raise BadInputError(f"{flag} {output} already exists.",
                            hint="Pass --overwrite to replace it (only a directory copt wrote), "
                                 + ("--resume to continue its checkpoints, " if can_resume else "")
                                 + f"or choose another {flag}.")
    if not (out / OUTPUT_MARKER).is_file():
        raise BadInputError(f"{flag} {output} was not written by copt (it has no {OUTPUT_MARKER}); --overwrite "
                            f"would delete: {_listing(out)}.",
                            hint=f"Choose a new {flag}, or move that directory away yourself.")


def _check_writable(directory: Path, flag: str, given: str | Path) -> None:
    """A file can be created in `directory` (a read-only or pseudo file system such as /proc fails here, before the
    work, not when the results are written)."""
    if not directory.is_dir():
        return  # check_parent_is_directory names that
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        raise BadInputError(f"{flag} {given}: cannot create a file in {directory} ({exc.strerror or exc}).",
                            hint=f"Choose a {flag} in a directory you can write to.") from None


def check_parent_is_directory(path: Path, flag: str, given: str | Path | None = None) -> None:
    """The nearest existing parent of an output to be written must be a directory (a file there would make the
    write fail after the work)."""
    for parent in Path(os.path.abspath(path)).parents:
        if os.path.lexists(parent):
            if not parent.is_dir():
                raise BadInputError(f"{flag} {given if given is not None else path}: {parent} is a file, not a "
                                    "directory.", hint=f"Give {flag} a path in a directory.")
            return


def check_distinct_outputs(outputs: Mapping[str, str | Path | None]) -> None:
    """Refuse two outputs of one run that name the same path (one would silently replace the other)."""
    seen: dict[Path, str] = {}
    problems = []
    for flag, given in outputs.items():
        if given is None or str(given) == "":
            continue
        path = _resolved(given, flag)
        if path in seen:
            problems.append(f"{seen[path]} and {flag} both name {given}")
        else:
            seen[path] = flag
    if problems:
        raise BadInputError("; ".join(problems) + ".", hint="Give each output its own path.")


# the commands whose outputs `--resume` continues (their checkpoints and metrics)
RESUMABLE_COMMANDS = ("train", "distill logits", "distill sft")


def _marker_command(directory: Path) -> str | None:
    """The command a copt output's marker names (None: an older marker without one); unreadable → '?'."""
    try:
        value = json.loads((directory / OUTPUT_MARKER).read_text(encoding="utf-8")).get("command")
    except (OSError, ValueError, AttributeError):
        return "?"
    return value if isinstance(value, str) or value is None else "?"


def _is_empty(directory: Path) -> bool:
    """Empty, or holding only copt's marker (a run that failed before writing anything: with its empty
    metrics.jsonl at most)."""
    items = list(directory.iterdir())
    if not any(p.name == OUTPUT_MARKER for p in items):
        return not items
    return all(p.name == OUTPUT_MARKER or (p.name == "metrics.jsonl" and p.is_file() and not p.is_symlink()
                                            and p.stat().st_size == 0) for p in items)


def write_output_marker(directory: str | Path, command: str) -> None:
    """Mark `directory` as a copt output (what lets --overwrite replace it later)."""
    from clusteropt_cli import __version__

    path = Path(directory) / OUTPUT_MARKER
    if path.exists():
        return
    path.write_text(json.dumps({"written_by": "copt", "version": __version__, "command": command,
                                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=2) + "\n")


# ---- temporary directories and their owners ----------------------------------------------------------------
def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc), to tell a reused pid from the owner."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def _write_owner(directory: Path) -> None:
    pid = os.getpid()
    (directory / TMP_OWNER).write_text(json.dumps({"pid": pid, "host": socket.gethostname(),
                                                   "start": _start_time(pid)}))


def _owner_alive(directory: Path) -> bool:
    """Whether the process that created this temporary directory may still be running (unknown → alive)."""
    try:
        owner = json.loads((directory / TMP_OWNER).read_text())
        pid = int(owner["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return True  # not ours (or not provably): leave it alone
    if owner.get("host") != socket.gethostname():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    start = owner.get("start")
    return start is None or _start_time(pid) in (None, start)


def clean_stale_temp_dirs(parent: Path, pattern: str) -> list[Path]:
    """Remove the temporary directories matching `pattern` in `parent` that copt created and whose process died."""
    removed = []
    if not parent.is_dir():
        return removed
    for path in parent.glob(pattern):
        if path.is_dir() and not path.is_symlink() and (path / TMP_OWNER).is_file() and not _owner_alive(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def make_temp_dir(parent: Path, prefix: str) -> Path:
    """A temporary directory in `parent` with an owner file (so a later run may clean it if this one is killed)."""
    parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temp_dirs(parent, f"{prefix}*")
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0700 would outlive the rename: an output as mkdir would make it
    _write_owner(tmp)
    return tmp


def open_permissions(tree: Path) -> None:
    """Files a library wrote private (safetensors' 0600) get the permissions the user's umask gives new files."""
    mode = 0o666 & ~_umask()
    for item in [tree, *tree.rglob("*")] if tree.is_dir() else [tree]:
        if item.is_file() and not item.is_symlink() and item.stat().st_mode & 0o777 == 0o600 and mode != 0o600:
            os.chmod(item, mode)


def _umask() -> int:
    """The process's umask (read by setting it and back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# ---- atomic outputs ------------------------------------------------------------------------------------------
def check_output_dir(path: Path, overwrite: bool) -> None:
    """check_output for a directory without inputs (kept for callers that check only the output)."""
    check_output(path, None, overwrite=overwrite)


@contextmanager
def atomic_output_dir(path: Path, overwrite: bool = False, command: str = "copt",
                      needed_bytes: int | None = None) -> Iterator[Path]:
    """Yield a temporary directory next to `path`; on success it replaces `path` (swap), on failure it is removed
    and the old `path` stays as it was. The new directory carries the copt output marker."""
    path = Path(os.path.abspath(path))  # `.` or `..`: its own name and parent (its temporary sibling is outside it)
    check_output(path, None, overwrite=overwrite)
    tmp = make_temp_dir(path.parent, f".{path.name}.tmp-")
    try:
        with disk_full_as_error(path, cleanup=tmp, needed_bytes=needed_bytes):
            yield tmp
            write_output_marker(tmp, command)
            (tmp / TMP_OWNER).unlink(missing_ok=True)
            open_permissions(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        check_output(path, None, overwrite=overwrite)  # the old output may have changed during the run
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # its owner file is gone: no later run would clean it
        raise
    if os.path.lexists(path):
        backup = path.parent / f".{path.name}.old-{os.getpid()}"
        os.replace(path, backup)
        os.replace(tmp, path)
        if backup.is_dir() and not backup.is_symlink():
            shutil.rmtree(backup, ignore_errors=True)
        else:
            backup.unlink(missing_ok=True)
    else:
        os.replace(tmp, path)


@contextmanager
def replacing_output_dir(path: Path, *, overwrite: bool, resume: bool = False, command: str = "copt",
                         enabled: bool = True) -> Iterator[Path]:
    """For outputs written in place (training: checkpoints, metrics.jsonl): with --overwrite an existing copt output
    is moved aside (not deleted) while the run writes a new one, deleted once the run succeeded, and restored when
    it fails. `enabled=False` (a rank under a launcher, whose parent prepared the directory) does nothing."""
    path = Path(os.path.abspath(path))
    if not enabled:
        yield path
        return
    check_output(path, None, overwrite=overwrite, resume=resume)
    backup = None
    existed = path.is_dir()
    try:  # a stop (SIGTERM, Ctrl-C) may land anywhere from here on, the move aside included
        if not resume and existed and not _is_empty(path):
            backup = make_temp_dir(path.parent, f".{path.name}.replaced-")
            os.replace(path, backup / "old")
        path.mkdir(parents=True, exist_ok=True)
        write_output_marker(path, command)
        yield path
    except BaseException:
        if backup is not None:
            if os.path.lexists(backup / "old"):  # moved aside: the new output goes, the old comes back
                shutil.rmtree(path, ignore_errors=True)
                os.replace(backup / "old", path)
            shutil.rmtree(backup, ignore_errors=True)
        elif path.is_dir() and _is_empty(path):  # nothing written: leave no trace (a new dir goes, an old stays empty)
            (path / OUTPUT_MARKER).unlink(missing_ok=True)
            (path / "metrics.jsonl").unlink(missing_ok=True)
            if not existed:
                path.rmdir()
        raise
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)


def atomic_write_text(path: Path, text: str) -> None:
    """Write a file through a temporary sibling and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600: the file as open() would create it
    try:
        with disk_full_as_error(Path(tmp)), os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---- full disks ----------------------------------------------------------------------------------------------
GiB = 1024**3


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC, directly or wrapped by torch's zip writer (RuntimeError 'PytorchStreamWriter failed writing file' /
    'enforce fail at inline_container', 'unexpected pos') or another library's error naming it."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(exc)
        if isinstance(exc, RuntimeError) and ("PytorchStreamWriter failed writing file" in text
                                              or "inline_container" in text) and (
                "No space left" in text or "file write failed" in text or "failed writing" in text
                or "unexpected pos" in text):  # its writer's check after a short write
            return True
        if "No space left on device" in text:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def _size(n: float) -> str:
    return f"{n / GiB:.1f} GiB" if n >= 0.1 * GiB else f"{n / 2**20:.1f} MiB"


def disk_full_error(path: Path, needed_bytes: int | None = None) -> DiskFullError:
    """The error for a write that ran out of space at `path` (`needed_bytes`: what the output takes, or at least
    what had been written when the disk filled)."""
    path = Path(path)
    device = path
    while not device.exists() and device != device.parent:
        device = device.parent
    try:
        free = shutil.disk_usage(device).free
    except OSError:
        free = None
    facts = ([f"needs ~{_size(needed_bytes)}"] if needed_bytes else []) + \
        ([f"{_size(free)} free"] if free is not None else [])
    return DiskFullError(f"No space left on device at {path}" + (f" ({', '.join(facts)})" if facts else "") + ".",
                         hint="Free space there or choose an --output on a larger filesystem; the partial files "
                              "were removed.")


@contextmanager
def disk_full_as_error(path: Path, cleanup: Path | None = None,
                       needed_bytes: int | Callable[[], int | None] | None = None) -> Iterator[None]:
    """Turn a full-disk failure inside the block into a DiskFullError naming `path`; `cleanup` (a file or directory
    of partial output) is removed first. The size named is `needed_bytes` (an estimate of the whole output, or a
    function computing it) when larger than what had been written."""
    try:
        yield
    except Exception as exc:  # OSError, torch's RuntimeError, safetensors' SafetensorError, ...
        if not isinstance(exc, DiskFullError) and not is_disk_full(exc):
            raise
        written = _tree_bytes(cleanup or path)
        try:
            estimate = needed_bytes() if callable(needed_bytes) else needed_bytes
        except Exception:  # noqa: BLE001 - the estimate is best effort
            estimate = None
        written = max(written, int(estimate or 0))
        if cleanup is not None:
            if cleanup.is_dir() and not cleanup.is_symlink():
                shutil.rmtree(cleanup, ignore_errors=True)
            else:
                cleanup.unlink(missing_ok=True)
        if isinstance(exc, DiskFullError) and not estimate:
            raise
        raise disk_full_error(path, written) from exc


def write_diagnostic_json(path: str | Path, document: object, what: str) -> None:
    """Write a diagnostic file (a trace) atomically; one that cannot be written is reported on stderr and the caller
    goes on (a server stopping must not fail on its diagnostics)."""
    import sys

    try:
        atomic_write_text(Path(path), json.dumps(document))
    except Exception as exc:  # noqa: BLE001 - a full disk, a folder that is a file, no permission
        print(f"copt: the {what} was not written to {path}: {exc}", file=sys.stderr)
