"""Build DeepSpeed's CPU ops once (CPU Adam, the shared-memory communication op), as DeepSpeed would on first use.

`python3 -m tests.build_jit_ops` compiles them into torch's extension cache (several minutes on 2 cores, once per
machine). The tests marked `jit` need them: they run when the ops are built and are skipped, with this command in
the reason, when they are not, so that a first `python3 -m pytest` compiles nothing. CI runs this first.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

OPS = {"CPUAdamBuilder": "cpu_adam", "ShareMemCommBuilder": "deepspeed_shm_comm"}


def extension_dir() -> Path:
    """Where torch's cpp_extension puts JIT-built ops (TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(root) / f"py{sys.version_info.major}{sys.version_info.minor}_cpu"


def built() -> bool:
    """True when every op the jit tests load is in the extension cache."""
    return all((extension_dir() / name / f"{name}.so").exists() for name in OPS.values())


def build() -> None:
    from deepspeed.accelerator import get_accelerator

    for builder_name, name in OPS.items():
        start = time.time()
        get_accelerator().create_op_builder(builder_name).load(verbose=False)
        print(f"{name}: ready in {time.time() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    build()
    if not built():
        sys.exit(f"DeepSpeed's ops were loaded but are not in {extension_dir()}")
