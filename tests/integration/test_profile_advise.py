"""profile → advise --from-profile → profile --expect: the closed loop on CPU with the fixture teacher."""

from __future__ import annotations

import json

import pytest

from tests.integration.test_profile_model import _run_main

BUDGET_GIB = 0.03


@pytest.mark.slow
def test_profile_advise_expect_loop(fixtures, tmp_path, capsys):
    profile_json, recipe = tmp_path / "profile.json", tmp_path / "fix.yaml"
    code, _, err = _run_main(["profile", "model", str(fixtures.teacher), "--mode", "train", "--micro-batch", "4",
                              "--seq-len", "128", "--warmup", "0", "--repeats", "1", "--memory-budget",
                              str(BUDGET_GIB), "--report", str(profile_json)], capsys)
    assert code == 0, err
    measured = json.loads(profile_json.read_text())
    assert measured["verdict"]["bottleneck"] == "memory-capacity-bound" and "oom" in measured["verdict"]["symptoms"]

    code, out, err = _run_main(["advise", "--from-profile", str(profile_json), "--memory-budget", str(BUDGET_GIB),
                                "--emit-recipe", str(recipe), "--json"], capsys)
    assert code == 0, err
    advice = json.loads(out)
    ids = [r["id"] for r in advice["recommendations"]]
    assert ids and ids[0] == "activation-checkpointing", ids  # the verdict became a recommendation
    assert recipe.is_file()

    code, out, err = _run_main(["profile", "model", "--expect", str(recipe), "--warmup", "0", "--repeats", "1",
                                "--json"], capsys)
    doc = json.loads(out)
    peak = {f["name"]: f for f in doc["check"]["figures"]}["peak_mem_bytes"]
    assert doc["profile"]["workload"]["activation_checkpointing"] is True
    assert peak["measured"] < BUDGET_GIB * 1024**3  # the applied fix fits the budget
    assert peak["status"] == "pass" and abs(peak["rel_error"]) <= 0.10, peak
    assert code == 0, err
