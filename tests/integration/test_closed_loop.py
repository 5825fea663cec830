"""Issue 9: profile → advise → apply → verify, end to end on the CPU with the fixture teacher.

A training step of micro-batch 4 × 128 does not fit a stated 0.03 GiB budget. `copt profile` says so
(memory-capacity-bound, symptom oom), `copt advise --from-profile` turns that into a recipe for its top
recommendation with a prediction block, `copt train --recipe` applies the recipe, and
`copt profile --expect` measures again and compares with the prediction (the CI gate exits 6 on a miss).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO

BUDGET_GIB = "0.03"


@pytest.mark.slow
def test_closed_loop_train_on_cpu(fixtures, tmp_path, copt):
    profile_json, recipe = tmp_path / "profile.json", tmp_path / "plan.yaml"

    # 1. measure: the step does not fit the budget
    result = copt("profile", "model", str(fixtures.teacher), "--mode", "train", "--micro-batch", "4", "--seq-len",
                  "128", "--precision", "fp32", "--warmup", "0", "--repeats", "1", "--memory-budget", BUDGET_GIB,
                  "--report", str(profile_json))
    assert result.returncode == 0, result.stderr
    before = json.loads(profile_json.read_text())
    assert before["verdict"]["bottleneck"] == "memory-capacity-bound"
    assert "oom" in before["verdict"]["symptoms"]
    assert before["metrics"]["peak_mem_bytes"] > float(BUDGET_GIB) * 1024**3

    # 2. advise: the verdict becomes a ranked plan and a recipe carrying its prediction
    result = copt("advise", "--from-profile", str(profile_json), "--emit-recipe", str(recipe), "--json")
    assert result.returncode == 0, result.stderr
    advice = json.loads(result.stdout)
    assert advice["recommendations"][0]["id"] == "activation-checkpointing"
    assert advice["memory"]["fits"] is False  # as measured
    plan = yaml.safe_load(recipe.read_text())
    assert recipe.read_text().startswith("# copt train --recipe")
    assert plan["activation_checkpointing"] is True
    predicted_peak = plan["prediction"]["figures"]["peak_mem_bytes"]
    assert predicted_peak < float(BUDGET_GIB) * 1024**3 < before["metrics"]["peak_mem_bytes"]

    # the gate fails when the prediction is wrong: the recipe with its prediction halved must exit 6
    wrong_plan = {**plan, "prediction": {**plan["prediction"], "figures": {"peak_mem_bytes": predicted_peak / 2}}}
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(yaml.safe_dump(wrong_plan))

    # 3. apply, 4. verify and the failing gate read only the recipes: three independent commands, run side by side
    out = tmp_path / "trained"
    train, verify, gate = (_start(*args) for args in (
        ("train", "--recipe", str(recipe), "--data", str(fixtures.train_text), "--output", str(out), "max_steps=3",
         "--json"),
        ("profile", "model", "--expect", str(recipe), "--warmup", "0", "--repeats", "1", "--json"),
        ("profile", "model", "--expect", str(wrong), "--warmup", "0", "--repeats", "1")))

    # 3. apply: copt train runs the recipe as written (a few steps) and saves a loadable model
    result = _finish(train)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["loss"] > 0 for r in rows)
    assert (out / "config.json").is_file()

    # 4. verify: measure again against the recipe's prediction
    result = _finish(verify)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    figures = {f["name"]: f for f in doc["check"]["figures"]}
    peak = figures["peak_mem_bytes"]
    assert peak["predicted"] == pytest.approx(predicted_peak)
    assert peak["measured"] < float(BUDGET_GIB) * 1024**3
    assert peak["status"] == "pass" and abs(peak["rel_error"]) <= 0.10, peak

    result = _finish(gate)
    assert result.returncode == 6, result.stderr


def _start(*args: str) -> subprocess.Popen:
    """`copt ARGS` started in the background (one OpenMP thread; it measures its own tensors, not the machine)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "clusteropt_cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
