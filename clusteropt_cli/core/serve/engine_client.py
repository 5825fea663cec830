"""The engine as an API-server process of the split server sees it (`copt serve --api-server-count N`): the
engine's public API (validate, submit, handles to iterate, await and cancel, stats, close_admission, error,
tokenizer, eos ids, max_model_len) over ZeroMQ to the engine-core process (engine_core.py; wire format in ipc.py).

Everything runs on the API process's event loop: requests are validated here (Engine.validate on the facts the
engine core reported: a bad request gets its 400 before it is sent), submitted with one message per HTTP request,
and the engine core's per-step messages are dispatched to the handles by one reader task.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from types import SimpleNamespace
from typing import Any

from clusteropt_cli.core.serve.engine import Engine, EngineStats
from clusteropt_cli.core.serve.ipc import (
    logprob_entry,
    pack,
    request_to_wire,
    result_from_wire,
    stats_from_wire,
    unpack,
)
from clusteropt_cli.core.serve.requests import (
    EngineDeadError,
    EngineObserver,
    EngineStoppedError,
    GenerationRequest,
    GenerationResult,
    InvalidRequestError,
    QueueFullError,
)
from clusteropt_cli.errors import BadInputError


def load_tokenizer(model: str) -> Any:
    """The tokenizer the engine loads (Engine.load: AutoTokenizer of the model directory)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return AutoTokenizer.from_pretrained(model)


class WireGrammar:
    """A grammar compiled here (so that a bad schema gets its 400 at once) and sent to the engine core as its
    spec (the engine core compiles it again against its own tokenizer info; xgrammar caches)."""

    def __init__(self, spec: list, compiled: Any):
        self.spec, self.compiled = spec, compiled


class RemoteHandle:
    """A request running in the engine-core process (the RequestHandle interface the routes use)."""

    def __init__(self, client: EngineClient, request: GenerationRequest, request_id: str):
        self.client = client
        self.request = request
        self.request_id = request_id
        self.logprobs: dict[int, Any] = {}
        self._chunks: list[int] = []
        self._count = 0
        self._result: GenerationResult | None = None
        self._cancelled = False
        self._event = asyncio.Event()  # streaming consumer
        self._done = asyncio.Event()  # result waiters
        self._t_submit = time.perf_counter()
        self._t_last: float | None = None
        self._t_first: float | None = None  # when the first tokens and the result reached this process
        self._t_final: float | None = None

    # engine-core side (the client's reader task)
    def _add(self, ids: list[int], lps: list | None, now: float, observer: EngineObserver) -> None:
        if lps is not None:
            for i, e in enumerate(lps):
                if e is not None:
                    self.logprobs[self._count + i] = logprob_entry(e)
        self._count += len(ids)
        self._chunks.extend(ids)
        try:
            if self._t_last is None:
                self._t_first = now
                observer.on_first_token(now - self._t_submit)
                if len(ids) > 1:
                    observer.on_tokens(0.0, len(ids) - 1)
            else:
                observer.on_tokens((now - self._t_last) / len(ids), len(ids))
        except Exception:  # noqa: BLE001 - metrics must never break generation
            pass
        self._t_last = now
        self._event.set()

    def _finish(self, result: GenerationResult) -> None:
        self._result = result
        self._event.set()
        self._done.set()

    # the routes' side
    @property
    def done(self) -> bool:
        return self._result is not None

    def cancel(self) -> None:
        if self._result is None and not self._cancelled:
            self._cancelled = True
            self.client._abort(self.request_id)

    def result(self, timeout: float | None = None) -> GenerationResult:
        if self._result is None:
            raise TimeoutError(f"request {self.request_id} has not finished")
        return self._result

    async def wait(self) -> GenerationResult:
        await self._done.wait()
        return self._result

    async def __aiter__(self):
        while True:
            if self._chunks:
                chunk, self._chunks = self._chunks, []
                yield chunk
                continue
            if self._result is not None:
                return
            self._event.clear()
            await self._event.wait()


class EngineClient:
    """Engine-shaped front of the engine-core process for one API-server process."""

    remote = True
    _validate_request_tensors = Engine._validate_request_tensors

    def validate(self, request: GenerationRequest) -> None:
        """Engine.validate on the facts the engine core reported (the engine core validates again at submit)."""
        try:
            Engine.validate(self, request)
        except AttributeError:  # a check that needs the engine itself: the engine core's submit runs it (400 too)
            pass

    def __init__(self, info: dict[str, Any], index: int, input_address: str, output_address: str,
                 parent_pid: int | None = None, tokenizer: Any = None):
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(info["tokenizer"])
        self.model_name = info["model_name"]
        self.max_model_len = int(info["max_model_len"])
        self.eos_ids = set(info["eos_ids"])
        self.sampling_defaults = info.get("sampling_defaults") or {}
        self.runner = SimpleNamespace(vocab_size=int(info["vocab_size"]))
        self.config = SimpleNamespace(model=info["tokenizer"])
        self.max_request_sequences = info.get("max_request_sequences")
        self.index = index
        self.input_address, self.output_address = input_address, output_address
        self.parent_pid = parent_pid
        self.observer = EngineObserver()
        self.stats = EngineStats()
        self.error: str | None = None
        self._accepting = True
        self._handles: dict[str, RemoteHandle] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._rids = itertools.count()
        self._aborts: list[str] = []
        self._tasks: list[asyncio.Task] = []
        self._ctx = self._dealer = self._pull = None

    # ---- lifecycle (run_server calls attach on its event loop, stop at the end) -------------------------
    async def attach(self) -> None:
        import zmq
        import zmq.asyncio

        self._loop = asyncio.get_running_loop()
        self._ctx = zmq.asyncio.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.bind(self.output_address)
        self._sync_ctx = zmq.Context()
        self._dealer = self._sync_ctx.socket(zmq.DEALER)  # sends only, never blocks (no high-water mark)
        self._dealer.setsockopt(zmq.IDENTITY, str(self.index).encode())
        self._dealer.setsockopt(zmq.SNDHWM, 0)
        self._dealer.setsockopt(zmq.LINGER, 1000)
        self._dealer.connect(self.input_address)
        self._tasks = [asyncio.ensure_future(self._read()), asyncio.ensure_future(self._watch_parent())]

    def stop(self, timeout: float | None = None) -> None:
        for task in self._tasks:
            task.cancel()
        for sock in (self._pull, self._dealer):
            if sock is not None:
                sock.close(linger=0 if sock is self._pull else 1000)
        for ctx in (self._ctx, getattr(self, "_sync_ctx", None)):
            if ctx is not None:
                ctx.term()

    def close_admission(self) -> None:
        self._accepting = False

    @property
    def idle(self) -> bool:
        return not self._handles

    def is_dead(self) -> bool:
        return self.error is not None

    # ---- requests ---------------------------------------------------------------------------------------
    def _send(self, message: list) -> None:
        self._dealer.send(pack(message))

    def _abort(self, rid: str) -> None:
        if not self._aborts:
            self._loop.call_soon(self._flush_aborts)
        self._aborts.append(rid)

    def _flush_aborts(self) -> None:
        rids, self._aborts = self._aborts, []
        if rids and self.error is None:
            self._send(["abort", rids])

    async def submit_many(self, requests: list[GenerationRequest]) -> list[RemoteHandle]:
        """Validate here, submit all (n > 1 choices of one prompt share its prefill), wait for the engine core's
        admission; raises what Engine.submit raises."""
        if self.error is not None:
            raise EngineDeadError(f"The engine failed: {self.error}", hint="Restart the server.")
        if not self._accepting:
            raise EngineStoppedError("The engine is not accepting requests (draining).", hint="Retry later.")
        for req in requests:
            self.validate(req)
        handles, wires, shares = [], [], []
        first: dict[tuple[int, ...], int] = {}
        for i, req in enumerate(requests):
            rid = f"{self.index}-{next(self._rids)}"
            handle = RemoteHandle(self, req, rid)
            handles.append(handle)
            grammar = req.grammar.spec if isinstance(req.grammar, WireGrammar) else None
            wires.append(request_to_wire(req, rid, grammar))
            key = tuple(req.prompt_ids)
            shares.append(first.get(key))
            first.setdefault(key, i)
        call = next(self._call_ids)
        future = self._loop.create_future()
        self._calls[call] = future
        for h in handles:
            self._handles[h.request_id] = h
        try:
            self._send(["submit", call, wires, shares])
            error = await future
        except asyncio.CancelledError:  # the client went away while the engine core admitted the requests
            for h in handles:
                self._handles.pop(h.request_id, None)
            if self.error is None:
                self._send(["abort", [h.request_id for h in handles]])
            raise
        finally:
            self._calls.pop(call, None)
        if error is None:
            return handles
        for h in handles:
            self._handles.pop(h.request_id, None)
        kind, message, param = error["kind"], error["message"], error.get("param")
        if kind == "dead":
            raise EngineDeadError(message, hint="Restart the server.")
        if kind == "stopped":
            raise EngineStoppedError(message, hint="Retry later.")
        if kind == "queue_full":
            raise QueueFullError(message, hint="Retry later or raise --max-queue.")
        if kind == "error":  # an internal error of the engine core (the app answers 500)
            raise RuntimeError(f"the engine core failed to admit the request: {message}")
        if param:
            raise InvalidRequestError(message, param)
        raise BadInputError(message)

    async def refresh_stats(self, timeout: float = 5.0) -> None:
        """Fetch the engine core's stats (for /metrics)."""
        if self.error is not None:
            return
        call = next(self._call_ids)
        future = self._loop.create_future()
        self._calls[call] = future
        try:
            self._send(["stats", call])
            self.stats = stats_from_wire(await asyncio.wait_for(future, timeout))
        except TimeoutError:
            pass
        finally:
            self._calls.pop(call, None)

    # ---- the reader task ----------------------------------------------------------------------------------
    async def _read(self) -> None:
        flushed = time.monotonic()
        while True:
            data = await self._pull.recv()
            try:
                self._dispatch(unpack(data))
                if time.monotonic() - flushed > 1.0:
                    flushed = time.monotonic()
                    flush = getattr(self.observer, "flush", None)
                    if flush is not None:
                        flush()
            except Exception:  # noqa: BLE001 - one bad message must not stop every stream of this process
                import traceback

                traceback.print_exc()

    def _dispatch(self, message: list) -> None:
        kind = message[0]
        if kind == "out":
            self._deliver(message[1])
        elif kind in ("ack", "stats"):
            future = self._calls.get(message[1])
            if future is not None and not future.done():
                future.set_result(message[2])
        elif kind == "dead":
            self._die(message[1])

    def _deliver(self, deltas: list) -> None:
        now = time.perf_counter()
        observer = self.observer
        handles = self._handles
        for rid, ids, lps, final in deltas:
            handle = handles.get(rid)
            if handle is None:
                continue
            if ids:
                handle._add(ids, lps, now, observer)
            if final is not None:
                del handles[rid]
                result = result_from_wire(final, rid, handle.request.prompt_ids)
                result.latency_s = now - handle._t_submit  # as the API process saw it
                handle._t_final = now
                handle._finish(result)
                try:
                    observer.on_finish(result)
                except Exception:  # noqa: BLE001 - metrics must never break generation
                    pass

    def _die(self, message: str) -> None:
        """The engine is gone: every request in flight ends with an error, new ones are refused."""
        if self.error is not None:
            return
        self.error = message.removeprefix("The engine failed: ")  # (/health and the errors say it)
        message = f"The engine failed: {self.error}"
        self._accepting = False
        for rid, handle in list(self._handles.items()):
            handle._finish(GenerationResult(request_id=rid, prompt_ids=handle.request.prompt_ids,
                                            output_ids=[], finish_reason="error", error=message))
        self._handles.clear()
        dead = {"kind": "dead", "message": f"The engine failed: {message}", "param": None}
        for future in self._calls.values():
            if not future.done():
                future.set_result(dead)

    async def _watch_parent(self) -> None:
        while self.parent_pid is not None:
            if os.getppid() != self.parent_pid:
                self._die("the server's supervisor process exited")
                return
            await asyncio.sleep(0.5)
