"""Packed prefill steps through one variable-length attention call per layer (runner._varlen_attention): the keys
each segment attends to — its own for a segment starting at position 0, its cached blocks for one continuing a
sequence — and the cumulative bounds give the logits and KV writes of the per-segment path. On CUDA the kernel is
FlashAttention's (checked against reference_varlen at start-up, on the GPU test too); here reference_varlen stands
in for it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from clusteropt_cli.core.serve import runner as runner_module  # noqa: E402
from clusteropt_cli.core.serve.engine import Engine, EngineConfig  # noqa: E402


@pytest.fixture(scope="module")
def engine(fixtures):
    eng = Engine(EngineConfig(model=str(fixtures.teacher), max_batch_size=8, max_model_len=256, device="cpu",
                              enable_prefix_caching=False))
    eng.start()
    assert eng.runner.paged and eng.runner.varlen is None  # not on CUDA: one SDPA per segment
    yield eng
    eng.stop()


def run_steps(runner, steps, used):
    """The packed steps from an empty cache: the logits of each and the pool contents of the used blocks (float32)."""
    for k, v in runner.caches:
        k[used] = 0
        v[used] = 0
    with torch.inference_mode():
        logits = [runner.forward_packed(chunks, wanted).float() for chunks, wanted in steps]
        kv = [(k[used].float(), v[used].float()) for k, v in runner.caches]
    return logits, kv


def varlen_steps(runner):
    """Three packed steps over rows 1–3 (their block tables set): two new prompts, one going on in the next step;
    the rest of it (20 cached tokens, every position's logits) beside a new prompt; a continuation alone (as a
    speculative window or a prefix-cache hit). Returns (steps, the blocks they use)."""
    gen = torch.Generator().manual_seed(5)
    p1, p2, p3 = (torch.randint(3, runner.vocab_size - 1, (n,), generator=gen).tolist() for n in (37, 12, 23))
    tables = {1: [40, 41, 42], 2: [50], 3: [60, 61]}
    for row, blocks in tables.items():
        runner.tables.set(row, 0, blocks)
    runner.tables.flush()
    steps = [([(1, 0, p1[:20]), (2, 0, p2)], [[], [11]]),
             ([(1, 20, p1[20:]), (3, 0, p3)], [list(range(17)), [22]]),
             ([(2, 12, p3[:3])], [[0, 1, 2]])]
    return steps, [b for blocks in tables.values() for b in blocks]


def test_varlen_steps_match_the_per_segment_path(engine, monkeypatch):
    runner = engine.runner
    steps, used = varlen_steps(runner)
    want_logits, want_kv = run_steps(runner, steps, used)
    calls = []

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, scaling):
        calls.append((cu_q.tolist(), cu_k.tolist(), max_q, max_k))
        return runner_module.reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scaling)

    monkeypatch.setattr(runner, "varlen", kernel)
    got_logits, got_kv = run_steps(runner, steps, used)
    layers = runner.num_layers
    assert len(calls) == 3 * layers  # one call per layer and step
    assert calls[0] == ([0, 20, 32], [0, 20, 32], 20, 20)
    assert calls[layers] == ([0, 17, 40], [0, 37, 60], 23, 37)  # the continuation attends to all 37 positions
    assert calls[2 * layers] == ([0, 3], [0, 15], 3, 15)
    for got, want in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for (gk, gv), (wk, wv) in zip(got_kv, want_kv, strict=True):
        torch.testing.assert_close(gk, wk, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gv, wv, rtol=1e-5, atol=1e-5)


def test_reference_varlen_is_causal_from_the_end_of_each_segments_keys():
    """The alignment the continuation steps need (query i of a segment sees its keys up to start + i): a mask
    aligned to the start of the keys would give other outputs."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 4, 8, generator=gen), torch.randn(7, 2, 8, generator=gen), torch.randn(7, 2, 8,
                                                                                                     generator=gen)
    cu_q, cu_k = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 7], dtype=torch.int32)
    got = runner_module.reference_varlen(q, k, v, cu_q, cu_k, 3, 7, None)
    kk, vv = k.repeat_interleave(2, dim=1).transpose(0, 1)[None], v.repeat_interleave(2, dim=1).transpose(0, 1)[None]
    for i in range(3):  # query i at position 4 + i
        row = F.scaled_dot_product_attention(q[i : i + 1].transpose(0, 1)[None], kk[:, :, : 5 + i], vv[:, :, : 5 + i])
        torch.testing.assert_close(got[i], row[0, :, 0])
    top_left = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kk, vv, is_causal=True)[0].transpose(0, 1)
    assert not torch.allclose(got, top_left)


def test_no_varlen_kernel_off_cuda():
    kernel, why = runner_module.varlen_kernel_for(torch.device("cpu"), torch.float32, 4, 2, 8)
    assert kernel is None and why
