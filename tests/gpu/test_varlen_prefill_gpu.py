"""Packed prefill steps on CUDA in bf16 through FlashAttention's variable-length kernel (runner.flash_varlen): the
runner picks it (its start-up check against reference_varlen passed), and steps with new prompts, a continued
prompt and a continuation alone give the per-segment path's logits and KV writes within bf16 rounding."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_flash_varlen_steps_match_the_per_segment_path_on_gpu(fixtures):
    import torch

    from clusteropt_cli.core.serve import runner as runner_module
    from clusteropt_cli.core.serve.engine import Engine, EngineConfig
    from tests.unit.test_varlen_prefill import run_steps, varlen_steps

    assert torch.cuda.is_available()
    engine = Engine(EngineConfig(model=str(fixtures.teacher), device="cuda", dtype="bf16", max_batch_size=8,
                                 max_model_len=256, cuda_graphs=False, enable_prefix_caching=False))
    with engine:
        runner = engine.runner
        assert runner.varlen is runner_module.flash_varlen, runner.varlen_reason
        assert "FlashAttention varlen" in runner.attention_path
        steps, used = varlen_steps(runner)
        got_logits, got_kv = run_steps(runner, steps, used)
        kernel, runner.varlen = runner.varlen, None
        try:
            want_logits, want_kv = run_steps(runner, steps, used)
        finally:
            runner.varlen = kernel
    for got, want in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=0.05, atol=0.1)
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    for (gk, gv), (wk, wv) in zip(got_kv, want_kv, strict=True):
        torch.testing.assert_close(gk, wk, rtol=0.02, atol=0.02)
        torch.testing.assert_close(gv, wv, rtol=0.02, atol=0.02)


def test_captured_varlen_prefill_graphs_match_the_eager_steps_on_gpu(fixtures):
    """copt serve's prefill graphs in bf16 on CUDA: one graph per token bucket through FlashAttention's
    variable-length kernel, captured; packed steps with a resumed prompt and a continuation alone replay through
    them and give the eager steps' logits and KV writes within bf16 rounding; generation with prompts split over
    steps goes through them."""
    import torch

    from clusteropt_cli.core.serve import runner as runner_module
    from clusteropt_cli.core.serve.engine import Engine, EngineConfig, GenerationRequest
    from tests.unit.test_prefill_graph import _blocks, _prompts

    assert torch.cuda.is_available()
    engine = Engine(EngineConfig(model=str(fixtures.teacher), device="cuda", dtype="bf16", max_batch_size=8,
                                 max_model_len=256, cuda_graphs=True, compile=False, enable_prefix_caching=False))
    with engine:
        runner = engine.runner
        assert runner.prefill_graph_error is None and engine.stats.prefill_graphs > 0
        graphs = runner._prefill_graphs
        assert all(g.kernel is runner_module.flash_varlen and g.graph is not None for g in graphs)
        used = _blocks(runner, {1: [40, 41, 42], 2: [50], 3: [60, 61]})
        p1, p2, p3 = _prompts(engine, [37, 12, 23], seed=3)
        steps = [([(1, 0, p1[:20]), (2, 0, p2)], [[], [11]]),
                 ([(1, 20, p1[20:]), (3, 0, p3)], [[16], [22]]),
                 ([(2, 12, p3[:3])], [[2]])]

        def run(through_graphs: bool):
            for k, v in runner.caches:
                k[used] = 0
                v[used] = 0
            runner._prefill_graphs = graphs if through_graphs else []
            before = runner.prefill_graph_steps
            with torch.inference_mode():
                logits = [runner.forward_packed(chunks, wanted).float() for chunks, wanted in steps]
                kv = [(k[used].float(), v[used].float()) for k, v in runner.caches]
            assert runner.prefill_graph_steps - before == (len(steps) if through_graphs else 0)
            return logits, kv

        got_logits, got_kv = run(True)
        want_logits, want_kv = run(False)
        runner._prefill_graphs = graphs
        prompts = _prompts(engine, [3, 17, 40, 9, 33, 120, 64], seed=4)
        engine.max_batch_tokens = 48  # prompts split over steps: resumed segments through the graphs
        before = runner.prefill_graph_steps
        out = engine.generate([GenerationRequest(prompt_ids=p, max_new_tokens=8, ignore_eos=True) for p in prompts])
        graphed = runner.prefill_graph_steps - before
        runner._prefill_graphs = []
        eager = engine.generate([GenerationRequest(prompt_ids=p, max_new_tokens=8, ignore_eos=True)
                                 for p in prompts])
    for got, want in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=0.05, atol=0.1)
        assert (got.argmax(-1) == want.argmax(-1)).all()
    for (gk, gv), (wk, wv) in zip(got_kv, want_kv, strict=True):
        torch.testing.assert_close(gk, wk, rtol=0.02, atol=0.02)
        torch.testing.assert_close(gv, wv, rtol=0.02, atol=0.02)
    assert graphed >= 5
    same = sum(a == b for r, e in zip(out, eager, strict=True) for a, b in zip(r.output_ids, e.output_ids, strict=True))
    assert same >= 0.9 * sum(len(r.output_ids) for r in out)
