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
