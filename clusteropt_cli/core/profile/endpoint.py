"""`copt profile endpoint`: an async load generator for OpenAI-compatible servers (streaming completions).

Each level (a concurrency, or a Poisson request rate) is bounded by a request count and/or a duration; every
request by a total timeout. Connection failures, HTTP errors, timeouts and broken streams are counted by kind,
never raised. TTFT = time to the first streamed text; ITL = gaps between streamed chunks; TPOT = (E2E − TTFT) /
(output tokens − 1), output tokens from the final `usage` chunk when the server sends it, else one per chunk.
A stream that ends with finish_reason "abort"/"error" counts as an error ("aborted").

A server is not trusted to be well-formed: a redirect is not followed (the API key stays with --url; "redirect"),
responses are asked for and read without content encoding, an error body is read up to ERROR_BODY_BYTES and
/metrics up to METRICS_BYTES, an event that is not an OpenAI completion chunk, more than RECHUNK_EVENTS × max_tokens
text events (a stream without end), more text events than max_tokens without a usage count (a proxy that split
tokens: their number is unknown) and a usage figure that is not a count up to max_tokens fail their request
("bad_stream", "bad_usage") with the reason, and what the server says reaches the terminal without control
characters. A stream of more text events than tokens (re-chunked by a proxy) keeps its TTFT, TPOT and tokens, not
its gaps between events, which are not gaps between tokens (`rechunked` in the level).

Output lengths: requests carry vLLM's `ignore_eos` so each runs to max_tokens. Servers that validate strictly
(`transformers serve`: HTTP 422 "Unexpected fields in the request: {'ignore_eos'}") reject it; unless
--ignore-eos forces it, copt then drops the field for the rest of the run, bounds outputs by max_tokens alone and
says so in the report (`workload.output_length_control`). A run in which every request failed raises with the
server's own error message.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import math
import random
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from typing import Any
from urllib.parse import urlparse

from clusteropt_cli import __version__
from clusteropt_cli.core.profile.report import EndpointLevel, HardwareInfo, ProfileReport
from clusteropt_cli.core.profile.settings import EndpointSettings, shown_url
from clusteropt_cli.core.profile.stats import latency_summary
from clusteropt_cli.core.profile.verdict import endpoint_verdict
from clusteropt_cli.core.textfiles import jsonl_rows, string_field
from clusteropt_cli.errors import BadInputError, CheckFailedError, CoptError

Log = Callable[[str], None]
WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "number group problem fact water story lot book word house door city road light music river").split()


@dataclass
class RequestResult:
    ok: bool
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    detail: str | None = None  # the server's error message (HTTP errors)
    sent_at: float | None = None  # time.time() when the request went out
    rechunked: bool = False  # more text events than tokens: its event gaps are not inter-token latencies

    def row(self, level: str) -> dict[str, Any]:
        """The request as one line of --save-requests."""
        return {"level": level, "sent_at": self.sent_at, "ok": self.ok, "error": self.error, "ttft_s": self.ttft_s,
                "tpot_s": self.tpot_s, "e2e_s": self.e2e_s, "output_tokens": self.output_tokens,
                "prompt_tokens": self.prompt_tokens}

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def completions_url(base: str) -> str:
    """The /v1/completions URL from a server root, a /v1 base or the full path."""
    base = base.rstrip("/")
    if base.endswith("/completions"):
        return base
    if base.endswith("/v1"):
        return base + "/completions"
    return base + "/v1/completions"


# ---- prompts -----------------------------------------------------------------------------------------------
def load_dataset_prompts(path: Any) -> list[str]:
    """Prompts from a .jsonl file: each line an object with 'prompt' or 'text' (or a JSON string)."""
    hint = "One JSON object per line, with a 'prompt' or 'text' field."
    prompts = []
    for number, obj in jsonl_rows(path, "--dataset", hint):
        text = obj if isinstance(obj, str) else string_field(obj, "prompt", "text")
        if not text:
            raise BadInputError(f"--dataset {path}: line {number} has no 'prompt' or 'text' string.", hint=hint)
        prompts.append(text)
    if not prompts:
        raise BadInputError(f"--dataset {path} has no prompts.", hint="Add lines like {\"prompt\": \"...\"}.")
    return prompts


class CycledPrompts:
    """A --dataset's prompts, sent in order and again from the top when the run needs more."""

    def __init__(self, prompts: list[str]):
        self.prompts, self.sent = prompts, 0

    def next(self) -> str:
        prompt = self.prompts[self.sent % len(self.prompts)]
        self.sent += 1
        return prompt


class SyntheticPrompts:
    """Random-word prompts that never repeat, within a run or across runs: a pool of `pool` bodies made up front
    (from `seed`), and each request's prompt a body under its own head — the run's tag (random words drawn anew
    for every run) and the request's number. A prefix cache hashes blocks from the first token on, so
    a repeated prompt (another level's, or an earlier run's against the same server) would skip its prefill and
    inflate throughput and TTFT figures; a new head costs one short encode, not a whole prompt's."""

    def __init__(self, pool: int, prompt_len: int, seed: int, tokenizer: str | None = None):
        rng = random.Random(seed)
        self.prompt_len = max(1, prompt_len)
        self.sent = 0
        self.tag = run_tag()
        bodies = [[rng.choice(WORDS) for _ in range(self.prompt_len + 8)] for _ in range(max(1, pool))]
        self.tok = None
        if tokenizer is None:
            self.bodies: list = bodies
            return
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(tokenizer)
        self.bodies = []
        for words in bodies:
            ids = self.tok(" " + " ".join(words), add_special_tokens=False)["input_ids"]
            if not ids:  # repeating nothing never reaches --prompt-len
                raise BadInputError(
                    f"--tokenizer {tokenizer}: it turns the prompts' English words into no tokens "
                    f"(its {type(self.tok).__name__} has no token for them)",
                    hint="Pass the served model's own tokenizer directory, or leave --tokenizer out "
                         "(prompts of --prompt-len words).")
            while len(ids) < self.prompt_len:
                ids = ids + ids
            self.bodies.append(ids[: self.prompt_len])

    def next(self) -> str:
        """The next prompt: request N's head on body N mod pool (exactly prompt_len tokens with a tokenizer)."""
        index, self.sent = self.sent, self.sent + 1
        head, body = f"{self.tag} request {index}:", self.bodies[index % len(self.bodies)]
        if self.tok is None:
            return " ".join((head.split() + body)[: self.prompt_len])
        ids = self.tok(head, add_special_tokens=False)["input_ids"]
        return self.tok.decode((ids + body)[: self.prompt_len])


def run_tag(words: int = 4) -> str:
    """Words drawn at random for one run (40^4 ≈ 2.6 million tags): the head that keeps its prompts apart from an
    earlier run's with the same --seed."""
    pick = random.SystemRandom()
    return " ".join(pick.choice(WORDS).capitalize() if i == 0 else pick.choice(WORDS) for i in range(words))


# ---- the server's prefix cache -------------------------------------------------------------------------------
# vLLM's counters of prompt tokens looked up in / served from the prefix cache (copt serve exports the same names)
PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS = "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"


def metrics_url(base: str) -> str:
    """The Prometheus /metrics URL of the server behind a root, /v1 or /v1/completions URL."""
    base = base.rstrip("/")
    for suffix in ("/completions", "/v1"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
    return base + "/metrics"


_COUNTER_LINE = re.compile(rf"^(?:{re.escape(PREFIX_CACHE_QUERIES)}|{re.escape(PREFIX_CACHE_HITS)})[{{ ].*$", re.M)
# a sample line: name, optional {labels} (quoted values may hold spaces and braces), value, optional timestamp
_SAMPLE = re.compile(r'^([^\s{]+)(?:\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})?\s+(\S+)(?:\s+-?\d+)?\s*$')
METRICS_BYTES = 8 * 2**20  # a /metrics body longer than this is not read: the counters are left unknown


def prefix_cache_counters(text: str) -> tuple[float, float] | None:
    """(prompt tokens looked up, found) in a Prometheus text exposition, summed over label sets; None when the
    server exports neither counter."""
    totals = {PREFIX_CACHE_QUERIES: 0.0, PREFIX_CACHE_HITS: 0.0}
    seen = False
    for match in _COUNTER_LINE.finditer(text):  # the counters' lines only: no list of every line of the body
        sample = _SAMPLE.match(match.group().rstrip("\r"))
        name = sample.group(1) if sample else None
        if name in totals:
            try:
                value = float(sample.group(2))
            except ValueError:
                continue
            if math.isfinite(value) and value >= 0:  # a counter: NaN, inf or below zero is not one
                totals[name] += value
                seen = True
    return (totals[PREFIX_CACHE_QUERIES], totals[PREFIX_CACHE_HITS]) if seen else None


def http_client(connections: int, request_timeout_s: float) -> Any:
    """The aiohttp client a level's requests go through: `connections` at most (0: no limit), a request's connect
    and read timeouts, and bodies asked for and read as sent (no gzip or deflate: nothing for a server to inflate in
    the client's memory)."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=connections)
    timeout = aiohttp.ClientTimeout(total=None, connect=min(5.0, request_timeout_s), sock_read=request_timeout_s)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=2**20, auto_decompress=False,
                                 headers={"Accept-Encoding": "identity"})


def request_options(url: str, api_key: str | None) -> dict[str, Any]:
    """Headers and proxy of every request to `url`, decided once per run: --api-key as a bearer token, else the
    ~/.netrc ($NETRC) entry of the host as basic auth; the proxy HTTP(S)_PROXY names unless NO_PROXY covers the host.
    (aiohttp's trust_env looks these up again for every request, the .netrc read in a worker thread: about a
    millisecond that lands in each measured TTFT.)"""
    import base64
    import netrc
    import os
    import urllib.request
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    host = parts.hostname or ""
    headers: dict[str, str] = {}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    else:
        try:
            entry = netrc.netrc(os.environ.get("NETRC") or None).authenticators(host)
        except (OSError, netrc.NetrcParseError):
            entry = None
        if entry and entry[0] is not None:
            token = base64.b64encode(f"{entry[0]}:{entry[2] or ''}".encode()).decode()
            headers["Authorization"] = f"Basic {token}"
    proxy = None if urllib.request.proxy_bypass(host) else urllib.request.getproxies().get(parts.scheme)
    return {"headers": headers, "proxy": proxy}


async def read_prefix_cache(client: Any, url: str, options: dict[str, Any]) -> tuple[float, float] | None:
    """The server's prefix-cache counters now, or None (no /metrics, no such counters, or not reachable)."""
    import aiohttp

    try:
        async with client.get(metrics_url(url), **options, allow_redirects=False,
                              timeout=aiohttp.ClientTimeout(total=5.0)) as resp:
            if resp.status != 200 or not _identity(resp):
                return None
            body = await read_capped(resp, METRICS_BYTES + 1)
            if len(body) > METRICS_BYTES:
                return None
            return prefix_cache_counters(body.decode("utf-8", "replace"))
    except Exception:  # noqa: BLE001 - the counters are descriptive; the load's figures do not depend on them
        return None


def hit_rate(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    """Prompt tokens found in the prefix cache over those looked up between two readings (None where the counters
    do not make a share: none looked up, or more found than looked up)."""
    if before is None or after is None or after[0] - before[0] <= 0:
        return None
    rate = max(0.0, after[1] - before[1]) / (after[0] - before[0])
    return rate if math.isfinite(rate) and rate <= 1.0 else None


RECHUNK_EVENTS = 16  # text events per token of max_tokens a stream may send (a proxy splitting tokens) before it fails
ERROR_BODY_BYTES = 64 * 1024  # what is read of an error response's body (its message is cut to 500 characters)


async def read_capped(resp: Any, limit: int) -> bytes:
    """At most `limit` bytes of a response's body, however long the body is."""
    body = bytearray()
    while len(body) < limit:
        part = await resp.content.read(limit - len(body))
        if not part:
            break
        body += part
    return bytes(body)


def _identity(resp: Any) -> bool:
    """Whether a response's body comes without content encoding (copt asks for none and decodes none)."""
    return resp.headers.get("Content-Encoding", "identity").strip().lower() in ("", "identity")


def printable(text: str, limit: int = 500) -> str:
    """A server's text as one line fit for a terminal: control and format characters (escape sequences, bidi
    overrides, newlines) as spaces, cut to `limit` characters."""
    return "".join(ch if ch.isprintable() else " " for ch in text[:limit]).strip()


def server_message(body: bytes) -> str:
    """The error message in an error response: OpenAI's error.message, FastAPI's detail, else the text (printable,
    at most 500 characters)."""
    text = body.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, a number past int's digits, or nested past the parser's depth
        return printable(text)
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            return printable(str(err["message"]))
        if isinstance(err, str):
            return printable(err)
        detail = data.get("detail", data.get("message"))
        if isinstance(detail, list):  # pydantic errors: [{"loc": [...], "msg": ...}, ...]
            return printable("; ".join(_pydantic_error(d) for d in detail[:20]))
        if detail is not None:
            return printable(str(detail))
    return printable(text)


def _pydantic_error(item: Any) -> str:
    if not isinstance(item, dict):
        return str(item)
    loc = item.get("loc", [])
    where = ".".join(map(str, loc)) if isinstance(loc, list) else str(loc)
    return f"{where}: {item.get('msg')}"


def rejects_ignore_eos(result: RequestResult) -> bool:
    """An HTTP 400/422 whose message names the ignore_eos field (or, for 422, extra fields in general)."""
    if result.error not in ("http_400", "http_422"):
        return False
    detail = (result.detail or "").lower()
    return "ignore_eos" in detail or (result.error == "http_422" and ("extra" in detail or "unexpected" in detail))


# ---- one request -------------------------------------------------------------------------------------------
class _BadResponse(Exception):
    """A response that is not what an OpenAI-compatible server sends: its request fails with `kind` and the reason."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind, self.reason = kind, reason


def _json_kind(value: Any) -> str:
    """What a parsed JSON value is, in JSON's words: "an object", "a string", ..."""
    kinds = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
             float: "a number"}
    return kinds.get(type(value), "null" if value is None else type(value).__name__)


def _first_choice(chunk: Any) -> dict[str, Any] | None:
    """A streamed event's first choice (None: no choices, as in the usage event); _BadResponse for an event that is
    not a completion chunk."""
    if not isinstance(chunk, dict):
        raise _BadResponse("bad_stream", f"an event is {_json_kind(chunk)}, not an object")
    choices = chunk.get("choices")
    if choices is None or choices == []:
        return None
    if not isinstance(choices, list):
        raise _BadResponse("bad_stream", f"an event's choices are {_json_kind(choices)}, not an array")
    if not isinstance(choices[0], dict):
        raise _BadResponse("bad_stream", f"an event's choice is {_json_kind(choices[0])}, not an object")
    return choices[0]


def _text_of(choice: dict[str, Any] | None) -> str:
    """The text a choice streams: `text` (completions) or `delta.content` (chat)."""
    if choice is None:
        return ""
    text = choice.get("text")
    if text is None:
        delta = choice.get("delta")
        if delta is not None and not isinstance(delta, dict):
            raise _BadResponse("bad_stream", f"an event's delta is {_json_kind(delta)}, not an object")
        text = (delta or {}).get("content")
    if text is not None and not isinstance(text, str):
        raise _BadResponse("bad_stream", f"an event's text is {_json_kind(text)}, not a string")
    return text or ""


def _count(usage: dict[str, Any], key: str, most: int, most_named: str) -> int | None:
    """usage[key] as a token count from 0 to `most` (None where the server leaves it out); _BadResponse for anything
    else: a negative, fractional, infinite or larger number, a string, a boolean."""
    value = usage.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= most:
        shown = json.dumps(value) if isinstance(value, (int, float)) else _json_kind(value)
        shown = shown if len(shown) <= 24 else f"a {len(shown)}-digit number"
        raise _BadResponse("bad_usage", f"usage.{key} is {shown}, not a count of 0 to {most_named}")
    return value


def _stream_error(error: Any) -> str:
    """The message of an error event (OpenAI's {"error": {"message": ...}}), printable."""
    message = error.get("message") if isinstance(error, dict) else error
    return printable(message if isinstance(message, str) else json.dumps(message)[:500])


async def one_request(client: Any, url: str, payload: dict[str, Any], options: dict[str, Any],
                      timeout_s: float) -> RequestResult:
    """Send one streaming completion over an aiohttp client (`options`: request_options()); never raises for network
    or server failures."""
    import aiohttp

    result = RequestResult(ok=False, sent_at=time.time())
    start = time.perf_counter()
    last: float | None = None
    chunks = events = 0
    usage: Any = None
    max_tokens = payload.get("max_tokens")
    content_type = ""

    async def consume() -> None:
        nonlocal last, chunks, events, usage, content_type
        # redirects are not followed: the request (and its Authorization) goes to --url's server alone
        async with client.post(url, json=payload, **options, allow_redirects=False) as resp:
            if 300 <= resp.status < 400:
                result.error = "redirect"
                result.detail = (f"HTTP {resp.status} to {printable(resp.headers.get('Location', '(no Location)'))}"
                                 "; redirects are not followed")
                return
            if resp.status != 200:
                result.error = f"http_{resp.status}"
                result.detail = server_message(await read_capped(resp, ERROR_BODY_BYTES))
                return
            if not _identity(resp):
                raise _BadResponse("bad_stream", f"the response is Content-Encoding "
                                   f"{printable(resp.headers['Content-Encoding'], 40)}, not the identity asked for")
            content_type = printable(resp.headers.get("Content-Type", ""), 80)
            async for raw in resp.content:  # one SSE line at a time (aiohttp splits on b"\n")
                if not raw.startswith(b"data:"):
                    continue
                events += 1
                data = raw[5:].strip()
                if data == b"[DONE]":
                    break
                try:
                    chunk = json.loads(data)
                except (ValueError, UnicodeDecodeError, RecursionError) as exc:
                    raise _BadResponse("bad_stream", f"an event is not JSON ({type(exc).__name__})") from None
                if isinstance(chunk, dict) and chunk.get("error"):
                    result.error = "stream_error"
                    result.detail = _stream_error(chunk["error"])
                    return
                choice = _first_choice(chunk)
                if choice is not None and choice.get("finish_reason") in ("abort", "error"):
                    result.error = "aborted"
                    return
                if chunk.get("usage"):
                    usage = chunk["usage"]
                text = _text_of(choice)
                if text:
                    if max_tokens is not None and chunks >= RECHUNK_EVENTS * max_tokens:  # a stream without end
                        raise _BadResponse("bad_stream", f"more than {RECHUNK_EVENTS} text events per token of "
                                                         f"max_tokens ({max_tokens})")
                    now = time.perf_counter()
                    if result.ttft_s is None:
                        result.ttft_s = now - start
                    elif last is not None:
                        result.itl_s.append(now - last)
                    last = now
                    chunks += 1

    try:
        await asyncio.wait_for(consume(), timeout=timeout_s)
    except _BadResponse as bad:
        result.error, result.detail = bad.kind, bad.reason
    except TimeoutError:
        result.error = "timeout"
    except aiohttp.ClientConnectorError:
        result.error = "connect"
    except aiohttp.InvalidURL:
        result.error = "bad_url"
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError):
        result.error = "disconnect"
    except (ValueError, aiohttp.http_exceptions.HttpProcessingError):  # e.g. a line longer than the client buffers
        result.error = "bad_stream"
    except aiohttp.ClientError as exc:
        result.error = f"http_error:{type(exc).__name__}"
    except Exception as exc:  # noqa: BLE001 - whatever one response does fails that request alone
        result.error = f"client_error:{type(exc).__name__}"
    if result.error is not None:
        return result
    result.e2e_s = time.perf_counter() - start
    if result.ttft_s is None:
        result.error = "empty"
        result.detail = ("the stream ended before any text" if events else
                         "no server-sent events (data: lines) in the response"
                         + (f" (Content-Type {content_type})" if content_type else ""))
        return result
    try:
        if usage is not None and not isinstance(usage, dict):
            raise _BadResponse("bad_usage", f"usage is {_json_kind(usage)}, not an object")
        most = (max_tokens, f"max_tokens ({max_tokens})") if max_tokens is not None else (2**53, "2^53")
        counted = _count(usage, "completion_tokens", *most) if usage else None
        if counted is None and max_tokens is not None and chunks > max_tokens:
            raise _BadResponse("bad_stream", f"{chunks} text events for max_tokens ({max_tokens}) and no usage "
                                             "count: the number of tokens is unknown")
        result.output_tokens = counted or chunks
        if chunks > result.output_tokens:  # a proxy split tokens into several events
            result.rechunked, result.itl_s = True, []
        result.prompt_tokens = (_count(usage, "prompt_tokens", 2**53, "2^53") if usage else None) or None
    except _BadResponse as bad:
        result.error, result.detail = bad.kind, bad.reason
        return result
    result.ok = True
    return result


# ---- levels ------------------------------------------------------------------------------------------------
class LoopLag:
    """How late the client's event loop runs while a level sends: a task that sleeps `interval_s` again and again
    and records how much later than asked it woke. A loop busy parsing streamed tokens wakes late, and so stamps,
    sends and reads every request late: those delays are in the level's TTFT and ITL, measured by the client and not
    by the server."""

    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self.samples: list[float] = []
        self._task: asyncio.Task | None = None

    async def _sample(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time()
            await asyncio.sleep(self.interval_s)
            self.samples.append(max(0.0, loop.time() - asked - self.interval_s))

    async def __aenter__(self) -> LoopLag:
        self._task = asyncio.get_running_loop().create_task(self._sample())
        return self

    async def __aexit__(self, *_exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


# a level whose client loop ran this late (p90) and at least this share of its TTFT p50 measured its own backlog
LOOP_LAG_WARN_S = 0.01
LOOP_LAG_WARN_SHARE = 0.2


def client_backlog_s(level: EndpointLevel | None) -> float | None:
    """The p90 of how late the level's client loop ran, where it is large enough to be part of the TTFT and ITL
    the level measured (LOOP_LAG_WARN_*); None otherwise (or no lag recorded: another tool's report)."""
    lag = ((level.client_loop_lag_s if level is not None else None) or {}).get("p90")
    if lag is None or lag < LOOP_LAG_WARN_S or lag < LOOP_LAG_WARN_SHARE * level.ttft_s.get("p50", 0.0):
        return None
    return lag


class _Runner:
    def __init__(self, s: EndpointSettings, client: Any, prompts: list[str] | CycledPrompts | SyntheticPrompts):
        self.s = s
        self.client = client
        # a --dataset's prompts (cycled), else synthetic ones that never repeat
        self.prompts = CycledPrompts(prompts) if isinstance(prompts, list) else prompts
        self.url = completions_url(s.url)
        self.options = request_options(self.url, s.api_key)
        self.send_ignore_eos = s.ignore_eos is not False
        self.rejection: str | None = None  # the server's message when it refused ignore_eos
        self.send_lag_s: list[float] = []  # the last rate level's: how late each request went out (by_rate)
        self.loop_lag_s: list[float] = []  # the last level's: how late the client's event loop woke (LoopLag)
        self.log: Log = lambda _msg: None

    def payload(self) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.s.model, "prompt": self.prompts.next(), "max_tokens": self.s.gen_len,
                                "temperature": self.s.temperature, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.s.top_p is not None:
            body["top_p"] = self.s.top_p
        if self.s.top_k is not None:
            body["top_k"] = self.s.top_k
        if self.send_ignore_eos:
            body["ignore_eos"] = True
        return body

    async def request(self) -> RequestResult:
        body = self.payload()
        result = await one_request(self.client, self.url, body, self.options, self.s.request_timeout_s)
        if self.s.ignore_eos is None and "ignore_eos" in body and rejects_ignore_eos(result):
            if self.send_ignore_eos:  # the first request to see it switches the run over
                self.send_ignore_eos = False
                self.rejection = f"{result.error.replace('_', ' ')}: {result.detail}"
                self.log(f"the server rejected ignore_eos ({self.rejection}); sending requests without it: output "
                         "lengths are bounded by max_tokens only (pass --ignore-eos to insist)")
            body.pop("ignore_eos")
            result = await one_request(self.client, self.url, body, self.options, self.s.request_timeout_s)
        return result

    def length_control(self) -> str:
        if self.send_ignore_eos:
            return "ignore_eos" + (" (forced by --ignore-eos)" if self.s.ignore_eos else "")
        if self.rejection:
            return f"max_tokens only: the server rejected ignore_eos ({self.rejection})"
        return "max_tokens only (--no-ignore-eos)"

    async def by_concurrency(self, concurrency: int, limit: int | None) -> tuple[list[RequestResult], float]:
        deadline = None if self.s.duration_s is None else time.perf_counter() + self.s.duration_s
        results: list[RequestResult] = []
        issued = 0

        async def worker() -> None:
            nonlocal issued
            while (limit is None or issued < limit) and (deadline is None or time.perf_counter() < deadline):
                issued += 1
                results.append(await self.request())

        start = time.perf_counter()
        async with LoopLag() as lag:
            await asyncio.gather(*(worker() for _ in range(concurrency)))
        self.loop_lag_s = lag.samples
        return results, time.perf_counter() - start

    async def by_rate(self, rate: float) -> tuple[list[RequestResult], float]:
        """Requests at poisson_send_times, each sent when the run's clock reaches its time (a loop busy with the
        streams in flight sends late, then catches up: the level keeps its rate); how late they went is
        `self.send_lag_s`."""
        start = time.perf_counter()
        tasks, lags = [], []
        async with LoopLag() as lag:
            for at in poisson_send_times(rate, duration_s=self.s.duration_s, requests=self.s.requests_for(None),
                                         seed=self.s.seed):
                wait = start + at - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                lags.append(max(0.0, time.perf_counter() - start - at))
                tasks.append(asyncio.create_task(self.request()))
            self.send_lag_s = lags
            results = list(await asyncio.gather(*tasks))
        self.loop_lag_s = lag.samples
        return results, time.perf_counter() - start


def poisson_send_times(rate: float, *, duration_s: float | None = None, requests: int | None = None,
                       seed: int = 0) -> Iterator[float]:
    """When a --rate level sends its requests, in seconds from its start: the first at 0, then exponential gaps of
    mean 1/rate from random.Random(seed), until `requests` were sent or the next would be at `duration_s` or later
    (endless when both are None). advise's open-loop replay sends at the same times."""
    if rate <= 0:
        raise ValueError("the rate must be positive")
    rng, at, sent = random.Random(seed), 0.0, 0
    while (requests is None or sent < requests) and (duration_s is None or at < duration_s):
        yield at
        sent += 1
        at += rng.expovariate(rate)


def summarize_level(results: list[RequestResult], duration_s: float, *, concurrency: int | None = None,
                    rate: float | None = None, slo_ttft_s: float | None = None,
                    slo_tpot_s: float | None = None) -> EndpointLevel:
    """Percentiles, throughput, goodput and errors by kind of one level."""
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    duration_s = max(duration_s, 1e-9)
    goodput = None
    if slo_ttft_s is not None or slo_tpot_s is not None:
        good = [r for r in ok if (slo_ttft_s is None or (r.ttft_s or 0) <= slo_ttft_s)
                and (slo_tpot_s is None or r.tpot_s is None or r.tpot_s <= slo_tpot_s)]
        goodput = len(good) / duration_s
    return EndpointLevel(
        concurrency=concurrency, rate=rate, requests=len(results), completed=len(ok), errors=errors,
        duration_s=duration_s, request_throughput=len(ok) / duration_s,
        output_tokens_per_s=sum(r.output_tokens for r in ok) / duration_s, goodput=goodput,
        ttft_s=latency_summary([r.ttft_s for r in ok if r.ttft_s is not None]),
        itl_s=latency_summary([gap for r in ok for gap in r.itl_s]),
        tpot_s=latency_summary([r.tpot_s for r in ok if r.tpot_s is not None]),
        e2e_s=latency_summary([r.e2e_s for r in ok if r.e2e_s is not None]),
        rechunked=sum(r.rechunked for r in ok),
    )


def _server_hardware(url: str) -> HardwareInfo:
    """The server's hardware is not visible over HTTP; for a loopback URL it is this machine's (and its host's
    speed, measured once the load is over)."""
    host = urlparse(url).hostname or ""
    if host in ("127.0.0.1", "localhost", "::1", "0.0.0.0"):
        from clusteropt_cli.core.hostspeed import python_loop_seconds

        try:
            from clusteropt_cli.hardware import detect_gpus

            gpus = detect_gpus()
        except Exception:  # noqa: BLE001 - hardware is descriptive here
            gpus = []
        if gpus:
            return HardwareInfo(device="cuda", name=gpus[0].name, catalog=gpus[0].catalog, count=len(gpus),
                                memory_bytes=gpus[0].memory_bytes, host_loop_s=python_loop_seconds())
        return HardwareInfo(device="cpu", name=f"local server at {url}", host_loop_s=python_loop_seconds())
    return HardwareInfo(device="remote", name=f"server at {url} (hardware not visible over HTTP)")


async def _run(s: EndpointSettings, prompts: list[str] | CycledPrompts | SyntheticPrompts, log: Log,
               requests_out: list[dict[str, Any]] | None = None) -> tuple[list[EndpointLevel], dict[str, Any]]:
    levels: list[EndpointLevel] = []
    # aiohttp, not httpx: at 128 streams httpx's pool spent ~150 µs of client CPU per streamed token against ~30 µs
    # (a 2-core host), so one client process capped what a fast server could be measured at
    # HTTP(S)_PROXY, NO_PROXY and .netrc apply (request_options), looked up once, not per request
    async with http_client(max(s.concurrency) + 4 if s.concurrency else 0, s.request_timeout_s) as client:
        runner = _Runner(s, client, prompts)
        runner.log = log
        failures: dict[str, str] = {}  # error kind → the server's first message for it

        def note(results: list[RequestResult]) -> list[str]:
            """Records the first message of each kind of failure; returns the kinds not seen before."""
            new = []
            for r in results:
                if not r.ok and r.error and r.error not in failures:
                    failures[r.error] = r.detail or ""
                    new.append(r.error)
            return new

        for i in range(s.warmup):
            warm = await runner.request()
            note([warm])
            log(f"warm-up request {i + 1}/{s.warmup}: " + ("ok" if warm.ok else f"failed ({warm.error}"
                                                           + (f": {warm.detail}" if warm.detail else "") + ")"))
        slo_ttft = s.slo_ttft_ms / 1e3 if s.slo_ttft_ms is not None else None
        slo_tpot = s.slo_tpot_ms / 1e3 if s.slo_tpot_ms is not None else None
        loads = [(f"concurrency {c}", partial(_concurrency_level, runner, c, prompts), {"concurrency": c})
                 for c in s.concurrency]
        loads += [(f"rate {rate}/s (Poisson)", partial(runner.by_rate, rate), {"rate": rate}) for rate in s.rate]
        for name, load, kind in loads:
            tag = f"c{kind['concurrency']}" if "concurrency" in kind else f"r{kind['rate']}"
            processes = s.client_processes_for(kind["concurrency"]) if "concurrency" in kind else 1
            log(f"{name}: sending {s.requests_for(kind.get('concurrency')) or 'for ' + str(s.duration_s) + ' s'}"
                + (f" from {processes} client processes" if processes > 1 else ""))
            before = await read_prefix_cache(client, s.url, runner.options)
            quiet_heap()
            results, duration = await load()
            first_seen = note(results)
            if requests_out is not None:
                requests_out.extend(r.row(tag) for r in results)
            level = summarize_level(results, duration, slo_ttft_s=slo_ttft, slo_tpot_s=slo_tpot, **kind)
            level.prefix_cache_hit_rate = hit_rate(before, await read_prefix_cache(client, s.url, runner.options))
            if "rate" in kind and runner.send_lag_s:
                level.send_lag_s = latency_summary(runner.send_lag_s)
            level.client_loop_lag_s = latency_summary(runner.loop_lag_s) or None
            levels.append(level)
            log(_level_line(level))
            for failure in first_seen:  # why, where the server said or copt could tell
                if failures[failure]:
                    log(f"  {failure}: {failures[failure]}")
            lagged = client_backlog_s(level)
            if lagged is not None:
                log(f"  the client's event loop ran late: p90 {lagged * 1e3:.1f} ms against a TTFT p50 of "
                    f"{level.ttft_s.get('p50', 0.0) * 1e3:.1f} ms; this level's TTFT and ITL include the client's own "
                    "backlog" + (" (more --client-processes share it out)" if "concurrency" in kind else ""))
            if level.send_lag_s and level.send_lag_s["p90"] > 0.5 / kind.get("rate", 1.0):
                log(f"  the client sent late: p90 {level.send_lag_s['p90'] * 1e3:.1f} ms after the request's Poisson "
                    "time (over half the mean gap): this host's event loop, busy with the streams in flight, bounds "
                    "the level")
            if (level.prefix_cache_hit_rate or 0.0) >= 0.01:
                log(f"  the server found {level.prefix_cache_hit_rate:.0%} of this level's prompt tokens in its prefix "
                    "cache: its TTFT and throughput include those hits (repeated --dataset prompts, or another "
                    "client's)")
    return levels, {"length_control": runner.length_control(), "failures": failures}


def quiet_heap() -> None:
    """Before a level: collect what the run has left so far and keep every object that exists now (the tokenizer,
    the prompts, earlier levels' results) out of the garbage collector's full collections while the level runs.
    A full collection stops the event loop that sends, reads and times every request: on the H200 host it held
    a --rate level's sends up to 0.28 s (p99) and would add as much to the TTFTs and ITLs of the streams in flight.
    profile_endpoint gives them back when the run ends, however it ends (a client process's end does)."""
    gc.collect()
    gc.freeze()


async def _concurrency_level(runner: _Runner, concurrency: int,
                             prompts: CycledPrompts | SyntheticPrompts) -> tuple[list[RequestResult], float]:
    """A concurrency level from one event loop, or split over client processes
    (EndpointSettings.client_processes_for)."""
    s = runner.s
    processes = s.client_processes_for(concurrency)
    if processes == 1:
        return await runner.by_concurrency(concurrency, s.requests_for(concurrency))
    if isinstance(prompts, CycledPrompts):
        share = [prompts.prompts[(prompts.sent + i) % len(prompts.prompts)] for i in range(len(prompts.prompts))]
        sources = [_PromptSource(dataset=share[i::processes] or share) for i in range(processes)]
    else:
        sources = [_PromptSource(pool=len(prompts.bodies), prompt_len=s.prompt_len, seed=s.seed + i,
                                 tokenizer=s.tokenizer) for i in range(processes)]
    outcome = await asyncio.to_thread(_level_in_processes, s, concurrency, sources, runner.send_ignore_eos)
    runner.loop_lag_s = outcome.loop_lag_s
    if outcome.rejection and runner.send_ignore_eos:
        runner.send_ignore_eos, runner.rejection = False, outcome.rejection
        runner.log(f"the server rejected ignore_eos ({outcome.rejection}); sending requests without it: output "
                   "lengths are bounded by max_tokens only (pass --ignore-eos to insist)")
    return outcome.results, outcome.duration_s


# ---- several client processes per level ---------------------------------------------------------------------
@dataclass
class _PromptSource:
    """How one client process makes its prompts: its share of a --dataset, or synthetic prompts under a run head
    of its own (SyntheticPrompts draws one per instance), so no two processes send the same prompt."""

    dataset: list[str] | None = None
    pool: int = 1
    prompt_len: int = 1
    seed: int = 0
    tokenizer: str | None = None

    def build(self) -> CycledPrompts | SyntheticPrompts:
        if self.dataset is not None:
            return CycledPrompts(self.dataset)
        return SyntheticPrompts(self.pool, self.prompt_len, self.seed, self.tokenizer)


@dataclass
class _LevelOutcome:
    results: list[RequestResult]
    duration_s: float
    rejection: str | None = None  # the server's message, where a process saw it reject ignore_eos
    loop_lag_s: list[float] = field(default_factory=list)  # every process's LoopLag samples


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


def _client_process(s: EndpointSettings, concurrency: int, limit: int | None, source: _PromptSource,
                    send_ignore_eos: bool, ready: Any, go: Any, out: Any) -> None:
    """One client process of a level: prompts and HTTP client first, then ready; sends once the parent says go
    (every process at once) and puts (results, start, end, rejection, loop lag samples) — wall-clock times — on
    `out`."""

    async def level() -> tuple[list[RequestResult], float, float, str | None, list[float]]:
        async with http_client(concurrency + 4, s.request_timeout_s) as client:
            runner = _Runner(s, client, source.build())
            runner.send_ignore_eos = send_ignore_eos
            quiet_heap()  # the process ends with the level: nothing to give back
            ready.put(True)
            await asyncio.to_thread(go.wait)
            start = time.time()
            results, _ = await runner.by_concurrency(concurrency, limit)
            return results, start, time.time(), runner.rejection, runner.loop_lag_s

    try:
        out.put(("done", *asyncio.run(level())))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the run with it
        ready.put(False)
        out.put(("failed", f"{type(exc).__name__}: {exc}"))


def _level_in_processes(s: EndpointSettings, concurrency: int, sources: list[_PromptSource],
                        send_ignore_eos: bool) -> _LevelOutcome:
    """Split a concurrency level over len(sources) spawned client processes (their streams and the level's request
    count shared out); the level's span runs from the first process's start to the last one's end."""
    import multiprocessing
    import queue

    ctx = multiprocessing.get_context("spawn")  # no fork of the parent's threads and event loop
    processes = len(sources)
    shares = _split(concurrency, processes)
    limit = s.requests_for(concurrency)
    limits = _split(limit, processes) if limit is not None else [None] * processes
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    workers = [ctx.Process(target=_client_process, daemon=True,
                           args=(s, shares[i], limits[i], sources[i], send_ignore_eos, ready, go, out))
               for i in range(processes)]
    try:
        for worker in workers:
            worker.start()
        for _ in workers:  # prompts (a tokenizer) and HTTP clients are made before any request goes out
            try:
                if not ready.get(timeout=300):
                    break
            except queue.Empty:
                break
        go.set()
        finished: list[tuple] = []
        wait_s = (s.duration_s or 0.0) + s.request_timeout_s * ((max(limits) or 1) if limit is not None else 1) + 60
        deadline = time.time() + wait_s
        while len(finished) < processes:
            try:
                finished.append(out.get(timeout=1.0))
            except queue.Empty:
                if time.time() > deadline or not any(w.is_alive() for w in workers) and out.empty():
                    break
        failed = [f[1] for f in finished if f[0] == "failed"]
        if failed or len(finished) < processes:
            raise CoptError(f"A client process of concurrency {concurrency} failed: "
                            + (failed[0] if failed else "it ended without results"),
                            hint="Run again with --client-processes 1 (one event loop sends every request).")
        return _LevelOutcome(results=[r for f in finished for r in f[1]],
                             duration_s=max(f[3] for f in finished) - min(f[2] for f in finished),
                             rejection=next((f[4] for f in finished if f[4]), None),
                             loop_lag_s=[lag for f in finished for lag in f[5]])
    finally:
        for worker in workers:
            worker.join(timeout=5)
            if worker.is_alive():
                worker.kill()


def _level_line(level: EndpointLevel) -> str:
    errors = f", errors {level.errors}" if level.errors else ""
    return f"  {level.completed}/{level.requests} ok, {level.output_tokens_per_s:.1f} output tok/s{errors}"


def profile_endpoint(s: EndpointSettings, log: Log | None = None,
                     requests_out: list[dict[str, Any]] | None = None) -> ProfileReport:
    """Run the sweep and return the ProfileReport (kind=endpoint); metrics are those of the highest load level
    that completed requests. `requests_out`: gets every timed request's RequestResult.row()."""
    log = log or (lambda _msg: None)
    s.validate()
    prompts: CycledPrompts | SyntheticPrompts
    if s.dataset is not None:
        prompts = CycledPrompts(load_dataset_prompts(s.dataset))
    else:
        largest = max([s.requests_for(c) or 256 for c in s.concurrency] + [s.requests_for(None) or 256])
        prompts = SyntheticPrompts(min(largest + s.warmup, 4096), s.prompt_len, s.seed, s.tokenizer)
        log(f"synthetic prompts: bodies from --seed {s.seed}, each under this run's head \"{prompts.tag} request N:\"")
    try:
        levels, facts = asyncio.run(_run(s, prompts, log, requests_out))
    finally:
        gc.unfreeze()  # what quiet_heap kept out of the collector's way goes back to it
    metrics: dict[str, float | None] = {}
    done = [lv for lv in levels if lv.completed > 0]
    if not done:
        raise _all_failed(s, levels, facts["failures"])
    if done:
        from clusteropt_cli.core.profile.expect import level_figures

        metrics.update(level_figures(done[-1]))
        metrics["max_output_tokens_per_s"] = max(lv.output_tokens_per_s for lv in done)
    total = sum(lv.requests for lv in levels)
    metrics["error_rate"] = (sum(sum(lv.errors.values()) for lv in levels) / total) if total else None
    verdict = endpoint_verdict(levels, slo_ttft_s=s.slo_ttft_ms / 1e3 if s.slo_ttft_ms else None,
                               slo_tpot_s=s.slo_tpot_ms / 1e3 if s.slo_tpot_ms else None)
    workload = {"url": shown_url(s.url), "concurrency": s.concurrency or None, "rate": s.rate or None,
                "num_requests": s.num_requests, "duration_s": s.duration_s, "prompt_len": s.prompt_len,
                "gen_len": s.gen_len, "dataset": str(s.dataset) if s.dataset else None,
                "slo_ttft_ms": s.slo_ttft_ms, "slo_tpot_ms": s.slo_tpot_ms,
                "ignore_eos": facts["length_control"].startswith("ignore_eos"),
                "output_length_control": facts["length_control"],
                "mean_output_tokens": _mean_output_tokens(levels), "temperature": s.temperature,
                "top_p": s.top_p, "top_k": s.top_k, "seed": s.seed,
                "client_processes": {str(c): s.client_processes_for(c) for c in s.concurrency} or None}
    return ProfileReport(kind="endpoint", mode="endpoint", created_at=datetime.now(UTC).isoformat(timespec="seconds"),
                         copt_version=__version__, hardware=_server_hardware(shown_url(s.url)), model={"name": s.model},
                         workload=workload, metrics=metrics, levels=levels, verdict=verdict)


def _mean_output_tokens(levels: list[EndpointLevel]) -> float | None:
    done = sum(lv.completed for lv in levels)
    tokens = sum(lv.output_tokens_per_s * lv.duration_s for lv in levels)
    return round(tokens / done, 1) if done else None


def _all_failed(s: EndpointSettings, levels: list[EndpointLevel], failures: dict[str, str]) -> Exception:
    """Every request failed: an error that passes on what the server said."""
    total = sum(lv.requests for lv in levels)
    kinds = ", ".join(f"{kind}: {msg}" if msg else kind for kind, msg in failures.items()) or "no requests sent"
    message = f"Every request to {shown_url(completions_url(s.url))} failed ({total} sent): {kinds}"
    if "redirect" in failures:
        return BadInputError(message, hint="copt does not follow a redirect (it would take --api-key to another "
                                           "address): pass the URL the server names as --url.")
    if any(k in ("http_404", "http_400", "http_401", "http_403", "http_422", "connect", "bad_url")
           for k in failures):
        hint = ("Check --url, --model (GET /v1/models lists the names the server serves) and --api-key."
                if "connect" not in failures else "Is the server running at --url?")
        return BadInputError(message, hint=hint)
    if failures and set(failures) <= {"bad_stream", "bad_usage", "empty"}:  # none at all: no request was sent
        return CheckFailedError(message, hint="Is --url an OpenAI-compatible server? copt reads /v1/completions "
                                              "streamed as server-sent events (data: lines of JSON chunks).")
    return CheckFailedError(message, hint="The server failed the requests; its log says why.")
