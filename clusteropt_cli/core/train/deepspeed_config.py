"""The DeepSpeed config copt generates for `--zero 1|2|3` (written next to the run as ds_config.json).

Mixed precision is DeepSpeed's own: bf16 (and fp8, whose non-fp8 parts run in bf16) use the `bf16` section
(bf16 weights and gradients on the device, fp32 master weights and Adam moments partitioned in the optimizer:
2 + 2 + 12 bytes per parameter before ZeRO's partitioning), fp16 the `fp16` section with dynamic loss
scaling, fp32 neither. torch.autocast is NOT used under DeepSpeed: DeepSpeed's engine turns an outer CUDA
autocast off inside its forward (deepspeed/runtime/torch_autocast.py, autocast_if_enabled), which used to make
copt's ZeRO runs compute a full fp32 forward on the GPU (fp32 attention falls back to the math SDPA kernel with
grouped-query attention and holds the [batch, heads, seq, seq] scores: out of memory on Llama-3.2-1B at 8 × 2048).
No heavy imports: `--dry-run` prints this config without importing deepspeed.
"""

from __future__ import annotations

from typing import Any


def deepspeed_weight_dtype(precision: str) -> str:
    """The dtype DeepSpeed keeps the model's weights in on the device for a precision (masters stay fp32)."""
    return {"bf16": "bf16", "fp8": "bf16", "fp16": "fp16"}.get(precision, "fp32")


def deepspeed_config(options: Any, world_size: int) -> dict[str, Any]:
    """A DeepSpeed config dict for TrainingOptions `options` on `world_size` data-parallel ranks."""
    zero: dict[str, Any] = {
        "stage": int(options.zero),
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e7,
        "allgather_bucket_size": 5e7,
    }
    if options.zero == 3:
        zero.update({
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_param_persistence_threshold": 1e5,
            "stage3_gather_16bit_weights_on_model_save": True,
        })
    if options.offload != "none":
        target: dict[str, Any] = {"device": options.offload, "pin_memory": True}
        if options.offload == "nvme":
            target["nvme_path"] = options.nvme_path
        zero["offload_optimizer"] = dict(target)
        if options.zero == 3:
            zero["offload_param"] = dict(target)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": int(options.micro_batch),
        "gradient_accumulation_steps": int(options.grad_accum),
        "train_batch_size": int(options.micro_batch * options.grad_accum * world_size),
        "gradient_clipping": float(options.grad_clip or 0.0),
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if options.precision in ("bf16", "fp8"):
        config["bf16"] = {"enabled": True}
    elif options.precision == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                          "hysteresis": 2, "min_loss_scale": 1}
    if options.offload != "none":
        # ZeRO-Offload runs the optimizer on the CPU: DeepSpeedCPUAdam (a C++ op compiled on first use and cached
        # under ~/.cache/torch_extensions), chosen by DeepSpeed from this section.
        config["optimizer"] = {"type": "AdamW", "params": {
            "lr": float(options.lr), "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": float(options.weight_decay)}}
    return config
