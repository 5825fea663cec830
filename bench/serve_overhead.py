#!/usr/bin/env python3
"""Host overhead of copt's serve engine on CPU: tiny model, many requests, time per phase of the engine step.

With the fixture teacher (~1M parameters) the model forward is cheap, so what the engine does around it
(scheduling, sampling, emitting tokens, detokenizing, handle wake-ups) is visible. Same-run baseline: a bare loop
over the same ModelRunner (prefill every prompt, then batched decode steps with argmax and nothing else), i.e. the
forward cost the engine cannot avoid.

    python bench/serve_overhead.py --out bench/results/serve_overhead_cpu.json [--requests 256 --out-tokens 32]
    python bench/serve_overhead.py --http --out ...   # the same requests streamed through `copt serve`
                                                      # (SERVE_PYTHONPATH=<tree> serves another checkout)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def workload(n: int, vocab: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def bare_loop(runner, prompts: list[list[int]], out_tokens: int, budget: int) -> dict:
    """Prefill in packed chunks of `budget` tokens, then decode all sequences together: the unavoidable work."""
    import torch

    t0 = time.perf_counter()
    last: list[int] = [0] * len(prompts)
    i = 0
    with torch.inference_mode():
        while i < len(prompts):
            group, used = [], 0
            while i < len(prompts) and (not group or used + len(prompts[i]) <= budget):
                group.append(i)
                used += len(prompts[i])
                i += 1
            logits = runner.forward_packed([(j, 0, prompts[j]) for j in group], [[len(prompts[j]) - 1] for j in group])
            for j, tok in zip(group, logits.argmax(-1).tolist(), strict=True):
                last[j] = tok
        t_prefill = time.perf_counter() - t0
        slots = list(range(len(prompts)))
        for step in range(out_tokens - 1):
            positions = [len(p) + step for p in prompts]
            last = runner.forward_decode(slots, positions, last).argmax(-1).tolist()
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "prefill_s": t_prefill, "decode_s": wall - t_prefill,
            "output_tokens_per_s": len(prompts) * out_tokens / wall,
            "decode_ms_per_step": 1000 * (wall - t_prefill) / max(1, out_tokens - 1)}


def bench_http(model: str, prompts: list[list[int]], out_tokens: int, max_len: int, api_servers: int = 0) -> dict:
    """`copt serve` in a subprocess, every request streamed at once; client-side tok/s, TTFT, ITL + engine phases."""
    import asyncio
    import os
    import subprocess

    import httpx
    from common import free_port, http_load, wait_healthy

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    tree = os.environ.get("SERVE_PYTHONPATH", str(REPO))
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "clusteropt_cli", "serve", model, "--port", str(port),
           "--max-batch-size", str(len(prompts)), "--max-model-len", str(max_len), "--max-batch-tokens", "4096",
           "--max-queue", str(4 * len(prompts)), "--served-model-name", "llama-1b-shape"]
    if api_servers:  # the split server (an older tree given by SERVE_PYTHONPATH may not have the flag)
        cmd += ["--api-server-count", str(api_servers)]
    proc = subprocess.Popen(cmd, env=env, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(url, proc, timeout=120)
        asyncio.run(http_load(url, prompts[:8], 8, True))  # warm-up
        res = asyncio.run(http_load(url, prompts, out_tokens, True))
        metrics = httpx.get(url + "/metrics", timeout=10).text
        res["engine_phase_s"] = {line.split('"')[1]: float(line.split()[-1]) for line in metrics.splitlines()
                                 if line.startswith("copt_engine_phase_seconds_total{")}
        return res
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results/serve_overhead_cpu.json"))
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--out-tokens", type=int, default=32)
    parser.add_argument("--prompt-min", type=int, default=32)
    parser.add_argument("--prompt-max", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--http", action="store_true", help="stream the requests through `copt serve` instead")
    parser.add_argument("--api-server-count", type=int, default=0,
                        help="with --http: serve with N API-server processes in front of an engine-core process")
    args = parser.parse_args()

    import torch

    from clusteropt_cli.core.serve.engine import Engine, EngineConfig, GenerationRequest
    from tests.fixture_models import build_fixtures

    torch.set_num_threads(args.threads)
    fx = build_fixtures()
    prompts = workload(args.requests, 1024, args.prompt_min, args.prompt_max)
    max_len = args.prompt_max + args.out_tokens + 8
    if args.http:
        res = bench_http(str(fx.teacher), prompts, args.out_tokens, max_len, args.api_server_count)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "api_server_count": args.api_server_count,
                                        "http_stream": res}, indent=2))
        t, i = res["ttft_s"], res["itl_s"]
        print(f"http_stream: {res['output_tokens_per_s']:,.0f} tok/s, wall {res['wall_s']:.2f} s, "
              f"TTFT p50/p99 {t['p50']:.2f}/{t['p99']:.2f} s, ITL p50/p99 {1e3 * i['p50']:.1f}/{1e3 * i['p99']:.1f} ms")
        for k, v in sorted(res["engine_phase_s"].items()):
            print(f"  {k:<22}{v:8.3f} s")
        return
    engine = Engine(EngineConfig(model=str(fx.teacher), device="cpu", max_batch_size=args.requests,
                                 max_model_len=max_len, max_batch_tokens=4096, max_queue=4 * args.requests))
    engine.start()
    try:
        reqs = [GenerationRequest(prompt_ids=p, max_new_tokens=args.out_tokens, ignore_eos=True) for p in prompts]
        engine.generate(reqs[:8])  # warm-up
        base = bare_loop(engine.runner, prompts, args.out_tokens, engine.max_batch_tokens)
        engine.stats.phase_s.clear()
        steps0, dsteps0 = engine.stats.steps, engine.stats.decode_steps
        t0 = time.perf_counter()
        results = engine.generate(reqs)
        wall = time.perf_counter() - t0
        tokens = sum(r.num_output_tokens for r in results)
        phases = dict(engine.stats.phase_s)
        steps = engine.stats.steps - steps0
        dsteps = engine.stats.decode_steps - dsteps0
        forward = phases.get("decode_forward", 0.0) + phases.get("prefill_forward", 0.0)
        accounted = sum(phases.values())
        eng = {"wall_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall, "steps": steps,
               "decode_steps": dsteps, "phase_s": {k: round(v, 4) for k, v in sorted(phases.items())},
               "host_outside_forward_s": wall - forward,
               "host_ms_per_step_outside_forward": 1000 * (wall - forward) / max(1, steps),
               "unaccounted_s": wall - accounted}
    finally:
        engine.stop()
    out = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "threads": args.threads,
           "workload": {"requests": args.requests, "prompt_tokens": [args.prompt_min, args.prompt_max],
                        "output_tokens": args.out_tokens},
           "bare_loop": base, "engine": eng, "engine_vs_bare_wall": wall / base["wall_s"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"bare loop: {base['wall_s']:.2f} s ({base['output_tokens_per_s']:,.0f} tok/s; "
          f"prefill {base['prefill_s']:.2f} s, decode {base['decode_ms_per_step']:.1f} ms/step)")
    print(f"engine:    {wall:.2f} s ({eng['output_tokens_per_s']:,.0f} tok/s), {steps} steps, "
          f"{eng['host_ms_per_step_outside_forward']:.2f} ms/step outside the forward; "
          f"engine/bare wall {out['engine_vs_bare_wall']:.2f}x")
    for k, v in eng["phase_s"].items():
        print(f"  {k:<22}{v:8.3f} s  {1000 * v / max(1, steps):7.2f} ms/step")
    print(f"  {'(unaccounted)':<22}{eng['unaccounted_s']:8.3f} s")
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
