"""The paged decode attention kernels on CUDA: against the gather reference over GQA groups, block sizes, dtypes, FP8
pools, split and single-pass launches and scratch rows; inside a compiled (dynamic, fullgraph) function replayed as a
CUDA graph, without torch's mutation analysis falling back to copying the pools."""

from __future__ import annotations

import logging

import pytest

pytestmark = pytest.mark.gpu


def _case(batch, kv_heads, groups, dim, block_size, num_blocks, dtype, pool_dtype, seed):
    """make_case's pools and tables on CUDA; a single row sits near the end of the bucket (the split path), rows past
    the first 7 (which cover position 0, block boundaries and scratch rows) at random positions."""
    import torch

    from tests.unit.test_paged_attention import make_case

    case = make_case(batch, kv_heads, groups, dim, block_size, num_blocks, dtype, pool_dtype, seed=seed)
    cap = num_blocks * block_size
    positions = case[4].clone()
    positions[7:] = torch.randint(0, cap, (batch,), generator=torch.Generator().manual_seed(seed))[7:]
    if batch == 1:
        positions[0] = cap - 3
    case[4] = positions
    return [t.cuda() for t in case]


@pytest.mark.parametrize("groups,dim", [(1, 64), (4, 128), (8, 64)])
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("dtype,pool", [("bfloat16", None), ("float16", None), ("float32", None),
                                        ("bfloat16", "fp8")])
@pytest.mark.parametrize("batch,num_blocks", [(1, 300), (7, 40), (64, 9)])
def test_kernels_match_the_reference(groups, dim, block_size, dtype, pool, batch, num_blocks):
    import torch

    from clusteropt_cli.core.serve import paged_attention as pa

    dtype = getattr(torch, dtype)
    pool_dtype = torch.float8_e4m3fn if pool else None
    num_blocks = max(1, num_blocks * 16 // block_size)
    case = _case(batch, 2, groups, dim, block_size, num_blocks, dtype, pool_dtype, seed=batch + groups)
    ref = pa.reference_paged_decode_attention(*case, num_blocks, dim**-0.5)
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    for splits in (None, 1, 5):
        out = pa.triton_paged_decode_attention(*case, num_blocks, dim**-0.5, num_splits=splits)
        assert out.dtype == dtype and torch.isfinite(out.float()).all()
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    op = pa.paged_decode_attention(*case, num_blocks, dim**-0.5)
    torch.testing.assert_close(op.float(), ref.float(), atol=tol, rtol=tol)


def test_compiled_and_captured_without_copying_the_pools(caplog):
    import torch

    from clusteropt_cli.core.serve import paged_attention as pa

    pa.register()

    def layer(query, k_pool, v_pool, tables, positions, num_blocks: int):
        return pa.paged_decode_attention(query * 2.0, k_pool, v_pool, tables, positions, num_blocks, 0.125) + 1.0

    torch._dynamo.reset()
    compiled = torch.compile(layer, dynamic=True, fullgraph=True)
    with caplog.at_level(logging.WARNING, logger="torch._higher_order_ops.triton_kernel_wrap"):
        for batch, num_blocks in ((1, 200), (3, 60), (40, 60)):
            case = _case(batch, 8, 4, 64, 16, num_blocks, torch.bfloat16, None, seed=batch)
            want = layer(*case, num_blocks)
            torch.testing.assert_close(compiled(*case, num_blocks), want, atol=3e-2, rtol=3e-2)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                compiled(*case, num_blocks)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = compiled(*case, num_blocks)
            case[4].copy_(torch.randint_like(case[4], 0, num_blocks * 16))  # new positions, same graph
            graph.replay()
            torch.testing.assert_close(out, layer(*case, num_blocks), atol=3e-2, rtol=3e-2)
    assert "assuming every input is mutated" not in caplog.text


def test_compiled_step_of_one_split_launches_no_merge_pass():
    """Under torch.compile (symbolic batch) a batch whose stage 1 takes one split (40 rows x 8 KV heads fill 132 SMs)
    writes its output in stage 1: stage 2 launches no programs; a batch of one still splits and merges."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from clusteropt_cli.core.serve import paged_attention as pa

    pa.register()

    def layer(query, k_pool, v_pool, tables, positions, num_blocks: int):
        return pa.paged_decode_attention(query, k_pool, v_pool, tables, positions, num_blocks, 0.125)

    torch._dynamo.reset()
    compiled = torch.compile(layer, dynamic=True, fullgraph=True)
    launched = {}
    for batch in (1, 3, 40):
        case = _case(batch, 8, 4, 64, 16, 60, torch.bfloat16, None, seed=batch)
        torch.testing.assert_close(compiled(*case, 60), layer(*case, 60), atol=3e-2, rtol=3e-2)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            compiled(*case, 60)
            torch.cuda.synchronize()
        launched[batch] = {e.key for e in prof.key_averages() if e.key.startswith("paged_decode_stage")}
    assert pa.choose_splits(40, 8, 960, torch.cuda.get_device_properties(0).multi_processor_count) == 1
    assert launched[1] == {"paged_decode_stage1", "paged_decode_stage2"}, launched
    assert launched[40] == {"paged_decode_stage1"}, launched
