#!/usr/bin/env python3
"""Same-run A/B of `copt serve` between two git revisions: HTTP streaming throughput and batch-1 latency.

Run from the repo root (on the GPU machine):
    python3 bench/serve_ab.py --before 32b1321 --out $OUT/serve_ab.json                  (≈ 10 minutes)
    python3 bench/serve_ab.py --before .ab-before --after . --out $OUT/serve_ab.json     (no git history there:
        a checkout made beforehand, e.g. `mkdir .ab-before && git archive 32b1321 | tar -x -C .ab-before`)
    python3 bench/serve_ab.py --before 32b1321 --smoke --out /tmp/ab.json                (CPU: tiny model)

--before / --after each name a git revision (checked out into its own temporary worktree, detached; the working
tree is not touched) or a directory holding a checkout ("." = this working tree, the default for --after). Both
are served with the same model, flags and workload; the servers run one at a time, alternating
before/after for --rounds rounds, so both sides see the same machine state. Model: the Llama-3.2-1B shape in bf16
with random weights (bench/common.py); workload: 256 streaming requests, prompts of 32–256 random tokens, 128
output tokens each (ignore_eos, greedy) for throughput, and one streaming request of 256 tokens at a time (three
times) for batch-1 decode ms/token and TTFT. Reported per side: the median over rounds, and after/before ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from common import (  # noqa: E402
    NUM_REQUESTS,
    OUT_TOKENS,
    free_port,
    http_load,
    log,
    make_model_dir,
    require_serve_speed_packages,
    wait_healthy,
    workload,
)


def checkout(spec: str, where: Path) -> tuple[Path, str, bool]:
    """(root, commit or path, made here): an existing checkout directory as is, else a detached worktree of the
    git revision `spec` (removed at the end)."""
    if Path(spec).is_dir():
        root = Path(spec).resolve()
        if not (root / "clusteropt_cli").is_dir():
            raise SystemExit(f"{spec} holds no copt checkout (no clusteropt_cli/ in it)")
        return root, str(root), False
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(where), spec], check=True,
                   capture_output=True, text=True)
    sha = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True,
                         check=True).stdout.strip()
    return where, sha, True


def serve_cmd(model_dir: Path, port: int, smoke: bool) -> list[str]:
    cmd = [sys.executable, "-m", "clusteropt_cli", "serve", str(model_dir), "--port", str(port),
           "--max-batch-size", str(64 if smoke else NUM_REQUESTS), "--max-model-len", "512",
           "--max-batch-tokens", "4096", "--served-model-name", "llama-1b-shape", "--max-queue", "4096"]
    if not smoke:
        cmd += ["--kv-cache-memory", "16"]
    return cmd


def measure(root: Path, model_dir: Path, prompts: list[list[int]], out_tokens: int, b1_tokens: int,
            smoke: bool) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # the side's checkout first; the rest of PYTHONPATH stays (packages installed to a --target directory)
    path = [str(root), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                         if p and Path(p).resolve() != REPO)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.Popen(serve_cmd(model_dir, port, smoke), cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        startup = wait_healthy(url, proc, timeout=600)
        asyncio.run(http_load(url, prompts[:16], 16, True))  # warm-up
        load = asyncio.run(http_load(url, prompts, out_tokens, True))
        runs = [asyncio.run(http_load(url, [prompts[1][:32]], b1_tokens, True)) for _ in range(3)]
        b1_ms = statistics.median(1000 * r["tpot_s"]["p50"] for r in runs)
        b1_ttft = statistics.median(1000 * r["ttft_s"]["p50"] for r in runs)
        return {"startup_s": round(startup, 2), "output_tokens_per_s": load["output_tokens_per_s"],
                "ttft_p50_ms": 1000 * load["ttft_s"]["p50"], "itl_p50_ms": 1000 * load["itl_s"]["p50"],
                "batch1_ms_per_token": b1_ms, "batch1_ttft_ms": b1_ttft}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="A: a git revision or a checkout directory")
    parser.add_argument("--after", default=".", help="B: a git revision or a checkout directory (default: .)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating before/after rounds (default 2)")
    parser.add_argument("--smoke", action="store_true", help="tiny model and workload (runs on a CPU)")
    parser.add_argument("--out", type=Path, required=True, help="JSON results path")
    args = parser.parse_args()
    require_serve_speed_packages(parser)

    n, out_tokens, b1_tokens = (16, 16, 32) if args.smoke else (NUM_REQUESTS, OUT_TOKENS, 256)
    results: dict = {"before": args.before, "after": args.after, "rounds": args.rounds, "smoke": args.smoke,
                     "requests": n, "output_tokens": out_tokens, "batch1_tokens": b1_tokens,
                     "runs": {"before": [], "after": []}}
    with tempfile.TemporaryDirectory(prefix="copt-serve-ab-") as tmp:
        tmp_path = Path(tmp)
        roots, made = {}, []
        try:
            for side, spec in (("before", args.before), ("after", args.after)):
                roots[side], what, new = checkout(spec, tmp_path / side)
                if new:
                    made.append(roots[side])
                results[f"{side}_commit"] = what
                log(f"{side}: {spec} = {what}")
            model_dir = tmp_path / "model"
            info = make_model_dir(model_dir, small=args.smoke)
            del info["model"]
            prompts = workload(info["vocab"], n)
            for r in range(args.rounds):
                order = ("before", "after") if r % 2 == 0 else ("after", "before")
                for side in order:
                    t0 = time.perf_counter()
                    res = measure(roots[side], model_dir, prompts, out_tokens, b1_tokens, args.smoke)
                    res["round"] = r
                    results["runs"][side].append(res)
                    log(f"round {r} {side}: {res['output_tokens_per_s']:.0f} tok/s, batch-1 "
                        f"{res['batch1_ms_per_token']:.3f} ms/token ({time.perf_counter() - t0:.0f} s)")
        finally:
            for root in made:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(root)],
                               capture_output=True)
    keys = ("output_tokens_per_s", "ttft_p50_ms", "itl_p50_ms", "batch1_ms_per_token", "batch1_ttft_ms")
    summary = {side: {k: statistics.median(run[k] for run in results["runs"][side]) for k in keys}
               for side in ("before", "after")}
    summary["after_over_before"] = {k: summary["after"][k] / summary["before"][k] for k in keys
                                    if summary["before"][k]}
    results["median"] = summary
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = args.out.with_suffix(args.out.suffix + ".tmp")
    tmp_out.write_text(json.dumps(results, indent=2))
    tmp_out.replace(args.out)
    print(f"{'metric':24} {'before':>12} {'after':>12} {'after/before':>13}")
    for k in keys:
        ratio = summary["after_over_before"].get(k)
        print(f"{k:24} {summary['before'][k]:12.3f} {summary['after'][k]:12.3f} "
              f"{(f'{ratio:.3f}' if ratio else '-'):>13}")
    print(f"(medians of {args.rounds} rounds; higher is better for tok/s, lower for ms) -> {args.out}")


if __name__ == "__main__":
    main()
