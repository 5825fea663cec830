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

    assert torch.cuda.is_available()
    engine = Engine(EngineConfig(model=str(fixtures.teacher), device="cuda", dtype="bf16", max_batch_size=8,
                                 max_model_len=256, cuda_graphs=False, enable_prefix_caching=False))
    with engine:
        runner = engine.runner
        assert runner.varlen is runner_module.flash_varlen, runner.varlen_reason
        assert "FlashAttention varlen" in runner.attention_path
        gen = torch.Generator().manual_seed(5)
        p1, p2, p3 = (torch.randint(3, runner.vocab_size - 1, (n,), generator=gen).tolist() for n in (37, 12, 23))
        tables = {1: [40, 41, 42], 2: [50], 3: [60, 61]}
        for row, blocks in tables.items():
            runner.tables.set(row, 0, blocks)
        runner.tables.flush()
        used = [b for blocks in tables.values() for b in blocks]
        steps = [([(1, 0, p1[:20]), (2, 0, p2)], [[], [11]]),
                 ([(1, 20, p1[20:]), (3, 0, p3)], [list(range(17)), [22]]),
                 ([(2, 12, p3[:3])], [[0, 1, 2]])]

        def run():
            for k, v in runner.caches:
                k[used] = 0
                v[used] = 0
            with torch.inference_mode():
                logits = [runner.forward_packed(chunks, wanted).float() for chunks, wanted in steps]
                kv = [(k[used].float(), v[used].float()) for k, v in runner.caches]
            return logits, kv

        got_logits, got_kv = run()
        kernel, runner.varlen = runner.varlen, None
        try:
            want_logits, want_kv = run()
        finally:
            runner.varlen = kernel
    for got, want in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=0.05, atol=0.1)
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    for (gk, gv), (wk, wv) in zip(got_kv, want_kv, strict=True):
        torch.testing.assert_close(gk, wk, rtol=0.02, atol=0.02)
        torch.testing.assert_close(gv, wv, rtol=0.02, atol=0.02)
