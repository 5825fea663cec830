"""core/models: the dtype names and the auto rule used to load teachers and trained students."""

from __future__ import annotations

import pytest


def test_dtype_names_and_the_auto_rule():
    import torch

    from clusteropt_cli.core.models import DTYPE_NAMES, dtype_of, torch_dtype

    assert [dtype_of(n) for n in DTYPE_NAMES] == [torch.bfloat16, torch.float16, torch.float32]
    with pytest.raises(KeyError):
        dtype_of("int8")
    assert torch_dtype("auto", "cpu", "bf16") is torch.float32  # CPU: fp32 whatever the training precision
    assert torch_dtype("auto", "cuda:1", "bf16") is torch.bfloat16
    assert torch_dtype("auto", "cuda", "fp16") is torch.float16
    assert torch_dtype("auto", "cuda", "fp32") is torch.float32
    assert torch_dtype("auto", "cuda", "fp8") is torch.bfloat16
    assert torch_dtype("fp16", "cpu") is torch.float16  # an explicit name is taken as given


def test_load_causal_lm_reads_a_local_directory(fixtures):
    import torch

    from clusteropt_cli.core.models import load_causal_lm

    model = load_causal_lm(fixtures.teacher, "bf16")
    assert next(model.parameters()).dtype is torch.bfloat16 and next(model.parameters()).device.type == "cpu"
