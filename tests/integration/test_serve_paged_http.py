"""The paged KV cache through `copt serve`: prefix-cache hits in /metrics, --no-enable-prefix-caching and FP8
blocks from the command line, preemption under a tiny pool (no 429 for memory)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.integration.test_serve_helpers import eval_prompts, hf_greedy, metric, running_server

pytestmark = pytest.mark.slow
LABEL = 'model_name="m"'


def _complete(url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_prefix_hits_show_in_metrics_and_caching_can_be_turned_off(fixtures):
    prompt = eval_prompts(fixtures, 1, min_len=70, max_len=71, seed=31)[0]
    # the second server also stores its blocks in FP8 (--kv-cache-dtype fp8 from the command line)
    for flags, expect_hits in (((), True), (("--no-enable-prefix-caching", "--kv-cache-dtype", "fp8"), False)):
        with running_server(fixtures.teacher, "--served-model-name", "m", "--metrics-public", "--max-model-len",
                            "256", *flags) as (url, _):
            first = _complete(url, prompt, 4)
            second = _complete(url, prompt, 4)
            hits = metric(url, "vllm:prefix_cache_hits_total", LABEL)
            queries = metric(url, "vllm:prefix_cache_queries_total", LABEL)
            blocks = metric(url, "copt_kv_cache_blocks")
        assert first["token_ids"] == second["token_ids"] and len(first["token_ids"]) == 4
        assert blocks > 0
        if expect_hits:
            assert hits == (len(prompt) - 1) // 16 * 16 and queries == 2 * len(prompt)
        else:
            assert hits == 0


def test_a_tiny_pool_preempts_instead_of_refusing(fixtures):
    prompts = eval_prompts(fixtures, 6, min_len=30, max_len=50, seed=32)
    expected = hf_greedy(fixtures.teacher, prompts, 40)
    # 12 blocks of 16 tokens: one 128-token sequence fits; six of up to 90 tokens do not fit together
    with running_server(fixtures.teacher, "--served-model-name", "m", "--metrics-public", "--max-model-len", "128",
                        "--kv-cache-blocks", "12", "--max-batch-size", "6") as (url, proc):
        with ThreadPoolExecutor(6) as pool:
            outs = list(pool.map(lambda p: _complete(url, p, 40), prompts))
        preemptions = metric(url, "vllm:num_preemptions_total", LABEL)
    assert [o["token_ids"] for o in outs] == expected
    assert preemptions > 0
    # the start-up lines describe the pool that runs, not slots of max_model_len
    stderr = proc.stderr.read()
    assert "paged KV cache of 12 blocks × 16 tokens" in stderr and "up to 6 sequences of ≤ 128 tokens" in stderr
    assert "attention: copt paged attention" in stderr

