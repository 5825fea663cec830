"""advise on open loops: requests at a rate whatever the answers do (copt profile endpoint --rate, vllm bench
serve --request-rate, guidellm's poisson profile), from the command line and from a measured profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clusteropt_cli.core.advise import api
from clusteropt_cli.core.advise.plan import InferPlan
from clusteropt_cli.modelspec import load_model_spec
from tests.conftest import run_copt

GIVEN = {"model": None, "micro_batch": None, "seq_len": None, "precision": None, "grad_accum": None,
         "activation_checkpointing": None, "batch": None, "prompt_len": None, "gen_len": None, "gpu": None,
         "gpus": None, "memory_budget": None, "compile": None, "loss_impl": None, "temperature": None}


def _rate_profile(tmp_path: Path, rates=(24.0, 48.0), seed: int = 7) -> Path:
    """A `copt profile endpoint --rate 24,48 --duration 10` report (the 8B shape's figures on the H200)."""
    levels = [{"concurrency": None, "rate": rate, "requests": int(rate * 10), "completed": int(rate * 10),
               "duration_s": 10.5, "request_throughput": rate, "output_tokens_per_s": 5167.0 * rate / 48,
               "ttft_s": {"p50": 0.05}, "tpot_s": {"p50": 0.0199}, "itl_s": {"p50": 0.019}, "e2e_s": {"p50": 2.6}}
              for rate in rates]
    report = {"schema_version": "copt.profile/1", "kind": "endpoint", "mode": "endpoint",
              "created_at": "2026-12-03T00:00:00Z", "copt_version": "0", "hardware": {"device": "remote"},
              "model": {"name": "llama-3.1-8b"},
              "workload": {"url": "http://127.0.0.1:8000", "concurrency": None, "rate": list(rates),
                           "duration_s": 10.0, "num_requests": None, "prompt_len": 256, "gen_len": 128,
                           "temperature": 1.0, "top_p": 0.95, "seed": seed},
              "metrics": {"ttft_s": 0.05, "tpot_s": 0.0199, "output_tokens_per_s": 5167.0},
              "levels": levels, "verdict": {"bottleneck": "unknown"}}
    path = tmp_path / "rates.json"
    path.write_text(json.dumps(report))
    return path


def test_a_rate_profile_is_replayed_as_its_open_loop(tmp_path) -> None:
    """The last rate level (whose figures are the metrics), its duration and the client's seed; the measured TTFT,
    TPOT and tok/s are set against the open loop's replay only, never against the burst's batch figures."""
    from clusteropt_cli.core.profile.report import load_profile

    report = load_profile(str(_rate_profile(tmp_path)))
    load = api.measured_closed_loop(report)
    assert load == {"rate": 48.0, "duration_s": 10.0, "seed": 7}
    task, values, _symptoms, measured = api.defaults_from_profile(report, "train", dict(GIVEN))
    assert task == "infer" and (values["prompt_len"], values["gen_len"], values["temperature"]) == (256, 128, 1.0)
    spec = load_model_spec("llama-3.1-8b")
    plan = InferPlan(prompt_len=256, gen_len=128, continuous_batching=True, temperature=1.0, top_p=0.95)
    result = api.advise(spec, api.resolve_target("h200")[0], plan, measured=measured, closed_loop=load)
    assert result["assumptions"]["open_loop_rate"] == 48.0 and result["assumptions"]["open_loop_duration_s"] == 10.0
    compared = {row["metric"] for row in result["measured"]}
    assert {"open_loop_tpot_s", "open_loop_output_tokens_per_s"} <= compared
    assert not compared & {"ttft_s", "tpot_s", "output_tokens_per_s", "tpot_out_of_step_s"}
    # the replay sends what the client sent: 48/s from seed 7 over 10 s, each 128 tokens
    from clusteropt_cli.core.profile.endpoint import poisson_send_times

    sent = len(list(poisson_send_times(48.0, duration_s=10.0, seed=7)))
    assert result["time"]["open_loop_output_tokens_per_s"] == pytest.approx(sent * 128 / 10.0, rel=0.12)


def test_a_concurrency_sweep_stays_a_closed_loop() -> None:
    from types import SimpleNamespace

    def level(concurrency, rate, requests):
        return SimpleNamespace(concurrency=concurrency, rate=rate, requests=requests, completed=requests)

    both = SimpleNamespace(workload={"duration_s": None}, levels=[level(8, 4.0, 32)])  # vllm --max-concurrency too
    assert api.measured_closed_loop(both) == {"requests": 32}
    for hostile in (float("nan"), -2.0, 0.0, "fast", True):  # a malformed rate: not an open loop
        bad = SimpleNamespace(workload={"duration_s": 10.0}, levels=[level(None, hostile, 20)])
        assert api.measured_closed_loop(bad) is None


def test_an_open_loop_that_cannot_be_replayed_is_not_compared_with_the_burst() -> None:
    """vLLM's figures are a roofline with no step model: the open loop is noted, not replayed, and the measured
    figures of a rate level are not set against the batch figures."""
    spec = load_model_spec("llama-3.1-8b")
    plan = InferPlan(prompt_len=256, gen_len=128, continuous_batching=True, engine="vllm")
    result = api.advise(spec, api.resolve_target("h200")[0], plan, closed_loop={"rate": 20.0},
                        measured={"ttft_s": 0.05, "tpot_s": 0.01, "output_tokens_per_s": 2000.0})
    assert "open_loop_tpot_s" not in result["time"]
    assert any("open loop at 20 requests/s was not replayed" in note for note in result["notes"])
    assert not {row["metric"] for row in result["measured"]} & {"ttft_s", "tpot_s", "output_tokens_per_s"}


def test_advise_rate_from_the_command_line(tmp_path) -> None:
    done = run_copt("advise", "-m", "llama-3.1-8b", "--gpu", "h200", "--task", "infer", "--prompt-len", "256",
                    "--gen-len", "128", "--rate", "24", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["assumptions"]["open_loop_duration_s"] == api.OPEN_LOOP_DURATION_S
    assert result["time"]["open_loop_output_tokens_per_s"] == pytest.approx(24 * 128, rel=0.1)
    assert result["time"]["open_loop_tpot_s"] > result["time"]["tpot_s"]  # others decode alongside
    # a typed --rate replaces the profile's rate and keeps its bound
    done = run_copt("advise", "--from-profile", str(_rate_profile(tmp_path)), "--gpu", "h200", "--rate", "12",
                    "--json")
    assert done.returncode == 0, done.stderr
    assumptions = json.loads(done.stdout)["assumptions"]
    assert (assumptions["open_loop_rate"], assumptions["open_loop_duration_s"]) == (12.0, 10.0)
    for bad in ("0", "-3", "nan", "inf"):
        done = run_copt("advise", "-m", "llama-3.1-8b", "--gpu", "h200", "--task", "infer", "--rate", bad)
        assert done.returncode == 2 and "--rate must be a positive number" in done.stderr, (bad, done.stderr)
    done = run_copt("advise", "-m", "llama-3.1-8b", "--gpu", "h200", "--rate", "4")
    assert done.returncode == 2 and "--rate needs --task infer" in done.stderr


def test_a_vllm_bench_serve_request_rate_is_an_open_loop(tmp_path) -> None:
    """`vllm bench serve --request-rate 8` without --max-concurrency: an open loop of its request count; with
    --max-concurrency the load is bounded by it and stays a closed loop."""
    from clusteropt_cli.core.profile.report import load_profile

    data = json.loads((Path(__file__).resolve().parents[1] / "data" / "vllm_bench_serve.json").read_text())
    rated = tmp_path / "rated.json"
    rated.write_text(json.dumps({**data, "request_rate": 8.0, "max_concurrency": None}))
    assert api.measured_closed_loop(load_profile(str(rated))) == {"rate": 8.0, "requests": 256}
    capped = tmp_path / "capped.json"
    capped.write_text(json.dumps({**data, "request_rate": 8.0, "max_concurrency": 64}))
    assert api.measured_closed_loop(load_profile(str(capped))) == {"requests": 256}
    done = run_copt("advise", "--from-profile", str(rated), "--model", "llama-3.2-1b", "--gpu", "h200", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["assumptions"]["open_loop_rate"] == 8.0 and result["assumptions"]["open_loop_requests"] == 256
    assert {row["metric"] for row in result["measured"]} >= {"open_loop_tpot_s", "open_loop_output_tokens_per_s"}


@pytest.mark.parametrize(("model", "load", "loop"), [
    ("llama-3.2-1b", None, "closed loop"), ("llama-3.2-1b", {"rate": 40.0, "duration_s": 10.0}, "open loop")])
def test_a_loop_ttft_left_out_says_why(model, load, loop) -> None:
    """Where most prefilling steps are host-bound the replay's TTFT is left out, and a note says so and what to
    measure instead; a replayed TTFT gets no such note. The 1B on an H200 with an fp8 KV cache: no prefill graphs,
    so its prefilling steps run eagerly at the host's floor; with the bf16 cache they replay captured graphs."""
    spec, target = load_model_spec(model), api.resolve_target("h200")[0]
    plan = InferPlan(batch=256 if load is None else 1, prompt_len=256, gen_len=128, continuous_batching=True,
                     kv_cache="fp8")
    result = api.advise(spec, target, plan, closed_loop=load)
    prefix = "closed_loop" if load is None else "open_loop"
    assert f"{prefix}_tpot_s" in result["time"] and f"{prefix}_ttft_s" not in result["time"]
    assert sum(note.startswith(f"no {loop} TTFT") for note in result["notes"]) == 1
    graphed = api.advise(spec, target, plan.with_(kv_cache="bf16"), closed_loop=load)
    assert f"{prefix}_ttft_s" in graphed["time"]
    assert not any(note.startswith(f"no {loop} TTFT") for note in graphed["notes"])
    replayed = api.advise(load_model_spec("llama-3.1-8b"), target, plan.with_(batch=256))
    assert "closed_loop_ttft_s" in replayed["time"]
    assert not any(note.startswith("no closed loop TTFT") for note in replayed["notes"])


def test_a_guidellm_constant_profile_is_replayed_evenly_spaced(tmp_path) -> None:
    """guidellm's constant profile spaces its requests evenly: read as such, replayed as such (fewer bunched
    arrivals than Poisson at the same rate: never a longer TTFT on the same steps), and written back as such."""
    from clusteropt_cli.core.advise.closed_loop import simulate_open_loop
    from clusteropt_cli.core.profile.external import guidellm_report
    from clusteropt_cli.core.profile.report import load_profile
    from tests.unit.test_closed_loop import _toy

    data = json.loads((Path(__file__).resolve().parents[1] / "data" / "guidellm_report.json").read_text())
    bench = data["benchmarks"][-1]
    bench["config"]["strategy"] = {"type_": "constant", "rate": 6.0}
    path = tmp_path / "constant.json"
    path.write_text(json.dumps({**data, "benchmarks": [bench]}))
    report = load_profile(str(path))
    assert (report.levels[-1].rate, report.levels[-1].arrivals) == (6.0, "constant")
    load = api.measured_closed_loop(report)
    assert load["rate"] == 6.0 and load["arrivals"] == "constant"
    written = guidellm_report(report)
    assert written["benchmarks"][0]["config"]["strategy"] == {"type_": "constant", "rate": 6.0}
    assert written["args"]["profile"] == "constant"
    even = simulate_open_loop(_toy(), 80.0, 11, duration_s=2.0, arrivals="constant")
    assert even.requests == 160
    assert sorted(s for s, _, _ in even.per_request) == pytest.approx([i / 80.0 for i in range(160)])
    bursty = simulate_open_loop(_toy(), 80.0, 11, duration_s=2.0)
    assert even.ttft_s <= bursty.ttft_s
    with pytest.raises(ValueError):
        simulate_open_loop(_toy(), 80.0, 11, duration_s=2.0, arrivals="gamma")
