#!/usr/bin/env python3
"""Host cost of copt serve's streaming path per generated token, without HTTP or a model (CPU, deterministic).

What runs between the engine emitting a token and the SSE bytes being handed to the ASGI server: the engine-side
push into each request's handle and the one wake-up per event loop per step (as Engine._emit_one_each does it),
then, on the event loop, every request's TokenStream: handle iteration, incremental detokenization, stop-string
checks and the SSE event text. `--requests` streams advance together, one token each per step, for `--steps`
steps; the figure is thread CPU time per token (the same thread does both sides here, so it is their sum).

    python bench/serve_stream_path.py [--requests 256 --steps 128 --repeats 5 --stop] [--out results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


async def one_pass(tokenizer, n: int, steps: int, stop: list[str], kind: str) -> tuple[float, int]:
    from clusteropt_cli.core.serve.openai_routes import TokenStream
    from clusteropt_cli.core.serve.protocol import ChatBody, CompletionBody
    from clusteropt_cli.core.serve.requests import GenerationRequest, RequestHandle, _wake_all

    rng = random.Random(0)
    vocab = len(tokenizer)
    handles = [RequestHandle(GenerationRequest(prompt_ids=[1, 2, 3], max_new_tokens=steps), f"r{i}") for i in range(n)]
    if kind == "chat":
        body = ChatBody(model="m", messages=[{"role": "user", "content": "x"}], stream=True, stop=stop or None)
    else:
        body = CompletionBody(model="m", prompt=[1, 2, 3], stream=True, stop=stop or None)
    streams = [TokenStream([h], body, kind, logprobs=False, tokenizer=tokenizer, text_of=None,
                           served_model_name="m").events() for h in handles]
    sent = [0]

    async def consume(events) -> None:
        async for event in events:
            sent[0] += len(event)

    loop = asyncio.get_running_loop()
    tasks = [asyncio.ensure_future(consume(e)) for e in streams]
    await asyncio.sleep(0)
    tokens = [[rng.randrange(4, vocab) for _ in range(steps)] for _ in range(n)]
    from clusteropt_cli.core.serve.requests import GenerationResult

    t0 = time.thread_time()
    for step in range(steps):
        wakes: dict = {}
        for i, h in enumerate(handles):
            tok = tokens[i][step]
            if step == steps - 1:
                h._push([tok], GenerationResult(request_id=h.request_id, prompt_ids=[1, 2, 3],
                                                output_ids=tokens[i], finish_reason="length",
                                                text=tokenizer.decode(tokens[i], skip_special_tokens=True)),
                        wakes=wakes)
            elif hasattr(h, "_push_token"):  # what Engine._emit_one_each calls (an older tree: _push)
                h._push_token(tok, wakes)
            else:
                h._push([tok], wakes=wakes)
        _wake_all(wakes)
        for _ in range(3):  # the wake-up callback, then every consumer's turn
            await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    del loop
    return time.thread_time() - t0, sent[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kind", choices=["completion", "chat"], default="completion")
    parser.add_argument("--stop", action="store_true", help="each request has two stop strings (never hit)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from tests.fixture_models import build_fixtures

    tokenizer = AutoTokenizer.from_pretrained(str(build_fixtures().tokenizer))
    stop = ["\u00a7\u00a7\u00a7", "<<END>>"] if args.stop else []
    runs = []
    for _ in range(args.repeats):
        cpu, nbytes = asyncio.run(one_pass(tokenizer, args.requests, args.steps, stop, args.kind))
        runs.append(1e6 * cpu / (args.requests * args.steps))
    med = statistics.median(runs)
    print(f"{args.kind}, {args.requests} streams x {args.steps} tokens{', stop strings' if args.stop else ''}: "
          f"{med:.2f} us/token CPU (median of {args.repeats}: {', '.join(f'{r:.2f}' for r in runs)})")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "kind": args.kind, "stop": args.stop,
                                        "requests": args.requests, "steps": args.steps, "us_per_token": runs,
                                        "median_us_per_token": med}, indent=2))


if __name__ == "__main__":
    main()
