"""`copt serve --draft-model`: identical greedy output, acceptance exported, queue full → 429, SIGTERM drains."""

from __future__ import annotations

import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.integration.test_serve_helpers import eval_prompts, hf_greedy, metric, running_server

pytestmark = pytest.mark.slow


def test_draft_model_speculation_queue_and_drain(fixtures):
    prompts = eval_prompts(fixtures, 4, seed=21)
    expected = hf_greedy(fixtures.teacher, prompts, 24)
    args = ("--draft-model", str(fixtures.draft), "--num-speculative-tokens", "4", "--speculative-max-batch", "4",
            "--max-batch-size", "2", "--max-queue", "2", "--grace-period", "20")
    with running_server(fixtures.teacher, *args) as (url, proc):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        name = str(fixtures.teacher)

        def ask(prompt):
            r = client.completions.create(model=name, prompt=prompt, max_tokens=24, temperature=0,
                                          extra_body={"return_token_ids": True})
            return r.choices[0].model_extra["token_ids"]

        with ThreadPoolExecutor(4) as pool:  # 2 run, 2 wait: the queue is exactly full
            assert list(pool.map(ask, prompts)) == expected
        drafted = metric(url, "copt_spec_decode_draft_tokens_total")
        accepted = metric(url, "copt_spec_decode_accepted_tokens_total")
        assert drafted > 0 and 0 < accepted <= drafted
        assert metric(url, "copt_spec_decode_acceptance_rate") == pytest.approx(accepted / drafted)

        # queue full: 2 slots + 2 waiting; the rest must get 429 and the server keeps serving
        def flood(_):
            return httpx.post(url + "/v1/completions", timeout=60, json={
                "prompt": "import os\n", "max_tokens": 60, "temperature": 0, "ignore_eos": True}).status_code

        with ThreadPoolExecutor(10) as pool:
            statuses = list(pool.map(flood, range(10)))
        assert statuses.count(429) >= 1 and statuses.count(200) >= 4 and set(statuses) <= {200, 429}

        # SIGTERM while a stream is in flight: it completes, new requests are refused, exit status 0
        pieces, done = [], threading.Event()

        def stream():
            for chunk in client.completions.create(model=name, prompt="def f(x):", max_tokens=80, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True}):
                pieces.append(chunk.choices[0] if chunk.choices else None)
                if len(pieces) == 2:
                    done.set()
            done.set()

        worker = threading.Thread(target=stream)
        worker.start()
        assert done.wait(30)
        proc.send_signal(signal.SIGTERM)
        worker.join(60)
        assert proc.wait(60) == 0
        assert pieces[-1].finish_reason == "length"
        with pytest.raises(httpx.HTTPError):
            httpx.get(url + "/health", timeout=2)
