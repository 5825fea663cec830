"""Measure the CPU training-step memory quantity (docs/advise.md, device cpu) on a real model (torch imported lazily).

peak_mem_bytes (device cpu) = model states (params + grads + optimizer states, all allocated after one step)
+ bytes of tensors saved for backward (unique non-parameter storages, via saved_tensors_hooks)
+ logits buffers (the logits the model returns, plus their fp32 upcast when they are not fp32).
`copt advise --gpu cpu` predicts exactly this; the advise model tests compare the two.
"""

from __future__ import annotations

from typing import Any


def measure_cpu_training_step(model: Any, input_ids: Any, precision: str = "fp32",
                              optimizer: str = "adamw") -> dict[str, float]:
    """Run one forward/backward/optimizer step on CPU and count the bytes defined above."""
    import torch

    from clusteropt_cli.core.profile.memory import tensor_bytes

    params = list(model.parameters())
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in param_storages and key not in seen and tensor.device.type == "cpu":
            seen[key] = storage.nbytes()
        return tensor

    opt = (torch.optim.AdamW(params, lr=1e-4) if optimizer == "adamw"
           else torch.optim.SGD(params, lr=1e-4, momentum=0.9))
    autocast = precision in ("bf16", "fp16")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=dtype, enabled=autocast):
            out = model(input_ids=input_ids, labels=input_ids)
    logits = out.logits
    logits_bytes = logits.numel() * logits.element_size()
    if logits.dtype != torch.float32:
        logits_bytes += logits.numel() * 4
    out.loss.backward()
    opt.step()
    # the same byte counting as `copt profile` (unique storages; scalar step counters excluded)
    state_bytes = tensor_bytes(t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    param_bytes = tensor_bytes(params)
    grad_bytes = tensor_bytes(p.grad for p in params if p.grad is not None)
    saved = float(sum(seen.values()))
    states = float(param_bytes + grad_bytes + state_bytes)
    return {"model_states": states, "saved_tensors": saved, "logits_buffers": float(logits_bytes),
            "peak_mem_bytes": states + saved + logits_bytes}
