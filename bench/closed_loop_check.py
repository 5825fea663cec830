#!/usr/bin/env python3
"""advise's closed-loop replay (clusteropt_cli/core/advise/closed_loop.py) against the loads a
bench/gpu_serve_models.py run measured: for every guidellm level (its request count) and every `copt profile
endpoint` level (its duration; a --rate level: the open-loop replay of its Poisson sends) of each shape, greedy
and sampled, the replay of that exact load next to the clients' tok/s, TTFT p50 and TPOT p50, with replayed ÷
measured; a one-client level against advise's batch-1 figures. Each results file is replayed for the GPU it names
(its `gpu` device name; H200 where none is recorded). Runs anywhere (no GPU): it reads the results JSON.

    python3 bench/closed_loop_check.py RESULTS.json [...] [--json] [--results-after-prefill] [--masked-prefill-graphs]
    python3 bench/closed_loop_check.py --spread RUN1/*.json RUN2/*.json [...]

--spread: the results are repeated runs of the same levels (a level measured again in another file is another run):
per level and figure, every run's measurement, how far apart they are (largest ÷ smallest) and the replay's ratio
to each, then how many figures the replay puts within ±15% of every run, of some run, and how many repeat within
±15% of their own median.

--results-after-prefill replays an engine that handed a step's decoded tokens out only after the step's prefill
(copt serve before it handed them out early): for results measured on such a tree. --masked-prefill-graphs replays
the engine whose prefill graphs took new prompts only (up to 8, 1,024 tokens packed; before they went through
FlashAttention's variable-length kernel): for results measured before 2026-12-03's held-out run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import LLAMA_70B_8L_SHAPE, QWEN3_MOE_16L_SHAPE, QWEN25_7B_SHAPE

from clusteropt_cli.core.advise.closed_loop import (
    closed_loop_figures,
    implied_ttft_ratio,
    open_loop_figures,
    ttft_explained,
)
from clusteropt_cli.core.advise.plan import InferPlan, Target
from clusteropt_cli.core.advise.timing import infer_time
from clusteropt_cli.hardware import get_gpu, match_catalog
from clusteropt_cli.modelspec import load_model_spec

# the shapes gpu_serve_models.py builds: a preset, or the shape's config
PRESETS = {"1b": "llama-3.2-1b", "3b": "llama-3.2-3b", "8b": "llama-3.1-8b",
           "70b8l": dict(LLAMA_70B_8L_SHAPE, model_type="llama", _name_or_path="llama-70b-8l"),
           "qwen7b": dict(QWEN25_7B_SHAPE, _name_or_path="qwen2.5-7b-shape"),
           "qwen3moe16l": dict(QWEN3_MOE_16L_SHAPE, _name_or_path="qwen3-30b-a3b-16l-shape")}
FIGURES = ("output_tokens_per_s", "ttft_s", "tpot_s")  # what each level is checked on


def _profile_duration(command: str) -> float:
    words = command.split()
    return float(words[words.index("--duration") + 1])


def _flag(command: str, name: str, default: float) -> float:
    words = command.split()
    return float(words[words.index(name) + 1]) if name in words else default


def levels(results: dict) -> list[dict]:
    """Every closed-loop level of the run: shape, tester, clients, the load, sampling, measured figures. Sampled
    levels are under `guidellm` / `profile_endpoint`, greedy ones (--tester-modes greedy) under `<tester>_greedy`."""
    cfg = results["config"]
    out = []
    for key, temperature in (("guidellm", 1.0), ("guidellm_greedy", 0.0)):
        for shape, runs in (results.get(key) or {}).items():
            for run in runs.values():
                if isinstance(run, dict) and run.get("completed"):
                    out.append({"shape": shape, "tester": "guidellm", "clients": run["concurrency"],
                                "load": {"requests": run["requests"]}, "temperature": temperature, "top_p": 1.0,
                                "measured": run})
    for key in ("profile_endpoint", "profile_endpoint_greedy"):
        for shape, report in (results.get(key) or {}).items():
            command = report.get("command") or report.get("rate_command")  # a rates-only run has only the latter
            if command is None:
                continue
            duration = _profile_duration(command)
            temperature = _flag(command, "--temperature", 1.0)
            top_p = _flag(command, "--top-p", 1.0)
            for name, level in report.items():
                if name.startswith("c") and name[1:].isdigit() and isinstance(level, dict) and level.get("completed"):
                    out.append({"shape": shape, "tester": "profile endpoint", "clients": int(name[1:]),
                                "load": {"duration_s": duration}, "temperature": temperature, "top_p": top_p,
                                "measured": level})
                elif name.startswith("r") and isinstance(level, dict) and level.get("completed"):
                    out.append({"shape": shape, "tester": "profile endpoint", "clients": None,
                                "load": {"rate": float(name[1:]), "duration_s": duration},
                                "temperature": temperature, "top_p": top_p, "measured": level})
    gpu = gpu_of(results)
    loop_us = (results.get("host") or {}).get("python_loop_us")
    for level in out:
        level["prompt_len"], level["gen_len"], level["gpu"] = cfg["prompt_len"], cfg["out_tokens"], gpu
        level["recorded_host_loop_s"] = loop_us / 1e6 if loop_us else None
    return out


def _turnarounds(text: str) -> dict[str, float]:
    """--turnaround-ms: 'MS' (every closed loop) or comma-separated 'TESTER[@CLIENTS]=MS' → seconds by key."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, ms = part.rpartition("=")
        try:
            seconds = float(ms) / 1e3
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r}: expected MS or TESTER[@CLIENTS]=MS") from None
        if seconds < 0:
            raise argparse.ArgumentTypeError(f"{part!r}: a turnaround is not negative")
        out[key.strip() or "*"] = seconds
    return out


def _turnaround_for(turnarounds: dict[str, float], level: dict) -> float:
    """The most specific --turnaround-ms entry for a level: tester@clients, then tester, then every level."""
    for key in (f"{level['tester']}@{level['clients']}", level["tester"], "*"):
        if key in turnarounds:
            return turnarounds[key]
    return 0.0


def gpu_of(results: dict) -> str:
    """The catalog name of the GPU the results were measured on (their `gpu` device name; H200 where it is not
    recorded or not in the catalog)."""
    spec = match_catalog(results.get("gpu") or "")
    return spec.name if spec else "h200"


def predicted(level: dict, results_before_prefill: bool = True, masked_prefill_graphs: bool = False,
              ) -> dict[str, float]:
    """The replay of the level's load (output_tokens_per_s, ttft_s, tpot_s): a closed loop's, an open loop's (a
    rate level, clients None: open_loop_figures with the profile endpoint's default seed) or, for one client,
    infer_time's own batch-1 figures (a lone client's requests never overlap)."""
    plan = InferPlan(batch=level["clients"] or 1, prompt_len=level["prompt_len"], gen_len=level["gen_len"],
                     continuous_batching=True, temperature=level["temperature"], top_p=level["top_p"])
    spec = load_model_spec(PRESETS[level["shape"]])
    target = Target(get_gpu(level.get("gpu", "h200")), host_loop_s=level.get("host_loop_s"))
    if level["clients"] is None:
        figures = open_loop_figures(spec, plan, target, **level["load"],
                                    masked_prefill_graphs=masked_prefill_graphs) or {}
        return {name.removeprefix("open_loop_"): value for name, value in figures.items()}
    if level["clients"] == 1:
        figures = infer_time(spec, plan, target).figures
        return {name: figures[name] for name in FIGURES}
    replay = closed_loop_figures(spec, plan, target, **level["load"], results_before_prefill=results_before_prefill,
                                 masked_prefill_graphs=masked_prefill_graphs,
                                 turnaround_s=level.get("turnaround_s", 0.0))
    return {name.removeprefix("closed_loop_"): value for name, value in (replay[0] if replay else {}).items()}


def check(level: dict, results_before_prefill: bool = True, masked_prefill_graphs: bool = False) -> dict:
    figures = predicted(level, results_before_prefill, masked_prefill_graphs)
    m = level["measured"]
    measured = {"output_tokens_per_s": m["output_tokens_per_s"], "ttft_s": m["ttft_s"]["p50"],
                "tpot_s": m["tpot_s"]["p50"]}
    row = {k: level[k] for k in ("shape", "tester", "clients", "load", "prompt_len", "gen_len", "temperature", "gpu")}
    if level.get("host_loop_s"):
        row["host_loop_ms"] = round(level["host_loop_s"] * 1e3, 2)
    for name, value in measured.items():
        replayed = figures.get(name)
        row[name] = {"measured": value, "replayed": replayed,
                     "ratio": None if replayed is None else round(replayed / value, 2)}
    row["ttft_bookkeeping"] = ttft_bookkeeping(level, figures)
    return row


def ttft_bookkeeping(level: dict, figures: dict[str, float]) -> dict | None:
    """A closed loop's TTFT from the cycle every client repeats (TTFT, decode, turnaround; clients × output tokens
    ÷ tok/s long): measured, the cycle and the decode ((output tokens - 1) × TPOT) in TTFTs; and the TTFT ratio
    the replay's tok/s and TPOT ratios alone imply, exp(-cycle × ln tok/s ratio - decode × ln TPOT ratio) — how far
    the replay's TTFT is off because its throughput and decode are. None: no closed loop or no replayed TTFT."""
    m = level["measured"]
    if not level["clients"] or level["clients"] < 2 or figures.get("ttft_s") is None:
        return None
    ttft, tok_s, tpot = m["ttft_s"]["p50"], m["output_tokens_per_s"], m["tpot_s"]["p50"]
    cycle = level["clients"] * level["gen_len"] / tok_s / ttft
    decode = (level["gen_len"] - 1) * tpot / ttft
    ratios = {name: figures[name] / value for name, value in
              (("ttft_s", ttft), ("output_tokens_per_s", tok_s), ("tpot_s", tpot))}
    implied = implied_ttft_ratio(cycle, decode, ratios["output_tokens_per_s"], ratios["tpot_s"])
    # as `copt profile endpoint --expect` judges it at ±TOLERANCE (an error relative to the prediction)
    passed = {name: abs(1 / ratio - 1) <= TOLERANCE for name, ratio in ratios.items()}
    verdict = "pass" if passed["ttft_s"] else (
        "explained" if ttft_explained(ratios["ttft_s"], implied, decode,
                                      passed["output_tokens_per_s"] and passed["tpot_s"], TOLERANCE) else "miss")
    return {"cycle_ttfts": round(cycle, 2), "decode_ttfts": round(decode, 2), "implied_ratio": round(implied, 2),
            "expect_ttft": verdict}


def bookkeeping_summary(rows: list[dict]) -> dict | None:
    """Over the closed loops with a replayed TTFT: how many, the correlation of ln(replayed ÷ measured TTFT) with
    ln(the ratio the tok/s and TPOT errors imply), and the range of decode_ttfts."""
    import math
    import statistics

    pairs = [(math.log(r["ttft_s"]["ratio"]), math.log(r["ttft_bookkeeping"]["implied_ratio"]), r)
             for r in rows if r.get("ttft_bookkeeping") and r["ttft_s"]["ratio"]]
    if len(pairs) < 3:
        return None
    actual, implied = [p[0] for p in pairs], [p[1] for p in pairs]
    decode = [p[2]["ttft_bookkeeping"]["decode_ttfts"] for p in pairs]
    return {"levels": len(pairs), "correlation": round(statistics.correlation(actual, implied), 2),
            "decode_ttfts": [min(decode), max(decode)]}


TOLERANCE = 0.15


def level_key(row: dict) -> tuple:
    """What makes two measured levels the same load: GPU, shape, tester, sampling, clients or rate, load, lengths."""
    return (row.get("gpu", "h200"), row["shape"], row["tester"], row["temperature"], row["clients"],
            tuple(sorted(row["load"].items())), row["prompt_len"], row["gen_len"])


def spread(rows: list[dict]) -> list[dict]:
    """Rows of check() from repeated runs, grouped by level: per figure the measurements (in file order), their
    spread (largest ÷ smallest), the replay and its ratio to each measurement."""
    by_level: dict[tuple, list[dict]] = {}
    for row in rows:
        by_level.setdefault(level_key(row), []).append(row)
    out = []
    for group in by_level.values():
        entry = {k: group[0][k] for k in ("shape", "tester", "clients", "load", "prompt_len", "gen_len", "temperature")}
        entry["gpu"] = group[0].get("gpu", "h200")
        for name in FIGURES:
            measured = [r[name]["measured"] for r in group]
            replayed = group[0][name]["replayed"]
            entry[name] = {"measured": measured, "spread": round(max(measured) / min(measured), 2),
                           "replayed": replayed,
                           "ratios": None if replayed is None else [round(replayed / m, 2) for m in measured]}
        out.append(entry)
    return out


def spread_summary(entries: list[dict]) -> dict[str, int]:
    """Figures (with a replay, measured more than once) the replay puts within TOLERANCE of every run and of at
    least one, and figures whose runs all sit within TOLERANCE of their own median."""
    import statistics

    counts = {"figures": 0, "replay_within_every_run": 0, "replay_within_some_run": 0, "runs_within_their_median": 0}
    for entry in entries:
        for name in FIGURES:
            f = entry[name]
            if f["replayed"] is None or len(f["measured"]) < 2:
                continue
            median = statistics.median(f["measured"])
            within = [abs(f["replayed"] / m - 1) <= TOLERANCE for m in f["measured"]]
            counts["figures"] += 1
            counts["replay_within_every_run"] += all(within)
            counts["replay_within_some_run"] += any(within)
            counts["runs_within_their_median"] += all(abs(m / median - 1) <= TOLERANCE for m in f["measured"])
    return counts


def _print_spread(entries: list[dict]) -> None:
    print("repeated runs of each level: measured (each run), largest ÷ smallest, replay ÷ each run")
    for e in entries:
        mode = "greedy" if e["temperature"] == 0 else "sampled"
        who = f"{e['clients']:4d} clients" if e["clients"] else f"{e['load']['rate']:g}/s Poisson"
        cells = []
        for name, scale, fmt in (("output_tokens_per_s", 1, "{:,.0f}"), ("ttft_s", 1e3, "{:.3g}"),
                                 ("tpot_s", 1e3, "{:.3g}")):
            f = e[name]
            shown = "/".join(fmt.format(m * scale) for m in f["measured"])
            ratios = "-" if f["ratios"] is None else "/".join(f"{r:.2f}" for r in f["ratios"])
            cells.append(f"{name.split('_')[0]} {shown} (×{f['spread']:.2f}; {ratios})")
        print(f"  {e['shape']} {e['tester']:16s} {mode:7s} {who}: " + "; ".join(cells))
    c = spread_summary(entries)
    print(f"{c['figures']} figures measured more than once and replayed: the replay within ±{TOLERANCE:.0%} of every "
          f"run for {c['replay_within_every_run']}, of some run for {c['replay_within_some_run']}; the runs within "
          f"±{TOLERANCE:.0%} of their own median for {c['runs_within_their_median']} (TTFT and TPOT in ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--results-after-prefill", action="store_true")
    parser.add_argument("--masked-prefill-graphs", action="store_true",
                        help="replay the engine whose prefill graphs took new prompts only (runs before 2026-12-03)")
    parser.add_argument("--spread", action="store_true", help="the results are repeated runs of the same levels")
    parser.add_argument("--recorded-host", action="store_true",
                        help="price copt serve's host work at the host probe the results recorded (advise "
                             "--host-loop-ms); runs without one stay at the calibration machines' host")
    parser.add_argument("--host-loop-ms", type=float,
                        help="price copt serve's host work at this host speed for every run (a probe taken beside "
                             "the run's own)")
    parser.add_argument("--turnaround-ms", type=_turnarounds, default={},
                        help="replay each closed-loop client's time between an answer and its next request: one "
                             "value for every tester, or per tester and clients, e.g. 'guidellm=56,profile "
                             "endpoint@256=35' (a results folder's requests_in_api.py reads it off an API trace)")
    args = parser.parse_args()
    all_levels = [level for path in args.results for level in levels(json.loads(path.read_text()))]
    for level in all_levels:
        level["turnaround_s"] = _turnaround_for(args.turnaround_ms, level)
        if args.host_loop_ms:
            level["host_loop_s"] = args.host_loop_ms / 1e3
        elif args.recorded_host:
            level["host_loop_s"] = level["recorded_host_loop_s"]
    rows = [check(level, not args.results_after_prefill, args.masked_prefill_graphs) for level in all_levels]
    if args.spread:
        entries = spread(rows)
        if args.json:
            print(json.dumps({"levels": entries, "summary": spread_summary(entries)}, indent=1))
        else:
            _print_spread(entries)
        return
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    gpus = sorted({r["gpu"] for r in rows})
    print(f"closed-loop replay ÷ measured (advise's figures for {', '.join(gpus)}, the results' GPU); TTFT '-': not "
          "replayed (host-bound)")
    for r in rows:
        cells = []
        for name, unit, scale in (("output_tokens_per_s", "tok/s", 1), ("ttft_s", "s", 1), ("tpot_s", "ms", 1e3)):
            f = r[name]
            shown = f"{f['measured'] * scale:,.0f}" if unit == "tok/s" else f"{f['measured'] * scale:.3g}"
            cells.append(f"{name.split('_')[0]} {shown} {unit} ({'-' if f['ratio'] is None else f['ratio']})")
        load = ", ".join(f"{k} {v}" for k, v in r["load"].items())
        mode = "greedy" if r["temperature"] == 0 else "sampled"
        who = f"{r['clients']:4d} clients" if r["clients"] else f"{r['load']['rate']:g}/s Poisson"
        book = r.get("ttft_bookkeeping")
        if book:
            cells.append(f"decode {book['decode_ttfts']:.1f}× the TTFT: tok/s and TPOT imply ttft "
                         f"{book['implied_ratio']:.2f}; --expect's TTFT at ±{TOLERANCE:.0%}: {book['expect_ttft']}")
        print(f"  {r['shape']} {r['prompt_len']}/{r['gen_len']} {r['tester']:16s} {mode:7s} {who} "
              f"({load}): " + "; ".join(cells))
    summary = bookkeeping_summary(rows)
    if summary:
        print(f"closed loops with a replayed TTFT: {summary['levels']}; ln(TTFT ratio) against ln(the ratio the "
              f"tok/s and TPOT ratios imply): correlation {summary['correlation']:.2f}; decode "
              f"{summary['decode_ttfts'][0]:.1f}-{summary['decode_ttfts'][1]:.1f}× the TTFT")
        verdicts = [r["ttft_bookkeeping"]["expect_ttft"] for r in rows if r.get("ttft_bookkeeping")]
        print(f"--expect's TTFT at ±{TOLERANCE:.0%}: " + ", ".join(
            f"{verdicts.count(v)} {v}" for v in ("pass", "explained", "miss")))


if __name__ == "__main__":
    main()
