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


def test_host_memory_check_adds_up_every_model(monkeypatch):
    """The weights of every model loaded together count against the host's available memory; a config whose size
    is unknown is not counted."""
    from clusteropt_cli.core import models
    from clusteropt_cli.errors import OutOfMemoryError
    from clusteropt_cli.modelspec import load_model_spec

    spec = load_model_spec("llama-3.2-1b")
    config = spec.to_hf_config()
    monkeypatch.setattr(models, "host_memory_available", lambda: int(spec.num_params * 4 * 1.5))
    unknown = ("custom", {"model_type": "not-a-model"}, 4)
    models.check_host_memory([("teacher", config, 4), unknown], hint="h")
    models.check_host_memory([("teacher", config, 2), ("student", config, 2)], hint="h")
    with pytest.raises(OutOfMemoryError) as info:
        models.check_host_memory(
            [("teacher", config, 4), ("student", config, 4)], hint="a smaller dtype"
        )
    assert info.value.exit_code == 5 and info.value.hint == "a smaller dtype"
    assert "teacher: 1.24B parameters × 4 bytes; student: 1.24B parameters × 4 bytes" in info.value.message
