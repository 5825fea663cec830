"""Training metrics: FLOPs per token, MFU, peak memory (CUDA allocator or the CPU accounting), metrics.jsonl."""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def training_flops_per_token(config: Any, seq_len: int) -> float | None:
    """Model FLOPs per trained token (6·N + attention) from clusteropt_cli.modelspec, or None when unknown."""
    try:
        from clusteropt_cli.modelspec import load_model_spec
    except ImportError:
        return None
    try:
        spec = load_model_spec(config.to_dict() if hasattr(config, "to_dict") else config)
        return float(spec.training_flops_per_token(seq_len))
    except Exception:  # noqa: BLE001 - an unknown architecture only costs the MFU figure
        return None


def peak_flops_per_device(precision: str, device_type: str) -> float | None:
    """Datasheet dense peak FLOP/s of the local GPU for the precision (None on CPU or an unknown GPU)."""
    if device_type != "cuda":
        return None
    from clusteropt_cli.hardware import detect_gpu_spec

    spec = detect_gpu_spec()
    return spec.peak_flops(precision) if spec else None


def model_state_bytes(model: Any, optimizer: Any, full_gradients: bool = False) -> int:
    """Bytes of parameters, gradients and optimizer states held by this process (unique storages; ZeRO-3
    partitions counted as the local shard). `full_gradients`: count one gradient per trainable parameter even
    when it was freed after the step (zero_grad(set_to_none=True)): it exists at the peak, during backward."""
    import torch

    seen: dict[int, int] = {}
    grad_bytes = 0
    if full_gradients:
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor) and t.numel() > 0:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()

    for p in model.parameters():
        add(getattr(p, "ds_tensor", None) if hasattr(p, "ds_tensor") else p)
        if not full_gradients:
            add(p.grad)
    base = optimizer
    while hasattr(base, "optimizer") and base.optimizer is not base:  # DeepSpeed wrappers → the torch optimizer
        base = base.optimizer
    for group in getattr(base, "param_groups", []):
        for p in group["params"]:
            add(p)
            if not full_gradients:
                add(p.grad)
    for state in getattr(base, "state", {}).values():
        for value in state.values():
            add(value)
    for name in ("averaged_gradients", "ipg_buffer"):  # DeepSpeed ZeRO-1/2 gradient partitions
        value = getattr(optimizer, name, None)
        for t in (value.values() if isinstance(value, dict) else value or []):
            for leaf in (t if isinstance(t, list) else [t]):
                add(leaf)
    return int(sum(seen.values())) + grad_bytes


class SavedTensorMeter:
    """The activation part of the CPU peak (docs/advise.md): bytes of the unique non-parameter storages autograd
    saves for backward during one forward, plus the logits buffers (the logits the LM head returns and their fp32
    upcast when they are not fp32; for the fused loss, the chunk of logits it holds at once).

    With activation checkpointing, the checkpointed layers' inputs are what stays alive; they are counted
    through forward pre-hooks on the checkpointed layers."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}
        self.logits_bytes = 0
        self._params: set[int] = set()

    def _add(self, t: Any) -> None:
        import torch

        if isinstance(t, torch.Tensor) and t.numel() > 0 and t.device.type != "meta":
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                return
            if storage.data_ptr() not in self._params:
                self.storages[storage.data_ptr()] = storage.nbytes()

    @property
    def saved_bytes(self) -> int:
        return int(sum(self.storages.values()))

    @property
    def bytes(self) -> int:
        return self.saved_bytes + int(self.logits_bytes)

    @contextmanager
    def watch(self, model: Any = None, checkpointed: bool = False):
        import torch

        def pack(t: Any) -> Any:
            self._add(t)
            return t

        def count_inputs(_module: Any, args: tuple, kwargs: dict) -> None:
            for value in (*args, *kwargs.values()):
                self._add(value)

        def count_logits(_module: Any, _args: tuple, output: Any) -> None:
            if isinstance(output, torch.Tensor):
                extra = output.numel() * 4 if output.dtype != torch.float32 else 0
                self.logits_bytes = max(self.logits_bytes, output.numel() * output.element_size() + extra)

        from clusteropt_cli.core.train import losses

        handles = []
        if model is not None:
            self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}
            head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
            if head is not None:
                handles.append(head.register_forward_hook(count_logits))
        if checkpointed and model is not None:
            for module in model.modules():
                if getattr(module, "gradient_checkpointing", False):
                    handles.append(module.register_forward_pre_hook(count_inputs, with_kwargs=True))
        losses.LAST_CHUNK_BUFFER_BYTES = 0
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield self
        finally:
            for h in handles:
                h.remove()
            self.logits_bytes = max(self.logits_bytes, losses.LAST_CHUNK_BUFFER_BYTES)


class MetricsWriter:
    """Appends one JSON row per step to metrics.jsonl (flushed each row). On resume the history up to the
    checkpoint's step is kept and the rows after it (steps the resumed run computes again) are dropped, through an
    atomic rewrite, so the file holds one consistent curve. A fresh run never truncates an existing history: it
    refuses (the run's output must be new, or replaced with --overwrite)."""

    def __init__(self, path: Path, resume_step: int | None = None):
        self.path = Path(path)
        if resume_step is not None and self.path.exists():
            kept = []
            for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a row cut by a crash
                if isinstance(row, dict) and int(row.get("step", 0)) <= resume_step:
                    kept.append(line)
            from clusteropt_cli.core.io import atomic_write_text

            atomic_write_text(self.path, "".join(f"{line}\n" for line in kept))
        elif resume_step is None and self.path.exists() and self.path.stat().st_size > 0:
            from clusteropt_cli.errors import BadInputError

            raise BadInputError(f"{self.path} already holds a training history; a new run would overwrite it.",
                                hint="Continue it with --resume, or start over with --overwrite (or a new --output).")
        self._handle = self.path.open("a")

    def write(self, row: dict[str, Any]) -> None:
        # strict JSON: a diverged step's NaN or infinity is written as null
        self._handle.write(json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v
                                       for k, v in row.items()}) + "\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class StepValues:
    """An optimizer step's scalars (loss, grad norm, loss-function metrics) whose kernels may still be queued.

    On CUDA the tensors are copied to pinned host memory behind a CUDA event, so the loop can queue the next step
    before reading them (`read()` waits for this step only, not for the work queued after it): the GPU never idles
    while the host logs. Plain floats and CPU tensors are read at once."""

    def __init__(self, values: dict[str, Any]) -> None:
        import torch

        self.floats = {k: (None if v is None else float(v)) for k, v in values.items()
                       if not isinstance(v, torch.Tensor)}
        self.tensor_names = [k for k, v in values.items() if isinstance(v, torch.Tensor)]
        self.event = None
        self.host = None
        if self.tensor_names:
            stacked = torch.stack([values[k].detach().float().reshape(()) for k in self.tensor_names])
            if stacked.is_cuda:
                self.host = torch.empty(stacked.shape, dtype=torch.float32, pin_memory=True)
                self.host.copy_(stacked, non_blocking=True)
                self.event = torch.cuda.Event()
                self.event.record()
            else:
                self.host = stacked

    @property
    def deferred(self) -> bool:
        """Whether reading waits on the GPU (the loop reads these one step later)."""
        return self.event is not None

    def read(self) -> dict[str, float | None]:
        if self.event is not None:
            self.event.synchronize()
        values = dict(self.floats)
        if self.host is not None:
            values.update(zip(self.tensor_names, self.host.tolist(), strict=True))
        return values
