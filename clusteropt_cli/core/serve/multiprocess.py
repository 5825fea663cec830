"""The split server (`copt serve --api-server-count N`, N ≥ 1), as vLLM runs its API servers and engine core:

- the engine-core process (engine_core.py) runs the Engine: scheduling and device steps;
- N API-server processes run HTTP, auth, validation, tokenization, chat templates, detokenization and SSE, each an
  `EngineClient` (engine_client.py) talking to the engine core over ZeroMQ (msgpack messages, one per engine step);
- this process (the supervisor) binds the listening socket once and hands it to the API processes (they accept
  on it in turn, as vLLM's API-server workers do), waits for them, and stops them in order.

SIGTERM or Ctrl-C: the API processes drain (new requests get 503, in-flight ones finish within --grace-period),
then the engine core drains and stops; exit 0. When the engine core dies (killed, or a device error), the API
processes answer /health 503 and every request 500, then exit; the supervisor exits ENGINE_DEAD_EXIT. When an API
process dies, the others and the engine core are stopped and the supervisor exits non-zero. Children stop by
themselves when the supervisor disappears.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from clusteropt_cli.errors import CoptError

ENGINE_DEAD_EXIT = 1


def listening_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """One listening TCP socket for every API-server process (as uvicorn/vLLM bind it)."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), port))
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


def run_api_server(settings: Any, index: int, input_address: str, output_address: str, sock: socket.socket,
                   conn: Any, parent_pid: int, metrics_dir: str) -> None:
    """An API-server process (multiprocessing spawn target). It imports and loads the tokenizer while the engine
    core loads the model, then waits for the engine's facts on `conn`."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # before prometheus_client is imported: summed /metrics
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the supervisor, which sends SIGTERM
    signal.signal(signal.SIGTERM, lambda *a: os._exit(0))  # until the server's own handler is in place
    try:
        from clusteropt_cli.core.serve.engine_client import EngineClient, load_tokenizer
        from clusteropt_cli.core.serve.launch import server_limits
        from clusteropt_cli.core.serve.server import run_server

        tokenizer = load_tokenizer(settings.tokenizer or settings.model)
    except BaseException:  # noqa: BLE001 - reported to the supervisor
        import traceback

        conn.send(("crash", traceback.format_exc()))
        os._exit(1)
    try:
        message = conn.recv()  # ("info", the engine's facts) once the engine core is up
    except (EOFError, OSError):  # the supervisor is gone or gave up
        os._exit(0)
    client = EngineClient(message[1], index, input_address, output_address, parent_pid=parent_pid,
                          tokenizer=tokenizer)
    name = settings.served_model_name or settings.model

    def ready(url: str) -> None:
        conn.send(("ready", os.getpid()))
        conn.close()

    code = run_server(client, host=settings.host, port=settings.port, served_model_name=name,
                      api_key=settings.api_key, grace_period=settings.grace_period, on_ready=ready,
                      limits=server_limits(settings), sockets=[sock], signals=(signal.SIGTERM,))
    sys.stderr.flush()
    os._exit(code)


def _await_ready(conn: Any, proc: Any, what: str, stop: list[int]) -> Any:
    """The child's ready payload; its load error raised here (with the exit code it carries)."""
    from multiprocessing.connection import wait

    while True:
        if stop:
            raise _Stopped()
        ready = wait([conn, proc.sentinel], timeout=0.2)
        if stop:  # SIGTERM / Ctrl-C while starting (the children were told to stop)
            raise _Stopped()
        if conn in ready:
            try:
                message = conn.recv()
            except EOFError:
                message = None
            if message is not None and message[0] == "ready":
                return message[1]
            if message is not None and message[0] == "error":
                raise CoptError(message[1], message[2], exit_code=message[3])
            if message is not None:
                raise RuntimeError(f"the {what} process failed to start:\n{message[1]}")
            proc.join(5)
            raise RuntimeError(f"the {what} process exited while starting (exit status {proc.exitcode})")
        if proc.sentinel in ready:
            proc.join(1)
            raise RuntimeError(f"the {what} process exited while starting (exit status {proc.exitcode})")


class _Stopped(Exception):
    pass


def _announce_dead(addresses: list[str], message: str) -> None:
    """Tell every API process that the engine is gone (the engine core cannot: it is dead)."""
    import zmq

    from clusteropt_cli.core.serve.ipc import pack

    ctx = zmq.Context()
    try:
        for address in addresses:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(address)
            sock.send(pack(["dead", message]))
            sock.close()
    finally:
        ctx.term()


def _stop(procs: list[Any], sig: int | None, timeout: float) -> None:
    """Signal (sig None: only wait for) the processes; kill what is left after `timeout` seconds."""
    for p in procs:
        if sig is not None and p.is_alive():
            try:
                os.kill(p.pid, sig)
            except ProcessLookupError:
                pass
    deadline = time.time() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.time()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


def _describe(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def serve_split(settings: Any, on_ready: Callable[[str, dict], None] | None = None) -> int:
    """Start the engine core and settings.api_server_count API processes; serve until SIGTERM/SIGINT; return the
    exit status (0 after a drain, ENGINE_DEAD_EXIT when the engine died, non-zero when an API process died)."""
    import multiprocessing as mp
    import shutil
    import tempfile
    from multiprocessing.connection import wait

    from clusteropt_cli.core.serve.engine_core import run_engine_core

    ctx = mp.get_context("spawn")
    count = settings.api_server_count
    sock = listening_socket(settings.host, settings.port)
    ipc_dir = tempfile.mkdtemp(prefix=f"copt-serve-{os.getpid()}-")
    input_address = f"ipc://{ipc_dir}/engine-in"
    outputs = [f"ipc://{ipc_dir}/api-{i}-out" for i in range(count)]
    metrics_dir = os.path.join(ipc_dir, "metrics")
    os.mkdir(metrics_dir)
    stop: list[int] = []
    apis: list[Any] = []
    core: Any = None

    def on_signal(signum: int, frame: Any) -> None:
        stop.append(signum)
        for p in apis:  # a second signal: the API processes stop without waiting (uvicorn's force exit)
            if p.is_alive():
                try:
                    os.kill(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        parent, child = ctx.Pipe(duplex=False)
        core = ctx.Process(target=run_engine_core, name="copt-engine-core",
                           args=(settings, input_address, outputs, child, os.getpid()))
        core.start()
        child.close()
        conns = []
        for i in range(count):  # they import and load the tokenizer while the engine core loads the model
            parent_api, child_api = ctx.Pipe(duplex=True)
            p = ctx.Process(target=run_api_server, name=f"copt-api-server-{i}",
                            args=(settings, i, input_address, outputs[i], sock, child_api, os.getpid(),
                                  metrics_dir))
            p.start()
            child_api.close()
            apis.append(p)
            conns.append(parent_api)
        ready = _await_ready(parent, core, "engine core", stop)
        info, client_info = ready["info"], ready["client"]
        for conn in conns:
            try:
                conn.send(("info", client_info))
            except OSError:  # that API process failed to start: _await_ready reports why
                pass
        for i, (p, conn) in enumerate(zip(apis, conns, strict=True)):
            _await_ready(conn, p, f"API server {i}", stop)
        port = sock.getsockname()[1]
        sock.close()  # the API processes hold it now; once they close theirs (drain), connections are refused
        if on_ready is not None:
            host = settings.host if ":" not in settings.host else f"[{settings.host.strip('[]')}]"
            on_ready(f"http://{host}:{port}",
                     {**info, "api_server_count": count, "engine_core_pid": core.pid,
                      "api_server_pids": [p.pid for p in apis]})
        while not stop:
            done = wait([core.sentinel] + [p.sentinel for p in apis], timeout=0.2)
            if not done or stop:  # (a signal: the API processes are draining and exit 0)
                continue
            if core.sentinel in done:
                core.join(1)
                reason = f"the engine-core process stopped ({_describe(core.exitcode)})"
                sys.stderr.write(f"copt serve: {reason}; the API servers answer 503 and exit\n")
                _announce_dead(outputs, reason)
                _stop(apis, None, settings.grace_period + 10)
                return ENGINE_DEAD_EXIT
            gone = next(p for p in apis if p.sentinel in done)
            gone.join(1)
            sys.stderr.write(f"copt serve: {gone.name} stopped ({_describe(gone.exitcode)}); stopping the server\n")
            _stop([p for p in apis if p is not gone], signal.SIGTERM, settings.grace_period + 10)
            _stop([core], signal.SIGTERM, settings.grace_period + 10)
            return gone.exitcode if gone.exitcode and gone.exitcode > 0 else ENGINE_DEAD_EXIT
        # drain: the API processes finish their requests (they got SIGTERM from on_signal), then the engine core
        _stop(apis, None, settings.grace_period + 10)
        _stop([core], signal.SIGTERM, settings.grace_period + 10)
        codes = [p.exitcode for p in apis] + [core.exitcode]
        bad = [c for c in codes if c != 0]
        if bad:
            sys.stderr.write(f"copt serve: a process did not stop cleanly ({', '.join(map(_describe, bad))})\n")
        return 0 if not bad else 1
    except _Stopped:
        return 130 if signal.SIGINT in stop else 0
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        leftovers = [p for p in apis + ([core] if core is not None else []) if p.is_alive()]
        if leftovers:
            _stop(leftovers, signal.SIGTERM, 5)
        sock.close()
        shutil.rmtree(ipc_dir, ignore_errors=True)
