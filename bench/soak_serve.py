#!/usr/bin/env python3
"""Soak `copt serve` on the fixture teacher (CPU): 1,000 requests at concurrency 64, half streaming, one in ten
cancelled mid-stream. Pass criteria: zero server errors, every non-cancelled request complete, and the server's
resident memory after the run within 10% of after the first 100 requests.

    python bench/soak_serve.py --out bench/results/serve_soak_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


async def one(client, url: str, i: int, prompt: list[int], max_tokens: int, outcome: dict) -> None:
    stream = i % 2 == 0
    cancel = i % 10 == 5  # one in ten, always a streaming one
    if cancel:
        stream = True
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.7 if i % 3 else 0, "seed": i,
            "stream": stream}
    try:
        if not stream:
            r = await client.post(url + "/v1/completions", json=body)
            if r.status_code >= 500:
                outcome["server_errors"] += 1
            elif r.status_code != 200:
                outcome["client_errors"] += 1
            elif r.json()["choices"][0]["finish_reason"] in ("length", "stop"):
                outcome["completed"] += 1
            else:
                outcome["incomplete"] += 1
            return
        chunks, reason = 0, None
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code >= 500:
                outcome["server_errors"] += 1
                return
            if r.status_code != 200:
                outcome["client_errors"] += 1
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunks += 1
                obj = json.loads(line[6:])
                if obj["choices"] and obj["choices"][0]["finish_reason"]:
                    reason = obj["choices"][0]["finish_reason"]
                if cancel and chunks == 2:
                    outcome["cancelled"] += 1
                    return  # leaving the context closes the connection mid-stream
        if reason in ("length", "stop"):
            outcome["completed"] += 1
        else:
            outcome["incomplete"] += 1
    except Exception as exc:  # noqa: BLE001 - a transport failure counts against the server
        outcome["server_errors"] += 1
        outcome.setdefault("exceptions", []).append(f"{type(exc).__name__}: {exc}")


async def soak(url: str, pid: int, prompts: list[list[int]], total: int, concurrency: int) -> dict:
    import httpx
    import psutil

    proc = psutil.Process(pid)
    rng = random.Random(0)
    outcome = {"completed": 0, "cancelled": 0, "incomplete": 0, "server_errors": 0, "client_errors": 0}
    rss: dict[str, float] = {"start": proc.memory_info().rss}
    sem = asyncio.Semaphore(concurrency)
    done = 0

    async def run(i: int) -> None:
        nonlocal done
        async with sem:
            await one(client, url, i, prompts[i % len(prompts)], rng.randint(8, 64), outcome)
        done += 1
        if done == 100:
            rss["after_100"] = proc.memory_info().rss

    limits = httpx.Limits(max_connections=concurrency + 8)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        await asyncio.gather(*[run(i) for i in range(total)])
    wall = time.perf_counter() - t0
    await asyncio.sleep(1.0)
    rss["end"] = proc.memory_info().rss
    metrics = httpx.get(url + "/metrics").text
    running = [float(line.split()[1]) for line in metrics.splitlines() if line.startswith("copt_num_requests_running ")]
    return {**outcome, "requests": total, "concurrency": concurrency, "wall_s": wall, "rss_bytes": rss,
            "rss_growth_vs_after_100": rss["end"] / rss["after_100"] - 1, "running_after": running[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/serve_soak_cpu.json")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()

    from tests.fixture_models import build_fixtures
    from tests.integration.test_serve_helpers import eval_prompts, running_server

    fixtures = build_fixtures()
    prompts = eval_prompts(fixtures, 200, min_len=8, max_len=120)
    with running_server(fixtures.teacher, "--max-batch-size", "64", "--max-queue", "4096") as (url, proc):
        result = asyncio.run(soak(url, proc.pid, prompts, args.requests, args.concurrency))
        proc.send_signal(__import__("signal").SIGTERM)
        result["exit_status"] = proc.wait(60)
    result["pass"] = (result["server_errors"] == 0 and result["incomplete"] == 0 and result["client_errors"] == 0
                      and result["completed"] + result["cancelled"] == result["requests"]
                      and abs(result["rss_growth_vs_after_100"]) <= 0.10 and result["exit_status"] == 0
                      and result["running_after"] == 0)
    result["date"] = time.strftime("%Y-%m-%d")
    result["machine"] = "CPU (2 shared cores), fixture teacher"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "exceptions"}, indent=2))
    sys.exit(0 if result["pass"] else 1)


if __name__ == "__main__":
    main()
