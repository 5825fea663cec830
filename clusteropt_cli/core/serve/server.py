"""The OpenAI-compatible HTTP server around the engine (FastAPI + uvicorn).

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (SSE streaming with `data: [DONE]`),
GET /health, GET /metrics (Prometheus). Errors use OpenAI's JSON shape. SIGTERM stops accepting new work,
lets in-flight requests finish within the grace period, then the process exits 0.

One client cannot hurt the others: bodies are capped (413) and read with a timeout, JSON parsing, chat templates
and tokenization run on worker threads (the event loop only moves bytes), every request field that reaches a
tensor is validated before admission (400 naming the field), a request that fails inside an engine step fails alone
(500), and an unrecoverable device error marks the engine dead (/health 503, every request 500) and the process
exits with status 1 so a supervisor restarts it. Connections that send no complete request head within the read
timeout, or whose body comes slower than that allows, are closed; a connection that stops reading its response (the
socket's buffers full) for the write timeout is cut and its requests cancelled; connections beyond --max-connections
are closed at once.

This module builds the app (auth, body limits, error handlers, /health, /metrics) and runs the server;
openai_routes.py holds the OpenAI endpoints.
"""


import asyncio
import hmac
import socket
import struct
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from clusteropt_cli.core.serve.api_trace import ApiTrace
from clusteropt_cli.core.serve.engine import Engine
from clusteropt_cli.core.serve.requests import (
    EngineObserver,
    GenerationResult,
    frozen_startup_heap,
)

ENGINE_DEAD_EXIT = 1  # the engine died of a device error: non-zero so that a supervisor restarts the server
# a request body must arrive within --read-timeout plus one second per this many bytes received (Apache's
# mod_reqtimeout MinRate): a body trickled a byte per piece would otherwise hold its connection for ever
BODY_MIN_BYTES_PER_S = 16 * 1024


@dataclass
class ServerLimits:
    """What one request or connection may cost the server (defaults: ServeRecipe)."""

    max_request_bytes: int = 16 * 2**20
    max_prompt_chars: int | None = None  # None: 64 characters per token of --max-model-len
    trust_request_chat_template: bool = False
    metrics_public: bool = False
    read_timeout: float = 30.0  # seconds to send the headers, between two pieces of the body (whole body: + 1 s/16 KiB)
    max_connections: int | None = None  # None: from the open-file limit
    write_timeout: float = 30.0  # seconds a client may leave the response unread (the send buffers full)

    def prompt_chars(self, max_model_len: int) -> int:
        return self.max_prompt_chars or max(65_536, 64 * max_model_len)


TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics(EngineObserver):
    """Prometheus metrics: HTTP requests, TTFT / ITL histograms, and the engine's gauges and counters — under copt's
    names and, for dashboards and gateways built for vLLM, under vLLM's (`vllm:...`, labelled model_name)."""

    def __init__(self, engine: Engine, model_name: str | None = None):
        self.engine = engine
        self._itl_pending: deque[tuple[float, int]] = deque()
        try:
            from prometheus_client import CollectorRegistry, Counter, Histogram
        except ImportError:  # serving still works; /metrics says what is missing
            self.registry = None
            self.requests = _NoMetric()
            return
        self.registry = CollectorRegistry()
        self.requests = Counter("copt_http_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.ttft = Histogram("copt_time_to_first_token_seconds", "Time to first token", buckets=TTFT_BUCKETS,
                              registry=self.registry)
        self.itl = Histogram("copt_inter_token_latency_seconds", "Inter-token latency", buckets=ITL_BUCKETS,
                             registry=self.registry)
        self.e2e = Histogram("copt_e2e_request_latency_seconds", "Request latency in the engine",
                             buckets=TTFT_BUCKETS, registry=self.registry)
        name = model_name or getattr(engine, "model_name", None) or engine.config.model

        def vllm_histogram(metric: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(metric, doc, ["model_name"], buckets=buckets, registry=self.registry).labels(name)

        self.vllm_ttft = vllm_histogram("vllm:time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
        self.vllm_itl = [vllm_histogram("vllm:time_per_output_token_seconds", "Time per output token", ITL_BUCKETS),
                         vllm_histogram("vllm:inter_token_latency_seconds", "Inter-token latency", ITL_BUCKETS)]
        self.vllm_e2e = vllm_histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency",
                                       TTFT_BUCKETS)
        self.registry.register(_EngineCollector(engine, name))
        self._render_registry = self.registry
        if getattr(engine, "remote", False):  # the split server (an API-server process)
            # the HTTP counters and latency histograms of every API-server process, summed: prometheus_client keeps
            # them in PROMETHEUS_MULTIPROC_DIR (set before it was imported), as vLLM does
            from prometheus_client import values

            if getattr(values.ValueClass, "__name__", "") == "MmapedValue":
                from prometheus_client.multiprocess import MultiProcessCollector

                self._render_registry = CollectorRegistry()
                MultiProcessCollector(self._render_registry)
                self._render_registry.register(_EngineCollector(engine, name))
            self._render_registry.register(_ApiServerCollector(engine.index))

    def on_first_token(self, ttft_s: float) -> None:
        if self.registry is not None:
            self.ttft.observe(ttft_s)
            self.vllm_ttft.observe(ttft_s)

    def on_tokens(self, itl_s: float, count: int) -> None:
        # called per token on the engine thread: only queue the sample; the histogram takes it at scrape time
        if self.registry is not None:
            self._itl_pending.append((itl_s, count))
            if len(self._itl_pending) >= 100_000:
                self._drain_itl()

    def flush(self) -> None:
        """Move the queued inter-token samples into the histograms (the split server's API processes do it every
        second: their histograms are summed with the other processes' at scrape time)."""
        if self.registry is not None:
            self._drain_itl()

    def _drain_itl(self) -> None:
        pending = self._itl_pending
        samples: list[tuple[float, int]] = []
        while pending:
            try:
                samples.append(pending.popleft())
            except IndexError:
                break
        if samples:
            for histogram in (self.itl, *self.vllm_itl):
                observe_many(histogram, samples)

    def on_finish(self, result: GenerationResult) -> None:
        if self.registry is not None:
            self.e2e.observe(result.latency_s)
            self.vllm_e2e.observe(result.latency_s)

    def render(self) -> bytes | None:
        if self.registry is None:
            return None
        self._drain_itl()
        from prometheus_client import generate_latest

        return generate_latest(self._render_registry)


def observe_many(histogram: Any, samples: list[tuple[float, int]]) -> None:
    """histogram.observe(value) `count` times for each (value, count), as one increment per bucket and one of the
    sum: in the split server's API processes every increment is a write to a shared memory-mapped file, and one
    per token and histogram cost a 256-stream load half of its API process's time. Histograms of another
    prometheus_client layout take the samples one by one."""
    import bisect

    bounds, buckets = getattr(histogram, "_upper_bounds", None), getattr(histogram, "_buckets", None)
    if bounds is None or buckets is None or len(bounds) != len(buckets) or getattr(histogram, "_sum", None) is None:
        for value, count in samples:
            for _ in range(count):
                histogram.observe(value)
        return
    counts = [0] * len(bounds)
    total = 0.0
    for value, count in samples:
        counts[min(bisect.bisect_left(bounds, value), len(bounds) - 1)] += count  # the first bound >= value
        total += value * count
    histogram._sum.inc(total)
    for bucket, count in zip(buckets, counts, strict=True):
        if count:
            bucket.inc(count)


class _ApiServerCollector:
    """The split server: which API-server process answered this scrape."""

    def __init__(self, index: int):
        self.index = index

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        yield GaugeMetricFamily("copt_api_server_index", "Index of the API-server process that answered this scrape",
                                value=self.index)


class _NoMetric:
    def labels(self, *args: Any) -> "_NoMetric":
        return self

    def inc(self, amount: float = 1) -> None:
        pass


class _EngineCollector:
    """Reads the engine's stats at scrape time."""

    def __init__(self, engine: Engine, model_name: str = ""):
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.engine.stats
        for name, doc, value, family in (
            ("vllm:num_requests_running", "Requests in the running batch", s.running, GaugeMetricFamily),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled", s.waiting, GaugeMetricFamily),
            ("vllm:kv_cache_usage_perc", "KV-cache usage (1 = full)", s.kv_cache_usage, GaugeMetricFamily),
            ("vllm:prompt_tokens", "Prefilled prompt tokens", s.prompt_tokens, CounterMetricFamily),
            ("vllm:generation_tokens", "Generated tokens", s.generated_tokens, CounterMetricFamily),
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", s.prefix_cache_queries,
             CounterMetricFamily),
            ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", s.prefix_cache_hits,
             CounterMetricFamily),
            ("vllm:num_preemptions", "Requests preempted (KV blocks freed, recomputed later)", s.preemptions,
             CounterMetricFamily),
        ):
            metric = family(name, doc, labels=["model_name"])
            metric.add_metric([self.model_name], value)
            yield metric
        success = CounterMetricFamily("vllm:request_success", "Finished requests by finish reason",
                                      labels=["model_name", "finished_reason"])
        for reason, count in sorted(s.finished.items()):
            success.add_metric([self.model_name, reason], count)
        yield success
        yield GaugeMetricFamily("copt_num_requests_running", "Requests holding a KV-cache slot", value=s.running)
        yield GaugeMetricFamily("copt_num_requests_waiting", "Requests queued for a slot", value=s.waiting)
        yield GaugeMetricFamily("copt_kv_cache_usage_ratio", "Fraction of KV-cache tokens in use",
                                value=s.kv_cache_usage)
        yield GaugeMetricFamily("copt_kv_cache_slots", "Sequence slots in the KV cache", value=s.num_slots)
        yield GaugeMetricFamily("copt_kv_cache_blocks", "Blocks of the paged KV cache (0: slot cache)",
                                value=s.kv_blocks)
        hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        yield GaugeMetricFamily("copt_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache, of those "
                                "looked up", value=hit_rate)
        yield GaugeMetricFamily("copt_spec_decode_acceptance_rate", "Accepted / drafted speculative tokens",
                                value=s.spec_acceptance_rate)
        for name, doc, value in (
            ("copt_prompt_tokens", "Prompt tokens prefilled", s.prompt_tokens),
            ("copt_generation_tokens", "Tokens generated", s.generated_tokens),
            ("copt_prefill_chunks", "Prompt chunks run (chunked prefill)", s.prefill_chunks),
            ("copt_prompt_tokens_shared", "Prompt tokens copied from another choice's KV cache (n > 1)",
             s.prompt_tokens_shared),
            ("copt_engine_steps", "Scheduler iterations", s.steps),
            ("copt_engine_decode_steps", "Batched decode steps (async scheduling runs several per iteration)",
             s.decode_steps),
            ("copt_engine_chained_steps", "Decode steps launched before the previous step's tokens were read",
             s.chained_steps),
            ("copt_spec_decode_draft_tokens", "Draft tokens proposed", s.spec_drafted),
            ("copt_spec_decode_accepted_tokens", "Draft tokens accepted", s.spec_accepted),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        phases = CounterMetricFamily("copt_engine_phase_seconds", "Engine-thread wall time per step phase",
                                     labels=["phase"])
        for phase, seconds in sorted(dict(s.phase_s).items()):
            phases.add_metric([phase], seconds)
        yield phases
        finished = CounterMetricFamily("copt_request_finished", "Finished requests by reason", labels=["reason"])
        for reason, count in sorted(s.finished.items()):
            finished.add_metric([reason], count)
        yield finished


def build_app(engine: Engine, *, served_model_name: str, api_key: str | None = None,
              metrics: ServerMetrics | None = None, limits: ServerLimits | None = None):
    """The FastAPI app (the engine must be started)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from clusteropt_cli.core.serve.openai_routes import add_openai_routes
    from clusteropt_cli.core.serve.protocol import openai_error

    app = FastAPI(title="copt serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.draining = False
    app.state.api_trace = trace = ApiTrace.from_env()  # COPT_API_TRACE=<folder>: streamed requests' times
    metrics = metrics or ServerMetrics(engine, served_model_name)
    limits = limits or ServerLimits()
    # CPU work of the front end (JSON parsing, chat templates, tokenization) runs here, never on the event loop
    workers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="copt-frontend")
    app.state.workers = workers

    async def off_loop(fn: Callable, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(workers, lambda: fn(*args, **kwargs))

    def error(status: int, message: str, **kw: Any) -> JSONResponse:
        return JSONResponse(openai_error(message, status, **kw), status_code=status)

    endpoints = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/tokenize",
                 "/detokenize")
    expected_auth = f"Bearer {api_key}".encode() if api_key else None

    def protected(path: str) -> bool:
        return (path.startswith("/v1") or path in ("/tokenize", "/detokenize")
                or (path == "/metrics" and not limits.metrics_public))

    class AuthLimitsAndCount:
        """API-key check (constant time), the request-body cap and read timeout, and request counting, as a plain
        ASGI middleware (Starlette's BaseHTTPMiddleware would relay every streamed chunk through an extra memory
        stream and task)."""

        def __init__(self, app: Any):
            self.app = app

        async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
            if scope["type"] != "http":
                await self.app(scope, receive, send)
                return
            if trace is not None:
                scope["copt_stamps"] = {"entered": time.perf_counter()}  # the request's intake, timed
            path = scope.get("path", "")
            endpoint = path if path in endpoints else "other"

            async def reply(response: JSONResponse) -> None:
                metrics.requests.labels(endpoint, str(response.status_code)).inc()
                await response(scope, receive, send)

            if expected_auth is not None and protected(path):
                header = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
                if not hmac.compare_digest(header, expected_auth):
                    await reply(error(401, "Missing or wrong API key (send 'Authorization: Bearer KEY').",
                                      code="invalid_api_key"))
                    return
            if scope.get("method") == "POST":
                body = await read_body(scope, receive)
                if isinstance(body, JSONResponse):
                    await reply(body)
                    return
                receive = replay(body, receive)

            async def counting_send(message: dict) -> None:
                if message["type"] == "http.response.start":
                    metrics.requests.labels(endpoint, str(message["status"])).inc()
                await send(message)

            await self.app(scope, receive, counting_send)

    def too_large(size: int | None = None) -> JSONResponse:
        got = f" ({size} bytes)" if size is not None else ""
        response = error(413, f"The request body is larger than this server accepts{got}: at most "
                              f"{limits.max_request_bytes} bytes (--max-request-bytes).", param=None,
                         code="request_too_large")
        response.headers["Connection"] = "close"
        return response

    async def read_body(scope: dict, receive: Callable) -> bytes | JSONResponse:
        """The whole body, refused (413) past the cap before it is read, closed (408) when it stalls for the read
        timeout or arrives slower than the read timeout plus a second per BODY_MIN_BYTES_PER_S bytes allow."""
        length = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return error(400, "Invalid Content-Length header.")
            if declared > limits.max_request_bytes:
                return too_large(declared)
        chunks, size = [], 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limits.read_timeout
        while True:
            try:
                wait = min(limits.read_timeout, deadline + size / BODY_MIN_BYTES_PER_S - loop.time())
                if wait <= 0:
                    raise TimeoutError
                message = await asyncio.wait_for(receive(), timeout=wait)
            except TimeoutError:
                response = error(408, f"The request body did not arrive in time (--read-timeout "
                                      f"{limits.read_timeout:g} s between two pieces, and the read timeout plus a "
                                      f"second per {BODY_MIN_BYTES_PER_S // 1024} KiB for the whole body).")
                response.headers["Connection"] = "close"
                return response
            if message["type"] == "http.disconnect":
                return error(499, "Client disconnected.")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limits.max_request_bytes:
                return too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def replay(body: bytes, receive: Callable) -> Callable:
        sent = False

        async def again() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return again

    app.add_middleware(AuthLimitsAndCount)

    def invalid(errors: list[dict[str, Any]], in_body: bool = True) -> JSONResponse:
        malformed = ("json_invalid", "json_type", "model_attributes_type", "model_type", "dict_type")
        for e in errors:
            loc = tuple(p for p in e.get("loc", ()) if p != "body")
            if e.get("type") in malformed and len(loc) == 0:
                detail = str(e.get("msg", "")).removeprefix("Invalid JSON: ")
                return error(400, f"The request body is not valid JSON (UTF-8 text without lone surrogates): "
                                  f"{detail}.")
        parts = []
        for e in errors[:5]:
            loc = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
            parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
        first = errors[0].get("loc", ()) if errors else ()
        param = ".".join(str(p) for p in first if p != "body") or None
        return error(400, "Invalid request: " + "; ".join(parts), param=param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return invalid(list(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):
        return error(500, f"Internal error: {type(exc).__name__}: {exc}", err_type="server_error")

    @app.get("/health")
    async def health():
        if app.state.draining:
            return error(503, "The server is shutting down.")
        if engine_dead():
            return error(503, f"The engine failed: {engine.error or 'its thread is gone'}")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        refresh = getattr(engine, "refresh_stats", None)
        if refresh is not None:  # the split server: the engine's stats come from the engine-core process
            await refresh()
        body = metrics.render()
        if body is None:
            return error(503, "prometheus-client is not installed (pip install 'clusteropt-cli[serve]').")
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    def engine_dead() -> bool:
        return is_engine_dead(engine)

    add_openai_routes(app, engine, served_model_name=served_model_name, limits=limits, off_loop=off_loop,
                      error=error, invalid=invalid, engine_dead=engine_dead)
    return app


def is_engine_dead(engine: Any) -> bool:
    """The engine failed (or its thread is gone); for the split server's EngineClient: the engine-core process."""
    dead = getattr(engine, "is_dead", None)
    if dead is not None:
        return dead()
    thread = engine._thread
    return engine.error is not None or (thread is not None and not thread.is_alive())


def raise_open_file_limit() -> int:
    """Raise the soft open-file limit to the hard one (as vLLM does); returns the soft limit now in force."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65_536)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        return int(soft) if soft != resource.RLIM_INFINITY else 65_536
    except (ImportError, ValueError, OSError):
        return 1024


def guarded_protocol(read_timeout: float, max_connections: int, write_timeout: float = 30.0) -> type:
    """uvicorn's HTTP protocol (httptools or h11, as uvicorn picks) that closes a connection which has not sent a
    complete request head within `read_timeout` seconds of connecting or of its previous response (half-open and
    slowloris connections), cuts one whose writes stay paused for `write_timeout` seconds (the client stopped
    reading: its receive buffer and the server's send buffer are full), and closes connections beyond
    `max_connections` as soon as they are accepted.

    A cut connection is reset (its unsent bytes dropped: a close would wait for the client to read them): the app
    sees the disconnect, so a stream's or a request's engine handles are cancelled and their KV cache freed.
    Without it a stream's send waited for the client for ever, its connection held, and the engine generated every
    token of the request for nobody."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class GuardedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _head_timer: asyncio.TimerHandle | None = None
        _write_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.close()
                return
            self._arm_head_timer()

        def _arm_head_timer(self) -> None:
            self._cancel_head_timer()
            self._head_timer = self.loop.call_later(read_timeout, self._head_timed_out)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            self._cancel_write_timer()
            super().connection_lost(exc)

        # the transport's write buffer passed its high-water mark (the kernel's send buffer is full already)
        def pause_writing(self) -> None:
            super().pause_writing()
            if self._write_timer is None:
                self._write_timer = self.loop.call_later(write_timeout, self._write_timed_out)

        def resume_writing(self) -> None:
            self._cancel_write_timer()
            super().resume_writing()

        def _cancel_write_timer(self) -> None:
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def _write_timed_out(self) -> None:
            self._write_timer = None
            sock = self.transport.get_extra_info("socket")
            try:  # a reset: the kernel drops the megabytes still queued for the client too
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except (AttributeError, OSError):
                pass
            self.transport.abort()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_head_timer()

        # httptools: the parser calls this when the request head is complete
        def on_headers_complete(self) -> None:
            self._cancel_head_timer()
            super().on_headers_complete()

        # h11: the head is complete once the client's state left IDLE
        def handle_events(self) -> None:
            super().handle_events()
            conn = getattr(self, "conn", None)
            if conn is not None and self._head_timer is not None:
                import h11

                if conn.their_state is not h11.IDLE:
                    self._cancel_head_timer()

    return GuardedHTTPProtocol


def run_server(engine: Engine, *, host: str, port: int, served_model_name: str, api_key: str | None = None,
               grace_period: float = 30.0, on_ready: Callable[[str], None] | None = None,
               log_level: str = "warning", limits: ServerLimits | None = None, dead_linger_s: float = 1.0,
               sockets: list | None = None, signals: tuple[int, ...] | None = None) -> int:
    """Serve until SIGTERM/SIGINT; then drain (no new requests, in-flight ones finish) and return 0. When the
    engine dies (an unrecoverable device error) the server answers 503/500 for `dead_linger_s` seconds, stops and
    returns ENGINE_DEAD_EXIT.

    `engine`: the Engine, or (an API-server process of the split server) an engine_client.EngineClient;
    `sockets`: listening sockets to serve on (shared by the API-server processes) instead of binding host:port;
    `signals`: the signals that drain (default SIGTERM and SIGINT)."""
    import contextlib
    import signal
    import sys

    import uvicorn

    limits = limits or ServerLimits()
    # the engine thread and the event loop share the GIL: switch often so HTTP I/O is not starved by the scheduler
    sys.setswitchinterval(0.0005)
    open_files = raise_open_file_limit()
    max_connections = limits.max_connections or max(32, open_files - 64)
    metrics = ServerMetrics(engine, served_model_name)
    engine.observer = metrics
    app = build_app(engine, served_model_name=served_model_name, api_key=api_key, metrics=metrics, limits=limits)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=grace_period, lifespan="off", timeout_keep_alive=5,
                            http=guarded_protocol(limits.read_timeout, max_connections, limits.write_timeout))
    dead = False

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # our handlers: drain instead of re-raising the signal after shutdown
            def handle(signum: int, frame: Any) -> None:
                app.state.draining = True
                engine.close_admission()
                if self.should_exit:
                    self.force_exit = True
                self.should_exit = True

            previous = {sig: signal.signal(sig, handle) for sig in (signals or (signal.SIGTERM, signal.SIGINT))}
            try:
                yield
            finally:
                for sig, old in previous.items():
                    signal.signal(sig, old)

        async def startup(self, sockets=None) -> None:
            attach = getattr(engine, "attach", None)
            if attach is not None:  # the split server: connect to the engine core on this event loop
                await attach()
            await super().startup(sockets)
            if self.started:
                self._watchdog = asyncio.ensure_future(self._watch_engine())
                if app.state.api_trace is not None:
                    self._lag_watch = asyncio.ensure_future(app.state.api_trace.watch_loop())
            if on_ready is not None and self.started:
                bound = [s.getsockname() for srv in self.servers for s in srv.sockets]
                actual = bound[0][1] if bound else port
                on_ready(f"http://{host}:{actual}")

        async def _watch_engine(self) -> None:
            """A dead engine cannot recover: let the in-flight requests get their 500, then stop (non-zero)."""
            nonlocal dead
            while not self.should_exit:
                if is_engine_dead(engine):
                    dead = True
                    sys.stderr.write(f"copt serve: the engine failed ({engine.error}); exiting so that a "
                                     "supervisor can restart the server\n")
                    await asyncio.sleep(dead_linger_s)  # the failed requests' 500s and error events go out
                    app.state.draining = True
                    self.should_exit = True
                    return
                await asyncio.sleep(0.2)

    server = _Server(config)
    try:
        with frozen_startup_heap():
            server.run(sockets=sockets)
    finally:
        deadline = time.time() + grace_period
        # (an EngineClient's requests cannot progress once the event loop is gone: uvicorn's graceful shutdown
        # has waited for them)
        while not dead and not getattr(engine, "remote", False) and not engine.idle and time.time() < deadline:
            time.sleep(0.05)
        engine.stop()
        app.state.workers.shutdown(wait=False, cancel_futures=True)
        if app.state.api_trace is not None:
            app.state.api_trace.write()
    if dead:
        return ENGINE_DEAD_EXIT
    return 0 if server.started else 1
