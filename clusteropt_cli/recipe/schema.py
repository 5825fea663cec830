"""The recipe schema: one pydantic model per task, every model strict about unknown keys.

Defaults live here, not in the CLI: a command passes only the flags the user typed, merged over the recipe.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

Precision = Literal["bf16", "fp16", "fp8", "fp32"]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


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

    precision: Precision = Field("bf16", description="bf16/fp16 mixed precision over fp32 weights; fp8; fp32.")
    activation_checkpointing: bool = Field(False, description="Recompute activations in backward.")
    attn: Literal["sdpa", "flash_attention_2", "eager"] = "sdpa"
    micro_batch: PositiveInt = 1
    grad_accum: PositiveInt = 1
    seq_len: PositiveInt = 512
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
    compile: bool = Field(False, description="Wrap the model in torch.compile.")
    gpus: PositiveInt = Field(1, description="Processes per node (GPUs; on CPU, processes).")
    nodes: PositiveInt = 1
    hostfile: str | None = None
    launcher: Literal["auto", "deepspeed", "torchrun"] = "auto"
    master_addr: str | None = None
    master_port: int | None = Field(None, ge=1, le=65535)
    save_every: PositiveInt | None = None
    resume: bool = False
    seed: int = 0
    log_every: PositiveInt = 1

    @model_validator(mode="after")
    def _check_training(self) -> TrainingOptions:
        problems = []
        if self.offload != "none" and self.zero == 0:
            problems.append("offload: CPU/NVMe offload needs DeepSpeed ZeRO; set zero to 1, 2 or 3")
        if self.offload == "nvme" and not self.nvme_path:
            problems.append("nvme_path: offload=nvme needs nvme_path (a fast local directory)")
        if self.max_steps is not None and self.epochs is not None:
            problems.append("max_steps: give max_steps or epochs, not both")
        if problems:
            raise ValueError("; ".join(problems))
        return self


class TrainRecipe(TrainingOptions):
    """copt train."""

    task: Literal["train"] = "train"
    model: str = Field(..., description="Local HF model dir (fine-tune), a config.json or a preset (scratch).")
    data: str | None = Field(None, description=".txt or .jsonl (text field), tokenized and packed to seq_len.")
    output: str | None = None
    gradient_compression: Literal["none", "fp16", "bf16", "powersgd"] = "none"
    pipeline_stages: PositiveInt = 1
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b"] = "1f1b"
    pipeline_micro_batches: PositiveInt | None = None
    virtual_stages: PositiveInt = 1
    prediction: Prediction | None = None

    @model_validator(mode="after")
    def _check_parallel(self) -> TrainRecipe:
        problems = []
        if self.zero == 3 and self.pipeline_stages > 1:
            problems.append("zero: ZeRO-3 cannot be combined with pipeline_stages > 1; use zero 0/1 with pipelines")
        if self.gradient_compression != "none" and self.zero > 0:
            problems.append("gradient_compression: DDP comm hooks apply only with zero=0")
        if self.pipeline_schedule == "interleaved-1f1b" and self.pipeline_stages > 1 and self.virtual_stages < 2:
            problems.append("virtual_stages: interleaved-1f1b needs virtual_stages >= 2")
        if self.pipeline_schedule != "interleaved-1f1b" and self.virtual_stages > 1:
            problems.append("virtual_stages: virtual stages need pipeline_schedule=interleaved-1f1b")
        if problems:
            raise ValueError("; ".join(problems))
        return self


class QuantizeRecipe(Strict):
    """copt quantize."""

    task: Literal["quantize"] = "quantize"
    model: str
    output: str | None = None
    method: Literal["awq", "gptq", "fp8", "int8", "rtn"] = "awq"
    bits: Literal[2, 3, 4, 8] | None = Field(None, description="Weight bits; default 4 for awq/gptq/rtn, 8 for fp8/int8.")
    group_size: int = Field(128, description="Columns sharing one scale; -1 for per-channel.")
    symmetric: bool = True
    calib: str | None = Field(None, description=".txt (one sample a line) or .jsonl with a text field.")
    num_samples: PositiveInt = 128
    seq_len: PositiveInt = 512
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"])
    backend: Literal["llmcompressor", "gptqmodel", "auto-gptq", "autoawq"] = "llmcompressor"
    eval: str | None = Field(None, description="Text file for perplexity before and after.")
    compare_rtn: bool = False
    prediction: Prediction | None = None

    @model_validator(mode="after")
    def _check_bits(self) -> QuantizeRecipe:
        if self.method in ("fp8", "int8") and self.bits not in (None, 8):
            raise ValueError(f"bits: method {self.method} is W8A8; bits must be 8 (got {self.bits})")
        if self.group_size == 0 or self.group_size < -1:
            raise ValueError("group_size: must be positive or -1 (per-channel)")
        return self

    @property
    def weight_bits(self) -> int:
        return self.bits or (8 if self.method in ("fp8", "int8") else 4)


class ServeRecipe(Strict):
    """copt serve."""

    task: Literal["serve"] = "serve"
    model: str
    engine: Literal["auto", "transformers", "vllm"] = "auto"
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: str | None = None
    served_model_name: str | None = None
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    max_batch_tokens: PositiveInt | None = Field(None, description="Tokens per step (chunked prefill budget).")
    max_batch_size: PositiveInt = Field(64, description="Sequences decoded together at most.")
    kv_cache_blocks: PositiveInt | None = None
    kv_cache_memory: float | None = Field(None, gt=0, description="GiB for the KV cache.")
    kv_cache_dtype: Literal["auto", "bf16", "fp8", "int8"] = "auto"
    block_size: PositiveInt = 32
    max_queue: PositiveInt = 1024
    max_model_len: PositiveInt | None = None
    draft_model: str | None = None
    num_speculative_tokens: PositiveInt = 4
    prompt_lookup: PositiveInt | None = Field(None, description="n-gram size for prompt-lookup drafting.")
    speculative_max_batch: PositiveInt = Field(4, description="Speculate only while at most this many run.")
    cuda_graphs: bool | None = Field(None, description="Capture decode steps as CUDA graphs (default: on GPU).")
    tensor_parallel: PositiveInt = 1
    pipeline_parallel: PositiveInt = 1
    quantization: str | None = Field(None, description="vLLM --quantization (awq, gptq, fp8, compressed-tensors).")
    grace_period: float = Field(30.0, ge=0, description="Seconds to finish in-flight requests on SIGTERM.")
    prediction: Prediction | None = None

    @model_validator(mode="after")
    def _check_serve(self) -> ServeRecipe:
        problems = []
        if self.kv_cache_blocks is not None and self.kv_cache_memory is not None:
            problems.append("kv_cache_blocks: give kv_cache_blocks or kv_cache_memory, not both")
        if self.draft_model and self.prompt_lookup:
            problems.append("draft_model: choose a draft model or prompt_lookup, not both")
        if problems:
            raise ValueError("; ".join(problems))
        return self


class DistillRecipe(TrainingOptions):
    """copt distill logits / sft (traces are generated by `copt distill traces`)."""

    task: Literal["distill"] = "distill"
    mode: Literal["logits", "sft"] = "logits"
    teacher: str | None = None
    student: str
    data: str | None = Field(None, description="Text for logits; traces.jsonl for sft.")
    output: str | None = None
    loss: Literal["forward-kl", "reverse-kl", "jsd"] = "forward-kl"
    temperature: float = Field(2.0, gt=0)
    alpha: float = Field(0.5, ge=0, le=1, description="Weight of the distillation loss; 1-alpha goes to CE.")
    top_k: PositiveInt | None = None
    teacher_dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    prediction: Prediction | None = None

    @model_validator(mode="after")
    def _check_distill(self) -> DistillRecipe:
        if self.mode == "logits" and not self.teacher:
            raise ValueError("teacher: distill logits needs a teacher model directory")
        return self


RECIPE_MODELS: dict[str, type[Strict]] = {
    "train": TrainRecipe,
    "quantize": QuantizeRecipe,
    "serve": ServeRecipe,
    "distill": DistillRecipe,
}
AnyRecipe = TrainRecipe | QuantizeRecipe | ServeRecipe | DistillRecipe
