"""The engine-core process of the split server (`copt serve --api-server-count N`): the Engine (scheduling and
device steps) behind ZeroMQ, for API-server processes that do HTTP, tokenization and detokenization (as vLLM's
EngineCoreProc does).

Threads: the engine's own scheduler thread; the main thread reads the API processes' messages (submit, abort,
stats) from one ROUTER socket; a sender thread sends one message per engine step phase and API process with the
new tokens of every request of that process the phase touched (the engine wakes the sender after a step's decode
and after its prefill, through the wake-up it gives asyncio consumers, RequestHandle.add_step_listener). The wire
format is in ipc.py.

SIGTERM drains (no new requests; running ones finish within the grace period) and exits 0; SIGINT is left to the
supervisor. A dead engine (device error) is announced to every API process, then the process exits
ENGINE_DEAD_EXIT. When the supervisor goes away the process stops (no orphans).
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
import traceback
from typing import Any

from clusteropt_cli.core.serve.ipc import (
    pack,
    request_from_wire,
    result_to_wire,
    stats_to_wire,
    unpack,
)
from clusteropt_cli.core.serve.requests import (
    EngineDeadError,
    EngineStoppedError,
    QueueFullError,
    frozen_startup_heap,
)
from clusteropt_cli.errors import BadInputError, CoptError

ENGINE_DEAD_EXIT = 1


class _Entry:
    """One request of one API process, as the engine core tracks it."""

    __slots__ = ("rid", "client", "handle", "sent_lp", "logprobs", "finished")

    def __init__(self, rid: str, client: int, handle: Any, logprobs: bool):
        self.rid, self.client, self.handle, self.logprobs = rid, client, handle, logprobs
        self.sent_lp = 0
        self.finished = False


class _StepLoop:
    """Stands in for an event loop in the engine's wake-ups: the engine calls call_soon_threadsafe once per step
    phase with every handle the phase touched; that becomes one batch for the sender thread."""

    def __init__(self, outbox: queue.SimpleQueue):
        self.outbox = outbox
        self.pending: list[_Entry] = []

    def call_soon_threadsafe(self, callback: Any, *args: Any) -> None:
        callback(*args)
        batch, self.pending = self.pending, []
        if batch:
            self.outbox.put(("batch", batch))


class _Listener:
    __slots__ = ("entry", "loop")

    def __init__(self, entry: _Entry, loop: _StepLoop):
        self.entry, self.loop = entry, loop

    def is_set(self) -> bool:
        return False

    def set(self) -> None:
        self.loop.pending.append(self.entry)


class EngineCore:
    def __init__(self, engine: Any, input_address: str, output_addresses: list[str], grace_period: float,
                 parent_pid: int | None = None, dead_linger_s: float = 1.0):
        import zmq

        self.engine = engine
        self.grace_period = grace_period
        self.parent_pid = parent_pid
        self.dead_linger_s = dead_linger_s
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.RCVHWM, 0)
        self.router.bind(input_address)
        self.pushes = []
        for address in output_addresses:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(address)
            self.pushes.append(sock)
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.step_loop = _StepLoop(self.outbox)
        self.entries: dict[str, _Entry] = {}
        self.draining = False
        self.drain_deadline = 0.0
        self._announced = False
        self._sender = threading.Thread(target=self._send_loop, name="copt-engine-out", daemon=True)

    # ---- the sender thread ---------------------------------------------------------------------------------
    def _delta(self, entry: _Entry) -> list | None:
        if entry.finished:
            return None
        ids, result = entry.handle.take()
        if not ids and result is None:
            return None
        lps = None
        if entry.logprobs and ids:
            got = entry.handle.logprobs
            lps = [got.get(entry.sent_lp + i) for i in range(len(ids))]
            entry.sent_lp += len(ids)
        final = None
        if result is not None:
            entry.finished = True
            self.entries.pop(entry.rid, None)
            final = result_to_wire(result)
        return [entry.rid, ids, lps, final]

    def _send_loop(self) -> None:
        import zmq

        while True:
            items = [self.outbox.get()]
            while True:  # everything queued meanwhile goes out in the same messages (fewer, larger when behind)
                try:
                    items.append(self.outbox.get_nowait())
                except queue.Empty:
                    break
            per_client: dict[int, list] = {}
            messages: list[tuple[int, Any]] = []
            stop = False
            for item in items:
                kind = item[0]
                if kind == "batch":
                    for entry in item[1]:
                        try:
                            delta = self._delta(entry)
                        except Exception:  # noqa: BLE001 - (a result that does not encode) that request alone
                            traceback.print_exc()
                            continue
                        if delta is not None:
                            per_client.setdefault(entry.client, []).append(delta)
                elif kind == "msg":
                    messages.append((item[1], item[2]))
                elif kind == "stop":
                    stop = True
            outgoing: list[tuple[int, list]] = []
            if self.engine.error is not None and not self._announced:
                # before the failed requests' results: the API processes answer them as the engine's death
                self._announced = True
                outgoing += [(c, ["dead", self._dead_reason()]) for c in range(len(self.pushes))]
            outgoing += [(client, ["out", deltas]) for client, deltas in per_client.items()]
            for client, message in messages:
                outgoing += [(c, message) for c in (range(len(self.pushes)) if client is None else [client])]
            for client, message in outgoing:
                try:
                    self.pushes[client].send(pack(message), zmq.NOBLOCK)
                except Exception:  # noqa: BLE001 - one message or one API process: never the others, never stop
                    traceback.print_exc()
            if stop:
                return

    # ---- the main thread -------------------------------------------------------------------------------------
    def _reply(self, client: int | None, message: list) -> None:
        self.outbox.put(("msg", client, message))

    def _submit(self, client: int, call: int, wires: list[dict], shares: list[int | None]) -> None:
        engine = self.engine
        handles: list[Any] = []
        entries: list[_Entry] = []
        try:
            if self.draining:
                raise EngineStoppedError("The server is shutting down.")
            for wire, share in zip(wires, shares, strict=True):
                request, spec = request_from_wire(wire)
                if spec is not None:
                    request.grammar = self._grammar(spec)
                leader = handles[share] if share is not None and share < len(handles) else None
                handle = engine.submit(request, share_prompt_with=leader)
                handles.append(handle)
                entries.append(_Entry(handle.request_id, client, handle, request.logprobs is not None))
        except (BadInputError, QueueFullError, EngineStoppedError) as exc:
            for h in handles:
                h.cancel()
            kind = ("dead" if isinstance(exc, EngineDeadError) else "stopped" if isinstance(exc, EngineStoppedError)
                    else "queue_full" if isinstance(exc, QueueFullError) else "bad")
            self._reply(client, ["ack", call, {"kind": kind, "message": exc.message,
                                               "param": getattr(exc, "param", None)}])
            return
        except Exception as exc:  # noqa: BLE001 - never leave the API process waiting for its answer
            traceback.print_exc()
            for h in handles:
                h.cancel()
            self._reply(client, ["ack", call, {"kind": "error", "message": f"{type(exc).__name__}: {exc}",
                                               "param": None}])
            return
        for entry in entries:
            self.entries[entry.rid] = entry
            entry.handle.add_step_listener(self.step_loop, _Listener(entry, self.step_loop))
        self._reply(client, ["ack", call, None])
        self.outbox.put(("batch", entries))  # tokens pushed before the listener was there

    def _grammar(self, spec: list) -> Any:
        from clusteropt_cli.core.serve.structured import GrammarCompiler, response_format_grammar, tool_grammar

        compiler = getattr(self, "_compiler", None)
        if compiler is None:
            engine = self.engine
            compiler = self._compiler = GrammarCompiler(engine.tokenizer, engine.runner.vocab_size, engine.eos_ids)
        if spec[0] == "tools":
            _, functions, mode, parallel = spec
            return tool_grammar(functions, mode, compiler, parallel=parallel)
        return response_format_grammar(spec[1], compiler)

    def _handle(self, identity: bytes, data: bytes) -> None:
        message = unpack(data)
        kind = message[0]
        client = int(identity)
        if kind == "submit":
            self._submit(client, message[1], message[2], message[3])
        elif kind == "abort":
            for rid in message[1]:
                entry = self.entries.get(rid)
                if entry is not None:
                    entry.handle.cancel()
        elif kind == "stats":
            self._reply(client, ["stats", message[1], stats_to_wire(self.engine.stats)])

    def drain(self) -> None:
        self._drain(signal.SIGTERM, None)

    def _drain(self, signum: int, frame: Any) -> None:
        if not self.draining:
            self.draining = True
            self.drain_deadline = time.time() + self.grace_period
            self.engine.close_admission()

    def _dead_reason(self) -> str:
        error = self.engine.error
        return f"The engine failed: {type(error).__name__}: {error}" if error is not None else \
            "The engine failed: its thread is gone"

    def run(self, install_signals: bool = True) -> int:
        """Serve until drained (0), the engine died (ENGINE_DEAD_EXIT) or the supervisor went away. SIGTERM drains
        (install_signals False: call drain() instead)."""
        import zmq

        if install_signals:
            signal.signal(signal.SIGTERM, self._drain)
        self._sender.start()
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        code = 0
        try:
            while True:
                if poller.poll(100):
                    while True:
                        try:
                            identity, data = self.router.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        try:
                            self._handle(identity, data)
                        except Exception:  # noqa: BLE001 - a malformed message must not stop the engine
                            traceback.print_exc()
                if self._engine_dead():
                    reason = self._dead_reason()
                    sys.stderr.write(f"copt serve (engine core): {reason}\n")
                    self._reply(None, ["dead", reason])
                    time.sleep(self.dead_linger_s)
                    code = ENGINE_DEAD_EXIT
                    break
                if self.parent_pid is not None and os.getppid() != self.parent_pid:
                    sys.stderr.write("copt serve (engine core): the supervisor is gone; stopping\n")
                    code = ENGINE_DEAD_EXIT
                    break
                if self.draining and ((self.engine.idle and not self.entries) or time.time() > self.drain_deadline):
                    break
        finally:
            self.engine.stop()
            self.outbox.put(("batch", list(self.entries.values())))  # the aborted requests' final results
            self.outbox.put(("stop",))
            self._sender.join(5)
            self.router.close(0)
            for sock in self.pushes:
                sock.close()
            self.ctx.term()
        return code

    def _engine_dead(self) -> bool:
        thread = self.engine._thread
        return self.engine.error is not None or (thread is not None and not thread.is_alive())


def engine_info(engine: Any, settings: Any) -> dict[str, Any]:
    """What `copt serve` reports at start (and what an API process needs to know of the engine)."""
    name = settings.served_model_name or settings.model
    speculation = (f"draft model {settings.draft_model}" if settings.draft_model else
                   f"prompt lookup (n ≤ {settings.prompt_lookup})" if settings.prompt_lookup else "off")
    if settings.draft_model or settings.prompt_lookup:
        speculation += f", k={settings.num_speculative_tokens}, while ≤ {settings.speculative_max_batch} run"
    pool = getattr(engine, "pool", None)
    return {"model": name, "device": engine.device, "kv_cache_slots": engine.num_slots,
            "kv_layout": "paged" if pool is not None else "slots",
            "kv_cache_blocks": None if pool is None else pool.num_blocks,
            "kv_block_size": None if pool is None else pool.block_size,
            "max_model_len": engine.max_model_len, "kv_cache_bytes": engine.kv_cache_bytes,
            "max_batch_tokens": engine.max_batch_tokens, "cuda_graphs": engine.stats.graphs_captured,
            "prefill_graphs": engine.stats.prefill_graphs,
            "speculation": speculation,
            "fp8_linears": {"count": engine.runner.fp8_linears,
                            "kernel": "scaled_mm" if engine.runner.fp8_kernels else "emulated"},
            "merged_projections": engine.runner.fused_projections,
            "decode_attention": engine.runner.decode_attention,
            "attention": engine.runner.attention_path}


def client_info(engine: Any) -> dict[str, Any]:
    """The engine facts an API process validates and tokenizes with."""
    return {"tokenizer": engine.config.tokenizer or engine.config.model, "model_name": engine.model_name,
            "max_model_len": engine.max_model_len,
            "vocab_size": int(engine.runner.vocab_size), "eos_ids": sorted(int(i) for i in engine.eos_ids),
            "sampling_defaults": dict(getattr(engine, "sampling_defaults", None) or {}),
            "max_request_sequences": int(engine.max_request_sequences)}


def run_engine_core(settings: Any, input_address: str, output_addresses: list[str], conn: Any,
                    parent_pid: int) -> None:
    """The engine-core process (multiprocessing spawn target): load, report ready (or the error) on `conn`, serve."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the supervisor, which drains in order
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))  # while loading: just stop
    try:
        from clusteropt_cli.core.serve.engine import Engine

        sys.setswitchinterval(0.001)
        engine = Engine.from_settings(settings)
        engine.start()
        core = EngineCore(engine, input_address, output_addresses, settings.grace_period, parent_pid)
        conn.send(("ready", {"info": engine_info(engine, settings), "client": client_info(engine)}))
    except BaseException as exc:  # noqa: BLE001 - reported to the supervisor, which raises it
        from clusteropt_cli.errors import map_exception

        mapped = exc if isinstance(exc, CoptError) else map_exception(exc)
        if mapped is not None:
            conn.send(("error", mapped.message, mapped.hint, mapped.exit_code))
        else:
            conn.send(("crash", "".join(traceback.format_exception(exc)), None, 1))
        conn.close()
        return
    conn.close()
    with frozen_startup_heap():
        code = core.run()
    if os.getppid() != parent_pid and input_address.startswith("ipc://"):
        # the supervisor was killed: its temporary folder (sockets, metrics) is left to the last one out
        import shutil

        time.sleep(1.0)  # the API processes notice within 0.5 s and exit
        shutil.rmtree(os.path.dirname(input_address.removeprefix("ipc://")), ignore_errors=True)
    sys.stderr.flush()
    os._exit(code)  # the engine's daemon threads (compile workers, …) must not hold the exit
