"""Time per training step and per token from FLOPs, bytes and links, at stated efficiencies (calibration.py)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from clusteropt_cli.core.advise import calibration as cal
from clusteropt_cli.core.advise.memory import embedding_value_bytes, kv_cache_bytes, weight_bytes
from clusteropt_cli.core.advise.plan import InferPlan, Target, TrainPlan
from clusteropt_cli.modelspec import ModelSpec


def bubble_fraction(stages: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Pipeline bubble: (p−1)/(m+p−1) for GPipe/1F1B; (p−1)/(v·m) for interleaved 1F1B (arXiv:2104.04473)."""
    if stages <= 1:
        return 0.0
    if virtual_stages > 1:
        return (stages - 1) / (virtual_stages * micro_batches)
    return (stages - 1) / (micro_batches + stages - 1)


def zero_comm_bytes(num_params: float, zero: int, dp: int, grad_bytes: float = 2.0) -> float:
    """Bytes each GPU sends per optimizer step for data parallelism (ring collectives).

    Stages 0–2: reduce-scatter + all-gather of gradients/parameters = 2Ψ·(n−1)/n elements;
    stage 3 adds the parameter all-gather in backward: 3Ψ·(n−1)/n = 1.5× data parallel (ZeRO paper §7).
    """
    if dp <= 1:
        return 0.0
    factor = 3.0 if zero >= 3 else 2.0
    return factor * num_params * grad_bytes * (dp - 1) / dp


def uniform_distinct_experts(experts: int, per_token: int, rows: int) -> float:
    """Distinct experts of a MoE layer that `rows` tokens pick under uniform routing: E·(1 − (1 − k/E)^rows)."""
    return experts * (1.0 - (1.0 - per_token / experts) ** rows)


def sampling_mode(plan: InferPlan, rows: int) -> str:
    """The selection mode copt's engine runs for the plan's sampled requests — the engine's own choice
    (device_sampling.selection_for; on CUDA one row with a wide top-k sorts, as SlotSampler.mode does), named as in
    calibration.SAMPLING_GRAPH_US."""
    from clusteropt_cli.core.serve import device_sampling as ds

    mode = ds.selection_for([ds.RowSettings(temperature=1.0, top_p=plan.top_p, top_k=plan.top_k)])
    if mode in (ds.TOP_K_WIDE, ds.TOP_K_WIDE_P) and rows <= ds.SORT_ROWS:
        mode = ds.SORT
    return {ds.PLAIN: "plain", ds.TOP_P: "top_p", ds.TOP_K_DRAW: "top_k_draw", ds.TOP_K_P_DRAW: "top_k_p_draw",
            ds.TOP_K_WIDE: "top_k_wide", ds.TOP_K_WIDE_P: "top_k_wide_p", ds.SORT: "sort"}[mode]


def _interpolated_us(points: tuple[tuple[int, float], ...], rows: int) -> float:
    """Linear in the rows between the measured points, extended along the last segment beyond them."""
    for (r0, v0), (r1, v1) in zip(points, points[1:], strict=False):
        if rows <= r1 or (r1, v1) == points[-1]:
            return v0 + (v1 - v0) * (max(rows, r0) - r0) / (r1 - r0)
    return points[-1][1]


# cal.SERVING_ENGINES terms that are host work (copt's engine per prompt; the API process per request and token):
# priced at the serving host's speed (host_work_scale)
HOST_WORK_TERMS = ("prefill_request_s", "prefill_graph_request_s", "http_request_s", "http_stream_s", "api_intake_s",
                   "http_token_s")


def host_work_scale(target: Target) -> float:
    """How much longer (> 1) or shorter the serving host takes for copt's engine's host work than the machines advise
    was calibrated on: its reference-loop time (core/hostspeed.py) over theirs; 1 where it is not known."""
    if not target.host_loop_s:
        return 1.0
    return target.host_loop_s / cal.HOST_LOOP_REFERENCE_S


def truncation_step_s(plan: InferPlan, rows: int) -> float:
    """Seconds per decode step that top-k / top-p truncation adds over temperature-only sampling in copt's engine
    (its sampling graph for `rows` rows, measured on the H200: calibration.SAMPLING_GRAPH_US)."""
    mode = sampling_mode(plan, rows)
    if mode == "plain":
        return 0.0
    table = cal.SAMPLING_GRAPH_US
    return max(0.0, _interpolated_us(table[mode], rows) - _interpolated_us(table["plain"], rows)) * 1e-6


@dataclass(frozen=True)
class ServeCosts:
    """What each step of a continuous-batching engine costs under a plan — infer_time's own step model — for
    running a load through it step by step (closed_loop.py)."""

    decode_step: Callable[[int], float]  # seconds of one decode step over n sequences
    prefill: Callable[[int, int], float]  # seconds of one prefill pass over t prompt tokens of r requests
    step_tokens: int  # the engine's token budget per step (--max-batch-tokens): decode rows, then prompt chunks
    max_running: int  # sequences the engine runs at once
    prompt_tokens: int  # prompt tokens each request computes (its prompt less the prefix-cache hits)
    first_token_s: float  # what the server adds to a request's first token (HTTP, tokenization, first event)
    intake_s: float  # the API process's time to take one request in (serial)
    stream_token_s: float  # the API process's time to stream one token out (serial, after the engine emitted it)
    # a step that decodes `rows` sequences and prefills `tokens` prompt tokens in `chunks` chunks (`cached`: how many
    # of their prompts' tokens earlier steps computed — chunks that resume a prompt; then masked_prefill_graphs):
    # (seconds, whether the host bounds it). None: the decode step plus the prefill pass
    mixed_step: Callable[[int, int, int, int, bool], tuple[float, bool]] | None = None
    # what a decode chain of n sequences adds once, at its start, to its passes' decode_step (the host's work and the
    # GPU's overlap from the second pass on)
    chain_start: Callable[[int], float] = lambda rows: 0.0
    # what a decode step of n sequences that is not chained (its tokens read and emitted before the next launch) adds
    unchained_s: Callable[[int], float] = lambda rows: 0.0
    # a step's decoded tokens and finished results reach the API before the step's prefill runs (copt's engine);
    # False: after it (engines whose mixed steps are one forward, and copt's before it handed them out early)
    results_before_prefill: bool = True
    # copt's engine before its prefill graphs went through FlashAttention's variable-length kernel: new prompts only,
    # up to runner.PREFILL_GRAPH_SEGMENTS of them and PREFILL_GRAPH_MAX_PACKED tokens (the masked graphs)
    masked_prefill_graphs: bool = False

    def step_with_prefill(self, rows: int, tokens: int, chunks: int, cached: int = 0) -> tuple[float, bool]:
        """Seconds of a step that prefills (next to `rows` decoding sequences, 0: none), and whether the host bounds
        it."""
        if self.mixed_step is not None:
            return self.mixed_step(rows, tokens, chunks, cached, self.masked_prefill_graphs)
        return (self.decode_step(rows) if rows else 0.0) + self.prefill(tokens, chunks), False


@dataclass
class TimeEstimate:
    figures: dict[str, float | None]
    assumptions: dict[str, float | str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    costs: ServeCosts | None = None  # continuous batching on copt's engine: the step costs behind the figures


# DeepSpeed's offloaded step runs CPU Adam and ZeRO-3's Python hooks on the host CPU (calibration.CPU_ADAM_S_PER_PARAM)
OFFLOAD_HOST_NOTE = ("offload: the step's speed depends on the host CPU (CPU Adam, ZeRO's hooks): the same runs "
                     "stepped up to 1.33× faster on one 16-core H100 host than on another; tokens/s is priced for "
                     "the slower hosts")


def _dp_link(target: Target, tp: int, pp: int) -> tuple[float, str]:
    """Bandwidth (bytes/s per GPU) of the slowest link data parallelism crosses."""
    gpu = target.gpu
    assert gpu is not None
    dp = target.world // (tp * pp)
    if target.nodes > 1 and dp > max(1, target.gpus_per_node // (tp * pp)):
        return gpu.inter_node_bandwidth, "inter-node network"
    return gpu.intra_node_bandwidth, gpu.interconnect


def _mlp_output_params(spec: ModelSpec) -> float:
    """Parameters per token of the decoder layers' MLP output projections (down_proj / c_proj, the active experts'
    under MoE) whose output only feeds the residual add; 0 where a norm follows it (Gemma-2/3's post-norm needs
    that output in backward)."""
    if spec.model_type in ("gemma2", "gemma3_text"):
        return 0.0
    h = spec.hidden_size
    dense = (spec.num_layers - spec.num_moe_layers) * h * spec.intermediate_size
    moe = spec.num_moe_layers * h * (spec.experts_per_token * spec.moe_intermediate_size
                                     + spec.shared_expert_intermediate_size)
    return float(dense + moe)


def recompute_flops_per_token(spec: ModelSpec, seq_len: int, compiled: bool) -> float:
    """Forward FLOPs per token activation checkpointing adds: copt train checkpoints every decoder layer
    (transformers' gradient_checkpointing_enable, non-reentrant); the embedding, final norm and LM head are not
    checkpointed. Eager, torch.utils.checkpoint reruns each layer's whole forward. Compiled, the checkpointed layers
    are inlined into the decoder's graph and the partitioner recomputes only what backward reads: every projection
    and the attention forward, but not the MLP's output projection, whose output only feeds the residual add (the
    next layer's input is the saved checkpoint)."""
    head = spec.vocab_size * spec.hidden_size
    layers = spec.matmul_params_active - head
    if compiled:
        layers -= _mlp_output_params(spec)
    return 2.0 * layers + spec.attention_flops_per_token(seq_len)


def compiled_gemm_efficiency(spec: ModelSpec) -> float:
    """Fraction of dense peak a compiled copt train step reaches on its FLOPs: a ceiling (large GEMMs) scaled by
    h / (h + w). A decoder layer's GEMMs cost ∝ tokens·h² while its memory-bound work (norms, RoPE, SwiGLU,
    residual adds, weight and gradient casts, attention's softmax) costs ∝ tokens·h, so the share of the step
    spent at GEMM speed grows with the hidden size h (calibration.COMPILED_GEMM_EFFICIENCY)."""
    ceiling, width = cal.COMPILED_GEMM_EFFICIENCY["ceiling"], cal.COMPILED_GEMM_EFFICIENCY["overhead_width"]
    h = spec.hidden_size
    return ceiling * h / (h + width)


def prefill_gemm_efficiency(spec: ModelSpec) -> float:
    """Fraction of dense peak a prefill pass reaches on its FLOPs, by the same form as compiled_gemm_efficiency: a
    ceiling scaled by h / (h + w), the memory-bound work per token next to the GEMMs per token
    (calibration.PREFILL_GEMM_EFFICIENCY)."""
    ceiling, width = cal.PREFILL_GEMM_EFFICIENCY["ceiling"], cal.PREFILL_GEMM_EFFICIENCY["overhead_width"]
    h = spec.hidden_size
    return ceiling * h / (h + width)


def prefill_flops(spec: ModelSpec, tokens: int, prompts: int, context_len: int) -> float:
    """FLOPs of a prefill pass over `tokens` prompt tokens of `prompts` prompts: every token through the decoder
    (attention over `context_len` keys), the LM head only for each prompt's last token (the engine computes no
    other logits of a prompt)."""
    head = 2.0 * spec.vocab_size * spec.hidden_size
    per_token = max(0.0, spec.forward_flops_per_token(context_len) - head)
    return tokens * per_token + prompts * head


def train_time(spec: ModelSpec, plan: TrainPlan, target: Target) -> TimeEstimate:
    """Step time = compute / (1 − bubble) + optimizer step + exposed communication + offload time.

    Eager (DeepSpeed, or compile off): compute = FLOPs / (peak × TRAIN_MFU_EAGER), everything else of the step
    inside that one efficiency. Compiled (copt train's CUDA default): compute = FLOPs / (peak ×
    compiled_gemm_efficiency) + the fused loss's pass over the logits (bytes / HBM bandwidth), and the optimizer
    step (clipping + the optimizer's update, bytes per parameter / HBM bandwidth) once per step; under fp8 the
    decoder's linears run at the fp8 peak (× FP8_GEMM_FACTOR), the LM head and attention in bf16.
    """
    if target.gpu is None:
        return TimeEstimate({"step_time_s": None, "tokens_per_s": None},
                            notes=["no CPU speed model: measure with copt profile"])
    gpu = target.gpu
    dp = max(1, target.world // (plan.tp * plan.pp))
    tokens_replica = plan.micro_batch * plan.seq_len * plan.grad_accum
    tokens_step = tokens_replica * dp
    model_flops_token = spec.training_flops_per_token(plan.seq_len)
    compiled = plan.runs_compiled(target.device)
    recompute = recompute_flops_per_token(spec, plan.seq_len, compiled) if plan.activation_checkpointing else 0.0
    dtype = "fp8" if plan.precision == "fp8" and gpu.supports_fp8 else plan.precision
    peak = gpu.peak_flops(dtype)
    shard = plan.tp * plan.pp
    local = spec.num_params / shard
    hbm = gpu.hbm_bandwidth * cal.STREAM_BANDWIDTH_EFFICIENCY
    loss_s = optimizer_s = 0.0
    assumptions: dict[str, float | str] = {}
    if compiled:
        eff = compiled_gemm_efficiency(spec)
        flops = tokens_replica * (model_flops_token + recompute) / shard
        if dtype == "fp8":  # torchao Float8Linear swaps the decoder's linears; LM head and attention stay bf16
            head = spec.vocab_size * spec.hidden_size
            linear = 6.0 * (spec.matmul_params_active - head) + (recompute - spec.attention_flops_per_token(
                plan.seq_len) if recompute else 0.0)
            linear_flops = tokens_replica * linear / shard
            compute = linear_flops / (peak * eff * cal.FP8_GEMM_FACTOR) \
                + (flops - linear_flops) / (gpu.peak_flops("bf16") * eff)
        else:
            compute = flops / (peak * eff)
        loss = plan.loss(spec)
        vocab = spec.vocab_size / plan.tp
        loss_bytes = tokens_replica * vocab * cal.LOSS_BYTES_PER_LOGIT[loss]
        if loss == "fused":  # each chunk's addmm reads and writes the fp32 head-gradient accumulator (V × h)
            chunk = plan.loss_chunk_tokens or max(256, 2**30 // (4 * spec.vocab_size))  # copt train's default
            chunks = plan.grad_accum * math.ceil(plan.micro_batch * (plan.seq_len - 1) / chunk)
            loss_bytes += chunks * 8.0 * vocab * spec.hidden_size
        loss_s = loss_bytes / hbm
        compute += loss_s
        updated = local / (dp if plan.zero >= 1 else 1)
        optimizer_s = updated * (cal.OPTIMIZER_BYTES_PER_PARAM[plan.optimizer] + cal.GRAD_CLIP_BYTES_PER_PARAM) / hbm
        assumptions.update({"gemm_efficiency": round(eff, 3), "hbm_efficiency": cal.STREAM_BANDWIDTH_EFFICIENCY})
    else:
        mfu = cal.TRAIN_MFU_EAGER * (cal.FP8_MFU_FACTOR if dtype == "fp8" else 1.0)
        compute = tokens_replica * (model_flops_token + recompute) / shard / (peak * mfu)
        assumptions["mfu"] = mfu
    m = plan.micro_batches_per_step
    bubble = bubble_fraction(plan.pp, m, plan.pp_virtual_stages)
    compute /= 1 - bubble
    grad_bytes = 4.0 if plan.precision == "fp32" else 2.0
    if plan.gradient_compression == "powersgd":
        grad_bytes /= 8  # rank-limited low-rank factors; order of magnitude from PowerSGD (Vogels et al. 2019)
    link, link_name = _dp_link(target, plan.tp, plan.pp)
    comm_bytes = zero_comm_bytes(local, plan.zero, dp, grad_bytes)
    if plan.zero >= 2:
        comm_bytes *= 1 + (plan.grad_accum - 1) / 2  # reduce-scatter every micro-step
    comm = comm_bytes / (link * cal.COMM_EFFICIENCY) if comm_bytes else 0.0
    exposed = max(0.0, comm - cal.COMM_OVERLAP * compute) if comm else 0.0
    exposed = max(exposed, comm * (1 - cal.COMM_OVERLAP))
    tp_comm = 0.0
    if plan.tp > 1:  # Megatron: 2 all-reduces forward + 2 backward of (tokens × hidden) per layer
        volume = 4 * spec.num_layers / plan.pp * plan.micro_batch * plan.seq_len * spec.hidden_size * 2
        tp_comm = plan.grad_accum * volume * 2 * (plan.tp - 1) / plan.tp / (gpu.intra_node_bandwidth
                                                                            * cal.COMM_EFFICIENCY)
    offload = 0.0
    if plan.offload != "none":
        local_part = local / (dp if plan.zero >= 1 else 1)
        pcie = 25e9 if plan.offload == "cpu" else 5e9  # host link / NVMe read+write
        offload = local_part * cal.CPU_ADAM_S_PER_PARAM + 4 * local_part / pcie
    step = compute + optimizer_s + exposed + tp_comm + offload
    tokens_per_s = tokens_step / step
    notes = [OFFLOAD_HOST_NOTE] if plan.offload != "none" else []
    achieved_mfu = tokens_step * model_flops_token / step / (peak * target.world)
    figures = {
        "step_time_s": step, "tokens_per_s": tokens_per_s, "mfu": achieved_mfu, "compute_s": compute,
        "loss_s": loss_s, "optimizer_s": optimizer_s,
        "bubble_fraction": bubble, "comm_bytes_per_gpu": comm_bytes, "comm_s": comm, "comm_exposed_s": exposed,
        "tp_comm_s": tp_comm, "offload_s": offload, "flops_per_token": model_flops_token,
        "recompute_flops_per_token": recompute,
    }
    if target.gpu_hour_usd:
        figures["usd_per_million_tokens"] = target.gpu_hour_usd * target.world / 3600 / tokens_per_s * 1e6
    assumptions.update({"peak_tflops": peak / 1e12, "comm_efficiency": cal.COMM_EFFICIENCY,
                        "comm_overlap": cal.COMM_OVERLAP, "link": link_name,
                        "bubble_form": "interleaved (p-1)/(v*m)" if plan.pp_virtual_stages > 1 else "(p-1)/(m+p-1)"})
    return TimeEstimate(figures, assumptions, notes)


def prefix_hit_tokens(spec: ModelSpec, plan: InferPlan) -> int:
    """Prompt tokens of each request served from the prefix cache: the full blocks of the shared prefix (at most
    (prompt_len - 1) // block_size), under a paged engine with prefix caching on (copt's engine, not its slot layout;
    vLLM). The first request computes them; every later one hits."""
    from clusteropt_cli.core.advise.memory import kv_layout
    from clusteropt_cli.core.serve.kv_blocks import cacheable_blocks

    if not plan.prefix_caching or plan.shared_prefix_len <= 0 or kv_layout(spec, plan) != "paged":
        return 0
    return cacheable_blocks(plan.prompt_len, plan.shared_prefix_len, plan.block_size) * plan.block_size


def infer_time(spec: ModelSpec, plan: InferPlan, target: Target) -> TimeEstimate:
    """TTFT from prefill FLOPs; TPOT floor from bytes read per decode step over HBM bandwidth."""
    if target.gpu is None:
        return TimeEstimate({"ttft_s": None, "tpot_s": None}, notes=["no CPU speed model: measure with copt profile"])
    gpu = target.gpu
    tp = plan.tp
    compute_dtype = "fp8" if plan.weights == "fp8" and gpu.supports_fp8 else "bf16"
    peak = gpu.peak_flops(compute_dtype) * tp
    bandwidth = gpu.hbm_bandwidth * tp
    # the bytes a decode step reads: copt's engine dequantizes int4/int8 checkpoints at load and runs them as the
    # model dtype (no integer GEMM kernel); vLLM reads them packed
    w_bytes = weight_bytes(spec, plan.served_weights)
    # the serving stack's measured overheads (copt: its own engine under continuous batching, HF generate on static
    # batches; vllm: none measured, roofline only)
    engine_name = ("copt" if plan.continuous_batching else "hf-generate") if plan.engine == "copt" else plan.engine
    engine = cal.SERVING_ENGINES.get(engine_name)
    # the host work of copt's engine (per prompt, per unchained step and sequence) at the serving host's speed
    host_scale = host_work_scale(target) if engine_name == "copt" else 1.0
    if engine and host_scale != 1.0:  # its work per prompt and the API process's per request and token
        engine = {k: v * host_scale if k in HOST_WORK_TERMS else v for k, v in engine.items()}
    # prefix caching: a request's prompt tokens found in the cache (the shared prefix's full blocks, once the first
    # request computed them) are not prefilled; the rest attend to the whole prompt
    hit = prefix_hit_tokens(spec, plan)
    computed = plan.prompt_len - hit
    prefill_context = hit + computed // 2
    prefill_peak = peak * prefill_gemm_efficiency(spec)

    def prefill_compute_s(tokens: int, prompts: int) -> float:
        """The FLOPs of a prefill pass at what prefill reaches of the peak."""
        return prefill_flops(spec, tokens, prompts, prefill_context) / prefill_peak

    def prefill_seconds(tokens: int, requests: int | None = None) -> float:
        """One prefill pass over `tokens` prompt tokens of `requests` requests (by default: whole prompts)."""
        if requests is None:
            requests = math.ceil(tokens / computed)
        compute = max(prefill_compute_s(tokens, requests), w_bytes / bandwidth)
        if not engine:
            return compute
        return compute + requests * engine["prefill_request_s"]

    # continuous batching runs at most the engine's concurrency (--max-batch-size, or what its KV cache holds);
    # clients beyond it wait for a running request to finish: they add rounds to TTFT, not rows to a decode step
    running = plan.batch
    if plan.continuous_batching and plan.batch > 1:
        from clusteropt_cli.core.advise.memory import max_concurrent_seqs

        limit = max_concurrent_seqs(spec, plan, target)
        if limit is not None:
            running = max(1, min(plan.batch, limit))
    prefill_tokens = running * computed
    prefill_s = prefill_seconds(prefill_tokens)
    one_prefill = prefill_seconds(computed)
    if engine and running == 1 and plan.continuous_batching and computed <= engine.get("prefill_graph_tokens", 0):
        # alone, copt's engine prefills the prompt as one captured graph (cal.SERVING_ENGINES)
        one_prefill = prefill_s = (
            max(prefill_compute_s(computed, 1),
                w_bytes / (bandwidth * cal.DECODE_BANDWIDTH_EFFICIENCY))
            + spec.num_layers * engine["prefill_graph_layer_s"] + engine["prefill_graph_request_s"])
    if plan.continuous_batching and plan.batch > 1:
        # `batch` clients whose requests arrive together (a burst, or closed-loop clients in step): the engine
        # prefills the round's prompts first come, first served in chunks of --max-batch-tokens, so the median
        # request's first token comes once about half of them ran (the engine's step trace on the H200: 8B shape,
        # 64 requests, median 0.30-0.34 s of 0.59 s of prefill steps; 256: 1.17 of 2.5 s). Through copt serve the
        # API process takes every request of the round in first (cal.SERVING_ENGINES api_intake_s per request).
        ttft = 0.5 * prefill_s + running * (engine or {}).get("api_intake_s", 0.0)
    elif plan.continuous_batching:
        ttft = one_prefill
    else:
        ttft = prefill_s  # static batch: every prompt of the batch is prefilled before the first token
    if engine:  # what the server adds to a request's first token (HTTP, tokenization, the first SSE event)
        ttft += engine.get("http_request_s", 0.0)  # the same for sampled requests (cal.SERVING_ENGINES)
    ctx = plan.prompt_len + plan.gen_len / 2
    # copt's engine decodes MoE experts below bf16 densely (graph-capturable; transformers' grouped GEMM is bf16's)
    dense_experts = spec.is_moe and engine_name == "copt" and (
        plan.dtype in ("fp16", "fp32") or (plan.dtype == "auto" and plan.weights == "fp16"))

    embedding_value = embedding_value_bytes(plan.served_weights)
    lookup_bytes = 0.0 if spec.tie_word_embeddings else spec.embedding_params * embedding_value

    def decode_step(rows: int) -> tuple[float, float, float, float]:
        """One decode step over `rows` sequences at the mean context: (seconds, floor seconds, bytes read,
        compute seconds)."""
        kv_read = kv_cache_bytes(spec, plan.with_(batch=rows) if rows != plan.batch else plan, ctx)
        # MoE decode reads only the experts the batch routes to: the active parameters (k experts per layer) plus
        # the other experts some token of the batch picks — E·(1 - (1 - k/E)^B) distinct experts, uniform routing
        if dense_experts:  # copt's engine below bf16: every expert on every row (core/serve/moe.py)
            active_w = w_bytes
        elif spec.is_moe:
            k, experts = spec.experts_per_token, spec.num_experts
            distinct = uniform_distinct_experts(experts, k, rows)
            expert_share = min(1.0, max(0.0, (distinct - k) / max(1, experts - k)))
            active_w = w_bytes * (spec.num_active_params
                                  + (spec.num_params - spec.num_active_params) * expert_share) / spec.num_params
        else:
            active_w = w_bytes
        # an untied input embedding is a lookup: a step reads its rows' vectors, not the table
        if lookup_bytes:
            active_w = max(0.0, active_w - lookup_bytes + rows * spec.hidden_size * embedding_value)
        floor = (active_w + kv_read) / bandwidth
        flops = spec.forward_flops_per_token(int(ctx))
        if dense_experts:
            flops += 2.0 * (spec.num_params - spec.num_active_params)
        compute = rows * flops / (peak * cal.DECODE_COMPUTE_MFU)
        seconds = max(floor / cal.DECODE_BANDWIDTH_EFFICIENCY, compute)
        if engine:
            # the device's chain of small kernels per layer (norms, rotary, attention, routing), then the engine's
            # work per step and sequence
            seconds += (spec.num_layers * engine.get("decode_layer_s", 0.0)
                        + spec.num_moe_layers * engine.get("moe_layer_s", 0.0))
            seconds += engine["step_fixed_s"] + engine["step_per_seq_s"] * rows
            if plan.compile_mode != "default" and engine_name == "copt" and rows == 1:
                # batch-1 steps run inductor's autotuned kernels (copt serve's default compile mode, "auto")
                seconds = max(seconds - cal.AUTOTUNED_B1_FLOOR_SHARE * floor, floor)
            if plan.temperature > 0 and engine_name == "copt":
                # sampled requests: one more [batch, vocabulary] pass on the device than the greedy argmax, and the
                # truncation's selection step where top-k or top-p is set
                seconds += cal.SAMPLED_DECODE_STEP_S + cal.SAMPLED_DECODE_PER_SEQ_S * rows
                seconds += truncation_step_s(plan, rows)
        return seconds, floor, active_w + kv_read, compute

    tpot, floor, decode_bytes, decode_compute = decode_step(running)
    spec_speedup = 1.0
    if plan.speculative_tokens:
        a, k = plan.speculative_acceptance, plan.speculative_tokens
        draft_cost = 0.05  # draft forward / target forward (a ~1/20-size draft)
        spec_speedup = (1 - a ** (k + 1)) / ((1 - a) * (1 + k * draft_cost))
        spec_speedup /= max(1.0, decode_compute * (k + 1) / floor)  # verify cost grows once compute-bound
        tpot /= max(1.0, spec_speedup)
    # static batches idle finished slots until the longest sequence ends (and pad prompts); continuous batching
    # refills them every step
    if plan.continuous_batching or engine:
        # `batch` clients each sending their next request when one ends (or one static batch after another): every
        # round prefills all prompts once, then decodes
        # (through copt serve, its API process takes every request of the round in and streams its tokens)
        round_s = prefill_s + plan.gen_len * tpot + running * (engine or {}).get("http_stream_s", 0.0)
        out_tps = running * plan.gen_len / round_s
        if running < plan.batch:
            # the rest wait for places in waves of `running`: the median request's wave starts after
            # (batch / 2) // running rounds (H200, 8B shape, 256 clients at --max-batch-size 64: TTFT p50 3.19 s,
            # two rounds of 1.42 s and its own wave's prefill)
            ttft += (plan.batch // 2 // running) * round_s
    else:
        out_tps = plan.batch / tpot * cal.STATIC_BATCH_EFFICIENCY
    # what a streaming client measures as TPOT ((last token - first) / (tokens - 1)): the decode steps, and the
    # prefill steps of the other requests that run while it decodes (chunked prefill shares the steps) — about half
    # of a round's prompts when every client's request runs at once, all of them when clients queue and take the
    # places requests free. H200, bench/gpu_serve_models.py (docs/benchmarks.md, real model sizes): the decode step
    # alone was 0.36–0.74 of the clients' TPOT p50 on the 1B and 8B shapes at 64 and 256 clients.
    client_tpot = out_of_step_tpot = tpot
    if plan.continuous_batching and running > 1 and plan.gen_len > 1:
        share = 1.0 if running < plan.batch else 0.5
        client_tpot = (plan.gen_len * tpot + share * prefill_s) / (plan.gen_len - 1)
        # closed-loop clients out of step (each sends its next request when its own ends, and arrivals spread over
        # the round — what a tester's later rounds settle into): every step carries some prompt's prefill, so each
        # request decodes through all of a round's prefill. H200, copt serve's defaults, `copt profile endpoint`
        # 10 s closed loops (bench/gpu_serve_models.py, docs/benchmarks.md, real model sizes): 8B shape 9.64 and
        # 28.8 ms at 64 and 256 clients, 1B 3.49 and 10.7 (predicted 10.8, 29.4, 3.44, 9.65). Their TTFT is then
        # below the in-step figure (0.13–0.46 s against 0.15–1.41 predicted in step) and set by the queue the
        # arrivals keep, which the round model does not give: closed_loop.py replays the loop for it.
        out_of_step_tpot = (plan.gen_len * tpot + prefill_s) / (plan.gen_len - 1)
    figures = {"ttft_s": ttft, "tpot_s": client_tpot, "tpot_out_of_step_s": out_of_step_tpot,
               "decode_step_s": tpot, "tpot_floor_s": floor, "itl_s": tpot,
               "prefill_s": prefill_s, "output_tokens_per_s": out_tps,
               "e2e_s": ttft + max(1, plan.gen_len - 1) * client_tpot,
               "mbu": min(1.0, floor / tpot), "decode_bytes_per_step": decode_bytes,
               "speculative_speedup": spec_speedup, "prefix_hit_rate": hit / plan.prompt_len,
               "running_seqs": running}
    if target.gpu_hour_usd:
        figures["usd_per_million_tokens"] = target.gpu_hour_usd * tp / 3600 / out_tps * 1e6
    assumptions = {"prefill_gemm_efficiency": prefill_gemm_efficiency(spec),
                   "decode_bandwidth_efficiency": cal.DECODE_BANDWIDTH_EFFICIENCY,
                   "hbm_bandwidth_tbs": gpu.hbm_bandwidth / 1e12, "peak_tflops": peak / tp / 1e12}
    assumptions["engine"] = engine_name
    if host_scale != 1.0:
        assumptions["host_loop_ms"] = round(target.host_loop_s * 1e3, 3)
        assumptions["host_work_scale"] = round(host_scale, 3)
    assumptions["sampling"] = (f"sampled (temperature > 0, {sampling_mode(plan, running).replace('_', ' ')})"
                               if plan.temperature > 0 else "greedy")
    notes = []
    if dense_experts:
        assumptions["moe_decode"] = "dense experts (copt's engine below bf16: every expert on every row)"
        notes.append("MoE below bf16: copt serve decodes every expert on every row (CUDA-graph capturable; copt serve "
                     "--dtype bf16 routes through transformers' grouped GEMM and reads only the picked experts)")
    elif spec.is_moe:
        k, experts = spec.experts_per_token, spec.num_experts
        distinct = uniform_distinct_experts(experts, k, running)
        rows = f"{running} row" + "s" * (running != 1)
        assumptions["moe_routing"] = (f"uniform: a decode step of {rows} reads {distinct:.0f} of {experts} experts "
                                      f"per layer ({k} per row); a model that routes unevenly reads fewer")
    if engine:
        assumptions.update({k: v for k, v in engine.items() if v and (spec.num_moe_layers or k != "moe_layer_s")})
    else:
        notes.append(f"{engine_name}: no measured serving overheads; roofline figures (an upper bound)")
    costs = None
    if engine and engine_name == "copt" and plan.continuous_batching and not plan.speculative_tokens:
        first_token_s = engine.get("http_request_s", 0.0)
        from clusteropt_cli.core.serve.runner import (
            PREFILL_GRAPH_BUCKETS,
            PREFILL_GRAPH_MAX_PACKED,
            PREFILL_GRAPH_MAX_TOKENS,
            PREFILL_GRAPH_SEGMENTS,
            PREFILL_GRAPH_VARLEN_SEGMENTS,
        )

        # copt's engine captures prefill graphs where its paged cache is in the model's dtype and no layer slides a
        # window (runner.capture_prefill_graphs). With FlashAttention's variable-length kernel (an NVIDIA GPU of
        # compute capability 8.0 or later, 16-bit weights, head size a multiple of 8 up to 256: runner.
        # varlen_kernel_for) one graph per token bucket takes up to PREFILL_GRAPH_VARLEN_SEGMENTS chunks, resumed
        # ones (a prefix-cache hit, a prompt split over steps) with at most as many cached keys as the bucket's
        # tokens; without it, only new prompts (up to PREFILL_GRAPH_SEGMENTS, PREFILL_GRAPH_MAX_PACKED tokens)
        graphs = plan.kv_layout != "slots" and plan.kv_cache in ("bf16", "fp16") and not spec.num_sliding_layers
        varlen = (target.gpu.vendor == "nvidia" and target.gpu.supports_bf16 and plan.dtype != "fp32"
                  and spec.head_dim % 8 == 0 and spec.head_dim <= 256)

        def graph_bucket(tokens: int, chunks: int, cached: int, masked: bool) -> int | None:
            """The token bucket of the captured prefill graph that runs these chunks (None: eager); `masked`: the
            engine's graphs without the variable-length kernel, whatever the GPU."""
            if not graphs:
                return None
            if varlen and not masked:
                need = max(tokens, cached)
                fits = chunks <= PREFILL_GRAPH_VARLEN_SEGMENTS and need <= PREFILL_GRAPH_MAX_TOKENS
                return next(b for b in PREFILL_GRAPH_BUCKETS if b >= need) if fits else None
            cap = PREFILL_GRAPH_MAX_TOKENS if chunks == 1 else PREFILL_GRAPH_MAX_PACKED
            fits = not cached and chunks <= PREFILL_GRAPH_SEGMENTS and tokens <= cap
            return next(b for b in PREFILL_GRAPH_BUCKETS if b >= tokens) if fits else None

        def unchained(rows: int) -> float:
            """The host's work of a decode step over `rows` sequences that no GPU work hides (cal.UNCHAINED_STEP_*),
            and the engine's own work per step and sequence it exposes there, at the serving host's speed."""
            exposed = (host_scale - 1.0) * (engine["step_fixed_s"] + engine["step_per_seq_s"] * rows)
            return (cal.UNCHAINED_STEP_S + cal.UNCHAINED_STEP_PER_SEQ_S * rows) * host_scale + exposed

        def decode_device(rows: int) -> float:
            """The device's share of a decode step over `rows` sequences: weights and cache read, or its FLOPs."""
            _, floor_s, _, compute = decode_step(rows)
            return max(floor_s / cal.DECODE_BANDWIDTH_EFFICIENCY, compute)

        def mixed_step(rows: int, tokens: int, chunks: int, cached: int, masked: bool) -> tuple[float, bool]:
            """A step of copt's engine that prefills: its decode pass (not chained: its tokens are read and
            emitted before the prefill launches, cal.UNCHAINED_STEP_*), then the prompt chunks — as the captured
            graph of the token bucket that holds them (its padding computed too), or eagerly, at least the host's
            floor (cal.PREFILL_STEP_HOST_*). A variable-length graph costs what a lone prompt's graph does
            (cal.SERVING_ENGINES: its FLOPs or weights, the chain of small kernels per layer on the device, a
            little host work per chunk); a masked one and an eager step the prefill pass with the engine's work
            per prompt on the host. Host-bound: the floor set it, or the host's share of it (the engine's costs
            per step, sequence and prompt) is larger than the device's (weights, cache and FLOPs)."""
            device = host = 0.0
            if rows:
                device = decode_device(rows)
                host = decode_step(rows)[0] - device + unchained(rows)
            bucket = graph_bucket(tokens, chunks, cached + hit * chunks, masked)
            graphed = bucket is not None
            if graphed and varlen and not masked:
                device += (max(prefill_compute_s(bucket, chunks),
                               w_bytes / (bandwidth * cal.DECODE_BANDWIDTH_EFFICIENCY))
                           + spec.num_layers * engine["prefill_graph_layer_s"])
                host += chunks * engine["prefill_graph_request_s"]
                return device + host, host > device
            priced = bucket or tokens
            per_prompt = chunks * engine["prefill_request_s"]
            device += prefill_seconds(priced, chunks) - per_prompt
            host += per_prompt
            floor = 0.0 if graphed else (cal.PREFILL_STEP_HOST_PER_CHUNK_S * chunks
                                         + cal.PREFILL_STEP_HOST_PER_LAYER_S * spec.num_layers) * host_scale
            return max(device + host, floor), floor > device + host or host > device

        def chain_start(rows: int) -> float:
            """A decode chain runs its passes as a two-stage pipeline — the host emits one pass's tokens while the
            GPU runs the next — so its stretch takes one stage more than its passes: the shorter of the host's work
            of an unchained pass (cal.UNCHAINED_STEP_*) and the device's."""
            return min(unchained(rows), decode_device(rows))

        costs = ServeCosts(
            decode_step=lambda rows: decode_step(rows)[0], prefill=prefill_seconds,
            step_tokens=plan.chunked_prefill or engine["prefill_chunk_tokens"], max_running=running,
            prompt_tokens=computed, first_token_s=first_token_s, intake_s=engine.get("api_intake_s", 0.0),
            stream_token_s=engine.get("http_token_s", 0.0), mixed_step=mixed_step, chain_start=chain_start,
            unchained_s=unchained)
    return TimeEstimate(figures, assumptions, notes=notes, costs=costs)
