"""copt profile endpoint against a small in-test OpenAI-style streaming server, failing endpoints and copt serve."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fastapi import Request  # module level: the routes' annotations are resolved from module globals

from tests.conftest import REPO

# per token, long enough that the fake server's sleep (not a busy 2-core host's scheduling) sets the throughput
# ratio between concurrency levels: 2 ms once let concurrency 4 measure slower than 1 in CI
TOKEN_DELAY_S = 0.01


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


RECEIVED: list[dict] = []  # the bodies /v1/completions got, newest last
# a prefix cache as /metrics reports it: every prompt word looked up, found when the same prompt came before
PREFIX_CACHE = {"queries": 0, "hits": 0, "seen": set()}


def _fake_openai_app():
    """Streams `max_tokens` one-word chunks as OpenAI SSE; /broken/... answers 500; /cut/... drops mid-stream."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    app = FastAPI()

    async def stream(body: dict, cut: bool):
        n = int(body.get("max_tokens", 16))
        for i in range(n):
            await asyncio.sleep(TOKEN_DELAY_S)
            chunk = {"id": "cmpl-1", "object": "text_completion", "model": body["model"],
                     "choices": [{"index": 0, "text": f" w{i}", "finish_reason": None}]}
            yield f"data: {json.dumps(chunk)}\n\n"
            if cut and i == 1:
                raise RuntimeError("connection cut mid-stream")
        usage = {"prompt_tokens": len(body["prompt"].split()), "completion_tokens": n, "total_tokens": 0}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        RECEIVED.append(body)
        words = len(body["prompt"].split())
        PREFIX_CACHE["queries"] += words
        PREFIX_CACHE["hits"] += words if body["prompt"] in PREFIX_CACHE["seen"] else 0
        PREFIX_CACHE["seen"].add(body["prompt"])
        return StreamingResponse(stream(body, cut=False), media_type="text/event-stream")

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(
            "# TYPE vllm:prefix_cache_queries_total counter\n"
            f'vllm:prefix_cache_queries_total{{model_name="m"}} {PREFIX_CACHE["queries"]}.0\n'
            f'vllm:prefix_cache_hits_total{{model_name="m"}} {PREFIX_CACHE["hits"]}.0\n')

    @app.post("/broken/v1/completions")
    async def broken(request: Request):
        return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, status_code=500)

    @app.post("/strict/v1/completions")
    async def strict(request: Request):  # answers vLLM extras as `transformers serve` does
        body = await request.json()
        extra = {key for key in body if key in ("ignore_eos", "min_tokens")}
        if extra:
            return JSONResponse({"detail": f"Unexpected fields in the request: {extra}"}, status_code=422)
        return StreamingResponse(stream(body, cut=False), media_type="text/event-stream")

    @app.post("/huge/v1/completions")
    async def huge(request: Request):  # one SSE line of 3 MB: more than the client buffers
        async def lines():
            yield "data: " + "x" * 3_000_000 + "\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(lines(), media_type="text/event-stream")

    @app.post("/cut/v1/completions")
    async def cut(request: Request):
        body = await request.json()
        return StreamingResponse(stream(body, cut=True), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def fake_server():
    import uvicorn

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(_fake_openai_app(), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 15
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    assert server.started, "in-test server did not start"
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=5)


def test_endpoint_sweep_report_plot_and_expect(fake_server, copt, tmp_path):
    """A concurrency sweep gives percentiles per level, a valid report, a PNG, and --expect compares figures."""
    recipe = tmp_path / "serve.yaml"
    recipe.write_text(
        "task: serve\nmodel: fake\nprediction:\n  source: test\n  figures:\n"
        "    output_tokens_per_s: 1.0e6\n    tpot_s: 0.01\n  assumptions:\n    concurrency: 4\n")
    report = tmp_path / "endpoint.json"
    plot = tmp_path / "sweep.png"
    proc = copt("profile", "endpoint", "--url", fake_server, "--model", "fake", "--concurrency", "1,4",
                "--num-requests", "8", "--gen-len", "12", "--prompt-len", "16", "--slo-ttft-ms", "1000",
                "--slo-tpot-ms", "1000", "--plot", str(plot), "--report", str(report), "--expect", str(recipe),
                "--tolerance", "100", "--json", timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    profile = doc["profile"]
    assert [lv["concurrency"] for lv in profile["levels"]] == [1, 4]
    for lv in profile["levels"]:
        assert lv["requests"] == 8 and lv["completed"] == 8 and lv["errors"] == {}
        for key in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
            assert 0 < lv[key]["p50"] <= lv[key]["p90"] <= lv[key]["p99"], (key, lv[key])
        # 12 tokens at >= 2 ms each: E2E at least 11 inter-token gaps
        assert lv["e2e_s"]["p50"] >= 11 * TOKEN_DELAY_S
        assert lv["tpot_s"]["p50"] >= TOKEN_DELAY_S * 0.9
        assert lv["output_tokens_per_s"] == pytest.approx(8 * 12 / lv["duration_s"], rel=1e-6)
        assert lv["goodput"] == pytest.approx(lv["request_throughput"])
    # 4 concurrent clients on an idle fake server: more throughput than 1
    assert profile["levels"][1]["output_tokens_per_s"] > profile["levels"][0]["output_tokens_per_s"]
    check = doc["check"]
    assert check["passed"] is True and check["level"] == "concurrency 4"
    by_name = {f["name"]: f for f in check["figures"]}
    assert by_name["output_tokens_per_s"]["measured"] == pytest.approx(profile["levels"][1]["output_tokens_per_s"])
    assert by_name["tpot_s"]["rel_error"] == pytest.approx(by_name["tpot_s"]["measured"] / 0.01 - 1)
    from clusteropt_cli.core.profile.report import load_profile

    assert load_profile(str(report)).levels[0].completed == 8
    assert plot.stat().st_size > 5000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_endpoint_closed_port_exits_non_zero(copt, tmp_path):
    """Nothing listens: every request fails with 'connect'; a profile that measured nothing exits 2."""
    url = f"http://127.0.0.1:{_free_port()}"
    proc = copt("profile", "endpoint", "--url", url, "--model", "m", "--concurrency", "2", "--num-requests", "5",
                "--warmup", "1", "--json", timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "Every request" in proc.stderr and "connect" in proc.stderr and "Is the server running" in proc.stderr
    assert proc.stdout == ""


def test_endpoint_falls_back_when_the_server_rejects_ignore_eos(fake_server, copt):
    """A server that validates strictly (422 for ignore_eos): dropped after the first refusal and reported;
    --ignore-eos insists (every request fails: non-zero exit with the server's message); --no-ignore-eos never
    sends it."""
    from clusteropt_cli.core.profile.endpoint import profile_endpoint
    from clusteropt_cli.core.profile.settings import EndpointSettings

    def run(**kw):
        return profile_endpoint(EndpointSettings(url=fake_server + "/strict", model="m", concurrency=[2],
                                                 num_requests=4, warmup=1, gen_len=5, prompt_len=4, **kw))

    report = run()
    assert report.levels[0].completed == 4 and report.levels[0].errors == {}
    control = report.workload["output_length_control"]
    assert control.startswith("max_tokens only: the server rejected ignore_eos (http 422: Unexpected fields")
    assert report.workload["ignore_eos"] is False and report.workload["mean_output_tokens"] == 5
    assert run(ignore_eos=False).workload["output_length_control"] == "max_tokens only (--no-ignore-eos)"
    assert profile_endpoint(EndpointSettings(url=fake_server, model="m", concurrency=[1], num_requests=2, warmup=0,
                                             gen_len=3, prompt_len=4)).workload["output_length_control"] == \
        "ignore_eos"
    proc = copt("profile", "endpoint", "--url", fake_server + "/strict", "--model", "m", "--concurrency", "1",
                "--num-requests", "2", "--gen-len", "3", "--ignore-eos", timeout=60)
    assert proc.returncode == 2
    assert "Every request" in proc.stderr and "Unexpected fields in the request" in proc.stderr


def test_endpoint_server_errors_and_cut_streams_are_counted(fake_server):
    """HTTP 500s and streams cut mid-way are errors by kind, never exceptions; Poisson mode is bounded."""
    from clusteropt_cli.core.profile.endpoint import _run, profile_endpoint
    from clusteropt_cli.core.profile.settings import EndpointSettings
    from clusteropt_cli.errors import CheckFailedError

    broken = EndpointSettings(url=fake_server + "/broken", model="m", concurrency=[3], num_requests=6, warmup=0,
                              gen_len=4, prompt_len=4)
    levels, facts = asyncio.run(_run(broken, ["a b c"], lambda _m: None))
    assert levels[0].errors == {"http_500": 6} and levels[0].completed == 0
    assert facts["failures"] == {"http_500": "boom"}  # the server's own message
    with pytest.raises(CheckFailedError, match="failed .6 sent.: http_500: boom"):
        profile_endpoint(broken)
    cut = EndpointSettings(url=fake_server + "/cut", model="m", rate=[200.0], num_requests=5, warmup=0, gen_len=6,
                           prompt_len=4)
    levels, _ = asyncio.run(_run(cut, ["a b c"], lambda _m: None))
    level = levels[0]
    assert level.rate == 200.0 and level.requests == 5 and level.completed == 0
    assert set(level.errors) == {"disconnect"}, level.errors
    with pytest.raises(CheckFailedError, match="disconnect"):
        profile_endpoint(cut)
    start = time.perf_counter()
    timed = profile_endpoint(EndpointSettings(url=fake_server, model="m", concurrency=[2], duration_s=0.3,
                                              warmup=0, gen_len=4, prompt_len=4))
    assert time.perf_counter() - start < 5
    assert timed.levels[0].completed >= 2 and timed.levels[0].errors == {}


def test_endpoint_never_sends_a_prompt_twice(fake_server):
    """A repeated prompt would be served from the server's prefix cache (no prefill): every request of a sweep —
    warm-up, every level, count- and duration-bounded — carries a prompt no earlier request sent, beyond the pool of
    bodies made up front (here 3 + 1 warm-up for 1 + 3 + 3 requests and a timed level), and a second run with the
    same seed against the same server sends none of the first run's prompts (the server's counters: no hits)."""
    from clusteropt_cli.core.profile.endpoint import EndpointSettings, profile_endpoint

    RECEIVED.clear()
    runs = [profile_endpoint(EndpointSettings(url=fake_server, model="m", concurrency=[1, 3], num_requests=3,
                                              warmup=1, gen_len=2, prompt_len=6)) for _ in range(2)]
    counted = [b["prompt"] for b in RECEIVED]
    assert len(counted) == 14 and len(set(counted)) == 14
    assert all(len(prompt.split()) == 6 for prompt in counted)
    assert [lv.prefix_cache_hit_rate for run in runs for lv in run.levels] == [0.0] * 4
    RECEIVED.clear()
    profile_endpoint(EndpointSettings(url=fake_server, model="m", concurrency=[2, 4], duration_s=0.3, warmup=0,
                                      gen_len=2, prompt_len=6))
    timed = [b["prompt"] for b in RECEIVED]
    assert len(timed) > 256 // 64 and len(set(timed)) == len(timed)


def test_endpoint_splits_a_level_over_client_processes(fake_server, tmp_path):
    """--client-processes 2: a level's streams and request count are shared out between two processes, each with
    its own event loop; every request is counted once, no two carry the same prompt (synthetic: a run head per
    process), a duration bounds the level, and a --dataset's prompts are shared out, not all sent twice."""
    from clusteropt_cli.core.profile.endpoint import EndpointSettings, profile_endpoint

    RECEIVED.clear()
    report = profile_endpoint(EndpointSettings(url=fake_server, model="m", concurrency=[4], num_requests=9,
                                               warmup=0, gen_len=3, prompt_len=6, client_processes=2))
    level = report.levels[0]
    assert level.requests == 9 and level.completed == 9 and level.errors == {}
    prompts = [b["prompt"] for b in RECEIVED]
    assert len(prompts) == 9 and len(set(prompts)) == 9
    assert len({p.split(" request ")[0] for p in prompts}) == 2  # one run head per process
    assert report.workload["client_processes"] == {"4": 2}
    assert level.output_tokens_per_s == pytest.approx(9 * 3 / level.duration_s)
    assert set(level.client_loop_lag_s) == {"p50", "p90", "p99", "mean"}  # both processes' event loops, sampled
    RECEIVED.clear()
    start = time.perf_counter()
    timed = profile_endpoint(EndpointSettings(url=fake_server, model="m", concurrency=[2], duration_s=0.5,
                                              warmup=0, gen_len=2, prompt_len=4, client_processes=2))
    assert timed.levels[0].completed >= 2 and 0.5 <= timed.levels[0].duration_s < 3
    assert time.perf_counter() - start < 30
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": f"prompt number {i}"}) + "\n" for i in range(6)))
    RECEIVED.clear()
    profile_endpoint(EndpointSettings(url=fake_server, model="m", concurrency=[2], num_requests=6, warmup=0,
                                      gen_len=2, dataset=dataset, client_processes=2))
    assert sorted(b["prompt"] for b in RECEIVED) == [f"prompt number {i}" for i in range(6)]


def test_a_failing_client_process_fails_the_level_with_a_hint(fake_server, tmp_path):
    """A client process that cannot make its prompts (here: a tokenizer folder that is not one) ends the level with
    a CoptError naming the way out, instead of a hang or a level counted from the other process alone."""
    from clusteropt_cli.core.profile.endpoint import EndpointSettings, _level_in_processes, _PromptSource
    from clusteropt_cli.errors import CoptError

    settings = EndpointSettings(url=fake_server, model="m", concurrency=[2], num_requests=4, warmup=0, gen_len=2,
                                prompt_len=4, client_processes=2)
    sources = [_PromptSource(pool=2, prompt_len=4), _PromptSource(pool=2, prompt_len=4, tokenizer=str(tmp_path))]
    start = time.perf_counter()
    with pytest.raises(CoptError, match="client process of concurrency 2 failed") as failure:
        _level_in_processes(settings, 2, sources, send_ignore_eos=True)
    assert "--client-processes 1" in failure.value.hint
    assert time.perf_counter() - start < 60


def test_auth_and_proxy_come_from_the_environment_once(monkeypatch, tmp_path):
    """--api-key as a bearer token, else the host's .netrc entry as basic auth; HTTP_PROXY unless NO_PROXY covers the
    host — decided once per run (request_options), not by aiohttp for every request."""
    import base64

    from clusteropt_cli.core.profile.endpoint import request_options

    netrc_file = tmp_path / "netrc"
    netrc_file.write_text("machine gpu-box login alice password s3cret\n")
    netrc_file.chmod(0o600)
    for name in ("HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(netrc_file))
    monkeypatch.setenv("http_proxy", "http://proxy.internal:3128")
    monkeypatch.setenv("no_proxy", "localhost,127.0.0.1")
    basic = "Basic " + base64.b64encode(b"alice:s3cret").decode()
    assert request_options("http://gpu-box:8000/v1/completions", None) == {
        "headers": {"Authorization": basic}, "proxy": "http://proxy.internal:3128"}
    assert request_options("http://gpu-box:8000/v1/completions", "k1") == {
        "headers": {"Authorization": "Bearer k1"}, "proxy": "http://proxy.internal:3128"}
    assert request_options("http://127.0.0.1:8000/v1/completions", None) == {"headers": {}, "proxy": None}
    netrc_file.write_text("this is not a netrc file machine\n")
    assert request_options("http://gpu-box:8000", None)["headers"] == {}  # a broken .netrc is ignored


def test_client_processes_default_and_bounds(monkeypatch):
    from clusteropt_cli.core.profile.settings import EndpointSettings
    from clusteropt_cli.errors import BadInputError

    monkeypatch.setattr("os.cpu_count", lambda: 16)
    auto = EndpointSettings(url="http://x", model="m")
    assert [auto.client_processes_for(c) for c in (1, 63, 64, 128, 256, 1024)] == [1, 1, 1, 2, 4, 8]
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert auto.client_processes_for(256) == 1  # a 2-core host keeps one event loop
    assert EndpointSettings(url="http://x", model="m", client_processes=4).client_processes_for(2) == 2
    with pytest.raises(BadInputError, match="--client-processes"):
        EndpointSettings(url="http://x", model="m", client_processes=0).validate()


def test_endpoint_counts_an_oversized_stream_line_as_a_bad_stream(fake_server):
    """A server streaming a 3 MB line fails that request as bad_stream; the client neither buffers without bound
    nor crashes, and the run reports it with the rest."""
    from clusteropt_cli.core.profile.endpoint import EndpointSettings, profile_endpoint
    from clusteropt_cli.errors import CoptError

    with pytest.raises(CoptError, match="bad_stream"):
        profile_endpoint(EndpointSettings(url=fake_server + "/huge", model="m", concurrency=[2], num_requests=2,
                                          warmup=0, gen_len=2, prompt_len=4))


def test_endpoint_reports_the_servers_prefix_cache_hits(fake_server, copt, tmp_path):
    """A --dataset cycled past its end repeats prompts; the report gives the share of prompt tokens the server found
    in its prefix cache per level (its /metrics counters) and the table says so; a server without the counters
    leaves it unset."""
    dataset = tmp_path / "two.jsonl"
    dataset.write_text('{"prompt": "hit test alpha beta"}\n{"prompt": "hit test gamma delta epsilon"}\n')
    report = tmp_path / "r.json"
    proc = copt("profile", "endpoint", "--url", fake_server, "--model", "m", "--concurrency", "1",
                "--num-requests", "4", "--warmup", "0", "--gen-len", "2", "--dataset", str(dataset),
                "--report", str(report))
    assert proc.returncode == 0, proc.stderr
    assert "prefix-cache hits (the server's /metrics): c=1 50.0%" in proc.stdout
    assert "of this level's prompt tokens in its prefix cache" in proc.stderr
    (level,) = json.loads(report.read_text())["levels"]
    assert level["prefix_cache_hit_rate"] == pytest.approx(9 / 18)
    assert level["client_loop_lag_s"]["p90"] >= 0  # how late the client's own event loop ran while it measured

    from clusteropt_cli.core.profile.endpoint import EndpointSettings, profile_endpoint

    strict = profile_endpoint(EndpointSettings(url=fake_server + "/strict", model="m", concurrency=[1],
                                               num_requests=1, warmup=0, gen_len=2, prompt_len=4))
    assert strict.levels[0].completed == 1 and strict.levels[0].prefix_cache_hit_rate is None


def test_prefix_cache_counters_sum_label_sets_and_skip_what_is_not_theirs():
    from clusteropt_cli.core.profile.endpoint import metrics_url, prefix_cache_counters

    text = ("# HELP vllm:prefix_cache_hits_total Prompt tokens found\n"
            'vllm:prefix_cache_queries_total{engine="0",model_name="a"} 100.0\n'
            'vllm:prefix_cache_queries_total{engine="1",model_name="a"} 50\n'
            'vllm:prefix_cache_hits_total{engine="0",model_name="a"} 30.0\n'
            "vllm:prefix_cache_hits_created 1.7e9\n"
            "vllm:prefix_cache_hits_total_bogus{x=\"1\"} 999\n")
    assert prefix_cache_counters(text) == (150.0, 30.0)
    assert prefix_cache_counters("vllm:num_requests_running 3\n") is None
    assert [metrics_url(u) for u in ("http://h:1", "http://h:1/v1/", "http://h:1/v1/completions")] == \
        ["http://h:1/metrics"] * 3


@pytest.mark.slow
def test_endpoint_against_copt_serve(fixtures, tmp_path):
    """profile endpoint against a real `copt serve` on the fixture teacher: percentiles for each level."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    server = subprocess.Popen(
        [sys.executable, "-m", "clusteropt_cli", "serve", str(fixtures.teacher), "--port", str(port),
         "--served-model-name", "teacher"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        import httpx

        deadline = time.time() + 60
        while time.time() < deadline:
            if server.poll() is not None:
                pytest.fail(f"copt serve exited: {server.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            pytest.fail("copt serve did not become healthy within 60 s")
        proc = subprocess.run(
            [sys.executable, "-m", "clusteropt_cli", "profile", "endpoint", "--url", f"http://127.0.0.1:{port}",
             "--model", "teacher", "--concurrency", "1,4", "--num-requests", "8", "--prompt-len", "32",
             "--gen-len", "8", "--tokenizer", str(fixtures.tokenizer), "--json"],
            capture_output=True, text=True, env=env, timeout=180)
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        assert [lv["concurrency"] for lv in doc["levels"]] == [1, 4]
        for lv in doc["levels"]:
            assert lv["completed"] == 8 and lv["errors"] == {}, lv
            for key in ("ttft_s", "tpot_s", "e2e_s"):
                assert 0 < lv[key]["p50"] <= lv[key]["p90"] <= lv[key]["p99"]
            assert lv["output_tokens_per_s"] > 0
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def test_endpoint_bad_flags_exit_2(copt, tmp_path):
    proc = copt("profile", "endpoint", "--url", "localhost:8000", "--model", "m", "--concurrency", "0,4",
                "--rate", "2")
    assert proc.returncode == 2
    assert "--url" in proc.stderr and "--concurrency" in proc.stderr and "not both" in proc.stderr
    proc = copt("profile", "endpoint", "--url", "http://127.0.0.1:1", "--model", "m", "--top-p", "1.5")
    assert proc.returncode == 2 and "--top-p must be in (0, 1]" in proc.stderr
    existing = tmp_path / "p.png"
    existing.write_bytes(b"x")
    proc = copt("profile", "endpoint", "--url", "http://127.0.0.1:1", "--model", "m", "--plot", str(existing))
    assert proc.returncode == 2 and "--overwrite" in proc.stderr and existing.read_bytes() == b"x"
    assert not Path(tmp_path / "missing").exists()


@pytest.mark.slow
def test_endpoint_against_transformers_serve(fixtures):
    """A third-party OpenAI server, `transformers serve` on the fixture teacher (CPU, offline): it answers
    ignore_eos with HTTP 422; the profile falls back and completes; a wrong model id exits 2 with its message."""
    import shutil

    if shutil.which("transformers") is None:
        pytest.skip("the transformers CLI is not on PATH")
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen(["transformers", "serve", str(fixtures.teacher), "--port", str(port), "--device",
                               "cpu"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        import httpx

        deadline = time.time() + 120
        while time.time() < deadline:
            if server.poll() is not None:
                pytest.fail(f"transformers serve exited: {server.stderr.read().decode()[-2000:]}")
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            pytest.fail("transformers serve did not come up within 120 s")
        base = [sys.executable, "-m", "clusteropt_cli", "profile", "endpoint", "--url", f"http://127.0.0.1:{port}",
                "--concurrency", "1,2", "--num-requests", "4", "--prompt-len", "16", "--gen-len", "8"]
        proc = subprocess.run(base + ["--model", str(fixtures.teacher), "--json"], capture_output=True, text=True,
                              env=env, timeout=180)
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        assert all(lv["completed"] == 4 and lv["errors"] == {} for lv in doc["levels"]), doc["levels"]
        assert "the server rejected ignore_eos (http 422" in doc["workload"]["output_length_control"]
        assert "ignore_eos" in proc.stderr  # said while it happened
        proc = subprocess.run(base + ["--model", "no-such-model"], capture_output=True, text=True, env=env,
                              timeout=180)
        assert proc.returncode == 2 and "Every request" in proc.stderr and "no-such-model" in proc.stderr
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def test_endpoint_expect_takes_the_serve_recipes_server_and_workload(fake_server, copt, tmp_path):
    """`profile endpoint --expect serve.yaml` alone measures the recipe's server at the predicted workload
    (concurrency, prompt/gen lengths, temperature) and compares the figures an endpoint measures."""
    port = int(fake_server.rsplit(":", 1)[1])
    recipe = tmp_path / "serve.yaml"
    recipe.write_text(
        f"task: serve\nmodel: /models/x\nserved_model_name: fake\nport: {port}\nprediction:\n  figures:\n"
        "    ttft_s: 0.01\n    tpot_s: 0.01\n    output_tokens_per_s: 100.0\n    peak_mem_bytes: 1.0e9\n"
        "  assumptions:\n    concurrency: 2\n    prompt_len: 8\n    gen_len: 6\n    temperature: 0.7\n"
        "    top_p: 0.9\n    top_k: 20\n")
    RECEIVED.clear()
    proc = copt("profile", "endpoint", "--expect", str(recipe), "--num-requests", "4", "--tolerance", "100",
                "--json", "--report", str(tmp_path / "p.json"), timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    profile, check = doc["profile"], doc["check"]
    assert [lv["concurrency"] for lv in profile["levels"]] == [2] and check["level"] == "concurrency 2"
    assert profile["workload"]["gen_len"] == 6 and profile["workload"]["temperature"] == 0.7
    assert (profile["workload"]["top_p"], profile["workload"]["top_k"]) == (0.9, 20)
    assert RECEIVED and all((b["temperature"], b["top_p"], b["top_k"]) == (0.7, 0.9, 20) for b in RECEIVED)
    # advise prices the sampling the load tester sent
    advised = copt("advise", "--from-profile", str(tmp_path / "p.json"), "--model", "llama-3.2-1b", "--gpu", "h200",
                   "--json", timeout=120)
    assert advised.returncode == 0, advised.stderr
    advice = json.loads(advised.stdout)
    assert advice["top_plan"]["assumptions"]["sampling"] == "sampled (temperature > 0, top k p draw)"
    # the server ran on this machine: its host's speed is recorded, and advise prices copt serve's host work by it
    assert 0 < profile["hardware"]["host_loop_s"] < 5
    assert advice["assumptions"]["host_loop_ms"] == pytest.approx(profile["hardware"]["host_loop_s"] * 1e3, abs=1e-3)
    # the level's own closed loop (2 clients, 4 requests) replayed, and its figures set against the replay's
    assert advice["assumptions"]["closed_loop_requests"] == 4
    assert {"closed_loop_tpot_s", "closed_loop_output_tokens_per_s"} <= {row["metric"] for row in advice["measured"]}
    assert profile["workload"]["url"] == f"http://127.0.0.1:{port}"
    status = {f["name"]: f["status"] for f in check["figures"]}
    assert status["peak_mem_bytes"] == "not-measured"
    assert {status[k] for k in ("ttft_s", "tpot_s", "output_tokens_per_s")} <= {"pass", "miss"}


def test_endpoint_writes_vllm_bench_serve_json_that_reads_back(fake_server, copt, tmp_path):
    """--save-vllm-bench: one `vllm bench serve --save-result` document per level, which copt's reader of that
    format turns back into the same figures; --save-requests: every timed request, whose TTFTs are the level's."""
    from clusteropt_cli.core.profile.external import detect_tool, external_report

    report = tmp_path / "copt.json"
    started = time.time()
    proc = copt("profile", "endpoint", "--url", fake_server, "--model", "fake", "--concurrency", "1,2",
                "--num-requests", "4", "--gen-len", "6", "--prompt-len", "8", "--report", str(report),
                "--save-vllm-bench", str(tmp_path / "bench.json"), "--save-requests", str(tmp_path / "req.jsonl"),
                timeout=120)
    assert proc.returncode == 0, proc.stderr
    ours = json.loads(report.read_text())
    rows = [json.loads(line) for line in (tmp_path / "req.jsonl").read_text().splitlines()]
    assert [r["level"] for r in rows] == ["c1"] * 4 + ["c2"] * 4
    assert all(r["ok"] and r["output_tokens"] == 6 and started < r["sent_at"] < time.time() for r in rows)
    for level, tag in zip(ours["levels"], ("c1", "c2"), strict=True):
        ttfts = sorted(r["ttft_s"] for r in rows if r["level"] == tag)
        assert ttfts[0] <= level["ttft_s"]["p50"] <= ttfts[-1]
    for level, name in zip(ours["levels"], ("bench-c1.json", "bench-c2.json"), strict=True):
        doc = json.loads((tmp_path / name).read_text())
        assert detect_tool(doc) == "vllm-bench" and doc["max_concurrency"] == level["concurrency"]
        assert doc["completed"] == 4 and doc["total_output_tokens"] == 24
        assert doc["median_ttft_ms"] == pytest.approx(level["ttft_s"]["p50"] * 1e3)
        assert doc["temperature"] == ours["workload"]["temperature"]  # the sampling sent, read back as sent
        assert external_report(doc, "vllm-bench").workload["temperature"] == ours["workload"]["temperature"]
        (back,) = external_report(doc, "vllm-bench").levels
        for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
            assert back.model_dump()[key] == pytest.approx(level[key]), key
        assert back.output_tokens_per_s == pytest.approx(level["output_tokens_per_s"])
    again = copt("profile", "endpoint", "--url", fake_server, "--model", "fake", "--concurrency", "1,2",
                 "--save-vllm-bench", str(tmp_path / "bench.json"), timeout=60)
    assert again.returncode == 2 and "bench-c1.json" in again.stderr  # refused before any request
    read_back = copt("profile", "endpoint", "--from-profile", str(report), "--save-requests",
                     str(tmp_path / "more.jsonl"), timeout=60)
    assert read_back.returncode == 2 and "live run" in read_back.stderr and not (tmp_path / "more.jsonl").exists()


def test_endpoint_writes_guidellm_report_that_reads_back(fake_server, copt, tmp_path):
    """--save-guidellm: one guidellm benchmarks report, one generative_benchmark per level in guidellm's layout
    (units: ms for TTFT/ITL, s for request latency), which copt's guidellm reader turns back into the same
    figures; `advise --from-profile` reads it."""
    from clusteropt_cli.core.profile.external import detect_tool, external_report

    report, saved = tmp_path / "copt.json", tmp_path / "guidellm.json"
    proc = copt("profile", "endpoint", "--url", fake_server, "--model", "fake", "--concurrency", "1,2",
                "--num-requests", "4", "--gen-len", "6", "--prompt-len", "8", "--report", str(report),
                "--save-guidellm", str(saved), timeout=120)
    assert proc.returncode == 0, proc.stderr
    ours, doc = json.loads(report.read_text()), json.loads(saved.read_text())
    assert detect_tool(doc) == "guidellm" and doc["args"]["model"] == "fake" and doc["args"]["rate"] == [1, 2]
    assert len(doc["benchmarks"]) == 2
    for level, bench in zip(ours["levels"], doc["benchmarks"], strict=True):
        assert bench["type_"] == "generative_benchmark"
        assert bench["config"]["strategy"] == {"type_": "concurrent", "streams": level["concurrency"]}
        assert bench["scheduler_metrics"]["requests_made"] == {"successful": 4, "incomplete": 0, "errored": 0,
                                                               "total": 4}
        ttft = bench["metrics"]["time_to_first_token_ms"]["successful"]
        assert ttft["median"] == pytest.approx(level["ttft_s"]["p50"] * 1e3)
        assert ttft["percentiles"]["p99"] == pytest.approx(level["ttft_s"]["p99"] * 1e3) and ttft["count"] == 4
        assert bench["metrics"]["request_latency"]["successful"]["mean"] == pytest.approx(level["e2e_s"]["mean"])
        assert bench["metrics"]["output_token_count"]["successful"]["mean"] == pytest.approx(6.0)
    back = external_report(doc, "guidellm")
    assert back.workload["concurrency"] == [1, 2] and back.workload["gen_len"] == 6
    # the sampling the requests carried, where guidellm 0.8 keeps it (its backend's extra body), read back as sent
    assert doc["config"]["spec"]["backend"]["extras"]["body"]["temperature"] == ours["workload"]["temperature"]
    assert back.workload["temperature"] == ours["workload"]["temperature"] and "sampling" not in back.workload
    for level, lv in zip(ours["levels"], back.levels, strict=True):
        got = lv.model_dump()
        for key in ("ttft_s", "tpot_s", "e2e_s"):
            assert got[key] == pytest.approx(level[key]), key
        assert got["itl_s"] == pytest.approx(level["tpot_s"])  # guidellm's inter-token latency is copt's TPOT
        for key in ("concurrency", "requests", "completed", "errors"):
            assert got[key] == level[key], key
        for key in ("duration_s", "request_throughput", "output_tokens_per_s"):
            assert got[key] == pytest.approx(level[key]), key
    for key in ("ttft_s", "tpot_s", "output_tokens_per_s"):
        assert back.metrics[key] == pytest.approx(ours["metrics"][key]), key
    advised = copt("advise", "--from-profile", str(saved), "--model", "llama-3.2-1b", "--gpu", "h200", "--json",
                   timeout=120)
    assert advised.returncode == 0, advised.stderr
    measured = {row["metric"] for row in json.loads(advised.stdout)["measured"]}
    assert {"ttft_s", "tpot_s", "output_tokens_per_s"} <= measured
    again = copt("profile", "endpoint", "--url", fake_server, "--model", "fake", "--save-guidellm", str(saved),
                 timeout=60)
    assert again.returncode == 2 and "--save-guidellm" in again.stderr  # refused before any request


_DATA = Path(__file__).resolve().parents[1] / "data"


def _serve_recipe(path, concurrency: int, ttft_s: float, tpot_s: float, out_tps: float):
    path.write_text(f"task: serve\nmodel: /models/x\nprediction:\n  figures:\n    ttft_s: {ttft_s}\n"
                    f"    tpot_s: {tpot_s}\n    output_tokens_per_s: {out_tps}\n"
                    f"  assumptions:\n    concurrency: {concurrency}\n")
    return path


def test_expect_checks_a_guidellm_report_without_a_server(copt, tmp_path):
    """`profile endpoint --from-profile guidellm.json --expect R.yaml` checks the prediction against guidellm's
    measurement at the predicted concurrency (16 of the report's 1 and 16), and exits 6 when it misses."""
    close = _serve_recipe(tmp_path / "close.yaml", 16, 0.05, 0.003, 4500.0)
    proc = copt("profile", "endpoint", "--from-profile", str(_DATA / "guidellm_report.json"), "--expect",
                str(close), "--json", timeout=60)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["check"]["passed"] and doc["check"]["level"] == "concurrency 16"
    measured = {f["name"]: f["measured"] for f in doc["check"]["figures"]}
    assert measured == pytest.approx({"ttft_s": 0.048, "tpot_s": 0.0031, "output_tokens_per_s": 4544.0})
    far = _serve_recipe(tmp_path / "far.yaml", 16, 0.01, 0.003, 4500.0)
    missed = copt("profile", "endpoint", "--from-profile", str(_DATA / "guidellm_report.json"), "--expect",
                  str(far), timeout=60)
    assert missed.returncode == 6 and "ttft_s" in missed.stderr
    assert "predicted vs measured at concurrency 16" in missed.stdout


def test_expect_on_a_closed_loop_bounds_ttft_and_checks_the_out_of_step_tpot(copt, tmp_path):
    """Closed-loop clients fall out of step after their first round: the measured TPOT is checked against the
    recipe's tpot_out_of_step_s (not its in-step tpot_s), and TTFT only against the in-step figure as a bound."""
    recipe = tmp_path / "loop.yaml"
    recipe.write_text("task: serve\nmodel: /models/x\nprediction:\n  figures:\n    ttft_s: 0.5\n    tpot_s: 0.002\n"
                      "    tpot_out_of_step_s: 0.0031\n    output_tokens_per_s: 4500.0\n"
                      "  assumptions:\n    concurrency: 16\n")
    proc = copt("profile", "endpoint", "--from-profile", str(_DATA / "guidellm_report.json"), "--expect",
                str(recipe), "--json", timeout=60)
    assert proc.returncode == 0, proc.stderr
    checks = {f["name"]: f for f in json.loads(proc.stdout)["check"]["figures"]}
    assert set(checks) == {"ttft_s", "tpot_s", "output_tokens_per_s"}
    assert checks["tpot_s"]["predicted"] == 0.0031 and checks["tpot_s"]["note"] == "out of step"
    assert checks["ttft_s"]["note"] == "upper" and checks["ttft_s"]["status"] == "pass"
    table = copt("profile", "endpoint", "--from-profile", str(_DATA / "guidellm_report.json"), "--expect",
                 str(recipe), timeout=60)
    assert "tpot_s (out of step)" in table.stdout and "≤ " in table.stdout
    slow = tmp_path / "slow.yaml"
    slow.write_text(recipe.read_text().replace("ttft_s: 0.5", "ttft_s: 0.02"))
    missed = copt("profile", "endpoint", "--from-profile", str(_DATA / "guidellm_report.json"), "--expect",
                  str(slow), timeout=60)
    assert missed.returncode == 6 and "ttft_s" in missed.stderr


def test_expect_on_a_closed_loop_checks_the_replayed_loop_of_the_same_load(copt, tmp_path):
    """A recipe with advise's replay of the closed loop (closed_loop_*, for 64 requests of 16 clients) is checked
    figure by figure against the level that sent that load; a replay of another load falls back to the bound and
    the out-of-step TPOT."""
    recipe = tmp_path / "replayed.yaml"
    recipe.write_text("task: serve\nmodel: /models/x\nprediction:\n  figures:\n    ttft_s: 0.5\n    tpot_s: 0.002\n"
                      "    tpot_out_of_step_s: 0.0031\n    output_tokens_per_s: 4500.0\n    closed_loop_ttft_s: 0.05\n"
                      "    closed_loop_tpot_s: 0.003\n    closed_loop_output_tokens_per_s: 4400.0\n"
                      "  assumptions:\n    concurrency: 16\n    closed_loop_requests: 64\n")
    report = str(_DATA / "guidellm_report.json")
    proc = copt("profile", "endpoint", "--from-profile", report, "--expect", str(recipe), "--json", timeout=60)
    assert proc.returncode == 0, proc.stderr
    checks = {f["name"]: f for f in json.loads(proc.stdout)["check"]["figures"]}
    assert set(checks) == {"ttft_s", "tpot_s", "output_tokens_per_s"}
    assert {name: (c["predicted"], c["note"], c["status"]) for name, c in checks.items()} == {
        "ttft_s": (0.05, "closed loop", "pass"), "tpot_s": (0.003, "closed loop", "pass"),
        "output_tokens_per_s": (4400.0, "closed loop", "pass")}
    table = copt("profile", "endpoint", "--from-profile", report, "--expect", str(recipe), timeout=60)
    assert "ttft_s (closed loop)" in table.stdout and "≤ " not in table.stdout
    slow = tmp_path / "slow.yaml"
    slow.write_text(recipe.read_text().replace("closed_loop_ttft_s: 0.05", "closed_loop_ttft_s: 0.02"))
    missed = copt("profile", "endpoint", "--from-profile", report, "--expect", str(slow), timeout=60)
    assert missed.returncode == 6 and "ttft_s" in missed.stderr
    other = tmp_path / "other.yaml"
    other.write_text(slow.read_text().replace("closed_loop_requests: 64", "closed_loop_requests: 160"))
    proc = copt("profile", "endpoint", "--from-profile", report, "--expect", str(other), "--json", timeout=60)
    assert proc.returncode == 0, proc.stderr
    checks = {f["name"]: f for f in json.loads(proc.stdout)["check"]["figures"]}
    assert checks["ttft_s"]["note"] == "upper" and checks["tpot_s"]["note"] == "out of step"
    malformed = tmp_path / "malformed.yaml"  # a hand-edited load: not the level's, so no replay comparison
    malformed.write_text(slow.read_text().replace("closed_loop_requests: 64", "closed_loop_requests: sixty-four"))
    proc = copt("profile", "endpoint", "--from-profile", report, "--expect", str(malformed), "--json", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert {f["name"]: f["note"] for f in json.loads(proc.stdout)["check"]["figures"]}["ttft_s"] == "upper"


def test_expect_checks_a_vllm_bench_result_and_refuses_another_concurrency(copt, tmp_path):
    """A vllm bench serve result is checked the same way; a prediction for a concurrency the file did not
    measure is refused (exit 2) rather than compared with another load."""
    bench = str(_DATA / "vllm_bench_serve.json")
    ok = copt("profile", "endpoint", "--from-profile", bench, "--expect",
              str(_serve_recipe(tmp_path / "c64.yaml", 64, 0.15, 0.0175, 3300.0)), "--json", timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["check"]["level"] == "concurrency 64"
    other = copt("profile", "endpoint", "--from-profile", bench, "--expect",
                 str(_serve_recipe(tmp_path / "c8.yaml", 8, 0.15, 0.0175, 3300.0)), timeout=60)
    assert other.returncode == 2 and "concurrency 8" in other.stderr and "concurrency 64" in other.stderr
    mixed = copt("profile", "endpoint", "--from-profile", bench, "--url", "http://127.0.0.1:1", timeout=60)
    assert mixed.returncode == 2 and "--url" in mixed.stderr


def test_from_profile_converts_between_formats(copt, tmp_path):
    """--from-profile with the --report/--save-* outputs converts a guidellm report into copt's profile and
    vLLM's result files (one per level), with the same figures."""
    proc = copt("profile", "endpoint", "--from-profile", str(_DATA / "guidellm_report.json"), "--report",
                str(tmp_path / "copt.json"), "--save-vllm-bench", str(tmp_path / "v.json"), timeout=60)
    assert proc.returncode == 0, proc.stderr
    ours = json.loads((tmp_path / "copt.json").read_text())
    assert ours["schema_version"].startswith("copt.profile/1") and ours["workload"]["tool"] == "guidellm"
    for level, name in zip(ours["levels"], ("v-c1.json", "v-c16.json"), strict=True):
        doc = json.loads((tmp_path / name).read_text())
        assert doc["max_concurrency"] == level["concurrency"]
        assert doc["median_ttft_ms"] == pytest.approx(level["ttft_s"]["p50"] * 1e3)


def _rate_report(path, rate: float = 48.0, duration: float = 10.0):
    """A `copt profile endpoint --rate RATE --duration D` report (the 8B shape's figures on the H200)."""
    level = {"concurrency": None, "rate": rate, "requests": 452, "completed": 452, "duration_s": 11.2,
             "request_throughput": 40.4, "output_tokens_per_s": 5167.0, "ttft_s": {"p50": 0.0504},
             "tpot_s": {"p50": 0.0199}, "itl_s": {"p50": 0.019}, "e2e_s": {"p50": 2.6}}
    path.write_text(json.dumps({
        "schema_version": "copt.profile/1", "kind": "endpoint", "mode": "endpoint",
        "created_at": "2026-12-03T00:00:00Z", "copt_version": "0", "hardware": {"device": "remote"},
        "model": {"name": "m"}, "workload": {"url": "http://127.0.0.1:8000", "rate": [rate], "duration_s": duration,
                                             "prompt_len": 256, "gen_len": 128, "temperature": 1.0, "seed": 0},
        "metrics": {"ttft_s": 0.0504, "tpot_s": 0.0199, "output_tokens_per_s": 5167.0}, "levels": [level],
        "verdict": {"bottleneck": "unknown"}}))
    return path


def test_expect_on_an_open_loop_checks_the_replayed_rate_of_the_same_load(copt, tmp_path):
    """A recipe from `advise --rate` (open_loop_*, for 48 requests/s over 10 s) is checked against the rate level that
    sent that load, never against the burst's batch figures; another load, or a closed-loop recipe, is refused with
    what to run."""
    report = str(_rate_report(tmp_path / "rates.json"))
    recipe = tmp_path / "open.yaml"
    recipe.write_text("task: serve\nmodel: /models/x\nprediction:\n  figures:\n    ttft_s: 0.017\n    tpot_s: 0.0045\n"
                      "    output_tokens_per_s: 217.0\n    open_loop_tpot_s: 0.019\n"
                      "    open_loop_output_tokens_per_s: 5300.0\n"
                      "  assumptions:\n    concurrency: 1\n    open_loop_rate: 48.0\n    open_loop_duration_s: 10.0\n")
    proc = copt("profile", "endpoint", "--from-profile", report, "--expect", str(recipe), "--json", timeout=60)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    checks = {f["name"]: f for f in doc["check"]["figures"]}
    assert doc["check"]["level"] == "rate 48.0"
    assert {name: (c["predicted"], c["note"], c["status"]) for name, c in checks.items()} == {
        "tpot_s": (0.019, "open loop", "pass"), "output_tokens_per_s": (5300.0, "open loop", "pass")}
    far = tmp_path / "far.yaml"
    far.write_text(recipe.read_text().replace("open_loop_tpot_s: 0.019", "open_loop_tpot_s: 0.012"))
    missed = copt("profile", "endpoint", "--from-profile", report, "--expect", str(far), timeout=60)
    assert missed.returncode == 6 and "tpot_s" in missed.stderr
    other = tmp_path / "other.yaml"
    other.write_text(recipe.read_text().replace("open_loop_duration_s: 10.0", "open_loop_duration_s: 60.0"))
    refused = copt("profile", "endpoint", "--from-profile", report, "--expect", str(other), timeout=60)
    assert refused.returncode == 2 and "open loop is 48.0 requests/s (Poisson) for 60 s" in refused.stderr
    elsewhere = tmp_path / "elsewhere.yaml"
    elsewhere.write_text(recipe.read_text().replace("open_loop_rate: 48.0", "open_loop_rate: 12.0"))
    refused = copt("profile", "endpoint", "--from-profile", report, "--expect", str(elsewhere), timeout=60)
    assert refused.returncode == 2 and "predicts an open loop at 12.0 requests/s" in refused.stderr
    closed = _serve_recipe(tmp_path / "closed.yaml", 16, 0.05, 0.003, 4500.0)
    refused = copt("profile", "endpoint", "--from-profile", report, "--expect", str(closed), timeout=60)
    assert refused.returncode == 2 and "predicts concurrency 16" in refused.stderr


def test_expect_sends_the_recipes_open_loop(tmp_path):
    """`profile endpoint --expect R.yaml` with no load flags sends the recipe's rate for its duration."""
    from clusteropt_cli.core.profile.expect import endpoint_values_from_recipe, load_expectation

    recipe = tmp_path / "open.yaml"
    recipe.write_text("task: serve\nmodel: /models/x\nprediction:\n  figures:\n    open_loop_tpot_s: 0.019\n"
                      "  assumptions:\n    concurrency: 1\n    open_loop_rate: 48.0\n    open_loop_duration_s: 10.0\n"
                      "    prompt_len: 256\n    gen_len: 128\n")
    exp = load_expectation(str(recipe))
    given = {"url": None, "model": None, "concurrency": [], "prompt_len": None, "gen_len": None, "temperature": None}
    values = endpoint_values_from_recipe(exp, given)
    assert (values["concurrency"], values["rate"], values["duration_s"]) == ([], [48.0], 10.0)
    assert (values["prompt_len"], values["gen_len"]) == (256, 128)
    typed = endpoint_values_from_recipe(exp, {**given, "concurrency": [8]})
    assert typed["concurrency"] == [8] and "rate" not in typed
    assert "rate" not in endpoint_values_from_recipe(exp, given, rate_given=True)


def test_a_constant_rate_recipe_is_not_checked_against_poisson_sends(copt, tmp_path):
    """An open loop replayed with evenly spaced sends (guidellm's constant profile) speaks of that load only: a
    Poisson level of the same rate and duration is refused, saying which spacing each had."""
    report = str(_rate_report(tmp_path / "rates.json"))
    recipe = tmp_path / "constant.yaml"
    recipe.write_text("task: serve\nmodel: /models/x\nprediction:\n  figures:\n    open_loop_tpot_s: 0.019\n"
                      "  assumptions:\n    concurrency: 1\n    open_loop_rate: 48.0\n    open_loop_duration_s: 10.0\n"
                      "    open_loop_arrivals: constant\n")
    refused = copt("profile", "endpoint", "--from-profile", report, "--expect", str(recipe), timeout=60)
    assert refused.returncode == 2
    assert "48.0 requests/s (evenly spaced) for 10 s; the profile's level sent 48.0/s (Poisson)" in refused.stderr


def test_prefix_cache_counters_read_samples_with_timestamps_and_quoted_labels():
    """A sample's optional timestamp was read as its value, and a label value holding a space split the line."""
    from clusteropt_cli.core.profile.endpoint import prefix_cache_counters

    text = ('vllm:prefix_cache_queries_total{model_name="my model",x="a}b"} 100 1712345678000\n'
            'vllm:prefix_cache_hits_total{model_name="my model"} 40 1712345678000\n')
    assert prefix_cache_counters(text) == (100.0, 40.0)
