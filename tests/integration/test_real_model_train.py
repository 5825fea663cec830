"""copt train on real weights (SmolLM2-135M-Instruct, tests/real_model.py): fine-tuning lowers the loss from the
first step, a run killed after a checkpoint resumes onto the uninterrupted run's loss curve and step count."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.slow]

# the model is small but Adam over its 135M parameters is not: ~1.4 s a step on one CPU thread, a checkpoint (weights
# and Adam moments) is 1.6 GB. So: 2 sequences of 16 tokens, 3 steps, one checkpoint
SEQ_LEN, BLOCKS, STEPS = 16, 2, 3


def _train_text(real_model, path) -> None:
    """Held-out English prose packing into exactly BLOCKS sequences: each step's batch (micro-batch BLOCKS) is the
    whole data set, so the loss falls step over step."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_model.model)
    words = real_model.eval_text.read_text().split()[: BLOCKS * SEQ_LEN * 2]
    lo, hi = 1, len(words)
    while lo < hi:  # the longest prefix of the text that still packs into BLOCKS sequences
        mid = (lo + hi + 1) // 2
        if len(tok(" ".join(words[:mid]), add_special_tokens=False)["input_ids"]) + 1 < (BLOCKS + 1) * SEQ_LEN:
            lo = mid
        else:
            hi = mid - 1
    path.write_text(" ".join(words[:lo]) + "\n")


def _args(real_model, data, out, *extra):
    return ["train", "--model", str(real_model.model), "--data", str(data), "--output", str(out), "--seq-len",
            str(SEQ_LEN), "--micro-batch", str(BLOCKS), "--max-steps", str(STEPS), "--lr", "1e-4", "--schedule",
            "constant", "--precision", "fp32", "--save-every", "2", "--json", *extra]


def _run(copt, args) -> dict:
    done = copt(*args, env={"OMP_NUM_THREADS": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def _start(args) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "clusteropt_cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def test_train_resume_continues_the_same_curve(real_model, tmp_path, copt):
    data = tmp_path / "train.txt"
    _train_text(real_model, data)
    out, cut = tmp_path / "run", tmp_path / "cut"
    # the uninterrupted run and the same run killed (-9) after its step-2 checkpoint, side by side
    full_run, killed = _start(_args(real_model, data, out)), _start(_args(real_model, data, cut))
    try:
        deadline = time.time() + 300
        while time.time() < deadline and killed.poll() is None:
            if (cut / "checkpoints" / "step-2" / "meta.json").exists():
                break
            time.sleep(0.02)
        assert killed.poll() is None, "the run finished before it could be killed: " + killed.communicate()[1][-3000:]
        os.kill(killed.pid, signal.SIGKILL)
        killed.communicate()
        assert not (cut / "model.safetensors").exists()  # nothing final was written
        resumed = _run(copt, _args(real_model, data, cut, "--resume"))
    finally:
        stdout, stderr = full_run.communicate(timeout=300)
        if killed.poll() is None:
            killed.kill()
            killed.communicate()
    assert full_run.returncode == 0, stderr[-3000:]
    full = json.loads(stdout)
    assert full["steps"] == STEPS and full["resumed_from"] is None and full["tokens"] == STEPS * BLOCKS * SEQ_LEN
    losses = full["losses"]
    # a trained model on English prose: the loss of a language model, not of random weights (~ln 49152 = 10.8)
    assert 1.0 < losses[0] < 7.0
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses  # falls every step
    assert losses[-1] < losses[0] - 0.5, losses
    assert (out / "checkpoints" / "step-2" / "meta.json").exists()

    # the killed run resumed from its step-2 checkpoint onto the uninterrupted run's curve
    assert resumed["resumed_from"] == 2 and resumed["start_step"] == 2 and resumed["steps"] == 1
    assert resumed["losses"] == pytest.approx(losses[2:], abs=1e-4)
    history = [json.loads(line) for line in (cut / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in history] == [1, 2, 3]
    assert [r["loss"] for r in history] == pytest.approx(losses, abs=1e-4)

    # the resumed model is the uninterrupted run's model
    import torch
    from safetensors.torch import load_file

    a, b = load_file(out / "model.safetensors"), load_file(cut / "model.safetensors")
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
    assert all(v.dtype == torch.float32 for v in b.values())
