"""The OpenAI-compatible HTTP server around the engine (FastAPI + uvicorn).

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (SSE streaming with `data: [DONE]`),
GET /health, GET /metrics (Prometheus). Errors use OpenAI's JSON shape. SIGTERM stops accepting new work,
lets in-flight requests finish within the grace period, then the process exits 0.

One client cannot hurt the others: bodies are capped (413) and read with a timeout, JSON parsing, chat templates
and tokenization run on worker threads (the event loop only moves bytes), every request field that reaches a
tensor is validated before admission (400 naming the field), a request that fails inside an engine step fails alone
(500), and an unrecoverable device error marks the engine dead (/health 503, every request 500) and the process
exits with status 1 so a supervisor restarts it. Connections that send no complete request within the read timeout
are closed, and connections beyond --max-connections are closed at once.
"""


import asyncio
import hmac
import json
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from clusteropt_cli.core.serve.engine import Engine
from clusteropt_cli.core.serve.requests import (
    EngineDeadError,
    EngineObserver,
    EngineStoppedError,
    GenerationRequest,
    GenerationResult,
    InvalidRequestError,
    QueueFullError,
    RequestHandle,
    TextStream,
)
from clusteropt_cli.errors import BadInputError

ENGINE_DEAD_EXIT = 1  # the engine died of a device error: non-zero so that a supervisor restarts the server


@dataclass
class ServerLimits:
    """What one request or connection may cost the server (defaults: ServeRecipe)."""

    max_request_bytes: int = 16 * 2**20
    max_prompt_chars: int | None = None  # None: 64 characters per token of --max-model-len
    trust_request_chat_template: bool = False
    metrics_public: bool = False
    read_timeout: float = 30.0  # seconds to send a request's headers, and between two pieces of its body
    max_connections: int | None = None  # None: from the open-file limit

    def prompt_chars(self, max_model_len: int) -> int:
        return self.max_prompt_chars or max(65_536, 64 * max_model_len)


# names apply_chat_template gives meaning to itself: never taken from a request's chat_template_kwargs
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "tokenize", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "add_generation_prompt", "continue_final_message"})


def template_variables(tokenizer: Any) -> frozenset[str]:
    """The variables the model's own chat template reads: the only chat_template_kwargs passed on."""
    template = getattr(tokenizer, "chat_template", None)
    sources = list(template.values()) if isinstance(template, dict) else [template] if template else []
    names: set[str] = set()
    try:
        import jinja2
        from jinja2 import meta

        env = jinja2.Environment()
        for source in sources:
            names |= meta.find_undeclared_variables(env.parse(source))
    except Exception:  # noqa: BLE001 - an unparsable template: pass no kwargs at all
        return frozenset()
    return frozenset(names - _RESERVED_TEMPLATE_KWARGS)

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

    def _drain_itl(self) -> None:
        pending = self._itl_pending
        while pending:
            try:
                itl_s, count = pending.popleft()
            except IndexError:
                break
            for _ in range(count):
                self.itl.observe(itl_s)
                for histogram in self.vllm_itl:
                    histogram.observe(itl_s)

    def on_finish(self, result: GenerationResult) -> None:
        if self.registry is not None:
            self.e2e.observe(result.latency_s)
            self.vllm_e2e.observe(result.latency_s)

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


class _ClientGone(Exception):
    pass


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def build_app(engine: Engine, *, served_model_name: str, api_key: str | None = None,
              metrics: ServerMetrics | None = None, limits: ServerLimits | None = None):
    """The FastAPI app (the engine must be started)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from pydantic import ValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from clusteropt_cli.core.serve.openai_extras import (
        TokenText,
        chat_logprobs,
        completion_logprobs,
        echo_entries,
    )
    from clusteropt_cli.core.serve.protocol import (
        ChatBody,
        ChatMessage,
        CompletionBody,
        openai_error,
        unsupported_field,
    )

    app = FastAPI(title="copt serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.draining = False
    metrics = metrics or ServerMetrics(engine, served_model_name)
    limits = limits or ServerLimits()
    max_prompt_chars = limits.prompt_chars(engine.max_model_len)
    tokenizer = engine.tokenizer
    template_kwargs = template_variables(tokenizer)
    created = int(time.time())
    # CPU work of the front end (JSON parsing, chat templates, tokenization) runs here, never on the event loop
    workers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="copt-frontend")
    app.state.workers = workers

    async def off_loop(fn: Callable, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(workers, lambda: fn(*args, **kwargs))

    grammars: list[Any] = []  # the structured.GrammarCompiler, built on the first constrained request

    def compile_grammar(build: Callable, *args: Any) -> Any:
        from clusteropt_cli.core.serve.structured import GrammarCompiler

        if not grammars:
            grammars.append(GrammarCompiler(tokenizer, engine.runner.vocab_size, engine.eos_ids))
        return build(*args, grammars[0])

    async def structured(body: Any, functions: list[dict[str, Any]] | None = None,
                         mode: str | None = None) -> Any:
        """The request's grammar (None: unconstrained), or a 400 naming the field the grammar library refuses."""
        from clusteropt_cli.core.serve.structured import (
            StructuredOutputError,
            response_format_grammar,
            tool_grammar,
        )

        try:
            if mode not in (None, "auto"):
                parallel = (body.model_extra or {}).get("parallel_tool_calls") is not False
                return await off_loop(compile_grammar, lambda *a: tool_grammar(*a, parallel=parallel), functions,
                                      mode)
            fmt = (body.model_extra or {}).get("response_format")
            if fmt is None or fmt == {"type": "text"}:
                return None
            return await off_loop(compile_grammar, response_format_grammar, fmt)
        except StructuredOutputError as exc:
            return error(400, exc.message, param=exc.param)

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
        """The whole body, refused (413) past the cap before it is read, closed (408) when it stalls."""
        length = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return error(400, "Invalid Content-Length header.")
            if declared > limits.max_request_bytes:
                return too_large(declared)
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), timeout=limits.read_timeout)
            except TimeoutError:
                response = error(408, f"The request body did not arrive within {limits.read_timeout:g} s.")
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

    async def json_body(request: Request) -> Any:
        """The body as plain JSON, parsed on a worker thread (lone surrogates are invalid JSON here: 400)."""
        import pydantic_core

        try:
            return await off_loop(pydantic_core.from_json, await request.body())
        except ValueError as exc:
            return error(400, f"The request body is not valid JSON (UTF-8 text without lone surrogates): {exc}.")

    async def parse(request: Request, model: type) -> Any:
        """The body as `model`, parsed on a worker thread; an error response when it is malformed."""
        raw = await request.body()
        try:
            body = await off_loop(model.model_validate_json, raw)
        except ValidationError as exc:
            return invalid(list(exc.errors()))
        bad = check_model(body.model)
        if bad is not None:
            return bad
        field_ = unsupported_field(body)
        if field_ is not None:
            return error(400, f"'{field_}' is not supported by this server (copt serve); remove it from the "
                              "request.", param=field_, code="unsupported_parameter")
        return body

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

    def engine_dead() -> bool:
        thread = engine._thread
        return engine.error is not None or (thread is not None and not thread.is_alive())

    defaults = getattr(engine, "sampling_defaults", None) or {}  # generation_config.json, as vLLM applies it

    def to_request(body: Any, prompt_ids: list[int], max_tokens: int | None, *, choice: int = 0,
                   logprobs: int | None = None, prompt_logprobs: int | None = None,
                   grammar: Any = None) -> GenerationRequest:
        top_k = defaults.get("top_k", 0) if body.top_k is None else body.top_k

        def given(key: str) -> float:  # the request's value, else the model's default, else the protocol's
            return getattr(body, key) if key in body.model_fields_set else defaults.get(key, getattr(body, key))

        seed = body.seed
        if seed is not None and choice:  # n > 1: each choice its own stream of the request's seed
            seed = (seed + choice) % 2**64
        return GenerationRequest(
            prompt_ids=prompt_ids, max_new_tokens=max_tokens if max_tokens is not None else 16,
            temperature=defaults.get("temperature", 1.0) if body.temperature is None else body.temperature,
            top_p=defaults.get("top_p", 1.0) if body.top_p is None else body.top_p, seed=seed,
            top_k=max(0, int(top_k)), min_p=defaults.get("min_p", 0.0) if body.min_p is None else body.min_p,
            presence_penalty=given("presence_penalty"), frequency_penalty=given("frequency_penalty"),
            repetition_penalty=given("repetition_penalty"),
            logit_bias=body.logit_bias_ids(), logprobs=logprobs,
            prompt_logprobs=prompt_logprobs if prompt_logprobs is not None else body.prompt_logprobs,
            stop=body.stop_list(),
            stop_token_ids=list(body.stop_token_ids or []), ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
            grammar=grammar)

    text_of = TokenText(tokenizer)

    def submit_all(requests: list[GenerationRequest]) -> list[RequestHandle] | JSONResponse:
        if app.state.draining:
            return error(503, "The server is shutting down.")
        handles: list[RequestHandle] = []
        try:
            first: dict[tuple[int, ...], RequestHandle] = {}  # n > 1: the choices share their prompt's prefill
            for req in requests:
                key = tuple(req.prompt_ids)
                handles.append(engine.submit(req, share_prompt_with=first.get(key)))
                first.setdefault(key, handles[-1])
        except (BadInputError, QueueFullError, EngineStoppedError) as exc:
            for h in handles:
                h.cancel()
            if isinstance(exc, EngineDeadError):
                return error(500, exc.message, err_type="server_error", code="engine_dead")
            status = 400 if isinstance(exc, BadInputError) else 429 if isinstance(exc, QueueFullError) else 503
            param = exc.param if isinstance(exc, InvalidRequestError) else "prompt" if status == 400 else None
            return error(status, exc.message, param=param)
        return handles

    def failed(results: list[GenerationResult]) -> JSONResponse | None:
        """A 500 for a request the engine failed (its own fault in a step, or a dead engine)."""
        for r in results:
            if r.finish_reason == "error":
                return error(500, f"The request failed in the engine: {r.error}", err_type="server_error",
                             code="engine_dead" if engine.error is not None else "request_failed")
        return None

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

    def too_long_prompt(chars: int, param: str) -> JSONResponse:
        return error(413, f"The prompt has {chars} characters; this server accepts at most {max_prompt_chars} "
                          "(--max-prompt-chars).", param=param, code="prompt_too_long")

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

    def stream_response(handles: list[RequestHandle], body: Any, kind: str,
                        logprobs: bool = False) -> StreamingResponse:
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

        continuous = body.continuous_usage()
        sent = [0] * len(handles)  # tokens streamed per choice (the logprob entries' keys)

        def rich_event(index: int, ids: list[int], delta: str) -> str:
            """A token event with logprobs and/or running usage (the slower, dict-built path)."""
            payload = chunk(index, delta, None)
            if logprobs:
                handle = handles[index]
                entries = [handle.logprobs.get(sent[index] + i) for i in range(len(ids))]
                entries = [e for e in entries if e is not None]
                payload["choices"][0]["logprobs"] = (chat_logprobs(text_of, entries) if kind == "chat"
                                                     else completion_logprobs(text_of, entries))
            if continuous:
                prompt = sum(len(h.request.prompt_ids) for h in handles)
                done = sum(sent) + len(ids)
                payload["usage"] = {"prompt_tokens": prompt, "completion_tokens": done,
                                    "total_tokens": prompt + done}
            return _sse(payload)

        async def events() -> AsyncIterator[str]:
            try:
                if kind == "chat":
                    for i in range(len(handles)):
                        yield _sse(chunk(i, None, None, role=True))
                async for index, ids in merged(handles):
                    if ids is not None:
                        delta = streams[index].push(ids)
                        if logprobs or continuous:
                            event = rich_event(index, ids, delta)
                            sent[index] += len(ids)
                            yield event
                        elif delta:
                            yield token_event(index, delta)
                        continue
                    result = handles[index].result()
                    if result.finish_reason == "error":  # the status line is sent: an error event, as vLLM does
                        yield _sse(openai_error(f"The request failed in the engine: {result.error}", 500))
                        yield _sse("[DONE]")
                        return
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

    def tool_stream(handles: list[RequestHandle], body: Any, mode: str, names: set[str],
                    logprobs: bool) -> StreamingResponse:
        """A streamed chat completion with tools: each choice's text is parsed for tool calls once it is complete,
        then sent as one delta (`tool_calls` with their index, id, name and whole arguments, or `content`)."""
        from clusteropt_cli.core.serve.structured import parse_tool_calls

        rid, now = "chatcmpl-" + uuid.uuid4().hex, int(time.time())

        def chunk(index: int, delta: dict[str, Any], reason: str | None, lp: Any = None) -> str:
            return _sse({"id": rid, "object": "chat.completion.chunk", "created": now, "model": served_model_name,
                         "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}]})

        async def events() -> AsyncIterator[str]:
            try:
                for i in range(len(handles)):
                    yield chunk(i, {"role": "assistant", "content": ""}, None)
                for i, handle in enumerate(handles):
                    result = await handle.wait()
                    if result.finish_reason == "error":
                        yield _sse(openai_error(f"The request failed in the engine: {result.error}", 500))
                        yield _sse("[DONE]")
                        return
                    content, calls = parse_tool_calls(result.text or "", mode, names)
                    lp = (chat_logprobs(text_of, [e for e in (result.logprobs or []) if e is not None])
                          if logprobs else None)
                    if content:
                        yield chunk(i, {"content": content}, None, lp)
                        lp = None
                    if calls:
                        yield chunk(i, {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}, None, lp)
                    reason = finish_reason(result)
                    yield chunk(i, {}, "tool_calls" if calls and reason == "stop" else reason)
                if body.include_usage():
                    yield _sse({"id": rid, "object": "chat.completion.chunk", "created": now,
                                "model": served_model_name, "choices": [],
                                "usage": usage([h.result() for h in handles])})
                yield _sse("[DONE]")
            finally:
                for h in handles:
                    if not h.done:
                        h.cancel()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def encode_all(texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        return [tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse(request, CompletionBody)
        if isinstance(body, JSONResponse):
            return body
        prompt = body.prompt
        if isinstance(prompt, str) or (prompt and all(isinstance(p, str) for p in prompt)):
            texts = [prompt] if isinstance(prompt, str) else list(prompt)
            chars = sum(len(t) for t in texts)
            if chars > max_prompt_chars:
                return too_long_prompt(chars, "prompt")
            prompts = await off_loop(encode_all, texts, body.add_special_tokens)
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]
        elif prompt and all(isinstance(p, list) for p in prompt):
            prompts = [list(p) for p in prompt]
        else:
            return error(400, "The prompt is empty.", param="prompt")
        if any(not p for p in prompts):
            return error(400, "The prompt is empty.", param="prompt")
        if body.max_tokens == 0 and not body.echo:
            return error(400, "max_tokens 0 is only for echo (prompt logprobs); ask for at least 1 token.",
                         param="max_tokens")
        # echo + logprobs: the prompt's logprobs too (lm-evaluation-harness' loglikelihood requests)
        prompt_lp = body.logprobs if (body.echo and body.logprobs is not None) else None
        grammar = await structured(body)
        if isinstance(grammar, JSONResponse):
            return grammar
        handles = submit_all([to_request(body, p, body.max_tokens, choice=j, logprobs=body.logprobs,
                                         prompt_logprobs=prompt_lp, grammar=grammar)
                              for p in prompts for j in range(body.n)])
        if not isinstance(handles, list):
            return handles
        if body.stream:
            return stream_response(handles, body, "completion", logprobs=body.logprobs is not None)
        try:
            results = await await_results(request, handles)
        except _ClientGone:
            return error(499, "Client disconnected.")
        bad = failed(results)
        if bad is not None:
            return bad
        echoed = (await off_loop(lambda: [tokenizer.decode(r.prompt_ids, skip_special_tokens=True)
                                          for r in results])) if body.echo else None
        choices = []
        for i, r in enumerate(results):
            text = r.text or ""
            if echoed is not None:
                text = echoed[i] + text
            lp = None
            if body.logprobs is not None:
                entries = [e for e in (r.logprobs or []) if e is not None]
                if body.echo:
                    entries = echo_entries(r.prompt_ids, r.prompt_logprobs) + entries
                lp = completion_logprobs(text_of, entries)
            choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": finish_reason(r),
                            "stop_reason": r.stop_reason, **token_ids(body, r)})
        return {"id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", "created": int(time.time()),
                "model": served_model_name, "choices": choices, "usage": usage(results)}

    def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool, kwargs: dict[str, Any],
                    add_special_tokens: bool = False) -> list[int]:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **kwargs)
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await parse(request, ChatBody)
        if isinstance(body, JSONResponse):
            return body
        from clusteropt_cli.core.serve.structured import StructuredOutputError, check_tools, parse_tool_calls

        extra = body.model_extra or {}
        try:
            functions, tool_mode = check_tools(extra.get("tools"), extra.get("tool_choice"))
        except StructuredOutputError as exc:
            return error(400, exc.message, param=exc.param)
        messages = [{"role": m.role, "content": m.text(),
                     **{k: v for k, v in (m.model_extra or {}).items() if k in ("tool_calls", "tool_call_id", "name")}}
                    for m in body.messages]
        chars = sum(len(m["content"]) for m in messages)
        if chars > max_prompt_chars:
            return too_long_prompt(chars, "messages")
        requested = dict(body.chat_template_kwargs or {})
        request_template = requested.pop("chat_template", None)
        where = "chat_template_kwargs.chat_template"
        if request_template is None and (body.model_extra or {}).get("chat_template") is not None:
            request_template, where = body.model_extra["chat_template"], "chat_template"  # vLLM's top-level field
        if request_template is not None and not limits.trust_request_chat_template:
            return error(400, "A chat template sent with the request is refused; the server uses the model's own "
                              "(start it with --trust-request-chat-template to allow them).",
                         param=where, code="unsupported_parameter")
        kwargs = {k: v for k, v in requested.items() if k in template_kwargs}
        if request_template is not None:
            if not isinstance(request_template, str) or len(request_template) > max_prompt_chars:
                return error(400, "chat_template must be a string of a reasonable size.", param=where)
            kwargs["chat_template"] = request_template
        if functions:  # rendered by the model's chat template (transformers' `tools` argument)
            kwargs["tools"] = [{"type": "function", "function": f} for f in functions]
        try:
            prompt_ids = await off_loop(render_chat, messages, body.add_generation_prompt, kwargs,
                                        body.add_special_tokens)
        except Exception as exc:  # noqa: BLE001 - template errors are the client's
            return error(400, f"Cannot apply the chat template: {exc}", param="messages")
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:
            max_tokens = max(1, engine.max_model_len - len(prompt_ids))
        top = (body.top_logprobs or 0) if body.logprobs else None
        grammar = await structured(body, functions, tool_mode)
        if isinstance(grammar, JSONResponse):
            return grammar
        handles = submit_all([to_request(body, prompt_ids, max_tokens, choice=j, logprobs=top, grammar=grammar)
                              for j in range(body.n)])
        if not isinstance(handles, list):
            return handles
        names = {f["name"] for f in functions}
        if body.stream and tool_mode is not None:
            return tool_stream(handles, body, tool_mode, names, top is not None)
        if body.stream:
            return stream_response(handles, body, "chat", logprobs=top is not None)
        try:
            results = await await_results(request, handles)
        except _ClientGone:
            return error(499, "Client disconnected.")
        bad = failed(results)
        if bad is not None:
            return bad
        choices = []
        for i, r in enumerate(results):
            message: dict[str, Any] = {"role": "assistant", "content": r.text or ""}
            reason = finish_reason(r)
            if tool_mode is not None:
                content, calls = parse_tool_calls(r.text or "", tool_mode, names)
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": calls}
                    reason = "tool_calls" if reason == "stop" else reason
            choices.append({"index": i, "message": message,
                            "logprobs": (chat_logprobs(text_of, [e for e in (r.logprobs or []) if e is not None])
                                         if top is not None else None),
                            "finish_reason": reason, "stop_reason": r.stop_reason, **token_ids(body, r)})
        return {"id": "chatcmpl-" + uuid.uuid4().hex, "object": "chat.completion", "created": int(time.time()),
                "model": served_model_name, "choices": choices, "usage": usage(results)}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's /tokenize: {"prompt": text} or {"messages": [...]} → {"count", "max_model_len", "tokens"}."""
        body = await json_body(request)
        if isinstance(body, JSONResponse):
            return body
        if not isinstance(body, dict):
            return error(400, "The request body must be a JSON object.")
        bad = check_model(body.get("model"))
        if bad is not None:
            return bad
        special = body.get("add_special_tokens", True)
        if "messages" in body:
            try:
                messages = [ChatMessage.model_validate(m) for m in body["messages"]]
                chars = sum(len(m.text()) for m in messages)
                if chars > max_prompt_chars:
                    return too_long_prompt(chars, "messages")
                ids = await off_loop(render_chat, [{"role": m.role, "content": m.text()} for m in messages],
                                     bool(body.get("add_generation_prompt", True)), {})
            except Exception as exc:  # noqa: BLE001 - the client's messages or template
                return error(400, f"Cannot apply the chat template: {exc}", param="messages")
        elif isinstance(body.get("prompt"), str):
            if len(body["prompt"]) > max_prompt_chars:
                return too_long_prompt(len(body["prompt"]), "prompt")
            ids = await off_loop(tokenizer.encode, body["prompt"], add_special_tokens=bool(special))
        else:
            return error(400, "Send 'prompt' (a string) or 'messages'.", param="prompt")
        out = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": None}
        if body.get("return_token_strs"):
            out["token_strs"] = await off_loop(tokenizer.convert_ids_to_tokens, ids)
        return out

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """vLLM's /detokenize: {"tokens": [ids]} → {"prompt": text}."""
        body = await json_body(request)
        if isinstance(body, JSONResponse):
            return body
        tokens = body.get("tokens") if isinstance(body, dict) else None
        vocab = engine.runner.vocab_size

        most = 4 * engine.max_model_len  # decoding holds the GIL: a bounded list keeps the event loop responsive

        def checked_decode() -> str | None:  # on a worker thread: the ids may be many
            if not isinstance(tokens, list) or len(tokens) > most or not all(
                    type(t) is int and 0 <= t < vocab for t in tokens):
                return None
            return tokenizer.decode(tokens)

        bad = check_model(body.get("model")) if isinstance(body, dict) else None
        if bad is not None:
            return bad
        text = await off_loop(checked_decode)
        if text is None:
            return error(400, f"'tokens' must be a list of at most {most} token ids in [0, {vocab}).",
                         param="tokens")
        return {"prompt": text}

    return app


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


def guarded_protocol(read_timeout: float, max_connections: int) -> type:
    """uvicorn's HTTP protocol (httptools or h11, as uvicorn picks) that closes a connection which has not sent a
    complete request head within `read_timeout` seconds of connecting or of its previous response (half-open and
    slowloris connections), and closes connections beyond `max_connections` as soon as they are accepted."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class GuardedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _head_timer: asyncio.TimerHandle | None = None

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
            super().connection_lost(exc)

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
               log_level: str = "warning", limits: ServerLimits | None = None, dead_linger_s: float = 1.0) -> int:
    """Serve until SIGTERM/SIGINT; then drain (no new requests, in-flight ones finish) and return 0. When the
    engine dies (an unrecoverable device error) the server answers 503/500 for `dead_linger_s` seconds, stops and
    returns ENGINE_DEAD_EXIT."""
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
                            http=guarded_protocol(limits.read_timeout, max_connections))
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

            previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGTERM, signal.SIGINT)}
            try:
                yield
            finally:
                for sig, old in previous.items():
                    signal.signal(sig, old)

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                self._watchdog = asyncio.ensure_future(self._watch_engine())
            if on_ready is not None and self.started:
                bound = [s.getsockname() for srv in self.servers for s in srv.sockets]
                actual = bound[0][1] if bound else port
                on_ready(f"http://{host}:{actual}")

        async def _watch_engine(self) -> None:
            """A dead engine cannot recover: let the in-flight requests get their 500, then stop (non-zero)."""
            nonlocal dead
            while not self.should_exit:
                thread = engine._thread
                if engine.error is not None or (thread is not None and not thread.is_alive()):
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
        server.run()
    finally:
        deadline = time.time() + grace_period
        while not dead and not engine.idle and time.time() < deadline:
            time.sleep(0.05)
        engine.stop()
        app.state.workers.shutdown(wait=False, cancel_futures=True)
    if dead:
        return ENGINE_DEAD_EXIT
    return 0 if server.started else 1
