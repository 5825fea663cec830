"""The OpenAI routes of the server: /v1/models, /v1/completions, /v1/chat/completions (SSE streaming),
/tokenize and /detokenize. server.py builds the app around them (auth, body limits, error handlers, /health,
/metrics) and the server."""

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from clusteropt_cli.core.serve.batch_encoder import INLINE_ENCODE_CHARS, BatchEncoder
from clusteropt_cli.core.serve.engine import Engine
from clusteropt_cli.core.serve.openai_extras import (
    TokenText,
    chat_logprobs,
    completion_logprobs,
    echo_entries,
    vllm_prompt_logprobs,
)
from clusteropt_cli.core.serve.protocol import (
    MAX_PROMPTS,
    ChatBody,
    ChatMessage,
    CompletionBody,
    openai_error,
    unsupported_field,
)
from clusteropt_cli.core.serve.requests import (
    EngineDeadError,
    EngineStoppedError,
    GenerationRequest,
    GenerationResult,
    InvalidRequestError,
    QueueFullError,
    RequestHandle,
    TextStream,
    plain_decoder,
)
from clusteropt_cli.core.serve.server import ServerLimits
from clusteropt_cli.errors import BadInputError

if TYPE_CHECKING:
    from fastapi import Request
    from fastapi.responses import JSONResponse, StreamingResponse

# No `from __future__ import annotations`: FastAPI resolves the annotations of the route functions (`Request`) in
# the module they are defined in, and fastapi is imported only in add_openai_routes.

# names apply_chat_template gives meaning to itself: never taken from a request's chat_template_kwargs
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "tokenize", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "add_generation_prompt", "continue_final_message"})

# characters a chat template writes around each message (role header, separators), counted with the messages' text
# against --max-prompt-chars and for the choice to render on the event loop: the template's work grows with the
# message count even where the messages are empty
MESSAGE_TEMPLATE_CHARS = 16
# /v1/completions: a body larger than this and six bytes per --max-prompt-chars character cannot be text prompts
LARGE_BODY_BYTES = 2**20
INLINE_PARSE_BYTES = 64 * 1024  # a body up to this size is parsed on the event loop, a larger one on a worker thread
LARGE_BODY_OTHER_LISTS = 64  # lists a completions body may hold beside its prompts (stop, stop_token_ids, extras)
LARGE_BODY_OTHER_ITEMS = 4096  # items of its other fields (logit_bias, stop_token_ids, extras)
# /detokenize: the largest body parsed for --max-model-len × 4 token ids (each id with its separator and spaces, then
# the request's other fields)
DETOKENIZE_BYTES_PER_TOKEN = 16
DETOKENIZE_BODY_EXTRA_BYTES = 64 * 1024


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


class _ClientGone(Exception):
    pass


def _event_stream(events: Any) -> Any:
    """Server-sent events, unbuffered by proxies."""
    from fastapi.responses import StreamingResponse

    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


_json_str = json.encoder.encode_basestring_ascii  # json.dumps(text) for a str, without dumps' dispatch


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def _is_reply(value: Any) -> bool:
    """A helper answered with an error response instead of its value."""
    from fastapi.responses import JSONResponse

    return isinstance(value, JSONResponse)


def usage(results: list[GenerationResult], n: int = 1) -> dict[str, int]:
    """OpenAI's usage of a request: every prompt counted once (its n choices share it), every choice's output."""
    prompt = sum(r.num_prompt_tokens for r in results[:: max(1, n)])
    completion = sum(r.num_output_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def token_ids(body: Any, result: GenerationResult) -> dict[str, Any]:
    """vLLM's `return_token_ids` extra: the prompt and output token ids next to the text."""
    if not (body.model_extra or {}).get("return_token_ids"):
        return {}
    return {"prompt_token_ids": result.prompt_ids, "token_ids": result.output_ids}


def finish_reason(result: GenerationResult) -> str:
    return result.finish_reason if result.finish_reason in ("stop", "length") else "abort"


def _cancel_unfinished(handles: list[RequestHandle]) -> None:
    for h in handles:
        if not h.done:
            h.cancel()


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


class TokenStream:
    """The server-sent events of one streamed completion or chat completion: each choice's text as it is
    detokenized (with its logprobs and the running usage when asked), its finish reason, the usage, [DONE]."""

    def __init__(self, handles: list[RequestHandle], body: Any, kind: str, *, logprobs: bool, tokenizer: Any,
                 text_of: TokenText, served_model_name: str, decode: Any = None):
        self.handles, self.body, self.kind, self.logprobs = handles, body, kind, logprobs
        self.text_of, self.served_model_name = text_of, served_model_name
        self.rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self.now = int(time.time())
        decode = decode if decode is not None else plain_decoder(tokenizer)
        self.streams = [TextStream(tokenizer, body.stop_list(), decode) for _ in handles]
        # the per-token event, pre-rendered around the JSON-escaped text (the same document json.dumps of
        # chunk(index, text, None) gives, without building and encoding the dicts for every token)
        self.head = json.dumps({"id": self.rid, "object": self.obj, "created": self.now, "model": served_model_name},
                               separators=(",", ":"))[:-1] + ',"choices":[{"index":'
        self.field = ',"delta":{"content":' if kind == "chat" else ',"text":'
        self.tail = '},"logprobs":null,"finish_reason":null}]}\n\n' if kind == "chat" else (
            ',"logprobs":null,"finish_reason":null}]}\n\n')
        self.continuous = body.continuous_usage()
        self.sent = [0] * len(handles)  # tokens streamed per choice (the logprob entries' keys)

    def chunk(self, index: int, text: str | None, reason: str | None, role: bool = False) -> dict[str, Any]:
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else (
                {"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": reason}
        return {"id": self.rid, "object": self.obj, "created": self.now, "model": self.served_model_name,
                "choices": [choice]}

    def token_event(self, index: int, text: str) -> str:
        return f"data: {self.head}{index}{self.field}{_json_str(text)}{self.tail}"

    def rich_event(self, index: int, ids: list[int], delta: str) -> str:
        """A token event with logprobs and/or running usage (the slower, dict-built path)."""
        payload = self.chunk(index, delta, None)
        if self.logprobs:
            handle = self.handles[index]
            entries = [handle.logprobs.get(self.sent[index] + i) for i in range(len(ids))]
            entries = [e for e in entries if e is not None]
            payload["choices"][0]["logprobs"] = (chat_logprobs(self.text_of, entries) if self.kind == "chat"
                                                 else completion_logprobs(self.text_of, entries))
        if self.continuous:
            prompt = sum(len(h.request.prompt_ids) for h in self.handles[:: max(1, self.body.n)])
            done = sum(self.sent) + len(ids)
            payload["usage"] = {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
        return _sse(payload)

    def closing(self, index: int) -> tuple[list[str], bool]:
        """The events that end choice `index` once its handle is done, and whether they end the whole stream (the
        request failed in the engine)."""
        result = self.handles[index].result()
        if result.finish_reason == "error":  # the status line is sent: an error event, as vLLM does
            return [_sse(openai_error(f"The request failed in the engine: {result.error}", 500)), _sse("[DONE]")], True
        tail = self.streams[index].finish(result.text)
        return [_sse(self.chunk(index, tail, finish_reason(result)))], False

    async def events(self) -> AsyncIterator[str]:
        handles = self.handles
        try:
            if self.kind == "chat":
                for i in range(len(handles)):
                    yield _sse(self.chunk(i, None, None, role=True))
            if len(handles) == 1 and not (self.logprobs or self.continuous):
                # the common stream (one choice, plain text events): the handle's chunks without merged()'s layer
                push, render = self.streams[0].push, self.token_event
                async for ids in handles[0]:
                    delta = push(ids)
                    if delta:
                        yield render(0, delta)
                events, failed = self.closing(0)
                for event in events:
                    yield event
                if failed:
                    return
            else:
                async for index, ids in merged(handles):
                    if ids is not None:
                        delta = self.streams[index].push(ids)
                        if self.logprobs or self.continuous:
                            event = self.rich_event(index, ids, delta)
                            self.sent[index] += len(ids)
                            yield event
                        elif delta:
                            yield self.token_event(index, delta)
                        continue
                    events, failed = self.closing(index)
                    for event in events:
                        yield event
                    if failed:
                        return
            if self.body.include_usage():
                payload = {"id": self.rid, "object": self.obj, "created": self.now, "model": self.served_model_name,
                           "choices": [], "usage": usage([h.result() for h in handles], self.body.n)}
                yield _sse(payload)
            yield _sse("[DONE]")
        finally:
            _cancel_unfinished(handles)


class OpenAIRoutes:
    """The OpenAI endpoints over one engine, and what they share: the served model name, the limits, the
    tokenizer and the variables of its chat template, the model's sampling defaults and the grammar compiler.
    `error` and `invalid` build error responses; `off_loop` runs CPU work on the front end's worker threads."""

    def __init__(self, app: Any, engine: Engine, *, served_model_name: str, limits: ServerLimits,
                 off_loop: Callable, error: Callable, invalid: Callable):
        self.app, self.engine, self.served_model_name, self.limits = app, engine, served_model_name, limits
        self.off_loop, self.error, self.invalid = off_loop, error, invalid
        self.max_prompt_chars = limits.prompt_chars(engine.max_model_len)
        self.tokenizer = engine.tokenizer
        self.template_kwargs = template_variables(self.tokenizer)
        self.created = int(time.time())
        self.grammar_compiler: Any = None  # the structured.GrammarCompiler, built on the first constrained request
        self.defaults = getattr(engine, "sampling_defaults", None) or {}  # generation_config.json, as vLLM does
        self.text_of = TokenText(self.tokenizer)
        self.decode = plain_decoder(self.tokenizer)  # the streams' detokenizer (tokenizer.decode, skipping specials)
        self.submit_many = getattr(engine, "submit_many", None)  # the split server's EngineClient: one message
        trace = getattr(app.state, "api_trace", None)
        # concurrent requests' text prompts together
        self.prompt_encoder = BatchEncoder(self.tokenizer, off_loop,
                                           on_batch=trace.encoder_batch if trace is not None else None)

    # ---- request parsing and checks --------------------------------------------------------------------------

    @staticmethod
    def stamp(request: "Request", name: str) -> None:
        """Time a step of the request's intake (COPT_API_TRACE: the middleware gave it a dict of stamps)."""
        stamps = request.scope.get("copt_stamps")
        if stamps is not None and name not in stamps:
            stamps[name] = time.perf_counter()

    async def json_body(self, request: "Request") -> Any:
        """The body as plain JSON, parsed on a worker thread (lone surrogates are invalid JSON here: 400)."""
        import pydantic_core

        try:
            return await self.off_loop(pydantic_core.from_json, await request.body())
        except ValueError as exc:
            return self.error(400, f"The request body is not valid JSON (UTF-8 text without lone surrogates): {exc}.")

    async def parse(self, request: "Request", model: type) -> Any:
        """The body as `model`, parsed on a worker thread; an error response when it is malformed. A large body is
        read into plain objects first, then validated: pydantic's JSON mode held the GIL about 3× longer on
        millions of token ids, and the event loop (/health, every stream) waits while the GIL is held."""
        raw = await request.body()
        self.stamp(request, "body")
        try:
            if len(raw) > LARGE_BODY_BYTES:
                plain = await self.json_body(request)
                if _is_reply(plain):
                    return plain
                body = await self.off_loop(model.model_validate, plain)
            elif len(raw) > INLINE_PARSE_BYTES:
                body = await self.off_loop(model.model_validate_json, raw)
            else:  # tens of microseconds: less than the trip to a worker thread and back under load
                body = model.model_validate_json(raw)
        except ValidationError as exc:
            return self.invalid(list(exc.errors()))
        bad = self.check_model(body.model)
        if bad is not None:
            return bad
        field_ = unsupported_field(body)
        if field_ is not None:
            return self.error(400, f"'{field_}' is not supported by this server (copt serve); remove it from the "
                                   "request.", param=field_, code="unsupported_parameter")
        return body

    def check_model(self, name: str | None) -> "JSONResponse | None":
        if name and name not in (self.served_model_name, self.engine.model_name):
            return self.error(404, f"The model '{name}' does not exist; this server serves "
                                   f"'{self.served_model_name}'.",
                              err_type="not_found_error", param="model", code="model_not_found")
        return None

    def too_long_prompt(self, chars: int, param: str) -> "JSONResponse":
        return self.error(413, f"The prompt has {chars} characters; this server accepts at most "
                               f"{self.max_prompt_chars} (--max-prompt-chars).", param=param, code="prompt_too_long")

    def compile_grammar(self, build: Callable, *args: Any) -> Any:
        from clusteropt_cli.core.serve.structured import GrammarCompiler

        if self.grammar_compiler is None:
            self.grammar_compiler = GrammarCompiler(self.tokenizer, self.engine.runner.vocab_size,
                                                    self.engine.eos_ids)
        return build(*args, self.grammar_compiler)

    async def structured(self, body: Any, functions: list[dict[str, Any]] | None = None,
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
                spec: list = ["tools", functions, mode, parallel]
                grammar = await self.off_loop(self.compile_grammar, lambda *a: tool_grammar(*a, parallel=parallel),
                                              functions, mode)
            else:
                fmt = (body.model_extra or {}).get("response_format")
                if fmt is None or fmt == {"type": "text"}:
                    return None
                spec = ["response_format", fmt]
                grammar = await self.off_loop(self.compile_grammar, response_format_grammar, fmt)
        except StructuredOutputError as exc:
            return self.error(400, exc.message, param=exc.param)
        if grammar is not None and getattr(self.engine, "remote", False):  # the engine core compiles its spec
            from clusteropt_cli.core.serve.engine_client import WireGrammar

            return WireGrammar(spec, grammar)
        return grammar

    # ---- the engine: requests, submission, results -----------------------------------------------------------

    def to_request(self, body: Any, prompt_ids: list[int], max_tokens: int | None, *, choice: int = 0,
                   logprobs: int | None = None, prompt_logprobs: int | None = None,
                   grammar: Any = None) -> GenerationRequest:
        defaults = self.defaults
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

    async def submit_all(self, requests: list[GenerationRequest]) -> "list[RequestHandle] | JSONResponse":
        if self.app.state.draining:
            return self.error(503, "The server is shutting down.")
        cap = getattr(self.engine, "max_request_sequences", None)
        if isinstance(cap, int) and len(requests) > cap:
            return self.error(400, f"This request asks for {len(requests)} sequences (its prompts × n); the server "
                                   f"holds at most {cap} at once (--max-batch-size running plus --max-queue "
                                   "waiting). Send fewer prompts or a smaller n per request.", param="n")
        handles: list[RequestHandle] = []
        try:
            if self.submit_many is not None:
                handles = await self.submit_many(requests)
            else:
                first: dict[tuple[int, ...], RequestHandle] = {}  # n > 1: the choices share their prompt's prefill
                for req in requests:
                    key = tuple(req.prompt_ids)
                    handles.append(self.engine.submit(req, share_prompt_with=first.get(key)))
                    first.setdefault(key, handles[-1])
        except (BadInputError, QueueFullError, EngineStoppedError) as exc:
            for h in handles:
                h.cancel()
            if isinstance(exc, EngineDeadError):
                return self.error(500, exc.message, err_type="server_error", code="engine_dead")
            status = 400 if isinstance(exc, BadInputError) else 429 if isinstance(exc, QueueFullError) else 503
            param = exc.param if isinstance(exc, InvalidRequestError) else "prompt" if status == 400 else None
            return self.error(status, exc.message, param=param)
        return handles

    async def await_results(self, request: "Request", handles: list[RequestHandle]) -> list[GenerationResult]:
        """The results of every handle; _ClientGone (the handles cancelled) when the client disconnects."""
        tasks = [asyncio.ensure_future(h.wait()) for h in handles]
        try:
            while True:
                done, pending = await asyncio.wait(tasks, timeout=0.5)
                if not pending:
                    return [t.result() for t in tasks]
                if await request.is_disconnected():
                    raise _ClientGone()
        finally:
            _cancel_unfinished(handles)
            for t in tasks:
                t.cancel()

    async def results_or_error(self, request: "Request",
                               handles: list[RequestHandle]) -> "list[GenerationResult] | JSONResponse":
        """The results, or a 499 for a client gone, or a 500 for a request the engine failed (its own fault in a
        step, or a dead engine)."""
        try:
            results = await self.await_results(request, handles)
        except _ClientGone:
            return self.error(499, "Client disconnected.")
        for r in results:
            if r.finish_reason == "error":
                return self.error(500, f"The request failed in the engine: {r.error}", err_type="server_error",
                                  code="engine_dead" if self.engine.error is not None else "request_failed")
        return results

    # ---- tokenization -----------------------------------------------------------------------------------------

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool, kwargs: dict[str, Any],
                    add_special_tokens: bool = False) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **kwargs)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    # ---- streaming --------------------------------------------------------------------------------------------

    def stream_response(self, handles: list[RequestHandle], body: Any, kind: str, logprobs: bool = False,
                        request: "Request | None" = None) -> "StreamingResponse":
        stream = TokenStream(handles, body, kind, logprobs=logprobs, tokenizer=self.tokenizer, text_of=self.text_of,
                             served_model_name=self.served_model_name, decode=self.decode)
        trace = self.app.state.api_trace
        if trace is not None:  # COPT_API_TRACE: the request's times, recorded once its stream ends
            stamps = request.scope.get("copt_stamps", {}) if request is not None else {}
            return _event_stream(trace.traced(stream.events(), handles, stamps))
        return _event_stream(stream.events())

    def tool_stream(self, handles: list[RequestHandle], body: Any, mode: str, names: set[str],
                    logprobs: bool) -> "StreamingResponse":
        """A streamed chat completion with tools: each choice's text is parsed for tool calls once it is complete,
        then sent as one delta (`tool_calls` with their index, id, name and whole arguments, or `content`)."""
        from clusteropt_cli.core.serve.structured import parse_tool_calls

        rid, now, model = "chatcmpl-" + uuid.uuid4().hex, int(time.time()), self.served_model_name

        def chunk(index: int, delta: dict[str, Any], reason: str | None, lp: Any = None) -> str:
            return _sse({"id": rid, "object": "chat.completion.chunk", "created": now, "model": model,
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
                    lp = (chat_logprobs(self.text_of, [e for e in (result.logprobs or []) if e is not None])
                          if logprobs else None)
                    if content:
                        yield chunk(i, {"content": content}, None, lp)
                        lp = None
                    if calls:
                        yield chunk(i, {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}, None, lp)
                    reason = finish_reason(result)
                    yield chunk(i, {}, "tool_calls" if calls and reason == "stop" else reason)
                if body.include_usage():
                    yield _sse({"id": rid, "object": "chat.completion.chunk", "created": now, "model": model,
                                "choices": [], "usage": usage([h.result() for h in handles], body.n)})
                yield _sse("[DONE]")
            finally:
                _cancel_unfinished(handles)

        return _event_stream(events())

    # ---- GET /v1/models ---------------------------------------------------------------------------------------

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.served_model_name, "object": "model", "created": self.created,
                                            "owned_by": "copt", "max_model_len": self.engine.max_model_len}]}

    # ---- POST /v1/completions ---------------------------------------------------------------------------------

    async def completions(self, request: "Request") -> Any:
        raw = await request.body()
        self.stamp(request, "body")
        # a body past any text prompt's size (--max-prompt-chars) holds token ids: one of more lists or ids than
        # MAX_PROMPTS prompts of the context length (and a few other fields) hold is refused before parsing builds
        # its objects holding the GIL (1.2 s for 3M ids on 2 cores, /health waiting)
        text_bytes = 6 * self.max_prompt_chars + LARGE_BODY_BYTES  # "\uXXXX" per character
        if len(raw) > text_bytes:
            context = self.engine.max_model_len
            if raw.count(b"[") > MAX_PROMPTS + LARGE_BODY_OTHER_LISTS:
                return self.error(400, f"Invalid request: prompt: at most {MAX_PROMPTS} prompts in one request.",
                                  param="prompt")
            if raw.count(b",") > MAX_PROMPTS * context + LARGE_BODY_OTHER_ITEMS:
                return self.error(400, f"This model's maximum context length is {context} tokens; the request "
                                       f"holds more token ids than {MAX_PROMPTS} prompts of that length.",
                                  param="prompt")
        body = await self.parse(request, CompletionBody)
        if _is_reply(body):
            return body
        self.stamp(request, "parsed")
        prompts = await self.completion_prompts(body)
        if _is_reply(prompts):
            return prompts
        self.stamp(request, "encoded")
        if body.max_tokens == 0 and not body.echo:
            return self.error(400, "max_tokens 0 is only for echo (prompt logprobs); ask for at least 1 token.",
                              param="max_tokens")
        # echo + logprobs: the prompt's logprobs too (lm-evaluation-harness' loglikelihood requests); vLLM's
        # prompt_logprobs field asks for them on its own (the more alternatives of the two are computed)
        wanted = [k for k in (body.logprobs if body.echo else None, body.prompt_logprobs) if k is not None]
        prompt_lp = max(wanted) if wanted else None
        grammar = await self.structured(body)
        if _is_reply(grammar):
            return grammar
        handles = await self.submit_all([self.to_request(body, p, body.max_tokens, choice=j, logprobs=body.logprobs,
                                                         prompt_logprobs=prompt_lp, grammar=grammar)
                                         for p in prompts for j in range(body.n)])
        if not isinstance(handles, list):
            return handles
        if body.stream:
            return self.stream_response(handles, body, "completion", logprobs=body.logprobs is not None,
                                        request=request)
        results = await self.results_or_error(request, handles)
        if not isinstance(results, list):
            return results
        return {"id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", "created": int(time.time()),
                "model": self.served_model_name, "choices": await self.completion_choices(body, results),
                "usage": usage(results, body.n)}

    async def completion_prompts(self, body: Any) -> "list[list[int]] | JSONResponse":
        """The prompts' token ids: text (one or a list, tokenized on a worker thread), ids, or lists of ids."""
        prompt = body.prompt  # one of the shapes protocol.prompt_shape lets through: its first item tells which
        if isinstance(prompt, str) or isinstance(prompt[0], str):
            texts = [prompt] if isinstance(prompt, str) else list(prompt)
            chars = sum(len(t) for t in texts)
            if chars > self.max_prompt_chars:
                return self.too_long_prompt(chars, "prompt")
            prompts = await self.prompt_encoder.encode(texts, body.add_special_tokens)
        elif isinstance(prompt[0], int):
            prompts = [prompt]
        else:
            prompts = [list(p) for p in prompt]
        if any(not p for p in prompts):
            return self.error(400, "The prompt is empty.", param="prompt")
        longest = max(len(p) for p in prompts)  # refused here, not after millions of ids went to the engine
        if longest >= self.engine.max_model_len:
            return self.error(400, f"This model's maximum context length is {self.engine.max_model_len} tokens; the "
                                   f"prompt has {longest} tokens.", param="prompt")
        return prompts

    async def completion_choices(self, body: Any, results: list[GenerationResult]) -> list[dict[str, Any]]:
        echoed = (await self.off_loop(lambda: [self.tokenizer.decode(r.prompt_ids, skip_special_tokens=True)
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
                    echoed_lp = [e if e is None else (e[0], e[1], e[2][: body.logprobs])
                                 for e in (r.prompt_logprobs or [])]
                    entries = echo_entries(r.prompt_ids, echoed_lp) + entries
                lp = completion_logprobs(self.text_of, entries)
            choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": finish_reason(r),
                      "stop_reason": r.stop_reason, **token_ids(body, r)}
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(self.text_of, r.prompt_logprobs or [],
                                                                 r.prompt_ranks, body.prompt_logprobs)
            choices.append(choice)
        return choices

    # ---- POST /v1/chat/completions ----------------------------------------------------------------------------

    async def chat(self, request: "Request") -> Any:
        body = await self.parse(request, ChatBody)
        if _is_reply(body):
            return body
        self.stamp(request, "parsed")
        from clusteropt_cli.core.serve.structured import StructuredOutputError, check_tools

        extra = body.model_extra or {}
        try:
            functions, tool_mode = check_tools(extra.get("tools"), extra.get("tool_choice"))
        except StructuredOutputError as exc:
            return self.error(400, exc.message, param=exc.param)
        prompt_ids = await self.chat_prompt(body, functions)
        if _is_reply(prompt_ids):
            return prompt_ids
        self.stamp(request, "encoded")
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:
            max_tokens = max(1, self.engine.max_model_len - len(prompt_ids))
        top = (body.top_logprobs or 0) if body.logprobs else None
        grammar = await self.structured(body, functions, tool_mode)
        if _is_reply(grammar):
            return grammar
        handles = await self.submit_all([self.to_request(body, prompt_ids, max_tokens, choice=j, logprobs=top,
                                                         grammar=grammar) for j in range(body.n)])
        if not isinstance(handles, list):
            return handles
        names = {f["name"] for f in functions}
        if body.stream and tool_mode is not None:
            return self.tool_stream(handles, body, tool_mode, names, top is not None)
        if body.stream:
            return self.stream_response(handles, body, "chat", logprobs=top is not None, request=request)
        results = await self.results_or_error(request, handles)
        if not isinstance(results, list):
            return results
        response = {"id": "chatcmpl-" + uuid.uuid4().hex, "object": "chat.completion", "created": int(time.time()),
                    "model": self.served_model_name,
                    "choices": self.chat_choices(body, results, tool_mode, names, logprobs=top is not None),
                    "usage": usage(results, body.n)}
        if body.prompt_logprobs is not None:  # vLLM: one list for the request's (shared) prompt
            response["prompt_logprobs"] = vllm_prompt_logprobs(self.text_of, results[0].prompt_logprobs or [],
                                                               results[0].prompt_ranks, body.prompt_logprobs)
        return response

    async def chat_prompt(self, body: Any, functions: list[dict[str, Any]]) -> "list[int] | JSONResponse":
        """The messages rendered by the chat template (the model's own, or the request's when the server trusts
        them) with the template variables the request may set, and tokenized: on the event loop for short messages
        and the model's template, else on a worker thread."""
        overhead = len(body.messages) * MESSAGE_TEMPLATE_CHARS  # what the template writes around each message
        if overhead > self.max_prompt_chars:  # before any work: 500,000 empty messages stalled every stream
            return self.too_long_prompt(overhead, "messages")
        messages = [{"role": m.role, "content": m.text(),
                     **{k: v for k, v in (m.model_extra or {}).items() if k in ("tool_calls", "tool_call_id", "name")}}
                    for m in body.messages]
        chars = overhead + sum(len(m["content"]) for m in messages)
        if chars > self.max_prompt_chars:
            return self.too_long_prompt(chars, "messages")
        requested = dict(body.chat_template_kwargs or {})
        request_template = requested.pop("chat_template", None)
        where = "chat_template_kwargs.chat_template"
        if request_template is None and (body.model_extra or {}).get("chat_template") is not None:
            request_template, where = body.model_extra["chat_template"], "chat_template"  # vLLM's top-level field
        if request_template is not None and not self.limits.trust_request_chat_template:
            return self.error(400, "A chat template sent with the request is refused; the server uses the model's "
                                   "own (start it with --trust-request-chat-template to allow them).",
                              param=where, code="unsupported_parameter")
        kwargs = {k: v for k, v in requested.items() if k in self.template_kwargs}
        if request_template is not None:
            if not isinstance(request_template, str) or len(request_template) > self.max_prompt_chars:
                return self.error(400, "chat_template must be a string of a reasonable size.", param=where)
            kwargs["chat_template"] = request_template
        if functions:  # rendered by the model's chat template (transformers' `tools` argument)
            kwargs["tools"] = [{"type": "function", "function": f} for f in functions]
        try:
            if chars <= INLINE_ENCODE_CHARS and not functions and "chat_template" not in kwargs:
                # the model's own template over short messages: on the loop (see batch_encoder.INLINE_ENCODE_CHARS)
                return self.render_chat(messages, body.add_generation_prompt, kwargs, body.add_special_tokens)
            return await self.off_loop(self.render_chat, messages, body.add_generation_prompt, kwargs,
                                       body.add_special_tokens)
        except Exception as exc:  # noqa: BLE001 - template errors are the client's
            return self.error(400, f"Cannot apply the chat template: {exc}", param="messages")

    def chat_choices(self, body: Any, results: list[GenerationResult], tool_mode: str | None, names: set[str], *,
                     logprobs: bool) -> list[dict[str, Any]]:
        from clusteropt_cli.core.serve.structured import parse_tool_calls

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
                            "logprobs": (chat_logprobs(self.text_of, [e for e in (r.logprobs or []) if e is not None])
                                         if logprobs else None),
                            "finish_reason": reason, "stop_reason": r.stop_reason, **token_ids(body, r)})
        return choices

    # ---- POST /tokenize, POST /detokenize (vLLM's) -------------------------------------------------------------

    async def tokenize(self, request: "Request") -> Any:
        """vLLM's /tokenize: {"prompt": text} or {"messages": [...]} → {"count", "max_model_len", "tokens"}."""
        body = await self.json_body(request)
        if _is_reply(body):
            return body
        if not isinstance(body, dict):
            return self.error(400, "The request body must be a JSON object.")
        bad = self.check_model(body.get("model"))
        if bad is not None:
            return bad
        special = body.get("add_special_tokens", True)
        if "messages" in body:
            try:
                messages = [ChatMessage.model_validate(m) for m in body["messages"]]
                chars = sum(len(m.text()) for m in messages)
                if chars > self.max_prompt_chars:
                    return self.too_long_prompt(chars, "messages")
                ids = await self.off_loop(self.render_chat, [{"role": m.role, "content": m.text()} for m in messages],
                                          bool(body.get("add_generation_prompt", True)), {})
            except Exception as exc:  # noqa: BLE001 - the client's messages or template
                return self.error(400, f"Cannot apply the chat template: {exc}", param="messages")
        elif isinstance(body.get("prompt"), str):
            if len(body["prompt"]) > self.max_prompt_chars:
                return self.too_long_prompt(len(body["prompt"]), "prompt")
            (ids,) = await self.prompt_encoder.encode([body["prompt"]], bool(special))
        else:
            return self.error(400, "Send 'prompt' (a string) or 'messages'.", param="prompt")
        out = {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids, "token_strs": None}
        if body.get("return_token_strs"):
            out["token_strs"] = await self.off_loop(self.tokenizer.convert_ids_to_tokens, ids)
        return out

    async def detokenize(self, request: "Request") -> Any:
        """vLLM's /detokenize: {"tokens": [ids]} → {"prompt": text}."""
        vocab = self.engine.runner.vocab_size
        most = 4 * self.engine.max_model_len  # decoding holds the GIL: a bounded list keeps the event loop responsive
        # parsing builds one Python int per id while holding the GIL (seconds for millions of them, /health waits):
        # a body too large for `most` ids and the other fields is refused before it is parsed
        if len(await request.body()) > DETOKENIZE_BYTES_PER_TOKEN * most + DETOKENIZE_BODY_EXTRA_BYTES:
            return self.error(400, f"'tokens' must be a list of at most {most} token ids in [0, {vocab}).",
                              param="tokens")
        body = await self.json_body(request)
        if _is_reply(body):
            return body
        tokens = body.get("tokens") if isinstance(body, dict) else None

        def checked_decode() -> str | None:  # on a worker thread: the ids may be many
            if not isinstance(tokens, list) or len(tokens) > most or not all(
                    type(t) is int and 0 <= t < vocab for t in tokens):
                return None
            return self.tokenizer.decode(tokens)

        bad = self.check_model(body.get("model")) if isinstance(body, dict) else None
        if bad is not None:
            return bad
        text = await self.off_loop(checked_decode)
        if text is None:
            return self.error(400, f"'tokens' must be a list of at most {most} token ids in [0, {vocab}).",
                              param="tokens")
        return {"prompt": text}


def add_openai_routes(app: Any, engine: Engine, *, served_model_name: str, limits: ServerLimits,
                      off_loop: Callable, error: Callable, invalid: Callable, engine_dead: Callable) -> None:
    """Register the OpenAI endpoints on `app` (build_app calls it with its error and off-loop helpers)."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    routes = OpenAIRoutes(app, engine, served_model_name=served_model_name, limits=limits, off_loop=off_loop,
                          error=error, invalid=invalid)

    def reply(value: Any) -> Any:
        """A reply document as a JSONResponse: the routes build plain JSON types, so FastAPI's jsonable_encoder
        walk of every value gives nothing json.dumps does not (on the CPU test machine, lm-evaluation-harness'
        kind of request — 40-token prompts, echo, 5 logprobs — took the API process 1.21 ms instead of 1.65)."""
        return JSONResponse(value) if isinstance(value, dict) else value

    @app.get("/v1/models")
    async def models():
        return reply(routes.models())

    @app.post("/v1/completions")
    async def completions(request: Request):
        return reply(await routes.completions(request))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return reply(await routes.chat(request))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return reply(await routes.tokenize(request))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return reply(await routes.detokenize(request))
