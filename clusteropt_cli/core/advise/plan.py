"""What advise reasons about: the hardware target and a training or inference plan, validated up front."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from clusteropt_cli.errors import BadInputError
from clusteropt_cli.hardware import GPUSpec
from clusteropt_cli.modelspec import ModelSpec

Precision = Literal["bf16", "fp16", "fp8", "fp32"]


@dataclass(frozen=True)
class Target:
    """Where the plan runs: a catalog GPU (or the CPU), how many per node, how many nodes."""

    gpu: GPUSpec | None  # None: the CPU
    gpus_per_node: int = 1
    nodes: int = 1
    budget_bytes: int | None = None  # --memory-budget; else the GPU's memory
    gpu_hour_usd: float | None = None
    detected: bool = False
    host_memory_bytes: int | None = None  # RAM per node: --host-memory, else this machine's when the GPU is detected
    # the serving host's speed: seconds of copt's reference Python loop (core/hostspeed.py): --host-loop-ms, else this
    # machine's when the GPU is detected; None: the calibration machines' (calibration.HOST_LOOP_REFERENCE_S)
    host_loop_s: float | None = None

    @property
    def device(self) -> str:
        return "cpu" if self.gpu is None else "cuda"

    @property
    def name(self) -> str:
        return "cpu" if self.gpu is None else self.gpu.name

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def memory_bytes(self) -> int | None:
        if self.budget_bytes is not None:
            return self.budget_bytes
        return None if self.gpu is None else self.gpu.memory_bytes


@dataclass(frozen=True)
class TrainPlan:
    micro_batch: int = 1
    seq_len: int = 2048
    grad_accum: int = 1
    precision: Precision = "bf16"
    optimizer: Literal["adamw", "adamw-8bit", "sgd"] = "adamw"
    zero: int = 0
    offload: Literal["none", "cpu", "nvme"] = "none"
    activation_checkpointing: bool = False
    attn: Literal["sdpa", "flash", "eager"] = "sdpa"
    tp: int = 1
    pp: int = 1
    pp_micro_batches: int | None = None  # default: copt train's, one per sequence of the step
    pp_virtual_stages: int = 1
    compile: bool | None = None  # None: copt train's default (on for CUDA; never under DeepSpeed), as in the recipe
    gradient_compression: Literal["none", "fp16", "bf16", "powersgd"] = "none"
    loss_impl: Literal["auto", "fused", "hf"] = "auto"  # the recipe's loss_impl (auto: fused unless ZeRO-3)
    loss_chunk_tokens: int | None = None

    @property
    def uses_deepspeed(self) -> bool:
        return self.zero > 0

    @property
    def pipeline_stages(self) -> int:  # the recipe's name, so copt train's rules read a plan like its options
        return self.pp

    @property
    def micro_batches_per_step(self) -> int:
        """The pipeline's micro-batches per optimizer step, as copt train splits them: --pipeline-micro-batches,
        else one per sequence (micro_batch × grad_accum)."""
        return self.pp_micro_batches or self.micro_batch * self.grad_accum

    @property
    def sequences_per_micro_batch(self) -> float | int:
        """Sequences one forward/backward holds: the micro-batch, or with pipeline stages the step's sequences
        split into its micro-batches (copt train's pipeline runs micro_batch × grad_accum sequences per step)."""
        if self.pp == 1:
            return self.micro_batch
        return self.micro_batch * self.grad_accum / self.micro_batches_per_step

    def runs_compiled(self, device: str) -> bool:
        """Whether copt train runs this plan's decoder under torch.compile on `device` (train's own rule)."""
        from clusteropt_cli.core.train.loop import runs_compiled

        return runs_compiled(self, device)

    def loss(self, spec: ModelSpec) -> str:
        """'fused' or 'hf': the LM loss copt train runs for this plan and model (train's own rule)."""
        from clusteropt_cli.core.train.loop import loss_kind

        return loss_kind(self, fused_supported=supports_fused_loss(spec))

    def with_(self, **changes) -> TrainPlan:
        return replace(self, **changes)


def supports_fused_loss(spec: ModelSpec) -> bool:
    """What copt train's losses.supports_fused_loss finds on the built model, from the config alone: a bias-free
    linear head without logit soft-capping or scaling."""
    cfg = getattr(spec, "config", None) or {}
    return not (cfg.get("final_logit_softcapping") or float(cfg.get("logit_scale", 1.0) or 1.0) != 1.0
                or spec.model_type in ("gemma2", "gemma3", "cohere", "cohere2"))


@dataclass(frozen=True)
class InferPlan:
    batch: int = 1
    prompt_len: int = 512
    gen_len: int = 256
    weights: Literal["bf16", "fp16", "fp8", "int8", "int4"] = "bf16"
    kv_cache: Literal["bf16", "fp16", "fp8", "int8"] = "bf16"
    tp: int = 1
    continuous_batching: bool = False
    chunked_prefill: int | None = None  # tokens per prefill chunk
    speculative_tokens: int = 0  # draft tokens per step (0 = off)
    speculative_acceptance: float = 0.7
    engine: Literal["copt", "vllm"] = "copt"  # the serving stack continuous batching runs on
    # copt serve --compile-mode: auto (the default) autotunes batch-1 decode kernels on CUDA, default never
    compile_mode: Literal["auto", "default", "max-autotune-no-cudagraphs"] = "auto"
    temperature: float = 0.0  # of the requests: 0 = greedy; > 0 = sampled (the OpenAI default is 1)
    top_p: float = 1.0  # of the sampled requests: nucleus truncation (1 = off, the OpenAI default)
    top_k: int = 0  # of the sampled requests: top-k truncation (0 = off)
    # leading prompt tokens every request shares (a system prompt, few-shot examples): with prefix caching their
    # full KV blocks are stored once and not prefilled again
    shared_prefix_len: int = 0
    # the serving engine's KV-cache settings (copt serve's flags; None: the engine's default)
    prefix_caching: bool = True  # --enable-prefix-caching (on by default in copt's engine and vLLM V1)
    max_batch_size: int | None = None  # --max-batch-size (vLLM --max-num-seqs); None: 256 (copt), vLLM's default
    block_size: int = 16  # --block-size
    kv_cache_memory_gib: float | None = None  # --kv-cache-memory
    kv_cache_tokens: int | None = None  # --kv-cache-blocks × --block-size
    gpu_memory_utilization: float | None = None  # --gpu-memory-utilization
    max_model_len: int | None = None  # --max-model-len (None: the engine's default choice)
    kv_layout: Literal["auto", "paged", "slots"] = "auto"  # copt's engine: --kv-layout
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"  # --dtype of the served model (auto: fp32 on the CPU)

    @property
    def serving_engine(self) -> str:
        """The engine `copt serve` runs this plan on. copt's engine serves one GPU with a model-dtype or (paged) fp8
        KV cache; tensor parallelism, an int8 KV cache and an fp8 cache in the slot layout are served by vLLM."""
        if self.engine == "vllm" or self.tp > 1 or self.kv_cache == "int8" or (self.kv_cache == "fp8"
                                                                            and self.kv_layout == "slots"):
            return "vllm"
        return "copt"

    @property
    def served_weights(self) -> str:
        """The format the serving engine holds the weights in. copt's engine dequantizes packed int4 (AWQ/GPTQ/RTN)
        and int8 checkpoints to the model dtype at load (core/serve/quantized.py: no integer GEMM kernel), so they
        take the model dtype's memory and decode at its speed; FP8 runs natively (Fp8Linear). vLLM keeps them packed
        (Marlin/Machete int4, int8 kernels)."""
        if self.serving_engine == "copt" and self.weights in ("int4", "int8"):
            return {"fp16": "fp16", "fp32": "fp32"}.get(self.dtype, "bf16")
        return self.weights

    def with_(self, **changes) -> InferPlan:
        return replace(self, **changes)


def _positive(problems: list[str], flag: str, value: int | None) -> None:
    if value is not None and value < 1:
        problems.append(f"{flag} must be at least 1 (got {value})")


def validate_train(spec: ModelSpec, plan: TrainPlan, target: Target) -> None:
    """Every impossible combination at once, each naming its flag."""
    problems: list[str] = []
    for flag, value in (("--micro-batch", plan.micro_batch), ("--seq-len", plan.seq_len),
                        ("--grad-accum", plan.grad_accum), ("--tensor-parallel", plan.tp),
                        ("--pipeline-stages", plan.pp), ("--pipeline-micro-batches", plan.pp_micro_batches),
                        ("--virtual-stages", plan.pp_virtual_stages),
                        ("--gpus", target.gpus_per_node), ("--nodes", target.nodes)):
        _positive(problems, flag, value)
    if plan.zero not in (0, 1, 2, 3):
        problems.append(f"--zero must be 0, 1, 2 or 3 (got {plan.zero})")
    if plan.pp > spec.num_layers:
        problems.append(f"--pipeline-stages {plan.pp} is more pipeline stages than the model's {spec.num_layers} "
                        "layers")
    elif plan.pp * plan.pp_virtual_stages > spec.num_layers:
        problems.append(f"--pipeline-stages × --virtual-stages = {plan.pp * plan.pp_virtual_stages} exceeds the "
                        f"model's {spec.num_layers} layers")
    if plan.tp > 1 and spec.num_heads % plan.tp:
        problems.append(f"--tensor-parallel {plan.tp} does not divide the model's {spec.num_heads} attention heads")
    if plan.tp > 1 and spec.num_kv_heads % plan.tp and plan.tp % spec.num_kv_heads:
        problems.append(f"--tensor-parallel {plan.tp} and the model's {spec.num_kv_heads} KV heads do not divide "
                        "each other")
    if target.world % (plan.tp * plan.pp) and target.world >= 1:
        problems.append(f"--tensor-parallel × --pipeline-stages = {plan.tp * plan.pp} must divide the "
                        f"{target.world} GPUs (--gpus × --nodes)")
    if plan.offload != "none" and plan.zero == 0:
        problems.append("--offload needs DeepSpeed ZeRO: add --zero 1, 2 or 3")
    if plan.zero == 3 and plan.pp > 1:
        problems.append("--zero 3 cannot be combined with --pipeline-stages > 1 (use --zero 1 with pipelines)")
    if plan.seq_len > spec.max_position_embeddings:  # refused by copt train, and by every trainer without RoPE scaling
        problems.append(f"--seq-len {plan.seq_len} exceeds the model's max_position_embeddings "
                        f"({spec.max_position_embeddings})")
    if plan.gradient_compression != "none" and target.world == 1:
        problems.append(f"gradient_compression={plan.gradient_compression} compresses gradients between "
                        "data-parallel GPUs: plan --gpus/--nodes above 1, or drop it")
    if target.device == "cpu" and (plan.zero or plan.tp > 1 or plan.pp > 1):
        problems.append("--gpu cpu models a single-process CPU step: drop --zero/--tensor-parallel/--pipeline-stages")
    if problems:
        raise BadInputError("Impossible training plan:\n" + "\n".join(f"  - {p}" for p in problems),
                            hint="Fix the flags named above (copt advise --help lists them).")


def validate_infer(spec: ModelSpec, plan: InferPlan, target: Target) -> None:
    problems: list[str] = []
    for flag, value in (("--batch", plan.batch), ("--prompt-len", plan.prompt_len), ("--gen-len", plan.gen_len),
                        ("--tensor-parallel", plan.tp), ("--gpus", target.gpus_per_node), ("--nodes", target.nodes)):
        _positive(problems, flag, value)
    if plan.tp > 1 and spec.num_heads % plan.tp:
        problems.append(f"--tensor-parallel {plan.tp} does not divide the model's {spec.num_heads} attention heads")
    if plan.tp > target.world:
        problems.append(f"--tensor-parallel {plan.tp} needs {plan.tp} GPUs; --gpus × --nodes gives {target.world}")
    if plan.shared_prefix_len < 0 or plan.shared_prefix_len > plan.prompt_len:
        problems.append(f"--shared-prefix-len {plan.shared_prefix_len} must be between 0 and --prompt-len "
                        f"{plan.prompt_len} (the shared prefix is part of each prompt)")
    if plan.prompt_len + plan.gen_len > spec.max_position_embeddings:  # copt serve and vLLM refuse such requests
        problems.append(f"--prompt-len + --gen-len = {plan.prompt_len + plan.gen_len} exceeds the model's context "
                        f"(max_position_embeddings {spec.max_position_embeddings})")
    if problems:
        raise BadInputError("Impossible inference plan:\n" + "\n".join(f"  - {p}" for p in problems),
                            hint="Fix the flags named above (copt advise --help lists them).")
