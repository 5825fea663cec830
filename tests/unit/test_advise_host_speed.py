"""The serving host's speed in advise: copt serve's host work is priced at the host's time for copt's reference Python
loop (core/hostspeed.py) over the calibration machines' (calibration.HOST_LOOP_REFERENCE_S)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from clusteropt_cli.core.advise import api
from clusteropt_cli.core.advise import calibration as cal
from clusteropt_cli.core.advise.closed_loop import closed_loop_figures
from clusteropt_cli.core.advise.plan import InferPlan, Target
from clusteropt_cli.core.advise.timing import infer_time
from clusteropt_cli.core.hostspeed import python_loop_seconds
from clusteropt_cli.errors import BadInputError
from clusteropt_cli.hardware import get_gpu
from clusteropt_cli.modelspec import load_model_spec
from tests.unit.test_advise_one_truth import GIVEN, _endpoint_profile

SPEC = load_model_spec("llama-3.2-1b")
PLAN = InferPlan(batch=256, prompt_len=256, gen_len=128, continuous_batching=True, temperature=1.0, top_p=0.95)
H100 = Target(get_gpu("h100-sxm"))


def _costs(host_loop_s: float | None):
    return infer_time(SPEC, PLAN, replace(H100, host_loop_s=host_loop_s)).costs


def test_the_reference_host_prices_as_an_unknown_one() -> None:
    unknown = infer_time(SPEC, PLAN, H100)
    reference = infer_time(SPEC, PLAN, replace(H100, host_loop_s=cal.HOST_LOOP_REFERENCE_S))
    assert unknown.figures == reference.figures
    assert "host_work_scale" not in unknown.assumptions


def test_a_faster_host_shortens_the_exposed_host_work_only() -> None:
    """Half the loop time: the host work of an unchained step (cal.UNCHAINED_STEP_* and the engine's own work per
    step and sequence it exposes) and per prompt chunk halves; a chained decode pass (its host work hidden behind
    the GPU's) costs the same; the API process's work per request and token halves."""
    ref, fast = _costs(None), _costs(cal.HOST_LOOP_REFERENCE_S / 2)
    engine = cal.SERVING_ENGINES["copt"]
    for rows in (1, 64, 256):
        exposed = engine["step_fixed_s"] + engine["step_per_seq_s"] * rows
        unchained = cal.UNCHAINED_STEP_S + cal.UNCHAINED_STEP_PER_SEQ_S * rows
        assert ref.unchained_s(rows) == pytest.approx(unchained)
        assert fast.unchained_s(rows) == pytest.approx(unchained / 2 - exposed / 2)
        assert fast.decode_step(rows) == ref.decode_step(rows)
    rows = 240
    saved = (ref.unchained_s(rows) - fast.unchained_s(rows)) + 8 * engine["prefill_graph_request_s"] / 2
    packed_ref, packed_fast = ref.step_with_prefill(rows, 1808, 8, 0)[0], fast.step_with_prefill(rows, 1808, 8, 0)[0]
    assert packed_ref - packed_fast == pytest.approx(saved)
    assert fast.first_token_s == pytest.approx(ref.first_token_s / 2)
    assert fast.stream_token_s == pytest.approx(ref.stream_token_s / 2)
    assert fast.intake_s == pytest.approx(ref.intake_s / 2)


def test_measured_hosts_closed_loops_follow_their_host() -> None:
    """Two H100 machines whose hosts ran the loop in 5.65 and 13.06 ms measured 28,218 and 23,245 output tok/s with
    256 sampled clients (the 1B, copt profile endpoint, 10 and 15 s; docs/benchmarks.md): priced at each host's
    speed both are within 6% (1.02 and 1.05; unscaled, the faster host's is 0.87)."""
    plan = replace(PLAN, temperature=1.0, top_p=0.95)
    for loop_s, duration, measured in ((5.65e-3, 10.0, 28_218), (13.06e-3, 15.0, 23_245)):
        figures, _ = closed_loop_figures(SPEC, plan, replace(H100, host_loop_s=loop_s), duration_s=duration)
        assert figures["closed_loop_output_tokens_per_s"] / measured == pytest.approx(1.0, abs=0.06)
    unscaled, _ = closed_loop_figures(SPEC, plan, H100, duration_s=10.0)
    assert unscaled["closed_loop_output_tokens_per_s"] / 28_218 < 0.88


def test_host_loop_flag_is_validated_and_reported() -> None:
    target, notes = api.resolve_target("h100-sxm", host_loop_ms=5.65, serving=True)
    assert target.host_loop_s == pytest.approx(5.65e-3)
    assert any("5.65 ms" in n and "×0.42" in n for n in notes)
    # a train plan has no serving host work: the flag is not applied
    assert api.resolve_target("h100-sxm", host_loop_ms=5.65)[0].host_loop_s is None
    for bad in (0.0, -1.0, 20_000.0):
        with pytest.raises(BadInputError, match="--host-loop-ms"):
            api.resolve_target("h100-sxm", host_loop_ms=bad, serving=True)


def test_the_cli_prices_the_given_host_and_refuses_it_for_training(copt) -> None:
    args = ("advise", "-m", "llama-3.2-1b", "--gpu", "h100-sxm", "--task", "infer", "--batch", "64", "--json")
    fast = json.loads(copt(*args, "--host-loop-ms", "5").stdout)
    plain = json.loads(copt(*args).stdout)
    assert fast["assumptions"]["host_loop_ms"] == 5.0
    assert fast["time"]["closed_loop_output_tokens_per_s"] > plain["time"]["closed_loop_output_tokens_per_s"]
    for value in ("nan", "0", "-3"):
        bad = copt(*args, "--host-loop-ms", value)
        assert bad.returncode == 2 and "--host-loop-ms" in bad.stderr, bad.stderr
    train = copt("advise", "-m", "llama-3.2-1b", "--gpu", "h100-sxm", "--task", "train", "--host-loop-ms", "5")
    assert train.returncode == 2 and "--task infer" in train.stderr


def test_a_profile_measured_on_the_serving_host_carries_its_speed(tmp_path: Path) -> None:
    from clusteropt_cli.core.profile.report import load_profile

    path = _endpoint_profile(tmp_path)
    document = json.loads(path.read_text())
    document["hardware"] = {"device": "cuda", "catalog": "h100-sxm", "name": "NVIDIA H100", "host_loop_s": 0.006}
    path.write_text(json.dumps(document))
    _task, values, _symptoms, _measured = api.defaults_from_profile(load_profile(str(path)), "infer", dict(GIVEN))
    assert values["host_loop_ms"] == pytest.approx(6.0)
    given = dict(GIVEN, host_loop_ms=9.0)  # a typed flag wins
    assert api.defaults_from_profile(load_profile(str(path)), "infer", given)[1]["host_loop_ms"] == 9.0


def test_the_probe_times_the_reference_loop() -> None:
    seconds = python_loop_seconds(repeats=3)
    assert 1e-4 < seconds < 5.0
