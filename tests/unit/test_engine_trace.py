"""COPT_ENGINE_TRACE=<folder>: the engine writes every step (span, batch, tokens) and every finished request
(arrival, first token, finish) at stop, and bench/engine_trace_report.py reads it back."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")


def test_trace_records_steps_and_requests(fixtures, tmp_path, monkeypatch):
    from clusteropt_cli.core.serve.engine import Engine, EngineConfig, GenerationRequest

    monkeypatch.setenv("COPT_ENGINE_TRACE", str(tmp_path / "trace"))
    engine = Engine(EngineConfig(model=str(fixtures.teacher), device="cpu", max_batch_size=4, max_model_len=128))
    with engine:
        results = engine.generate([GenerationRequest(prompt_ids=[5 + i, 6, 7, 8], max_new_tokens=6, ignore_eos=True)
                                   for i in range(3)])
    files = list((tmp_path / "trace").glob("engine-trace-*.json"))
    assert len(files) == 1
    trace = json.loads(files[0].read_text())
    assert len(trace["requests"]) == 3
    for arrival, first, finish, prompt, output in trace["requests"]:
        assert arrival <= first <= finish and prompt == 4 and output == 6
    steps = trace["steps"]
    assert all(s[0] <= s[1] for s in steps) and all(a[1] <= b[0] for a, b in zip(steps, steps[1:], strict=False))
    assert sum(s[6] for s in steps) == 12  # every prompt token computed once
    assert sum(s[7] for s in steps) == sum(r.num_output_tokens for r in results) == 18
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from engine_trace_report import loads

    (load,) = loads(trace)
    assert load["requests"] == 3 and load["output_tokens"] == 18 and load["prompt_tokens"] == 12


def test_no_trace_without_the_variable(fixtures, monkeypatch):
    from clusteropt_cli.core.serve.engine import Engine, EngineConfig

    monkeypatch.delenv("COPT_ENGINE_TRACE", raising=False)
    assert Engine(EngineConfig(model=str(fixtures.teacher), device="cpu"))._trace is None


def test_an_unwritable_trace_folder_does_not_stop_the_engine_stopping(fixtures, tmp_path, monkeypatch, capsys):
    from clusteropt_cli.core.serve.engine import Engine, EngineConfig

    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("COPT_ENGINE_TRACE", str(blocker / "trace"))
    engine = Engine(EngineConfig(model=str(fixtures.teacher), device="cpu", max_batch_size=2, max_model_len=64))
    engine.start()
    engine.stop()
    assert "engine trace was not written" in capsys.readouterr().err
