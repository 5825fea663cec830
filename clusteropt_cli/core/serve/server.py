"""The OpenAI-compatible HTTP server around the engine (FastAPI + uvicorn).

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (SSE streaming with `data: [DONE]`),
GET /health, GET /metrics (Prometheus). Errors use OpenAI's JSON shape. SIGTERM stops accepting new work,
lets in-flight requests finish within the grace period, then the process exits 0.
"""


import asyncio
import json
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from clusteropt_cli.core.serve.engine import (
    Engine,
    EngineObserver,
    EngineStoppedError,
    GenerationRequest,
    GenerationResult,
    QueueFullError,
    RequestHandle,
    TextStream,
)
from clusteropt_cli.errors import BadInputError

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics(EngineObserver):
    """Prometheus metrics: HTTP requests, TTFT / ITL histograms, and the engine's gauges and counters."""

    def __init__(self, engine: Engine):
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
        self.registry.register(_EngineCollector(engine))

    def on_first_token(self, ttft_s: float) -> None:
        if self.registry is not None:
            self.ttft.observe(ttft_s)

    def on_tokens(self, itl_s: float, count: int) -> None:
        # called per token on the engine thread: only queue the sample; the histogram takes it at scrape time
        if self.registry is not None:
            self._itl_pending.append((itl_s, count))
            if len(self._itl_pending) >= 100_000:
                self._drain_itl()

    def _drain_itl(self) -> None:
        pending = self._itl_pending
        while pending:
            try:
                itl_s, count = pending.popleft()
            except IndexError:
                break
            for _ in range(count):
                self.itl.observe(itl_s)

    def on_finish(self, result: GenerationResult) -> None:
        if self.registry is not None:
            self.e2e.observe(result.latency_s)

    def render(self) -> bytes | None:
        if self.registry is None:
            return None
        self._drain_itl()
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class _NoMetric:
    def labels(self, *args: Any) -> "_NoMetric":
        return self

    def inc(self, amount: float = 1) -> None:
        pass


class _EngineCollector:
    """Reads the engine's stats at scrape time."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.engine.stats
        yield GaugeMetricFamily("copt_num_requests_running", "Requests holding a KV-cache slot", value=s.running)
        yield GaugeMetricFamily("copt_num_requests_waiting", "Requests queued for a slot", value=s.waiting)
        yield GaugeMetricFamily("copt_kv_cache_usage_ratio", "Fraction of KV-cache tokens in use",
                                value=s.kv_cache_usage)
        yield GaugeMetricFamily("copt_kv_cache_slots", "Sequence slots in the KV cache", value=s.num_slots)
        yield GaugeMetricFamily("copt_spec_decode_acceptance_rate", "Accepted / drafted speculative tokens",
                                value=s.spec_acceptance_rate)
        for name, doc, value in (
            ("copt_prompt_tokens", "Prompt tokens prefilled", s.prompt_tokens),
            ("copt_generation_tokens", "Tokens generated", s.generated_tokens),
            ("copt_prefill_chunks", "Prompt chunks run (chunked prefill)", s.prefill_chunks),
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


class _ClientGone(Exception):
    pass


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def build_app(engine: Engine, *, served_model_name: str, api_key: str | None = None,
              metrics: ServerMetrics | None = None):
    """The FastAPI app (the engine must be started)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from clusteropt_cli.core.serve.protocol import ChatBody, CompletionBody, openai_error

    app = FastAPI(title="copt serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.draining = False
    metrics = metrics or ServerMetrics(engine)
    tokenizer = engine.tokenizer
    created = int(time.time())

    def error(status: int, message: str, **kw: Any) -> JSONResponse:
        return JSONResponse(openai_error(message, status, **kw), status_code=status)

    endpoints = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
    expected_auth = f"Bearer {api_key}".encode("latin-1") if api_key else None

    class AuthAndCount:
        """API-key check and request counting as a plain ASGI middleware (Starlette's BaseHTTPMiddleware would
        relay every streamed chunk through an extra memory stream and task)."""

        def __init__(self, app: Any):
            self.app = app

        async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
            if scope["type"] != "http":
                await self.app(scope, receive, send)
                return
            path = scope.get("path", "")
            if expected_auth is not None and path.startswith("/v1"):
                header = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
                if header != expected_auth:
                    metrics.requests.labels(path, "401").inc()
                    response = error(401, "Missing or wrong API key (send 'Authorization: Bearer KEY').",
                                     code="invalid_api_key")
                    await response(scope, receive, send)
                    return
            endpoint = path if path in endpoints else "other"

            async def counting_send(message: dict) -> None:
                if message["type"] == "http.response.start":
                    metrics.requests.labels(endpoint, str(message["status"])).inc()
                await send(message)

            await self.app(scope, receive, counting_send)

    app.add_middleware(AuthAndCount)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        malformed = ("json_invalid", "model_attributes_type", "dict_type")
        if any(e.get("type") in malformed and tuple(e.get("loc", ()))[:1] == ("body",) and len(e.get("loc", ())) <= 2
               for e in errors):
            return error(400, "The request body is not valid JSON.")
        parts = []
        for e in errors[:5]:
            loc = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
            parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
        first = errors[0].get("loc", ()) if errors else ()
        param = ".".join(str(p) for p in first if p != "body") or None
        return error(422, "Invalid request: " + "; ".join(parts), param=param)

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
        if engine.error is not None:
            return error(503, f"The engine failed: {engine.error}")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        body = metrics.render()
        if body is None:
            return error(503, "prometheus-client is not installed (pip install 'clusteropt-cli[serve]').")
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": created,
                                            "owned_by": "copt", "max_model_len": engine.max_model_len}]}

    def check_model(name: str | None) -> JSONResponse | None:
        if name and name not in (served_model_name, engine.model_name):
            return error(404, f"The model '{name}' does not exist; this server serves '{served_model_name}'.",
                         err_type="not_found_error", param="model", code="model_not_found")
        return None

    defaults = getattr(engine, "sampling_defaults", None) or {}  # generation_config.json, as vLLM applies it

    def to_request(body: Any, prompt_ids: list[int], max_tokens: int | None) -> GenerationRequest:
        return GenerationRequest(
            prompt_ids=prompt_ids, max_new_tokens=max_tokens if max_tokens is not None else 16,
            temperature=defaults.get("temperature", 1.0) if body.temperature is None else body.temperature,
            top_p=defaults.get("top_p", 1.0) if body.top_p is None else body.top_p, seed=body.seed,
            stop=body.stop_list(),
            stop_token_ids=list(body.stop_token_ids or []), ignore_eos=body.ignore_eos, min_tokens=body.min_tokens)

    def submit_all(requests: list[GenerationRequest]) -> list[RequestHandle] | JSONResponse:
        if app.state.draining:
            return error(503, "The server is shutting down.")
        handles: list[RequestHandle] = []
        try:
            for req in requests:
                handles.append(engine.submit(req))
        except (BadInputError, QueueFullError, EngineStoppedError) as exc:
            for h in handles:
                h.cancel()
            status = 400 if isinstance(exc, BadInputError) else 429 if isinstance(exc, QueueFullError) else 503
            return error(status, exc.message, param="prompt" if status == 400 else None)
        return handles

    async def await_results(request: Request, handles: list[RequestHandle]) -> list[GenerationResult]:
        tasks = [asyncio.ensure_future(h.wait()) for h in handles]
        try:
            while True:
                done, pending = await asyncio.wait(tasks, timeout=0.5)
                if not pending:
                    return [t.result() for t in tasks]
                if await request.is_disconnected():
                    raise _ClientGone()
        finally:
            for h in handles:
                if not h.done:
                    h.cancel()
            for t in tasks:
                t.cancel()

    def usage(results: list[GenerationResult]) -> dict[str, int]:
        prompt = sum(r.num_prompt_tokens for r in results)
        completion = sum(r.num_output_tokens for r in results)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def token_ids(body: Any, result: GenerationResult) -> dict[str, Any]:
        """vLLM's `return_token_ids` extra: the prompt and output token ids next to the text."""
        if not (body.model_extra or {}).get("return_token_ids"):
            return {}
        return {"prompt_token_ids": result.prompt_ids, "token_ids": result.output_ids}

    def finish_reason(result: GenerationResult) -> str:
        return result.finish_reason if result.finish_reason in ("stop", "length") else "abort"

    async def merged(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, list[int] | None]]:
        """Token chunks of several handles as (index, ids); (index, None) when one finishes."""
        if len(handles) == 1:
            async for ids in handles[0]:
                yield 0, ids
            yield 0, None
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, h: RequestHandle) -> None:
            async for ids in h:
                await queue.put((i, ids))
            await queue.put((i, None))

        tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
        try:
            remaining = len(handles)
            while remaining:
                item = await queue.get()
                if item[1] is None:
                    remaining -= 1
                yield item
        finally:
            for t in tasks:
                t.cancel()

    def stream_response(handles: list[RequestHandle], body: Any, kind: str) -> StreamingResponse:
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        now = int(time.time())
        streams = [TextStream(tokenizer, body.stop_list()) for _ in handles]

        def chunk(index: int, text: str | None, reason: str | None, role: bool = False) -> dict[str, Any]:
            if kind == "chat":
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else (
                    {"content": text} if text else {})
                choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": reason}
            return {"id": rid, "object": obj, "created": now, "model": served_model_name, "choices": [choice]}

        # the per-token event, pre-rendered around the JSON-escaped text (the same document json.dumps of
        # chunk(index, text, None) gives, without building and encoding the dicts for every token)
        head = json.dumps({"id": rid, "object": obj, "created": now, "model": served_model_name},
                          separators=(",", ":"))[:-1] + ',"choices":[{"index":'
        field_ = ',"delta":{"content":' if kind == "chat" else ',"text":'
        tail = '},"logprobs":null,"finish_reason":null}]}\n\n' if kind == "chat" else (
            ',"logprobs":null,"finish_reason":null}]}\n\n')

        def token_event(index: int, text: str) -> str:
            return f"data: {head}{index}{field_}{json.dumps(text)}{tail}"

        async def events() -> AsyncIterator[str]:
            try:
                if kind == "chat":
                    for i in range(len(handles)):
                        yield _sse(chunk(i, None, None, role=True))
                async for index, ids in merged(handles):
                    if ids is not None:
                        delta = streams[index].push(ids)
                        if delta:
                            yield token_event(index, delta)
                        continue
                    result = handles[index].result()
                    tail = streams[index].finish(result.text)
                    yield _sse(chunk(index, tail, finish_reason(result)))
                if body.include_usage():
                    payload = {"id": rid, "object": obj, "created": now, "model": served_model_name, "choices": [],
                               "usage": usage([h.result() for h in handles])}
                    yield _sse(payload)
                yield _sse("[DONE]")
            finally:
                for h in handles:
                    if not h.done:
                        h.cancel()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        bad = check_model(body.model)
        if bad is not None:
            return bad
        if body.n != 1:
            return error(400, "Only n=1 is supported.", param="n")
        prompt = body.prompt
        if isinstance(prompt, str):
            prompts = [tokenizer.encode(prompt, add_special_tokens=False)]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]
        elif prompt and all(isinstance(p, str) for p in prompt):
            prompts = [tokenizer.encode(p, add_special_tokens=False) for p in prompt]
        elif prompt and all(isinstance(p, list) for p in prompt):
            prompts = [list(p) for p in prompt]
        else:
            return error(400, "The prompt is empty.", param="prompt")
        if any(not p for p in prompts):
            return error(400, "The prompt is empty.", param="prompt")
        handles = submit_all([to_request(body, p, body.max_tokens) for p in prompts])
        if not isinstance(handles, list):
            return handles
        if body.stream:
            return stream_response(handles, body, "completion")
        try:
            results = await await_results(request, handles)
        except _ClientGone:
            return error(499, "Client disconnected.")
        choices = []
        for i, r in enumerate(results):
            text = r.text or ""
            if body.echo and isinstance(prompt, (str, list)):
                text = tokenizer.decode(r.prompt_ids, skip_special_tokens=True) + text
            choices.append({"index": i, "text": text, "logprobs": None, "finish_reason": finish_reason(r),
                            "stop_reason": r.stop_reason, **token_ids(body, r)})
        return {"id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", "created": int(time.time()),
                "model": served_model_name, "choices": choices, "usage": usage(results)}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        bad = check_model(body.model)
        if bad is not None:
            return bad
        if body.n != 1:
            return error(400, "Only n=1 is supported.", param="n")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=body.add_generation_prompt,
                                                 **(body.chat_template_kwargs or {}))
        except Exception as exc:  # noqa: BLE001 - template errors are the client's
            return error(400, f"Cannot apply the chat template: {exc}", param="messages")
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:
            max_tokens = max(1, engine.max_model_len - len(prompt_ids))
        handles = submit_all([to_request(body, prompt_ids, max_tokens)])
        if not isinstance(handles, list):
            return handles
        if body.stream:
            return stream_response(handles, body, "chat")
        try:
            results = await await_results(request, handles)
        except _ClientGone:
            return error(499, "Client disconnected.")
        r = results[0]
        return {"id": "chatcmpl-" + uuid.uuid4().hex, "object": "chat.completion", "created": int(time.time()),
                "model": served_model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": r.text or ""},
                             "logprobs": None, "finish_reason": finish_reason(r), "stop_reason": r.stop_reason,
                             **token_ids(body, r)}],
                "usage": usage(results)}

    return app


def run_server(engine: Engine, *, host: str, port: int, served_model_name: str, api_key: str | None = None,
               grace_period: float = 30.0, on_ready: Callable[[str], None] | None = None,
               log_level: str = "warning") -> int:
    """Serve until SIGTERM/SIGINT; then drain (no new requests, in-flight ones finish) and return 0."""
    import contextlib
    import signal
    import sys

    import uvicorn

    # the engine thread and the event loop share the GIL: switch often so HTTP I/O is not starved by the scheduler
    sys.setswitchinterval(0.0005)
    metrics = ServerMetrics(engine)
    engine.observer = metrics
    app = build_app(engine, served_model_name=served_model_name, api_key=api_key, metrics=metrics)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=grace_period, lifespan="off", timeout_keep_alive=30)

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # our handlers: drain instead of re-raising the signal after shutdown
            def handle(signum: int, frame: Any) -> None:
                app.state.draining = True
                engine.close_admission()
                if self.should_exit:
                    self.force_exit = True
                self.should_exit = True

            previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGTERM, signal.SIGINT)}
            try:
                yield
            finally:
                for sig, old in previous.items():
                    signal.signal(sig, old)

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if on_ready is not None and self.started:
                bound = [s.getsockname() for srv in self.servers for s in srv.sockets]
                actual = bound[0][1] if bound else port
                on_ready(f"http://{host}:{actual}")

    server = _Server(config)
    try:
        server.run()
    finally:
        deadline = time.time() + grace_period
        while not engine.idle and time.time() < deadline:
            time.sleep(0.05)
        engine.stop()
    return 0 if server.started else 1
