"""`copt serve` against hostile clients: one request can fail only itself, never freeze or poison the server.

Poison payloads and malformed fields get a 4xx naming the field while other requests keep streaming; injected
faults in an engine step fail only the request they belong to; a device error kills the engine (/health 503,
every request 500, run_server returns non-zero); big bodies, prompts and template bombs never stall /health;
half-open connections are closed, and so are bodies trickled byte by byte; a client that stops reading its stream is
cut and its requests cancelled; clients that disconnect (streamed or not, n > 1, queued) leave nothing behind in the
engine; the API key holds (empty keys refused, /metrics behind it)."""

from __future__ import annotations

import json
import select
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest

from tests.integration.test_serve_helpers import free_port, running_server

pytestmark = pytest.mark.slow
KEY = "sk-hostile"
AUTH = {"Authorization": f"Bearer {KEY}"}
POISON = {"prompt": "x", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [999999]}


@pytest.fixture(scope="module")
def server(fixtures):
    with running_server(fixtures.teacher, "--api-key", KEY, "--max-model-len", "512", "--read-timeout", "2",
                        "--write-timeout", "2", "--max-connections", "40") as (url, proc):
        yield url


def stream(url: str, body: dict, headers: dict | None = None) -> dict:
    """One streamed completion: its text, last finish_reason and any error event."""
    out = {"text": "", "finish_reason": None, "error": None, "status": None}
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, headers=headers or AUTH,
                      timeout=120) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out["error"] = event["error"]
                continue
            for choice in event["choices"]:
                out["text"] += choice["text"]
                out["finish_reason"] = choice["finish_reason"] or out["finish_reason"]
    return out


@contextmanager
def health_watch(url: str):
    """Polls /health while the block runs; yields the list of (status, seconds) samples."""
    samples: list[tuple[int, float]] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=10) as client:
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    status = client.get(url + "/health").status_code
                except httpx.HTTPError:
                    status = -1
                samples.append((status, time.perf_counter() - t0))
                time.sleep(0.05)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()


def six_streams(url: str, tokens: int = 40) -> list:
    pool = ThreadPoolExecutor(6)
    return [pool.submit(stream, url, {"prompt": f"def f{i}(x):", "max_tokens": tokens, "temperature": 0,
                                      "ignore_eos": True}) for i in range(6)]


def test_poison_request_is_refused_while_six_others_stream(server):
    futures = six_streams(server)
    time.sleep(0.3)
    r = httpx.post(server + "/v1/completions", json=POISON, headers=AUTH, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"
    # suppressing every token of the vocabulary (min_tokens with all ids as stop ids, sampling) is refused too
    r = httpx.post(server + "/v1/completions", headers=AUTH, timeout=30, json={
        "prompt": "x", "max_tokens": 4, "min_tokens": 2, "temperature": 1.0, "stop_token_ids": list(range(1024))})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"
    results = [f.result(timeout=120) for f in futures]
    assert [r["finish_reason"] for r in results] == ["length"] * 6
    assert all(r["error"] is None and r["text"] for r in results)
    assert httpx.get(server + "/health").status_code == 200


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": [5, 999999], "max_tokens": 4}, "prompt"),
    ({"prompt": [[5, 6], [7, -1]], "max_tokens": 4}, "prompt"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids.0"),
    ({"prompt": "x", "max_tokens": 4, "min_tokens": 9}, "min_tokens"),
    ({"prompt": "x", "seed": 2**64}, "seed"),
    ({"prompt": "x", "seed": -(2**63) - 1}, "seed"),
    ({"prompt": "x", "top_k": 2**64}, "top_k"),
    ({"prompt": "x", "max_tokens": 2**70, "min_tokens": 2**65}, "min_tokens"),
    ({"prompt": "x", "logit_bias": {"99999999999999999999999": 1}}, "logit_bias"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 65}, "n"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "stop": ["a"] * 17}, "stop"),
    ({"prompt": "x", "stop": "s" * 300}, "stop"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "echo": True, "stream": True}, "echo"),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "response_format": {"type": "yaml"}}, "response_format.type"),
    ({"prompt": "x", "logit_bias": {"²": 1}}, "logit_bias"),  # a digit to str.isdigit, not to int()
    ({"prompt": "x", "logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    ({"prompt": ["a"] * 1024, "max_tokens": 1, "n": 2}, "n"),  # more sequences than the server ever holds: not 429
])
def test_bad_fields_get_400_naming_the_field(server, body, param):
    r = httpx.post(server + "/v1/completions", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and set(error) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0]"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format.json_schema"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
    ({"top_logprobs": 5}, "top_logprobs"),  # without logprobs: true (vLLM and OpenAI refuse it too)
    ({"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"),
    ({"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}, "messages.0.content"),
])
def test_chat_fields_the_server_cannot_honour_get_400(server, extra, param):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    r = httpx.post(server + "/v1/chat/completions", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_lone_surrogate_and_defaults_that_change_nothing(server):
    headers = {**AUTH, "Content-Type": "application/json"}
    for path, body in (("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}'),
                       ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}]}'),
                       ("/tokenize", b'{"prompt": "a\\ud800b"}')):
        r = httpx.post(server + path, content=body, headers=headers)
        assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], (path, r.text)
    # what OpenAI clients send by default is not refused
    ok = httpx.post(server + "/v1/completions", headers=AUTH, timeout=60, json={
        "prompt": "x", "max_tokens": 2, "n": 1, "best_of": 1, "logprobs": None, "presence_penalty": 0,
        "frequency_penalty": 0.0, "logit_bias": {}, "echo": False, "seed": 2**64 - 1, "temperature": 0.5})
    assert ok.status_code == 200, ok.text
    chat = httpx.post(server + "/v1/chat/completions", headers=AUTH, timeout=60, json={
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 2,
        "tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "logprobs": False})
    assert chat.status_code == 200, chat.text


def test_huge_body_and_huge_prompt_never_stall_health(server):
    with health_watch(server) as samples:
        body = b'{"prompt": "' + b"a" * (20 * 2**20) + b'", "max_tokens": 2}'
        r = httpx.post(server + "/v1/completions", content=body, timeout=60,
                       headers={**AUTH, "Content-Type": "application/json"})
        assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]
        # under the body cap, over the prompt's character cap (64 per token of the 512-token context)
        r = httpx.post(server + "/v1/completions", json={"prompt": "ab " * 200_000, "max_tokens": 2}, headers=AUTH,
                       timeout=60)
        assert r.status_code == 413 and r.json()["error"]["param"] == "prompt"
        assert "--max-prompt-chars" in r.json()["error"]["message"]
        r = httpx.post(server + "/v1/chat/completions", headers=AUTH, timeout=60,
                       json={"messages": [{"role": "user", "content": "ab " * 200_000}], "max_tokens": 2})
        assert r.status_code == 413 and r.json()["error"]["param"] == "messages"
        # vLLM's /tokenize and /detokenize: the same caps, parsed and decoded on worker threads
        r = httpx.post(server + "/tokenize", headers=AUTH, timeout=60,
                       json={"messages": [{"role": "user", "content": "ab " * 200_000}]})
        assert r.status_code == 413 and r.json()["error"]["param"] == "messages"
        r = httpx.post(server + "/detokenize", headers=AUTH, timeout=60, json={"tokens": [5, 300, 700] * 1_000_000})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
        # under both caps: tokenized on a worker thread, refused by the engine as longer than the context
        r = httpx.post(server + "/v1/completions", json={"prompt": "def f(x): " * 6000, "max_tokens": 2},
                       headers=AUTH, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        time.sleep(0.3)
    assert len(samples) >= 5 and all(status == 200 for status, _ in samples)
    assert max(seconds for _, seconds in samples) < 1.0


def test_huge_token_id_prompts_are_refused_fast_and_never_stall_health(server):
    """Bodies under --max-request-bytes that are millions of token ids: one prompt of 3M ids, 1M prompts of three
    ids, 2,000 prompts. Each is refused with 400 naming the prompt (the context length, at most 1,024 prompts) in
    about a second, while /health keeps answering (pydantic's union of list types took 3-7 s on such bodies, the
    engine queued 1,024 of the million before answering 429)."""
    # encoded before the watch: encoding holds this process's GIL, which the watching thread shares
    bodies = [(json.dumps({"prompt": prompt, "max_tokens": 2}).encode(), says)
              for prompt, says in (([5, 300, 700] * 1_000_000, "maximum context length"),
                                   ([[5, 300, 700]] * 1_000_000, "at most 1024 prompts"),
                                   ([[5, 300, 700]] * 2000, "at most 1024 prompts"))]
    with health_watch(server) as samples:
        for body, says in bodies:
            t0 = time.perf_counter()
            r = httpx.post(server + "/v1/completions", content=body, timeout=60,
                           headers={**AUTH, "Content-Type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text[:200]
            assert says in r.json()["error"]["message"] and time.perf_counter() - t0 < 5
        time.sleep(0.3)
    assert len(samples) >= 5 and all(status == 200 for status, _ in samples)
    assert max(seconds for _, seconds in samples) < 1.0


def test_a_flood_of_empty_messages_is_refused_fast_and_health_stays_fast(server):
    """The template's work grows with the message count even where every message is empty: 500,000 of them once
    stalled every stream for seconds."""
    body = json.dumps({"messages": [{"role": "user", "content": ""}] * 200_000, "max_tokens": 1})
    with health_watch(server) as samples:
        r = httpx.post(server + "/v1/chat/completions", content=body, timeout=60,
                       headers={**AUTH, "Content-Type": "application/json"})
        time.sleep(0.3)
    assert r.status_code == 413 and r.json()["error"]["param"] == "messages", r.text
    assert all(status == 200 for status, _ in samples) and max(s for _, s in samples) < 1.0


def test_usage_counts_each_prompt_once_for_n_choices(server):
    """OpenAI's usage: the n choices share their prompt (vLLM counts it once too)."""
    for stream in (False, True):
        body = {"prompt": ["Hello there", "a b c"], "max_tokens": 3, "n": 3, "stream": stream,
                "stream_options": {"include_usage": True} if stream else None}
        one = httpx.post(server + "/v1/completions", headers=AUTH, timeout=60,
                         json={"prompt": ["Hello there", "a b c"], "max_tokens": 3}).json()["usage"]
        if stream:
            with httpx.stream("POST", server + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
            got = next(e["usage"] for e in events if e.get("usage"))
        else:
            got = httpx.post(server + "/v1/completions", headers=AUTH, timeout=60, json=body).json()["usage"]
        assert got["prompt_tokens"] == one["prompt_tokens"], (stream, got, one)
        assert got["completion_tokens"] == 6 * 3
    chat = httpx.post(server + "/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2, "n": 3}).json()
    single = httpx.post(server + "/v1/chat/completions", headers=AUTH, timeout=60,
                        json={"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}).json()
    assert chat["usage"]["prompt_tokens"] == single["usage"]["prompt_tokens"]


def test_template_bomb_is_refused_and_health_stays_fast(server):
    bomb = "{{ 'ab' * 15000000 }}"
    with health_watch(server) as samples:
        for body in ({"chat_template_kwargs": {"chat_template": bomb}}, {"chat_template": bomb}):
            r = httpx.post(server + "/v1/chat/completions", headers=AUTH, timeout=30,
                           json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body})
            assert r.status_code == 400 and "--trust-request-chat-template" in r.json()["error"]["message"]
        # keys the model's template does not read are dropped (a template variable is never overridden blindly)
        r = httpx.post(server + "/v1/chat/completions", headers=AUTH, timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "chat_template_kwargs": {"tokenize": True, "messages": [], "made_up": 1}})
        assert r.status_code == 200, r.text
        time.sleep(0.3)
    assert all(status == 200 for status, _ in samples) and max(s for _, s in samples) < 1.0


def test_half_open_and_excess_connections_are_closed(server):
    port = int(server.rsplit(":", 1)[1])

    def closed_by_server(sock: socket.socket, wait: float) -> bool:
        sock.settimeout(wait)
        try:
            return sock.recv(1024) == b"" or True  # EOF, or a response the server sent before closing
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True

    idle = socket.create_connection(("127.0.0.1", port))
    slow = socket.create_connection(("127.0.0.1", port))
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # never finishes its head
    stalled = socket.create_connection(("127.0.0.1", port))
    stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                    + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"pro")  # body stalls
    t0 = time.time()
    assert closed_by_server(idle, 10) and closed_by_server(slow, 10) and closed_by_server(stalled, 10)
    assert time.time() - t0 < 8  # --read-timeout 2
    for sock in (idle, slow, stalled):
        sock.close()
    # beyond --max-connections 40, new connections are closed at once; the server serves again afterwards
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(45)]
    try:
        assert sum(closed_by_server(s, 0.5) for s in socks[-5:]) == 5
    finally:
        for sock in socks:
            sock.close()
    time.sleep(0.3)
    assert httpx.get(server + "/health", timeout=5).status_code == 200


def engine_gauges(url: str) -> dict[str, float]:
    """The engine's gauges and finished-request counts from /metrics."""
    out = {}
    for line in httpx.get(url + "/metrics", headers=AUTH, timeout=10).text.splitlines():
        if line.startswith(("copt_num_requests_", "copt_kv_cache_usage_ratio ", "copt_request_finished_total{")):
            name, value = line.rsplit(" ", 1)
            out[name.replace("copt_request_finished_total", "finished")] = float(value)
    return out


def raw_request(port: int, path: str, body: dict, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:  # before connecting: the window the client offers stays this small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json"
                 f"\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def wait_for(check, seconds: float, every: float = 0.1):
    deadline = time.time() + seconds
    while True:
        value = check()
        if value or time.time() > deadline:
            return value
        time.sleep(every)


def test_a_client_that_stops_reading_its_stream_is_cut_and_its_requests_cancelled(server):
    """A streaming client that never reads: once the socket's buffers are full the server's sends wait; after
    --write-timeout (2 s here) the connection is cut and its 32 sequences are aborted, their KV cache freed (the
    engine generated every one of their tokens for nobody, and the connection stayed open for ever). Other streams
    and /health go on meanwhile."""
    port = int(server.rsplit(":", 1)[1])
    before = engine_gauges(server)
    # 32 choices × 400 tokens with 20 top logprobs: about 19 MB of events, far more than the socket buffers hold
    stuck = raw_request(port, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "n": 32, "logprobs": True,
        "top_logprobs": 20, "ignore_eos": True, "stream": True}, rcvbuf=4096)
    try:
        assert wait_for(lambda: engine_gauges(server)["copt_num_requests_running"] >= 32, 30)
        with health_watch(server) as samples:
            others = [f.result(timeout=120) for f in six_streams(server, tokens=30)]
        assert [r["finish_reason"] for r in others] == ["length"] * 6
        assert all(status == 200 for status, _ in samples) and max(s for _, s in samples) < 1.0
        assert wait_for(lambda: engine_gauges(server)["copt_num_requests_running"] == 0, 60)
        after = engine_gauges(server)
        aborted = after.get('finished{reason="abort"}', 0) - before.get('finished{reason="abort"}', 0)
        assert aborted == 32, (before, after)
        assert after["copt_num_requests_waiting"] == 0 and after["copt_kv_cache_usage_ratio"] == 0
        stuck.settimeout(5)  # the server has cut the connection: reading reaches its end (or its reset)
        try:
            while stuck.recv(1 << 20):
                pass
        except ConnectionResetError:
            pass
    finally:
        stuck.close()


def test_a_body_trickled_a_byte_at_a_time_is_cut(server):
    """Every piece of the body arrives within --read-timeout (2 s), but the whole body must come within the read
    timeout plus a second per 16 KiB: the connection gets 408 and is closed at about 2 s (it held one of
    --max-connections for as long as the client trickled)."""
    port = int(server.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port))
    try:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: "
                     "application/json\r\nContent-Length: 100000\r\n\r\n{\"prompt\": \"".encode())
        t0 = time.time()
        answer = None
        while answer is None and time.time() - t0 < 10:
            if select.select([sock], [], [], 0.5)[0]:  # the server answered (408) or closed
                try:
                    answer = sock.recv(4096)
                except ConnectionResetError:
                    answer = b""
                break
            try:
                sock.sendall(b"a")
            except OSError:
                answer = b""
        assert answer is not None, "the trickled body kept its connection for 10 s"
        assert time.time() - t0 < 6, time.time() - t0
        assert answer == b"" or answer.startswith(b"HTTP/1.1 408"), answer[:200]
    finally:
        sock.close()


def test_clients_that_disconnect_leave_nothing_behind(server):
    """60 clients that go away mid-stream (n > 1, include_usage, logprobs), mid-request (not streamed, n > 1) or
    right after sending: every sequence is aborted in the engine, the running and waiting counts and the KV cache
    come back to zero, and the next request is served."""
    port = int(server.rsplit(":", 1)[1])
    before = engine_gauges(server)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    kinds = [
        ("/v1/completions", {"prompt": "def f(x):", "stream": True}, 1),
        ("/v1/completions", {"prompt": "def f(x):", "stream": True, "n": 3,
                             "stream_options": {"include_usage": True}}, 3),
        ("/v1/chat/completions", {**chat, "stream": True, "n": 2, "logprobs": True, "top_logprobs": 2,
                                  "stream_options": {"include_usage": True, "continuous_usage_stats": True}}, 2),
        ("/v1/completions", {"prompt": "def f(x):", "n": 3}, 3),
        ("/v1/chat/completions", {**chat, "n": 2}, 2),
        ("/v1/completions", {"prompt": "def f(x):"}, 1),
    ]

    def client(i: int) -> None:
        path, body, _ = kinds[i % len(kinds)]
        sock = raw_request(port, path, {**body, "max_tokens": 400, "ignore_eos": True})
        if body.get("stream"):
            sock.settimeout(30)
            got = b""
            while b"data: " not in got:
                got += sock.recv(4096)
        elif i % 4:
            time.sleep(0.2)
        if i % 2:  # half of them reset the connection instead of closing it
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()

    with ThreadPoolExecutor(10) as pool:
        list(pool.map(client, range(60)))
    sequences = sum(kinds[i % len(kinds)][2] for i in range(60))
    key = 'finished{reason="abort"}'
    assert wait_for(lambda: engine_gauges(server).get(key, 0) - before.get(key, 0) == sequences, 10)
    assert wait_for(lambda: engine_gauges(server)["copt_num_requests_running"] == 0, 10)
    after = engine_gauges(server)
    assert after["copt_num_requests_waiting"] == 0 and after["copt_kv_cache_usage_ratio"] == 0, after
    assert after.get(key, 0) - before.get(key, 0) == sequences  # none ran to its end
    r = httpx.post(server + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, headers=AUTH, timeout=30)
    assert r.status_code == 200


def test_metrics_behind_the_key(server):
    assert httpx.get(server + "/metrics").status_code == 401
    assert httpx.get(server + "/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(server + "/metrics", headers=AUTH).status_code == 200
    assert httpx.get(server + "/health").status_code == 200  # liveness stays open, as in vLLM


def test_key_from_the_environment_and_public_metrics(fixtures, monkeypatch):
    monkeypatch.setenv("COPT_API_KEY", "sk-env")
    with running_server(fixtures.teacher, "--max-model-len", "128", "--metrics-public") as (url, proc):
        body = {"prompt": "x", "max_tokens": 2}
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 401
        ok = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer sk-env"}, timeout=30)
        assert ok.status_code == 200
        assert httpx.get(url + "/metrics").status_code == 200


def test_bad_keys_are_refused_before_loading(fixtures, copt):
    for args, env, text in (
        (["--api-key", ""], {}, "empty"),
        (["--api-key", "clé"], {}, "ASCII"),
        ([], {"COPT_API_KEY": ""}, "COPT_API_KEY"),
    ):
        result = copt("serve", str(fixtures.teacher), "--port", str(free_port()), *args, env=env, timeout=60)
        assert result.returncode == 2, result.stderr
        assert text in result.stderr and "loading" not in result.stderr


def test_open_bind_without_key_warns(fixtures, copt):
    result = copt("serve", str(fixtures.teacher), "--host", "0.0.0.0", "--port", str(free_port()), "--dry-run",
                  timeout=60)
    assert result.returncode == 0 and "without an API key" in result.stderr


# ---- injected faults, in-process ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(fixtures):
    import torch

    from clusteropt_cli.core.serve.engine import Engine, EngineConfig

    torch.set_num_threads(1)
    eng = Engine(EngineConfig(model=str(fixtures.teacher), max_batch_size=8, max_model_len=256))
    eng.start()
    yield eng
    eng.stop()


@contextmanager
def in_process(engine):
    import uvicorn

    from clusteropt_cli.core.serve.server import build_app

    port = free_port()
    app = build_app(engine, served_model_name="m")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def test_a_fault_in_one_requests_sampling_fails_it_alone(engine, monkeypatch):
    sampler = engine.runner.sampler
    real = sampler.sample

    def sample(logits, slots, positions, **kw):
        poisoned = {s.slot for s in engine._running if s.req.seed == 666}
        if poisoned & set(slots):
            raise RuntimeError("injected fault")
        return real(logits, slots, positions, **kw)

    monkeypatch.setattr(sampler, "sample", sample)
    with in_process(engine) as url:
        futures = six_streams(url, tokens=30)
        # sampled rows of the others share the batched call with the faulty one: they are sampled one by one
        sampled = ThreadPoolExecutor(1).submit(stream, url, {"prompt": "import os", "max_tokens": 30,
                                                             "temperature": 0.8, "seed": 7, "ignore_eos": True})
        time.sleep(0.2)
        bad = stream(url, {"prompt": "x", "max_tokens": 20, "temperature": 1.0, "seed": 666})
        assert bad["error"] is not None and bad["error"]["code"] == 500 and "injected" in bad["error"]["message"]
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 5, "temperature": 1.0,
                                                      "seed": 666}, timeout=60)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        results = [f.result(timeout=120) for f in futures] + [sampled.result(timeout=120)]
        assert [r["finish_reason"] for r in results] == ["length"] * 7
        assert httpx.get(url + "/health").status_code == 200


def test_a_fault_in_emitting_one_request_fails_it_alone(engine, monkeypatch):
    real = engine._emit_tokens

    def emit(seq, tokens, now=None):
        if seq.req.max_new_tokens == 13:
            raise ValueError("injected emit fault")
        return real(seq, tokens, now)

    monkeypatch.setattr(engine, "_emit_tokens", emit)
    with in_process(engine) as url:
        futures = six_streams(url, tokens=30)
        time.sleep(0.2)
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 13}, timeout=60)
        assert r.status_code == 500 and "injected emit fault" in r.json()["error"]["message"]
        assert [f.result(timeout=120)["finish_reason"] for f in futures] == ["length"] * 6


def test_a_step_fault_no_request_owns_fails_that_step_and_the_engine_goes_on(engine, monkeypatch):
    real = engine._step
    armed = threading.Event()

    def step():
        if armed.is_set() and engine._running:
            armed.clear()
            raise ValueError("injected step fault")
        return real()

    monkeypatch.setattr(engine, "_step", step)
    with in_process(engine) as url:
        armed.set()
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 5}, timeout=60)
        assert r.status_code == 500 and "injected step fault" in r.json()["error"]["message"]
        assert httpx.get(url + "/health").status_code == 200
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 5, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


def test_a_device_error_kills_the_engine_and_the_server_exits_nonzero(fixtures):
    import torch

    from clusteropt_cli.core.serve.engine import Engine, EngineConfig
    from clusteropt_cli.core.serve.server import ENGINE_DEAD_EXIT, run_server

    torch.set_num_threads(1)
    engine = Engine(EngineConfig(model=str(fixtures.teacher), max_batch_size=4, max_model_len=512)).start()
    real = engine._step
    armed = threading.Event()

    def step():
        if armed.is_set() and engine._running and any(s.out for s in engine._running):
            raise RuntimeError("CUDA error: device-side assert triggered")
        return real()

    engine._step = step
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    seen: dict = {}

    def client() -> None:
        for _ in range(200):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        pool = ThreadPoolExecutor(2)
        streamed = pool.submit(stream, url, {"prompt": "x", "max_tokens": 500, "ignore_eos": True})
        plain = pool.submit(httpx.post, url + "/v1/completions", json={"prompt": "y", "max_tokens": 500,
                                                                       "ignore_eos": True}, timeout=60)
        deadline = time.time() + 30
        while len(engine._running) < 2 and time.time() < deadline:  # both admitted: the fault hits them in flight
            time.sleep(0.005)
        armed.set()
        seen["stream"] = streamed.result(60)
        seen["plain"] = plain.result(60).status_code
        seen["health"] = httpx.get(url + "/health", timeout=5).status_code
        seen["new"] = httpx.post(url + "/v1/completions", json={"prompt": "z", "max_tokens": 2}, timeout=5)

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    code = run_server(engine, host="127.0.0.1", port=port, served_model_name="m", grace_period=5, dead_linger_s=5)
    thread.join(30)
    assert code == ENGINE_DEAD_EXIT != 0
    assert seen["stream"]["error"] is not None and "device-side assert" in seen["stream"]["error"]["message"]
    assert seen["plain"] == 500 and seen["health"] == 503
    assert seen["new"].status_code == 500 and seen["new"].json()["error"]["code"] == "engine_dead"


def test_requests_cancelled_in_the_queue_leave_its_count_at_once(engine):
    """Requests cancelled while they wait for a slot are dropped at the next step and the waiting count says so at
    once, not after the decode stretch the others go on with (up to 256 tokens: seconds during which /metrics
    showed them waiting)."""
    from clusteropt_cli.core.serve.engine import GenerationRequest

    prompt = engine.tokenizer.encode("def f(x):", add_special_tokens=False)
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=200, ignore_eos=True)
    running = [engine.submit(request) for _ in range(8)]  # every slot of the fixture's engine
    queued = [engine.submit(request) for _ in range(5)]
    try:
        assert wait_for(lambda: all(h._seq.out for h in running) and engine.stats.waiting == 5, 30, every=0.005)
        for h in queued:
            h.cancel()
        assert wait_for(lambda: all(h.done for h in queued), 10, every=0.005)
        assert all(h.result().finish_reason == "abort" and not h.result().output_ids for h in queued)
        assert wait_for(lambda: engine.stats.waiting == 0, 0.3, every=0.005), engine.stats.waiting
        assert not any(h.done for h in running)  # the others still decode
    finally:
        for h in running + queued:
            h.cancel()
    assert wait_for(lambda: engine.idle and engine.stats.running == 0, 10, every=0.01)
    assert engine.stats.kv_cache_usage == 0


def test_stop_strings_cost_the_engine_linear_time(engine, monkeypatch):
    """A long output with stop strings is detokenized incrementally on the engine thread (the old check decoded the
    whole output at every token: quadratic, and every other request waited for it)."""
    from clusteropt_cli.core.serve.engine import GenerationRequest

    prompt = engine.tokenizer.encode("def parse(line):\n", add_special_tokens=False)
    free = engine.generate([GenerationRequest(prompt_ids=prompt, max_new_tokens=200, ignore_eos=True)])[0]
    text = free.text
    stop = next(text[i : i + 4] for i in range(len(text) * 3 // 4, len(text) - 4)
                if text[i : i + 4].strip() and text.index(text[i : i + 4]) == i)
    decoded = []
    real = engine.tokenizer.decode

    def decode(ids, *args, **kwargs):
        decoded.append(len(ids))
        return real(ids, *args, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "decode", decode)
    cut = engine.generate([GenerationRequest(prompt_ids=prompt, max_new_tokens=200, ignore_eos=True,
                                             stop=[stop, "never-in-the-text-" * 10])])[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.index(stop)]
    n = len(cut.output_ids)
    assert n > 100 and sum(decoded) < 10 * n  # the whole-output decode per token: n²/2 token decodes


def test_fuzzed_fields_never_get_a_500(server):
    """Random values of the wrong type, size or range in every field a client can send: each request gets a 2xx or
    a 4xx (never a 500), and the server stays healthy."""
    import random

    rng = random.Random(16)
    odd_values = [None, True, -1, 0, 1, 2**31, 2**63, 2**64, -(2**64), 1e308, -1e-308, float("nan"), float("inf"),
                  "", "x", "\u0000", "é" * 3, "\U0001f600", [], [None], [1, "a"], [[]], [[2**64]], {}, {"a": 1},
                  {"5": "x"}, {"-1": 1}, [-5], list(range(40))]
    fields = ["prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stop", "seed", "ignore_eos",
              "min_tokens", "stop_token_ids", "top_k", "min_p", "presence_penalty", "frequency_penalty",
              "repetition_penalty", "logit_bias", "logprobs", "top_logprobs", "echo", "best_of", "stream_options",
              "prompt_logprobs", "chat_template_kwargs", "messages", "add_generation_prompt", "user", "model",
              "max_completion_tokens", "response_format", "tools", "suffix", "add_special_tokens"]
    statuses = []
    with httpx.Client(timeout=60, headers=AUTH) as client:
        for i in range(150):
            chat = i % 2 == 1
            body = ({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "def f"})
            body["max_tokens"] = 3
            for name in rng.sample(fields, rng.randint(1, 4)):
                body[name] = rng.choice(odd_values)
            path = "/v1/chat/completions" if chat else "/v1/completions"
            r = client.post(server + path, content=json.dumps(body), headers={"Content-Type": "application/json"})
            statuses.append(r.status_code)
            assert r.status_code < 500, (body, r.text)
            if r.status_code >= 400:
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert 200 in statuses and 400 in statuses
    assert httpx.get(server + "/health").status_code == 200


def test_env_key_stays_out_of_the_vllm_command(fixtures, copt):
    result = copt("serve", str(fixtures.teacher), "--engine", "vllm", "--vllm-version", "0.11", "--dry-run",
                  env={"COPT_API_KEY": "sk-secret"}, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "sk-secret" not in result.stdout and "VLLM_API_KEY" in result.stderr
