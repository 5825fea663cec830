"""Where a streamed request's time goes in an API-server process (a diagnostic, like the engine's StepTrace:
`COPT_API_TRACE=<folder>` makes every API process of `copt serve` record its streamed requests and its event loop's
lag, and write them to <folder>/api-trace-<pid>.json when it stops).

A request: [entered, submitted, first token in, first event out, result in, last event out, request id, body read,
parsed, prompt encoded] — entered: the HTTP request reached the app (its body not yet read); submitted: handed to the
engine; in: the engine's tokens or result reached this process; out: the event was handed to the HTTP server; body
read; parsed: the request checked; prompt encoded: its token ids ready (tokenized, or the chat template rendered). A
lag sample: [time, seconds a 10 ms sleep of the event loop overran]. A prompt-encoder batch: [its first text queued,
started, ended, texts] (batch_encoder.py). Times are time.perf_counter() seconds (CLOCK_MONOTONIC: comparable with
the engine trace's and the clients' on one machine); `clock` pairs one with time.time(). Ids match the engine
trace's.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from typing import Any

LAG_PERIOD_S = 0.01
MAX_ENTRIES = 1_000_000  # requests and lag samples kept each; a long-running server keeps its first ones


class ApiTrace:
    def __init__(self, folder: str):
        self.folder = folder
        self.clock = (time.time(), time.perf_counter())
        self.requests: list[tuple] = []
        self.lag: list[tuple[float, float]] = []
        self.encoder_batches: list[tuple[float, float, float, int]] = []

    @classmethod
    def from_env(cls) -> ApiTrace | None:
        folder = os.environ.get("COPT_API_TRACE")
        return cls(folder) if folder else None

    def record(self, handles: list[Any], stamps: dict[str, float], first_out: float | None, last_out: float) -> None:
        if len(self.requests) >= MAX_ENTRIES:
            return
        for h in handles:
            self.requests.append((stamps.get("entered"), getattr(h, "_t_submit", None), getattr(h, "_t_first", None),
                                  first_out, getattr(h, "_t_final", None), last_out, h.request_id,
                                  stamps.get("body"), stamps.get("parsed"), stamps.get("encoded")))

    def encoder_batch(self, queued: float, started: float, ended: float, texts: int) -> None:
        if len(self.encoder_batches) < MAX_ENTRIES:
            self.encoder_batches.append((queued, started, ended, texts))

    async def traced(self, events: AsyncIterator[str], handles: list[Any],
                     stamps: dict[str, float]) -> AsyncIterator[str]:
        """`events` passed through, the request recorded once they end (`stamps`: its intake's times by name)."""
        first_out = None
        async for event in events:
            if first_out is None:
                first_out = time.perf_counter()
            yield event
        self.record(handles, stamps, first_out, time.perf_counter())

    async def watch_loop(self) -> None:
        """Sample how late the event loop wakes from a short sleep (a busy loop delays every stream and request)."""
        while True:
            t = time.perf_counter()
            await asyncio.sleep(LAG_PERIOD_S)
            if len(self.lag) < MAX_ENTRIES:
                self.lag.append((t, time.perf_counter() - t - LAG_PERIOD_S))

    def write(self) -> None:
        """Write the trace (a folder that cannot be written is reported on stderr; stopping goes on)."""
        from clusteropt_cli.core.io import write_diagnostic_json

        write_diagnostic_json(os.path.join(self.folder, f"api-trace-{os.getpid()}.json"),
                              {"clock": self.clock, "requests": self.requests, "lag": self.lag,
                               "encoder_batches": self.encoder_batches}, "API trace")
