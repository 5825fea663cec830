"""copt train core on CPU, in-process: data, schedule, fused loss, and the loop in each single-process mode."""

from __future__ import annotations

import json
import math

import pytest

from clusteropt_cli.core.train import DataCursor, pack_token_ids, read_metrics, read_texts, run_training
from clusteropt_cli.core.train.deepspeed_config import deepspeed_config
from clusteropt_cli.core.train.engines import lr_lambda
from clusteropt_cli.errors import BadInputError, UnsupportedHardwareError
from clusteropt_cli.recipe.schema.train import TrainRecipe


def _recipe(fixtures, tmp_path, **kw) -> TrainRecipe:
    base = dict(model=str(fixtures.student / "config.json"), tokenizer=str(fixtures.tokenizer),
                data=str(fixtures.train_text), output=str(tmp_path / "out"), seq_len=64, micro_batch=4,
                max_steps=8, lr=3e-3, warmup_steps=0, precision="fp32")
    base.update(kw)
    return TrainRecipe(**base)


@pytest.fixture(scope="module")
def data64(fixtures):
    """(tokenizer, 64-token blocks of the fixture text), tokenized once for the module."""
    from clusteropt_cli.core.train import build_text_dataset
    from clusteropt_cli.core.train.model import load_tokenizer, resolve_model_source

    tokenizer = load_tokenizer(resolve_model_source(str(fixtures.student), str(fixtures.tokenizer)))
    return tokenizer, build_text_dataset(fixtures.train_text, tokenizer, 64)


def _train(recipe: TrainRecipe, data64):
    from clusteropt_cli.core.train.model import load_model, resolve_model_source

    tokenizer, dataset = data64
    source = resolve_model_source(recipe.model, recipe.tokenizer)
    return run_training(recipe, load_model(source, seed=recipe.seed), dataset, recipe.output, tokenizer=tokenizer)


def test_read_and_pack(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n\n{"text": "two"}\n')
    assert read_texts(tmp_path / "a.jsonl") == ["one", "two"]
    (tmp_path / "b.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(BadInputError, match="b.jsonl:1"):
        read_texts(tmp_path / "b.jsonl")
    with pytest.raises(BadInputError, match="does not exist"):
        read_texts(tmp_path / "missing.txt")
    blocks = pack_token_ids([[1, 2, 3], [4, 5]], seq_len=3, eos_id=0)
    assert blocks.tolist() == [[1, 2, 3], [0, 4, 5]]  # eos between documents, the tail [0] dropped
    with pytest.raises(BadInputError, match="fewer than one block"):
        pack_token_ids([[1]], seq_len=8, eos_id=None)


def test_cursor_is_deterministic_and_resumable():
    full = DataCursor(10, seed=3)
    seq = [full.next_indices(4) for _ in range(5)]  # crosses two epoch boundaries
    assert sorted(seq[0] + seq[1] + seq[2][:2]) == list(range(10))
    resumed = DataCursor(10, seed=3)
    resumed.next_indices(4), resumed.next_indices(4)
    state = resumed.state_dict()
    again = DataCursor(10, seed=3)
    again.load_state_dict(state)
    assert [again.next_indices(4) for _ in range(3)] == seq[2:]
    with pytest.raises(BadInputError, match="blocks"):
        DataCursor(11).load_state_dict(state)


def test_lr_schedule():
    r = TrainRecipe(model="m", lr=1.0, warmup_steps=2, min_lr_ratio=0.1, schedule="cosine")
    f = lr_lambda(r, total_steps=12)
    assert f(0) == pytest.approx(0.5) and f(1) == pytest.approx(1.0)
    assert f(2) == pytest.approx(1.0) and f(12) == pytest.approx(0.1)
    assert f(7) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_fused_cross_entropy_matches_full_logits():
    import torch

    from clusteropt_cli.core.train.losses import fused_linear_cross_entropy

    torch.manual_seed(0)
    h = torch.randn(300, 32, requires_grad=True)
    w = torch.randn(100, 32, requires_grad=True)
    labels = torch.randint(0, 100, (300,))
    labels[::7] = -100
    fused = fused_linear_cross_entropy(h, w, labels, chunk_tokens=64)
    (fused * 3).backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref = torch.nn.functional.cross_entropy(h @ w.t(), labels, ignore_index=-100)
    (ref * 3).backward()
    assert fused.item() == pytest.approx(ref.item(), rel=1e-5)
    assert torch.allclose(gh, h.grad, atol=1e-6) and torch.allclose(gw, w.grad, atol=1e-6)


def test_deepspeed_config_zero3_offload():
    r = TrainRecipe(model="m", zero=3, offload="cpu", micro_batch=2, grad_accum=4, precision="fp16", grad_clip=1.0)
    cfg = deepspeed_config(r, world_size=2)
    assert cfg["train_batch_size"] == 16 and cfg["zero_optimization"]["stage"] == 3
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert cfg["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert cfg["fp16"]["loss_scale"] == 0  # dynamic loss scaling
    assert cfg["optimizer"]["type"] == "AdamW"  # DeepSpeedCPUAdam under offload


@pytest.mark.parametrize(("precision", "section"), [("bf16", "bf16"), ("fp8", "bf16"), ("fp16", "fp16"),
                                                      ("fp32", None)])
def test_deepspeed_config_uses_deepspeeds_own_mixed_precision(precision, section):
    """bf16 is DeepSpeed's bf16 mode (bf16 weights, fp32 masters in the optimizer), never torch.autocast, which
    DeepSpeed's engine switches off inside its forward on a GPU (the fp32 forward that ran out of memory)."""
    cfg = deepspeed_config(TrainRecipe(model="m", zero=2, precision=precision), world_size=2)
    assert [k for k in ("bf16", "fp16") if k in cfg] == ([section] if section else [])
    assert section is None or cfg[section]["enabled"] is True
    assert "torch_autocast" not in cfg


_DS_DTYPE_PROBE = """
import gc, json, sys, torch
import deepspeed.runtime.torch_autocast as dta
from clusteropt_cli.core.train.engines import DeepSpeedEngine
from clusteropt_cli.core.train.deepspeed_config import deepspeed_config
from clusteropt_cli.core.train.distributed import setup_distributed
from clusteropt_cli.recipe.schema.train import TrainRecipe
from transformers import LlamaConfig, LlamaForCausalLM

class CudaSemantics:  # DeepSpeed asks torch.is_autocast_enabled() (CUDA only): make it see CPU autocast as on a GPU
    def __getattr__(self, name):
        return getattr(torch, name)
    def is_autocast_enabled(self, device_type=None):
        return torch.is_autocast_enabled(device_type or "cpu")
dta.torch = CudaSemantics()
ctx = setup_distributed(1)
probes = {}
for zero in map(int, sys.argv[1].split(",")):  # each stage its own model and engine, in turn
    seen = []
    def loss_fn(model, batch, seen=seen):
        out = model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False)
        seen.append([str(out.logits.dtype), torch.is_autocast_enabled("cpu")])
        return out.loss, {}
    options = TrainRecipe(model="m", zero=zero, precision="bf16", micro_batch=2, seq_len=32, lr=1e-3)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256))
    engine = DeepSpeedEngine(options, model, loss_fn, ctx, 2, deepspeed_config(options, 1))
    ids = torch.randint(0, 256, (2, 32))
    losses = []
    for _ in range(2):
        loss, _ = engine.micro_step({"input_ids": ids, "labels": ids}, True)
        engine.optimizer_step()
        losses.append(float(loss))
    probes[zero] = {"seen": seen, "param_dtype": str(next(model.parameters()).dtype), "losses": losses}
    engine.engine.destroy()  # the next stage starts from nothing of this one (ZeRO-3's hooks on its model too)
    del engine, model
    gc.collect()
print(json.dumps(probes))
"""


@pytest.fixture(scope="module")
def ds_dtype_probes(request) -> dict:
    """The probe run once for the ZeRO stages of this module's selected dtype tests, one stage after the other in one
    process (as tests/integration/zero_states_worker.py measures its stages): the interpreter start and the torch,
    transformers and DeepSpeed imports are most of a probe's time. Returns stage → the probe's findings."""
    import subprocess
    import sys

    from tests.conftest import REPO

    test = "test_deepspeed_bf16_forward_is_bf16_under_gpu_autocast_semantics"
    stages = sorted({item.callspec.params["zero"] for item in request.session.items
                     if item.module is request.module and item.originalname == test})
    proc = subprocess.run([sys.executable, "-c", _DS_DTYPE_PROBE, ",".join(map(str, stages))], cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {int(stage): probe for stage, probe in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


@pytest.mark.slow
@pytest.mark.jit
@pytest.mark.parametrize("zero", [2, 3])
def test_deepspeed_bf16_forward_is_bf16_under_gpu_autocast_semantics(ds_dtype_probes, zero):
    """The forward inside DeepSpeed computes in bf16 even where DeepSpeed disables an outer autocast (CUDA): the
    failure measured on the H200 was a silent fp32 forward there; CPU autocast escapes DeepSpeed's CUDA-only check,
    so the probe gives DeepSpeed the GPU's view."""
    probe = ds_dtype_probes[zero]
    assert probe["param_dtype"] == "torch.bfloat16"
    assert [dtype for dtype, _ in probe["seen"]] == ["torch.bfloat16"] * 2
    assert probe["losses"][1] < probe["losses"][0]


def test_schema_rejects_bad_parallel_plans():
    with pytest.raises(ValueError, match="ZeRO-3 cannot be combined"):
        TrainRecipe(model="m", zero=3, pipeline_stages=2, gpus=2)
    with pytest.raises(ValueError, match="one stage per rank"):
        TrainRecipe(model="m", pipeline_stages=2, gpus=1)


def test_fp8_needs_a_capable_gpu():
    from clusteropt_cli.core.train.precision import check_precision_supported

    with pytest.raises(UnsupportedHardwareError, match="compute capability >= 8.9"):
        check_precision_supported("fp8", "cpu")


def _check_run(result, out, steps=8):
    assert result.steps == steps and result.engine == "torch"
    assert result.first_loss > 6.8  # random init: ln(1024) = 6.93
    assert result.final_loss < result.first_loss - 0.25, result.losses
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for key in ("loss", "lr", "tokens_per_s", "mfu", "peak_mem_bytes"):
        assert key in rows[0]
    assert rows[0]["mfu"] is None  # CPU
    assert rows[-1]["peak_mem_bytes"] > 0
    assert json.loads((out / "train_result.json").read_text())["steps"] == steps
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_loss_falls_in_mixed_precision(fixtures, tmp_path, data64, precision):
    result = _train(_recipe(fixtures, tmp_path, precision=precision), data64)
    rows = _check_run(result, tmp_path / "out")
    if precision == "fp16":
        assert rows[0]["loss_scale"] >= 1.0  # dynamic loss scaling is on


@pytest.mark.slow
def test_loss_falls_fp32_and_checkpointing_keeps_the_curve_with_less_memory(fixtures, tmp_path, data64):
    plain = _train(_recipe(fixtures, tmp_path / "a"), data64)
    _check_run(plain, tmp_path / "a" / "out")
    ckpt = _train(_recipe(fixtures, tmp_path / "b", activation_checkpointing=True), data64)
    _check_run(ckpt, tmp_path / "b" / "out")
    assert ckpt.losses == pytest.approx(plain.losses, abs=1e-4)
    assert ckpt.peak_mem_bytes < plain.peak_mem_bytes


@pytest.mark.slow
def test_final_model_loads_with_from_pretrained(fixtures, tmp_path, data64):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = _train(_recipe(fixtures, tmp_path, model=str(fixtures.student), max_steps=2, lr=1e-4), data64)
    out = tmp_path / "out"
    assert result.model_saved and (out / "model.safetensors").exists()
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.num_hidden_layers == 2 and tok.eos_token == "<|endoftext|>"
    assert not list(out.glob(".final-*"))


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True])
def test_cpu_peak_memory_matches_the_shared_definition(fixtures, tmp_path, checkpointing):
    """peak_mem_bytes on CPU = states + saved tensors + logits buffers (docs/advise.md): with the model's own loss
    and with the fused loss it equals `copt advise --gpu cpu`'s prediction for that loss; the fused loss holds less
    (no saved log-softmax)."""
    import torch

    from clusteropt_cli.core.advise.api import evaluate_train, resolve_target
    from clusteropt_cli.core.advise.plan import TrainPlan
    from clusteropt_cli.core.train import PackedDataset
    from clusteropt_cli.core.train.model import load_model, resolve_model_source
    from clusteropt_cli.modelspec import load_model_spec

    source = resolve_model_source(str(fixtures.teacher))
    dataset = PackedDataset(torch.randint(0, 1024, (8, 128), generator=torch.Generator().manual_seed(0)))
    measured = {}
    for loss_impl in ("hf", "fused"):
        recipe = TrainRecipe(model="t", seq_len=128, micro_batch=4, max_steps=1, precision="bf16",
                             activation_checkpointing=checkpointing, loss_impl=loss_impl)
        measured[loss_impl] = run_training(recipe, load_model(source), dataset, tmp_path / loss_impl,
                                           save_final=False).peak_mem_bytes
    target, _ = resolve_target("cpu")
    spec = load_model_spec(str(fixtures.teacher))
    for loss_impl in ("hf", "fused"):
        plan = TrainPlan(micro_batch=4, seq_len=128, precision="bf16", activation_checkpointing=checkpointing,
                         loss_impl=loss_impl)
        predicted = evaluate_train(spec, plan, target)["memory"]["per_gpu_bytes"]
        assert measured[loss_impl] == pytest.approx(predicted, rel=0.01), loss_impl
    assert measured["fused"] < measured["hf"]


def _tiny_llama(**overrides):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, **overrides)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def test_training_attention_is_mask_free_causal_sdpa_even_while_tracing(monkeypatch):
    """Under torch.compile transformers cannot prove the mask is causal and builds a [B,1,S,S] mask (no causal
    flash kernel); copt's training attention passes none and sets is_causal, with the same loss."""
    import torch
    import transformers.masking_utils as masking_utils

    from clusteropt_cli.core.train.attention import CAUSAL_SDPA, check_unpadded
    from clusteropt_cli.core.train.loop import prepare_model

    torch.manual_seed(0)
    model = _tiny_llama()
    ids = torch.randint(0, 128, (2, 16))
    monkeypatch.setattr(masking_utils, "is_tracing", lambda *a, **k: True)  # what torch.compile's tracing sees
    calls: list[tuple[bool, bool]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("attn_mask") is None, bool(kwargs.get("is_causal"))))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    reference = float(model(input_ids=ids, labels=ids).loss)
    assert calls and all(call == (False, False) for call in calls)  # the stock path: an explicit mask

    calls.clear()
    options = TrainRecipe(model="x", attn="sdpa", compile=False, precision="fp32")
    prepare_model(options, model, "cpu")
    assert model.config._attn_implementation == CAUSAL_SDPA
    assert float(model(input_ids=ids, labels=ids).loss) == pytest.approx(reference, abs=1e-5)
    assert calls and all(call == (True, True) for call in calls)
    padded = {"input_ids": ids, "attention_mask": torch.ones_like(ids).index_fill_(1, torch.tensor([0]), 0)}
    with pytest.raises(ValueError, match="padded"):
        check_unpadded(model, padded)
    check_unpadded(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})  # all ones: fine


def test_sliding_window_models_keep_their_mask():
    from clusteropt_cli.core.train.attention import use_causal_sdpa

    model = _tiny_llama()
    model.config.sliding_window = 8
    assert not use_causal_sdpa(model)
    assert model.config._attn_implementation == "sdpa"
    eager = _tiny_llama()
    eager.set_attn_implementation("eager")
    assert not use_causal_sdpa(eager)


def test_loss_chunk_tokens_reaches_the_fused_loss(monkeypatch):
    import torch

    import clusteropt_cli.core.train.losses as losses
    from clusteropt_cli.core.train.loop import default_loss_fn

    seen = []
    real = losses.fused_linear_cross_entropy

    def recording(*args, chunk_tokens, **kwargs):
        seen.append(chunk_tokens)
        return real(*args, chunk_tokens=chunk_tokens, **kwargs)

    monkeypatch.setattr(losses, "fused_linear_cross_entropy", recording)
    model = _tiny_llama()
    ids = torch.randint(0, 128, (2, 16))
    batch = {"input_ids": ids, "labels": ids}
    default, _ = default_loss_fn(TrainRecipe(model="x"), model, "torch")(model, batch)
    chunked, _ = default_loss_fn(TrainRecipe(model="x", loss_chunk_tokens=7), model, "torch")(model, batch)
    assert seen == [2**30 // (4 * 128), 7]  # default: ~1 GiB of fp32 logits per chunk
    assert float(chunked) == pytest.approx(float(default), rel=1e-5)
    with pytest.raises(ValueError, match="loss_chunk_tokens"):
        TrainRecipe(model="x", loss_chunk_tokens=7, loss_impl="hf")


def test_step_values_on_cpu_are_read_at_once():
    import torch

    from clusteropt_cli.core.train.metrics import StepValues

    values = StepValues({"loss": torch.tensor(2.5), "grad_norm": None, "lr": 0.1, "kl": torch.tensor([0.25])})
    assert not values.deferred  # nothing queued on a CPU: the loop writes the row at once
    assert values.read() == {"loss": 2.5, "grad_norm": None, "lr": 0.1, "kl": 0.25}


def _read_one_step_late(values):
    """StepValues as on CUDA (read after the next step is queued), on the CPU: the loop's deferred path in CI."""
    from clusteropt_cli.core.train.metrics import StepValues

    class ReadOneStepLate(StepValues):
        deferred = True

    return ReadOneStepLate(values)


@pytest.mark.slow
def test_deferred_step_readout_writes_every_row_in_order_and_resumes(fixtures, tmp_path, data64, monkeypatch):
    """The loop reads step n's values after step n+1 is queued: same losses and rows as reading at once, a save
    step read before its checkpoint (its row is in metrics.jsonl when the checkpoint exists), the last step read
    at the end, and --resume continues the same curve."""
    import clusteropt_cli.core.train.loop as loop

    at_once = _train(_recipe(fixtures, tmp_path / "a", max_steps=7), data64)
    monkeypatch.setattr(loop, "StepValues", _read_one_step_late)
    saves: list[tuple[int, int]] = []  # (checkpoint step, rows written by then)
    real_save = loop._save_checkpoint

    def recording_save(engine, output_dir, step, *args):
        saves.append((step, len(read_metrics(output_dir / "metrics.jsonl"))))
        return real_save(engine, output_dir, step, *args)

    monkeypatch.setattr(loop, "_save_checkpoint", recording_save)
    late = _train(_recipe(fixtures, tmp_path / "b", max_steps=7, save_every=3), data64)
    rows = read_metrics(tmp_path / "b" / "out" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 8))
    assert late.losses == pytest.approx(at_once.losses, abs=1e-6)
    assert [r["loss"] for r in rows] == late.losses and all(r["step_time_s"] > 0 for r in rows)
    assert saves == [(3, 3), (6, 6)]
    resumed = _train(_recipe(fixtures, tmp_path / "b", max_steps=7, save_every=3, resume=True), data64)
    assert resumed.start_step == 6 and resumed.losses == pytest.approx(at_once.losses[6:], abs=1e-5)
    assert [r["step"] for r in read_metrics(tmp_path / "b" / "out" / "metrics.jsonl")] == list(range(1, 8))


def test_one_launcher_runs_here_or_launches_and_reads_rank_zeros_result(tmp_path, monkeypatch):
    """copt train and copt distill share core/train/launch: the ranks' arguments, running in this process, or
    launching and reading rank 0's result file back (a failed launch: CoptError, no output left behind)."""
    import sys

    from clusteropt_cli.core.train.launch import LaunchPlan, child_args, run_or_launch
    from clusteropt_cli.errors import CoptError

    recipe = TrainRecipe(model="m", data="d.txt", output=str(tmp_path / "out"), max_steps=3)
    monkeypatch.setattr(sys, "argv", ["pytest", "-q"])  # called programmatically: every setting as an override
    args = child_args(recipe, ["distill", "sft"], exclude={"task", "prediction"}, extra=["--json"])
    assert args[:2] == ["distill", "sft"] and "max_steps=3" in args and "model=m" in args and args[-1] == "--json"
    assert not any(a.startswith(("task=", "prediction=")) for a in args)
    monkeypatch.setattr(sys, "argv", ["copt", "train", "--model", "m", "--gpus", "2"])
    assert child_args(recipe, ["train"], extra=["--json"]) == ["train", "--model", "m", "--gpus", "2"]

    common = dict(overwrite=False, resume=False, command="train", result_file="r.json", what="training")
    here = LaunchPlan("none", 1, 1, 1, [])
    assert run_or_launch(here, lambda: "ran here", output=tmp_path / "here", **common) == "ran here"
    assert not (tmp_path / "here").exists()  # in one process run_here prepares the output itself

    out = tmp_path / "out"
    write = f"import json, pathlib; pathlib.Path({str(out / 'r.json')!r}).write_text(json.dumps({{'steps': 3}}))"
    launched = LaunchPlan("torchrun", 2, 1, 2, [sys.executable, "-c", write])
    assert run_or_launch(launched, lambda: pytest.fail("ran here"), output=out, **common) == {"steps": 3}

    failing = LaunchPlan("torchrun", 2, 1, 2, [sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(CoptError, match="The training processes exited with code 3"):
        run_or_launch(failing, lambda: None, output=tmp_path / "new", **common)
    assert not (tmp_path / "new").exists()


def test_an_explicit_compile_under_deepspeed_says_the_decoder_runs_eager():
    """DeepSpeed's engine wraps the module, so copt train never compiles the decoder under --zero: an explicit
    `compile: true` (a shipped recipe sets it) is not dropped silently; without --zero it compiles."""
    from clusteropt_cli.core.train.loop import prepare_model

    logs: list[str] = []
    options = TrainRecipe(model="x", compile=True, zero=2, precision="fp32")
    model = prepare_model(options, _tiny_llama(), "cpu", for_deepspeed=True, log=logs.append)
    assert any("not applied under DeepSpeed ZeRO" in line and "runs eager" in line for line in logs), logs
    assert not hasattr(model.get_decoder(), "_compiled_call_impl") or model.get_decoder()._compiled_call_impl is None
    logs.clear()
    prepare_model(TrainRecipe(model="x", zero=2, precision="fp32"), _tiny_llama(), "cpu", for_deepspeed=True,
                  log=logs.append)
    assert not any("torch.compile" in line for line in logs), logs
    logs.clear()
    compiled = prepare_model(TrainRecipe(model="x", compile=True, precision="fp32"), _tiny_llama(), "cpu",
                             log=logs.append)
    assert any("decoder compiled" in line for line in logs)
    assert compiled.get_decoder()._compiled_call_impl is not None


def test_text_inputs_share_one_suffix_rule(tmp_path):
    """--data/--eval-data are read, checked up front, and validated by copt train with the same suffixes."""
    from clusteropt_cli.core.train.data import TEXT_SUFFIXES, check_text_input, read_texts
    from clusteropt_cli.errors import BadInputError

    table = tmp_path / "d.csv"
    table.write_text("text\nhello\n")
    for check in (lambda: read_texts(table, flag="--data"), lambda: check_text_input(table, "--data", read=True)):
        with pytest.raises(BadInputError, match=r"--data .*d\.csv is neither \.txt nor \.jsonl"):
            check()
    for suffix in TEXT_SUFFIXES:
        doc = tmp_path / f"doc{suffix}"
        doc.write_text('{"text": "hello"}\n' if suffix == ".jsonl" else "hello\n")
        check_text_input(doc, "--data", read=True)
