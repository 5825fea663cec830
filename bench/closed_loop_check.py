#!/usr/bin/env python3
"""advise's closed-loop replay (clusteropt_cli/core/advise/closed_loop.py) against the closed loops a
bench/gpu_serve_models.py run measured: for every guidellm level (its request count) and every `copt profile
endpoint` level (its duration) of each shape, the replay of that exact load next to the clients' tok/s, TTFT p50
and TPOT p50, with replayed ÷ measured. Runs anywhere (no GPU): it reads the results JSON.

    python3 bench/closed_loop_check.py RESULTS.json [...] [--json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from clusteropt_cli.core.advise.closed_loop import closed_loop_figures
from clusteropt_cli.core.advise.plan import InferPlan, Target
from clusteropt_cli.hardware import get_gpu
from clusteropt_cli.modelspec import load_model_spec

PRESETS = {"1b": "llama-3.2-1b", "8b": "llama-3.1-8b"}  # the shapes gpu_serve_models.py builds


def _profile_duration(command: str) -> float:
    words = command.split()
    return float(words[words.index("--duration") + 1])


def levels(results: dict) -> list[dict]:
    """Every closed-loop level of the run: shape, tester, clients, the load, sampling, measured figures."""
    cfg = results["config"]
    out = []
    for shape, runs in (results.get("guidellm") or {}).items():
        for run in runs.values():
            if isinstance(run, dict) and run.get("completed"):
                out.append({"shape": shape, "tester": "guidellm", "clients": run["concurrency"],
                            "load": {"requests": run["requests"]}, "top_p": 1.0, "measured": run})
    for shape, report in (results.get("profile_endpoint") or {}).items():
        duration = _profile_duration(report["command"])
        for key, level in report.items():
            if key.startswith("c") and isinstance(level, dict) and int(key[1:]) > 1:
                top_p = 0.95 if "--top-p 0.95" in report["command"] else 1.0
                out.append({"shape": shape, "tester": "profile endpoint", "clients": int(key[1:]),
                            "load": {"duration_s": duration}, "top_p": top_p, "measured": level})
    for level in out:
        level["prompt_len"], level["gen_len"] = cfg["prompt_len"], cfg["out_tokens"]
    return out


def check(level: dict) -> dict:
    plan = InferPlan(batch=level["clients"], prompt_len=level["prompt_len"], gen_len=level["gen_len"],
                     continuous_batching=True, temperature=1.0, top_p=level["top_p"])
    figures, _ = closed_loop_figures(load_model_spec(PRESETS[level["shape"]]), plan, Target(get_gpu("h200")),
                                     **level["load"])
    m = level["measured"]
    measured = {"output_tokens_per_s": m["output_tokens_per_s"], "ttft_s": m["ttft_s"]["p50"],
                "tpot_s": m["tpot_s"]["p50"]}
    row = {k: level[k] for k in ("shape", "tester", "clients", "load", "prompt_len", "gen_len")}
    for name, value in measured.items():
        replayed = figures.get(f"closed_loop_{name}")
        row[name] = {"measured": value, "replayed": replayed,
                     "ratio": None if replayed is None else round(replayed / value, 2)}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [check(level) for path in args.results for level in levels(json.loads(path.read_text()))]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("closed-loop replay ÷ measured (H200 figures of the results); TTFT '-': not replayed (host-bound)")
    for r in rows:
        cells = []
        for name, unit, scale in (("output_tokens_per_s", "tok/s", 1), ("ttft_s", "s", 1), ("tpot_s", "ms", 1e3)):
            f = r[name]
            shown = f"{f['measured'] * scale:,.0f}" if unit == "tok/s" else f"{f['measured'] * scale:.3g}"
            cells.append(f"{name.split('_')[0]} {shown} {unit} ({'-' if f['ratio'] is None else f['ratio']})")
        load = ", ".join(f"{k} {v}" for k, v in r["load"].items())
        print(f"  {r['shape']} {r['prompt_len']}/{r['gen_len']} {r['tester']:16s} {r['clients']:4d} clients ({load}): "
              + "; ".join(cells))


if __name__ == "__main__":
    main()
