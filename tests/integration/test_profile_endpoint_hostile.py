"""copt profile endpoint against broken or hostile servers: a raw HTTP server on 127.0.0.1 answers each path with
bytes of its choosing. Every bad answer fails its own request with a kind and a reason; none crashes the run, hangs
it past its bounds, puts NaN or a negative figure in the report, or makes the client hold more memory than a line."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
import tracemalloc
import zlib
from collections.abc import Callable

import pytest

SSE = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
DONE = b"data: [DONE]\n\n"


def event(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def text_event(text) -> bytes:
    return event({"choices": [{"index": 0, "text": text, "finish_reason": None}]})


def stream_with_usage(usage: bytes) -> bytes:
    """Three text events, then a usage event with `usage` as its raw JSON value."""
    return SSE + text_event(" a") + text_event(" b") + text_event(" c") + \
        b'data: {"choices": [], "usage": ' + usage + b"}\n\n" + DONE


def endless(head: bytes, piece: bytes, total: int) -> Callable[[socket.socket], None]:
    """`head`, then `piece` again and again up to `total` bytes (or until the client hangs up)."""
    def send(conn: socket.socket) -> None:
        conn.sendall(head)
        with_sent = 0
        while with_sent < total:
            conn.sendall(piece)
            with_sent += len(piece)
    return send


def response(status: str, body: bytes, headers: str = "") -> bytes:
    """A whole response; the server answers one request per connection."""
    return f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n{headers}\r\n".encode() + body


class RawServer:
    """Answers `/<name>/...` with ROUTES[<name>] (bytes, or a function of the socket); records (method, path,
    headers) of every request; 404 for what it does not know."""

    def __init__(self, routes: dict[str, bytes | Callable[[socket.socket], None]]):
        self.routes, self.seen = routes, []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                data = b""
                while b"\r\n\r\n" not in data:
                    got = conn.recv(65536)
                    if not got:
                        return
                    data += got
                head, _, body = data.partition(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
                while len(body) < int(headers.get("content-length", 0)):
                    body += conn.recv(65536)
                self.seen.append((method, path, headers))
                name = path.strip("/").split("/")[0] + ("/metrics" if path.endswith("/metrics") else "")
                answer = self.routes.get(name, response("404 Not Found", b""))
                if callable(answer):
                    answer(conn)
                else:
                    conn.sendall(answer)
                conn.shutdown(socket.SHUT_WR)
                while conn.recv(65536):  # until the client closes: nothing it has not read is lost
                    pass
            except OSError:
                return

    def close(self) -> None:
        self.sock.close()


ELSEWHERE = RawServer({"ok": stream_with_usage(b'{"completion_tokens": 3}'),
                       "ok/metrics": response("200 OK", b"vllm:prefix_cache_queries_total 1\n")})
GZIPPED = zlib.compressobj(6, zlib.DEFLATED, 31)
GZIPPED_STREAM = GZIPPED.compress(text_event(" a") + DONE) + GZIPPED.flush()
MARKUP_ERROR = json.dumps({"error": {"message": "bad [/x] [link=http://evil]y[/link] \x1b]52;c;aGk=\x07 \x1b[2J end"}})

ROUTES: dict[str, bytes | Callable[[socket.socket], None]] = {
    "ok": stream_with_usage(b'{"prompt_tokens": 4, "completion_tokens": 3}'),
    # events that are not completion chunks
    "choices-string": SSE + event({"choices": "abc"}) + DONE,
    "choices-object": SSE + event({"choices": {"0": {"text": "x"}}}) + DONE,
    "choice-number": SSE + event({"choices": [1]}) + DONE,
    "text-number": SSE + event({"choices": [{"text": 5}]}) * 3 + DONE,
    "delta-string": SSE + event({"choices": [{"delta": "x"}]}) + DONE,
    "event-array": SSE + event([1, 2]) + text_event("a") + DONE,
    "nested": SSE + b"data: " + b"[" * 100_000 + b"]" * 100_000 + b"\n\n" + DONE,
    "utf8": SSE + b'data: {"choices": [{"text": "\xff\xfe"}]}\n\n' + DONE,
    # more text events than max_tokens: a stream without end, ten bytes an event
    "tiny-events": endless(SSE, b'data: {"choices":[{"text":"a"}]}\n' * 1000, 64 * 2**20),
    # a proxy that splits each of 8 tokens into 3 events, with and without the usage count
    "rechunked": SSE + text_event("a") * 24 + b'data: {"choices": [], "usage": {"completion_tokens": 8}}\n\n' + DONE,
    "rechunked-no-usage": SSE + text_event("a") * 24 + DONE,
    # no events, or none with text
    "plain": response("200 OK", b"hello world", "Content-Type: text/plain\r\n"),
    "done-first": SSE + DONE,
    "empty-deltas": SSE + event({"choices": [{"text": ""}]}) * 100 + DONE,
    # usage that is not a token count
    "usage-negative": stream_with_usage(b'{"completion_tokens": -5}'),
    "usage-huge": stream_with_usage(b'{"completion_tokens": 1' + b"0" * 400 + b"}"),
    "usage-inf": stream_with_usage(b'{"completion_tokens": 1e999}'),
    "usage-nan": stream_with_usage(b'{"completion_tokens": NaN}'),
    "usage-string": stream_with_usage(b'{"completion_tokens": "3"}'),
    "usage-fraction": stream_with_usage(b'{"completion_tokens": 2.5}'),
    "usage-boolean": stream_with_usage(b'{"completion_tokens": true}'),
    "usage-over-max": stream_with_usage(b'{"completion_tokens": 1000000000000}'),
    "usage-array": stream_with_usage(b"[1, 2]"),
    "usage-prompt": stream_with_usage(b'{"completion_tokens": 3, "prompt_tokens": Infinity}'),
    "usage-whole-float": stream_with_usage(b'{"completion_tokens": 3.0, "prompt_tokens": 4}'),
    # redirects, to another server that would answer
    "r307": response("307 Temporary Redirect", b"", f"Location: {ELSEWHERE.url}/ok/v1/completions\r\n"),
    "r301": response("301 Moved Permanently", b"", f"Location: {ELSEWHERE.url}/ok/v1/completions\r\n"),
    "r307/metrics": response("307 Temporary Redirect", b"", f"Location: {ELSEWHERE.url}/ok/metrics\r\n"),
    # bodies the client must not inflate or hold whole
    "gzip": response("200 OK", GZIPPED_STREAM, "Content-Type: text/event-stream\r\nContent-Encoding: gzip\r\n"),
    "big-error": endless(b"HTTP/1.1 500 Internal Server Error\r\nConnection: close\r\n\r\n", b"x" * 2**16,
                         32 * 2**20),
    "big-metrics/metrics": endless(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n", b"\n" * 2**16, 32 * 2**20),
    "big-metrics": stream_with_usage(b'{"completion_tokens": 3}'),
    "nan-metrics/metrics": response("200 OK", b"vllm:prefix_cache_queries_total NaN\n"
                                              b"vllm:prefix_cache_hits_total 5\n"),
    "nan-metrics": stream_with_usage(b'{"completion_tokens": 3}'),
    # error bodies that are not what they seem
    "nested-error": response("500 Internal Server Error", b"[" * 100_000 + b"]" * 100_000),
    "loc-error": response("422 Unprocessable Entity", json.dumps({"detail": [{"loc": 5, "msg": "bad"}]}).encode()),
    "markup-error": response("500 Internal Server Error", MARKUP_ERROR.encode()),
    # connections that break
    "mid-headers": b"HTTP/1.1 200 OK\r\nContent-Ty",
}


@pytest.fixture(scope="module")
def hostile():
    server = RawServer(ROUTES)
    yield server
    server.close()


def run_level(url: str, gen_len: int = 8, requests: int = 2, timeout_s: float = 10.0):
    """One concurrency-1 level of `requests` against `url`: (level, {kind: the first reason})."""
    from clusteropt_cli.core.profile.endpoint import _run
    from clusteropt_cli.core.profile.settings import EndpointSettings

    settings = EndpointSettings(url=url, model="m", concurrency=[1], num_requests=requests, warmup=0,
                                gen_len=gen_len, prompt_len=4, request_timeout_s=timeout_s, api_key="sk-secret")
    levels, facts = asyncio.run(_run(settings, ["a b c"], lambda _m: None))
    return levels[0], facts["failures"]


def assert_sane(level) -> None:
    """Nothing in a level is NaN, infinite or negative."""
    figures = [level.duration_s, level.request_throughput, level.output_tokens_per_s]
    figures += [v for d in (level.ttft_s, level.itl_s, level.tpot_s, level.e2e_s) for v in d.values()]
    assert all(math.isfinite(v) and v >= 0 for v in figures), figures


@pytest.mark.parametrize("name, reason", [
    ("choices-string", "choices are a string, not an array"),
    ("choices-object", "choices are an object, not an array"),
    ("choice-number", "choice is a number, not an object"),
    ("text-number", "text is a number, not a string"),
    ("delta-string", "delta is a string, not an object"),
    ("event-array", "an event is an array, not an object"),
    ("nested", "not JSON (RecursionError)"),
    ("utf8", "not JSON (UnicodeDecodeError)"),
])
def test_an_event_that_is_not_a_completion_chunk_fails_its_request_as_a_bad_stream(hostile, name, reason):
    """Before: AttributeError/KeyError/RecursionError as `client_error:...`, or a number counted as a token."""
    level, failures = run_level(f"{hostile.url}/{name}")
    assert level.errors == {"bad_stream": 2} and level.completed == 0
    assert reason in failures["bad_stream"], failures
    assert_sane(level)


@pytest.mark.parametrize("name, reason", [
    ("usage-negative", "usage.completion_tokens is -5, not a count of 0 to max_tokens (8)"),
    ("usage-huge", "usage.completion_tokens is a 401-digit number"),
    ("usage-inf", "usage.completion_tokens is Infinity"),
    ("usage-nan", "usage.completion_tokens is NaN"),
    ("usage-string", "usage.completion_tokens is a string"),
    ("usage-fraction", "usage.completion_tokens is 2.5"),
    ("usage-boolean", "usage.completion_tokens is true"),
    ("usage-over-max", "usage.completion_tokens is 1000000000000, not a count of 0 to max_tokens (8)"),
    ("usage-array", "usage is an array, not an object"),
    ("usage-prompt", "usage.prompt_tokens is Infinity, not a count of 0 to 2^53"),
])
def test_usage_that_is_not_a_token_count_fails_its_request(hostile, name, reason):
    """Before: a traceback out of the run (int() of inf, NaN, a string, a 401-digit number too large for a float;
    .get of a list) or a negative or absurd throughput in the report."""
    level, failures = run_level(f"{hostile.url}/{name}")
    assert level.errors == {"bad_usage": 2} and level.completed == 0 and level.output_tokens_per_s == 0
    assert reason in failures["bad_usage"], failures
    assert_sane(level)


def test_the_log_gives_the_first_reason_of_each_kind_of_failure(hostile):
    """A level's failures are counted by kind in the report; the log says why, once per kind (before: only the
    warm-up's and the run's last words did)."""
    from clusteropt_cli.core.profile.endpoint import profile_endpoint
    from clusteropt_cli.core.profile.settings import EndpointSettings
    from clusteropt_cli.errors import CheckFailedError

    lines: list[str] = []
    with pytest.raises(CheckFailedError, match="bad_usage: usage.completion_tokens is -5"):
        profile_endpoint(EndpointSettings(url=f"{hostile.url}/usage-negative", model="m", concurrency=[1, 2],
                                          num_requests=2, warmup=0, gen_len=8, prompt_len=4), log=lines.append)
    reasons = [line for line in lines if line.startswith("  bad_usage:")]
    assert reasons == ["  bad_usage: usage.completion_tokens is -5, not a count of 0 to max_tokens (8)"]


def test_a_well_formed_usage_is_taken(hostile):
    level, _ = run_level(f"{hostile.url}/usage-whole-float")
    assert level.completed == 2 and level.errors == {}
    assert level.output_tokens_per_s == pytest.approx(6 / level.duration_s)
    assert_sane(level)


def test_a_stream_without_end_fails_the_request_at_once(hostile):
    """A server streaming tiny events without end: the request stops at 16 × max_tokens of them, instead of keeping
    a gap for each until --request-timeout and counting it a success of that many tokens."""
    start = time.perf_counter()
    level, failures = run_level(f"{hostile.url}/tiny-events", timeout_s=30)
    assert time.perf_counter() - start < 10
    assert level.errors == {"bad_stream": 2}
    assert failures["bad_stream"] == "more than 16 text events per token of max_tokens (8)"


def test_a_proxy_splitting_tokens_counts_by_usage_without_event_gaps(hostile, copt):
    """Before: 24 events for 8 tokens failed as bad_stream. Now the usage count gives the tokens and TPOT, and the
    gaps between events (a third of a token each) stay out of the ITL; without usage the count is unknown."""
    level, failures = run_level(f"{hostile.url}/rechunked")
    assert level.completed == 2 and level.errors == {} and level.rechunked == 2
    assert level.output_tokens_per_s == pytest.approx(16 / level.duration_s)
    assert level.itl_s == {} and level.tpot_s
    assert_sane(level)
    level, failures = run_level(f"{hostile.url}/rechunked-no-usage")
    assert level.errors == {"bad_stream": 2}
    assert failures["bad_stream"] == ("24 text events for max_tokens (8) and no usage count: the number of tokens "
                                      "is unknown")
    proc = copt("profile", "endpoint", "--url", f"{hostile.url}/rechunked", "--model", "m", "--concurrency", "1",
                "--num-requests", "2", "--gen-len", "8", "--warmup", "0", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "more text events than tokens" in proc.stdout and "c=1 2" in proc.stdout


@pytest.mark.parametrize("name, reason", [
    ("plain", "no server-sent events (data: lines) in the response (Content-Type text/plain)"),
    ("done-first", "the stream ended before any text"),
    ("empty-deltas", "the stream ended before any text"),
])
def test_an_answer_without_text_is_empty_and_says_why(hostile, name, reason):
    """Before: `empty` without a reason. Zero tokens are no request's TPOT or throughput (no division by zero)."""
    level, failures = run_level(f"{hostile.url}/{name}")
    assert level.errors == {"empty": 2} and failures == {"empty": reason}
    assert_sane(level)


def test_redirects_are_not_followed(hostile):
    """A 307 (POST again) or 301 (GET) to another port: before, aiohttp followed it and the level measured that
    server instead (and /metrics too); now the request fails as `redirect`, naming where, the other server sees
    nothing, and a run of nothing else refuses --url as bad input."""
    from clusteropt_cli.core.profile.endpoint import profile_endpoint
    from clusteropt_cli.core.profile.settings import EndpointSettings
    from clusteropt_cli.errors import BadInputError

    ELSEWHERE.seen.clear()
    for name, status in (("r307", 307), ("r301", 301)):
        level, failures = run_level(f"{hostile.url}/{name}")
        assert level.errors == {"redirect": 2} and level.prefix_cache_hit_rate is None
        assert failures["redirect"] == (f"HTTP {status} to {ELSEWHERE.url}/ok/v1/completions; redirects are not "
                                        "followed")
    assert ELSEWHERE.seen == []
    with pytest.raises(BadInputError, match="redirect: HTTP 307") as refused:
        profile_endpoint(EndpointSettings(url=f"{hostile.url}/r307", model="m", concurrency=[1], num_requests=1,
                                          warmup=0, gen_len=2, prompt_len=4, api_key="sk-secret"))
    assert "pass the URL the server names as --url" in refused.value.hint
    assert ELSEWHERE.seen == []


def test_bodies_are_neither_asked_for_nor_inflated_compressed(hostile):
    """Before: aiohttp asked for gzip and inflated what came, however large (a 300 MB line from a few hundred KB
    took 1.3 GB); now requests ask for identity and a compressed answer fails as a bad stream."""
    hostile.seen.clear()
    level, failures = run_level(f"{hostile.url}/gzip")
    assert level.errors == {"bad_stream": 2}
    assert failures["bad_stream"] == "the response is Content-Encoding gzip, not the identity asked for"
    assert {headers.get("accept-encoding") for _, _, headers in hostile.seen} == {"identity"}


def test_error_and_metrics_bodies_are_read_within_bounds(hostile):
    """A 500 with a 32 MB body and a 32 MB /metrics: before, each was read whole (and /metrics split into a list of
    its lines); now an error body is read up to 64 KiB and /metrics up to 8 MiB (longer: no hit rate)."""
    tracemalloc.start()
    try:
        level, failures = run_level(f"{hostile.url}/big-error", requests=1)
        _, peak = tracemalloc.get_traced_memory()
        assert level.errors == {"http_500": 1} and failures["http_500"] == "x" * 500
        assert peak < 12 * 2**20, peak
        tracemalloc.reset_peak()
        level, _ = run_level(f"{hostile.url}/big-metrics", requests=1)
        _, peak = tracemalloc.get_traced_memory()
        assert level.completed == 1 and level.prefix_cache_hit_rate is None
        assert peak < 24 * 2**20, peak
    finally:
        tracemalloc.stop()


def test_counters_that_are_not_counts_make_no_hit_rate(hostile):
    """A NaN counter (or one that runs backwards or finds more than it looked up) made a NaN or >100% hit rate."""
    from clusteropt_cli.core.profile.endpoint import hit_rate, prefix_cache_counters

    level, _ = run_level(f"{hostile.url}/nan-metrics", requests=1)
    assert level.completed == 1 and level.prefix_cache_hit_rate is None
    assert prefix_cache_counters("vllm:prefix_cache_queries_total inf\nvllm:prefix_cache_hits_total -3\n") is None
    assert hit_rate((10.0, 0.0), (20.0, 50.0)) is None and hit_rate((10.0, 0.0), (20.0, 5.0)) == 0.5


@pytest.mark.parametrize("name, kind, message", [
    ("nested-error", "http_500", "[[[["),  # before: client_error:RecursionError
    ("loc-error", "http_422", "5: bad"),  # before: client_error:TypeError
])
def test_an_error_body_keeps_its_status(hostile, name, kind, message):
    level, failures = run_level(f"{hostile.url}/{name}")
    assert level.errors == {kind: 2} and failures[kind].startswith(message)


def test_a_connection_closed_mid_headers_is_a_disconnect(hostile):
    level, _ = run_level(f"{hostile.url}/mid-headers")
    assert level.errors == {"disconnect": 2}  # already so before


def test_the_servers_words_reach_the_terminal_as_plain_text(hostile, copt):
    """An error message with rich markup and terminal escapes (OSC 52 writes the clipboard, CSI 2J clears the
    screen): before, the warm-up log line ended the run in an internal MarkupError (exit 1), and the escapes went to
    the terminal as they came; now the brackets print as text and the control characters as spaces."""
    proc = copt("profile", "endpoint", "--url", f"{hostile.url}/markup-error", "--model", "m", "--concurrency", "1",
                "--num-requests", "1", "--gen-len", "2", timeout=60)
    assert proc.returncode == 6, proc.stderr
    assert "warm-up request 1/1: failed (http_500: bad [/x] [link=http://evil]y[/link]" in proc.stderr
    assert "Every request" in proc.stderr and "\x1b" not in proc.stderr and "\x07" not in proc.stderr
