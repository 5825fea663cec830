"""The decision matrix: symptoms → ranked techniques, each checked against this plan and re-predicted.

Every recommendation has a stable id, why it applies here, the expected gain with its source, its cost, the
applicability checks it passed or failed, the predicted figures after applying it (the same memory/time models
run on the changed plan) and the copt flags that apply it. Ranking per symptom: the predicted improvement of the
symptom's own metric, plus a bonus for the order of the decision matrix (MATRIX).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from clusteropt_cli.core.advise import calibration as cal
from clusteropt_cli.core.advise.memory import host_train_memory, kv_layout
from clusteropt_cli.core.advise.plan import InferPlan, Target, TrainPlan, validate_train
from clusteropt_cli.core.advise.recipes import copt_train_problems
from clusteropt_cli.errors import BadInputError
from clusteropt_cli.modelspec import ModelSpec

BENCH = "docs/benchmarks.md"
SRC_CKPT = f"Chen et al. arXiv:1604.06174; {BENCH}#train"
SRC_MIXED = "Micikevicius et al. arXiv:1710.03740"
SRC_FP8 = "FP8 formats arXiv:2209.05433"
SRC_ACCUM = "DeepSpeed docs: gradient_accumulation_steps"
SRC_POWERSGD = "PowerSGD arXiv:1905.13514"
SRC_GEMM = "NVIDIA matmul performance guide"
SRC_ALLOC = "PyTorch CUDA memory management docs (expandable_segments)"
SRC_R1 = "DeepSeek-R1 arXiv:2501.12948"
SRC_FP8_H200 = f"{SRC_FP8}; {BENCH}#h200-baselines"

# The decision matrix (bottleneck → techniques), in order; ids not listed rank on predicted gain alone.
MATRIX: dict[str, list[str]] = {
    "oom": ["zero-3", "cpu-offload", "activation-checkpointing", "zero-2", "zero-1", "nvme-offload",
            "gradient-accumulation", "flash-attention", "8bit-optimizer", "tensor-parallel", "pipeline-parallel",
            "awq", "gptq", "quantized-kernels", "kv-cache-quantization", "fp8-w8a8", "expandable-segments"],
    "high-ttft": ["chunked-prefill", "prefix-caching", "tensor-parallel", "fp8-w8a8", "operator-fusion"],
    "slow-tpot": ["speculative-decoding", "awq", "gptq", "quantized-kernels", "fp8-w8a8", "kv-cache-quantization",
                  "operator-fusion", "tensor-parallel", "distillation"],
    "low-throughput": ["continuous-batching", "kv-cache-quantization", "awq", "quantized-kernels", "fp8-w8a8", "gptq",
                       "chunked-prefill", "operator-fusion", "larger-micro-batch", "fp8"],
    "comm-bound": ["gradient-accumulation", "gradient-compression", "zero-1", "tensor-parallel", "pipeline-parallel"],
    "low-mfu": ["larger-micro-batch", "operator-fusion", "flash-attention", "bf16", "fp8", "gradient-accumulation"],
}


@dataclass
class Recommendation:
    id: str
    title: str
    why: str
    gain: str
    gain_source: str
    cost: str
    checks: list[dict[str, Any]] = field(default_factory=list)
    applicable: bool = True
    predicted: dict[str, Any] = field(default_factory=dict)
    flags: list[str] = field(default_factory=list)
    command: str = ""
    score: float = 0.0
    symptoms: list[str] = field(default_factory=list)
    plan: Any = field(default=None, repr=False)
    # not applicable alone (its copt-engine plan does not fit one GPU) but a step the OOM plan may stack
    stack_only: bool = False


@dataclass
class Context:
    spec: ModelSpec
    target: Target
    plan: TrainPlan | InferPlan
    evaluate: Callable[[Any], dict[str, Any]]  # plan → predicted figures (memory + time)
    base: dict[str, Any]
    model_arg: str

    @property
    def train(self) -> bool:
        return isinstance(self.plan, TrainPlan)


def _check(name: str, ok: bool, detail: str) -> dict[str, Any]:
    return {"check": name, "ok": bool(ok), "detail": detail}


def _gpu_checks(ctx: Context, need_fp8: bool = False, need_multi: bool = False) -> list[dict[str, Any]]:
    checks = []
    gpu = ctx.target.gpu
    if need_fp8:
        ok = gpu is not None and gpu.supports_fp8
        cc = "cpu" if gpu is None else (f"{gpu.compute_capability[0]}.{gpu.compute_capability[1]}"
                                        if gpu.compute_capability else gpu.vendor)
        checks.append(_check("fp8-hardware", ok, f"FP8 tensor cores need compute capability ≥ 8.9 ({ctx.target.name}: "
                                                 f"{cc})"))
    if need_multi:
        checks.append(_check("multi-gpu", ctx.target.world > 1,
                             f"partitioning needs more than one GPU (have {ctx.target.world})"))
    if ctx.target.gpu is None:
        checks.append(_check("gpu", False, "needs a CUDA GPU"))
    return checks


# ---- the catalog: one function per technique ------------------------------------------------------------------
def _stackable(plan: TrainPlan) -> TrainPlan:
    """A recommendation's plan with the user's other options its layout rules out reset, as copt train's schema
    rules them out (else its printed command would be refused): offload runs DeepSpeed's CPU AdamW whatever the
    optimizer; ZeRO takes no DDP gradient compression; ZeRO-3 has no fused loss (its gathered head)."""
    changes: dict[str, Any] = {}
    if plan.offload != "none" and plan.optimizer != "adamw":
        changes["optimizer"] = "adamw"
    if plan.zero > 0 and plan.gradient_compression != "none":
        changes["gradient_compression"] = "none"
    if plan.zero == 3 and plan.loss_impl == "fused":
        changes["loss_impl"] = "auto"
    return plan.with_(**changes) if changes else plan


def _train_recs(ctx: Context) -> list[Recommendation]:
    p: TrainPlan = ctx.plan  # type: ignore[assignment]
    spec, target = ctx.spec, ctx.target
    recs: list[Recommendation] = []
    mem = ctx.base["memory"]
    # a plan copt train runs gets only recommendations it runs too (tensor parallelism aside: ranked below, its
    # command says where such layouts run); a layout it does not run is re-planned as the layout it is
    runs = not copt_train_problems(p, spec, target, ctx.model_arg)

    def add(rid: str, title: str, why: str, gain: str, source: str, cost: str, new: TrainPlan | None,
            flags: list[str], checks: list[dict[str, Any]] | None = None) -> None:
        if new is None or new == p:
            return
        new = _stackable(new)
        try:
            validate_train(spec, new, target)  # a layout advise itself calls impossible is never recommended
        except BadInputError:
            return
        if runs and new.tp == 1 and copt_train_problems(new, spec, target, ctx.model_arg):
            if new.pp == 1 or new.zero == 0:
                return
            # copt's pipeline engine runs without ZeRO: ZeRO partitions over data parallelism instead of stages
            new = new.with_(pp=1, pp_micro_batches=None, pp_virtual_stages=1)
            if copt_train_problems(new, spec, target, ctx.model_arg):
                return
            flags = [*flags, "--pipeline-stages 1"]
        recs.append(Recommendation(rid, title, why, gain, source, cost, checks or [], plan=new, flags=flags))

    if not p.activation_checkpointing:
        add("activation-checkpointing", "Recompute activations in backward",
            f"activations are {_gib(mem['breakdown']['activations'])} of the peak",
            "70%+ activation memory saved", SRC_CKPT, "+20–30% compute (measured +22% on the H200 anchor)",
            p.with_(activation_checkpointing=True), ["--activation-checkpointing"])
    for stage in (1, 2, 3):
        if p.zero < stage and not (stage == 3 and p.pp > 1):
            saves = {1: "optimizer states", 2: "optimizer states + gradients", 3: "all model states"}[stage]
            gain = {1: "4× on optimizer states", 2: "8× on optimizer states + gradients",
                    3: "model states fall to 16Φ/N per GPU"}[stage]
            cost = {1: "no extra communication", 2: "no extra communication (reduce-scatter replaces all-reduce)",
                    3: "1.5× data-parallel communication (parameter all-gathers)"}[stage]
            add(f"zero-{stage}", f"DeepSpeed ZeRO stage {stage}", f"partitions {saves} over the data-parallel GPUs",
                gain, "ZeRO arXiv:1910.02054", cost, p.with_(zero=stage), [f"--zero {stage}"],
                _gpu_checks(ctx, need_multi=True))
    if p.offload == "none":
        z = 3 if p.pp == 1 else max(1, p.zero)
        cpu_plan = p.with_(zero=max(z, p.zero), offload="cpu")
        host_gib = host_train_memory(spec, cpu_plan, target)["peak_bytes"] / cal.GiB
        add("cpu-offload", "ZeRO-Offload: optimizer states (and ZeRO-3 parameters) in host memory",
            "model states dominate the peak" if mem["model_states_bytes"] > 0.5 * mem["per_gpu_bytes"]
            else "moves the fp32 master weights and Adam states off the GPU",
            "optimizer states leave the GPU", "ZeRO-Offload arXiv:2101.06840",
            f"host RAM ≈ {host_gib:.0f} GiB per node (DeepSpeed's pinned states, 24 bytes/param measured under "
            "ZeRO-3); CPU Adam, ZeRO's hooks and PCIe per step, set by the host CPU (3B shape on 16-core H100 hosts: "
            "1.14–1.51 s per step vs 0.45 s of compute)",
            cpu_plan, [f"--zero {cpu_plan.zero}", "--offload cpu"])
        add("nvme-offload", "ZeRO-Infinity: optimizer states on NVMe", "when host RAM cannot hold the states",
            "optimizer states leave the GPU and the host RAM", "ZeRO-Infinity arXiv:2104.07857",
            "NVMe bandwidth bound; slower than CPU offload", p.with_(zero=3 if p.pp == 1 else max(1, p.zero),
                                                                     offload="nvme"),
            [f"--zero {3 if p.pp == 1 else max(1, p.zero)}", "--offload nvme", "--nvme-path NVME_DIR"])
    if p.attn == "eager":
        add("flash-attention", "SDPA / FlashAttention instead of eager attention",
            f"eager attention stores the {p.seq_len}×{p.seq_len} score matrix per head",
            "attention memory O(N²) → O(N); faster kernels", "FlashAttention-2 arXiv:2307.08691",
            "none (same math)", p.with_(attn="sdpa"), ["--attn sdpa"])
    if p.precision in ("fp32", "fp16") and (target.gpu is None or target.gpu.supports_bf16):
        add("bf16", "bf16 mixed precision", f"{p.precision} " + ("runs on slow fp32/tf32 paths" if p.precision ==
                                                                  "fp32" else "needs loss scaling"),
            "tensor-core throughput; fewer activation bytes", SRC_MIXED, "weights kept in fp32 (16 bytes/param)",
            p.with_(precision="bf16"), ["--precision bf16"])
    if p.precision != "fp8":
        add("fp8", "FP8 training (E4M3 forward / E5M2 gradients)", "matmuls at twice the bf16 tensor-core rate",
            "up to 2× matmul throughput (1,421 vs 774 TFLOP/s measured on the H200)",
            SRC_FP8_H200, "numerical care (scaling); TransformerEngine/torchao",
            p.with_(precision="fp8"), ["--precision fp8"], _gpu_checks(ctx, need_fp8=True))
    if p.micro_batch > 1:
        mb = max(1, p.micro_batch // 2)
        add("gradient-accumulation", "Halve the micro-batch, double gradient accumulation",
            "same global batch with half the activations", "activations ÷2; fewer all-reduces per token",
            SRC_ACCUM, "smaller GEMMs: slightly lower MFU", p.with_(micro_batch=mb, grad_accum=p.grad_accum * 2),
            [f"--micro-batch {mb}", f"--grad-accum {p.grad_accum * 2}"])
    elif p.grad_accum < 8 and target.world > 1:
        add("gradient-accumulation", "Accumulate more micro-batches per optimizer step",
            "amortizes the gradient all-reduce over more tokens", "communication per token ÷ accumulation steps",
            SRC_ACCUM, "larger global batch", p.with_(grad_accum=p.grad_accum * 4),
            [f"--grad-accum {p.grad_accum * 4}"])
    if p.optimizer == "adamw" and p.offload == "none":  # offloaded states live on the host, in DeepSpeed's CPU Adam
        add("8bit-optimizer", "8-bit AdamW (bitsandbytes)", "Adam states are 8 bytes/param",
            "optimizer states 8 → 2 bytes/param", "Dettmers et al. arXiv:2110.02861", "bitsandbytes dependency",
            p.with_(optimizer="adamw-8bit"), ["--optimizer adamw-8bit"])
    # the widest power-of-two degree inside a node that leaves whole pipelines (tp × pp divides the GPUs)
    t = max([d for d in (2, 4, 8) if d <= target.gpus_per_node and target.world % (d * p.pp) == 0], default=1)
    if p.tp == 1 and t > 1 and spec.num_heads % t == 0:
        add("tensor-parallel", f"Tensor parallelism over {t} GPUs", "splits every layer's weights and activations",
            f"weights and activations ÷{t}", "Megatron-LM arXiv:1909.08053",
            "4 all-reduces per layer on NVLink; stays inside a node", p.with_(tp=t), [f"--tensor-parallel {t}"],
            _gpu_checks(ctx, need_multi=True))
    # copt train's pipeline engine: one stage per process (no data parallelism), no ZeRO, bf16 or fp32
    stages = target.world // p.tp  # the GPUs a tensor-parallel group leaves: one stage per group
    if p.pp == 1 and 1 < stages <= min(8, spec.num_layers) and p.zero == 0 and p.precision in ("bf16", "fp32"):
        m = max(4 * stages, p.grad_accum)
        add("pipeline-parallel", f"Pipeline parallelism, {stages} stages (1F1B)", "splits the layers across GPUs",
            f"weights ÷{stages}; bubble (p−1)/(m+p−1) = {(stages - 1) / (m + stages - 1):.0%} at m={m}",
            "PipeDream-Flush 1F1B arXiv:2006.09503; Megatron-LM arXiv:2104.04473",
            "pipeline bubble; 1F1B keeps stage 0's activations for p micro-batches",
            p.with_(pp=stages, pp_micro_batches=m, grad_accum=max(p.grad_accum, m)),
            [f"--pipeline-stages {stages}", f"--pipeline-micro-batches {m}", f"--grad-accum {max(p.grad_accum, m)}"],
            _gpu_checks(ctx, need_multi=True))
    if p.zero == 0 and target.world > 1 and p.gradient_compression == "none":
        add("gradient-compression", "Compress gradients for the all-reduce (PowerSGD)",
            "data-parallel gradient traffic crosses a slow link", "up to 90% less gradient traffic", SRC_POWERSGD,
            "approximate gradients (error feedback needed); DDP only (zero 0)",
            p.with_(gradient_compression="powersgd"), ["--gradient-compression powersgd"],
            _gpu_checks(ctx, need_multi=True))
    if target.gpu is not None and not p.runs_compiled(target.device) and not p.uses_deepspeed:
        add("operator-fusion", "torch.compile the training step", "fuses norms, RoPE, SwiGLU and casts",
            "57.5k vs 46.6k tok/s (+23%) and 50.1 vs 73.8 GiB measured on the H200 anchor",
            f"{BENCH}#h200-baselines", "~40 s compile on the first step", p.with_(compile=True), ["--compile"])
    mem_ratio = mem["required_bytes"] / mem["budget_bytes"] if mem.get("budget_bytes") else 1.0
    if mem_ratio < 0.5:
        mb = p.micro_batch * 2
        add("larger-micro-batch", "Double the micro-batch", "memory is under half used",
            "bigger GEMMs and fewer optimizer steps per token", SRC_GEMM, "larger global batch (or fewer accumulation)",
            p.with_(micro_batch=mb, grad_accum=max(1, p.grad_accum // 2)),
            [f"--micro-batch {mb}", f"--grad-accum {max(1, p.grad_accum // 2)}"])
    if target.gpu is not None:
        recs.append(Recommendation(
            "expandable-segments", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
            "fragmentation can make a plan that fits by allocation fail by reservation",
            "fragmentation 18% → below 5%", SRC_ALLOC, "none", [], plan=p,
            flags=["(env) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"]))
    return recs


def _infer_recs(ctx: Context) -> list[Recommendation]:
    p: InferPlan = ctx.plan  # type: ignore[assignment]
    target = ctx.target
    recs: list[Recommendation] = []

    def add(rid: str, title: str, why: str, gain: str, source: str, cost: str, new: InferPlan, flags: list[str],
            checks: list[dict[str, Any]] | None = None) -> None:
        if new.serving_engine == "vllm":  # the engine copt serve runs it on (its prices are for it): vLLM batches
            new = new.with_(engine="vllm", continuous_batching=True)  # continuously
        if new == p and rid not in ("prefix-caching", "distillation"):
            return
        recs.append(Recommendation(rid, title, why, gain, source, cost, checks or [], plan=new, flags=flags))

    if not p.continuous_batching:
        add("continuous-batching", "Continuous batching (iteration-level scheduling)",
            "static batches wait for their longest sequence and pad",
            "3–5× serving throughput", "Orca (OSDI '22); vLLM arXiv:2309.06180", "a serving engine (copt serve)",
            p.with_(continuous_batching=True, batch=max(p.batch, _max_seqs(ctx, p))), ["copt serve --max-batch-size"])
    # copt's engine already chunks prompts within its step budget (--max-batch-tokens, 2048 on CUDA): only a plan off
    # it (a static batch) or with a larger budget has chunked prefill to gain
    default_chunk = cal.SERVING_ENGINES["copt"]["prefill_chunk_tokens"]
    already_chunked = (p.continuous_batching and p.serving_engine == "copt"
                       and (p.chunked_prefill or default_chunk) <= default_chunk)
    if not already_chunked:
        add("chunked-prefill", "Chunked prefill", "long prompts stall every running sequence and queue new ones",
            "flattens TTFT spikes: a new request waits for one chunk, not every prompt",
            "Sarathi-Serve arXiv:2403.02310; vLLM docs: chunked prefill",
            "slightly lower prefill efficiency", p.with_(chunked_prefill=2048, continuous_batching=True),
            ["--max-batch-tokens 2048"])
    if p.shared_prefix_len and not p.prefix_caching:
        add("prefix-caching", "Prefix caching", f"the {p.shared_prefix_len}-token prefix every request shares is "
            "prefilled and stored again for each one",
            "prefill skips the cached prefix (TTFT ∝ uncached tokens); its KV blocks are stored once",
            "vLLM automatic prefix caching; copt serve's paged KV cache", "none (on by default)",
            p.with_(prefix_caching=True, continuous_batching=True), ["--enable-prefix-caching"])
    elif not p.shared_prefix_len:
        add("prefix-caching", "Prefix caching", "shared system prompts/few-shot prefixes are prefilled once and their "
            "KV blocks stored once", "prefill skips the cached prefix (TTFT ∝ uncached tokens)",
            "vLLM automatic prefix caching; copt serve's paged KV cache", "gains only with shared prefixes", p,
            ["--shared-prefix-len N (copt advise)"],
            [_check("shared-prefix", False, "this workload names no shared prefix: --shared-prefix-len N prices one "
                    "(copt serve and vLLM cache prefixes by default)")])
    if p.speculative_tokens == 0:
        ok = p.batch <= 8
        add("speculative-decoding", "Speculative decoding (draft model or prompt lookup)",
            "decode is memory-bound: verifying k tokens costs about one step",
            "~2–3 tokens accepted per target step", "Leviathan et al. arXiv:2211.17192",
            "a draft model; gains shrink as the batch grows",
            p.with_(speculative_tokens=4), ["--draft-model DRAFT_DIR", "--num-speculative-tokens 4"],
            [_check("low-batch", ok, f"pays at low batch (≤ 8 concurrent sequences; here {p.batch})")])
    if p.weights in ("bf16", "fp16"):
        # copt's engine dequantizes packed int4 checkpoints to the model dtype at load (no int4 GEMM kernel): the
        # smaller weights and faster decode are vLLM's (Marlin/Machete W4A16 kernels), so 4-bit plans are served there
        via = "" if p.engine == "vllm" else (
            "; served by vLLM (Marlin/Machete int4 kernels): copt's engine dequantizes 4-bit checkpoints to "
            f"{p.with_(weights='int4', engine='copt').served_weights} at load, with no memory or speed gain")
        engine_flags = [] if p.engine == "vllm" else ["--engine vllm"]
        add("awq", "AWQ 4-bit weights", "decode time is weight bytes over bandwidth" + via,
            "weights ~3.5× smaller; near-lossless 4-bit", "AWQ arXiv:2306.00978",
            "calibration run; int4 GEMM kernels lose at large batch" + ("" if p.engine == "vllm" else "; vLLM"),
            p.with_(weights="int4", engine="vllm"), ["copt quantize --method awq", *engine_flags], _gpu_checks(ctx))
        add("gptq", "GPTQ 4-bit weights", "decode time is weight bytes over bandwidth" + via,
            "weights ~3.5× smaller", "GPTQ arXiv:2210.17323",
            "calibration run; outlier-sensitive" + ("" if p.engine == "vllm" else "; vLLM"),
            p.with_(weights="int4", engine="vllm"), ["copt quantize --method gptq", *engine_flags], _gpu_checks(ctx))
        add("fp8-w8a8", "FP8 weights and activations (W8A8)", "native FP8 tensor cores, half the weight bytes",
            "2× matmul peak, weights ÷2", SRC_FP8, "needs Ada/Hopper or newer", p.with_(weights="fp8"),
            ["copt quantize --method fp8"], _gpu_checks(ctx, need_fp8=True))
    elif p.weights in ("int4", "int8") and p.engine == "copt":
        add("quantized-kernels", f"Serve the {p.weights} checkpoint on vLLM's packed kernels",
            f"copt's engine dequantizes {p.weights} checkpoints to {p.served_weights} at load (no integer GEMM "
            "kernel): the quantization saves no memory and no decode time there",
            f"weights stay {p.weights} in memory and in every decode step's reads",
            "vLLM docs: quantization (Marlin/Machete kernels)", "a vLLM install", p.with_(engine="vllm"),
            ["--engine vllm"], _gpu_checks(ctx))
    if p.kv_cache in ("bf16", "fp16") and target.gpu is not None and target.gpu.supports_fp8:
        # FP8 KV blocks: copt's paged engine keeps them (its kernel needs FP8 hardware, compute capability 8.9+);
        # the slot layout goes to vLLM. No INT8 cache: neither copt serve nor vLLM's command line takes one
        own = p.engine == "copt" and p.continuous_batching and kv_layout(ctx.spec, p) == "paged"
        add("kv-cache-quantization", "FP8 KV cache", "the KV cache grows with batch × context",
            "KV bytes ÷2 → 2× the concurrent sequences", "vLLM docs: quantized KV cache", "small accuracy cost",
            p.with_(kv_cache="fp8") if own else p.with_(kv_cache="fp8", engine="vllm"),
            ["--kv-cache-dtype fp8"] if own else ["--kv-cache-dtype fp8", "--engine vllm"])
    if p.tp == 1 and target.world > 1:
        t = min(target.world, 8)
        while ctx.spec.num_heads % t:
            t //= 2
        if t > 1:
            add("tensor-parallel", f"Tensor parallelism over {t} GPUs", "splits weights, KV and FLOPs per token",
                f"prefill and decode up to {t}× faster (NVLink)", "Megatron-LM arXiv:1909.08053",
                "all-reduces per layer", p.with_(tp=t, engine="vllm"), [f"--tensor-parallel {t}", "--engine vllm"])
    add("distillation", "Distill into a smaller student", "every decode step reads all weights",
        "a 1.5–32B student inherits reasoning from trace SFT", SRC_R1, "a training run (copt distill)", p,
        ["copt distill sft"])
    # copt serve compiles its decode layers and captures CUDA graphs by default, and so does vLLM: only a static batch
    # on HF generate (eager) has them to gain
    if p.engine == "copt" and not p.continuous_batching:
        add("operator-fusion", "CUDA graphs / torch.compile for decode",
            "HF eager decode is launch-bound (43.5 ms/token vs a 0.58 ms floor on the H200)",
            "1.80 ms/token compiled vs 43.5 eager (24×) measured on the 1B shape", f"{BENCH}#h200-baselines",
            "compile time; static shapes", p.with_(continuous_batching=True), ["--cuda-graphs"])
    return recs


def _max_seqs(ctx: Context, p: InferPlan) -> int:
    from clusteropt_cli.core.advise.memory import max_concurrent_seqs

    return max(1, min(256, max_concurrent_seqs(ctx.spec, p.with_(continuous_batching=True), ctx.target) or p.batch))


def _gib(n: float) -> str:
    """Bytes in the largest binary unit that keeps the figure readable (tiny models report MiB)."""
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size or unit == "KiB":
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


# ---- scoring -------------------------------------------------------------------------------------------------
def _metric_gain(symptom: str, before: dict[str, Any], after: dict[str, Any]) -> float:
    """Relative improvement of the symptom's own metric (0 = none, 0.5 = 50% better)."""
    def rel_drop(key: str, src: str = "time") -> float:
        b, a = before[src].get(key), after[src].get(key)
        if not b or a is None:
            return 0.0
        return (b - a) / b

    def rel_rise(key: str) -> float:
        b, a = before["time"].get(key), after["time"].get(key)
        if not b or a is None:
            return 0.0
        return min(5.0, (a - b) / b)

    if symptom == "oom":
        if (after["memory"].get("host") or {}).get("fits") is False:
            return 0.0  # the states moved to a host that cannot hold them: nothing saved
        b, a = before["memory"]["required_bytes"], after["memory"]["required_bytes"]
        gain = (b - a) / b
        slowdown = max(0.0, -rel_rise("tokens_per_s"))
        if after["memory"]["fits"] and not before["memory"]["fits"]:
            # once a plan fits, saving more memory matters little and speed decides among the plans that fit
            return 1.0 + 0.2 * min(gain, 1.0) - 0.5 * slowdown
        return gain - 0.15 * slowdown if gain > 0 else gain
    if symptom == "high-ttft":
        return rel_drop("ttft_s")
    if symptom == "slow-tpot":
        return rel_drop("tpot_s")
    if symptom == "low-throughput":
        key = "output_tokens_per_s" if "output_tokens_per_s" in before["time"] else "tokens_per_s"
        return rel_rise(key)
    if symptom == "comm-bound":
        b = (before["time"].get("comm_exposed_s") or 0) + (before["time"].get("tp_comm_s") or 0)
        a = (after["time"].get("comm_exposed_s") or 0) + (after["time"].get("tp_comm_s") or 0)
        return (b - a) / b if b else 0.0
    if symptom == "low-mfu":
        return rel_rise("tokens_per_s")
    return 0.0


def recommend(ctx: Context, symptoms: list[str]) -> tuple[list[Recommendation], list[Recommendation]]:
    """(applicable recommendations ranked best first, inapplicable ones with their failed checks)."""
    recs = _train_recs(ctx) if ctx.train else _infer_recs(ctx)
    wanted = symptoms or (["oom"] if ctx.base["memory"]["fits"] is False else [])
    applicable, rejected = [], []
    for rec in recs:
        rec.applicable = all(c["ok"] for c in rec.checks)
        if not rec.applicable:
            rejected.append(rec)
            continue
        after = ctx.evaluate(rec.plan)
        if not ctx.train:
            after = _fit_serving(ctx, rec, after)
            if not all(c["ok"] for c in rec.checks):
                rec.applicable, rec.stack_only = False, True
                rejected.append(rec)
                continue
        rec.predicted = _summary(after)
        score = 0.0
        for symptom in wanted:
            order = MATRIX.get(symptom, [])
            bonus = 0.3 * (1 - order.index(rec.id) / len(order)) if rec.id in order else 0.0
            gain = _metric_gain(symptom, ctx.base, after)
            if rec.id in order or gain > 0.01:
                score += max(gain, 0.0) + bonus
                rec.symptoms.append(symptom)
        if not wanted:  # no symptom: rank by predicted speed-up while still fitting
            score = _metric_gain("low-throughput", ctx.base, after) if after["memory"]["fits"] is not False else 0.0
        if after["memory"]["fits"] is False and ctx.base["memory"]["fits"] is not False:
            score -= 1.0  # never trade a fitting plan for one that does not fit
        if ctx.train and rec.plan.tp > 1 and score > 0:
            score *= 0.5  # copt train cannot run it (Megatron-LM / torchtitan can): rank runnable plans first
        if not ctx.train and rec.plan.engine != ctx.plan.engine and score > 0:
            score *= 0.5  # a switch to vLLM is priced on its roofline (no measured overheads): an upper bound
        rec.score = round(score, 4)
        applicable.append(rec)
    applicable = [r for r in applicable if r.score > 0 or (not wanted and r.score >= 0)]
    applicable.sort(key=lambda r: (-r.score, r.id))
    return applicable, rejected


# infer recommendations whose command is not a `copt serve` of the changed plan
_NOT_SERVED = {"distillation"}
# copt-engine techniques vLLM runs as well (an FP8 checkpoint, an fp8 KV cache, prompt-lookup speculation, chunked
# prefill): moved to vLLM with tensor parallelism when the plan does not fit one GPU
_VLLM_PORTABLE = {"fp8-w8a8", "kv-cache-quantization", "speculative-decoding", "chunked-prefill"}


def _tp_sizes(ctx: Context, above: int) -> list[int]:
    """Tensor-parallel sizes above `above` this target and model allow (powers of two up to one 8-GPU host)."""
    sizes, t = [], 2
    while t <= min(8, ctx.target.world):
        if t > above and ctx.spec.num_heads % t == 0:
            sizes.append(t)
        t *= 2
    return sizes


def weights_exceed_gpu(mem: dict[str, Any]) -> bool:
    """Whether a serve plan's weights per GPU (with the allocator's slack and the CUDA context) leave no room at all:
    the engine cannot start, whatever its batch."""
    budget = mem.get("budget_bytes")
    return budget is not None and mem["breakdown"]["weights"] * (1 + cal.ALLOCATOR_FRAGMENTATION) + \
        cal.CUDA_CONTEXT_BYTES >= budget


def _fit_serving(ctx: Context, rec: Recommendation, after: dict[str, Any]) -> dict[str, Any]:
    """A serve plan that does not fit one GPU of the target is served the way that makes it fit, or not at all.

    copt's engine runs one GPU (no tensor parallelism): a technique vLLM runs as well (FP8 checkpoints, an fp8 KV
    cache, prompt-lookup speculation, chunked prefill) is rewritten for vLLM with tensor parallelism over as few GPUs
    as make it fit; anything else is not applicable, with the reason (a failing `one-gpu` check). A vLLM plan gets
    more tensor parallelism the same way. Returns the evaluation of the plan the recommendation now prints."""
    mem = after["memory"]
    if rec.id in _NOT_SERVED or mem["fits"] is not False:
        return after
    plan: InferPlan = rec.plan
    budget = mem["budget_bytes"]
    weights = mem["breakdown"]["weights"]
    if weights_exceed_gpu(mem):
        what = (f"the {plan.served_weights} weights ({_gib(weights)} per GPU, with the CUDA context) exceed "
                + (f"{plan.tp} × " if plan.tp > 1 else "one ") + f"{ctx.target.name} ({_gib(budget)} each)")
    else:
        what = (f"{plan.batch} concurrent sequences need {_gib(mem['required_bytes'])} per GPU, one "
                f"{ctx.target.name} has {_gib(budget)}")
    if plan.engine == "vllm" or rec.id in _VLLM_PORTABLE:
        for t in _tp_sizes(ctx, plan.tp):
            candidate = plan.with_(tp=t, engine="vllm", continuous_batching=True)
            result = ctx.evaluate(candidate)
            if not result["memory"]["fits"]:
                continue
            rec.flags = [f for f in rec.flags if not f.startswith(("--tensor-parallel", "--engine"))] + [
                f"--tensor-parallel {t}", "--engine vllm"]
            via = "" if plan.engine == "vllm" else "served by vLLM (copt's engine runs one GPU) "
            rec.why += f"; {via}over {t} GPUs with tensor parallelism: {what}"
            rec.plan = candidate
            return result
        if plan.engine == "vllm":
            return after  # the largest tensor-parallel layout does not fit either: ranked as not fitting
    if ctx.target.world > 1 and _tp_sizes(ctx, 1):
        instead = "serve the model through vLLM with tensor parallelism (tensor-parallel), or quantize it first"
    else:
        instead = "quantize it first, or plan more GPUs (--gpus N) for vLLM's tensor parallelism"
    rec.checks.append(_check("one-gpu", False, f"copt's engine serves on one GPU and {what}; {instead}"))
    return after


def _summary(result: dict[str, Any]) -> dict[str, Any]:
    mem, tm = result["memory"], result["time"]
    keys = ("step_time_s", "tokens_per_s", "mfu", "ttft_s", "tpot_s", "output_tokens_per_s")
    out = {"peak_mem_bytes": mem["per_gpu_bytes"], "required_bytes": mem["required_bytes"], "fits": mem["fits"]}
    out.update({k: tm[k] for k in keys if tm.get(k) is not None})
    return out
