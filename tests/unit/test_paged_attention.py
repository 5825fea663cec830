"""Paged decode attention (clusteropt_cli/core/serve/paged_attention.py): the reference and the registered op against
a naive per-row loop, the op under torch.compile (dynamic shapes, fullgraph), and the Triton kernels themselves under
the Triton interpreter (CPU tensors, in a subprocess: TRITON_INTERPRET must be set before triton is imported)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from clusteropt_cli.core.serve import paged_attention as pa  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FP8 = getattr(torch, "float8_e4m3fn", None)


def naive(query, k_pool, v_pool, tables, positions, num_blocks, scale):
    """One row, one head at a time: the keys of row b are its table's blocks in order, 0..positions[b] (clamped to
    the bucket of num_blocks blocks), float32 softmax."""
    batch, heads, dim = query.shape
    block_size, kv_heads = k_pool.shape[1], k_pool.shape[2]
    groups = heads // kv_heads
    out = torch.empty(batch, heads, dim)
    for b in range(batch):
        length = min(max(int(positions[b]), 0), num_blocks * block_size - 1) + 1
        needed = (length + block_size - 1) // block_size
        keys = torch.cat([k_pool[int(tables[b, j])] for j in range(needed)])[:length].float()
        values = torch.cat([v_pool[int(tables[b, j])] for j in range(needed)])[:length].float()
        for h in range(heads):
            scores = keys[:, h // groups] @ query[b, h].float() * scale
            out[b, h] = scores.softmax(0) @ values[:, h // groups]
    return out.to(query.dtype)


def make_case(batch, kv_heads, groups, dim, block_size, num_blocks, dtype, pool_dtype=None, seed=0,
              table_dtype=None):
    """Pools with shuffled physical blocks, a table with spare rows and columns, ragged positions covering position 0,
    the last slot of a block, the first slot of the next (a block boundary), the bucket's last key and a scratch row
    past the bucket."""
    gen = torch.Generator().manual_seed(seed)
    pool_blocks = batch * num_blocks + 5
    query = torch.randn(batch, kv_heads * groups, dim, generator=gen).to(dtype)
    k_pool = torch.randn(pool_blocks, block_size, kv_heads, dim, generator=gen).to(pool_dtype or dtype)
    v_pool = torch.randn(pool_blocks, block_size, kv_heads, dim, generator=gen).to(pool_dtype or dtype)
    columns = num_blocks + 3  # more table columns than the bucket: the op may read only the first num_blocks
    total = (batch + 2) * columns
    tables = torch.cat([torch.randperm(pool_blocks, generator=gen) for _ in range(total // pool_blocks + 1)])
    tables = tables[:total].reshape(batch + 2, columns).to(table_dtype or torch.int32)
    cap = num_blocks * block_size
    candidates = [0, block_size - 1, block_size, 2 * block_size + 3, cap - 1, cap + 7, 10**9]
    positions = torch.tensor([candidates[i % len(candidates)] for i in range(batch)], dtype=torch.int64)
    return [query, k_pool, v_pool, tables, positions]


def tolerance(dtype):
    return {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}[dtype]


@pytest.mark.parametrize("groups", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype,pool", [("float32", None), ("bfloat16", None), ("bfloat16", "fp8"),
                                        ("float32", "fp8")])
def test_reference_and_op_match_a_per_row_loop(groups, block_size, dtype, pool):
    dtype = getattr(torch, dtype)
    pool_dtype = FP8 if pool == "fp8" else None
    if pool == "fp8" and FP8 is None:
        pytest.skip("no float8_e4m3fn in this torch")
    num_blocks = 5  # bucket of 5 blocks: more than most rows need
    case = make_case(7, 2, groups, 32, block_size, num_blocks, dtype, pool_dtype, seed=groups * block_size)
    scale = 32**-0.5
    expected = naive(*case, num_blocks, scale)
    ref = pa.reference_paged_decode_attention(*case, num_blocks, scale)
    op = pa.paged_decode_attention(*case, num_blocks, scale)
    assert ref.dtype == op.dtype == dtype and ref.shape == case[0].shape
    assert torch.isfinite(op.float()).all()  # the scratch rows too
    torch.testing.assert_close(ref.float(), expected.float(), atol=tolerance(dtype), rtol=tolerance(dtype))
    torch.testing.assert_close(op.float(), ref.float(), atol=0, rtol=0)


def test_the_op_is_registered_and_reads_only_the_bucket():
    op = pa.register()
    assert op is pa.register() and op is torch.ops.copt.paged_decode_attention.default
    case = list(make_case(3, 2, 2, 16, 16, 2, torch.float32, table_dtype=torch.int64))
    case[4] = torch.tensor([5, 31, 40])  # row 2 lies past a 2-block bucket: clamped to its 32 keys
    expected = naive(*case, 2, 0.25)
    # table columns past the bucket hold ids outside the pool; the spare rows too: neither may be read
    case[3][:, 2:] = 10**6
    case[3][3:] = -5
    out = op(*case, 2, 0.25)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="num_blocks"):
        pa.paged_decode_attention(*case, 9, 0.25)
    with pytest.raises(ValueError, match="block_tables"):
        pa.paged_decode_attention(case[0], case[1], case[2], case[3][:2], case[4], 2, 0.25)
    with pytest.raises(ValueError, match="pool dtype"):
        pa.paged_decode_attention(case[0].bfloat16(), *case[1:], 2, 0.25)


def test_split_choice_fills_the_gpu_at_batch_one_and_does_not_split_a_full_batch():
    assert pa.choose_splits(1, 8, 32768, 132) == 33  # 264 programs for 132 SMs
    assert pa.choose_splits(1, 8, 512, 132) == 8  # short bucket: no split under MIN_SPLIT_TOKENS keys
    assert pa.choose_splits(1, 8, 100, 132) == 2 and pa.choose_splits(1, 8, 16, 132) == 1
    assert pa.choose_splits(1, 1, 10**6, 132) == pa.MAX_SPLITS
    assert pa.choose_splits(64, 8, 32768, 132) == 1
    assert pa.choose_splits(256, 8, 32768, 132) == 1


@pytest.mark.slow
def test_the_op_compiles_with_dynamic_shapes_in_one_graph():
    pa.register()  # before compiling: defining the operator cannot be traced

    def layer(query, k_pool, v_pool, tables, positions, num_blocks: int):
        out = pa.paged_decode_attention(query * 2.0, k_pool, v_pool, tables, positions, num_blocks, 0.125)
        return out.float().sum(-1) + 1.0

    torch._dynamo.reset()
    compiled = torch.compile(layer, dynamic=True, fullgraph=True)
    for batch, num_blocks in ((3, 4), (6, 5)):
        case = make_case(batch, 2, 4, 16, 16, num_blocks, torch.float32, seed=batch)
        torch.testing.assert_close(compiled(*case, num_blocks), layer(*case, num_blocks), atol=1e-5, rtol=1e-5)


INTERPRETER_SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from tests.unit.test_paged_attention import make_case, naive, tolerance
from clusteropt_cli.core.serve import paged_attention as pa
results = []
fp8 = torch.float8_e4m3fn
cases = [  # groups, block_size, dtype, pool dtype, splits
    (1, 16, torch.float32, None, 1), (4, 16, torch.bfloat16, None, 3), (8, 32, torch.bfloat16, None, None),
    (4, 32, torch.float32, None, 2), (4, 16, torch.bfloat16, fp8, 2), (8, 16, torch.float32, fp8, 1),
    (1, 32, torch.bfloat16, fp8, 4),
]
for groups, block_size, dtype, pool_dtype, splits in cases:
    num_blocks = 6
    query, k_pool, v_pool, tables, positions = make_case(7, 2, groups, 32, block_size, num_blocks, dtype, pool_dtype,
                                                         seed=groups + block_size)
    expected = naive(query, k_pool, v_pool, tables, positions, num_blocks, 0.2)
    # poison the blocks that only bucket padding points at: a kernel that read past a row's last block would see NaN
    needed = (positions.clamp(max=num_blocks * block_size - 1) // block_size + 1).tolist()
    used = {int(tables[b, j]) for b in range(len(needed)) for j in range(needed[b])}
    k_pool, v_pool = k_pool.clone(), v_pool.clone()
    for blk in range(k_pool.shape[0]):
        if blk not in used:
            k_pool[blk] = float("nan")
            v_pool[blk] = float("nan")
    out = pa.triton_paged_decode_attention(query, k_pool, v_pool, tables, positions, num_blocks, 0.2,
                                           num_splits=splits)
    err = (out.float() - expected.float()).abs().max().item()
    results.append(dict(groups=groups, block_size=block_size, dtype=str(dtype), pool=str(pool_dtype), splits=splits,
                        err=err, tol=tolerance(dtype) if pool_dtype is None else 2e-2, dtype_ok=out.dtype == dtype))
    if splits == 1:  # one split known only at run time (a compiled step's symbolic batch): stage 2 gets no programs
        is_one, pa._is_one = pa._is_one, lambda value: False
        launched = []
        stage2 = pa.paged_decode_stage2
        pa.paged_decode_stage2 = type("Spy", (), {"__getitem__": lambda self, grid: launched.append(grid) or
                                                  stage2[grid]})()
        try:
            out = pa.triton_paged_decode_attention(query, k_pool, v_pool, tables, positions, num_blocks, 0.2,
                                                   num_splits=1)
        finally:
            pa._is_one, pa.paged_decode_stage2 = is_one, stage2
        err = (out.float() - expected.float()).abs().max().item()
        results.append(dict(groups=groups, block_size=block_size, dtype=str(dtype), pool=str(pool_dtype),
                            splits="1 at run time", err=err, tol=tolerance(dtype) if pool_dtype is None else 2e-2,
                            dtype_ok=out.dtype == dtype, no_merge_pass=launched == [(0, query.shape[1])]))
print(json.dumps(results))
"""


@pytest.mark.slow
def test_triton_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    from tests.triton_interpreter import run_interpreted

    results = run_interpreted(INTERPRETER_SCRIPT)
    assert len(results) == 9  # 7 cases, and the two of one split again with the count known only at run time
    for r in results:
        assert r["dtype_ok"] and r["err"] <= r["tol"] and r.get("no_merge_pass", True), r


def test_torch_sees_the_kernels_inside_the_op():
    """torch keys its compile caches on the source of the kernels a triton_op launches: they must be found."""
    pytest.importorskip("triton")
    from torch._library.triton import get_triton_kernels_for_op

    pa.register()
    names = sorted(k.fn.__name__ for k in get_triton_kernels_for_op(pa.OP_NAME))
    assert names == ["paged_decode_stage1", "paged_decode_stage2"]


NO_TRITON_SCRIPT = r"""
import sys
sys.modules["triton"] = None  # import triton now raises ImportError
sys.path.insert(0, sys.argv[1])
from clusteropt_cli.core.serve import paged_attention as pa
assert "torch" not in sys.modules  # importing the module stays light
from tests.unit.test_paged_attention import make_case, naive
import torch
assert not pa.triton_available()
case = make_case(5, 2, 4, 16, 16, 3, torch.float32)
torch.testing.assert_close(pa.paged_decode_attention(*case, 3, 0.3), naive(*case, 3, 0.3), atol=1e-5, rtol=1e-5)
print("ok")
"""


def test_the_op_works_without_triton():
    proc = subprocess.run([sys.executable, "-c", NO_TRITON_SCRIPT, str(REPO)], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
