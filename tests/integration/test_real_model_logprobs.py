"""Logprobs on real weights (SmolLM2-135M-Instruct, tests/real_model.py): the engine's prompt logprobs and sampled
token logprobs are transformers' log_softmax of the same fp32 model, top alternatives in the same order, through
the paged KV cache (block size 16) and through a prefix-cache hit; in-process, and through `copt serve`'s
OpenAI routes (completions with echo, chat top_logprobs: assert_served_logprobs_equal_hf, run on the server of
test_real_model.py's serve test)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

TEXTS = (
    "The capital of France is Paris, and the capital of Germany is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Water boils at 100 degrees Celsius at sea level. At the top of a high mountain, water boils at a",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
)
TOP_K = 5
TOL = 2e-4  # fp32 on CPU: the paged attention and HF's sdpa differ only in summation order (measured: <2e-5)


@pytest.fixture(scope="module")
def smol(real_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(real_model.model).eval(), AutoTokenizer.from_pretrained(
        real_model.model)


def _hf_logprobs(model, ids: list[int]):
    """HF's log_softmax at every position of `ids` (row i: the distribution of token i+1)."""
    import torch

    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def _assert_entries(entries, ids: list[int], reference, where: str) -> None:
    """entries[j] = (token, logprob, top) for token ids[j+1], scored by reference row j."""
    assert len(entries) == len(ids) - 1, where
    for j, (tok, lp, top) in enumerate(entries):
        row = reference[j]
        assert tok == ids[j + 1], where
        assert lp == pytest.approx(row[tok].item(), abs=TOL), f"{where}: token {j + 1}"
        want_v, want_i = row.topk(TOP_K)
        got_i = [t for t, _ in top]
        got_v = [v for _, v in top]
        assert len(top) == TOP_K, where
        # the same alternatives in the same order, unless two of them tie within the tolerance
        near_tie = any(a - b < 2 * TOL for a, b in zip(want_v.tolist(), want_v.tolist()[1:], strict=False))
        if not near_tie:
            assert got_i == want_i.tolist(), f"{where}: token {j + 1}"
        assert got_v == pytest.approx(want_v.tolist(), abs=TOL), f"{where}: token {j + 1}"
        assert got_v == sorted(got_v, reverse=True)


def test_engine_logprobs_equal_hf_log_softmax(real_model, smol):
    from clusteropt_cli.core.serve.engine import Engine, EngineConfig, GenerationRequest

    model, tok = smol
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    prompts.append(tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                           add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    n_new = 6
    config = EngineConfig(model=str(real_model.model), device="cpu", max_batch_size=4, max_model_len=256,
                          compile=False, kv_cache_tokens=2048)
    with Engine(config) as engine:
        assert engine.runner.paged and engine.config.block_size == 16
        assert str(engine.runner.dtype) == "torch.float32"
        # prompt logprobs (teacher-forced, bypassing the prefix cache) and sampled-token logprobs, batched
        scored = engine.generate([GenerationRequest(prompt_ids=p, max_new_tokens=n_new, prompt_logprobs=TOP_K,
                                                    logprobs=TOP_K, ignore_eos=True) for p in prompts])
        # the same prompts again with sampled-token logprobs only: they go through the prefix cache this time
        hits = engine.pool.stats.hits
        cached = engine.generate([GenerationRequest(prompt_ids=p, max_new_tokens=n_new, logprobs=TOP_K,
                                                    ignore_eos=True) for p in prompts])
        assert engine.pool.stats.hits - hits >= sum((len(p) - 1) // 16 for p in prompts) > 0
    for i, (prompt, first, again) in enumerate(zip(prompts, scored, cached, strict=True)):
        full = prompt + first.output_ids
        reference = _hf_logprobs(model, full)
        assert first.prompt_logprobs[0] is None and len(first.prompt_logprobs) == len(prompt)
        _assert_entries(first.prompt_logprobs[1:], prompt, reference, f"prompt {i}")
        # greedy: each output token is HF's argmax, with HF's logprob at its position
        assert first.output_ids == reference[len(prompt) - 1 : -1].argmax(-1).tolist()
        _assert_entries(first.logprobs, full[len(prompt) - 1 :], reference[len(prompt) - 1 :], f"output {i}")
        assert again.output_ids == first.output_ids and again.prompt_logprobs is None
        _assert_entries(again.logprobs, full[len(prompt) - 1 :], reference[len(prompt) - 1 :], f"cached {i}")


def assert_served_logprobs_equal_hf(url: str, model, tok) -> None:
    """The same through `copt serve`'s OpenAI surface: /v1/completions with echo (prompt logprobs, lm-eval's
    loglikelihood shape) and again from the prefix cache, and /v1/chat/completions' top_logprobs — HF's values, the
    top alternatives in HF's order, as token texts. `url`: a fresh server of this model (--served-model-name smol
    --metrics-public; no request before these: the prefix-cache hit count is checked), `model`/`tok` its HF model
    and tokenizer. Run by test_real_model.py's serve test, whose server (SmolLM2 with a BOS-adding tokenizer)
    answers these and its own requests."""
    import httpx

    from tests.integration.test_serve_helpers import metric

    text = TEXTS[2]
    question = [{"role": "user", "content": "Name the largest planet in the solar system."}]
    body = {"prompt": text, "max_tokens": 5, "temperature": 0, "logprobs": 3, "ignore_eos": True,
            "return_token_ids": True}
    echoed = httpx.post(url + "/v1/completions", json={**body, "echo": True}, timeout=120).json()["choices"][0]
    cached = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
    hits = metric(url, "vllm:prefix_cache_hits_total", 'model_name="smol"')
    # vLLM's prompt_logprobs field: on completions (per choice) and chat (per response)
    vllm_prompt = httpx.post(url + "/v1/completions", timeout=120, json={
        **body, "logprobs": None, "prompt_logprobs": 3}).json()["choices"][0]
    vllm_chat = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "messages": question, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}).json()
    chat = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "messages": question, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 3,
        "return_token_ids": True}).json()["choices"][0]
    prompt = tok(text)["input_ids"]
    assert echoed["prompt_token_ids"] == prompt and cached["token_ids"] == echoed["token_ids"]
    assert hits == (len(prompt) - 1) // 16 * 16 > 0  # the second request's full prompt blocks came from the cache
    full = prompt + echoed["token_ids"]
    reference = _hf_logprobs(model, full)
    lp = echoed["logprobs"]
    assert len(lp["token_logprobs"]) == len(full) and lp["token_logprobs"][0] is None
    decode = lambda i: tok.decode([i])  # noqa: E731 - the server's token texts: each token decoded alone

    def check(value, top, position, token):
        row = reference[position]
        assert value == pytest.approx(row[token].item(), abs=TOL)
        want_v, want_i = row.topk(3)
        assert list(top)[:3] == [decode(i) for i in want_i.tolist()]
        assert list(top.values())[:3] == pytest.approx(want_v.tolist(), abs=TOL)

    for j in range(1, len(full)):  # prompt tokens (echo) and the generated ones
        check(lp["token_logprobs"][j], lp["top_logprobs"][j], j - 1, full[j])
    for j, token in enumerate(cached["token_ids"]):  # through the prefix cache
        check(cached["logprobs"]["token_logprobs"][j], cached["logprobs"]["top_logprobs"][j],
              len(prompt) - 1 + j, token)

    def check_vllm(positions, ids, reference, k):
        """vLLM's shape: None first, then token id → {logprob, rank, decoded_token}: the prompt token, the top k."""
        assert len(positions) == len(ids) and positions[0] is None
        for j in range(1, len(ids)):
            row, token, got = reference[j - 1], ids[j], positions[j]
            first = next(iter(got))
            assert int(first) == token and got[first]["decoded_token"] == decode(token)
            value = row[token].item()
            assert got[first]["logprob"] == pytest.approx(value, abs=TOL)
            # its rank: 1 + the tokens more likely (within the tolerance, for near-ties)
            assert (row > value + TOL).sum() + 1 <= got[first]["rank"] <= (row > value - TOL).sum() + 1
            want_v, want_i = row.topk(k)
            want_i, want_v = want_i.tolist(), want_v.tolist()
            assert len(got) == k + (token not in want_i)
            near_tie = any(a - b < 2 * TOL for a, b in zip(want_v, want_v[1:], strict=False))
            for r, (tid, v) in enumerate(zip(want_i, want_v, strict=True), start=1):
                assert got[str(tid)]["logprob"] == pytest.approx(v, abs=TOL)
                assert got[str(tid)]["rank"] == r or near_tie

    check_vllm(vllm_prompt["prompt_logprobs"], prompt, reference, 3)
    chat_prompt = tok.apply_chat_template(question, add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"]
    chat_full = chat_prompt + chat["token_ids"]
    reference = _hf_logprobs(model, chat_full)
    check_vllm(vllm_chat["prompt_logprobs"], chat_prompt, reference, 2)
    entries = chat["logprobs"]["content"]
    assert len(entries) == len(chat["token_ids"]) > 0
    for j, (entry, token) in enumerate(zip(entries, chat["token_ids"], strict=True)):
        check(entry["logprob"], {e["token"]: e["logprob"] for e in entry["top_logprobs"]}, len(chat_prompt) - 1 + j,
              token)
        assert entry["token"] == decode(token) == entry["top_logprobs"][0]["token"]  # greedy: the most likely
