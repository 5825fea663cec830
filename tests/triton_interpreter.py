"""Run a script's Triton kernels on CPU tensors under the Triton interpreter, in a subprocess (TRITON_INTERPRET must
be set before triton is imported, so not in the test process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_interpreted(script: str, timeout: float = 600) -> list:
    """Run `script` (it gets the repository root as argv[1]) under TRITON_INTERPRET=1; returns the JSON list its last
    stdout line prints. Fails the test with the script's stderr when it exits non-zero."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", script, str(REPO)], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
