"""Memory per GPU of a training step or an inference run, term by term from the architecture.

Training activations are the tensors autograd saves for backward, counted the way PyTorch and transformers 5.17
really allocate them for Llama-family decoders (checked on CPU with saved_tensors_hooks, see tests):

* `amp` (torch autocast bf16/fp16 over fp32 weights, copt train with --zero 0): the residual stream stays fp32;
  every linear casts its input to bf16 separately (autocast caches casts of weights, never of activations);
  RMSNorm saves its fp32 input and the fp32 normalized tensor; RoPE saves nothing large (cos/sin do not need
  grad); SDPA (flash/efficient, GQA native) saves bf16 q, k, v, out and the fp32 log-sum-exp; the SwiGLU MLP saves
  gate, up, silu(gate) and their product. The bf16 copies of all weights are held by autocast's cast cache and by
  the linears until backward passes them.
* `half` (weights in bf16/fp16, DeepSpeed ZeRO): the same graph without casts; the norms upcast to fp32 inside.
* `fp32`: no autocast; linears share their input.

Logits: LlamaForCausalLM computes bf16 logits, ForCausalLMLoss upcasts them to fp32 (`logits.float()`) and
cross_entropy saves the fp32 log-softmax; its backward holds the saved output, the incoming gradient and the
result (3 × tokens × vocab × 4 bytes) at once. That phase is usually the peak of a small-model step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from clusteropt_cli.core.advise import calibration as cal
from clusteropt_cli.core.advise.plan import InferPlan, Target, TrainPlan
from clusteropt_cli.modelspec import ModelSpec

# DeepSpeed settings: read from the config copt train writes (core/train/deepspeed_config.py), the one generator
# advise also uses for --emit-ds-config; the buffers below are sized from it (ds_settings).
DS_MAX_REUSE_DISTANCE = 1e9  # stage3_max_reuse_distance, DeepSpeed's default (elements)
DS_MAX_LIVE_PARAMETERS = 1e9  # stage3_max_live_parameters, DeepSpeed's default (elements)


def ds_settings(plan: TrainPlan, world: int = 1) -> dict[str, float]:
    """The ZeRO settings copt train writes for this plan (train's generator), with DeepSpeed's defaults for the
    keys it leaves out: reduce/allgather buckets, overlap, stage-3 prefetch and persistence threshold."""
    from clusteropt_cli.core.train.deepspeed_config import deepspeed_config

    zero = deepspeed_config(train_options(plan), max(1, world))["zero_optimization"]
    return {"reduce_bucket_size": float(zero.get("reduce_bucket_size", 5e8)),
            "allgather_bucket_size": float(zero.get("allgather_bucket_size", 5e8)),
            "overlap_comm": bool(zero.get("overlap_comm", False)),
            "stage3_prefetch_bucket_size": float(zero.get("stage3_prefetch_bucket_size", 5e7)),
            "stage3_param_persistence_threshold": float(zero.get("stage3_param_persistence_threshold", 1e5)),
            "stage3_max_reuse_distance": float(zero.get("stage3_max_reuse_distance", DS_MAX_REUSE_DISTANCE)),
            "stage3_max_live_parameters": float(zero.get("stage3_max_live_parameters", DS_MAX_LIVE_PARAMETERS))}


def train_options(plan: TrainPlan, **extra: object) -> object:
    """A copt train recipe (TrainRecipe, validated) carrying this plan's training options."""
    from clusteropt_cli.recipe.schema.train import TrainRecipe

    values = {"model": "plan", "precision": plan.precision, "micro_batch": plan.micro_batch,
              "grad_accum": plan.grad_accum, "seq_len": plan.seq_len, "optimizer": plan.optimizer, "zero": plan.zero,
              "offload": plan.offload, "activation_checkpointing": plan.activation_checkpointing,
              "nvme_path": "/local_nvme" if plan.offload == "nvme" else None, "loss_impl": plan.loss_impl}
    values.update(extra)
    return TrainRecipe.model_validate(values)


@dataclass
class MemoryEstimate:
    """Predicted memory per GPU; `per_gpu_bytes` is the allocator peak (torch.cuda.max_memory_allocated)."""

    per_gpu_bytes: float
    breakdown: dict[str, float]
    required_bytes: float  # peak + fragmentation + CUDA context: what must fit
    budget_bytes: float | None
    fits: bool | None
    peak_phase: str
    model_states_bytes: float
    phases: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    deepspeed_buffers: dict[str, dict[str, float]] = field(default_factory=dict)  # phase → named buffer → bytes

    @property
    def headroom_bytes(self) -> float | None:
        return None if self.budget_bytes is None else self.budget_bytes - self.required_bytes


def training_mode(plan: TrainPlan) -> str:
    """How the weights are held: `amp` (fp32 + autocast), `half` (DeepSpeed bf16/fp16), `fp32`."""
    if plan.precision == "fp32":
        return "fp32"
    return "half" if plan.uses_deepspeed else "amp"


# ---- activations --------------------------------------------------------------------------------------------
def _attention_saved(spec: ModelSpec, mode: str, attn: str, seq_len: int, tp: int) -> float:
    """Bytes per token per layer saved by the attention block (after the input norm)."""
    h, nh = spec.hidden_size, spec.num_heads
    a = 4 if mode == "fp32" else 2  # dtype of q/k/v/out
    q = spec.q_width / tp
    kv = spec.kv_width / tp
    vdim = nh * (spec.v_head_dim or spec.head_dim) / tp
    heads = nh / tp
    lse = 4 * heads
    if spec.is_mla:
        ql, kl = spec.q_lora_rank, spec.kv_lora_rank
        inputs = (2 * 2 * h) if mode == "amp" else (a * h)
        latents = (8 + a) * ql + (8 + a) * kl  # fp32 norm in/out + projection input per latent
        core = a * (q + q + vdim + vdim) + 4 * q  # q, k (full heads), v, out; fp32 rope'd q/k concat
        return inputs + latents + core + lse
    if mode == "amp":
        inputs = 3 * 2 * h  # q/k/v each cast the normed input
    elif mode == "fp32":
        inputs = 4 * h
    else:
        inputs = 2 * h
    if spec.model_type in ("qwen3", "qwen3_moe"):  # per-head q/k RMSNorm: fp32 input + normalized
        inputs += 8 * (q + kv)
    if attn == "eager":
        # q, repeated k and v, o_proj input; softmax output (fp32) and, under autocast, its bf16 copy
        probs = (6 if mode != "fp32" else 4) * heads * seq_len
        return inputs + a * 4 * q + probs
    if spec.model_type == "gpt2":
        return inputs + a * (3 * q + q) + lse  # q, k, v are views of one qkv tensor; out shared with c_proj input
    return inputs + a * (q + 2 * kv + vdim) + lse  # o_proj input shares storage with the SDPA output


def _mlp_saved(spec: ModelSpec, mode: str, tp: int, moe: bool) -> float:
    """Bytes per token per layer saved by the MLP (or MoE) block."""
    h = spec.hidden_size
    a = 4 if mode == "fp32" else 2

    def swiglu(width: float, separate_casts: int) -> float:
        cast = 2 * h * separate_casts if mode == "amp" else a * h
        return cast + 4 * a * width / tp  # gate, up, silu(gate), product

    if spec.model_type == "gpt2":
        inner = spec.intermediate_size / tp
        return (2 * h if mode == "amp" else a * h) + a * inner * 8  # c_fc out, gelu_new intermediates, c_proj in
    if not moe:
        return swiglu(spec.intermediate_size, 2)
    k = spec.experts_per_token
    routed = k * (swiglu(spec.moe_intermediate_size, 1) + a * h)  # per chosen expert + routing-weighted output
    router = (2 * h if mode == "amp" else 0) + 4 * spec.num_experts
    shared = swiglu(spec.shared_expert_intermediate_size, 2) if spec.shared_expert_intermediate_size else 0
    return router + routed + shared


def compiled_layer_bytes_per_token(spec: ModelSpec, mode: str, tp: int, fp8: bool = False) -> float | None:
    """Bytes per token a torch.compile'd Llama-family decoder layer saves for backward, or None where the compiled
    form is not modelled (MLA, GPT-2, eager attention: the eager count applies).

    Inductor's partitioner keeps the smallest set backward needs and recomputes cheap pointwise ops from it: per
    norm its input (the residual stream, fp32 under autocast) and the one bf16 cast of its output that the
    projections share; q, k, v after RoPE, the attention output and its log-sum-exp; gate, up and their SwiGLU
    product. The bf16 casts of the weights are saved too (counted in train_memory, not here). torchao's Float8Linear
    saves the inputs of the linears in fp8 instead (1 byte). COMPILED_ACTIVATION_FACTOR scales the set to the H200
    measurements (calibration.py).
    """
    if spec.is_mla or spec.model_type == "gpt2":
        return None
    h = spec.hidden_size
    a = 4 if mode == "fp32" else 2
    r = 2 if mode == "half" else 4  # residual stream dtype
    lin_in = 1 if fp8 else a  # a linear's saved input
    q, kv = spec.q_width / tp, spec.kv_width / tp
    vdim = spec.num_heads * (spec.v_head_dim or spec.head_dim) / tp
    heads = spec.num_heads / tp
    attn = r * h + 4 + lin_in * h + a * (q + 2 * kv) + lin_in * vdim + 4 * heads
    if spec.model_type in ("qwen3", "qwen3_moe"):
        attn += 4 * (q + kv) / 1  # per-head q/k norms keep their fp32 inputs
    inter = spec.intermediate_size / tp
    mlp = r * h + 4 + lin_in * h + a * 2 * inter + lin_in * inter
    factor = cal.COMPILED_ACTIVATION_FACTOR["fp8" if fp8 else "default"]
    return (attn + mlp) * factor


def activation_bytes_per_token(spec: ModelSpec, plan: TrainPlan, compiled: bool = False,
                               loss: str = "hf") -> dict[str, float]:
    """Saved bytes per token: per dense layer, per MoE layer, the layer input (checkpointing), the final block.

    `compiled`: the decoder runs under torch.compile (compiled_layer_bytes_per_token for its dense layers);
    `loss`: "fused" (copt train's chunked head + cross-entropy: the final hidden states, their reshaped copy and
    the gradient the loss computes for them) or "hf" (the lm_head's saved input; logits counted apart).
    """
    mode = training_mode(plan)
    h = spec.hidden_size
    norm = 6 * h if mode == "half" else 8 * h  # RMSNorm/LayerNorm input + normalized (fp32)
    small = 8  # rsqrt / mean+rstd
    attn = _attention_saved(spec, mode, plan.attn, plan.seq_len, plan.tp)
    dense = 2 * (norm + small) + attn + _mlp_saved(spec, mode, plan.tp, moe=False)
    compiled_dense = compiled_layer_bytes_per_token(spec, mode, plan.tp, fp8=plan.precision == "fp8") \
        if compiled and plan.attn != "eager" else None
    if compiled_dense is not None:
        dense = compiled_dense
    moe = 2 * (norm + small) + attn + _mlp_saved(spec, mode, plan.tp, moe=True) if spec.is_moe else 0.0
    residual = 2 if mode == "half" else 4
    if loss == "fused":
        hidden = 2 if mode == "half" else 4  # the final norm's output: fp32 under autocast
        # final norm's input (+ its output under eager), the [:, :-1] reshaped copy, the loss's gradient for it
        final = (residual * h + 4 if compiled else norm + small) + 2 * hidden * h + 16
    else:
        lm_input = 4 * h if mode == "fp32" else 2 * h  # the lm_head's saved input (a cast under autocast)
        final = norm + small + lm_input + 8  # final norm, lm_head input, int64 labels
    return {"dense_layer": dense, "moe_layer": moe, "layer_input": residual * h, "final": final}


def fused_loss_bytes(spec: ModelSpec, mode: str, tokens: float, tp: int, chunk_tokens: int | None) -> dict[str, float]:
    """Buffers of copt train's fused chunked loss (core/train/losses.py) beyond the per-token `final` term.

    forward: the fp32 gradient of the head weight (V × h, accumulated chunk by chunk), the head weight cast to the
    compute dtype (under autocast; DeepSpeed's bf16 weight needs none) and one chunk's logits, their gradient and
    the kernel's temporaries (FUSED_LOSS_BYTES_PER_CHUNK_LOGIT, measured).
    backward: the saved fp32 head gradient and its scaled copy (cast to the weight's dtype).
    """
    vocab = spec.vocab_size / tp
    head = vocab * spec.hidden_size
    chunk = chunk_tokens or max(256, 2**30 // (4 * spec.vocab_size))
    chunk = min(chunk, tokens)
    weight_cast = 2 * head if mode == "amp" else 0.0
    fwd = 4 * head + weight_cast + cal.FUSED_LOSS_BYTES_PER_CHUNK_LOGIT * chunk * vocab
    scaled = 4 * head + (2 * head if mode == "half" else 0.0)
    bwd = 4 * head + scaled
    return {"forward": fwd, "backward": bwd, "saved": 4 * head, "logits": 0.0}


def _logits_bytes(spec: ModelSpec, mode: str, tokens: float, tp: int) -> dict[str, float]:
    vocab = spec.vocab_size / tp  # vocab-parallel head under TP
    half = 2 * vocab * tokens
    full = 4 * vocab * tokens
    held = (half if mode != "fp32" else full) if cal.LOGITS_HELD_IN_BACKWARD else 0.0
    # forward at log_softmax: logits (model dtype) + fp32 upcast + fp32 log-softmax output
    fwd = (half + full + full) if mode != "fp32" else (full + full)
    bwd = held + 3 * full
    return {"forward": fwd, "backward": bwd, "saved": full, "logits": half if mode != "fp32" else full}


# ---- model states -------------------------------------------------------------------------------------------
def model_states(num_params: float, precision: str, optimizer: str, zero: int, dp: int, offload: str = "none",
                 deepspeed: bool | None = None) -> dict[str, float]:
    """Bytes per GPU of weights, gradients and optimizer states (ZeRO partitioning over `dp` ranks).

    DeepSpeed layout (zero ≥ 1, bf16/fp16): 2 + 2 + 12 bytes/param (fp32 master + Adam m, v) = 16 (ZeRO paper).
    torch autocast layout (zero 0): fp32 weights 4 + fp32 grads 4 + Adam 8 = 16 as well.
    """
    ds = zero > 0 if deepspeed is None else deepspeed
    half = precision != "fp32"
    opt_per_param = {"adamw": 8.0, "adamw-8bit": 2.0, "sgd": 4.0}[optimizer]
    if ds and half:
        w, g, o = 2.0, 2.0, 4.0 + opt_per_param
    else:
        w, g, o = 4.0, 4.0, opt_per_param
    if precision == "fp8" and not ds:
        w += 1.0  # fp8 weight copies (TransformerEngine / torchao keep them alongside the fp32 master)
    weights, grads, optim = w * num_params, g * num_params, o * num_params
    if zero >= 1:
        optim /= dp
    if zero >= 2:
        grads /= dp
    if zero >= 3:
        weights /= dp
    if offload != "none":
        optim = 0.0  # optimizer states and fp32 master weights live on the host / NVMe
        if zero >= 2:
            grads = 0.0  # gradient partitions are copied to the host as they are reduced (buckets only on GPU)
        if zero >= 3:
            weights = 0.0  # offload_param: parameters stream in per layer
    return {"weights": weights, "gradients": grads, "optimizer": optim}


def _zero3_gathered_at_loss(spec: ModelSpec, plan: TrainPlan, layer_params: float,
                            cfg: dict[str, float] | None = None) -> float:
    """Elements ZeRO-3 still holds gathered when the loss runs (after the lm_head's forward).

    PartitionedParameterCoordinator.__params_to_release (deepspeed 0.19.8) keeps a module's parameters gathered
    when they recur within the next stage3_max_reuse_distance elements of the recorded module trace. The trace
    here is per decoder layer: forward embed, layers 0..n-1, final norm, head; backward head, norm, then per layer
    (its checkpointed re-forward and) its backward. With a tied head the embedding matrix is the head's weight.
    The total is capped at stage3_max_live_parameters.
    """
    cfg = cfg or ds_settings(plan)
    n = spec.num_layers
    embed = spec.embedding_params / plan.tp
    head = embed if spec.tie_word_embeddings else spec.vocab_size * spec.hidden_size / plan.tp
    embed_name = "head" if spec.tie_word_embeddings else "embed"  # tied: one Parameter, one gathered tensor
    fwd = [(embed_name, embed)] + [(f"L{i}", layer_params) for i in range(n)] + [("head", head)]
    bwd: list[tuple[str, float]] = [("head", head)]
    for i in reversed(range(n)):
        bwd += [(f"L{i}", layer_params)] * (2 if plan.activation_checkpointing else 1)
    bwd.append((embed_name, embed))
    trace = fwd + bwd
    loss_at = len(fwd) - 1
    last_use = {name: pos for pos, (name, _) in enumerate(trace[:loss_at + 1])}
    kept = {"head": head}  # in use at the loss
    for name, pos in last_use.items():
        traversed = 0.0
        for later_name, later_numel in trace[pos + 1:]:
            if traversed >= cfg["stage3_max_reuse_distance"]:
                break
            if later_name == name:
                kept[name] = trace[pos][1]
                break
            traversed += later_numel
    return min(sum(kept.values()), cfg["stage3_max_live_parameters"])


def deepspeed_terms(spec: ModelSpec, plan: TrainPlan, dp: int) -> dict[str, dict[str, float]]:
    """Named DeepSpeed 0.19.8 buffers (bytes per GPU) live in each phase of a steady-state step, beyond the
    model states of `model_states` (bit16 weights or their partition, fp32 master partition, Adam moments).

    Read from deepspeed/runtime/zero/stage_1_and_2.py and stage3.py for the config copt train writes (ds_settings)
    (bf16/fp16, grad_accum_dtype unset = the model dtype, overlap_comm, contiguous_gradients): copt train's config:

    ZeRO-1/2 (DeepSpeedZeroOptimizer):
      * `ipg_buckets`: setup_buckets() allocates at the first gradient hook of each backward
        2 (overlap_comm) × reduce_bucket_size elements of the model dtype; _release_ipg_buffers() drops them at
        the backward epilogue. Not live at the loss.
      * `grads_in_partition`: copy_grads_in_partition() copies this rank's gradients into one contiguous tensor of
        its partition (model dtype, params/dp) during backward; held as averaged_gradients until step() frees it.
        ZeRO-1 with overlap_comm reduces in the hooks like ZeRO-2, so it holds the same partition, not full grads.
      * step(): flatten(averaged_gradients) (model dtype, params/dp) next to that partition, then its fp32 copy
        `single_grad_partition` (4 × params/dp) set as the fp32 master's grad; DeepSpeed AdamW updates in place.
      * with gradient accumulation the un-reduced gradients persist between micro-steps (ZeRO-1: full param.grad,
        ZeRO-2: the partition) — `model_states`' gradients term.
    ZeRO-3 (DeepSpeedZeroOptimizer_Stage3):
      * `grad_partitions_flat_buffer`: zeros of params/dp in the model dtype, allocated at init, always live.
      * `ipg_bucket`: one reduce_bucket_size buffer of the model dtype, allocated at init, always live.
      * `gathered_params`: full parameters held by the coordinator (the head and the last layers that recur within
        stage3_max_reuse_distance, see _zero3_gathered_at_loss), the prefetch bucket (stage3_prefetch_bucket_size)
        and parameters under stage3_param_persistence_threshold (the norms), which are never partitioned.
      * step: the fp32 gradient partition of the sub-group (4 × params/dp).
    """
    cfg = ds_settings(plan, dp)
    lp = 4.0 if plan.precision == "fp32" else 2.0
    part = _local_params(spec, plan) / dp
    offload = plan.offload != "none"
    head = 0 if spec.tie_word_embeddings else spec.vocab_size * spec.hidden_size
    layer_params = max(0.0, (spec.num_params - spec.embedding_params - head) / spec.num_layers) / plan.tp
    terms: dict[str, dict[str, float]] = {"loss": {}, "end-of-backward": {}, "optimizer-step": {}}
    if plan.zero in (1, 2):
        buckets = (2 if cfg["overlap_comm"] else 1) * cfg["reduce_bucket_size"] * lp
        grads_part = 0.0 if offload else lp * part
        terms["end-of-backward"] = {"ipg_buckets": buckets, "grads_in_partition": grads_part}
        if not offload:
            terms["optimizer-step"] = {"grads_in_partition": grads_part, "flat_grad_partition": lp * part,
                                       "fp32_grad_partition": 4.0 * part}
    elif plan.zero >= 3:
        persistent = (2 * spec.num_layers + 1) * spec.hidden_size * lp  # the RMSNorm/LayerNorm weights
        if spec.hidden_size >= cfg["stage3_param_persistence_threshold"]:
            persistent = 0.0
        always = {"grad_partitions_flat_buffer": 0.0 if offload else lp * part,
                  "ipg_bucket": cfg["reduce_bucket_size"] * lp,
                  "persistent_params": persistent}
        prefetch = cfg["stage3_prefetch_bucket_size"] * lp
        terms["loss"] = {**always, "gathered_params": _zero3_gathered_at_loss(spec, plan, layer_params, cfg) * lp,
                         "prefetch_bucket": prefetch}
        terms["end-of-backward"] = {**always, "gathered_params": layer_params * lp, "prefetch_bucket": prefetch}
        terms["optimizer-step"] = {**always, **({} if offload else {"fp32_grad_partition": 4.0 * part})}
    return terms


def _local_params(spec: ModelSpec, plan: TrainPlan) -> float:
    return spec.num_params / (plan.tp * plan.pp)


def train_memory(spec: ModelSpec, plan: TrainPlan, target: Target) -> MemoryEstimate:
    """Per-GPU peak of a training step, by phase (loss forward, loss backward, end of backward)."""
    mode = training_mode(plan)
    dp = max(1, target.world // (plan.tp * plan.pp))
    local = _local_params(spec, plan)
    states = model_states(local, plan.precision, plan.optimizer, plan.zero, dp, plan.offload)
    notes: list[str] = []

    # DeepSpeed working buffers, per phase (deepspeed_terms)
    ds = deepspeed_terms(spec, plan, dp) if plan.uses_deepspeed else None
    buffers = 0.0
    if ds is not None:
        cfg = ds_settings(plan, dp)
        notes.append(f"DeepSpeed 0.19.8 buffers for the config copt train writes (reduce_bucket_size "
                     f"{cfg['reduce_bucket_size']:.0e}, overlap_comm"
                     + (f", prefetch {cfg['stage3_prefetch_bucket_size']:.0e}, persistence "
                        f"{cfg['stage3_param_persistence_threshold']:.0e})" if plan.zero >= 3 else ")"))

    # what copt train runs for this plan on this device (its own rules): compiled decoder? fused loss?
    compiled = plan.runs_compiled(target.device)
    loss = plan.loss(spec)
    notes.append(f"this plan as copt train runs it: {'compiled' if compiled else 'eager'} decoder, "
                 f"{'fused chunked' if loss == 'fused' else 'the model’s own (fp32 logits)'} loss")

    # activations
    per_token = activation_bytes_per_token(spec, plan, compiled, loss)
    tokens = plan.sequences_per_micro_batch * plan.seq_len  # one forward/backward's
    layers_local = spec.num_layers / plan.pp
    moe_frac = spec.num_moe_layers / spec.num_layers
    full_layer = (1 - moe_frac) * per_token["dense_layer"] + moe_frac * per_token["moe_layer"]
    in_flight = 1
    if plan.pp > 1:
        m = plan.micro_batches_per_step
        in_flight = min(plan.pp, m)  # 1F1B: stage 0 holds up to p micro-batches
        notes.append(f"pipeline stage 0 holds {in_flight} micro-batches of activations (1F1B)")
    if plan.activation_checkpointing:
        stored = layers_local * per_token["layer_input"] * tokens * in_flight
        recompute = full_layer * tokens
    else:
        stored = layers_local * full_layer * tokens * in_flight
        recompute = 0.0
    final = per_token["final"] * tokens
    logits = _logits_bytes(spec, mode, tokens, plan.tp) if loss == "hf" else \
        fused_loss_bytes(spec, mode, tokens, plan.tp, plan.loss_chunk_tokens)
    # bf16 weight copies made by autocast (matmul weights; kept by the cast cache and the linears' saved inputs).
    # A compiled decoder saves the decoder layers' casts for backward too (its partitioner keeps the 2-byte cast
    # rather than the 4-byte weight; H200: the 1B, 3B and 8B peaks, calibration.COMPILED_ACTIVATION_FACTOR), except
    # under checkpointing (each layer recomputes its casts) and fp8 (the fp32 weights reach Float8Linear; its fp8
    # copies are in model_states). The fused loss counts its own head cast.
    matmul_local = spec.matmul_params_active / (plan.tp * plan.pp) if not spec.is_moe else local
    head_params = spec.vocab_size * spec.hidden_size / plan.tp
    head_cast = 2 * head_params if mode == "amp" and loss == "hf" else 0.0
    untied_head = 0.0 if spec.tie_word_embeddings else spec.vocab_size * spec.hidden_size
    layer_matmul = max(0.0, spec.num_params - spec.embedding_params - untied_head) / (plan.tp * plan.pp)  # all experts
    compiled_casts = 2 * layer_matmul if plan.precision != "fp8" and not plan.activation_checkpointing else 0.0
    casts = (head_cast + compiled_casts if compiled else 2 * matmul_local) if mode == "amp" else 0.0
    layer_casts = 2 * local / max(1.0, layers_local) if mode == "amp" and not compiled else 0.0
    if plan.zero >= 3:
        casts = head_cast = 0.0  # ZeRO-3 gathers bf16 params per layer (in the buffers above)

    if ds is not None:
        return _deepspeed_phases(states, ds, plan, stored, final, recompute, layers_local, logits, target, notes)
    grads_resident = states["gradients"] if plan.grad_accum > 1 else 0.0
    base = states["weights"] + states["optimizer"] + grads_resident + buffers
    phases = {
        "loss-forward": base + stored + final + casts + logits["forward"],
        "loss-backward": base + stored + final + (head_cast if plan.activation_checkpointing else casts)
        + logits["backward"],
        "end-of-backward": states["weights"] + states["optimizer"] + states["gradients"] + buffers
        + (recompute + stored / max(1.0, layers_local) if plan.activation_checkpointing else 0.0) + layer_casts,
    }
    if spec.tie_word_embeddings and plan.pp == 1:
        # the embedding's backward makes a dense V × h gradient and adds it to the tied weight's (the head's) grad.
        # Compiled, the embedding lookup is inside the decoder's graph and its backward runs in the same backward
        # graph as the first layer's, whose activations are still held then (H200, checkpointing: 1B and 3B shapes
        # within 0.3% with them, −2.8% and −1.7% without)
        first_layer = 0.0
        if compiled:
            first_layer = recompute + stored / max(1.0, layers_local) if plan.activation_checkpointing \
                else full_layer * tokens
        phases["embedding-backward"] = states["weights"] + states["optimizer"] + states["gradients"] + buffers \
            + (4.0 if mode != "half" else 2.0) * spec.vocab_size * spec.hidden_size / plan.tp + first_layer
    peak_phase = max(phases, key=phases.get)
    peak = phases[peak_phase]
    if peak_phase == "loss-forward":
        act, lg, wcast, grads = stored + final, logits["forward"], casts, grads_resident
    elif peak_phase == "loss-backward":
        act, lg = stored + final, logits["backward"]
        wcast = head_cast if plan.activation_checkpointing else casts
        grads = grads_resident
    elif peak_phase == "end-of-backward":
        act = recompute + (stored / max(1.0, layers_local) if plan.activation_checkpointing else 0.0)
        lg, wcast, grads = 0.0, layer_casts, states["gradients"]
    else:  # embedding-backward: the tied embedding's dense gradient, counted with the gradients
        act, lg, wcast = first_layer, 0.0, 0.0
        grads = phases[peak_phase] - states["weights"] - states["optimizer"] - buffers - first_layer
    breakdown = {
        "weights": states["weights"], "gradients": grads, "optimizer": states["optimizer"],
        "activations": act, "logits": lg, "kv_cache": 0.0, "autocast_weight_copies": wcast, "buffers": buffers,
    }
    if abs(sum(breakdown.values()) - peak) > 1:  # keep the breakdown honest
        breakdown["activations"] += peak - sum(breakdown.values())
    model_states_total = states["weights"] + states["gradients"] + states["optimizer"]
    return _finish(peak, breakdown, target, peak_phase, model_states_total, phases, notes)


_GRADIENT_TERMS = ("grads_in_partition", "grad_partitions_flat_buffer", "flat_grad_partition",
                   "fp32_grad_partition")


def _deepspeed_phases(states: dict[str, float], ds: dict[str, dict[str, float]], plan: TrainPlan, stored: float,
                      final: float, recompute: float, layers_local: float, logits: dict[str, float],
                      target: Target, notes: list[str]) -> MemoryEstimate:
    """Phases of a DeepSpeed step: model states + the named buffers live in each phase (deepspeed_terms).

    Under ZeRO-3 copt train builds the model partitioned (deepspeed.zero.Init): no whole copy on the GPU at start.

    At the loss of a steady-state step no gradient exists (step() freed the partition, zero_grad() the rest)
    unless gradients accumulate over micro-steps; the ZeRO-1/2 buckets are allocated by the first gradient hook.
    """
    resident = states["weights"] + states["optimizer"]
    accumulating = states["gradients"] if plan.grad_accum > 1 and plan.zero in (1, 2) else 0.0
    last_layer = recompute + (stored / max(1.0, layers_local) if plan.activation_checkpointing else 0.0)
    acts = {"loss-forward": (stored + final, logits["forward"]), "loss-backward": (stored + final, logits["backward"]),
            "end-of-backward": (last_layer, 0.0), "optimizer-step": (0.0, 0.0)}
    live = {"loss-forward": ds["loss"], "loss-backward": ds["loss"], "end-of-backward": ds["end-of-backward"],
            "optimizer-step": ds["optimizer-step"]}
    phases = {name: resident + sum(act) + sum(live[name].values()) + (accumulating if name.startswith("loss") else 0)
              for name, act in acts.items()}
    peak_phase = max(phases, key=phases.get)
    terms = live[peak_phase]
    grads = sum(v for k, v in terms.items() if k in _GRADIENT_TERMS)
    grads += accumulating if peak_phase.startswith("loss") else 0.0
    breakdown = {
        "weights": states["weights"], "gradients": grads, "optimizer": states["optimizer"],
        "activations": acts[peak_phase][0], "logits": acts[peak_phase][1], "kv_cache": 0.0,
        "autocast_weight_copies": 0.0,
        "buffers": sum(v for k, v in terms.items() if k not in _GRADIENT_TERMS),
    }
    model_states_total = states["weights"] + states["gradients"] + states["optimizer"]
    estimate = _finish(phases[peak_phase], breakdown, target, peak_phase, model_states_total, phases, notes)
    estimate.deepspeed_buffers = {name: dict(t) for name, t in ds.items()}
    return estimate


def host_train_memory(spec: ModelSpec, plan: TrainPlan, target: Target) -> dict[str, object]:
    """Host RAM per node a copt train run of `plan` needs, and NVMe space for ZeRO-Infinity.

    Every rank loads the model's fp32 weights on the host before handing them to the GPU or DeepSpeed (`load`;
    not under ZeRO-3, which builds each parameter partitioned, onto the host with offload, by deepspeed.zero.Init);
    ZeRO-Offload then keeps DeepSpeed's pinned buffers there (`offload`: fp32 masters, Adam moments, fp32 gradient
    partitions and, under ZeRO-3, the 16-bit parameters: calibration.OFFLOAD_HOST_BYTES_PER_PARAM), each rank its
    share. The peak is the larger of the two (the loaded copy is on the GPU before the buffers are allocated) plus
    each rank's process (calibration.HOST_PROCESS_BYTES). `fits` is None when the host's RAM is unknown (a catalog
    GPU without --host-memory)."""
    ranks = target.gpus_per_node
    n = float(spec.num_params)
    share = n * ranks / max(1, target.world)  # parameters whose states this node's ranks hold
    load = 0.0 if plan.zero >= 3 else 4.0 * n * ranks
    offload, nvme = 0.0, 0.0
    if plan.offload == "cpu":
        offload = cal.OFFLOAD_HOST_BYTES_PER_PARAM["cpu-zero3" if plan.zero >= 3 else "cpu"] * share
    elif plan.offload == "nvme":
        offload = cal.OFFLOAD_HOST_BYTES_PER_PARAM["nvme"] * share
        nvme = cal.OFFLOAD_NVME_BYTES_PER_PARAM["zero3" if plan.zero >= 3 else "other"] * share
    process = cal.HOST_PROCESS_BYTES * ranks
    peak = max(load, offload) + process
    budget = target.host_memory_bytes
    return {"peak_bytes": peak, "terms": {"model_load": load, "offload_buffers": offload, "processes": process},
            "nvme_bytes": nvme, "budget_bytes": budget, "fits": None if budget is None else peak <= budget}


def cpu_training_bytes(spec: ModelSpec, plan: TrainPlan) -> dict[str, float]:
    """The CPU 'peak' quantity (docs/advise.md): states (params+grads+optimizer) + saved tensors + logits buffers.

    Saved tensors are unique non-parameter storages saved for backward during the forward (autocast weight copies
    and the fp32 log-softmax included); logits buffers are the logits tensor the model returns plus, when it is not
    fp32, the fp32 upcast made by the loss.
    """
    mode = training_mode(plan)
    states = model_states(spec.num_params, plan.precision, plan.optimizer, 0, 1, deepspeed=False)
    states["gradients"] = 4.0 * spec.num_params  # counted in full on CPU
    tokens = plan.micro_batch * plan.seq_len
    moe_frac = spec.num_moe_layers / spec.num_layers
    head = spec.vocab_size * spec.hidden_size
    if plan.loss(spec) == "fused":  # copt train's default loss: no logits tensor, no head linear
        per_token = activation_bytes_per_token(spec, plan, loss="hf")  # the layers are the same
        layer = (1 - moe_frac) * per_token["dense_layer"] + moe_frac * per_token["moe_layer"]
        if plan.activation_checkpointing:
            layer = per_token["layer_input"]
        # the final norm's saved tensors, then what the fused loss saves: the gradient for the (shifted) hidden
        # states in their dtype and the fp32 gradient of the head weight
        hidden = 4.0 if mode != "half" else 2.0
        final = per_token["final"] - (4 * spec.hidden_size if mode == "fp32" else 2 * spec.hidden_size) - 8
        shifted = plan.micro_batch * (plan.seq_len - 1)
        saved = spec.num_layers * layer * tokens + final * tokens + hidden * spec.hidden_size * shifted + 4 * head
        if mode == "amp":  # autocast weight copies saved by the decoder's linears (none under checkpointing)
            saved += 0.0 if plan.activation_checkpointing else 2 * (spec.matmul_params_active
                                                                    - (head if spec.tie_word_embeddings else 0))
        chunk = min(plan.loss_chunk_tokens or max(256, 2**30 // (4 * spec.vocab_size)), shifted)
        buffers = chunk * spec.vocab_size * (4.0 if mode == "fp32" else 2.0 + 4.0)  # one chunk + its fp32 copy
        total = sum(states.values()) + saved + buffers
        return {"model_states": sum(states.values()), "saved_tensors": saved, "logits_buffers": buffers,
                "peak_mem_bytes": total}
    per_token = activation_bytes_per_token(spec, plan)
    layer = (1 - moe_frac) * per_token["dense_layer"] + moe_frac * per_token["moe_layer"]
    if plan.activation_checkpointing:
        layer = per_token["layer_input"]
    logits = _logits_bytes(spec, mode, tokens, 1)
    saved = spec.num_layers * layer * tokens + per_token["final"] * tokens + logits["saved"]
    if mode == "amp":  # autocast weight copies saved by the linears (only the head's under checkpointing)
        saved += 2 * (head if plan.activation_checkpointing else spec.matmul_params_active)
    buffers = logits["logits"] + (4 * spec.vocab_size * tokens if mode != "fp32" else 0.0)
    total = sum(states.values()) + saved + buffers
    return {"model_states": sum(states.values()), "saved_tensors": saved, "logits_buffers": buffers,
            "peak_mem_bytes": total}


# ---- inference ----------------------------------------------------------------------------------------------
def embedding_value_bytes(weights: str) -> float:
    """Bytes per embedding (and lm_head) value: the checkpoint's own in 16/32-bit ones; quantized formats keep them in
    bf16 (llm-compressor's default)."""
    return cal.WEIGHT_BYTES[weights] if weights in ("bf16", "fp16", "fp32") else 2.0


def weight_bytes(spec: ModelSpec, weights: str) -> float:
    """Weights in memory; quantized formats keep embeddings and lm_head in bf16 (embedding_value_bytes)."""
    per = cal.WEIGHT_BYTES[weights]
    if weights in ("bf16", "fp16", "fp32"):
        return spec.num_params * per
    head = 0 if spec.tie_word_embeddings else spec.vocab_size * spec.hidden_size
    kept = spec.embedding_params + head
    return (spec.num_params - kept) * per + kept * embedding_value_bytes(weights)


def window_slack(plan: InferPlan) -> int:
    """Tokens a sliding-window layer holds beyond its window: none under vLLM (hybrid KV cache manager) and
    transformers' generate (sliding cache layers); copt's own engine keeps a ring of the window plus one prefill
    chunk (core/serve/attention.py: RING_SLACK - 1)."""
    if plan.continuous_batching and plan.engine == "copt":
        from clusteropt_cli.core.serve.attention import RING_SLACK

        return RING_SLACK - 1
    return 0


def kv_cache_bytes(spec: ModelSpec, plan: InferPlan, tokens_per_seq: float | None = None) -> float:
    """KV cache of the plan's batch (per GPU): per layer min(window (+ the engine's slack), context) tokens on
    sliding-window layers, the whole context on full-attention layers."""
    shard = min(plan.tp, spec.num_kv_heads) if not spec.is_mla else 1
    ctx = plan.prompt_len + plan.gen_len if tokens_per_seq is None else tokens_per_seq
    per_seq = spec.kv_cache_bytes_per_seq(ctx, cal.KV_BYTES[plan.kv_cache], window_slack=window_slack(plan))
    return plan.batch * per_seq / shard


def _prefill_working_set(spec: ModelSpec, plan: InferPlan) -> float:
    """Largest transient buffers of one prefill forward (no grad, bf16): residual, normed, MLP triplet."""
    tokens = plan.batch * plan.prompt_len
    if plan.chunked_prefill:
        tokens = min(tokens, plan.chunked_prefill)
    elif plan.continuous_batching:  # an engine prefills at most its per-step token budget (vLLM: 8,192)
        tokens = min(tokens, cal.SERVING_ENGINES["copt"]["prefill_chunk_tokens"] if plan.engine == "copt" else 8192)
    h = spec.hidden_size
    inter = (spec.moe_intermediate_size * spec.experts_per_token if spec.is_moe else spec.intermediate_size)
    attn = 2 * (2 * spec.q_width + 2 * spec.kv_width) / plan.tp
    mlp = 3 * 2 * inter / plan.tp
    per_token = 3 * 2 * h + max(attn, mlp) + 4  # residual, normed input, block output + the larger block
    last_logits = plan.batch * spec.vocab_size * (2 + 4)  # generate keeps only the last position, upcast to fp32
    return tokens * per_token + last_logits


def infer_memory(spec: ModelSpec, plan: InferPlan, target: Target) -> MemoryEstimate:
    # as the engine holds them: copt's engine dequantizes int4/int8 checkpoints to the model dtype at load
    weights = weight_bytes(spec, plan.served_weights) / plan.tp
    kv = kv_cache_bytes(spec, plan)
    from clusteropt_cli.core.advise.timing import prefix_hit_tokens

    hit = prefix_hit_tokens(spec, plan)
    if hit and plan.batch > 1:  # the shared prefix's blocks are stored once, not once per sequence
        kv -= (plan.batch - 1) * kv_cache_bytes(spec, plan.with_(batch=1), hit)
    work = _prefill_working_set(spec, plan)
    layer_kv = kv / spec.num_layers  # a DynamicCache update concatenates one layer's cache into a new tensor
    decode = layer_kv + plan.batch * spec.vocab_size * 6
    act = max(work, decode)
    peak = weights + kv + act
    breakdown = {"weights": weights, "gradients": 0.0, "optimizer": 0.0, "activations": act, "logits": 0.0,
                 "kv_cache": kv, "autocast_weight_copies": 0.0, "buffers": 0.0}
    phase = "prefill" if work >= decode else "decode"
    return _finish(peak, breakdown, target, phase, weights, {"prefill": weights + kv + work,
                                                             "decode": weights + kv + decode}, [])


def max_concurrent_seqs(spec: ModelSpec, plan: InferPlan, target: Target) -> int | None:
    """Sequences of prompt+gen tokens the serving engine runs at once: its KV cache (paged, with the plan's shared
    prefix stored once) within --max-batch-size (serving_capacity); None when the memory is unknown."""
    cap = serving_capacity(spec, plan, target)
    return None if cap is None else cap.max_concurrent_seqs


@dataclass
class ServingCapacity:
    """How a serving engine sizes its KV cache for a plan, and how many of the plan's sequences it then runs."""

    engine: str  # "copt" or "vllm"
    layout: str  # "paged" (a block pool) or "slots" (one max_model_len slot per sequence)
    bytes_per_token: float  # KV bytes per token (per GPU)
    capacity_tokens: int  # paged: num_blocks × block_size; slots: slots × slot length
    block_size: int
    num_blocks: int | None  # paged only
    max_model_len: int | None  # the engine's max_model_len (copt: given or its default choice)
    seq_tokens: int  # KV positions one sequence of the plan fills: prompt + gen - 1 (the last token is not fed)
    shared_blocks: int  # blocks of the shared prefix stored once (prefix caching)
    prefix_hit_rate: float  # of each prompt's tokens, served from the cache (all but the first request)
    kv_concurrent_seqs: int  # sequences the KV cache holds at once
    max_seqs: int  # the batch cap: copt --max-batch-size, vLLM --max-num-seqs
    budget: str  # how the cache was sized

    @property
    def max_concurrent_seqs(self) -> int:
        return min(self.kv_concurrent_seqs, self.max_seqs)

    def as_dict(self) -> dict[str, object]:
        from dataclasses import asdict

        return {**asdict(self), "max_concurrent_seqs": self.max_concurrent_seqs}


VLLM_MAX_NUM_SEQS = {"large": 1024, "small": 256}  # vLLM V1's default --max-num-seqs on GPUs of >= 70 GiB / less


def default_max_seqs(plan: InferPlan, target: Target) -> int:
    """The plan's batch cap: --max-batch-size when given, else the engine's default (copt serve's recipe default;
    vLLM V1's max_num_seqs for an OpenAI server: 1024 on GPUs with 70 GiB or more, 256 below)."""
    if plan.max_batch_size is not None:
        return int(plan.max_batch_size)
    if plan.engine == "vllm":
        mem = target.memory_bytes or 0
        return VLLM_MAX_NUM_SEQS["large" if mem >= 70 * cal.GiB else "small"]
    from clusteropt_cli.recipe.schema.serve import ServeRecipe

    return int(ServeRecipe.model_fields["max_batch_size"].default)


def _engine_config(spec: ModelSpec) -> object:
    """The model's (text) config as attributes, the way copt serve's engine reads a transformers config."""
    from types import SimpleNamespace

    cfg = spec.config or {}
    if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"]}
    values = {"hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_layers,
              "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
              "head_dim": spec.head_dim, "intermediate_size": spec.intermediate_size, "vocab_size": spec.vocab_size,
              "max_position_embeddings": spec.max_position_embeddings, "model_type": spec.model_type}
    values.update({k: v for k, v in cfg.items() if k.isidentifier()})
    # what transformers' config classes derive on loading (the engine reads the loaded config): Qwen2/Qwen3-style
    # `use_sliding_window: false` turns the window off; on, it applies from layer `max_window_layers` up
    if values.get("use_sliding_window") is False:
        values["sliding_window"] = None
    elif values.get("use_sliding_window") and values.get("sliding_window") and not values.get("layer_types"):
        first = int(values.get("max_window_layers") or 0)
        values["layer_types"] = ["sliding_attention" if i >= first else "full_attention"
                                 for i in range(int(values["num_hidden_layers"]))]
    return SimpleNamespace(**values)


def kv_layout(spec: ModelSpec, plan: InferPlan) -> str:
    """How the plan's engine keeps its KV cache: "paged" (vLLM; copt's engine unless --kv-layout slots or a layer
    keeps a sliding-window ring, or the model is served through transformers' own attention), "slots" (copt's
    engine otherwise) or "static" (transformers' generate on a static batch)."""
    if plan.engine == "vllm":
        return "paged"
    if not plan.continuous_batching:
        return "static"
    from clusteropt_cli.core.serve.architectures import inspect_architecture, pages_kv_cache

    arch = inspect_architecture(_engine_config(spec), spec.max_position_embeddings)
    return "paged" if pages_kv_cache(arch, plan.kv_layout) else "slots"


def serving_capacity(spec: ModelSpec, plan: InferPlan, target: Target) -> ServingCapacity | None:
    """The KV cache of the plan's serving engine and the concurrency it allows (None: no memory to size it from).

    copt's engine (continuous batching, `--engine copt`) by its own rules and functions (core/serve/kv_budget.py,
    loading.py, kv_blocks.py): capacity in tokens = --kv-cache-memory GiB // bytes per token; under
    --gpu-memory-utilization U: U × total − weights − activation_reserve, // bytes per token; by default 85% of the
    memory free after loading (total − CUDA context − weights); on the CPU cpu_kv_capacity. Paged (the default
    unless a layer keeps a sliding-window ring, or --kv-layout slots): num_blocks = capacity // block_size, and a
    sequence of L positions owns ceil(L / block_size) blocks, less the full blocks of the shared prefix (stored once
    with prefix caching); slots: min(--max-batch-size, capacity // max_model_len). vLLM pages the same way
    (16-token blocks, prefix caching on by default in V1) in the memory left at --gpu-memory-utilization (0.9)
    after the weights and a profiled forward.
    """
    from clusteropt_cli.core.serve.kv_blocks import cacheable_blocks

    bs = int(plan.block_size)
    seq_tokens = plan.prompt_len + plan.gen_len - 1
    max_seqs = default_max_seqs(plan, target)
    caching = plan.prefix_caching and plan.shared_prefix_len > 0
    shared = cacheable_blocks(plan.prompt_len, plan.shared_prefix_len, bs) if caching else 0
    if plan.engine == "copt" and plan.continuous_batching:
        return _copt_capacity(spec, plan, target, seq_tokens, max_seqs, shared)
    mem = target.memory_bytes
    if mem is None:
        return None
    shard = min(plan.tp, spec.num_kv_heads) if not spec.is_mla else 1
    per_token = spec.kv_cache_bytes_per_token(cal.KV_BYTES[plan.kv_cache]) / shard
    utilization = plan.gpu_memory_utilization or cal.SERVING_MEMORY_UTILIZATION
    if plan.kv_cache_memory_gib is not None:
        usable = plan.kv_cache_memory_gib * cal.GiB
        why = f"--kv-cache-memory {plan.kv_cache_memory_gib:g} GiB"
    else:
        usable = mem * utilization - weight_bytes(spec, plan.served_weights) / plan.tp
        usable -= _prefill_working_set(spec, plan.with_(batch=1, chunked_prefill=plan.chunked_prefill or 8192))
        why = f"--gpu-memory-utilization {utilization:g} less the weights and a profiled forward"
    num_blocks = max(0, int(usable // (bs * per_token)))
    # a sliding-window layer keeps only its window (vLLM's hybrid KV cache manager): blocks of the average layer
    per_seq = kv_cache_bytes(spec, plan.with_(batch=1), seq_tokens)
    need = max(1, -(-int(per_seq) // int(bs * per_token)))
    shared = min(shared, need - 1)
    held = 0 if num_blocks < need else (num_blocks - shared) // (need - shared)
    if plan.engine == "vllm":
        return ServingCapacity("vllm", "paged", per_token, num_blocks * bs, bs, num_blocks, plan.max_model_len,
                               seq_tokens, shared, shared * bs / plan.prompt_len if shared else 0.0, held, max_seqs,
                               why)
    # transformers' generate on a static batch: a cache per sequence of its full length, nothing shared
    held = max(0, int(usable // kv_cache_bytes(spec, plan.with_(batch=1))))
    return ServingCapacity("hf-generate", "static", per_token, int(usable // per_token) if per_token else 0, 1, None,
                           None, seq_tokens, 0, 0.0, held, held, why)


def _copt_capacity(spec: ModelSpec, plan: InferPlan, target: Target, seq_tokens: int, max_seqs: int,
                   shared: int) -> ServingCapacity | None:
    """serving_capacity for copt's engine: EngineLoading.load's sizing, step by step, with its own functions."""
    from clusteropt_cli.core.serve.kv_blocks import max_concurrent_sequences
    from clusteropt_cli.core.serve.kv_budget import (
        DEFAULT_GPU_MEMORY_FRACTION,
        activation_reserve,
        choose_max_model_len,
        default_max_batch_tokens,
        utilization_budget,
    )
    from clusteropt_cli.core.serve.loading import CPU_KV_FRACTION, CPU_KV_MAX_BYTES, cpu_kv_capacity
    from clusteropt_cli.core.serve.runner import ModelRunner, resolve_dtype_name

    mem = target.memory_bytes
    if mem is None and plan.kv_cache_memory_gib is None and plan.kv_cache_tokens is None:
        return None
    config = _engine_config(spec)
    context = spec.max_position_embeddings
    device = target.device
    dtype = resolve_dtype_name(plan.dtype, device, spec.config.get("dtype") or spec.torch_dtype)
    elt = int(cal.KV_BYTES[dtype])
    kv_elt = 1 if plan.kv_cache in ("fp8", "int8") else elt  # fp8 blocks (int8: vLLM only)
    paged = kv_layout(spec, plan) == "paged"
    spec_extra = plan.speculative_tokens + 1 if plan.speculative_tokens else 0

    def per_token_of(length: int) -> int:
        return ModelRunner.kv_bytes_per_token_of(config, kv_elt, None if paged else length)

    # unquantized weights are held in the served dtype (fp32 on the CPU), and so are int4/int8 checkpoints, which
    # copt's engine dequantizes at load (core/serve/quantized.py); FP8 stays FP8
    weights = int(spec.num_params * elt if plan.served_weights in ("bf16", "fp16", "fp32")
                  else weight_bytes(spec, plan.served_weights))
    batch_tokens = int(plan.chunked_prefill or default_max_batch_tokens(device))
    reserve = activation_reserve(config, batch_tokens, max_seqs, elt) if device == "cuda" else 0
    free_at_start = int(mem - cal.CUDA_CONTEXT_BYTES) if device == "cuda" and mem is not None else None
    # the budget the default max_model_len is chosen for, before loading (EngineLoading._planned_kv_budget)
    if plan.kv_cache_tokens is not None:
        planned, planned_per_token = int(plan.kv_cache_tokens), (lambda _n: 1)
    elif plan.kv_cache_memory_gib is not None:
        planned, planned_per_token = int(plan.kv_cache_memory_gib * 2**30), per_token_of
    elif device != "cuda":
        planned, planned_per_token = min(int(mem * CPU_KV_FRACTION), CPU_KV_MAX_BYTES), per_token_of
    elif plan.gpu_memory_utilization is not None:
        planned = utilization_budget(mem, mem, weights, plan.gpu_memory_utilization, reserve)
        planned_per_token = per_token_of
    else:
        planned, planned_per_token = int((free_at_start - weights) * DEFAULT_GPU_MEMORY_FRACTION), per_token_of
    if plan.max_model_len:
        max_len = int(plan.max_model_len)
    else:
        max_len = choose_max_model_len(context, planned_per_token, max(0, planned), 1 if paged else max_seqs,
                                       spec_extra).max_model_len
    cache_len = max_len + spec_extra
    per_token = per_token_of(cache_len)
    # the capacity once loaded (EngineLoading.load)
    if plan.kv_cache_tokens is not None:
        capacity, why = int(plan.kv_cache_tokens), f"--kv-cache-blocks: {plan.kv_cache_tokens:,} tokens"
    elif plan.kv_cache_memory_gib is not None:
        capacity = int(plan.kv_cache_memory_gib * 2**30 // per_token)
        why = f"--kv-cache-memory {plan.kv_cache_memory_gib:g} GiB"
    elif device == "cuda" and plan.gpu_memory_utilization is not None:
        budget = int(mem * plan.gpu_memory_utilization) - weights - reserve
        capacity = max(0, int(budget // per_token))
        why = (f"--gpu-memory-utilization {plan.gpu_memory_utilization:g}: less the weights and "
               f"{reserve / cal.GiB:.1f} GiB kept for activations")
    elif device == "cuda":
        capacity = max(0, int((free_at_start - weights) * DEFAULT_GPU_MEMORY_FRACTION // per_token))
        why = (f"{DEFAULT_GPU_MEMORY_FRACTION:.0%} of the memory free after loading" if free_at_start > weights
               else "none: the weights alone exceed the GPU's memory")
    else:
        capacity, why = cpu_kv_capacity(per_token, cache_len, max_seqs, max(0, int(mem - weights)))
        why = f"CPU: {why}"
    bs = int(plan.block_size)
    if paged:
        num_blocks = capacity // bs
        held = max_concurrent_sequences(num_blocks, bs, seq_tokens, 10**9, plan.prompt_len, shared * bs)
        if seq_tokens > max_len or num_blocks < -(-cache_len // bs):
            held = 0  # longer than max_model_len, or the engine refuses to start (not one max_model_len sequence)
        hit = shared * bs / plan.prompt_len if shared else 0.0
        return ServingCapacity("copt", "paged", per_token, num_blocks * bs, bs, num_blocks, max_len, seq_tokens,
                               shared, hit, held, max_seqs, why)
    slots = max(0, min(max_seqs, capacity // cache_len))
    held = slots if seq_tokens <= max_len else 0
    return ServingCapacity("copt", "slots", per_token, slots * cache_len, bs, None, max_len, seq_tokens, 0, 0.0,
                           held, max_seqs, why)


def _finish(peak: float, breakdown: dict[str, float], target: Target, phase: str, states: float,
            phases: dict[str, float], notes: list[str]) -> MemoryEstimate:
    if target.device == "cuda":
        required = peak * (1 + cal.ALLOCATOR_FRAGMENTATION) + cal.CUDA_CONTEXT_BYTES
    else:
        required = peak
    budget = target.memory_bytes
    fits = None if budget is None else required <= budget
    return MemoryEstimate(per_gpu_bytes=peak, breakdown=breakdown, required_bytes=required, budget_bytes=budget,
                          fits=fits, peak_phase=phase, model_states_bytes=states, phases=phases, notes=notes)
