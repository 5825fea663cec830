"""advise's closed-loop replay (core/advise/closed_loop.py): closed-loop clients run through copt's scheduler with
the step model's costs, checked for bookkeeping on toy costs and against closed loops measured on the H200."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clusteropt_cli.core.advise.closed_loop import (
    closed_loop_figures,
    implied_ttft_ratio,
    open_loop_figures,
    simulate_closed_loop,
    simulate_open_loop,
    simulate_sends,
)
from clusteropt_cli.core.advise.plan import InferPlan, Target
from clusteropt_cli.core.advise.timing import ServeCosts, infer_time
from clusteropt_cli.hardware import get_gpu
from clusteropt_cli.modelspec import load_model_spec
from tests.unit.test_advise_models import HELD_OUT_512, THIRD_PARTY


def _toy(**changes) -> ServeCosts:
    """10 ms decode steps, 1 ms per 100 prompt tokens, a 1,000-token step budget, 100-token prompts."""
    settings = dict(decode_step=lambda rows: 0.010, prefill=lambda tokens, requests: tokens * 1e-5,
                    step_tokens=1000, max_running=64, prompt_tokens=100, first_token_s=0.0, intake_s=0.0,
                    stream_token_s=0.0)
    return ServeCosts(**{**settings, **changes})


def test_one_client_is_one_request_after_another() -> None:
    """One client: its prompt in one step (1 ms), then gen_len - 1 decode steps; the next request follows."""
    run = simulate_closed_loop(_toy(first_token_s=0.002), 1, 11, requests=3)
    assert run.requests == 3 and run.ttft_first_round_s == pytest.approx(0.003)
    assert run.ttft_later_rounds_s == pytest.approx(0.003)
    assert run.tpot_s == pytest.approx(0.010)
    assert run.duration_s == pytest.approx(3 * (0.001 + 10 * 0.010))
    assert run.output_tokens_per_s == pytest.approx(33 / run.duration_s)


def test_the_step_budget_spreads_a_burst_over_steps_first_come_first_served() -> None:
    """20 prompts of 100 tokens sent at once with a 1,000-token budget: ten prefilled in the first step, the rest
    next to their decoding rows (990 tokens: nine whole prompts and one in part), the last in a third step."""
    run = simulate_closed_loop(_toy(), 20, 5, requests=20)
    firsts = sorted(round(first - sent, 6) for sent, first, _ in run.per_request)
    assert firsts[:10] == [pytest.approx(0.010)] * 10  # one 1,000-token prefill step
    assert firsts[10:19] == [pytest.approx(0.010 + 0.010 + 0.0099)] * 9  # a decode step + 990 prompt tokens
    assert firsts[19] == pytest.approx(0.0299 + 0.010 + 0.0001)  # its last 10 tokens next to 19 decoding rows
    assert run.requests == 20 and all(last > first for _, first, last in run.per_request)


def test_a_duration_stops_new_requests_and_lets_the_sent_ones_finish() -> None:
    run = simulate_closed_loop(_toy(), 4, 10, duration_s=0.5)
    assert all(sent < 0.5 for sent, _, _ in run.per_request)
    assert max(last for _, _, last in run.per_request) >= 0.5 and run.duration_s >= 0.5
    assert run.output_tokens_per_s == pytest.approx(run.requests * 10 / run.duration_s)


def test_the_api_process_takes_requests_in_one_after_another() -> None:
    """Requests reach the engine through one API process: 2 ms each, so four sent at once arrive 2, 4, 6, 8 ms."""
    run = simulate_closed_loop(_toy(intake_s=0.002), 4, 2, requests=4)
    assert sorted(round(first, 6) for _, first, _ in run.per_request)[-1] >= 0.008


def test_a_clients_turnaround_delays_its_next_request() -> None:
    """One client with a 50 ms turnaround: each request is sent 50 ms after the last one's answer (1 ms prefill,
    ten 10 ms decode steps), so three requests take three cycles and two turnarounds."""
    run = simulate_closed_loop(_toy(), 1, 11, requests=3, turnaround_s=0.050)
    sends = sorted(sent for sent, _, _ in run.per_request)
    lasts = sorted(last for _, _, last in run.per_request)
    assert [b - a for a, b in zip(lasts, sends[1:], strict=False)] == [pytest.approx(0.050)] * 2
    assert run.duration_s == pytest.approx(3 * 0.101 + 2 * 0.050)
    with pytest.raises(ValueError, match="turnaround"):
        simulate_closed_loop(_toy(), 1, 11, requests=3, turnaround_s=-0.001)


def test_a_turnaround_costs_its_share_of_the_cycle_not_more() -> None:
    """Sends a turnaround delays are taken by the API process in the order they are made, not when the answer
    before them arrived: on the 1B shape's step model at 64 clients, a 15 ms turnaround (3% of a ~0.4 s cycle) costs
    a few percent of the throughput (the API process once queued behind every pending send and halved it), and a
    longer one costs more."""
    spec = load_model_spec("llama-3.2-1b")
    plan = InferPlan(batch=64, prompt_len=256, gen_len=128, continuous_batching=True)
    costs = infer_time(spec, plan, Target(get_gpu("h200"))).costs
    tok_s = {t: simulate_closed_loop(costs, 64, 128, duration_s=5.0, turnaround_s=t).output_tokens_per_s
             for t in (0.0, 0.015, 0.2)}
    cycle = 64 * 128 / tok_s[0.0]
    assert 0.9 * tok_s[0.0] < tok_s[0.015] <= tok_s[0.0]
    assert 64 * 128 / (cycle + 0.2) <= tok_s[0.2] < tok_s[0.015]


def test_a_steps_decoded_results_go_out_before_its_prefill() -> None:
    """Client 0's request (in at 30 ms) prefills alone (50 ms); client 1's (in at 60 ms) prefills in the next step,
    next to client 0's last decode (10 ms): that last token goes out at 90 ms, before the prefill ends at 140 ms —
    copt's engine hands a step's decoded tokens out before running its prefill. An engine that hands them out after
    the prefill (results_before_prefill False) delivers it at 140 ms."""
    slow_prefill = dict(prefill=lambda tokens, requests: tokens * 5e-4, intake_s=0.030)
    early = simulate_closed_loop(_toy(**slow_prefill), 2, 2, requests=2)
    late = simulate_closed_loop(_toy(**slow_prefill, results_before_prefill=False), 2, 2, requests=2)
    assert early.per_request[0] == pytest.approx((0.0, 0.080, 0.090))
    assert late.per_request[0] == pytest.approx((0.0, 0.080, 0.140))
    assert early.per_request[1] == late.per_request[1] == pytest.approx((0.0, 0.140, 0.150))


def test_a_prefilling_step_costs_what_the_step_model_says() -> None:
    """A step that prefills is priced whole by the step model (decode rows, prompt tokens, chunks, whether one
    resumes a prompt): a host-bound one counts toward the share that hides the TTFT."""
    calls = []

    def mixed_step(rows: int, tokens: int, chunks: int, cached: int, masked: bool) -> tuple[float, bool]:
        calls.append((rows, tokens, chunks, cached))
        return 0.050, True

    run = simulate_closed_loop(_toy(mixed_step=mixed_step), 1, 2, requests=1)
    assert run.ttft_s == pytest.approx(0.050) and run.host_bound_share == 1.0
    assert calls == [(0, 100, 1, 0)]


def test_a_prompt_split_over_steps_resumes_in_the_next() -> None:
    """Two 100-token prompts with a 150-token budget: the second is split, and the step that finishes it resumes
    a prompt begun earlier: its 50 tokens computed then are cached keys the step reads."""
    calls = []

    def mixed_step(rows: int, tokens: int, chunks: int, cached: int, masked: bool) -> tuple[float, bool]:
        calls.append((rows, tokens, chunks, cached))
        return 0.010, False

    simulate_closed_loop(_toy(mixed_step=mixed_step, step_tokens=150), 2, 3, requests=2)
    assert calls[:2] == [(0, 150, 2, 0), (1, 50, 1, 50)]


def test_the_api_process_streams_every_token_and_can_fall_behind() -> None:
    """Each decoded token goes through the API process one after another (costs.stream_token_s): two sequences at
    6 ms a token are 12 ms of API work per 10 ms decode step, so the answers complete 16 ms after their last step."""
    run = simulate_closed_loop(_toy(stream_token_s=0.006), 2, 4, requests=2)
    assert [last for _, _, last in run.per_request] == [pytest.approx(0.048)] * 2  # the engine's last step: 0.032
    alone = simulate_closed_loop(_toy(stream_token_s=0.001), 1, 3, requests=1)
    (_, first, last), = alone.per_request
    assert first == pytest.approx(0.001) and last == pytest.approx(0.022)  # keeps up: 1 ms after each step

def test_a_one_token_answer_goes_out_after_its_prefill() -> None:
    """gen_len 1: the answer is the prefill's token, complete once its step ran and the API streamed it (2 ms for
    two 100-token prompts, then 1 ms of API time each), and each client's next request is sent then."""
    run = simulate_closed_loop(_toy(stream_token_s=0.001), 2, 1, requests=4)
    lasts = sorted(last for _, _, last in run.per_request)
    assert lasts[:2] == [pytest.approx(0.003), pytest.approx(0.004)]
    assert all(last >= first for _, first, last in run.per_request) and run.duration_s == pytest.approx(lasts[-1])

def test_a_decode_chain_pays_its_start_once() -> None:
    """copt's engine chains pure decode steps: a chain's first pass overlaps nothing (costs.chain_start), the
    passes after it are plain decode steps. One request of 4 tokens: its prompt (1 ms), then three passes, the first
    5 ms dearer."""
    run = simulate_closed_loop(_toy(chain_start=lambda rows: 0.005), 1, 4, requests=1)
    (sent, first, last), = run.per_request
    assert first == pytest.approx(0.001) and last == pytest.approx(0.001 + 0.015 + 0.010 + 0.010)


def test_a_finished_sequence_ends_the_chain_and_waiting_requests_stop_chaining() -> None:
    """Two clients and one place: the second request waits, so the first one's passes are not chained (+4 ms each,
    costs.unchained_s); when it finishes the second is prefilled and decodes in a chain of its own."""
    costs = _toy(unchained_s=lambda rows: 0.004, chain_start=lambda rows: 0.002, max_running=1)
    run = simulate_closed_loop(costs, 2, 3, requests=2)
    (_, first_a, last_a), (_, first_b, last_b) = sorted(run.per_request)
    assert first_a == pytest.approx(0.001) and last_a == pytest.approx(0.001 + 2 * 0.014)
    assert first_b == pytest.approx(last_a + 0.001)
    assert last_b == pytest.approx(first_b + 0.012 + 0.010)  # a new chain: its first pass pays the start


def test_copts_step_model_prices_a_graphed_step_by_its_token_bucket() -> None:
    """On an H200 a packed step runs as the captured graph of the token bucket above its tokens and its resumed
    chunks' cached keys (768 tokens: the 1,024 graph; 1,100 cached keys: the 2,048 one), through FlashAttention's
    variable-length kernel; past the largest bucket (cached keys or chunks) it runs eagerly, at least the host's
    floor. Where that kernel is missing (an AMD GPU) a resumed chunk runs eagerly; an fp8 cache has no graphs."""
    spec, target = load_model_spec("llama-3.1-8b"), Target(get_gpu("h200"))
    costs = infer_time(spec, _plan(256), target).costs
    graphed, host_bound = costs.step_with_prefill(128, 768, 3, 0)
    assert not host_bound
    assert graphed == pytest.approx(costs.step_with_prefill(128, 1024, 3, 0)[0])
    assert costs.step_with_prefill(128, 768, 3, 200)[0] == pytest.approx(graphed)  # resumed: the same graph
    assert costs.step_with_prefill(128, 768, 3, 1100)[0] == pytest.approx(costs.step_with_prefill(128, 2048, 3)[0])
    eager = costs.step_with_prefill(128, 768, 3, 2100)[0]
    assert graphed > eager  # eager: no padding to the bucket
    unchained = eager - costs.decode_step(128) - costs.prefill(768, 3)
    assert unchained == pytest.approx(1.6e-3 + 128 * 18e-6)  # calibration.UNCHAINED_STEP_*
    many, floored = costs.step_with_prefill(0, 33 * 16, 33)  # more chunks than a graph takes: the host's floor
    assert floored and many == pytest.approx(33 * 3e-3 + 32 * 0.5e-3)  # calibration.PREFILL_STEP_HOST_*
    masked = infer_time(spec, _plan(256), Target(get_gpu("mi300x"))).costs
    assert masked.step_with_prefill(128, 768, 3, 200)[0] < masked.step_with_prefill(128, 768, 3, 0)[0]
    fp8 = infer_time(spec, _plan(256).with_(kv_cache="fp8"), target).costs
    assert fp8.step_with_prefill(128, 768, 3, 0)[0] < graphed
    small = infer_time(load_model_spec("llama-3.2-1b"), _plan(256), target).costs
    assert small.step_with_prefill(200, 256, 1, 0)[1]  # the 1B's steps: the host's share is larger
    assert not costs.step_with_prefill(200, 256, 1, 0)[1]


def test_a_load_too_long_to_replay_is_cut_and_not_reported() -> None:
    """max_steps bounds the work whatever the flags say (an hour-long loop, a huge gen_len): the replay stops and
    says so, and advise reports no closed-loop figure rather than one for part of the load."""
    cut = simulate_closed_loop(_toy(), 2, 1000, requests=10, max_steps=500)
    assert cut.truncated and cut.steps == 500 and cut.requests == 0
    whole = simulate_closed_loop(_toy(), 2, 10, requests=10, max_steps=500)
    assert not whole.truncated and whole.requests == 10
    spec, target = load_model_spec("llama-3.1-8b"), Target(get_gpu("h200"))
    assert closed_loop_figures(spec, _plan(2, gen=100_000), target) is None
    assert closed_loop_figures(spec, _plan(64), target, duration_s=3600.0) is None


def _no_replay(*args, **kwargs):
    raise AssertionError("replayed a load that cannot finish")


def test_a_load_that_cannot_finish_in_the_steps_is_not_replayed(monkeypatch) -> None:
    """A mistyped --batch 100000000 or --rate 1e9 once held advise for many minutes while the replay built and
    stepped every request (8 GB of host memory at --rate 1e12): a load whose first requests alone need more steps
    than max_steps (each step decodes at most max_running rows and prefills at most step_tokens prompt tokens) is
    reported truncated without being replayed; one that fits is replayed as before."""
    import clusteropt_cli.core.advise.closed_loop as loop

    costs = _toy()  # 64 rows, 10 tokens each: 64 requests take at least 9 steps
    monkeypatch.setattr(loop, "_replay", _no_replay)
    for run in (simulate_closed_loop(costs, 100_000_000, 10, requests=400_000_000, max_steps=500),
                simulate_closed_loop(costs, 64 * 56, 10, duration_s=1.0, max_steps=500),
                simulate_open_loop(costs, 1e9, 10, duration_s=60.0, max_steps=500),
                simulate_sends(costs, 10, [0.0] * 64 * 56, max_steps=500)):
        assert run.truncated and run.requests == 0
    monkeypatch.undo()
    fits = simulate_closed_loop(costs, 64 * 10, 10, requests=64 * 10, max_steps=500)
    assert not fits.truncated and fits.requests == 64 * 10
    spec, target = load_model_spec("llama-3.1-8b"), Target(get_gpu("h200"))
    monkeypatch.setattr(loop, "_replay", _no_replay)
    assert closed_loop_figures(spec, _plan(100_000_000), target) is None
    assert open_loop_figures(spec, _plan(8), target, rate=1e12, duration_s=60.0) is None


@pytest.mark.parametrize(("flags", "why"), [
    (["--batch", "100000000"],
     "no closed-loop figures: the load of 100,000,000 clients does not finish within the replay's 200,000"),
    (["--rate", "1e9"], "the open loop at 1e+09 requests/s was not replayed"),
    (["--rate", "1e12", "--batch", "8"], "the open loop at 1e+12 requests/s was not replayed")])
def test_advise_answers_a_mistyped_load_without_replaying_it(monkeypatch, flags, why) -> None:
    """`copt advise` with a client count or rate a few zeros too long: its other figures, no closed- or open-loop
    ones and a note saying why, and no replay started."""
    from typer.testing import CliRunner

    import clusteropt_cli.core.advise.closed_loop as loop
    from clusteropt_cli.app import app

    monkeypatch.setattr(loop, "_replay", _no_replay)
    result = CliRunner().invoke(app, ["advise", "-m", "llama-3.1-8b", "--gpu", "h100-sxm", "--task", "infer",
                                      "--json", *flags])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    figures = report["top_plan"]["time"]
    assert figures["tpot_s"] > 0 and not any(k.startswith(("closed_loop_", "open_loop_")) for k in figures)
    assert any(note.startswith(why) for note in report["notes"]), report["notes"]


@pytest.mark.parametrize("bad", [dict(clients=0), dict(gen_len=0), dict(requests=None, duration_s=None)])
def test_bad_loads_are_refused(bad) -> None:
    args = {"clients": 2, "gen_len": 4, "requests": 4, "duration_s": None, **bad}
    with pytest.raises(ValueError):
        simulate_closed_loop(_toy(), args.pop("clients"), args.pop("gen_len"), **args)


def _plan(clients: int, prompt: int = 256, gen: int = 128, top_p: float = 0.95) -> InferPlan:
    return InferPlan(batch=clients, prompt_len=prompt, gen_len=gen, continuous_batching=True, temperature=1.0,
                     top_p=top_p)


def test_the_first_round_is_the_round_models_burst() -> None:
    """Every client's first request arrives at once: the replay's first-round TTFT is the round model's in-step
    TTFT (half the round's prefill and the API's intake), within 15% (the replay steps through the prefill chunk
    by chunk, with the decode rows each step also carries)."""
    spec, target = load_model_spec("llama-3.1-8b"), Target(get_gpu("h200"))
    for clients in (64, 256):
        est = infer_time(spec, _plan(clients), target)
        run = simulate_closed_loop(est.costs, clients, 128, requests=clients)
        assert run.ttft_first_round_s == pytest.approx(est.figures["ttft_s"], rel=0.15), clients


def test_no_replay_where_the_step_model_does_not_apply() -> None:
    spec, target = load_model_spec("llama-3.1-8b"), Target(get_gpu("h200"))
    assert closed_loop_figures(spec, _plan(1), target) is None  # one client: the batch-1 figures say it
    assert closed_loop_figures(spec, _plan(8).with_(continuous_batching=False), target) is None
    assert closed_loop_figures(spec, _plan(8).with_(speculative_tokens=4), target) is None
    assert closed_loop_figures(spec, _plan(8).with_(engine="vllm"), target) is None
    assert closed_loop_figures(spec, _plan(8), Target(None)) is None
    figures, load = closed_loop_figures(spec, _plan(8), target)
    assert load == {"closed_loop_requests": 32}  # copt profile endpoint's default: 4 per client
    assert set(figures) == {"closed_loop_ttft_s", "closed_loop_tpot_s", "closed_loop_output_tokens_per_s"}


def test_a_full_engines_ttft_is_reported_with_its_amplification() -> None:
    """Where most of a closed loop's TTFT is spent queued (the engine full: 64 and 256 clients on the 8B shape), the
    replay's TTFT comes with its amplification (its decode over it); with few clients (8: the TTFT mostly the prompt's
    own prefill) it does not."""
    spec, target = load_model_spec("llama-3.1-8b"), Target(get_gpu("h200"))
    few = simulate_closed_loop(infer_time(spec, _plan(8), target).costs, 8, 128, requests=32)
    assert few.queued_share < 0.5
    for clients in (64, 256):
        run = simulate_closed_loop(infer_time(spec, _plan(clients), target).costs, clients, 128, requests=4 * clients)
        decode = sorted(last - first for _, first, last in run.per_request)
        assert run.queued_share >= 0.5
        assert run.ttft_amplification == pytest.approx(decode[len(decode) // 2] / run.ttft_s, rel=0.01)
        figures, _ = closed_loop_figures(spec, _plan(clients), target)
        assert figures["closed_loop_ttft_amplification"] >= 3.0, clients


def test_advise_says_when_a_closed_loops_ttft_is_a_band() -> None:
    """advise's closed loop at 256 clients on the 8B shape carries the amplification and a note that reads the
    TTFT as a band; one at 8 clients neither."""
    from clusteropt_cli.core.advise.api import add_closed_loop

    spec, target = load_model_spec("llama-3.1-8b"), Target(get_gpu("h200"))
    for clients, amplified in ((256, True), (8, False)):
        evaluated = {"time": {}, "time_assumptions": {}}
        add_closed_loop(spec, _plan(clients), target, evaluated)
        assert ("closed_loop_ttft_amplification" in evaluated["time"]) == amplified
        notes = [n for n in evaluated.get("time_notes", []) if "read it as a band" in n.lower()]
        assert len(notes) == int(amplified), clients


# Closed loops measured on the H200 with copt serve's defaults (bench/gpu_serve_models.py; docs/benchmarks.md, real
# model sizes): guidellm 0.8 (temperature 1, `requests` in all) and `copt profile endpoint` (top_p 0.95, closed loop
# for `seconds`), client-side tok/s and the TTFT / TPOT medians. (model, prompt, output, clients, tester, requests
# per client or seconds): (tok/s, TTFT s, TPOT s). 256/128 (THIRD_PARTY, fd577c7): their 1B and 8B engine traces
# gave the host floor (calibration.PREFILL_STEP_HOST_*). 512/256 (HELD_OUT_512, 61350ef). 512/128, both shapes:
# replayed before the run (the replay as committed here; copt serve as at 940c06a), 2026-12-02. 8B 1024/64:
# replayed at e401a30 before the run, 2026-12-02 (prompts split over steps).
MEASURED = {**{(model, 256, 128, clients, tester, 2 if tester == "guidellm" else 10): figures
               for (model, clients, tester), figures in THIRD_PARTY.items()},
            **{(model, 512, 256, clients, tester, 4 if tester == "guidellm" else 15): figures
               for (model, clients, tester), figures in HELD_OUT_512.items()},
            ("llama-3.1-8b", 512, 128, 32, "guidellm", 2): (3044, 0.240, 8.47e-3),
            ("llama-3.1-8b", 512, 128, 128, "guidellm", 2): (4671, 0.230, 24.81e-3),
            ("llama-3.1-8b", 512, 128, 32, "profile", 10): (3004, 0.219, 8.91e-3),
            ("llama-3.1-8b", 512, 128, 128, "profile", 10): (4518, 0.245, 25.65e-3),
            ("llama-3.2-1b", 512, 128, 32, "guidellm", 2): (11072, 0.091, 2.15e-3),
            ("llama-3.2-1b", 512, 128, 128, "guidellm", 2): (16711, 0.179, 6.09e-3),
            ("llama-3.2-1b", 512, 128, 32, "profile", 10): (10607, 0.087, 2.31e-3),
            ("llama-3.2-1b", 512, 128, 128, "profile", 10): (16537, 0.119, 6.65e-3),
            ("llama-3.1-8b", 1024, 64, 16, "guidellm", 2): (1085, 0.226, 10.74e-3),
            ("llama-3.1-8b", 1024, 64, 64, "guidellm", 2): (1430, 0.230, 39.83e-3),
            ("llama-3.1-8b", 1024, 64, 16, "profile", 10): (1072, 0.157, 12.31e-3),
            ("llama-3.1-8b", 1024, 64, 64, "profile", 10): (1430, 0.240, 39.79e-3)}
# Replayed ÷ measured beyond ±15%, pinned (±3%) so that a change in either shows. The 8B's TTFT comes out a step
# or so short where the measured loop kept a deeper queue (0.70-0.73), and just over once (1.19) — a closed loop's
# TTFT swings run to run (8B 512/128, profile endpoint at 32 clients, same tree, a second run: 0.148 s, replayed
# 1.01; bench/results/serve-models-h200-2026-12-02/closed-loop-512x128/repeat-8b); the 1B's
# tok/s and TPOT run over in some (its profile endpoint's TPOT at 256 clients under: 0.83).
KNOWN_MISSES = {
    ("llama-3.1-8b", 256, 128, 256, "guidellm", 2, "ttft"): 0.67,
    ("llama-3.1-8b", 256, 128, 256, "profile", 10, "ttft"): 0.74,
    ("llama-3.1-8b", 512, 128, 32, "guidellm", 2, "ttft"): 0.68,
    ("llama-3.1-8b", 512, 128, 32, "profile", 10, "ttft"): 0.68,
    ("llama-3.2-1b", 256, 128, 256, "profile", 10, "tok/s"): 1.23,
    ("llama-3.2-1b", 256, 128, 256, "profile", 10, "tpot"): 0.80,
    ("llama-3.2-1b", 256, 128, 64, "profile", 10, "tok/s"): 1.17,
    ("llama-3.2-1b", 512, 128, 128, "guidellm", 2, "tpot"): 1.25,
    ("llama-3.2-1b", 512, 128, 128, "profile", 10, "tpot"): 1.23,
    ("llama-3.2-1b", 512, 128, 32, "profile", 10, "tpot"): 1.15,
    ("llama-3.2-1b", 512, 128, 32, "profile", 10, "ttft"): 0.43,
    ("llama-3.2-1b", 512, 256, 128, "guidellm", 4, "tok/s"): 1.20,
    ("llama-3.2-1b", 512, 256, 32, "guidellm", 4, "tok/s"): 1.26,
    ("llama-3.2-1b", 512, 256, 32, "profile", 15, "ttft"): 0.37,
}


def _predicted(model: str, prompt: int, gen: int, clients: int, temperature: float, top_p: float,
               load: dict, results_before_prefill: bool = False, masked_prefill_graphs: bool = True,
               gpu: str = "h200") -> dict[str, float]:
    """The replay of a closed-loop level's load; for one client, infer_time's batch-1 figures (as
    bench/closed_loop_check.py does). `results_before_prefill`: the engine the level ran on handed a step's
    decoded tokens out before the step's prefill (copt serve since it does; the tables before RESULTS_BEFORE_PREFILL
    were measured on the engine that handed them out after it). `masked_prefill_graphs`: its prefill graphs took
    new prompts only (every run pinned here before VARLEN_GRAPHS). `gpu`: the catalog GPU the level ran on."""
    plan = InferPlan(batch=clients, prompt_len=prompt, gen_len=gen, continuous_batching=True,
                     temperature=temperature, top_p=top_p)
    spec, target = load_model_spec(SHAPE_CONFIGS.get(model, model)), Target(get_gpu(gpu))
    if clients == 1:
        figures = infer_time(spec, plan, target).figures
        return {f"closed_loop_{name}": figures[name] for name in ("output_tokens_per_s", "ttft_s", "tpot_s")}
    figures, _ = closed_loop_figures(spec, plan, target, **load, results_before_prefill=results_before_prefill,
                                     masked_prefill_graphs=masked_prefill_graphs)
    return figures


def _check(model: str, figures: dict[str, float], measured: tuple[float, float, float], known: dict) -> None:
    tok_s, ttft, tpot = measured
    ratios = {"tok/s": figures["closed_loop_output_tokens_per_s"] / tok_s,
              "tpot": figures["closed_loop_tpot_s"] / tpot}
    if "closed_loop_ttft_s" in figures:
        ratios["ttft"] = figures["closed_loop_ttft_s"] / ttft
    for name, ratio in ratios.items():
        if name not in known:
            assert 0.85 <= ratio <= 1.15, (name, ratio)
        else:
            assert ratio == pytest.approx(known[name], rel=0.03), (name, ratio)


@pytest.mark.parametrize("case", sorted(MEASURED))
def test_replayed_closed_loops_against_the_h200(case) -> None:
    model, prompt, gen, clients, tester, amount = case
    load = {"duration_s": float(amount)} if tester == "profile" else {"requests": amount * clients}
    figures = _predicted(model, prompt, gen, clients, 1.0, 0.95 if tester == "profile" else 1.0, load)
    if model == "llama-3.2-1b" and clients >= 64:  # host-bound prefill steps: the 1B's loops stayed in step, the
        assert "closed_loop_ttft_s" not in figures  # replay's do not (at 32 clients most are GPU-bound: pinned below)
    known = {name: ratio for (*key, name), ratio in KNOWN_MISSES.items() if tuple(key) == case}
    _check(model, figures, MEASURED[case], known)


# The pinned ratios below are the current model's; the ones the comments quote are from when each run was pinned.
# Since prefill's efficiency grows with the hidden size and the LM head runs once per prompt
# (calibration.PREFILL_GEMM_EFFICIENCY; held out on a wide shape, bench/results/serve-models-h100-2026-12-06/
# held-out-70b8l) the H200 runs below are within ±15% as often as before (closed loops 409 figures), the open loops
# 83 of 98 figures where they were 90 of 97: the 8B's TTFTs come out shorter.

# Greedy and sampled requests from one to 256 clients, 256/128, one run per shape (bench/gpu_serve_models.py
# --tester-modes sampled,greedy --guidellm-loads 1,64,256 --guidellm-requests-per-stream 4 --profile-levels 1,64,256
# --profile-duration 10; H200, 2026-12-02, 8aee225; predictions written down before the run): guidellm 0.8 (4
# requests per stream, temperature 1 or 0) and `copt profile endpoint` (10 s per level, temperature 1 with top_p 0.95,
# or 0). (model, clients, tester, temperature): (tok/s, TTFT s, TPOT s).
GREEDY_AND_SAMPLED = {
    ("llama-3.1-8b", 1, "guidellm", 1.0): (223, 0.0160, 4.37e-3),
    ("llama-3.1-8b", 64, "guidellm", 1.0): (5964, 0.1455, 9.45e-3),
    ("llama-3.1-8b", 256, "guidellm", 1.0): (8390, 0.2163, 28.70e-3),
    ("llama-3.1-8b", 1, "guidellm", 0.0): (224, 0.0161, 4.35e-3),
    ("llama-3.1-8b", 64, "guidellm", 0.0): (6048, 0.2319, 8.66e-3),
    ("llama-3.1-8b", 256, "guidellm", 0.0): (8416, 0.2213, 28.54e-3),
    ("llama-3.1-8b", 1, "profile", 1.0): (223, 0.0170, 4.39e-3),
    ("llama-3.1-8b", 64, "profile", 1.0): (5581, 0.2837, 8.92e-3),
    ("llama-3.1-8b", 256, "profile", 1.0): (7928, 0.3152, 28.34e-3),
    ("llama-3.1-8b", 1, "profile", 0.0): (225, 0.0170, 4.35e-3),
    ("llama-3.1-8b", 64, "profile", 0.0): (5916, 0.2086, 9.27e-3),
    ("llama-3.1-8b", 256, "profile", 0.0): (8256, 0.3091, 27.54e-3),
    ("llama-3.2-1b", 1, "guidellm", 1.0): (872, 0.0068, 1.08e-3),
    ("llama-3.2-1b", 64, "guidellm", 1.0): (18243, 0.1255, 2.43e-3),
    ("llama-3.2-1b", 256, "guidellm", 1.0): (22578, 0.3640, 8.27e-3),
    ("llama-3.2-1b", 1, "guidellm", 0.0): (878, 0.0074, 1.06e-3),
    ("llama-3.2-1b", 64, "guidellm", 0.0): (17507, 0.1266, 2.51e-3),
    ("llama-3.2-1b", 256, "guidellm", 0.0): (22762, 0.3838, 7.66e-3),
    ("llama-3.2-1b", 1, "profile", 1.0): (856, 0.0087, 1.10e-3),
    ("llama-3.2-1b", 64, "profile", 1.0): (17208, 0.0725, 3.08e-3),
    ("llama-3.2-1b", 256, "profile", 1.0): (22601, 0.3948, 7.89e-3),
    ("llama-3.2-1b", 1, "profile", 0.0): (884, 0.0088, 1.07e-3),
    ("llama-3.2-1b", 64, "profile", 0.0): (16740, 0.1094, 2.89e-3),
    ("llama-3.2-1b", 256, "profile", 0.0): (21425, 0.4667, 7.99e-3),
}
# Beyond ±15%, pinned (±3%). The 8B's closed-loop TTFT at 64 and 256 clients: the measured loops kept a deeper queue
# than the replay's, and by how much differs between loads that the model prices the same (guidellm at 64 clients:
# 0.146 s sampled, 0.232 s greedy). The 1B's TPOT at guidellm's 64 clients (1.29, 1.37): its measured loops stayed
# in step — an API process streaming a decode chain's tokens 0.05-0.27 s behind the engine sends the next round in
# a bunch, which then waits in a queue that the closed loop keeps (engine trace, 89 requests waiting at 160
# running). At 256 clients the replay's API process, streaming every token (calibration http_token_s), falls behind
# the same way and its loops stay in step too. guidellm's one-client TTFT on the 1B is 1.5-2 ms below the other
# clients'.
GREEDY_AND_SAMPLED_MISSES = {
    ("llama-3.1-8b", 256, "guidellm", 0.0, "ttft"): 0.726,
    ("llama-3.1-8b", 256, "guidellm", 1.0, "ttft"): 0.745,
    ("llama-3.1-8b", 256, "profile", 0.0, "ttft"): 0.775,
    ("llama-3.1-8b", 256, "profile", 1.0, "ttft"): 0.768,
    ("llama-3.1-8b", 64, "guidellm", 0.0, "ttft"): 0.691,
    ("llama-3.1-8b", 64, "profile", 0.0, "ttft"): 0.723,
    ("llama-3.1-8b", 64, "profile", 1.0, "ttft"): 0.533,
    ("llama-3.2-1b", 1, "guidellm", 1.0, "ttft"): 1.215,
    ("llama-3.2-1b", 64, "guidellm", 0.0, "tpot"): 1.239,
    ("llama-3.2-1b", 64, "guidellm", 1.0, "tpot"): 1.315,
}


# The same 8B levels on copt serve handing a step's decoded tokens and finished results out before the step's prefill
# (same command; H200, 2026-12-03, 67158b2; predictions written down before the run). The measured loops' clients
# now come back during the prefill and their requests wait for the rest of it: closed-loop TTFT p50 rose by 58-92%
# at four levels (guidellm at 256 clients: 0.216 → 0.354 s sampled, 0.221 → 0.424 s greedy) and moved −12 to +16% at
# the others; the replay of this engine against the earlier one says +29-56%. tok/s and the cycle a client sees
# (TTFT + 127 × TPOT, means) within 5% of the earlier run.
RESULTS_BEFORE_PREFILL = {
    ("llama-3.1-8b", 1, "guidellm", 1.0): (220, 0.0163, 4.43e-3),
    ("llama-3.1-8b", 64, "guidellm", 1.0): (6038, 0.2349, 8.73e-3),
    ("llama-3.1-8b", 256, "guidellm", 1.0): (8252, 0.3540, 28.33e-3),
    ("llama-3.1-8b", 1, "guidellm", 0.0): (221, 0.0159, 4.41e-3),
    ("llama-3.1-8b", 64, "guidellm", 0.0): (5907, 0.2038, 8.99e-3),
    ("llama-3.1-8b", 256, "guidellm", 0.0): (8213, 0.4239, 28.10e-3),
    ("llama-3.1-8b", 1, "profile", 1.0): (219, 0.0178, 4.46e-3),
    ("llama-3.1-8b", 64, "profile", 1.0): (5644, 0.3131, 8.44e-3),
    ("llama-3.1-8b", 256, "profile", 1.0): (7606, 0.3013, 29.13e-3),
    ("llama-3.1-8b", 1, "profile", 0.0): (221, 0.0172, 4.41e-3),
    ("llama-3.1-8b", 64, "profile", 0.0): (5796, 0.3302, 8.34e-3),
    ("llama-3.1-8b", 256, "profile", 0.0): (8028, 0.3579, 28.19e-3),
}
# Beyond ±15%, pinned (±3%): the closed-loop TTFT at six levels (0.56-1.16). Within ±15%: every tok/s and TPOT, the
# one-client TTFTs and two closed-loop TTFTs.
RESULTS_BEFORE_PREFILL_MISSES = {
    ("llama-3.1-8b", 256, "guidellm", 0.0, "ttft"): 0.531,
    ("llama-3.1-8b", 256, "guidellm", 1.0, "ttft"): 0.637,
    ("llama-3.1-8b", 64, "profile", 0.0, "ttft"): 0.701,
    ("llama-3.1-8b", 64, "profile", 1.0, "ttft"): 0.741,
}


# Both shapes again on that engine (b9411c3), `copt profile endpoint` now deciding auth and proxy once per run (it had
# read .netrc in a worker thread for every request), with open-loop levels (--profile-rates) in the same run (H200,
# 2026-12-03, bench/results/serve-models-h200-2026-12-03/open-loop; predictions written down before the run). The
# 8B's profile endpoint at 64 clients: TTFT p50 0.313 → 0.207 s sampled, 0.330 → 0.214 s greedy, now within.
FIXED_CLIENT = {
    ("llama-3.1-8b", 64, "guidellm", 1.0): (5990, 0.2388, 8.72e-3),
    ("llama-3.1-8b", 256, "guidellm", 1.0): (8366, 0.3496, 27.29e-3),
    ("llama-3.1-8b", 64, "guidellm", 0.0): (6040, 0.2310, 8.78e-3),
    ("llama-3.1-8b", 256, "guidellm", 0.0): (8249, 0.4327, 27.58e-3),
    ("llama-3.1-8b", 1, "profile", 1.0): (220, 0.0166, 4.45e-3),
    ("llama-3.1-8b", 64, "profile", 1.0): (5799, 0.2065, 9.16e-3),
    ("llama-3.1-8b", 256, "profile", 1.0): (7744, 0.4577, 28.47e-3),
    ("llama-3.1-8b", 1, "profile", 0.0): (222, 0.0164, 4.41e-3),
    ("llama-3.1-8b", 64, "profile", 0.0): (5995, 0.2144, 8.84e-3),
    ("llama-3.1-8b", 256, "profile", 0.0): (8066, 0.3284, 28.01e-3),
    ("llama-3.2-1b", 1, "guidellm", 1.0): (801, 0.0076, 1.17e-3),
    ("llama-3.2-1b", 64, "guidellm", 1.0): (17303, 0.1335, 2.59e-3),
    ("llama-3.2-1b", 256, "guidellm", 1.0): (19601, 0.5652, 8.32e-3),
    ("llama-3.2-1b", 1, "guidellm", 0.0): (814, 0.0079, 1.16e-3),
    ("llama-3.2-1b", 64, "guidellm", 0.0): (18393, 0.1226, 2.46e-3),
    ("llama-3.2-1b", 256, "guidellm", 0.0): (22266, 0.3562, 8.32e-3),
    ("llama-3.2-1b", 1, "profile", 1.0): (795, 0.0083, 1.20e-3),
    ("llama-3.2-1b", 64, "profile", 1.0): (14990, 0.1334, 3.19e-3),
    ("llama-3.2-1b", 256, "profile", 1.0): (22105, 0.2947, 8.69e-3),
    ("llama-3.2-1b", 1, "profile", 0.0): (827, 0.0076, 1.16e-3),
    ("llama-3.2-1b", 64, "profile", 0.0): (16607, 0.1215, 2.89e-3),
    ("llama-3.2-1b", 256, "profile", 0.0): (19162, 0.3738, 10.44e-3),
}
# Beyond ±15%, pinned (±3%): the 8B's closed-loop TTFT at 256 clients (three of four, 0.54-0.76) and the sampled
# profile endpoint's at 64 (1.18); the 1B's TPOT at guidellm's 64 (1.23, 1.27) and the greedy profile endpoint's at 256
# (0.82). With the engine's step costs read off this run's
# traces (calibration.UNCHAINED_STEP_*, prefill graphs priced by their token bucket, decode chains as the engine runs
# them) the 1B's steps come within ±15% (bench/engine_trace_report.py --step-costs), but its closed loops' clients
# fall out of step in the replay where the measured ones stayed in step (step-costs-*.txt with the results).
FIXED_CLIENT_MISSES = {
    ("llama-3.1-8b", 256, "guidellm", 0.0, "ttft"): 0.520,
    ("llama-3.1-8b", 256, "guidellm", 1.0, "ttft"): 0.645,
    ("llama-3.1-8b", 256, "profile", 1.0, "ttft"): 0.669,
    ("llama-3.2-1b", 256, "profile", 0.0, "tpot"): 0.816,
    ("llama-3.2-1b", 64, "guidellm", 0.0, "tpot"): 1.215,
    ("llama-3.2-1b", 64, "guidellm", 1.0, "tpot"): 1.187,
}


# Both shapes again with the step model read off the previous run's traces (calibration.UNCHAINED_STEP_*, prefill
# graphs priced by their token bucket), `copt profile endpoint` sending each rate level's whole schedule on a frozen
# heap (H200, 2026-12-03, 5218b2e, bench/results/serve-models-h200-2026-12-03/step-model; predictions written down
# before the run; the decode chains' start, end and the waiting rule, and the API's per-token streaming added after
# it). Beyond ±15%, pinned (±3%): the 8B's closed-loop TTFT at four levels (0.55-1.22); the 1B's TPOT at 64 clients
# on three levels (1.15-1.26) and the profile endpoint's at 256 (0.78, 0.80; guidellm's there: within), its sampled
# tok/s there (1.17).
STEP_MODEL = {
    ("llama-3.1-8b", 1, "profile", 0.0): (220, 0.0163, 4.45e-3),
    ("llama-3.1-8b", 1, "profile", 1.0): (218, 0.0171, 4.49e-3),
    ("llama-3.1-8b", 64, "guidellm", 0.0): (6027, 0.2006, 8.96e-3),
    ("llama-3.1-8b", 64, "guidellm", 1.0): (5901, 0.2790, 8.57e-3),
    ("llama-3.1-8b", 64, "profile", 0.0): (6109, 0.1999, 8.88e-3),
    ("llama-3.1-8b", 64, "profile", 1.0): (5415, 0.2616, 9.48e-3),
    ("llama-3.1-8b", 256, "guidellm", 0.0): (8254, 0.3435, 27.93e-3),
    ("llama-3.1-8b", 256, "guidellm", 1.0): (8172, 0.4271, 27.64e-3),
    ("llama-3.1-8b", 256, "profile", 0.0): (8512, 0.3495, 26.58e-3),
    ("llama-3.1-8b", 256, "profile", 1.0): (7982, 0.3083, 27.91e-3),
    ("llama-3.2-1b", 1, "guidellm", 0.0): (874, 0.0081, 1.06e-3),
    ("llama-3.2-1b", 1, "guidellm", 1.0): (869, 0.0074, 1.08e-3),
    ("llama-3.2-1b", 1, "profile", 0.0): (892, 0.0081, 1.06e-3),
    ("llama-3.2-1b", 1, "profile", 1.0): (863, 0.0081, 1.10e-3),
    ("llama-3.2-1b", 64, "guidellm", 0.0): (17498, 0.1371, 2.47e-3),
    ("llama-3.2-1b", 64, "guidellm", 1.0): (15065, 0.1602, 2.92e-3),
    ("llama-3.2-1b", 64, "profile", 0.0): (17848, 0.1049, 2.68e-3),
    ("llama-3.2-1b", 64, "profile", 1.0): (17836, 0.0989, 2.77e-3),
    ("llama-3.2-1b", 256, "guidellm", 0.0): (18957, 0.6329, 8.37e-3),
    ("llama-3.2-1b", 256, "guidellm", 1.0): (23110, 0.4113, 7.56e-3),
    ("llama-3.2-1b", 256, "profile", 0.0): (19151, 0.3796, 10.60e-3),
    ("llama-3.2-1b", 256, "profile", 1.0): (18133, 0.4025, 11.13e-3),
}
STEP_MODEL_MISSES = {
    ("llama-3.1-8b", 256, "guidellm", 0.0, "ttft"): 0.655,
    ("llama-3.1-8b", 256, "guidellm", 1.0, "ttft"): 0.528,
    ("llama-3.1-8b", 64, "guidellm", 0.0, "ttft"): 1.155,
    ("llama-3.1-8b", 64, "guidellm", 1.0, "ttft"): 0.831,
    ("llama-3.1-8b", 64, "profile", 0.0, "ttft"): 1.159,
    ("llama-3.2-1b", 256, "profile", 0.0, "tpot"): 0.804,
    ("llama-3.2-1b", 256, "profile", 1.0, "tok/s"): 1.169,
    ("llama-3.2-1b", 256, "profile", 1.0, "tpot"): 0.768,
    ("llama-3.2-1b", 64, "guidellm", 0.0, "tpot"): 1.210,
    ("llama-3.2-1b", 64, "profile", 1.0, "tpot"): 1.168,
}


# The same levels again, both shapes, predicted before the run with the replay as it is here (H200, 2026-12-03,
# 8c40622, bench/results/serve-models-h200-2026-12-03/held-out/predicted-before-the-run.txt; the 1B's greedy rate
# levels from a second server start): 79 of 92 figures within ±15%. Beyond it, pinned (±3%): the 8B's closed-loop
# TTFT at five levels (guidellm at 256 clients 0.39, 0.46: the engine's own arrival-to-first-token median was 0.59
# and 0.50 s, its queue came back every other round; 0.85-1.17 at 64 clients); the 1B's guidellm TPOT at 64 clients
# (1.17, 1.32) and its 256-client guidellm level, whose tok/s went 16,895 sampled and 25,056 greedy (23,110 and 18,957
# in the run before: the same eager 2,048-token steps took 24-40 ms from level to level, with 2-6 of the host's 16
# cores busy). held-out/spread-of-three-runs.txt sets the three runs of every level side by side.
HELD_OUT_RERUN = {
    ("llama-3.1-8b", 1, "profile", 0.0): (212, 0.0166, 4.62e-3),
    ("llama-3.1-8b", 1, "profile", 1.0): (210, 0.0171, 4.66e-3),
    ("llama-3.1-8b", 64, "guidellm", 0.0): (6009, 0.2810, 8.40e-3),
    ("llama-3.1-8b", 64, "guidellm", 1.0): (5914, 0.2102, 9.00e-3),
    ("llama-3.1-8b", 64, "profile", 0.0): (5778, 0.2906, 8.52e-3),
    ("llama-3.1-8b", 64, "profile", 1.0): (5575, 0.2898, 8.59e-3),
    ("llama-3.1-8b", 256, "guidellm", 0.0): (8153, 0.5192, 26.95e-3),
    ("llama-3.1-8b", 256, "guidellm", 1.0): (8085, 0.6080, 26.60e-3),
    ("llama-3.1-8b", 256, "profile", 0.0): (8102, 0.3189, 27.67e-3),
    ("llama-3.1-8b", 256, "profile", 1.0): (7795, 0.3624, 28.89e-3),
    ("llama-3.2-1b", 1, "guidellm", 0.0): (843, 0.0078, 1.11e-3),
    ("llama-3.2-1b", 1, "guidellm", 1.0): (830, 0.0074, 1.13e-3),
    ("llama-3.2-1b", 1, "profile", 0.0): (849, 0.0082, 1.12e-3),
    ("llama-3.2-1b", 1, "profile", 1.0): (819, 0.0087, 1.16e-3),
    ("llama-3.2-1b", 64, "guidellm", 0.0): (18242, 0.1256, 2.35e-3),
    ("llama-3.2-1b", 64, "guidellm", 1.0): (15817, 0.1580, 2.70e-3),
    ("llama-3.2-1b", 64, "profile", 0.0): (16876, 0.1271, 2.76e-3),
    ("llama-3.2-1b", 64, "profile", 1.0): (16278, 0.1091, 2.97e-3),
    ("llama-3.2-1b", 256, "guidellm", 0.0): (25056, 0.4231, 6.90e-3),
    ("llama-3.2-1b", 256, "guidellm", 1.0): (16895, 0.6953, 9.87e-3),
    ("llama-3.2-1b", 256, "profile", 0.0): (20326, 0.3033, 9.76e-3),
    ("llama-3.2-1b", 256, "profile", 1.0): (19996, 0.3495, 9.21e-3),
}
HELD_OUT_RERUN_MISSES = {
    ("llama-3.1-8b", 256, "guidellm", 0.0, "ttft"): 0.433,
    ("llama-3.1-8b", 256, "guidellm", 1.0, "ttft"): 0.371,
    ("llama-3.1-8b", 256, "profile", 1.0, "ttft"): 0.845,
    ("llama-3.1-8b", 64, "guidellm", 0.0, "ttft"): 0.824,
    ("llama-3.1-8b", 64, "profile", 0.0, "ttft"): 0.797,
    ("llama-3.1-8b", 64, "profile", 1.0, "ttft"): 0.801,
    ("llama-3.2-1b", 256, "guidellm", 0.0, "tok/s"): 0.847,
    ("llama-3.2-1b", 256, "guidellm", 0.0, "tpot"): 1.229,
    ("llama-3.2-1b", 256, "guidellm", 1.0, "tok/s"): 1.254,
    ("llama-3.2-1b", 64, "guidellm", 0.0, "tpot"): 1.272,
}


# The levels again on the engine whose prefill graphs go through FlashAttention's variable-length kernel (packed steps
# of up to 2,048 tokens and resumed prompts captured), predicted before the run with the replay that prices them (H200,
# 2026-12-03, c6917de; the varlen-graphs folder of bench/results/serve-models-h200-2026-12-03 has the predictions; the
# greedy `copt profile endpoint` levels ran out of the run's time): 54 of 68 figures within ±15%. The replay now gives
# the 1B's closed-loop TTFT (its prefilling steps are no longer host-bound): 0.54-0.61 of the clients' at 64 and 256
# clients, where replayed from the engine's own arrivals it is 0.94-1.1 of the engine's TTFT at 64 clients
# (engine_trace_report.py --replay-arrivals): the rest (~50 ms at 64 clients) is the API process's and the clients' (a
# finished request's client sent its next 55-76 ms later, --round-trips). Beyond ±15%, pinned (±3%).
VARLEN_GRAPHS = {
    ("llama-3.1-8b", 1, "profile", 1.0): (214, 0.0177, 4.56e-3),
    ("llama-3.1-8b", 64, "guidellm", 0.0): (5964, 0.3159, 8.16e-3),
    ("llama-3.1-8b", 64, "guidellm", 1.0): (5917, 0.2377, 8.92e-3),
    ("llama-3.1-8b", 64, "profile", 1.0): (5444, 0.2811, 9.04e-3),
    ("llama-3.1-8b", 256, "guidellm", 0.0): (8130, 0.2485, 29.31e-3),
    ("llama-3.1-8b", 256, "guidellm", 1.0): (7934, 0.6207, 27.47e-3),
    ("llama-3.1-8b", 256, "profile", 1.0): (7755, 0.3841, 28.82e-3),
    ("llama-3.2-1b", 1, "guidellm", 0.0): (771, 0.0088, 1.21e-3),
    ("llama-3.2-1b", 1, "guidellm", 1.0): (763, 0.0082, 1.23e-3),
    ("llama-3.2-1b", 1, "profile", 1.0): (748, 0.0102, 1.26e-3),
    ("llama-3.2-1b", 64, "guidellm", 0.0): (19967, 0.1013, 2.35e-3),
    ("llama-3.2-1b", 64, "guidellm", 1.0): (19235, 0.1051, 2.43e-3),
    ("llama-3.2-1b", 64, "profile", 1.0): (17421, 0.0974, 2.92e-3),
    ("llama-3.2-1b", 256, "guidellm", 0.0): (26266, 0.4170, 6.50e-3),
    ("llama-3.2-1b", 256, "guidellm", 1.0): (22272, 0.4682, 7.71e-3),
    ("llama-3.2-1b", 256, "profile", 1.0): (22507, 0.3167, 8.73e-3),
}
VARLEN_GRAPHS_MISSES = {
    ("llama-3.1-8b", 256, "guidellm", 1.0, "ttft"): 0.369,
    ("llama-3.1-8b", 256, "profile", 1.0, "ttft"): 0.810,
    ("llama-3.1-8b", 64, "guidellm", 0.0, "ttft"): 0.689,
    ("llama-3.1-8b", 64, "profile", 1.0, "ttft"): 0.776,
    ("llama-3.2-1b", 1, "profile", 1.0, "ttft"): 0.810,
    ("llama-3.2-1b", 256, "guidellm", 0.0, "ttft"): 0.612,
    ("llama-3.2-1b", 256, "guidellm", 1.0, "tok/s"): 1.238,
    ("llama-3.2-1b", 256, "guidellm", 1.0, "ttft"): 0.547,
    ("llama-3.2-1b", 256, "profile", 1.0, "tok/s"): 1.190,
    ("llama-3.2-1b", 256, "profile", 1.0, "tpot"): 0.842,
    ("llama-3.2-1b", 64, "guidellm", 0.0, "ttft"): 0.602,
    ("llama-3.2-1b", 64, "guidellm", 1.0, "ttft"): 0.582,
    ("llama-3.2-1b", 64, "profile", 1.0, "tok/s"): 1.162,
    ("llama-3.2-1b", 64, "profile", 1.0, "ttft"): 0.631,
}

# The 8B's levels on the split server with prompts tokenized on the API process's event loop as they arrive (H200,
# 2026-12-04, 8dababc; bench/results/serve-models-h200-2026-12-04/timeline-8b, traces included; the greedy `copt profile
# endpoint` levels ran out of that run's time and were measured later): 20 of 24 within ±15%. Replayed from the engine's
# own arrivals (engine_trace_report.py --replay-arrivals) guidellm's TTFT at 256 clients comes out at 451 ms against the
# engine's 449: the miss lies in the closed loop's arrivals — through each stretch of mixed steps the engine held about
# twice the replay's backlog of waiting requests (25-55 against 14-28), its clients turning an answer around in 30 ms
# (p50, finish to next arrival) where the replay's take about 5. Beyond ±15%, pinned (±3%).
INTAKE_ON_LOOP_8B = {
    ("llama-3.1-8b", 64, "guidellm", 0.0): (5836, 0.2748, 8.87e-3),
    ("llama-3.1-8b", 64, "guidellm", 1.0): (5775, 0.2776, 8.63e-3),
    ("llama-3.1-8b", 64, "profile", 1.0): (5592, 0.2069, 9.39e-3),
    ("llama-3.1-8b", 256, "guidellm", 0.0): (8011, 0.4574, 28.44e-3),
    ("llama-3.1-8b", 256, "guidellm", 1.0): (7869, 0.4659, 28.72e-3),
    ("llama-3.1-8b", 256, "profile", 1.0): (7548, 0.3844, 29.71e-3),
    # the greedy profile endpoint levels, measured later on the same server code (ec8528c; profile-greedy-8b)
    ("llama-3.1-8b", 64, "profile", 0.0): (6009, 0.2052, 9.04e-3),
    ("llama-3.1-8b", 256, "profile", 0.0): (8024, 0.3049, 28.07e-3),
}
INTAKE_ON_LOOP_8B_MISSES = {
    ("llama-3.1-8b", 256, "guidellm", 0.0, "ttft"): 0.498,
    ("llama-3.1-8b", 256, "guidellm", 1.0, "ttft"): 0.490,
    ("llama-3.1-8b", 256, "profile", 1.0, "ttft"): 0.807,
    ("llama-3.1-8b", 64, "guidellm", 0.0, "ttft"): 0.792,
    ("llama-3.1-8b", 64, "guidellm", 1.0, "ttft"): 0.784,
}


# The 1B's levels on the same server (H200, 2026-12-04, ec8528c; bench/results/serve-models-h200-2026-12-04/timeline-1b,
# traces included): 9 of 24 within ±15%. At 256 streams guidellm measures its own client: 286-367 ms (p50) between its
# stamp of a request's start and the API process receiving it, of a TTFT of 418-461 ms whose engine part was 67 ms,
# and 18,688-20,414 tok/s drawn where the profile endpoint drew 22,293-25,283. Server-side, replayed from the engine's
# own arrivals the 256-client loads give 0.25-0.69 of the engine's TTFT and 0.68-0.99 of its TPOT: the measured loops
# stay in rounds (bursts of arrivals), the replay's drift apart. Beyond ±15%, pinned (±3%).
INTAKE_ON_LOOP_1B = {
    ("llama-3.2-1b", 64, "guidellm", 0.0): (19961, 0.09864, 2.406e-3),
    ("llama-3.2-1b", 64, "guidellm", 1.0): (17331, 0.10804, 2.792e-3),
    ("llama-3.2-1b", 64, "profile", 0.0): (19340, 0.08480, 2.613e-3),
    ("llama-3.2-1b", 64, "profile", 1.0): (17573, 0.07274, 3.031e-3),
    ("llama-3.2-1b", 256, "guidellm", 0.0): (18688, 0.41773, 9.023e-3),
    ("llama-3.2-1b", 256, "guidellm", 1.0): (20414, 0.46122, 8.926e-3),
    ("llama-3.2-1b", 256, "profile", 0.0): (25283, 0.17128, 8.580e-3),
    ("llama-3.2-1b", 256, "profile", 1.0): (22293, 0.19781, 9.920e-3),
}
INTAKE_ON_LOOP_1B_MISSES = {
    ("llama-3.2-1b", 256, "guidellm", 0.0, "tok/s"): 1.483,
    ("llama-3.2-1b", 256, "guidellm", 0.0, "tpot"): 0.807,
    ("llama-3.2-1b", 256, "guidellm", 0.0, "ttft"): 0.611,
    ("llama-3.2-1b", 256, "guidellm", 1.0, "tok/s"): 1.351,
    ("llama-3.2-1b", 256, "guidellm", 1.0, "tpot"): 0.819,
    ("llama-3.2-1b", 256, "guidellm", 1.0, "ttft"): 0.555,
    ("llama-3.2-1b", 256, "profile", 0.0, "ttft"): 1.398,
    ("llama-3.2-1b", 256, "profile", 1.0, "tok/s"): 1.201,
    ("llama-3.2-1b", 256, "profile", 1.0, "tpot"): 0.741,
    ("llama-3.2-1b", 256, "profile", 1.0, "ttft"): 1.395,
    ("llama-3.2-1b", 64, "guidellm", 0.0, "ttft"): 0.619,
    ("llama-3.2-1b", 64, "guidellm", 1.0, "tok/s"): 1.237,
    ("llama-3.2-1b", 64, "guidellm", 1.0, "ttft"): 0.566,
    ("llama-3.2-1b", 64, "profile", 0.0, "ttft"): 0.719,
    ("llama-3.2-1b", 64, "profile", 1.0, "tok/s"): 1.152,
    ("llama-3.2-1b", 64, "profile", 1.0, "ttft"): 0.845,
}

# Longer closed loops, both shapes, greedy and sampled (H200, 2026-12-04, e0af88a: 12 requests per guidellm stream,
# `copt profile endpoint --duration 30`; bench/results/serve-models-h200-2026-12-04/long-loads-{8b,1b}[-greedy], traces
# included): with three times the rounds the first burst weighs less on the medians. The 8B: 21 of 24 within ±15%
# (tok/s and TPOT 16 of 16), the 1B 11 of 24. Each TTFT is what the decode leaves of the clients' cycle (the decode
# 3.1-17.4 times the TTFT): the replay's TTFT errors follow its tok/s and TPOT errors
# (test_a_closed_loops_ttft_follows_its_tok_s_and_tpot). guidellm measured its own client on the 1B: 37-60 ms (p50)
# from its stamp of a request's start to the API process receiving it at 64 streams, 60 ms (sampled) and 210 ms
# (greedy) at 256, where the profile endpoint's took 10-19 ms. Beyond ±15%, pinned (±3%).
LONG_LOADS_8B = {
    ("llama-3.1-8b", 64, "guidellm", 0.0): (6085, 0.20071, 8.834e-3),
    ("llama-3.1-8b", 64, "guidellm", 1.0): (5794, 0.28092, 8.766e-3),
    ("llama-3.1-8b", 64, "profile", 0.0): (5913, 0.20662, 8.982e-3),
    ("llama-3.1-8b", 64, "profile", 1.0): (5811, 0.20579, 9.31e-3),
    ("llama-3.1-8b", 256, "guidellm", 0.0): (8349, 0.27561, 28.649e-3),
    ("llama-3.1-8b", 256, "guidellm", 1.0): (7879, 0.39504, 29.168e-3),
    ("llama-3.1-8b", 256, "profile", 0.0): (8157, 0.22042, 29.539e-3),
    ("llama-3.1-8b", 256, "profile", 1.0): (7792, 0.22458, 30.739e-3),
}
LONG_LOADS_8B_MISSES = {
    ("llama-3.1-8b", 256, "guidellm", 0.0, "ttft"): 0.826,
    ("llama-3.1-8b", 256, "guidellm", 1.0, "ttft"): 0.578,
    ("llama-3.1-8b", 64, "guidellm", 1.0, "ttft"): 0.775,
}
LONG_LOADS_1B = {
    ("llama-3.2-1b", 64, "guidellm", 0.0): (20138, 0.07801, 2.564e-3),
    ("llama-3.2-1b", 64, "guidellm", 1.0): (17915, 0.10804, 2.667e-3),
    ("llama-3.2-1b", 64, "profile", 0.0): (20050, 0.06196, 2.713e-3),
    ("llama-3.2-1b", 64, "profile", 1.0): (17833, 0.0648, 3.076e-3),
    ("llama-3.2-1b", 256, "guidellm", 0.0): (22332, 0.27469, 9.573e-3),
    ("llama-3.2-1b", 256, "guidellm", 1.0): (23224, 0.15714, 9.373e-3),
    ("llama-3.2-1b", 256, "profile", 0.0): (27697, 0.13969, 8.216e-3),
    ("llama-3.2-1b", 256, "profile", 1.0): (22475, 0.1671, 10.056e-3),
}
LONG_LOADS_1B_MISSES = {
    ("llama-3.2-1b", 256, "guidellm", 0.0, "tok/s"): 1.253,
    ("llama-3.2-1b", 256, "guidellm", 0.0, "tpot"): 0.772,
    ("llama-3.2-1b", 256, "guidellm", 1.0, "tok/s"): 1.201,
    ("llama-3.2-1b", 256, "guidellm", 1.0, "tpot"): 0.792,
    ("llama-3.2-1b", 256, "guidellm", 1.0, "ttft"): 1.472,
    ("llama-3.2-1b", 256, "profile", 0.0, "ttft"): 1.646,
    ("llama-3.2-1b", 256, "profile", 1.0, "tok/s"): 1.192,
    ("llama-3.2-1b", 256, "profile", 1.0, "tpot"): 0.744,
    ("llama-3.2-1b", 256, "profile", 1.0, "ttft"): 1.652,
    ("llama-3.2-1b", 64, "guidellm", 0.0, "ttft"): 0.782,
    ("llama-3.2-1b", 64, "guidellm", 1.0, "tok/s"): 1.202,
    ("llama-3.2-1b", 64, "guidellm", 1.0, "ttft"): 0.566,
}

# The same long loops on an H100 80GB HBM3 (bench/results/serve-models-h100-2026-12-06/long-loads-{1b,8b}, traces in the
# 8B's), replayed with advise's H100 figures (no constant fitted to an H100): the 1B at 1b8fa11 (12 requests per
# guidellm stream, 30 s profile endpoint levels), the 8B at 6224514 (6 per stream, 15 s levels; its profile endpoint's
# greedy levels did not finish). tok/s 14 of 14 within ±15%, TPOT 13 of 14, TTFT 6 of 14.
H100_LONG_LOADS_1B = {
    ("llama-3.2-1b", 64, "guidellm", 0.0): (20208, 0.06990, 2.610e-3),
    ("llama-3.2-1b", 64, "guidellm", 1.0): (19700, 0.07478, 2.646e-3),
    ("llama-3.2-1b", 64, "profile", 0.0): (20697, 0.06594, 2.578e-3),
    ("llama-3.2-1b", 64, "profile", 1.0): (18505, 0.07237, 2.899e-3),
    ("llama-3.2-1b", 256, "guidellm", 0.0): (28004, 0.14434, 8.019e-3),
    ("llama-3.2-1b", 256, "guidellm", 1.0): (27037, 0.17350, 8.006e-3),
    ("llama-3.2-1b", 256, "profile", 0.0): (29499, 0.09739, 7.874e-3),
    ("llama-3.2-1b", 256, "profile", 1.0): (26814, 0.10322, 8.708e-3),
}
H100_LONG_LOADS_1B_MISSES = {
    ("llama-3.2-1b", 256, "guidellm", 0.0, "ttft"): 1.896,
    ("llama-3.2-1b", 256, "guidellm", 1.0, "ttft"): 1.725,
    ("llama-3.2-1b", 256, "profile", 0.0, "ttft"): 2.810,
    ("llama-3.2-1b", 256, "profile", 1.0, "ttft"): 1.166,
    ("llama-3.2-1b", 64, "guidellm", 1.0, "ttft"): 0.827,
}
H100_LONG_LOADS_8B = {
    ("llama-3.1-8b", 64, "guidellm", 0.0): (5167, 0.24070, 10.446e-3),
    ("llama-3.1-8b", 64, "guidellm", 1.0): (5115, 0.24071, 10.639e-3),
    ("llama-3.1-8b", 64, "profile", 1.0): (4891, 0.21547, 11.076e-3),
    ("llama-3.1-8b", 256, "guidellm", 0.0): (7507, 0.40753, 30.524e-3),
    ("llama-3.1-8b", 256, "guidellm", 1.0): (7538, 0.39223, 30.775e-3),
    ("llama-3.1-8b", 256, "profile", 1.0): (7237, 0.31121, 31.793e-3),
}
H100_LONG_LOADS_8B_MISSES = {
    ("llama-3.1-8b", 256, "guidellm", 0.0, "ttft"): 0.570,
    ("llama-3.1-8b", 256, "guidellm", 1.0, "ttft"): 0.594,
    ("llama-3.1-8b", 256, "profile", 1.0, "ttft"): 0.752,
}

# Held out on an H100 (predicted before each run; bench/results/serve-models-h100-2026-12-06/held-out-{70b8l,3b}):
# Llama-3.1-70B's width on 8 layers at f02a78b (guidellm 6 requests per stream, 15 s profile endpoint levels; the
# prefill model of d141a0c was fitted without it) and the Llama-3.2-3B shape at c9960a3 (guidellm only).
H100_HELD_OUT = {
    ("llama-70b-8l", 64, "guidellm", 1.0): (6344, 0.18792, 8.616e-3),
    ("llama-70b-8l", 256, "guidellm", 1.0): (10098, 0.24490, 23.342e-3),
    ("llama-70b-8l", 64, "profile", 1.0): (6163, 0.17269, 8.996e-3),
    ("llama-70b-8l", 256, "profile", 1.0): (9791, 0.25405, 23.791e-3),
    ("llama-3.2-3b", 64, "guidellm", 1.0): (8061, 0.20084, 6.359e-3),
    ("llama-3.2-3b", 256, "guidellm", 1.0): (11746, 0.33785, 18.891e-3),
}
H100_HELD_OUT_MISSES = {
    ("llama-3.2-3b", 256, "guidellm", 1.0, "ttft"): 0.381,
    ("llama-3.2-3b", 64, "guidellm", 1.0, "ttft"): 0.590,
    ("llama-70b-8l", 256, "guidellm", 1.0, "ttft"): 0.734,
    ("llama-70b-8l", 256, "profile", 1.0, "ttft"): 0.711,
}
# Held out on an H100, a second architecture (Qwen2.5-7B's: q/k/v biases, 4 KV heads, a 152k vocabulary, untied;
# advise's figures written before the run, bench/results/serve-models-h100-2026-12-07/held-out-qwen7b{,-loads}) at
# 671a42d, guidellm 4 requests per stream, 10 s profile endpoint levels: tok/s and TPOT 16 of 16 within ±15%, TTFT 6 of
# 8 (guidellm's at 256 streams).
H100_HELD_OUT_QWEN7B = {
    ("qwen2.5-7b-shape", 64, "guidellm", 1.0): (5555, 0.19308, 9.842e-3),
    ("qwen2.5-7b-shape", 256, "guidellm", 1.0): (8717, 0.40642, 26.184e-3),
    ("qwen2.5-7b-shape", 64, "guidellm", 0.0): (5682, 0.19127, 9.636e-3),
    ("qwen2.5-7b-shape", 256, "guidellm", 0.0): (8765, 0.33878, 25.820e-3),
    ("qwen2.5-7b-shape", 64, "profile", 1.0): (5438, 0.19462, 10.260e-3),
    ("qwen2.5-7b-shape", 256, "profile", 1.0): (8551, 0.29630, 26.986e-3),
    ("qwen2.5-7b-shape", 64, "profile", 0.0): (5637, 0.19139, 9.768e-3),
    ("qwen2.5-7b-shape", 256, "profile", 0.0): (8718, 0.30190, 26.367e-3),
}
H100_HELD_OUT_QWEN7B_MISSES = {
    ("qwen2.5-7b-shape", 256, "guidellm", 1.0, "ttft"): 0.549,
    ("qwen2.5-7b-shape", 256, "guidellm", 0.0, "ttft"): 0.657,
}
# shapes pinned here that are not presets: the measured model's own config.json
SHAPE_CONFIGS = {"llama-70b-8l": str(Path(__file__).resolve().parents[2] / "bench" / "results"
                                     / "serve-models-h100-2026-12-06" / "held-out-70b8l" / "config-70b8l.json"),
                 "qwen2.5-7b-shape": str(Path(__file__).resolve().parents[2] / "bench" / "results"
                                         / "serve-models-h100-2026-12-07" / "held-out-qwen7b-loads"
                                         / "config-qwen7b.json")}

# run: (levels, pinned misses, whether that engine streamed a step's decode before its prefill, whether its prefill
# graphs were the masked ones)
TESTER_RUNS = {"greedy-and-sampled": (GREEDY_AND_SAMPLED, GREEDY_AND_SAMPLED_MISSES, False, True),
               "results-before-prefill": (RESULTS_BEFORE_PREFILL, RESULTS_BEFORE_PREFILL_MISSES, True, True),
               "fixed-client": (FIXED_CLIENT, FIXED_CLIENT_MISSES, True, True),
               "step-model": (STEP_MODEL, STEP_MODEL_MISSES, True, True),
               "held-out-rerun": (HELD_OUT_RERUN, HELD_OUT_RERUN_MISSES, True, True),
               "varlen-graphs": (VARLEN_GRAPHS, VARLEN_GRAPHS_MISSES, True, False),
               "intake-on-loop-8b": (INTAKE_ON_LOOP_8B, INTAKE_ON_LOOP_8B_MISSES, True, False),
               "intake-on-loop-1b": (INTAKE_ON_LOOP_1B, INTAKE_ON_LOOP_1B_MISSES, True, False),
               "long-loads-8b": (LONG_LOADS_8B, LONG_LOADS_8B_MISSES, True, False),
               "long-loads-1b": (LONG_LOADS_1B, LONG_LOADS_1B_MISSES, True, False),
               "h100-long-loads-1b": (H100_LONG_LOADS_1B, H100_LONG_LOADS_1B_MISSES, True, False),
               "h100-long-loads-8b": (H100_LONG_LOADS_8B, H100_LONG_LOADS_8B_MISSES, True, False),
               "h100-held-out": (H100_HELD_OUT, H100_HELD_OUT_MISSES, True, False),
               "h100-held-out-qwen7b": (H100_HELD_OUT_QWEN7B, H100_HELD_OUT_QWEN7B_MISSES, True, False)}
# run: the GPU it was measured on, where not the H200
RUN_GPU = {"h100-long-loads-1b": "h100-sxm", "h100-long-loads-8b": "h100-sxm", "h100-held-out": "h100-sxm",
           "h100-held-out-qwen7b": "h100-sxm"}
# run: (requests per guidellm stream, seconds per profile endpoint level) where not (4, 10)
RUN_LOADS = {"long-loads-8b": (12, 30.0), "long-loads-1b": (12, 30.0), "h100-long-loads-1b": (12, 30.0),
             "h100-long-loads-8b": (6, 15.0), "h100-held-out": (6, 15.0)}


def _tester_load(run: str, tester: str, clients: int) -> dict[str, float]:
    """The load a run's level sent: guidellm's request count, the profile endpoint's duration."""
    per_stream, duration = RUN_LOADS.get(run, (4, 10.0))
    return {"duration_s": duration} if tester == "profile" else {"requests": per_stream * clients}


@pytest.mark.parametrize(("run", "case"), [(run, case) for run, (levels, *_) in TESTER_RUNS.items()
                                           for case in sorted(levels)])
def test_greedy_and_sampled_closed_loops_against_the_h200(run, case) -> None:
    """Every level of both testers, greedy and sampled, from one to 256 clients: the replay of the engine the run
    measured (one client: the batch-1 figures) within ±15% or at its pinned miss."""
    levels, misses, results_before_prefill, masked_prefill_graphs = TESTER_RUNS[run]
    model, clients, tester, temperature = case
    top_p = 0.95 if tester == "profile" and temperature > 0 else 1.0
    figures = _predicted(model, 256, 128, clients, temperature, top_p, _tester_load(run, tester, clients),
                         results_before_prefill, masked_prefill_graphs, RUN_GPU.get(run, "h200"))
    if model == "llama-3.2-1b" and clients > 1:  # host-bound prefilling steps, or not since the varlen graphs
        assert ("closed_loop_ttft_s" in figures) != masked_prefill_graphs
    known = {name: ratio for (*key, name), ratio in misses.items() if tuple(key) == case}
    _check(model, figures, levels[case], known)


def test_a_closed_loops_ttft_follows_its_tok_s_and_tpot() -> None:
    """Each closed-loop client's cycle is its TTFT, its decode and its turnaround, clients × output tokens ÷ tok/s
    long: the TTFT is the cycle less the rest. So over every pinned closed loop with a replayed TTFT, the replay's TTFT
    error (ln of replayed ÷ measured) follows the one its tok/s and TPOT errors imply, -cycle/TTFT × ln(tok/s ratio)
    - decode/TTFT × ln(TPOT ratio) with the measured cycle and decode (correlation 0.87 over the 104 levels), and the
    decode is 2 to 17 times the TTFT: a 1% error in tok/s or TPOT is one of 2-17% in the TTFT."""
    import math
    import statistics

    actual, implied, decode_ttfts = [], [], []
    for run, (levels, _, results_before_prefill, masked_prefill_graphs) in TESTER_RUNS.items():
        for (model, clients, tester, temperature), (tok_s, ttft, tpot) in levels.items():
            if clients == 1:
                continue
            top_p = 0.95 if tester == "profile" and temperature > 0 else 1.0
            figures = _predicted(model, 256, 128, clients, temperature, top_p, _tester_load(run, tester, clients),
                                 results_before_prefill, masked_prefill_graphs, RUN_GPU.get(run, "h200"))
            if "closed_loop_ttft_s" not in figures:
                continue
            cycle, decode = clients * 128 / tok_s / ttft, 127 * tpot / ttft
            actual.append(math.log(figures["closed_loop_ttft_s"] / ttft))
            tok_ratio = figures["closed_loop_output_tokens_per_s"] / tok_s
            tpot_ratio = figures["closed_loop_tpot_s"] / tpot
            implied.append(math.log(implied_ttft_ratio(cycle, decode, tok_ratio, tpot_ratio)))
            decode_ttfts.append(decode)
    # a loop of 8 TTFTs' cycle and 7 TTFTs' decode: +1% tok/s and +1% TPOT leave 1.01^-15 of the TTFT
    assert implied_ttft_ratio(8.0, 7.0, 1.01, 1.01) == pytest.approx(1.01 ** -15)
    assert len(actual) >= 80
    assert statistics.correlation(actual, implied) >= 0.75
    assert min(decode_ttfts) >= 1.5 and max(decode_ttfts) >= 15.0


def test_the_measured_load_is_the_one_replayed() -> None:
    """`advise --from-profile`: a duration-bounded level is replayed for its duration, a counted one for its
    request count; a profile without a closed loop (one client, a rate) gets the default."""
    from types import SimpleNamespace

    from clusteropt_cli.core.advise.api import measured_closed_loop

    def report(workload, *levels):
        return SimpleNamespace(workload=workload, levels=[SimpleNamespace(concurrency=c, requests=n, completed=n)
                                                          for c, n in levels])

    assert measured_closed_loop(report({"duration_s": 10.0, "num_requests": None}, (1, 9), (64, 472))) == {
        "duration_s": 10.0}
    assert measured_closed_loop(report({"tool": "guidellm"}, (16, 64))) == {"requests": 64}
    assert measured_closed_loop(report({"duration_s": None}, (1, 8))) is None
    for hostile in ("abc", -5, float("nan"), float("inf"), True, [10]):  # a malformed report: its request count
        assert measured_closed_loop(report({"duration_s": hostile}, (8, 32))) == {"requests": 32}


def test_an_open_loop_sends_the_profile_endpoints_poisson_times() -> None:
    """simulate_open_loop sends what `copt profile endpoint --rate` sends (poisson_send_times, same seed), whatever
    the answers do: far apart, each request is a lone one (one prefill step, then decode steps of one row)."""
    from clusteropt_cli.core.profile.endpoint import poisson_send_times

    sends = list(poisson_send_times(2.0, duration_s=20.0, seed=5))
    run = simulate_open_loop(_toy(first_token_s=0.002), 2.0, 11, duration_s=20.0, seed=5)
    assert run.requests == run.clients == len(sends) and not run.truncated
    assert sorted(sent for sent, _, _ in run.per_request) == pytest.approx(sends)
    assert run.ttft_s == pytest.approx(0.003, abs=0.011)  # at most one decode step ahead of its prefill
    assert run.tpot_s == pytest.approx(0.010, rel=0.15)
    with pytest.raises(ValueError):
        simulate_open_loop(_toy(), 2.0, 11)


def test_an_open_loop_queues_past_what_the_engine_serves() -> None:
    """Below the engine's rate the TTFT stays near one step and every request is served as it comes; past it (64
    rows, each held 11 steps of at least 10 ms: under 582 requests/s) the requests wait for a free row, the TTFT
    grows with the load's length and the throughput stays under the rows' bound."""
    low = simulate_open_loop(_toy(), 100.0, 11, duration_s=2.0)
    high = simulate_open_loop(_toy(), 1000.0, 11, duration_s=2.0)
    assert low.ttft_s < 0.02 and high.ttft_s > 10 * low.ttft_s
    assert low.output_tokens_per_s == pytest.approx(low.requests * 11 / low.duration_s)
    assert low.requests / low.duration_s == pytest.approx(100.0, rel=0.15)
    assert high.output_tokens_per_s < 64 * 11 / (11 * 0.010)


def test_open_loop_figures_on_the_h200_shapes() -> None:
    """advise's open loop of the 8B shape: TPOT grows with the rate; one truth with the closed loop's step costs."""
    plan = InferPlan(prompt_len=256, gen_len=128, continuous_batching=True)
    spec, target = load_model_spec("llama-3.1-8b"), Target(get_gpu("h200"))
    slow, fast = (open_loop_figures(spec, plan, target, rate=r, duration_s=10.0) for r in (8.0, 48.0))
    assert slow and fast and fast["open_loop_tpot_s"] > slow["open_loop_tpot_s"]
    assert slow["open_loop_output_tokens_per_s"] == pytest.approx(8 * 128, rel=0.15)
    assert open_loop_figures(spec, plan, Target(None), rate=8.0, duration_s=10.0) is None


# The same run's open loops (`copt profile endpoint --rate`, Poisson sends, seed 0, 10 s per level): (model, rate,
# temperature): (tok/s, TTFT s, TPOT s). Beyond ±15%, pinned (±3%): the 8B's sampled TTFT at 64/s (0.55); the 1B's
# greedy TPOT at 120/s (0.43: that level saturated in this run, TPOT 10.9 ms against 4.1 and 5.4 ms in the two runs
# before). The 1B's TTFT is not replayed (host-bound steps).
STEP_MODEL_RATES = {
    ("llama-3.1-8b", 24.0, 0.0): (2719, 0.0312, 7.97e-3),
    ("llama-3.1-8b", 24.0, 1.0): (2704, 0.0324, 8.32e-3),
    ("llama-3.1-8b", 48.0, 0.0): (5374, 0.0450, 17.91e-3),
    ("llama-3.1-8b", 48.0, 1.0): (5345, 0.0488, 19.42e-3),
    ("llama-3.1-8b", 64.0, 0.0): (6648, 0.1034, 31.15e-3),
    ("llama-3.1-8b", 64.0, 1.0): (6151, 0.2139, 34.87e-3),
    ("llama-3.2-1b", 40.0, 0.0): (4880, 0.0115, 1.71e-3),
    ("llama-3.2-1b", 40.0, 1.0): (4874, 0.0121, 1.86e-3),
    ("llama-3.2-1b", 80.0, 0.0): (10118, 0.0139, 2.45e-3),
    ("llama-3.2-1b", 80.0, 1.0): (10143, 0.0134, 2.82e-3),
    ("llama-3.2-1b", 120.0, 0.0): (14574, 0.0536, 10.90e-3),
    ("llama-3.2-1b", 120.0, 1.0): (14950, 0.0218, 6.02e-3),
    ("llama-3.2-1b", 160.0, 0.0): (16054, 1.4218, 15.07e-3),
    ("llama-3.2-1b", 160.0, 1.0): (17566, 0.7224, 13.80e-3),
}
STEP_MODEL_RATE_MISSES = {
    ("llama-3.1-8b", 48.0, 1.0, "tpot"): 0.843,
    ("llama-3.1-8b", 64.0, 1.0, "ttft"): 0.471,
    ("llama-3.2-1b", 120.0, 0.0, "tpot"): 0.419,
}

# The 8B's sampled rate levels again, with decode chains replayed as the engine runs them (predictions written down
# before the run; H200, 2026-12-03, 9376dbe, bench/results/serve-models-h200-2026-12-03/chain-rules): within ±15% but
# the TTFT at 24/s (0.83) as predicted then; every figure within with the API's per-token streaming added after it.
STEP_MODEL_RATES_CHAINS = {
    ("llama-3.1-8b", 24.0, 1.0): (2711, 0.0319, 8.27e-3),
    ("llama-3.1-8b", 48.0, 1.0): (5334, 0.0478, 19.44e-3),
    ("llama-3.1-8b", 64.0, 1.0): (6561, 0.1066, 31.64e-3),
}
STEP_MODEL_RATE_CHAINS_MISSES = {
    ("llama-3.1-8b", 48.0, 1.0, "tpot"): 0.829,
}
# The held-out rerun's rate levels (predicted before it, see HELD_OUT_RERUN): beyond ±15%, pinned (±3%), the 8B's
# sampled TTFT at 64/s (0.21: the queue that level builds near the engine's limit, 0.077, 0.214 and 0.577 s in three
# runs) and its greedy 48/s level (TPOT 0.78, TTFT 0.83; 16.9 and 17.9 ms TPOT in the two runs before).
HELD_OUT_RERUN_RATES = {
    ("llama-3.1-8b", 24.0, 0.0): (2716, 0.0337, 8.34e-3),
    ("llama-3.1-8b", 24.0, 1.0): (2707, 0.0332, 8.48e-3),
    ("llama-3.1-8b", 48.0, 0.0): (5341, 0.0553, 21.87e-3),
    ("llama-3.1-8b", 48.0, 1.0): (5289, 0.0520, 19.91e-3),
    ("llama-3.1-8b", 64.0, 0.0): (6384, 0.1289, 33.37e-3),
    ("llama-3.1-8b", 64.0, 1.0): (6089, 0.5774, 36.02e-3),
    ("llama-3.2-1b", 40.0, 0.0): (4878, 0.0120, 1.72e-3),
    ("llama-3.2-1b", 40.0, 1.0): (4868, 0.0131, 1.97e-3),
    ("llama-3.2-1b", 80.0, 0.0): (10150, 0.0157, 2.89e-3),
    ("llama-3.2-1b", 80.0, 1.0): (10138, 0.0155, 3.30e-3),
    ("llama-3.2-1b", 120.0, 0.0): (15006, 0.0217, 4.68e-3),
    ("llama-3.2-1b", 120.0, 1.0): (14915, 0.0271, 7.23e-3),
    ("llama-3.2-1b", 160.0, 0.0): (16188, 1.0783, 15.22e-3),
    ("llama-3.2-1b", 160.0, 1.0): (15433, 1.2504, 16.14e-3),
}
HELD_OUT_RERUN_RATE_MISSES = {
    ("llama-3.1-8b", 24.0, 0.0, "ttft"): 0.841,
    ("llama-3.1-8b", 48.0, 0.0, "tpot"): 0.719,
    ("llama-3.1-8b", 48.0, 0.0, "ttft"): 0.788,
    ("llama-3.1-8b", 48.0, 1.0, "tpot"): 0.823,
    ("llama-3.1-8b", 48.0, 1.0, "ttft"): 0.846,
    ("llama-3.1-8b", 64.0, 0.0, "ttft"): 0.685,
    ("llama-3.1-8b", 64.0, 1.0, "ttft"): 0.175,
    ("llama-3.2-1b", 120.0, 1.0, "tpot"): 0.813,
    ("llama-3.2-1b", 40.0, 1.0, "tpot"): 0.839,
    ("llama-3.2-1b", 80.0, 0.0, "tpot"): 0.815,
    ("llama-3.2-1b", 80.0, 1.0, "tpot"): 0.810,
}
# The rate levels of the VARLEN_GRAPHS run (sampled only: the greedy ones ran out of its time), predicted before it;
# beyond ±15%, pinned (±3%): the 8B's TTFT at 64/s (3.01: 0.26 s measured, 0.08-0.58 s in the runs before, the queue
# near the engine's limit) and the 1B's at 120/s (0.74).
VARLEN_GRAPHS_RATES = {
    ("llama-3.1-8b", 24.0, 1.0): (2702, 0.0361, 8.88e-3),
    ("llama-3.1-8b", 48.0, 1.0): (5186, 0.0545, 23.35e-3),
    ("llama-3.1-8b", 64.0, 1.0): (6307, 0.2597, 33.97e-3),
    ("llama-3.2-1b", 40.0, 1.0): (4869, 0.0137, 2.01e-3),
    ("llama-3.2-1b", 80.0, 1.0): (10082, 0.0169, 3.48e-3),
    ("llama-3.2-1b", 120.0, 1.0): (14716, 0.0319, 8.30e-3),
    ("llama-3.2-1b", 160.0, 1.0): (17042, 0.6428, 14.30e-3),
}
VARLEN_GRAPHS_RATE_MISSES = {
    ("llama-3.1-8b", 64.0, 1.0, "ttft"): 1.628,
    ("llama-3.2-1b", 120.0, 1.0, "ttft"): 0.750,
    ("llama-3.2-1b", 160.0, 1.0, "ttft"): 1.472,
}
# run: (levels, pinned misses, whether that engine's prefill graphs were the masked ones)
RATE_RUNS = {"step-model": (STEP_MODEL_RATES, STEP_MODEL_RATE_MISSES, True),
             "chain-rules": (STEP_MODEL_RATES_CHAINS, STEP_MODEL_RATE_CHAINS_MISSES, True),
             "held-out-rerun": (HELD_OUT_RERUN_RATES, HELD_OUT_RERUN_RATE_MISSES, True),
             "varlen-graphs": (VARLEN_GRAPHS_RATES, VARLEN_GRAPHS_RATE_MISSES, False)}


@pytest.mark.parametrize(("run", "case"), [(run, case) for run, (levels, *_) in RATE_RUNS.items()
                                           for case in sorted(levels)])
def test_replayed_open_loops_against_the_h200(run, case) -> None:
    """Every rate level of both shapes, greedy and sampled: the open-loop replay of the profile endpoint's Poisson
    sends within ±15% of what it measured, or at its pinned miss."""
    levels, misses, masked_prefill_graphs = RATE_RUNS[run]
    model, rate, temperature = case
    plan = InferPlan(prompt_len=256, gen_len=128, continuous_batching=True, temperature=temperature,
                     top_p=0.95 if temperature > 0 else 1.0)
    figures = open_loop_figures(load_model_spec(model), plan, Target(get_gpu("h200")), rate=rate, duration_s=10.0,
                                masked_prefill_graphs=masked_prefill_graphs)
    assert figures is not None
    if model == "llama-3.2-1b" and masked_prefill_graphs:  # host-bound prefilling steps
        assert "open_loop_ttft_s" not in figures
    known = {name: ratio for (*key, name), ratio in misses.items() if tuple(key) == case}
    _check(model, {name.replace("open_loop", "closed_loop"): value for name, value in figures.items()},
           levels[case], known)


def test_measured_arrivals_replay_in_time_order() -> None:
    """simulate_sends replays a measured load's own arrivals (an engine trace's): two requests 1 s apart are two lone
    requests; a burst of three queues first come, first served within the step budget."""
    lone = simulate_sends(_toy(), 11, [1.0, 0.0])
    assert lone.requests == 2 and lone.ttft_s == pytest.approx(0.001)
    assert sorted(sent for sent, _, _ in lone.per_request) == [0.0, 1.0]
    burst = simulate_sends(_toy(step_tokens=100), 11, [0.0, 0.0, 0.0])
    firsts = sorted(first for _, first, _ in burst.per_request)
    assert firsts[0] < firsts[1] < firsts[2]  # one prompt per step (100-token budget)
    with pytest.raises(ValueError):
        simulate_sends(_toy(), 0, [0.0])


def test_repeated_runs_of_a_level_are_set_side_by_side(monkeypatch) -> None:
    """bench/closed_loop_check.py --spread: the same level measured in two runs is one entry with both
    measurements, their spread and the replay's ratio to each; the summary counts a figure the replay puts within
    ±15% of one run only as within some run, and runs 40% apart as not repeating."""

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    from closed_loop_check import spread, spread_summary

    def row(tok_s: float, ttft: float, shape: str = "8b") -> dict:
        return {"shape": shape, "tester": "guidellm", "clients": 64, "load": {"requests": 256}, "prompt_len": 256,
                "gen_len": 128, "temperature": 1.0,
                "output_tokens_per_s": {"measured": tok_s, "replayed": 1000.0},
                "ttft_s": {"measured": ttft, "replayed": 0.1}, "tpot_s": {"measured": 0.01, "replayed": None}}

    entries = spread([row(1000.0, 0.1), row(1050.0, 0.14), row(500.0, 0.1, shape="1b")])
    assert len(entries) == 2
    first = entries[0]
    assert first["output_tokens_per_s"]["measured"] == [1000.0, 1050.0]
    assert first["ttft_s"]["spread"] == 1.4 and first["ttft_s"]["ratios"] == [1.0, 0.71]
    assert first["tpot_s"]["ratios"] is None
    assert spread_summary(entries) == {"figures": 2, "replay_within_every_run": 1, "replay_within_some_run": 2,
                                       "runs_within_their_median": 1}


def test_results_are_replayed_for_the_gpu_they_were_measured_on(monkeypatch) -> None:
    """bench/closed_loop_check.py: a results file's levels carry the catalog GPU of its device name (H200 where
    none is recorded), the replay prices that GPU, and the same load on two GPUs is two levels, not one repeated."""

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    from closed_loop_check import level_key, levels, predicted

    run = {"completed": True, "concurrency": 64, "requests": 256}
    results = {"gpu": "NVIDIA H100 80GB HBM3", "config": {"prompt_len": 256, "out_tokens": 128},
               "guidellm": {"1b": {"c64": run}}}
    (h100,) = levels(results)
    (h200,) = levels({k: v for k, v in results.items() if k != "gpu"})
    assert (h100["gpu"], h200["gpu"]) == ("h100-sxm", "h200")
    assert level_key(h100) != level_key(h200)
    assert predicted(h100)["output_tokens_per_s"] < predicted(h200)["output_tokens_per_s"]  # 3.35 vs 4.8 TB/s


def test_the_check_marks_each_ttft_as_expect_would(monkeypatch) -> None:
    """bench/closed_loop_check.py's TTFT verdict is --expect's at ±15%: the 3B's H100 profile-endpoint levels
    (2026-12-06) pass at 64 clients and are explained at 256 (tok/s and TPOT within 5%, TTFT 0.78 and 0.60 of the
    measured against implied 0.70 and 0.62); a TTFT its tok/s and TPOT do not explain stays a miss."""
    from clusteropt_cli.core.advise.closed_loop import ttft_explained

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    import json

    from closed_loop_check import check, levels

    results = Path(__file__).resolve().parents[2] / "bench" / "results" / "serve-models-h100-2026-12-06"
    rows = [check(level, True, False) for level in levels(json.loads(
        (results / "held-out-3b-profile" / "profile3b.json").read_text()))]
    verdicts = {(r["temperature"], r["clients"]): r["ttft_bookkeeping"]["expect_ttft"] for r in rows}
    assert verdicts == {(1.0, 64): "pass", (1.0, 256): "explained", (0.0, 64): "pass", (0.0, 256): "explained"}
    assert not ttft_explained(0.75, 0.52, 13.0, True, 0.15)  # the 8B's H100 profile endpoint, 256 sampled
    assert not ttft_explained(0.60, 0.62, 2.0, True, 0.15)  # a decode of 2 TTFTs amplifies too little
    assert not ttft_explained(0.60, 0.62, 10.0, False, 0.15)  # beside a missed tok/s or TPOT


def test_a_replay_logs_each_step_it_priced() -> None:
    """simulate_sends(step_log=...): one (seconds, decoding rows, prompt chunks) per step — a lone request's prefill
    step (1 ms, no rows, one chunk), then its decode steps at one row; the steps add up to the replay's span."""
    log: list[tuple[float, int, int]] = []
    run = simulate_sends(_toy(), 11, [0.0], step_log=log)
    assert log[0] == (pytest.approx(0.001), 0, 1)
    assert log[1:] == [(pytest.approx(0.010), 1, 0)] * 10
    assert sum(seconds for seconds, _, _ in log) == pytest.approx(run.duration_s)
    assert simulate_sends(_toy(), 11, [0.0]).tpot_s == run.tpot_s  # logging changes nothing


def test_step_mix_splits_prefilling_steps_from_lone_decode_passes(monkeypatch) -> None:
    """bench/engine_trace_report.py step_mix: steps that prefilled (and their prompts), decode passes run alone
    (a chained step counts its passes), and the rows per decode pass weighted by passes."""

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    from engine_trace_report import step_mix

    steps = [(0.020, 100, 1, 8), (0.030, 200, 3, 0), (0.010, 200, 1, 2), (0.001, 0, 0, 1)]
    assert step_mix(steps) == {"prefill_steps": 3, "prefill_steps_s": 0.031, "chunks_per_prefill_step": 3.67,
                               "decode_passes_alone": 3, "decode_alone_s": 0.03, "rows_per_pass": 180.0}
    assert step_mix([])["rows_per_pass"] == 0.0


def test_the_check_replays_the_turnaround_given_for_each_tester(monkeypatch) -> None:
    """bench/closed_loop_check.py --turnaround-ms: one value for every closed loop, or per tester and clients, the
    most specific entry winning; a malformed or negative value is refused."""
    import argparse

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    from closed_loop_check import _turnaround_for, _turnarounds

    given = _turnarounds("20, guidellm=56, profile endpoint@256=35")
    assert given == {"*": 0.020, "guidellm": 0.056, "profile endpoint@256": 0.035}
    assert _turnaround_for(given, {"tester": "guidellm", "clients": 256}) == 0.056
    assert _turnaround_for(given, {"tester": "profile endpoint", "clients": 256}) == 0.035
    assert _turnaround_for(given, {"tester": "profile endpoint", "clients": 64}) == 0.020
    assert _turnaround_for({}, {"tester": "guidellm", "clients": 64}) == 0.0
    for bad in ("guidellm=fast", "-5"):
        with pytest.raises(argparse.ArgumentTypeError):
            _turnarounds(bad)
