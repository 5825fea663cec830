"""Atomic, resumable training checkpoints: OUTPUT/checkpoints/step-N/ (model, optimizer, scheduler, loss scaler,
RNG of every rank, data position). A checkpoint is written into a hidden temporary directory and renamed into
place only when every rank has finished writing, so a crash (even kill -9) leaves either the previous
checkpoint or the new one, never half of one."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

CHECKPOINTS = "checkpoints"
TMP_PREFIX = ".tmp-"


def checkpoint_root(output_dir: Path) -> Path:
    return Path(output_dir) / CHECKPOINTS


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The newest complete checkpoint (step-N with the highest N), or None."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return None
    done = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and (p / "meta.json").exists()]
    return max(done, key=lambda p: int(p.name.split("-", 1)[1]), default=None)


def staging_dir(output_dir: Path, step: int) -> Path:
    """Where every rank writes checkpoint `step` before it is committed."""
    return checkpoint_root(output_dir) / f"{TMP_PREFIX}step-{step}"


def commit_checkpoint(output_dir: Path, step: int, meta: dict[str, Any], keep: int = 1) -> Path:
    """(rank 0, after a barrier) Write meta.json last, rename the staging directory into place, prune old ones."""
    import json

    staging = staging_dir(output_dir, step)
    (staging / "meta.json").write_text(json.dumps(meta, indent=2))
    _fsync_dir(staging)
    final = checkpoint_root(output_dir) / f"step-{step}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    _fsync_dir(final.parent)
    older = sorted((p for p in checkpoint_root(output_dir).iterdir() if p.name.startswith("step-") and p != final),
                   key=lambda p: int(p.name.split("-", 1)[1]))
    for path in older[: max(0, len(older) - (keep - 1))]:
        shutil.rmtree(path, ignore_errors=True)
    for path in checkpoint_root(output_dir).glob(f"{TMP_PREFIX}*"):  # leftovers of a crash
        if path != staging:
            shutil.rmtree(path, ignore_errors=True)
    return final


def _fsync_dir(path: Path) -> None:
    for file in path.rglob("*"):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())


def rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from (python, torch CPU, CUDA of this device)."""
    import torch

    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import torch

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def save_torch_file(obj: Any, path: Path) -> None:
    import torch

    torch.save(obj, path)


def load_torch_file(path: Path) -> Any:
    import torch

    return torch.load(path, map_location="cpu", weights_only=False)
