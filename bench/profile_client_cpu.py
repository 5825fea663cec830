#!/usr/bin/env python3
"""How fast `copt profile endpoint`'s client can go: a minimal streaming server (raw asyncio, pre-shaped OpenAI SSE
chunks, one every --gap-ms per stream) in its own process, and profile_endpoint() at each concurrency against it,
reporting output tok/s, the client process's CPU per streamed token, TPOT p50 (the server's pace is --gap-ms: a
TPOT well above it, or ITL p50 near zero — chunks read in bursts — means the client fell behind) and TTFT p50 (the
server sends the first chunk at once: what the client and loopback add to a TTFT). One client process per level
(--client-processes 1), whose CPU is the one counted.

    python3 bench/profile_client_cpu.py --concurrency 64,128,256 --out client.json     (any machine)
    python3 bench/profile_client_cpu.py --rates 40,120,160 [--no-quiet-heap]

--rates: Poisson levels of --rate-duration seconds instead, reporting how late the client sent its requests
(send_lag_s p50/p90/p99 and the latest) and the garbage collector's full (generation 2) collections while the level
ran, with the longest (the loop stands still for it); --no-quiet-heap runs them without endpoint.quiet_heap, for a
before/after.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import free_port  # noqa: E402


def _serve(port: int, gap_s: float) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if head.startswith(b"GET"):  # /metrics and the like: none here
                    writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                    await writer.drain()
                    continue
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = json.loads(await reader.readexactly(length))
                n = int(body.get("max_tokens", 16))
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                for i in range(n):
                    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                             "choices": [{"index": 0, "text": f" w{i}", "logprobs": None, "finish_reason": None}]}
                    data = f"data: {json.dumps(chunk)}\n\n".encode()
                    writer.write(b"%x\r\n%s\r\n" % (len(data), data))
                    await writer.drain()
                    await asyncio.sleep(gap_s)
                usage = {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": n + 8}
                data = f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode()
                writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=4096)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="64,128,256")
    parser.add_argument("--gap-ms", type=float, default=3.0, help="the server's pause between two chunks of a stream")
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="requests per stream")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--rates", default="", help="Poisson levels (requests/s) instead of the concurrencies")
    parser.add_argument("--rate-duration", type=float, default=6.0)
    parser.add_argument("--no-quiet-heap", action="store_true")
    parser.add_argument("--tokenizer", help="a tokenizer directory for the prompts (the heap a real run carries)")
    parser.add_argument("--prompt-len", type=int, default=8)
    args = parser.parse_args()
    import clusteropt_cli.core.profile.endpoint as endpoint
    from clusteropt_cli.core.profile.endpoint import EndpointSettings, profile_endpoint

    if args.no_quiet_heap:
        endpoint.quiet_heap = lambda: None
    port = free_port()
    server = multiprocessing.get_context("spawn").Process(target=_serve, args=(port, args.gap_ms / 1e3), daemon=True)
    server.start()
    time.sleep(1.0)
    rows = []
    try:
        rates = [float(x) for x in args.rates.split(",") if x.strip()]
        if rates:  # one run, its levels in turn (as a real sweep: earlier levels' results stay on the heap)
            lags: list[list[float]] = []
            window: list[float] = []  # each level's start and end
            full: dict[int, list[float]] = {}  # level index → its full collections' seconds
            by_rate = endpoint._Runner.by_rate

            async def keep_lags(runner, rate):  # noqa: ANN001
                window.append(time.perf_counter())
                out = await by_rate(runner, rate)
                window.append(time.perf_counter())
                lags.append(list(runner.send_lag_s))
                return out

            started: list[float] = []

            def watch(phase: str, info: dict) -> None:
                if info["generation"] == 2 and len(window) % 2 == 1:  # while a level runs
                    if phase == "start":
                        started.append(time.perf_counter())
                    elif started:
                        full.setdefault(len(window) // 2, []).append(time.perf_counter() - started.pop())

            endpoint._Runner.by_rate = keep_lags
            gc.callbacks.append(watch)
            try:
                report = profile_endpoint(EndpointSettings(
                    url=f"http://127.0.0.1:{port}", model="m", rate=rates, duration_s=args.rate_duration, warmup=0,
                    gen_len=args.gen_len, prompt_len=args.prompt_len, tokenizer=args.tokenizer))
            finally:
                endpoint._Runner.by_rate = by_rate
                gc.callbacks.remove(watch)
            for i, lv in enumerate(report.levels):
                pauses = full.get(i, [])
                rows.append({"rate": lv.rate, "requests": lv.requests,
                             "output_tokens_per_s": round(lv.output_tokens_per_s),
                             **{f"send_lag_{k}_ms": round(1e3 * v, 2) for k, v in lv.send_lag_s.items() if k != "mean"},
                             "send_lag_max_ms": round(1e3 * max(lags[i]), 2), "full_collections": len(pauses),
                             "longest_full_collection_ms": round(1e3 * max(pauses, default=0.0), 2),
                             "ttft_p99_ms": round(1e3 * lv.ttft_s["p99"], 2)})
                print(rows[-1], flush=True)
        for c in (int(x) for x in args.concurrency.split(",") if x.strip() and not args.rates):
            cpu0 = time.process_time()
            report = profile_endpoint(EndpointSettings(url=f"http://127.0.0.1:{port}", model="m", concurrency=[c],
                                                       num_requests=c * args.rounds, warmup=0, gen_len=args.gen_len,
                                                       prompt_len=8, client_processes=1))
            cpu = time.process_time() - cpu0
            lv = report.levels[0]
            tokens = lv.completed * args.gen_len
            rows.append({"concurrency": c, "output_tokens_per_s": round(lv.output_tokens_per_s),
                         "client_cpu_us_per_token": round(1e6 * cpu / max(tokens, 1), 1),
                         "tpot_p50_ms": round(1e3 * lv.tpot_s["p50"], 2), "itl_p50_ms": round(1e3 * lv.itl_s["p50"], 2),
                         "ttft_p50_ms": round(1e3 * lv.ttft_s["p50"], 3),
                         "ideal_tokens_per_s": round(c / (args.gap_ms / 1e3))})
            print(rows[-1], flush=True)
    finally:
        server.terminate()
    if args.out:
        args.out.write_text(json.dumps({"gap_ms": args.gap_ms, "gen_len": args.gen_len, "levels": rows}, indent=2))


if __name__ == "__main__":
    main()
