"""`copt profile model`: time one inference request shape or one training step, measure peak memory, name
the bottleneck.

Every figure is a median over `repeats` timed iterations after `warmup` untimed ones, with the device
synchronized around each timed phase; the spread is kept in `ProfileReport.spread`.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from clusteropt_cli import __version__
from clusteropt_cli.core.models import check_host_memory, dtype_of
from clusteropt_cli.core.profile.loading import check_model_source, load_model, model_spec
from clusteropt_cli.core.profile.memory import (
    SavedTensorTracker,
    cache_bytes,
    optimizer_state_bytes,
    tensor_bytes,
)
from clusteropt_cli.core.profile.report import HardwareInfo, OpTime, ProfileReport
from clusteropt_cli.core.profile.settings import ModelProfileSettings
from clusteropt_cli.core.profile.stats import spread
from clusteropt_cli.core.profile.verdict import model_verdict
from clusteropt_cli.errors import BadInputError, UnsupportedHardwareError

Log = Callable[[str], None]


@dataclass
class _Measured:
    metrics: dict[str, float | None] = field(default_factory=dict)
    samples: dict[str, list[float]] = field(default_factory=dict)
    oom: bool = False
    oom_message: str | None = None


def resolve_device(setting: str) -> str:
    import torch

    if setting == "cuda" and not torch.cuda.is_available():
        raise UnsupportedHardwareError("--device cuda: no CUDA GPU is visible.", hint="Use --device cpu or auto.")
    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return setting


def resolve_dtype(name: str, device: str) -> str:
    """'auto' → bf16 on CUDA (fp16 where bf16 is missing), fp32 on CPU."""
    if name != "auto":
        return name
    if device == "cuda":
        import torch

        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "fp32"


def hardware_info(device: str) -> tuple[HardwareInfo, Any]:
    """HardwareInfo for the report and the GPUSpec (None on CPU or an unknown GPU)."""
    if device == "cuda":
        import torch

        from clusteropt_cli.hardware import match_catalog

        props = torch.cuda.get_device_properties(0)
        spec = match_catalog(props.name, int(props.total_memory))
        from clusteropt_cli.core.hostspeed import python_loop_seconds

        return HardwareInfo(device="cuda", name=props.name, catalog=spec.name if spec else None,
                            memory_bytes=int(props.total_memory), host_loop_s=python_loop_seconds()), spec
    import psutil

    name = platform.processor() or platform.machine() or "cpu"
    return HardwareInfo(device="cpu", name=f"{name} ({psutil.cpu_count(logical=True)} threads)",
                        memory_bytes=int(psutil.virtual_memory().total)), None


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _now(device: str) -> float:
    _sync(device)
    return time.perf_counter()


def _is_oom(exc: BaseException) -> bool:
    return type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc).lower()


def profile_model(s: ModelProfileSettings, log: Log | None = None) -> ProfileReport:
    """Measure the model as `s` says and return the versioned ProfileReport (trace written when asked)."""
    log = log or (lambda _msg: None)
    s.validate()
    resolved = check_model_source(s.model)
    import torch

    device = resolve_device(s.device)
    hw, gpu = hardware_info(device)
    if s.mode == "train":
        precision = resolve_dtype(s.precision, device)
        weights_dtype = "fp32"
    else:
        precision = weights_dtype = resolve_dtype(s.dtype, device)
    if device == "cpu" and precision == "fp16" and s.mode == "infer":
        log("fp16 matmuls on CPU are slow; bf16 or fp32 are the usual CPU dtypes")
    if device == "cpu":  # the weights are held in host memory
        smaller = "in a smaller --dtype (bf16), " if s.mode == "infer" and weights_dtype == "fp32" else ""
        check_host_memory([(s.model, resolved.config, dtype_of(weights_dtype).itemsize)],
                          hint=f"Profile {smaller}on a GPU (--device cuda), or a smaller model"
                               + (" (training keeps fp32 weights)." if s.mode == "train" else "."))
    log(f"loading {s.model} on {device} ({weights_dtype} weights)")
    loaded = load_model(s.model, device, dtype_of(weights_dtype), attn=s.attn, seed=s.seed, resolved=resolved)
    model = loaded.model
    max_pos = getattr(model.config, "max_position_embeddings", None)
    needed = s.seq_len if s.mode == "train" else s.prompt_len + s.gen_len
    if max_pos is not None and needed > max_pos:
        flag = "--seq-len" if s.mode == "train" else "--prompt-len + --gen-len"
        raise BadInputError(f"{flag} = {needed} exceeds the model's max_position_embeddings ({max_pos}).",
                            hint=f"Lower {flag}.")
    spec = model_spec(s.model, loaded.config)
    params = list(model.parameters())
    num_params = sum(p.numel() for p in params)
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    if s.mode == "train":
        run_step, measured = _train_runner(model, s, device, precision, params)
        workload = {"micro_batch": s.micro_batch, "seq_len": s.seq_len, "precision": precision,
                    "activation_checkpointing": s.activation_checkpointing, "optimizer": s.optimizer,
                    "loss_impl": s.loss_impl, "compile": s.compile, "attn": s.attn}
    else:
        run_step, measured = _infer_runner(model, s, device)
        workload = {"batch": s.batch, "prompt_len": s.prompt_len, "gen_len": s.gen_len, "dtype": precision,
                    "attn": s.attn}
    workload.update({"warmup": s.warmup, "repeats": s.repeats})
    if s.memory_budget_bytes is not None:
        workload["memory_budget_bytes"] = s.memory_budget_bytes
    top_ops: list[OpTime] = []
    trace_file = None
    try:
        for i in range(s.warmup):
            log(f"warm-up {i + 1}/{s.warmup}")
            run_step(False)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for i in range(s.repeats):
            run_step(True)
            log(f"repeat {i + 1}/{s.repeats}")
        if device == "cuda":
            measured.metrics["peak_mem_bytes"] = float(torch.cuda.max_memory_allocated())
            measured.metrics["peak_reserved_bytes"] = float(torch.cuda.max_memory_reserved())
        if s.trace is not None or device == "cuda":
            top_ops, busy = _profiled_iteration(run_step, device, s.trace)
            if busy is not None:
                measured.metrics["device_busy_frac"] = busy
            trace_file = str(s.trace) if s.trace is not None else None
    except Exception as exc:  # noqa: BLE001 - OOM becomes the verdict; anything else propagates
        if not _is_oom(exc):
            raise
        measured.oom = True
        measured.oom_message = str(exc).splitlines()[0] if str(exc) else "out of memory"
        if device == "cuda":
            measured.metrics["peak_mem_bytes"] = float(torch.cuda.max_memory_allocated())
            measured.metrics["peak_reserved_bytes"] = float(torch.cuda.max_memory_reserved())
            torch.cuda.empty_cache()
        log(f"out of memory: {measured.oom_message}")

    metrics = measured.metrics
    report_spread = {}
    for name, values in measured.samples.items():
        if values:
            sp = spread(values)
            report_spread[name] = sp
            metrics[name] = sp.median
    _derive(metrics, s, device, precision, spec, gpu, params)
    verdict = model_verdict(s.mode, metrics, device=device, memory_bytes=hw.memory_bytes,
                            budget_bytes=s.memory_budget_bytes, oom=measured.oom,
                            batch=s.batch if s.mode == "infer" else s.micro_batch)
    if measured.oom and measured.oom_message:
        verdict.evidence.append(measured.oom_message)
    model_info = {"source": s.model, "path": s.model, "name": getattr(model.config, "_name_or_path", None) or s.model,
                  "model_type": getattr(model.config, "model_type", None), "num_params": num_params,
                  "num_layers": getattr(model.config, "num_hidden_layers", None),
                  "hidden_size": getattr(model.config, "hidden_size", None),
                  "vocab_size": getattr(model.config, "vocab_size", None), "dtype": weights_dtype,
                  "random_weights": loaded.random_weights}
    del model, loaded, run_step
    if device == "cuda":
        torch.cuda.empty_cache()
    return ProfileReport(kind="model", mode=s.mode, created_at=datetime.now(UTC).isoformat(timespec="seconds"),
                         copt_version=__version__, hardware=hw, model=model_info, workload=workload,
                         metrics=metrics, spread=report_spread, top_ops=top_ops, verdict=verdict,
                         trace_file=trace_file)


# ---- inference ---------------------------------------------------------------------------------------------
def _infer_runner(model: Any, s: ModelProfileSettings, device: str):
    """A callable running prefill + (gen_len − 1) greedy decode steps with a KV cache, recording phase times."""
    import torch

    model.eval()
    measured = _Measured(samples={"ttft_s": [], "decode_s": [], "tpot_s": [], "request_s": []})
    gen = torch.Generator(device="cpu").manual_seed(s.seed)
    vocab = model.config.vocab_size
    input_ids = torch.randint(low=0, high=vocab, size=(s.batch, s.prompt_len), generator=gen).to(device)
    param_bytes = tensor_bytes(model.parameters())
    state = {"cache_bytes": 0, "logits_bytes": 0}

    @torch.inference_mode()
    def run(record: bool) -> None:
        t0 = _now(device)
        out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
        next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
        t1 = _now(device)
        state["logits_bytes"] = max(state["logits_bytes"], tensor_bytes([out.logits]))
        cache = out.past_key_values
        del out
        for _ in range(s.gen_len - 1):
            out = model(input_ids=next_ids, past_key_values=cache, use_cache=True)
            next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
            cache = out.past_key_values
            del out
        t2 = _now(device)
        state["cache_bytes"] = cache_bytes(cache)
        del cache
        if record:
            measured.samples["ttft_s"].append(t1 - t0)
            measured.samples["decode_s"].append(t2 - t1)
            measured.samples["request_s"].append(t2 - t0)
            if s.gen_len > 1:
                measured.samples["tpot_s"].append((t2 - t1) / (s.gen_len - 1))
            if device == "cpu":
                peak = param_bytes + state["cache_bytes"] + state["logits_bytes"]
                measured.metrics["peak_mem_bytes"] = float(peak)
            measured.metrics["weights_bytes"] = float(param_bytes)
            measured.metrics["kv_cache_bytes"] = float(state["cache_bytes"])

    return run, measured


# ---- training ----------------------------------------------------------------------------------------------
def _train_runner(model: Any, s: ModelProfileSettings, device: str, precision: str, params: list[Any]):
    """A callable running one optimizer step (forward, backward, optimizer) with phase times and CPU memory."""
    from types import SimpleNamespace

    import torch

    from clusteropt_cli.core.train.attention import use_causal_sdpa
    from clusteropt_cli.core.train.engines import build_optimizer
    from clusteropt_cli.core.train.loop import default_loss_fn

    model.train()
    model.config.use_cache = False
    if s.activation_checkpointing:
        # On CPU the saved-tensor tracker sees the recomputation only with the reentrant form.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": device == "cpu"})
    if s.attn == "sdpa":  # copt train's attention: SDPA is_causal with no mask (random batches have no padding)
        use_causal_sdpa(model)
    if s.compile:
        model.get_decoder().compile()
    # the same attention, optimizer and loss as `copt train` (core/train), so a profile predicts a training run
    optimizer = build_optimizer(SimpleNamespace(optimizer=s.optimizer, lr=1e-4), params, device)
    loss_fn = default_loss_fn(SimpleNamespace(loss_impl=s.loss_impl, zero=0), model, "torch")
    scaler = torch.amp.GradScaler(device) if precision == "fp16" else None
    autocast = (torch.autocast(device_type=device, dtype=dtype_of(precision)) if precision != "fp32"
                else nullcontext())
    gen = torch.Generator(device="cpu").manual_seed(s.seed)
    vocab = model.config.vocab_size
    input_ids = torch.randint(0, vocab, (s.micro_batch, s.seq_len), generator=gen).to(device)
    batch = {"input_ids": input_ids, "labels": input_ids}
    measured = _Measured(samples={"step_time_s": [], "forward_s": [], "backward_s": [], "optimizer_s": []})
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    param_bytes = tensor_bytes(params)
    head_out = {"bytes": 0}
    head = model.get_output_embeddings()
    if head is not None and device == "cpu":
        # the logits the LM head returns (HF loss path); the fused loss never calls the head module
        def record_head(_module: Any, _inputs: Any, output: Any) -> None:
            head_out["bytes"] = max(head_out["bytes"], tensor_bytes([output]))

        head.register_forward_hook(record_head)

    def run(record: bool) -> None:
        tracker = SavedTensorTracker(param_ptrs) if device == "cpu" else None
        hooks = tracker.hooks() if tracker is not None else nullcontext()
        t0 = _now(device)
        with hooks:
            with autocast:
                loss, _ = loss_fn(model, batch)
            t1 = _now(device)
            extra_bytes = forward_saved = 0
            if tracker is not None:
                # logits and loss live at the end of the forward, next to everything saved so far; the
                # backward (with checkpointing, its recomputation) may peak later, once they are gone
                extra_bytes = tensor_bytes([loss]) + head_out["bytes"]
                forward_saved = tracker.current
                head_out["bytes"] = 0
            (scaler.scale(loss) if scaler is not None else loss).backward()
        t2 = _now(device)
        grad_bytes = tensor_bytes(p.grad for p in params if p.grad is not None)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t3 = _now(device)
        loss_value = float(loss.detach())
        del loss
        if record:
            measured.samples["step_time_s"].append(t3 - t0)
            measured.samples["forward_s"].append(t1 - t0)
            measured.samples["backward_s"].append(t2 - t1)
            measured.samples["optimizer_s"].append(t3 - t2)
            measured.metrics["loss"] = loss_value
            states = param_bytes + grad_bytes + optimizer_state_bytes(optimizer)
            measured.metrics["model_states_bytes"] = float(states)
            if tracker is not None:
                measured.metrics["saved_activations_bytes"] = float(tracker.peak)
                measured.metrics["logits_loss_bytes"] = float(extra_bytes)
                measured.metrics["peak_mem_bytes"] = float(states + max(forward_saved + extra_bytes, tracker.peak))

    return run, measured


# ---- derived figures ---------------------------------------------------------------------------------------
def _derive(metrics: dict[str, Any], s: ModelProfileSettings, device: str, precision: str, spec: Any, gpu: Any,
            params: list[Any]) -> None:
    """tokens/s, MFU/MBU against the catalog (CUDA) or fractions of measured CPU ceilings, phase fractions."""
    ceilings = None
    if device == "cpu":
        from clusteropt_cli.core.profile.ceilings import cpu_ceilings

        ceilings = cpu_ceilings()
        metrics["cpu_matmul_flops"] = ceilings["matmul_flops"]
        metrics["cpu_copy_bandwidth"] = ceilings["copy_bandwidth"]
    peak_flops = gpu.peak_flops(precision) if gpu is not None else None
    metrics.setdefault("mfu", None)
    if s.mode == "train":
        step = metrics.get("step_time_s")
        if not step:
            return
        tokens = s.micro_batch * s.seq_len
        metrics["tokens_per_s"] = tokens / step
        phases = {p: metrics.get(f"{p}_s") for p in ("forward", "backward", "optimizer")}
        if all(v is not None for v in phases.values()):
            total = sum(phases.values()) or 1.0  # medians of each phase: fractions sum to 1
            for phase, value in phases.items():
                metrics[f"{phase}_frac"] = value / total
        if spec is not None:
            achieved = spec.training_flops_per_token(s.seq_len) * tokens / step
            metrics["achieved_flops"] = achieved
            if peak_flops:
                metrics["mfu"] = achieved / peak_flops
            if ceilings:
                metrics["cpu_matmul_frac"] = achieved / ceilings["matmul_flops"]
        return
    metrics.setdefault("mbu", None)
    ttft, decode = metrics.get("ttft_s"), metrics.get("decode_s")
    if not ttft:
        return
    total = ttft + (decode or 0.0)
    metrics["output_tokens_per_s"] = s.batch * s.gen_len / total
    metrics["tokens_per_s"] = metrics["output_tokens_per_s"]
    metrics["prefill_tokens_per_s"] = s.batch * s.prompt_len / ttft
    if spec is not None:
        achieved = spec.forward_flops_per_token(s.prompt_len) * s.batch * s.prompt_len / ttft
        metrics["achieved_flops"] = achieved
        if peak_flops:
            metrics["mfu"] = achieved / peak_flops
        if ceilings:
            metrics["cpu_matmul_frac"] = achieved / ceilings["matmul_flops"]
    tpot = metrics.get("tpot_s")
    kv_total = metrics.get("kv_cache_bytes")
    if tpot and kv_total is not None:
        tokens_cached = s.batch * (s.prompt_len + s.gen_len - 1)
        avg_context = s.prompt_len + s.gen_len / 2
        bytes_per_step = metrics["weights_bytes"] + kv_total / tokens_cached * s.batch * avg_context
        metrics["decode_bytes_per_step"] = bytes_per_step
        if gpu is not None:
            metrics["mbu"] = bytes_per_step / tpot / gpu.hbm_bandwidth
        if ceilings:
            metrics["cpu_bandwidth_frac"] = bytes_per_step / tpot / ceilings["copy_bandwidth"]


# ---- torch.profiler ----------------------------------------------------------------------------------------
def _profiled_iteration(run_step: Callable[[bool], None], device: str, trace_path: Any) -> tuple[list[OpTime], Any]:
    """One more iteration under torch.profiler: top ops by self time, device-busy fraction, optional trace."""
    import os
    import tempfile
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    t0 = _now(device)
    with profile(activities=activities) as prof:
        run_step(False)
        _sync(device)
    wall = time.perf_counter() - t0
    events = list(prof.key_averages())
    if device == "cuda":
        from torch.autograd import DeviceType

        # kernels (device events) by their own time; CPU ops would count the same kernels again
        events = [e for e in events if getattr(e, "device_type", None) == DeviceType.CUDA]

    def self_time(e: Any) -> float:
        if device == "cuda":
            return float(getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0))
        return float(e.self_cpu_time_total)

    total = sum(self_time(e) for e in events) or 1.0
    ranked = sorted(events, key=self_time, reverse=True)[:15]
    top = [OpTime(name=e.key, self_time_s=self_time(e) / 1e6, fraction=self_time(e) / total, calls=int(e.count))
           for e in ranked if self_time(e) > 0]
    busy = min(1.0, total / 1e6 / wall) if device == "cuda" and wall > 0 else None
    if trace_path is not None:
        path = Path(trace_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".json", dir=path.parent)
        os.close(fd)
        try:
            prof.export_chrome_trace(tmp)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return top, busy
