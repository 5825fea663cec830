"""lm-evaluation-harness in a venv of its own for tests/integration/test_serve_lm_eval.py.

lm-eval installs scikit-learn, and transformers imports scikit-learn in every process where it is installed (2 s of
each `copt` start-up on the CPU test machine, paid by every CLI test). So it is not in the dev extra: the venv sees
the main environment's packages (torch, transformers, datasets: `--system-site-packages`) and adds lm-eval's own,
built once from the package index and cached under ~/.cache/copt-test-venvs (COPT_FIXTURE_CACHE's parent if set).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

LM_EVAL_REQUIREMENT = "lm-eval[api]>=0.4.13,<0.5"


def _venv_root() -> Path:
    key = hashlib.sha256(f"{LM_EVAL_REQUIREMENT}{sys.version}{sys.executable}".encode()).hexdigest()[:12]
    cache = os.environ.get("COPT_FIXTURE_CACHE")
    base = Path(cache).parent if cache else Path.home() / ".cache"
    return base / "copt-test-venvs" / f"lm-eval-{key}"


def lm_eval_python() -> Path:
    """The Python of a venv where `import lm_eval` works (built on first use; raises with pip's output if not)."""
    root = _venv_root()
    python = root / "bin" / "python"
    done = root / ".complete"
    if done.is_file():
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", "--system-site-packages", str(root)], check=True)
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                           LM_EVAL_REQUIREMENT], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"building the lm-eval venv at {root} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    check = subprocess.run([str(python), "-c", "import lm_eval"], capture_output=True, text=True)
    if check.returncode != 0:
        raise RuntimeError(f"lm_eval does not import in {root}:\n{check.stderr[-3000:]}")
    done.write_text(LM_EVAL_REQUIREMENT + "\n")
    return python
