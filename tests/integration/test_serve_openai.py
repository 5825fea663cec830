"""`copt serve` on the fixture teacher, driven by the official openai client."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.integration.test_serve_helpers import eval_prompts, hf_greedy, metric, running_server

pytestmark = pytest.mark.slow
KEY = "sk-test-copt"


@pytest.fixture(scope="module")
def server(fixtures):
    # small step budget so that long prompts go through several prefill chunks
    with running_server(fixtures.teacher, "--api-key", KEY, "--metrics-public", "--max-batch-tokens", "48",
                        "--served-model-name", "teacher", "--max-model-len", "512") as (url, proc):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["teacher"]
    assert httpx.get(server + "/health").json() == {"status": "ok"}


def test_completion_matches_hf_generate(fixtures, client):
    prompt = eval_prompts(fixtures, 1, seed=3)[0]
    expected = hf_greedy(fixtures.teacher, [prompt], 24)[0]
    resp = client.completions.create(model="teacher", prompt=prompt, max_tokens=24, temperature=0,
                                     extra_body={"return_token_ids": True})
    choice = resp.choices[0]
    assert choice.model_extra["token_ids"] == expected
    assert choice.finish_reason == ("length" if len(expected) == 24 else "stop")
    assert resp.usage.prompt_tokens == len(prompt) and resp.usage.completion_tokens == len(expected)
    assert choice.text and isinstance(choice.text, str)


def test_32_concurrent_greedy_equal_hf(fixtures, client, server):
    prompts = eval_prompts(fixtures, 32, seed=7)
    expected = hf_greedy(fixtures.teacher, prompts, 20)
    steps_before = metric(server, "copt_engine_steps_total")
    decode_before = metric(server, "copt_engine_decode_steps_total")

    def ask(prompt):
        r = client.completions.create(model="teacher", prompt=prompt, max_tokens=20, temperature=0,
                                      extra_body={"return_token_ids": True})
        return r.choices[0].model_extra["token_ids"]

    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(ask, prompts))
    assert got == expected
    # continuous batching: far fewer engine steps than 32 requests × 20 tokens run one at a time
    assert metric(server, "copt_engine_steps_total") - steps_before < 32 * 20 / 2
    decode_steps = metric(server, "copt_engine_decode_steps_total") - decode_before
    assert 19 <= decode_steps < 32 * 20 / 2  # 19 decode steps at least (one token comes from prefill), batched


def test_streaming_completion_equals_non_streaming(fixtures, client):
    prompt = eval_prompts(fixtures, 1, seed=11)[0]
    full = client.completions.create(model="teacher", prompt=prompt, max_tokens=30, temperature=0)
    stream = client.completions.create(model="teacher", prompt=prompt, max_tokens=30, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    pieces, reasons, usage = [], [], None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.text)
            reasons.append(c.finish_reason)
    assert "".join(pieces) == full.choices[0].text
    assert reasons[-1] == full.choices[0].finish_reason and all(r is None for r in reasons[:-1])
    assert usage.completion_tokens == full.usage.completion_tokens


def test_chat_uses_template_and_streams(fixtures, client):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(fixtures.teacher)
    messages = [{"role": "user", "content": "def mean(data):"}]
    prompt_ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False)
    expected = hf_greedy(fixtures.teacher, [prompt_ids], 16)[0]
    resp = client.chat.completions.create(model="teacher", messages=messages, max_tokens=16, temperature=0,
                                          extra_body={"return_token_ids": True})
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].model_extra["token_ids"] == expected
    assert resp.usage.prompt_tokens == len(prompt_ids)
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="teacher", messages=messages, max_tokens=16, temperature=0, stream=True) if c.choices)
    assert text == resp.choices[0].message.content


def test_long_prompt_goes_through_chunked_prefill(fixtures, client, server):
    prompt = eval_prompts(fixtures, 1, min_len=400, max_len=401, seed=5)[0]
    expected = hf_greedy(fixtures.teacher, [prompt], 12)[0]
    before = metric(server, "copt_prefill_chunks_total")
    resp = client.completions.create(model="teacher", prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body={"return_token_ids": True})
    assert resp.choices[0].model_extra["token_ids"] == expected
    assert metric(server, "copt_prefill_chunks_total") - before >= 400 // 48  # 48-token budget per step


def test_stop_seed_and_vllm_extras(fixtures, client):
    prompt = eval_prompts(fixtures, 1, seed=13)[0]
    free = client.completions.create(model="teacher", prompt=prompt, max_tokens=40, temperature=0).choices[0].text
    stop = free[5:8]
    assert stop.strip(), "need a visible stop string"
    cut = client.completions.create(model="teacher", prompt=prompt, max_tokens=40, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == free[: free.index(stop)]
    a = client.completions.create(model="teacher", prompt=prompt, max_tokens=20, temperature=0.9, seed=42)
    b = client.completions.create(model="teacher", prompt=prompt, max_tokens=20, temperature=0.9, seed=42)
    assert a.choices[0].text == b.choices[0].text
    extra = client.completions.create(model="teacher", prompt=prompt, max_tokens=25, temperature=0,
                                      extra_body={"ignore_eos": True, "min_tokens": 25, "best_of": 1})
    assert extra.usage.completion_tokens == 25 and extra.choices[0].finish_reason == "length"


def test_bad_requests_get_their_status_and_server_stays_up(server, client):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    url = server + "/v1/completions"
    cases = [
        (b'{"prompt": "x", "max_tokens": ', 400),  # malformed JSON
        (json.dumps({"model": "nope", "prompt": "x"}).encode(), 404),
        (json.dumps({"prompt": list(range(2, 600)), "max_tokens": 4}).encode(), 400),  # longer than the context
        (json.dumps({"prompt": "x", "max_tokens": 0}).encode(), 400),
        (json.dumps({"prompt": "x", "max_tokens": "many"}).encode(), 400),
        (json.dumps({"prompt": "x", "temperature": "hot"}).encode(), 400),
    ]
    for body, status in cases:
        r = httpx.post(url, content=body, headers=headers, timeout=30)
        assert r.status_code == status, (body, r.text)
        assert set(r.json()["error"]) >= {"message", "type", "code"}
    for auth in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(url, json={"prompt": "x"}, headers=auth, timeout=30)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="teacher", prompt=list(range(2, 600)), max_tokens=2)
    assert httpx.get(server + "/health").status_code == 200
    assert client.completions.create(model="teacher", prompt="def", max_tokens=3).usage.completion_tokens >= 1


def test_disconnect_mid_stream_frees_the_slot(client, server):
    aborted = metric(server, "copt_request_finished_total", 'reason="abort"')
    stream = client.completions.create(model="teacher", prompt="import os\n", max_tokens=400, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    for _ in range(100):
        if metric(server, "copt_request_finished_total", 'reason="abort"') > aborted:
            break
        import time

        time.sleep(0.05)
    assert metric(server, "copt_request_finished_total", 'reason="abort"') == aborted + 1
    assert metric(server, "copt_num_requests_running") == 0


def test_metrics_are_prometheus(server):
    text = httpx.get(server + "/metrics").text
    for name in ("copt_time_to_first_token_seconds_bucket", "copt_inter_token_latency_seconds_bucket",
                 "copt_num_requests_running", "copt_num_requests_waiting", "copt_kv_cache_usage_ratio",
                 "copt_spec_decode_acceptance_rate", 'copt_http_requests_total{endpoint="/v1/completions"'):
        assert name in text
    assert metric(server, "copt_time_to_first_token_seconds_count") >= 30
