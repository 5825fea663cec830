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
    for arrival, first, finish, prompt, output, _rid in trace["requests"]:
        assert arrival <= first <= finish and prompt == 4 and output == 6
    assert sorted(r[5] for r in trace["requests"]) == sorted(r.request_id for r in results)  # the API trace's ids
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


@pytest.mark.parametrize("masked_graphs", [False, True])
def test_the_unchained_step_fit_recovers_a_known_cost(tmp_path, monkeypatch, masked_graphs):
    """bench/fit_unchained_step.py on a gzipped trace whose steps cost advise's chained decode, the prefill graph's
    price (the variable-length graphs as mixed_step prices them, or --masked-graphs: the bucket's prefill pass) and
    2 ms + 20 µs per decoding sequence: the fit gives those back; --step-costs reads the same file."""
    import gzip

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    from engine_trace_report import _costs, _read, step_costs
    from fit_unchained_step import FIT_TOP_P, fit, residuals

    costs = _costs("llama-3.2-1b", 256, "h200", top_p=FIT_TOP_P)
    steps, t = [], 0.0
    for rows in range(8, 256, 4):
        for chunks in (0, 1, 2):
            tokens = 256 * chunks
            seconds = costs.decode_step(rows) + 2e-3 + 20e-6 * rows
            if chunks and masked_graphs:
                seconds += costs.prefill(256 * 2 ** (chunks - 1), chunks)  # the graph bucket above the tokens
            elif chunks:  # the mixed step's price less its decode and its unchained cost
                priced, _ = costs.mixed_step(rows, tokens, chunks, 0, False)
                seconds += priced - costs.decode_step(rows) - costs.unchained_s(rows)
            # [start, end, running, waiting, decode steps, chained, prompt tokens, generated tokens]
            steps.append([t, t + seconds, rows + chunks, 0, 1, 0, tokens, rows + chunks])
            t += seconds
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"clock": [0, 0], "steps": steps, "requests": []}, f)
    a, b, used = fit(residuals(str(path), "llama-3.2-1b", 256, "h200", masked_graphs))
    assert a == pytest.approx(2e-3, rel=1e-3) and b == pytest.approx(20e-6, rel=1e-3) and used == len(steps)
    assert len(_read(path)["steps"]) == len(steps)
    assert step_costs(_read(path), "llama-3.2-1b", 256, "h200")


def test_the_host_sampler_reads_this_machine(monkeypatch):
    """bench/host_sampler.py: the busy-time counters only grow, and this process is among the processes it reads."""
    import os

    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    from host_sampler import cpu_times, processes

    total, idle = cpu_times()
    assert 0 <= idle <= total
    later = cpu_times()
    assert later[0] >= total and later[1] >= idle
    mine = processes()[str(os.getpid())]
    assert mine[0] >= 0 and "python" in mine[2]


def test_round_trips_are_read_off_closed_loops_only(monkeypatch):
    """bench/engine_trace_report.py --round-trips: four clients whose next request reaches the engine 20 ms after
    their last one finished give 20 ms; an open loop whose requests in flight touch four once is left out."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    from engine_trace_report import round_trips

    closed = [[c * 1e-3 + k * 1.02, c * 1e-3 + k * 1.02 + 0.1, c * 1e-3 + k * 1.02 + 1.0, 8, 4]
              for k in range(3) for c in range(4)]
    # 10 s later, an open loop: requests 0.3 s apart lasting 0.25 s, three more beside one of them (four in flight)
    open_loop = [[10 + 0.3 * i, 10 + 0.3 * i + 0.05, 10 + 0.3 * i + 0.25, 8, 4] for i in range(40)]
    open_loop += [[10.31 + 0.01 * i, 10.4, 10.5, 8, 4] for i in range(3)]
    rows = round_trips({"requests": closed + open_loop, "steps": []}, clients=(4,))
    assert rows == [{"requests": 12, "clients": 4, "p10_ms": 20.0, "p50_ms": 20.0, "p90_ms": 20.0}]


def test_step_costs_set_long_decode_chains_per_pass(tmp_path, monkeypatch):
    """--step-costs: a chain of 8+ decode passes is priced per pass (decode_step plus its chain_start shared among
    the passes), rows from its generated tokens over its passes; shorter chains are left out."""
    import gzip

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    from engine_trace_report import CHAINED, _costs, step_costs

    costs = _costs("llama-3.2-1b", 256, "h200")
    steps, t = [], 0.0
    for rows, passes in ((64, 20), (64, 40), (200, 10), (64, 3)):
        seconds = 1.1 * (passes * costs.decode_step(rows) + costs.chain_start(rows))  # 10% over the price
        steps.append([t, t + seconds, rows, 0, passes, passes - 1, 0, rows * passes])
        t += seconds
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"clock": [0, 0], "steps": steps, "requests": []}, f)
    chained = [r for r in step_costs(json.loads(gzip.open(path).read()), "llama-3.2-1b", 256, "h200")
               if r["chunks"] == CHAINED]
    assert [(r["rows_from"], r["steps"]) for r in chained] == [(64, 2), (192, 1)]
    assert all(r["replayed_ms"] / r["measured_ms"] == pytest.approx(1 / 1.1, abs=0.01) for r in chained)


def test_step_costs_price_the_sampling_the_requests_asked_for(tmp_path, monkeypatch):
    """--step-costs --temperature/--top-p: chains that cost exactly advise's greedy price come out at 1 when priced
    greedy, and above it priced sampled (the extra pass), more so with a top-p (its selection step)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    from engine_trace_report import CHAINED, _costs, step_costs

    greedy = _costs("llama-3.2-1b", 256, "h200", temperature=0.0)
    steps, t = [], 0.0
    for rows in (64, 200):
        seconds = 20 * greedy.decode_step(rows) + greedy.chain_start(rows)
        steps.append([t, t + seconds, rows, 0, 20, 19, 0, rows * 20])
        t += seconds
    trace = {"clock": [0, 0], "steps": steps, "requests": []}

    def ratios(temperature: float, top_p: float) -> list[float]:
        rows = step_costs(trace, "llama-3.2-1b", 256, "h200", temperature=temperature, top_p=top_p)
        return [r["replayed_ms"] / r["measured_ms"] for r in rows if r["chunks"] == CHAINED]

    assert ratios(0.0, 1.0) == pytest.approx([1.0, 1.0], abs=0.01)
    plain, truncated = ratios(1.0, 1.0), ratios(1.0, 0.95)
    assert all(1.0 < p < t for p, t in zip(plain, truncated, strict=True))


def test_passes_by_load_prices_each_loads_chains(monkeypatch):
    """--passes-by-load: a load's chains of 6+ decode passes that cost exactly advise's greedy price come out at 1
    greedy and above 1 sampled, binned by 64 rows; shorter chains, steps with prompt tokens, bins of fewer than
    PASSES_MIN_COUNT passes and loads of fewer than PASSES_MIN_LOAD requests are left out."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    from engine_trace_report import PASSES_MIN_LOAD, _costs, passes_by_load

    greedy = _costs("llama-3.2-1b", 256, "h200", temperature=0.0)
    steps, t = [], 0.0
    for rows, passes, prompt in [(64, 20, 0)] * 3 + [(256, 30, 0)] * 2 + [(64, 3, 0), (64, 20, 256), (128, 8, 0)]:
        seconds = passes * greedy.decode_step(rows) + greedy.chain_start(rows)
        if rows == 64 and passes == 3 or prompt:
            seconds *= 5  # would move the 64-row bin if counted
        steps.append([t, t + seconds, rows, 0, passes, passes - 1, prompt, rows * passes])
        t += seconds
    load = [[0.001 * i, 0.01, t, 8, 4] for i in range(PASSES_MIN_LOAD)]
    small = [[t + 10 + 0.001 * i, t + 10.1, t + 10.2, 8, 4] for i in range(PASSES_MIN_LOAD - 1)]
    (only,) = passes_by_load({"requests": load + small, "steps": steps}, "llama-3.2-1b", 256, "h200")
    assert only["requests"] == PASSES_MIN_LOAD
    assert [(b["rows_from"], b["passes"]) for b in only["bins"]] == [(64, 60), (256, 60)]
    assert all(b["greedy_ratio"] == pytest.approx(1.0, abs=0.01) and b["sampled_ratio"] > 1.0 for b in only["bins"])
