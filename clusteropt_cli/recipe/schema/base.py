"""Shared pieces of the recipe schema: strict base model, predictions, training options."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

Precision = Literal["bf16", "fp16", "fp8", "fp32"]


# recipe keys that name files or directories: a leading ~ is the user's home, as in a shell (every command then reads
# and writes the same path its checks looked at)
PATH_KEYS = frozenset({"model", "data", "eval_data", "output", "teacher", "student", "prompts", "traces",
                       "eval_traces", "calib", "eval", "draft_model", "tokenizer", "hostfile", "nvme_path"})


def raise_problems(problems: list[str]) -> None:
    """End a model validator: every problem at once, one a line as 'key: what is wrong'. Another key a message
    names is written `key`: a recipe's error shows the key, a command line's the flag the user types for it."""
    if problems:
        raise ValueError("\n".join(problems))


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(), allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _expand_home(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        import os

        return {k: os.path.expanduser(v) if k in PATH_KEYS and isinstance(v, str) and v.startswith("~") else v
                for k, v in data.items()}


class Prediction(Strict):
    """What `copt advise` predicted for a recipe it emitted; `copt profile --expect` checks it."""

    source: str = Field("copt advise", description="Who made the prediction.")
    gpu: str | None = Field(None, description="Catalog GPU the prediction is for (cpu for a CPU run).")
    figures: dict[str, float] = Field(
        default_factory=dict,
        description="Predicted figures by name: peak_mem_bytes, tokens_per_s, step_time_s, ttft_s, tpot_s, ...",
    )
    budget_bytes: int | None = Field(None, description="Memory budget the plan was made to fit.")
    assumptions: dict[str, Any] = Field(default_factory=dict, description="MFU, bandwidth efficiency, ...")
    recommendation: str | None = Field(None, description="Id of the recommendation the recipe applies.")


class TrainingOptions(Strict):
    """Options shared by every command that trains a model (train, distill logits, distill sft)."""

    precision: Precision = Field(
        "bf16", description="bf16/fp16 autocast over fp32 weights; with zero >= 1 DeepSpeed's bf16/fp16 mode "
        "(16-bit weights, fp32 master weights and Adam states: 2+2+12 bytes/param); fp8; fp32.")
    activation_checkpointing: bool = Field(False, description="Recompute activations in backward.")
    attn: Literal["sdpa", "flash_attention_2", "eager"] = "sdpa"
    # bounded: a careless 10^20 was accepted and loaded everything before the process ran out of memory
    micro_batch: int = Field(1, ge=1, le=65_536)
    grad_accum: int = Field(1, ge=1, le=65_536)
    seq_len: int = Field(512, ge=2, le=2**21, description="Tokens per sequence (at least 2: a token and its target).")
    max_steps: PositiveInt | None = Field(None, description="Stop after this many optimizer steps.")
    epochs: float | None = Field(None, gt=0, description="Passes over the data (when max_steps is not set).")
    lr: float = Field(3e-4, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final LR as a fraction of lr (cosine/linear).")
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float | None = Field(1.0, gt=0)
    optimizer: Literal["adamw", "adamw-8bit", "sgd"] = "adamw"
    zero: Literal[0, 1, 2, 3] = 0
    offload: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: str | None = None
    compile: bool | None = Field(None, description="torch.compile the decoder; None = on for CUDA, off on CPU.")
    loss_impl: Literal["auto", "fused", "hf"] = Field(
        "auto", description="LM loss: fused chunked head+cross-entropy (no full fp32 logits), the model's own "
        "loss (hf), or auto (fused unless ZeRO-3).")
    loss_chunk_tokens: PositiveInt | None = Field(
        None, description="Tokens per chunk of the fused loss; None = ~1 GiB of fp32 logits per chunk (2,048 tokens "
        "of a 128k vocabulary). Larger chunks: fewer, larger GEMMs for more memory (H200, 1B, 8 x 2048: 8,192 "
        "tokens gave +2% tokens/s for +7.3 GiB).")
    gpus: PositiveInt = Field(1, description="Processes per node (GPUs; on CPU, processes).")
    nodes: PositiveInt = 1
    hostfile: str | None = None
    launcher: Literal["auto", "deepspeed", "torchrun"] = "auto"
    master_addr: str | None = None
    master_port: int | None = Field(None, ge=1, le=65535)
    save_every: PositiveInt | None = None
    keep_checkpoints: PositiveInt = Field(2, description="Checkpoints kept under OUTPUT/checkpoints (the newest N); "
                                          "--resume falls back to the newest one that verifies.")
    resume: bool = False
    seed: int = 0
    log_every: PositiveInt = 1

    @model_validator(mode="after")
    def _check_training(self) -> TrainingOptions:
        problems = []
        if self.offload != "none" and self.zero == 0:
            problems.append("offload: CPU/NVMe offload needs DeepSpeed ZeRO (set `zero` to 1, 2 or 3)")
        if self.offload == "nvme" and not self.nvme_path:
            problems.append("nvme_path: `offload` nvme needs `nvme_path` (a fast local directory)")
        if self.offload != "none" and self.optimizer != "adamw":
            problems.append(f"optimizer: with `offload` {self.offload} DeepSpeed runs its own CPU AdamW on the host, "
                            f"so {self.optimizer} does not apply (use `optimizer` adamw, or `offload` none)")
        if self.max_steps is not None and self.epochs is not None:
            problems.append("max_steps: give `max_steps` or `epochs`, not both")
        if self.loss_chunk_tokens is not None and self.loss_impl == "hf":
            problems.append("loss_chunk_tokens: sets the fused loss's chunks; `loss_impl` hf has none")
        raise_problems(problems)
        return self
