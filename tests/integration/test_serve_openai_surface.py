"""`copt serve`'s OpenAI/vLLM surface beyond text: logprobs (checked against HF), echo with prompt logprobs in the
request shape lm-evaluation-harness sends, n > 1, seeds under load, /tokenize, /detokenize, usage while streaming,
vLLM metric names."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.integration.test_serve_helpers import metric, running_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(fixtures):
    with running_server(fixtures.teacher, "--metrics-public", "--served-model-name", "teacher",
                        "--max-model-len", "256") as (url, proc):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hf(fixtures):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(fixtures.teacher, dtype=torch.float32).eval()

    def logprobs(ids: list[int], temperature: float = 1.0):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits / temperature, -1)

    return logprobs


PROMPT = list(range(40, 60))


def post(server: str, path: str, body: dict) -> dict:
    r = httpx.post(server + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_completion_logprobs_equal_hf(server, hf, temperature):
    out = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "temperature": temperature, "seed": 3,
                                           "logprobs": 2, "ignore_eos": True, "return_token_ids": True})
    choice = out["choices"][0]
    ids = choice["token_ids"]
    lp = choice["logprobs"]
    ref = hf(PROMPT + ids, temperature or 1.0)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) == 5
    for i, tok in enumerate(ids):
        row = ref[len(PROMPT) - 1 + i]
        assert lp["token_logprobs"][i] == pytest.approx(float(row[tok]), abs=1e-4)
        top_values = sorted(lp["top_logprobs"][i].values(), reverse=True)
        assert top_values[0] == pytest.approx(float(row.max()), abs=1e-4)
        assert len(lp["top_logprobs"][i]) in (2, 3)  # top 2, plus the chosen token when it is not among them
    assert lp["text_offset"][0] == 0 and "".join(lp["tokens"]).startswith(choice["text"][:1])


def test_echo_prompt_logprobs_in_lm_eval_harness_shape(server, hf):
    """lm-eval's local-completions loglikelihood: token-id prompts, echo, logprobs 1, max_tokens 1 (and 0)."""
    context, continuation = PROMPT[:12], PROMPT[12:]
    other = [7, 8, 9, 10, 11, 12]
    for max_tokens in (1, 0):
        out = post(server, "/v1/completions", {"model": "teacher", "prompt": [context + continuation, other],
                                               "temperature": 0, "max_tokens": max_tokens, "logprobs": 1,
                                               "seed": 1234, "echo": True})
        choices = sorted(out["choices"], key=lambda c: c["index"])
        assert len(choices) == 2
        for choice, ids, ctxlen in ((choices[0], context + continuation, len(context)), (choices[1], other, 1)):
            lp = choice["logprobs"]
            assert len(lp["token_logprobs"]) == len(ids) + max_tokens
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            ref = hf(ids)
            expected = [float(ref[j - 1, ids[j]]) for j in range(1, len(ids))]
            assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(expected, abs=1e-4)
            # lm-eval's parse_logprobs: the continuation's logprob sum and whether it is greedy
            span = slice(ctxlen, len(ids))
            total = sum(lp["token_logprobs"][span])
            greedy = all(t == max(top.values()) for t, top in zip(lp["token_logprobs"][span], lp["top_logprobs"][span],
                                                                  strict=True))
            assert total == pytest.approx(sum(expected[ctxlen - 1 :]), abs=1e-3)
            argmax = [int(ref[j - 1].argmax()) for j in range(ctxlen, len(ids))]
            assert greedy == (argmax == ids[ctxlen:])
        assert out["usage"]["completion_tokens"] == 2 * max_tokens
    r = httpx.post(server + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 0}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_chat_logprobs_and_n(client, server):
    resp = client.chat.completions.create(model="teacher", messages=[{"role": "user", "content": "def add(a, b):"}],
                                          max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.token == entry.top_logprobs[0].token  # greedy: the most likely token
    # longer than a KV block: the choices share the prompt's full blocks through the prefix cache
    prompt = "def main(argv):\n    parser = argparse.ArgumentParser(description='run')\n    parser.add_argument("
    many = client.completions.create(model="teacher", prompt=prompt, max_tokens=8, temperature=1.0, n=3, seed=5)
    again = client.completions.create(model="teacher", prompt=prompt, max_tokens=8, temperature=1.0, n=3, seed=5)
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    assert [c.text for c in many.choices] == [c.text for c in again.choices]
    assert len({c.text for c in many.choices}) > 1  # each choice its own sample
    assert metric(server, "copt_prompt_tokens_shared_total") > 0  # the choices shared one prefill


def test_seeded_sampling_is_reproducible_under_load(server):
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.9, "top_p": 0.9, "top_k": 20, "seed": 77,
            "ignore_eos": True, "return_token_ids": True}
    alone = post(server, "/v1/completions", body)["choices"][0]["token_ids"]
    others = [{"prompt": list(range(3, 10 + i)), "max_tokens": 24, "temperature": t, "ignore_eos": True,
               "presence_penalty": 0.5 if i % 2 else 0.0} for i, t in enumerate([0.0, 1.0, 0.7, 1.3, 0.0, 0.5])]
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(post, server, "/v1/completions", o) for o in others[:3]]
        mine = pool.submit(post, server, "/v1/completions", body)
        futures += [pool.submit(post, server, "/v1/completions", o) for o in others[3:]]
        assert mine.result()["choices"][0]["token_ids"] == alone
        assert all(f.result()["choices"] for f in futures)


def test_tokenize_detokenize(server, fixtures):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(fixtures.teacher)
    out = post(server, "/tokenize", {"model": "teacher", "prompt": "def f(x): return x"})
    assert out["tokens"] == tok.encode("def f(x): return x") and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 256
    assert post(server, "/detokenize", {"tokens": out["tokens"]})["prompt"] == tok.decode(out["tokens"])
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat["count"] > 1
    r = httpx.post(server + "/detokenize", json={"tokens": [-1]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    # the most ids it decodes (4 × --max-model-len), pretty-printed: not refused for its size before it is parsed
    most = [len(tok) - 1] * (4 * 256)
    r = httpx.post(server + "/detokenize", content=json.dumps({"tokens": most}, indent=8), timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["prompt"] == tok.decode(most)
    r = httpx.post(server + "/detokenize", json={"tokens": most + [0]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_streaming_usage_and_logprobs(server):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True, "ignore_eos": True, "logprobs": 1,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = []
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    token_events = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"] is None]
    running = [e["usage"]["completion_tokens"] for e in token_events]
    assert running == sorted(running) and running[-1] == 6
    assert sum(len(e["choices"][0]["logprobs"]["tokens"]) for e in token_events) == 6
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6


def test_vllm_metric_names(server):
    post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
    text = httpx.get(server + "/metrics", timeout=10).text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:time_per_output_token_seconds_bucket",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:e2e_request_latency_seconds_count",
                 "copt_num_requests_running"):
        assert f"\n{name}" in text, name
    line = next(ln for ln in text.splitlines() if ln.startswith("vllm:generation_tokens_total"))
    assert 'model_name="teacher"' in line and float(line.split()[-1]) >= 3
