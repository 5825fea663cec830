"""Atomic, verified, resumable training checkpoints: OUTPUT/checkpoints/step-N/ (model, optimizer, scheduler, loss
scaler, RNG of every rank, data position). A checkpoint is written into a hidden temporary directory and renamed into
place only when every rank has finished writing, so a crash (even kill -9) leaves either the previous checkpoint or
the new one, never half of one. Its meta.json (written last) lists every file with its size and sha256; --resume
uses the newest checkpoint that verifies, and loads copt's own files with torch.load(weights_only=True) (tensors
and plain containers only: a planted pickle cannot run code)."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clusteropt_cli.errors import BadInputError

CHECKPOINTS = "checkpoints"
TMP_PREFIX = ".tmp-"
META = "meta.json"
META_VERSION = 2
DEFAULT_KEEP = 2


def checkpoint_root(output_dir: Path) -> Path:
    return Path(output_dir) / CHECKPOINTS


def _step_of(path: Path) -> int | None:
    try:
        return int(path.name.split("-", 1)[1])
    except (IndexError, ValueError):
        return None


def checkpoint_dirs(output_dir: Path) -> list[Path]:
    """Every step-N directory (complete or not), newest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and _step_of(p) is not None]
    return sorted(dirs, key=lambda p: _step_of(p), reverse=True)


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The newest checkpoint with its meta.json (not verified; see `select_checkpoint`), or None."""
    return next((p for p in checkpoint_dirs(output_dir) if (p / META).is_file()), None)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _sha256_all(files: list[Path]) -> list[str]:
    """sha256 of each file, several files at once (hashlib releases the GIL on large blocks): a checkpoint of
    many shards is read about as fast as the disk allows."""
    if len(files) <= 1:
        return [_sha256(f) for f in files]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(8, len(files), os.cpu_count() or 1)) as pool:
        return list(pool.map(_sha256, files))


def file_manifest(directory: Path) -> dict[str, dict[str, Any]]:
    """{relative path: {bytes, sha256}} of every file under `directory` except meta.json."""
    files = [f for f in sorted(directory.rglob("*")) if f.is_file() and f.name != META]
    return {str(f.relative_to(directory)): {"bytes": f.stat().st_size, "sha256": digest}
            for f, digest in zip(files, _sha256_all(files), strict=True)}


def verify_checkpoint(path: Path, hashes: bool = True) -> tuple[dict[str, Any] | None, str | None]:
    """(meta, None) when the checkpoint is complete and every file matches its size and checksum (`hashes=False`:
    its size only), else (None, the reason naming the file)."""
    import json

    meta_file = path / META
    if not meta_file.is_file():
        return None, f"{meta_file} is missing (an incomplete or foreign checkpoint)"
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"{meta_file} cannot be read ({exc})"
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int) or "data" not in meta:
        return None, f"{meta_file} is not a copt checkpoint's metadata"
    files = meta.get("files")
    if not isinstance(files, dict) or not files:
        return None, f"{meta_file} lists no files with checksums (written by an older copt?)"
    for name, info in files.items():  # sizes first: a truncated file is found without reading anything
        file = path / name
        if not isinstance(info, dict) or not file.is_file():
            return None, f"{file} is missing"
        size = file.stat().st_size
        if size != info.get("bytes"):
            return None, f"{file} has {size} bytes, its metadata says {info.get('bytes')} (truncated?)"
    if not hashes:
        return meta, None
    names = list(files)
    for name, digest in zip(names, _sha256_all([path / n for n in names]), strict=True):
        if digest != files[name].get("sha256"):
            return None, f"{path / name} does not match its sha256 in {META} (damaged or replaced)"
    return meta, None


@dataclass
class Selected:
    """The checkpoint --resume continues from, and the newer ones that did not verify (with why)."""

    path: Path
    meta: dict[str, Any]
    skipped: list[str] = field(default_factory=list)


def select_checkpoint(output_dir: Path, hashes: bool = True) -> Selected | None:
    """The newest checkpoint that verifies; None when there is none at all. Raises BadInputError (exit 2) naming
    the files when checkpoints exist but none verifies."""
    skipped = []
    for path in checkpoint_dirs(output_dir):
        meta, problem = verify_checkpoint(path, hashes)
        if meta is not None:
            return Selected(path, meta, skipped)
        skipped.append(problem)
    if skipped:
        raise BadInputError("--resume: no checkpoint in " f"{checkpoint_root(output_dir)} is valid:\n"
                            + "\n".join(f"  - {s}" for s in skipped),
                            hint="Nothing was changed. Restore the files named above, or start over in a new "
                                 "--output (or the same one without --resume and with --overwrite).")
    return None


def staging_dir(output_dir: Path, step: int) -> Path:
    """Where every rank writes checkpoint `step` before it is committed."""
    return checkpoint_root(output_dir) / f"{TMP_PREFIX}step-{step}"


def commit_checkpoint(output_dir: Path, step: int, meta: dict[str, Any], keep: int = DEFAULT_KEEP) -> Path:
    """(rank 0, after a barrier) Write meta.json (with every file's size and sha256) last, rename the staging
    directory into place, keep the newest `keep` checkpoints."""
    import json

    from clusteropt_cli.core.io import disk_full_as_error

    staging = staging_dir(output_dir, step)
    with disk_full_as_error(staging, cleanup=staging):
        _fsync_dir(staging)
        meta = {**meta, "meta_version": META_VERSION, "files": file_manifest(staging)}
        (staging / META).write_text(json.dumps(meta, indent=2))
        _fsync_dir(staging, only=META)
    final = checkpoint_root(output_dir) / f"step-{step}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    _fsync_path(final.parent)
    older = [p for p in checkpoint_dirs(output_dir) if p != final]
    for path in older[max(0, keep - 1):]:
        shutil.rmtree(path, ignore_errors=True)
    for path in checkpoint_root(output_dir).glob(f"{TMP_PREFIX}*"):  # leftovers of a crash
        if path != staging:
            shutil.rmtree(path, ignore_errors=True)
    return final


def _fsync_path(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_dir(path: Path, only: str | None = None) -> None:
    for file in path.rglob(only or "*"):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())


# ---- RNG state as tensors and plain values (loadable with weights_only=True) ------------------------------------
def rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from (python, torch CPU, CUDA of this device, numpy)."""
    import torch

    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64),
                                        "gauss": gauss},
                             "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                          "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    except ImportError:
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import torch

    py = state["python"]
    if isinstance(py, dict):
        random.setstate((py["version"], tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
    else:  # a tuple, as written by earlier versions
        random.setstate(py)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        import numpy as np

        ns = state["numpy"]
        if isinstance(ns, dict):
            np.random.set_state((ns["kind"], ns["keys"].numpy().astype(np.uint32), ns["pos"], ns["has_gauss"],
                                 ns["cached_gaussian"]))
        else:
            np.random.set_state(ns)


def save_torch_file(obj: Any, path: Path) -> None:
    """torch.save; a full disk becomes a DiskFullError naming the file (the partial file is removed)."""
    import torch

    from clusteropt_cli.core.io import disk_full_as_error

    with disk_full_as_error(Path(path), cleanup=Path(path)):
        torch.save(obj, path)


# The Python classes DeepSpeed pickles into its checkpoints (torch.serialization.get_unsafe_globals_in_checkpoint on
# ZeRO-1/2/3 checkpoints, fp32/bf16/fp16). DeepSpeed loads its files with weights_only=False, so copt scans them
# first (the scan reads the pickle's opcodes, it runs nothing) and refuses any other global.
DEEPSPEED_GLOBALS = frozenset({
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
})


def check_pickled_globals(directory: Path, allowed: frozenset[str] = DEEPSPEED_GLOBALS) -> None:
    """Refuse (exit 2) a checkpoint whose .pt files reference Python objects outside `allowed`, without loading
    them: what protects a library's own torch.load(weights_only=False) from a planted pickle."""
    import torch

    for file in sorted(Path(directory).rglob("*.pt")):
        try:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(str(file))
        except Exception as exc:  # noqa: BLE001 - an unreadable file is a bad checkpoint
            raise BadInputError(f"Checkpoint file {file} is not a readable torch file: {exc}",
                                hint="Restore the file copt wrote, or start over in a new --output.") from None
        unexpected = sorted(set(names) - allowed)
        if unexpected:
            raise BadInputError(f"Checkpoint file {file} references Python objects copt does not load "
                                f"({', '.join(unexpected[:5])}); unpickling them could run code.",
                                hint="Restore the file copt wrote, or start over in a new --output.")


def load_torch_file(path: Path) -> Any:
    """torch.load with weights_only=True: tensors and plain containers only, never arbitrary pickled objects."""
    import pickle

    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise BadInputError(f"Checkpoint file {path} holds objects other than tensors and plain values; copt does "
                            f"not unpickle them (it could run code): {str(exc).splitlines()[0]}",
                            hint="Restore the file copt wrote, or start over in a new --output.") from None
