"""bench/common.py's host probe: what every benchmark records about the machine's CPU, including the AdamW step on
the CPU that ZeRO-Offload's optimizer step resembles."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import common  # noqa: E402


def test_cpu_adamw_probe_times_a_step_per_parameter() -> None:
    small = common.cpu_adamw_ns_per_param(params=2**14, reps=3)
    large = common.cpu_adamw_ns_per_param(params=2**20, reps=3)
    assert 0 < large < 1e3 and 0 < small
    # a per-parameter figure: a 64× larger step spreads its fixed cost thinner, so its ns per parameter is not
    # many times the small one's
    assert large < small * 8


def test_host_probe_records_the_adamw_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "cpu_adamw_ns_per_param", lambda: 1.25)
    probe = common.host_probe()
    assert probe["cpu_adamw_ns_per_param"] == 1.25 and probe["python_loop_us"] > 0
