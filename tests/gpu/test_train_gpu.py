"""copt train on a CUDA GPU: compiled bf16 default path, fp16 loss scaling, fp8 (cc >= 8.9), MFU and allocator peak."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def _tiny_llama():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=768, vocab_size=4096,
                                  max_position_embeddings=512)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _dataset():
    import torch

    from clusteropt_cli.core.train import PackedDataset

    g = torch.Generator().manual_seed(0)
    # a learnable stream: a repeated random pattern, so the loss must fall fast
    pattern = torch.randint(0, 4096, (256,), generator=g)
    return PackedDataset(pattern.repeat(64).view(-1, 256))


def _train(tmp_path, **kw):
    from clusteropt_cli.core.train import run_training
    from clusteropt_cli.recipe.schema.train import TrainRecipe

    kw = {"max_steps": 12, **kw}
    recipe = TrainRecipe(model="tiny", seq_len=256, micro_batch=8, lr=2e-3, warmup_steps=0, **kw)
    return run_training(recipe, _tiny_llama(), _dataset(), tmp_path / "out", save_final=False)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_compiled_mixed_precision_learns_and_reports_mfu(tmp_path, precision):
    result = _train(tmp_path, precision=precision)
    assert result.final_loss < result.first_loss - 1.0, result.losses
    assert result.peak_mem_bytes and result.peak_mem_bytes > 0
    assert result.mfu is not None and 0 < result.mfu < 1  # a catalog GPU


def test_fp8_on_capable_gpu(tmp_path):
    import torch

    from clusteropt_cli.errors import UnsupportedHardwareError

    if torch.cuda.get_device_capability() < (8, 9):
        with pytest.raises(UnsupportedHardwareError):
            _train(tmp_path, precision="fp8")
        return
    pytest.importorskip("torchao.float8")
    result = _train(tmp_path, precision="fp8")
    assert result.final_loss < result.first_loss - 1.0, result.losses


def test_fused_loss_matches_hf_loss_on_gpu(tmp_path):
    fused = _train(tmp_path / "a", precision="bf16", max_steps=3, compile=False)
    hf = _train(tmp_path / "b", precision="bf16", max_steps=3, compile=False, loss_impl="hf")
    assert fused.losses == pytest.approx(hf.losses, rel=2e-2)


def test_deferred_step_readout_keeps_every_row_and_resumes(tmp_path):
    """On CUDA a step's loss and grad norm are read after the next step is queued: every step still gets its row,
    in order, with the values of that step; a save step is read before its checkpoint is written."""
    import math

    from clusteropt_cli.core.train import read_metrics

    first = _train(tmp_path, precision="bf16", max_steps=7, save_every=3)
    rows = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 8))
    assert [r["loss"] for r in rows] == first.losses
    assert all(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in rows)
    assert all(r["step_time_s"] > 0 and r["peak_mem_bytes"] > 0 for r in rows)
    assert (tmp_path / "out" / "checkpoints" / "step-6" / "meta.json").exists()
    resumed = _train(tmp_path, precision="bf16", max_steps=7, save_every=3, resume=True)
    assert resumed.start_step == 6 and len(resumed.losses) == 1
    rows = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 8))


def test_step_values_read_waits_for_its_own_step_only():
    import torch

    from clusteropt_cli.core.train.metrics import StepValues

    x = torch.randn(4096, 4096, device="cuda")
    loss = (x @ x).square().mean()
    values = StepValues({"loss": loss, "grad_norm": loss.sqrt(), "lr": 0.5, "extra": None})
    assert values.deferred
    for _ in range(20):  # queued after the values: read() must not need them
        x = x @ x / 64
    got = values.read()
    assert got["loss"] == pytest.approx(float(loss), rel=1e-6)
    assert got["grad_norm"] == pytest.approx(float(loss.sqrt()), rel=1e-6)
    assert got["lr"] == 0.5 and got["extra"] is None


def _text_recipe(tmp_path, shape: dict, words: int, **settings):
    """A TrainRecipe for copt train's own path: a llama config of `shape`, a repeated text of `words` words and the
    fixtures' byte-level BPE (1,024 tokens) trained on it, the output under tmp_path/out."""
    import json

    from clusteropt_cli.recipe.schema.train import TrainRecipe
    from tests.fixture_models import _train_tokenizer

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 512,
                                                      **shape}))
    text = tmp_path / "d.txt"
    text.write_text(" ".join(f"word{i % 97}" for i in range(words)))
    _train_tokenizer(text.read_text(), tmp_path / "tok")
    return TrainRecipe(model=str(tmp_path / "config.json"), tokenizer=str(tmp_path / "tok"), data=str(text),
                       output=str(tmp_path / "out"), seq_len=256, warmup_steps=0, **settings)


def test_zero3_builds_the_model_partitioned_on_the_gpu(tmp_path):
    """ZeRO-3 + CPU offload through copt train's own path (train_from_settings: zero3_model_init, then load_model): the
    model is built partitioned under deepspeed.zero.Init, never whole on the GPU — the GPU's peak up to the engine's
    start stays well under the 16-bit model's own size (before, deepspeed.initialize moved the whole model to the GPU
    first). The steps after it gather up to stage3_max_live_parameters (DeepSpeed's 1e9) at once: not checked."""
    pytest.importorskip("deepspeed")
    import torch

    from clusteropt_cli.core.train.run import train_from_settings

    shape = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 8,
             "intermediate_size": 8192, "vocab_size": 4096}
    recipe = _text_recipe(tmp_path, shape, 20000, micro_batch=1, max_steps=3, zero=3, offload="cpu",
                          precision="bf16", lr=1e-4)

    logs: list[str] = []
    peak_at_start: list[int] = []

    class PeakAtStart:  # called after deepspeed.initialize, before the first step (and the peak's reset)
        def on_start(self, total_steps: int, start_step: int) -> None:
            peak_at_start.append(torch.cuda.max_memory_allocated())

    torch.cuda.reset_peak_memory_stats()
    result = train_from_settings(recipe, callbacks=[PeakAtStart()], log=logs.append)
    params = 16 * (2 * 2048 * 2048 + 2 * 2048 * 1024 + 3 * 2048 * 8192) + 2 * 4096 * 2048
    assert any("partitioned by ZeRO-3 as built" in line for line in logs), logs
    assert result.steps == 3 and all(loss == loss for loss in result.losses)
    assert peak_at_start and peak_at_start[0] < 0.5 * 2 * params, (peak_at_start, 2 * params)


@pytest.mark.parametrize("zero", [2, 3])
def test_fp8_under_deepspeed_zero_learns_and_saves_a_plain_model(tmp_path, zero):
    """--precision fp8 with --zero 2/3 through copt train's own path: torchao's Float8Linear swapped in after
    zero.Init partitioned the linears (ZeRO-3) must train (the loss falls on a repeated text) and save a plain bf16
    model that transformers loads."""
    import torch

    pytest.importorskip("deepspeed")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability >= 8.9")
    pytest.importorskip("torchao.float8")
    from transformers import AutoModelForCausalLM

    from clusteropt_cli.core.train.run import train_from_settings

    shape = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 768, "vocab_size": 1024}
    recipe = _text_recipe(tmp_path, shape, 40000, micro_batch=8, max_steps=24, zero=zero, precision="fp8", lr=2e-3)
    out = tmp_path / "out"
    logs: list[str] = []

    class Logs:
        def on_log(self, message: str) -> None:
            logs.append(message)

    result = train_from_settings(recipe, callbacks=[Logs()], log=logs.append)
    assert any("Float8Linear" in line for line in logs), logs
    assert result.engine.startswith("deepspeed") and result.steps == 24
    assert result.final_loss < result.first_loss - 1.0, result.losses
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).cuda()
    assert type(model.model.layers[0].mlp.up_proj) is torch.nn.Linear
    ids = torch.randint(0, 1024, (1, 32), device="cuda")
    assert torch.isfinite(model(ids).logits.float()).all()
