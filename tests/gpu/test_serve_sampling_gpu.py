"""Sampling on the device through the captured graphs (CUDA): the sampling graphs are captured with the compiled
noise kernel, seeded requests repeat exactly through chained (async) steps, logit_bias / penalties / min_tokens act
inside the graphs, and logprobs equal HF's (fp32). The CPU tests check the same math without graphs."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_sampling_graphs_on_gpu(fixtures):
    import torch
    from transformers import AutoModelForCausalLM

    from clusteropt_cli.core.serve.engine import Engine, EngineConfig, GenerationRequest

    assert torch.cuda.is_available()
    engine = Engine(EngineConfig(model=str(fixtures.teacher), device="cuda", dtype="fp32", max_batch_size=8,
                                 max_model_len=256, kv_cache_tokens=8 * 256, cuda_graphs=True, compile=True))
    prompt = list(range(40, 60))
    with engine:
        sampler = engine.runner.sampler
        assert sampler.graph_error is None and sampler.compile_error is None and len(sampler._graphs) > 0
        before = engine.stats.chained_steps
        for params in ({"temperature": 0.8}, {"temperature": 1.0, "top_p": 0.9, "top_k": 20},
                       {"temperature": 0.7, "presence_penalty": 0.5, "repetition_penalty": 1.2}):
            reqs = [GenerationRequest(prompt_ids=prompt, max_new_tokens=24, seed=7, ignore_eos=True, **params)
                    for _ in range(2)]
            first, second = engine.generate(reqs[:1])[0], engine.generate(reqs[1:])[0]
            assert first.output_ids == second.output_ids, params
        assert engine.stats.chained_steps > before  # sampled steps went through the chained graphs
        forced = engine.generate([GenerationRequest(prompt_ids=prompt, max_new_tokens=8, temperature=1.0, seed=1,
                                                    logit_bias={17: 100.0}, ignore_eos=True)])[0]
        assert forced.output_ids == [17] * 8
        distinct = engine.generate([GenerationRequest(prompt_ids=prompt, max_new_tokens=20, frequency_penalty=100.0,
                                                      ignore_eos=True)])[0]
        assert len(set(distinct.output_ids)) == 20  # the counts are updated inside the graph
        eos = sorted(engine.eos_ids)[0]
        early = engine.generate([GenerationRequest(prompt_ids=prompt, max_new_tokens=12, min_tokens=5, seed=2,
                                                   temperature=1.0, logit_bias={eos: 100.0})])[0]
        assert early.num_output_tokens == 5 and early.finish_reason == "stop"
        lp = engine.generate([GenerationRequest(prompt_ids=prompt, max_new_tokens=6, logprobs=2,
                                                ignore_eos=True)])[0]
    model = AutoModelForCausalLM.from_pretrained(fixtures.teacher, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(input_ids=torch.tensor([prompt + lp.output_ids])).logits[0].float(), -1)
    for i, (tok, value, top) in enumerate(lp.logprobs):
        assert value == pytest.approx(float(ref[len(prompt) - 1 + i, tok]), abs=2e-3)
        assert tok == top[0][0]


def test_triton_top_k_thresholds_draw_the_sorts_tokens_on_gpu():
    """TOP_K / TOP_K_P take their thresholds from the two-pass Triton top-64 on CUDA (topk_kernel.py), TOP_K_DRAW
    draws among its entries (values and token ids): the values equal torch.topk's, the entries a stable sort's, and
    every row draws the token the full sort draws (128k vocabulary, ties and -inf rows)."""
    import torch

    from clusteropt_cli.core.serve import topk_kernel
    from clusteropt_cli.core.serve.device_sampling import (
        SORT,
        TOP_K,
        TOP_K_DRAW,
        TOP_K_P,
        TOP_K_P_DRAW,
        choose_tokens,
    )

    assert topk_kernel.kernel_error() is None
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, vocab = 48, 128256
    x = torch.randn(rows, vocab, device="cuda", generator=gen) * 3
    x[::7] = torch.round(x[::7] * 4) / 4  # ties at the thresholds
    x[3, : vocab // 2] = float("-inf")
    assert torch.equal(topk_kernel.top_values(x, 64), x.topk(64, dim=-1).values)
    values, ids = topk_kernel.top_entries(x, 64)
    sorted_values, order = x.sort(dim=-1, descending=True, stable=True)
    assert torch.equal(values, sorted_values[:, :64]) and torch.equal(ids, order[:, :64])
    k = torch.tensor([1, 5, 20, 50, 64, 0], device="cuda").repeat(rows // 6)
    p = torch.tensor([1.0, 0.9, 0.5], device="cuda").repeat(rows // 3)
    args = dict(temperature=torch.ones(rows, device="cuda"), min_p=torch.zeros(rows, device="cuda"),
                seed_lo=torch.arange(rows, device="cuda"), seed_hi=torch.zeros(rows, dtype=torch.long, device="cuda"),
                position=torch.full((rows,), 9, device="cuda"))
    draw_k = torch.where(k > 0, k, torch.full_like(k, 64))  # TOP_K_DRAW: every sampled row has a top-k
    ones = torch.ones(rows, device="cuda")
    for mode, top_p, top_k in ((TOP_K, ones, k), (TOP_K_P, p, k), (TOP_K_DRAW, ones, draw_k),
                               (TOP_K_P_DRAW, p, draw_k)):
        cheap = choose_tokens(x, args["temperature"], top_p, top_k, args["min_p"], args["seed_lo"], args["seed_hi"],
                              args["position"], mode)
        full = choose_tokens(x, args["temperature"], top_p, top_k, args["min_p"], args["seed_lo"], args["seed_hi"],
                             args["position"], SORT)
        assert torch.equal(cheap, full), mode


def test_first_tokens_of_high_slots_are_staged_on_gpu(fixtures):
    """A request admitted while others hold the low slots samples its first token through the first-token stage's
    captured graph (the rows of its own count): the same seeded tokens as the eager path, penalties included."""
    import torch

    from clusteropt_cli.core.serve.device_sampling import SlotSampler
    from clusteropt_cli.core.serve.engine import Engine, EngineConfig, GenerationRequest

    assert torch.cuda.is_available()
    engine = Engine(EngineConfig(model=str(fixtures.teacher), device="cuda", dtype="fp32", max_batch_size=8,
                                 max_model_len=256, kv_cache_tokens=8 * 256, cuda_graphs=True, compile=True))
    staged_calls = []
    original = SlotSampler.sample_staged

    def counting(self, *args, **kwargs):  # noqa: ANN001, ANN202
        staged_calls.append(len(args[2]))
        return original(self, *args, **kwargs)

    with engine:
        runner = engine.runner
        assert runner.first_token_stage is not None and len(runner.first_token_stage._graphs) > 0
        SlotSampler.sample_staged = counting
        try:
            outputs = {}
            for graphed in (True, False):
                runner.graphed_first_tokens = graphed
                held = [engine.submit(GenerationRequest(prompt_ids=[30 + i] * 8, max_new_tokens=200,
                                                        ignore_eos=True)) for i in range(6)]
                started: set[int] = set()
                while len(started) < len(held):  # every one holds its slot (it has a token)
                    started.update(i for i, h in enumerate(held) if h.take()[0] or h.done)
                tests = [GenerationRequest(prompt_ids=list(range(40, 60)), max_new_tokens=6, seed=11, ignore_eos=True,
                                           temperature=1.0, top_p=0.9, presence_penalty=0.5)]
                outputs[graphed] = engine.generate(tests)[0].output_ids
                for h in held:
                    h.cancel()
                for h in held:
                    h.result(timeout=60)
        finally:
            SlotSampler.sample_staged = original
            runner.graphed_first_tokens = True
    assert staged_calls, "the first token of slot 6 was not staged"
    assert outputs[True] == outputs[False]
