"""copt distill on a CUDA GPU: bf16 distillation with the teacher in bf16, traces through the CUDA engine."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.gpu


def test_logits_bf16_on_gpu_lowers_kl(fixtures, tmp_path):
    import torch

    from clusteropt_cli.core.distill.logits import distill_logits
    from clusteropt_cli.recipe.schema.distill import DistillRecipe

    assert torch.cuda.is_available()
    settings = DistillRecipe(mode="logits", teacher=str(fixtures.teacher), student=str(fixtures.student),
                             data=str(fixtures.train_text), max_steps=40, lr=3e-3, schedule="constant",
                             micro_batch=16, seq_len=128, precision="bf16", temperature=1.0, alpha=1.0,
                             teacher_dtype="bf16")
    result = distill_logits(settings, output_dir=tmp_path / "out", eval_text=fixtures.eval_text)
    assert result.train["engine"] == "torch" and result.train["peak_mem_bytes"] > 0
    assert result.eval_kl_after < 0.8 * result.eval_kl_before


def test_traces_through_the_cuda_engine(fixtures, tmp_path):
    from clusteropt_cli.core.distill.generate import distill_traces
    from clusteropt_cli.recipe.schema.distill import DistillRecipe

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Write function number {i}."}) + "\n"
                               for i in range(8)))
    settings = DistillRecipe(mode="traces", teacher=str(fixtures.teacher), prompts=str(prompts), samples=4,
                             max_new_tokens=32, sample_temperature=0.8)
    stats = distill_traces(settings, output=tmp_path / "traces.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "traces.jsonl").read_text().splitlines()]
    assert len(rows) == 32 == stats.samples_total
    assert stats.output_tokens_per_s > 0
