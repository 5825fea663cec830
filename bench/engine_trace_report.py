#!/usr/bin/env python3
"""Summarise engine step traces (COPT_ENGINE_TRACE=<folder>, see core/serve/engine.py StepTrace): per load (a burst
of arrivals separated from the next by a pause), when the requests arrived, how the engine thread spent the
load's span — in steps (decode only, prefill only, both) or waiting between them — and how many decode steps ran
chained (async scheduling).

    python3 bench/engine_trace_report.py TRACE.json [...]     (prints; --json for the numbers)
    python3 bench/engine_trace_report.py TRACE.json --step-costs llama-3.1-8b [--prompt-len 256] [--gpu h200]

--step-costs PRESET sets every step that ran one decode pass (decode only, or decode and prefill) next to the cost
advise's replay gives it (timing.ServeCosts of a 256-client plan of PRESET at --temperature and --top-p:
decode_step(rows) + chain_start(rows) for a decode pass run alone — a chain of one pass — and step_with_prefill for
one that prefills: a step whose prompt tokens are not whole prompts counts as resuming one): medians per bin of
decode rows (by 32) and prompt chunks (prompt tokens / --prompt-len). A step's decode rows are its generated tokens
less the prompts it finished (prompt tokens // --prompt-len): exact when every prompt is --prompt-len tokens and
none is split. Chains of 8 or more decode passes (async scheduling) are set per pass against decode_step(rows) plus
their chain_start(rows) shared among the passes, their rows the chain's generated tokens over its passes.

--replay-arrivals PRESET replays each load of the trace (requests separated from the next load by an idle engine)
from the engine's own arrival times (closed_loop.simulate_sends, API and HTTP costs left out) and sets the engine's
TTFT (arrival to first token) and TPOT next to the replay's: the step model on the measured arrivals, apart from
how a closed loop's clients come back (--temperature, --top-p: the sampling the steps are priced for), and under
each load where the engine's time went, measured and replayed: the steps that prefilled (how many prompts each) and
the decode passes run alone, and the decoding rows per pass.
--passes-by-load PRESET: per load, the decode passes run in chains of 6 or more without prompt tokens, by 64 rows,
measured per pass against advise's price of the same chains, greedy and sampled (--top-p).
--round-trips: for each closed loop of the trace (a load whose requests in flight peak at --clients, 64 and 256 by
default), how long after the engine finished a request it received the next one — finishes and later arrivals
paired in order (the i-th finish with the arrival after the clients' first requests): the clients' and the API's
round trip, which advise's replay counts only as the API's streaming and intake.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from clusteropt_cli.core.advise.timing import ServeCosts


def _read(path: Path) -> dict:
    """A trace as written (JSON) or as kept with the results (gzipped JSON)."""
    import gzip

    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def loads(trace: dict, gap_s: float = 0.1) -> list[dict]:
    """The trace's requests grouped into loads (an arrival more than gap_s after the previous one starts a new
    load: the benchmarks submit each load at once, back to back), each with the steps that ran while it did."""
    requests = sorted(trace["requests"], key=lambda r: r[0])
    groups: list[list] = []
    last = float("-inf")
    for r in requests:
        if r[0] > last + gap_s:
            groups.append([])
        groups[-1].append(r)
        last = r[0]
    out = []
    for group in groups:
        t0, t1 = min(r[0] for r in group), max(r[2] for r in group)
        out.append(summarise(group, steps_during(trace, t0, t1), t0, t1))
    return out


def steps_during(trace: dict, t0: float, t1: float) -> list:
    """The trace's steps that ran (in part) between t0 and t1."""
    return [s for s in trace["steps"] if s[1] > t0 and s[0] < t1]


def summarise(requests: list, steps: list, t0: float, t1: float) -> dict:
    span = t1 - t0
    busy = sum(min(s[1], t1) - max(s[0], t0) for s in steps)  # the load's share of the steps at its edges
    kinds = {"decode": [], "prefill": [], "mixed": [], "other": []}
    for s in steps:
        decode, prompt = s[4] > 0, s[6] > 0
        kinds["mixed" if decode and prompt else "decode" if decode else "prefill" if prompt else "other"].append(s)
    first = [r[1] - r[0] for r in requests if r[1] is not None]
    arrivals = sorted(r[0] for r in requests)
    return {
        "requests": len(requests), "span_s": round(span, 3),
        "arrival_spread_s": round(arrivals[-1] - arrivals[0], 3),
        "arrivals_by_quarter_of_span": [sum(1 for a in arrivals if t0 + q * span / 4 <= a < t0 + (q + 1) * span / 4)
                                        for q in range(4)],
        "output_tokens": sum(r[4] for r in requests),
        "steps": len(steps), "step_busy_s": round(busy, 3), "between_steps_s": round(span - busy, 3),
        "decode_steps": sum(s[4] for s in steps), "chained_decode_steps": sum(s[5] for s in steps),
        "prompt_tokens": sum(s[6] for s in steps),
        "by_kind": {k: {"steps": len(v), "s": round(sum(s[1] - s[0] for s in v), 3),
                        "prompt_tokens": sum(s[6] for s in v), "decode_steps": sum(s[4] for s in v)}
                    for k, v in kinds.items() if v},
        "ttft_engine_p50_s": round(sorted(first)[len(first) // 2], 3) if first else None,
    }


CHAINED = -1  # step_costs' chunks of a bin of chained decode passes
CHAIN_PASSES = 8  # chains this long or longer (shorter ones carry their start and end in a few passes)


def step_costs(trace: dict, preset: str, prompt_len: int, gpu: str, host_loop_s: float | None = None,
               temperature: float = 1.0, top_p: float = 1.0) -> list[dict]:
    """Measured one-decode-pass steps, and the passes of decode chains (chunks CHAINED), against the replay's step
    cost for requests of this sampling, binned (see the module text)."""
    import statistics
    from collections import defaultdict

    costs = _costs(preset, prompt_len, gpu, temperature, host_loop_s=host_loop_s, top_p=top_p)
    bins: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for s in trace["steps"]:
        if s[4] >= CHAIN_PASSES and not s[6]:  # a chain of decode passes: per pass, its start shared among them
            rows = max(1, round(s[7] / s[4]))
            replayed = chain_price(costs, rows, s[4]) / s[4]
            bins[(rows // 32 * 32, CHAINED)].append(((s[1] - s[0]) / s[4], replayed))
            continue
        if s[4] != 1:
            continue
        chunks = -(-s[6] // prompt_len)
        rows = max(1, s[7] - s[6] // prompt_len)
        if chunks:
            rest = s[6] % prompt_len  # a resumed prompt's rest: its first prompt_len - rest tokens are cached
            replayed = costs.step_with_prefill(rows, s[6], chunks, prompt_len - rest if rest else 0)[0]
        else:  # a decode pass alone: a chain that ended after it (a sequence finished, a request arrived)
            replayed = costs.decode_step(rows) + costs.chain_start(rows)
        bins[(rows // 32 * 32, chunks)].append((s[1] - s[0], replayed))
    return [{"rows_from": rows, "chunks": chunks, "steps": len(v),
             "measured_ms": round(1e3 * statistics.median(m for m, _ in v), 2),
             "replayed_ms": round(1e3 * statistics.median(r for _, r in v), 2)}
            for (rows, chunks), v in sorted(bins.items())]


def chain_price(costs: ServeCosts, rows: int, passes: int) -> float:
    """advise's price of a decode chain: `passes` decode steps over `rows` sequences and the chain's start."""
    return passes * costs.decode_step(rows) + costs.chain_start(rows)


def _costs(preset: str, prompt_len: int, gpu: str, temperature: float = 1.0, host_loop_s: float | None = None,
           top_p: float = 1.0):
    from clusteropt_cli.core.advise.plan import InferPlan, Target
    from clusteropt_cli.core.advise.timing import infer_time
    from clusteropt_cli.hardware import get_gpu
    from clusteropt_cli.modelspec import load_model_spec

    plan = InferPlan(batch=256, prompt_len=prompt_len, gen_len=128, continuous_batching=True,
                     temperature=temperature, top_p=top_p)
    costs = infer_time(load_model_spec(preset), plan, Target(get_gpu(gpu), host_loop_s=host_loop_s)).costs
    if costs is None:
        raise SystemExit(f"advise has no step costs for {preset} on {gpu}")
    return costs


def idle_separated(trace: dict, idle_s: float = 0.0) -> list[list]:
    """The trace's requests by load: a request that arrives more than `idle_s` after every earlier one had finished
    (the engine went idle) starts a new one."""
    groups: list[list] = []
    busy_until = float("-inf")
    for r in sorted(trace["requests"], key=lambda r: r[0]):
        if r[0] > busy_until + idle_s:
            groups.append([])
        groups[-1].append(r)
        busy_until = max(busy_until, r[2])
    return groups


def replay_arrivals(trace: dict, preset: str, prompt_len: int, gpu: str, temperature: float,
                    host_loop_s: float | None = None, top_p: float = 1.0) -> list[dict]:
    """Each load of the trace replayed from its measured engine arrivals (see the module text), with the steps'
    mix measured and replayed (step_mix)."""
    import statistics
    from dataclasses import replace

    from clusteropt_cli.core.advise.closed_loop import simulate_sends

    costs = replace(_costs(preset, prompt_len, gpu, temperature, host_loop_s, top_p), intake_s=0.0,
                    stream_token_s=0.0, first_token_s=0.0)
    out = []
    for group in idle_separated(trace):
        t0, gen = group[0][0], max(1, round(statistics.median(r[4] for r in group)))
        log: list[tuple[float, int, int]] = []
        run = simulate_sends(costs, gen, [r[0] - t0 for r in group], step_log=log)
        measured_steps = [(s[1] - s[0], s[2], s[4], -(-s[6] // prompt_len))  # a resumed prompt's rest: a chunk
                          for s in steps_during(trace, t0, max(r[2] for r in group))]
        ttft = [r[1] - r[0] for r in group]
        replayed = [first - sent for sent, first, _ in run.per_request]
        tpot = [(r[2] - r[1]) / (r[4] - 1) for r in group if r[4] > 1]
        out.append({"requests": len(group), "arrivals_over_s": round(group[-1][0] - t0, 2),
                    "ttft_p50_ms": round(1e3 * statistics.median(ttft), 1),
                    "replayed_ttft_p50_ms": round(1e3 * run.ttft_s, 1),
                    "ttft_mean_ms": round(1e3 * statistics.mean(ttft), 1),
                    "replayed_ttft_mean_ms": round(1e3 * statistics.mean(replayed), 1),
                    "tpot_p50_ms": round(1e3 * statistics.median(tpot), 2) if tpot else None,
                    "replayed_tpot_p50_ms": round(1e3 * run.tpot_s, 2),
                    "step_mix": step_mix(measured_steps),
                    "replayed_step_mix": step_mix([(sec, rows, 1 if rows else 0, chunks)
                                                   for sec, rows, chunks in log])})
    return out


PASSES_MIN_CHAIN = 6  # passes_by_load: chains this long or longer (a chain's start shared among its passes)
PASSES_MIN_LOAD = 100  # passes_by_load: loads of fewer requests are left out
PASSES_MIN_COUNT = 50  # passes_by_load: bins of fewer passes are left out


def passes_by_load(trace: dict, preset: str, prompt_len: int, gpu: str, host_loop_s: float | None = None,
                   top_p: float = 1.0) -> list[dict]:
    """Per load (idle-separated, PASSES_MIN_LOAD requests or more) its decode passes run in chains of
    PASSES_MIN_CHAIN or more without prompt tokens, by 64 decoding rows (256 and more together): the measured time
    per pass and advise's price of the same chains (decode_step(rows) per pass and one chain_start(rows) per chain)
    over it, greedy and sampled (temperature 1, `top_p`) — a trace does not record what its requests asked for."""
    from collections import defaultdict

    priced = {"greedy": _costs(preset, prompt_len, gpu, 0.0, host_loop_s),
              "sampled": _costs(preset, prompt_len, gpu, 1.0, host_loop_s, top_p)}
    out = []
    for group in idle_separated(trace):
        if len(group) < PASSES_MIN_LOAD:
            continue
        bins: dict[int, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])  # passes, measured, greedy, sampled
        for s in steps_during(trace, group[0][0], max(r[2] for r in group)):
            if s[4] < PASSES_MIN_CHAIN or s[6]:
                continue
            rows = max(1, round(s[7] / s[4]))
            entry = bins[min(rows, 256) // 64 * 64]
            entry[0] += s[4]
            entry[1] += s[1] - s[0]
            entry[2] += chain_price(priced["greedy"], rows, s[4])
            entry[3] += chain_price(priced["sampled"], rows, s[4])
        out.append({"requests": len(group), "bins": [
            {"rows_from": rows, "passes": int(n), "measured_ms_per_pass": round(1e3 * t / n, 2),
             "greedy_ratio": round(g / t, 2), "sampled_ratio": round(sp / t, 2)}
            for rows, (n, t, g, sp) in sorted(bins.items()) if n >= PASSES_MIN_COUNT]})
    return out


def step_mix(steps: list[tuple[float, int, int, int]]) -> dict:
    """Where a load's engine time went, from (seconds, rows, decode passes, prompt chunks) per step: steps that
    prefilled (count, seconds, mean prompt chunks) and decode passes run without a prefill (count, seconds), and
    the decoding rows per decode pass (a step's rows counted once per pass)."""
    mixed = [s for s in steps if s[3] > 0]
    decode = [s for s in steps if s[3] == 0 and s[2] > 0]
    passes = sum(s[2] for s in steps)
    return {"prefill_steps": len(mixed), "prefill_steps_s": round(sum(s[0] for s in mixed), 3),
            "chunks_per_prefill_step": round(sum(s[3] for s in mixed) / len(mixed), 2) if mixed else 0.0,
            "decode_passes_alone": sum(s[2] for s in decode), "decode_alone_s": round(sum(s[0] for s in decode), 3),
            "rows_per_pass": round(sum(s[1] * s[2] for s in steps) / passes, 1) if passes else 0.0}


def _stays_full(events: list[tuple[float, int]], clients: int) -> bool:
    """A closed loop keeps about `clients` requests in flight from its first burst until its last round: at least
    90% of them for half that time or more (H200 runs: 69-100% of it; an open loop whose peak came near `clients`:
    1-2%)."""
    arrivals = [t for t, change in events if change > 0]
    finishes = [t for t, change in events if change < 0]
    start, end = arrivals[clients - 1], finishes[-clients]
    if end <= start:
        return False
    full = 0.0
    in_flight, last = 0, events[0][0]
    for t, change in events:
        if in_flight >= 0.9 * clients:
            full += max(0.0, min(t, end) - max(last, start))
        in_flight += change
        last = t
    return full >= 0.5 * (end - start)


def round_trips(trace: dict, clients: tuple[int, ...] = (64, 256)) -> list[dict]:
    """Per closed loop of the trace (see the module text): its requests, clients and the finish → next arrival
    delays' p10 / p50 / p90 in ms."""
    out = []
    for group in idle_separated(trace, idle_s=0.1):  # a closed loop's rounds may leave the engine idle a moment
        events = sorted([(r[0], 1) for r in group] + [(r[2], -1) for r in group])
        peak = max(itertools.accumulate(change for _, change in events))
        loop = next((n for n in clients if 0.9 * n <= peak <= n), None)
        if loop is None or len(group) <= 2 * loop or not _stays_full(events, loop):
            continue
        arrivals = sorted(r[0] for r in group)[loop:]
        finishes = sorted(r[2] for r in group)[: len(arrivals)]
        delays = sorted(a - f for a, f in zip(arrivals, finishes, strict=True))
        n = len(delays)
        out.append({"requests": len(group), "clients": loop,
                    **{f"p{q}_ms": round(1e3 * delays[min(n - 1, q * n // 100)], 1) for q in (10, 50, 90)}})
    return out


def _print_reports(paths: list[Path], as_json: bool, compute: Callable[[dict], list[dict]], header: str,
                   render: Callable[[dict], str | None]) -> None:
    """Each trace's rows (`compute` of the read trace): as JSON, or a header line and `render`'s text per row (a
    row rendered as None or "" prints nothing)."""
    for path in paths:
        rows = compute(_read(path))
        if as_json:
            print(json.dumps(rows, indent=1))
            continue
        print(f"{path.name}: {header}")
        for row in rows:
            text = render(row)
            if text:
                print(text)


def _replayed_load_lines(r: dict) -> str | None:
    if r["requests"] < 32:
        return None
    lines = [f"  {r['requests']:5d} requests over {r['arrivals_over_s']:6.2f} s: engine TTFT p50 "
             f"{r['ttft_p50_ms']:7.1f} ms, replayed {r['replayed_ttft_p50_ms']:7.1f} (mean "
             f"{r['ttft_mean_ms']:7.1f}, replayed {r['replayed_ttft_mean_ms']:7.1f}); TPOT p50 "
             f"{r['tpot_p50_ms']} ms, replayed {r['replayed_tpot_p50_ms']}"]
    for who, mix in (("measured", r["step_mix"]), ("replayed", r["replayed_step_mix"])):
        lines.append(f"      {who:8s}: {mix['prefill_steps']:5d} prefilling steps {mix['prefill_steps_s']:6.2f} s "
                     f"({mix['chunks_per_prefill_step']:.1f} prompts each), {mix['decode_passes_alone']:5d} "
                     f"decode passes alone {mix['decode_alone_s']:6.2f} s; {mix['rows_per_pass']:.0f} rows "
                     "per decode pass")
    return "\n".join(lines)


def _step_cost_line(r: dict) -> str | None:
    if r["steps"] < 5:
        return None
    what = "chained passes" if r["chunks"] == CHAINED else f"{r['chunks']} prompt chunks"
    return (f"  rows {r['rows_from']:3d}-{r['rows_from'] + 31:3d}, {what}: "
            f"{r['steps']:5d} {'chains' if r['chunks'] == CHAINED else 'steps'}, measured "
            f"{r['measured_ms']:6.2f} ms, replayed {r['replayed_ms']:6.2f} ms "
            f"({r['replayed_ms'] / r['measured_ms']:.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--step-costs", metavar="PRESET", help="measured steps against advise's step costs")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--gpu", default="h200")
    parser.add_argument("--replay-arrivals", metavar="PRESET", help="the step model on each load's measured arrivals")
    parser.add_argument("--temperature", type=float, default=1.0, help="--step-costs, --replay-arrivals: the "
                        "requests' temperature (default 1, the OpenAI default; 0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="--step-costs, --replay-arrivals: the requests' "
                        "top_p (default 1: none)")
    parser.add_argument("--host-loop-ms", type=float, help="price copt serve's host work at this host speed (advise "
                        "--host-loop-ms; a run's host probe records it as python_loop_us)")
    parser.add_argument("--passes-by-load", metavar="PRESET", help="each load's chained decode passes by rows "
                        "against advise's price, greedy and sampled")
    parser.add_argument("--round-trips", action="store_true", help="finish → next arrival in each closed loop")
    parser.add_argument("--clients", default="64,256", help="--round-trips: the closed loops' client counts")
    args = parser.parse_args()
    host_loop_s = args.host_loop_ms / 1e3 if args.host_loop_ms else None
    if args.round_trips:
        clients = tuple(int(x) for x in args.clients.split(","))
        _print_reports(args.traces, args.json, lambda t: round_trips(t, clients),
                       "finish → next arrival in each closed loop (finishes and arrivals paired in order)",
                       lambda r: f"  {r['requests']:5d} requests, {r['clients']:3d} clients: p10 {r['p10_ms']} ms, "
                                 f"p50 {r['p50_ms']} ms, p90 {r['p90_ms']} ms")
        return
    if args.passes_by_load:
        _print_reports(args.traces, args.json,
                       lambda t: passes_by_load(t, args.passes_by_load, args.prompt_len, args.gpu, host_loop_s,
                                                args.top_p),
                       f"chained decode passes per load, ms per pass (advise's price ÷ measured, greedy / sampled "
                       f"at top-p {args.top_p:g}; {args.passes_by_load} on {args.gpu})",
                       lambda load: f"  {load['requests']:5d} requests: " + "  ".join(
                           f"rows {b['rows_from']}+ {b['passes']} passes {b['measured_ms_per_pass']:.2f} ms "
                           f"({b['greedy_ratio']:.2f} / {b['sampled_ratio']:.2f})" for b in load["bins"]))
        return
    if args.replay_arrivals:
        _print_reports(args.traces, args.json,
                       lambda t: replay_arrivals(t, args.replay_arrivals, args.prompt_len, args.gpu,
                                                 args.temperature, host_loop_s, args.top_p),
                       f"each load from its engine arrivals, measured against the replay ({args.replay_arrivals}, "
                       f"temperature {args.temperature:g})", _replayed_load_lines)
        return
    if args.step_costs:
        _print_reports(args.traces, args.json,
                       lambda t: step_costs(t, args.step_costs, args.prompt_len, args.gpu, host_loop_s,
                                            args.temperature, args.top_p),
                       f"one-decode-pass steps and chained decode passes, measured against advise's step cost "
                       f"({args.step_costs})", _step_cost_line)
        return
    report = {}
    for path in args.traces:
        trace = _read(path)
        if not trace["requests"]:
            continue
        report[path.name] = loads(trace)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for name, items in report.items():
        print(name)
        for i, load in enumerate(items):
            kinds = ", ".join(f"{k} {v['steps']} steps {v['s']:.3f} s" for k, v in load["by_kind"].items())
            print(f"  load {i}: {load['requests']} requests over {load['span_s']:.3f} s (arrivals over "
                  f"{load['arrival_spread_s']:.3f} s, by quarter {load['arrivals_by_quarter_of_span']}); "
                  f"{load['steps']} steps busy {load['step_busy_s']:.3f} s, "
                  f"between steps {load['between_steps_s']:.3f} s; "
                  f"{kinds}; decode steps {load['decode_steps']} ({load['chained_decode_steps']} chained); "
                  f"engine TTFT p50 {load['ttft_engine_p50_s']} s")


if __name__ == "__main__":
    main()
