"""`copt serve --api-server-count 2`: two API-server processes in front of an engine-core process (ZeroMQ +
msgpack). Streaming and non-streaming equal HF greedy; a client that disconnects mid-stream frees its slot in the
engine process; a bad request gets its 400 before admission; auth and /metrics (the engine core's stats in every
API process) hold; SIGTERM drains and exits 0; a dead engine core gives /health 503 and a non-zero exit, with no
process left behind."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.test_serve_helpers import eval_prompts, hf_greedy, running_server

pytestmark = pytest.mark.slow
KEY = "sk-split"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _ready_info(proc) -> dict:
    """The --json ready document the supervisor prints once every process is up."""
    lines = []
    while True:
        line = proc.stdout.readline()
        assert line, "no ready document on stdout"
        lines.append(line)
        if line.rstrip() == "}":
            return json.loads("".join(lines))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids: list[int], timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while any(_alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), "a child process outlived the server"


def _stream(url: str, body: dict, *, stop_after: int | None = None) -> dict:
    out = {"text": "", "finish_reason": None, "events": 0, "done": False}
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, headers=AUTH,
                      timeout=60) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if line == "data: [DONE]":
                out["done"] = True
                continue
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices", []):
                out["text"] += choice["text"]
                out["finish_reason"] = choice["finish_reason"] or out["finish_reason"]
            out["events"] += 1
            if stop_after is not None and out["events"] >= stop_after:
                break  # leaving the block closes the connection mid-stream
    return out


@pytest.fixture(scope="module")
def split(fixtures):
    with running_server(fixtures.teacher, "--api-server-count", "2", "--api-key", KEY, "--max-model-len", "512",
                        "--json") as (url, proc):
        yield url, proc, _ready_info(proc)


def test_streaming_and_plain_equal_hf_greedy_across_api_processes(fixtures, split):
    url, _, info = split
    assert info["api_server_count"] == 2 and len(info["api_server_pids"]) == 2
    prompts = eval_prompts(fixtures, 8, seed=21)
    expected = hf_greedy(fixtures.teacher, prompts, 16)

    def plain(prompt):
        r = httpx.post(url + "/v1/completions", headers=AUTH, timeout=60, json={
            "prompt": prompt, "max_tokens": 16, "temperature": 0, "return_token_ids": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(plain, prompts))
        streamed = list(pool.map(lambda p: _stream(url, {"prompt": p, "max_tokens": 16, "temperature": 0}),
                                 prompts))
    assert [c["token_ids"] for c in got] == expected
    assert [s["text"] for s in streamed] == [c["text"] for c in got]
    assert all(s["done"] and s["finish_reason"] == c["finish_reason"] for s, c in zip(streamed, got, strict=True))
    # both API processes accept on the shared socket
    seen = set()
    for _ in range(40):
        with ThreadPoolExecutor(4) as pool:
            seen |= set(pool.map(lambda _: _index(url), range(4)))
        if seen == {0, 1}:
            break
    assert seen == {0, 1}
    # /metrics sums the HTTP counters of both processes, whichever answers the scrape
    for _ in range(6):
        assert metric_auth(url, "copt_http_requests_total", 'endpoint="/v1/completions",status="200"') == 16


def _index(url: str) -> int:
    r = httpx.get(url + "/metrics", headers=AUTH, timeout=5)
    line = next(x for x in r.text.splitlines() if x.startswith("copt_api_server_index "))
    return int(float(line.split()[-1]))


def test_auth_validation_and_engine_metrics(split):
    url = split[0]
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/metrics").status_code == 401
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/v1/models", headers=AUTH).json()["data"][0]["max_model_len"] == 512
    bad = httpx.post(url + "/v1/completions", headers=AUTH, json={"prompt": [5, 10**9], "max_tokens": 2})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
    bad = httpx.post(url + "/v1/completions", headers=AUTH, json={"prompt": "x", "max_tokens": 2, "logprobs": 21})
    assert bad.status_code == 400
    text = httpx.get(url + "/metrics", headers=AUTH).text  # the engine core's stats, through an API process
    assert "copt_engine_steps_total" in text and "copt_kv_cache_slots 256.0" in text  # --max-batch-size default
    assert 'copt_request_finished_total{reason="length"}' in text


def test_logprobs_and_n_choices_cross_the_process_boundary(split):
    url = split[0]
    r = httpx.post(url + "/v1/completions", headers=AUTH, timeout=60, json={
        "prompt": "def add(a, b):", "max_tokens": 6, "temperature": 0, "logprobs": 2, "n": 2})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2 and choices[0]["text"] == choices[1]["text"]
    lp = choices[0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(lp["tokens"]) > 0 and all(len(t) >= 1 for t in lp["top_logprobs"])
    # vLLM's prompt_logprobs (values, ranks) come back from the engine core too
    r = httpx.post(url + "/v1/completions", headers=AUTH, timeout=60, json={
        "prompt": "def add(a, b):", "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1, "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    positions, ids = choice["prompt_logprobs"], choice["prompt_token_ids"]
    assert len(positions) == len(ids) > 1 and positions[0] is None
    for token, position in zip(ids[1:], positions[1:], strict=True):
        entry = position[str(token)]
        assert entry["rank"] >= 1 and entry["logprob"] <= 0 and (entry["rank"] == 1) == (len(position) == 1)


def test_structured_output_is_compiled_in_the_engine_core(split):
    from tests.integration.test_serve_structured import MESSAGES, SCHEMA, schema_format, validate

    url = split[0]
    r = httpx.post(url + "/v1/chat/completions", headers=AUTH, timeout=120, json={
        "messages": MESSAGES, "max_tokens": 120, "temperature": 0, "response_format": schema_format()})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    validate(json.loads(choice["message"]["content"]), SCHEMA)
    bad = httpx.post(url + "/v1/chat/completions", headers=AUTH, timeout=60, json={
        "messages": MESSAGES, "max_tokens": 4, "response_format": schema_format({"type": 5})})
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("response_format")


def test_disconnect_mid_stream_frees_the_slot_in_the_engine_process(split):
    url = split[0]

    def aborted() -> float:
        return metric_auth(url, "copt_request_finished_total", 'reason="abort"')

    before = aborted()
    out = _stream(url, {"prompt": "def f(x):", "max_tokens": 400, "ignore_eos": True, "temperature": 0},
                  stop_after=3)
    assert out["events"] == 3 and not out["done"]
    deadline = time.time() + 15
    while time.time() < deadline and (aborted() < before + 1 or metric_auth(url, "copt_num_requests_running")):
        time.sleep(0.1)
    assert aborted() == before + 1
    assert metric_auth(url, "copt_num_requests_running") == 0


def metric_auth(url: str, name: str, labels: str = "") -> float:
    key = f"{name}{{{labels}}}" if labels else name
    for line in httpx.get(url + "/metrics", headers=AUTH, timeout=5).text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0


def test_engine_core_death_gives_503_and_a_nonzero_exit(split):
    """(Last: it kills the module's server.)"""
    url, proc, info = split
    long = ThreadPoolExecutor(1).submit(_stream, url, {"prompt": "x", "max_tokens": 400, "ignore_eos": True})
    time.sleep(0.5)
    os.kill(info["engine_core_pid"], signal.SIGKILL)
    statuses = []
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            statuses.append(httpx.get(url + "/health", timeout=2).status_code)
        except httpx.HTTPError:
            break
        if statuses[-1] == 503:
            break
        time.sleep(0.05)
    assert 503 in statuses
    assert long.result(30)["finish_reason"] != "length"  # the request in flight failed, it did not hang
    assert proc.wait(30) != 0
    _wait_gone(info["api_server_pids"])


def test_sigterm_drains_in_flight_requests_and_exits_zero(fixtures):
    with running_server(fixtures.teacher, "--api-server-count", "2", "--api-key", KEY, "--max-model-len", "512",
                        "--grace-period", "20", "--json") as (url, proc):
        info = _ready_info(proc)
        pool = ThreadPoolExecutor(2)
        # long enough (~1 s on the fixture) to be caught in flight: 60 tokens were often done before a /metrics
        # scrape saw both running, and the test then waited out its deadline and signalled an idle server
        streams = [pool.submit(_stream, url, {"prompt": f"def f{i}(x):", "max_tokens": 400, "ignore_eos": True,
                                              "temperature": 0}) for i in range(2)]
        deadline = time.time() + 15
        while metric_auth(url, "copt_num_requests_running") < 2 and time.time() < deadline:
            time.sleep(0.02)
        assert not any(s.done() for s in streams), "the requests finished before the signal"
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:
            late = httpx.post(url + "/v1/completions", headers=AUTH, json={"prompt": "y", "max_tokens": 2},
                              timeout=5).status_code
        except httpx.HTTPError:
            late = None  # the listening socket is closed already
        assert late in (None, 503)
        for s in streams:
            out = s.result(60)
            assert out["done"] and out["finish_reason"] == "length", out
        assert proc.wait(40) == 0
        _wait_gone([info["engine_core_pid"], *info["api_server_pids"]])


def test_a_device_error_in_the_engine_core_reaches_the_api_process(fixtures, tmp_path):
    """The engine core and an API server's EngineClient in this process (threads): a device error in an engine
    step fails the requests in flight with the error, /health answers 503, new requests 500 (engine_dead), and the
    API server exits ENGINE_DEAD_EXIT; the engine core stops too."""
    import threading

    import torch

    from clusteropt_cli.core.serve.engine import Engine, EngineConfig
    from clusteropt_cli.core.serve.server import ENGINE_DEAD_EXIT, run_server
    from tests.integration.test_serve_helpers import free_port

    torch.set_num_threads(1)
    engine = Engine(EngineConfig(model=str(fixtures.teacher), max_batch_size=4, max_model_len=512)).start()
    real = engine._step
    armed = threading.Event()

    def step():
        if armed.is_set() and engine._running and any(s.out for s in engine._running):
            raise RuntimeError("CUDA error: device-side assert triggered")
        if len(engine._running) + len(engine._waiting) < 2 and not armed.is_set():
            time.sleep(0.002)  # hold the first request until the second is in: neither can finish before the error
            return None
        return real()

    engine._step = step
    core, core_thread, codes, client = _core_in_a_thread(engine, tmp_path, dead_linger_s=0.5)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    seen: dict = {}

    def load() -> None:
        _wait_healthy(url)
        pool = ThreadPoolExecutor(2)
        streamed = pool.submit(_stream_any, url, {"prompt": "x", "max_tokens": 400, "ignore_eos": True})
        plain = pool.submit(httpx.post, url + "/v1/completions", json={"prompt": "y", "max_tokens": 400,
                                                                       "ignore_eos": True}, timeout=60)
        deadline = time.time() + 30
        while len(engine._running) < 2 and time.time() < deadline:
            time.sleep(0.005)
        armed.set()
        seen["stream"] = streamed.result(60)
        seen["plain"] = plain.result(60).status_code
        seen["health"] = httpx.get(url + "/health", timeout=5).status_code
        seen["new"] = httpx.post(url + "/v1/completions", json={"prompt": "z", "max_tokens": 2}, timeout=5)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    code = run_server(client, host="127.0.0.1", port=port, served_model_name="m", grace_period=5, dead_linger_s=3)
    thread.join(30)
    core_thread.join(30)
    assert code == ENGINE_DEAD_EXIT != 0 and codes["core"] == ENGINE_DEAD_EXIT
    assert seen["stream"]["error"] is not None and "device-side assert" in seen["stream"]["error"]["message"]
    assert seen["plain"] == 500 and seen["health"] == 503
    assert seen["new"].status_code == 500 and seen["new"].json()["error"]["code"] == "engine_dead"


def _core_in_a_thread(engine, tmp_path, **core_options):
    """An EngineCore over `engine` on a thread of this process and an EngineClient of it (API process 0): (core,
    its thread, {"core": exit code} once it returns, client)."""
    import threading

    from clusteropt_cli.core.serve.engine_client import EngineClient
    from clusteropt_cli.core.serve.engine_core import EngineCore, client_info

    inp, out = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out-0"
    core = EngineCore(engine, inp, [out], grace_period=5, **core_options)
    codes: dict = {}
    thread = threading.Thread(target=lambda: codes.setdefault("core", core.run(install_signals=False)), daemon=True)
    thread.start()
    return core, thread, codes, EngineClient(client_info(engine), 0, inp, out)


def _wait_healthy(url: str) -> None:
    for _ in range(200):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.05)


def _stream_any(url: str, body: dict) -> dict:
    """A streamed completion without auth: its text and any error event."""
    out = {"text": "", "error": None}
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out["error"] = event["error"]
            for choice in event.get("choices", []):
                out["text"] += choice["text"]
    return out


def _serve_under_load(engine: Any, load: Callable[[str], None]) -> int:
    """run_server(engine) in this thread (it handles SIGTERM there) while `load(url)` runs in another once the server
    is healthy; SIGTERM when the load ends, however it ends (a hang shows as a missing answer, not as a test that never
    ends). Returns run_server's exit status."""
    import threading

    from clusteropt_cli.core.serve.server import run_server
    from tests.integration.test_serve_helpers import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"

    def run() -> None:
        try:
            _wait_healthy(url)
            load(url)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    code = run_server(engine, host="127.0.0.1", port=port, served_model_name="m", grace_period=5)
    thread.join(10)
    return code



def test_a_load_error_in_the_engine_core_keeps_its_message_and_exit_code(fixtures, copt):
    from tests.integration.test_serve_helpers import free_port

    result = copt("serve", str(fixtures.teacher), "--api-server-count", "2", "--kv-cache-memory", "0.0000001",
                  "--port", str(free_port()), env={"OMP_NUM_THREADS": "1"}, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "The KV cache holds 0 tokens" in result.stderr and "--kv-cache-memory" in result.stderr


def test_no_orphans_when_the_supervisor_is_killed(fixtures):
    with running_server(fixtures.teacher, "--api-server-count", "2", "--max-model-len", "128", "--json") as (url,
                                                                                                         proc):
        info = _ready_info(proc)
        assert list(Path(tempfile.gettempdir()).glob(f"copt-serve-{proc.pid}-*"))  # its sockets' folder
        proc.kill()
        proc.wait(10)
        _wait_gone([info["engine_core_pid"], *info["api_server_pids"]], timeout=15)
        assert not list(Path(tempfile.gettempdir()).glob(f"copt-serve-{proc.pid}-*"))  # removed by the last one out


def test_an_internal_error_at_admission_fails_that_request_alone(fixtures, tmp_path):
    """The engine core answers every submit, even one that fails unexpectedly there (500, never a hang); the next
    request is served; SIGTERM drains the API server (exit 0) and the engine core stops cleanly."""

    import torch

    from clusteropt_cli.core.serve.engine import Engine, EngineConfig

    torch.set_num_threads(1)
    engine = Engine(EngineConfig(model=str(fixtures.teacher), max_batch_size=4, max_model_len=256)).start()
    real_submit = engine.submit

    def submit(request, share_prompt_with=None):
        if request.max_new_tokens == 13:
            raise RuntimeError("unexpected")
        return real_submit(request, share_prompt_with=share_prompt_with)

    engine.submit = submit
    core, core_thread, codes, client = _core_in_a_thread(engine, tmp_path)
    seen: dict = {}

    def load(url: str) -> None:
        seen["bad"] = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 13}, timeout=10)
        seen["good"] = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30)

    code = _serve_under_load(client, load)
    core.drain()
    core_thread.join(30)
    assert seen["bad"].status_code == 500 and "unexpected" in seen["bad"].json()["error"]["message"]
    assert seen["good"].status_code == 200 and seen["good"].json()["usage"]["completion_tokens"] == 3
    assert code == 0 and codes["core"] == 0


def test_api_and_engine_traces_time_each_streamed_request_in_order(fixtures, tmp_path, monkeypatch):
    """COPT_API_TRACE and COPT_ENGINE_TRACE: every streamed request appears in both under one id, its times in the
    order a request takes (entered, body read, parsed, prompt encoded, submitted, engine arrival, engine first token,
    first token in, first event out; result in after the first token in; last event out after both); the event
    loop's lag and the prompt encoder's batches are recorded."""
    import torch

    from clusteropt_cli.core.serve.engine import Engine, EngineConfig

    monkeypatch.setenv("COPT_API_TRACE", str(tmp_path / "api"))
    monkeypatch.setenv("COPT_ENGINE_TRACE", str(tmp_path / "engine"))
    torch.set_num_threads(1)
    engine = Engine(EngineConfig(model=str(fixtures.teacher), max_batch_size=4, max_model_len=256)).start()
    core, core_thread, codes, client = _core_in_a_thread(engine, tmp_path)
    outs: list = []

    def load(url: str) -> None:
        with ThreadPoolExecutor(3) as pool:
            outs.extend(pool.map(lambda i: _stream_any(url, {"prompt": f"def g{i}(x):", "max_tokens": 8,
                                                              "ignore_eos": True}), range(3)))
        httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)  # not streamed

    assert _serve_under_load(client, load) == 0
    core.drain()
    core_thread.join(30)
    assert len(outs) == 3 and all(o["error"] is None and o["text"] for o in outs)
    (api_file,) = (tmp_path / "api").glob("api-trace-*.json")
    (engine_file,) = (tmp_path / "engine").glob("engine-trace-*.json")
    api, eng = json.loads(api_file.read_text()), json.loads(engine_file.read_text())
    assert len(api["requests"]) == 3  # the streamed ones
    in_engine = {r[5]: r for r in eng["requests"]}
    for entered, submitted, first_in, first_out, final_in, last_out, rid, body, parsed, encoded in api["requests"]:
        arrival, first, finish, *_ = in_engine[rid]
        assert entered <= body <= parsed <= encoded <= submitted <= arrival <= first <= first_in <= first_out
        # (a short answer's result can reach the process before its first event has gone out)
        assert first_in <= final_in <= last_out and first_out <= last_out and finish <= final_in
    assert api["lag"] and all(lag > -0.002 for _, lag in api["lag"])  # (asyncio may wake up to 1 ms early)
    batches = api["encoder_batches"]  # the 3 streamed text prompts and the plain one, 1-4 to a batch
    assert sum(n for *_, n in batches) == 4 and all(queued <= start <= end for queued, start, end, _ in batches)


def test_the_single_process_servers_api_trace_times_the_intake_up_to_the_engine(fixtures, tmp_path, monkeypatch):
    """`--api-server-count 0` (one process, the default on a CPU): the API trace's rows carry the submission too, so
    bench/serve_timeline.py splits the time from the app to the engine there as well."""

    import torch

    from clusteropt_cli.core.serve.engine import Engine, EngineConfig

    monkeypatch.setenv("COPT_API_TRACE", str(tmp_path / "api"))
    monkeypatch.setenv("COPT_ENGINE_TRACE", str(tmp_path / "engine"))
    torch.set_num_threads(1)
    engine = Engine(EngineConfig(model=str(fixtures.teacher), max_batch_size=2, max_model_len=128)).start()
    outs: list = []

    def load(url: str) -> None:
        outs.extend(_stream_any(url, {"prompt": f"def h{i}(x):", "max_tokens": 4, "ignore_eos": True})
                    for i in range(2))

    assert _serve_under_load(engine, load) == 0  # (run_server stops the engine)
    assert len(outs) == 2 and all(o["error"] is None and o["text"] for o in outs)
    (api_file,) = (tmp_path / "api").glob("api-trace-*.json")
    (engine_file,) = (tmp_path / "engine").glob("engine-trace-*.json")
    api, eng = json.loads(api_file.read_text()), json.loads(engine_file.read_text())
    in_engine = {r[5]: r for r in eng["requests"]}
    assert len(api["requests"]) == 2
    for entered, submitted, _, first_out, _, last_out, rid, body, parsed, encoded in api["requests"]:
        arrival, first, *_ = in_engine[rid]
        assert entered <= body <= parsed <= encoded <= submitted <= first <= first_out <= last_out
        assert abs(submitted - arrival) < 0.5  # one clock: the engine takes the request in as it is handed over
