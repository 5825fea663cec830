"""Every tunable constant of the advise models, in one place, each with where its value comes from.

Measured values come from the GPU benchmarks in `bench/` (tables: docs/benchmarks.md). Nothing else in
core/advise hard-codes an efficiency or an overhead.
"""

from __future__ import annotations

GiB = 1024**3

# ---- memory -------------------------------------------------------------------------------------------------
# Are the logits of the forward still referenced while backward runs (`out = model(...); out.loss.backward()` keeps
# `out.logits`: vocab × tokens × 2 more bytes)? Not in copt: copt train's and copt profile's loss functions return
# the loss alone (losses.hf_causal_lm_loss), so the model's output and its logits are gone before backward. Measured
# with DeepSpeed's engine returning the loss alone: 2×H200 ZeRO-1/2, 1B shape, 4 × 2048: 21.64 GiB per GPU
# (21.57 not held, 23.53 held); H100/H200 ZeRO-3 + CPU offload with the model's own loss (2026-12-06): 1B 8 × 2048
# with checkpointing 26.8 GiB (25.8 not held, 29.7 held), 3B 4 × 2048 42.0 (41.2 / 43.2), with checkpointing 15.3
# (14.4 / 16.3). A plain loop that keeps `out` (bench/gpu_advise.py's train cases) sets it True: H200 anchor
# (docs/benchmarks.md#h200-baselines, 1B, 8 × 2048, bf16 autocast) 73.8 / 42.5 GiB measured, 75.4 / 44.0 held.
LOGITS_HELD_IN_BACKWARD = False
# Saved activations of a torch.compile'd decoder layer (memory.compiled_layer_bytes_per_token) relative to the
# minimal set the partitioner must keep. bf16: 1.0, the minimal set as counted, with the bf16 weight casts the
# compiled graph saves for backward counted apart (memory.train_memory). H200 measurements in docs/benchmarks.md
# (copt train running advise's plans: Llama-3.2-1B 8 × 2048, Llama-3.2-3B 4 × 2048, Llama-3.1-8B 2 × 2048): peaks
# 43,496,512,000 / 73,087,488,512 / 136,783,503,360 bytes, all three within 0.1% with 1.0 and the saved casts
# (with 1.09 and no casts, fitted on the 1B alone, the 3B and 8B were −4.9% and −6.1%). FP8 (torchao
# Float8Linear + the same defaults; weights reach the linears in fp32, their fp8 copies counted in model_states),
# 1B shape: 35,110,114,816 bytes (32.7 GiB) → 0.79.
COMPILED_ACTIVATION_FACTOR = {"default": 1.0, "fp8": 0.79}
# Bytes per logit of one chunk of copt train's fused loss (logits, their gradient and the cross-entropy kernel's
# temporaries). H200, 1B shape, 8 × 2048 (docs/benchmarks.md#train): peak 43.50 / 46.07 / 51.33 GB with
# loss_chunk_tokens 2,093 (default) / 4,096 / 8,192 → +2.58 GB per 2,003 × 128,256 logits and +7.84 GB per
# 6,099 × 128,256: 10.0 bytes per logit both ways.
FUSED_LOSS_BYTES_PER_CHUNK_LOGIT = 10.0
# Fraction the caching allocator reserves above the allocated peak (fragmentation, block rounding).
# Seen on the H200: reserved/allocated 1.03–1.08 for steady training loops; 1.06 assumed.
ALLOCATOR_FRAGMENTATION = 0.06
# CUDA context + cuBLAS/cuDNN handles and workspaces outside torch's allocator (nvidia-smi minus reserved).
CUDA_CONTEXT_BYTES = int(0.55 * GiB)
# Reserve for prefill/decode working buffers of a serving engine on top of weights + KV cache (vLLM sizes its
# KV pool from gpu_memory_utilization; 0.9 is its default).
SERVING_MEMORY_UTILIZATION = 0.90
# Bytes per weight for quantized formats, scales included (group size 128, fp16 scale + zero point for int4).
WEIGHT_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0 + 4 / 4096, "int8": 1.0 + 2 / 128,
                "int4": 0.5 + 4 / 128}
KV_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0}

# ---- time ---------------------------------------------------------------------------------------------------
# Model FLOPs utilization of an eager training step (dense FLOPs, datasheet peak; DeepSpeed, or compile off): one
# efficiency for the whole step, optimizer included. H200 anchor: 46.6k tok/s on the 1B shape at 8 × 2048 = 8.22
# GFLOP/token → 383 TFLOP/s = 0.387 of 989 TFLOP/s (docs/benchmarks.md#h200-baselines).
TRAIN_MFU_EAGER = 0.39
# copt train's compiled step (its CUDA default: compiled decoder, mask-free causal SDPA, chunked LM-head loss, fused
# AdamW, each step's loss read one step late) is priced term by term (timing.train_time):
#   FLOPs / (peak × ceiling × h / (h + overhead_width))  +  logits × LOSS_BYTES_PER_LOGIT / HBM
#   + once per optimizer step: parameters × (OPTIMIZER_BYTES_PER_PARAM + GRAD_CLIP_BYTES_PER_PARAM) / HBM.
# The h / (h + w) factor is the memory-bound work of a decoder layer (∝ tokens·h: norms, RoPE, SwiGLU, residual
# adds, casts, attention's softmax) next to its GEMMs (∝ tokens·h²): wider models spend more of the step at GEMM
# speed. ceiling: a bf16 8192³ matmul reaches 774 TFLOP/s = 0.78 of peak (docs/benchmarks.md#h200-baselines);
# 0.80 taken. overhead_width fitted on the H200 measurements in docs/benchmarks.md (copt train running advise's
# plans: Llama-3.2-1B shape 8 × 2048, 3B 4 × 2048, Llama-3.1-8B 2 × 2048, the 1B and 3B also with activation
# checkpointing: 71.3k / 30.6k / 12.9k / 63.1k / 25.5k tok/s), least squares on log tokens/s: 290 → 0.70 of peak
# at h 2048, 0.73 at 3072, 0.75 at 4096; tokens/s within +7.0% (1B) to −7.8% (8B) of all five. The 8B's step
# implies ≥ 0.8 of peak once its optimizer traffic is counted; the ceiling is kept at the measured large-GEMM
# figure instead. The 1B step profiled (docs/benchmarks.md#train: GEMMs 175 ms at ~695 TFLOP/s, fused Triton
# kernels 36 ms, attention 28 ms, AdamW + clipping ~13 ms of 248 ms) agrees: 0.70 of peak on GEMMs, a fifth of
# the step memory-bound. The same program measured 66.1k tok/s there (7% below the 71.3k above): expect that
# spread between machines and runs.
COMPILED_GEMM_EFFICIENCY = {"ceiling": 0.80, "overhead_width": 290.0}
# Fraction of the datasheet HBM bandwidth streaming kernels reach: H200 device-to-device copy 4.26 of 4.8 TB/s
# (docs/benchmarks.md#h200-baselines).
STREAM_BANDWIDTH_EFFICIENCY = 0.89
# HBM bytes per parameter of one optimizer step over fp32 parameters (copt train, zero 0): fused AdamW reads
# parameter, gradient and both moments and writes parameter and moments (7 × 4 bytes); SGD with momentum 5 × 4;
# bitsandbytes' 8-bit AdamW 4 + 4 read, 4 written, 1-byte moments read and written (4). The 1B profile's AdamW +
# clipping (13 ms for 1.24 B parameters, docs/benchmarks.md#train) is 40 bytes at 3.8 TB/s.
OPTIMIZER_BYTES_PER_PARAM = {"adamw": 28.0, "sgd": 20.0, "adamw-8bit": 16.0}
# clip_grad_norm_ (copt train always calls it): the norm reads every gradient, the clip multiplies them in place.
GRAD_CLIP_BYTES_PER_PARAM = 12.0
# HBM bytes per logit of the loss beyond its GEMMs. "fused" (copt train's chunked head + cross-entropy): the bf16
# logits written, read by the compiled cross-entropy kernel, which writes their bf16 gradient, read by the two
# gradient GEMMs. "hf" (the model's own loss): bf16 logits, their fp32 upcast, fp32 log-softmax, its gradient,
# softmax backward and the cast back, read by the two GEMMs (counted, not measured). The fused loss also reads and
# writes its fp32 head-gradient accumulator once per chunk (timing.train_time).
LOSS_BYTES_PER_LOGIT = {"fused": 10.0, "hf": 42.0}
# torchao Float8Linear runs the decoder's linears (not the LM head, not attention) at this fraction of the fp8 peak
# relative to what bf16 GEMMs reach of theirs: casts and amax/scale reductions stay. Fitted to the H200 ratio of
# copt train --precision fp8 to its bf16 default on the 1B shape, 8 × 2048, in the same run (both with the per-step
# readout of that time): 70,087 / 61,326 tok/s = 1.14 (docs/benchmarks.md#train) → 0.62 (1,979 TFLOP/s × 0.62 ×
# 0.70 ≈ 860 TFLOP/s on the 1B shape's linears, against 690 in bf16).
FP8_GEMM_FACTOR = 0.62
# Eager fp8 (compile off; not measured): this fraction of the eager bf16 MFU, on the 2× peak (the ratio the
# compiled fp8 anchor gave under the single-MFU model).
FP8_MFU_FACTOR = 0.53
# Prefill: a pass's FLOPs (timing.prefill_flops: every prompt token through the decoder, the LM head once per prompt,
# for its last token's logits) at ceiling × h / (h + overhead_width) of dense peak (timing.prefill_gemm_efficiency,
# the form of COMPILED_GEMM_EFFICIENCY: GEMM work per token ∝ h², the memory-bound rest ∝ h). Ceiling: the large-GEMM
# figure (0.78 measured, 0.80 as there); the width fitted (least squares on log predicted ÷ measured, a grid over
# 0.62-0.80 and 800-2,800) on the H200 anchors: batch-1 TTFT of 32- and 256-token prompts (in-process, below) 1.00
# and 1.02 (1B), 1.00 and 0.96 (8B); the 1B's packed steps (in-process, below) of eight and four 256-token prompts and
# of one 2,048-token prompt 1.05, 1.03, 0.96; the 8B's closed-loop steps of 6-8 prompt chunks (the engine traces of
# its long loops, sampled and greedy, docs/benchmarks.md#closed-loops-replayed; engine_trace_report.py --step-costs)
# 1.00 and 1.03 → 2,400: 0.37 of peak at h 2,048 (1B), 0.45 at 3,072, 0.50 at 4,096 (8B), 0.62 at 8,192. Held out:
# the same steps of the 8B's long loops on an H100 0.98; the in-process packed steps of the 8B (docs/benchmarks.md
# #time-to-first-token) 1.03, 1.06, 0.98; a wider model on an H100 (Llama-3.1-70B's width on 8 layers, same section
# as the loops) 0.97-1.00. Before (0.50 of peak for every model, the LM head on every prompt token) those figures were
# 1.00, 1.00, 1.00, 1.00; 1.00, 0.99, 0.90; 1.06 and 1.09; H100 1.04; 1.10, 1.13, 1.05; 1.27-1.30: the 8B's packed
# steps priced 4-13% high and the wide model's 30%, which the 1B's anchors had hidden.
PREFILL_GEMM_EFFICIENCY = {"ceiling": 0.80, "overhead_width": 2400.0}
# A decode step over many rows can be bound by its FLOPs rather than its bytes: this fraction of dense peak then (the
# flat prefill figure this model used before PREFILL_GEMM_EFFICIENCY; rarely binding: 256 rows of the 1B shape need
# 1.3 ms of it against a 1.35 ms bandwidth floor on the H200).
DECODE_COMPUTE_MFU = 0.50
# Fraction of HBM bandwidth a decode step reaches over the bytes it reads (the weights but an untied input
# embedding, a lookup; the KV cache), with the engine's cost per layer, per MoE layer, per step and per sequence
# (SERVING_ENGINES: decode_layer_s, moe_layer_s, step_fixed_s, step_per_seq_s) and the autotuned batch-1 kernels'
# saving (AUTOTUNED_B1_FLOOR_SHARE). Fitted (least worst error) to copt's engine in-process, CUDA graphs, greedy,
# bench/gpu_moe_decode.py (docs/benchmarks.md#decode-steps): dense Llama-3.2-1B and Llama-3.1-8B widths on 4 and 16
# layers at batch 1, 16 and 64 on an H100 host (2026-12-07: 0.93-1.07), and the H200's 1B and 8B batch-1 steps
# (1.171 and 4.379 ms autotuned, 1.201 and 4.701 with cuBLAS: 0.95, 1.06, 0.96, 1.03) and the 1B's 256-row chained
# step (2.93 ms: 0.93) of 2026-12-02; held out, a second H100 host: 0.89-1.05. The MoE shapes (Qwen3-30B-A3B's
# width on 8 layers, Mixtral-8x7B's on 4 and 8) gave the cost per MoE layer (50 µs, routed and dense experts alike):
# 0.89-1.12. The one cost per step fitted
# before (0.57 ms on the 16- and 32-layer shapes) priced the 4-layer shapes 1.61-1.74x and a 4-layer Mixtral 1.25x;
# a layer of the 1B's width costs 26-34 µs more than its bytes at the datasheet bandwidth and the 8B's 35-43 µs, the
# step beyond its layers and LM head 0.12-0.17 ms. Held out, through `copt serve` on H100s (docs/benchmarks.md#real-
# model-sizes-copts-defaults-other-clients): batch-1 8B 6.20 ms/token (advise 6.18), 3B 2.90-3.03 (3.11), 1B
# 1.29-1.45 over four hosts (1.37), Llama-3.1-70B's width on 8 layers 5.32 (5.69; 6.83 before).
DECODE_BANDWIDTH_EFFICIENCY = 0.82
# Useful fraction of a static batch's decode slots (padding, finished sequences idling until the longest ends).
# H200: HF static generate at batch 64 2,372 tok/s vs continuous batching (generate_batch + CUDA graphs) 3,495
# → 0.68; Orca and vLLM report 3–5× serving throughput for continuous batching. 0.6 assumed.
STATIC_BATCH_EFFICIENCY = 0.6
# What a real serving stack adds to the roofline: a cost per prompt prefilled, a fixed host + launch cost per decode
# step, a cost per running sequence per step, and what the HTTP front end adds per request of a round. copt's own
# engine, H200, Llama-3.2-1B shape, 256 requests of 256 new prompt tokens × 128 output tokens sent at once,
# --max-batch-size 256, greedy and sampled (top_p 0.95), in-process and through `copt serve` with one API-server
# process, the same run (bench/gpu_serve_frontend.py with engine step traces, 2026-12-02, packed prefill through
# FlashAttention varlen; docs/benchmarks.md#front-end-processes):
# - per step: chained decode steps of 256 rows took 2.86–3.0 ms greedy (3.5–3.7 sampled); with batch-1 decode at
#   1.22 ms/token through the server, the two points over floor / DECODE_BANDWIDTH_EFFICIENCY gave 0.57 ms fixed and
#   3.9 µs per sequence, refitted since per layer (DECODE_BANDWIDTH_EFFICIENCY): 0.02 ms per step, 31 µs per layer
#   (50 µs more per MoE layer) and 3.5 µs per sequence. The per-layer cost counts with the engine's own work in a
#   step that prefills (timing.infer_time's mixed_step), as the fixed cost it replaces did.
# - per prompt: the engine's whole load took 1.180 s greedy and 1.186 s sampled (median of 3) against 0.33 s of
#   prefill FLOPs at a flat 0.50 of peak and 128 decode steps at the rates above → 1.7 ms per prompt (16 prompts per
#   4,096-token step: a mixed step took 39 ms median; eager layers, the step's first tokens, the finish tail).
# - per request of a round through HTTP: the clients' wall was 1.465 s greedy / 1.532 s sampled against the
#   engine's model above → 1.25 ms per request (the API process takes the requests in, then streams every token
#   of 256 streams: it lagged the engine by 0.1–0.3 s at the end of the load).
# Batch-1 TTFT: see below. Held out (no constant fitted to them): bench/gpu_serve_models.py's 64- and 256-client
# loads on the 1B and 8B shapes, batch 1, guidellm and `copt profile endpoint` (docs/benchmarks.md, real model sizes).
# Under load the first tokens of a round also wait for the API process to take the round's requests in: client
# TTFT p50 minus the engine's own (its step trace, from each request's arrival), copt serve's defaults, H200,
# 2026-12-02, bench/gpu_serve_models.py: 8B shape 0.04-0.07 s at 64 clients and 0.13-0.16 s at 256, 1B 0.05 s and
# 0.17-0.28 s → 0.75 ms per request of the round (api_intake_s; fitted to that run, with the half-round prefill
# wait of timing.infer_time read off the same traces).
# Without continuous batching the baseline is HF `generate` on a static batch, whose per-step host cost dominates
# (docs/benchmarks.md#h200-baselines: batch 64 left-padded 2,372 output tok/s = 27 ms/step; batch 1 eager measured
# 43.5 ms/token, so batch-1 figures from this anchor are optimistic). vLLM is not calibrated here (roofline only).
# A prompt prefilled alone (batch 1) runs as a captured prefill graph (up to 2,048 tokens: runner.PrefillGraph):
# max(its FLOPs at PREFILL_GEMM_EFFICIENCY, the weights at DECODE_BANDWIDTH_EFFICIENCY) plus a cost per layer (its
# chain of small kernels) and per request (scheduling, first-token sampling, emission). In-process engine, H200,
# 2026-12-01 (bench/gpu_ttft_profile.py, docs/benchmarks.md#time-to-first-token), TTFT for prompts of 32 and 256
# tokens: 1B shape 3.92 and 4.59 ms, 8B shape 10.43 and 13.98 ms → 0.185 ms per layer, 0.32 ms per request (fitted
# with a flat 0.50 of peak; with PREFILL_GEMM_EFFICIENCY they predict 3.92, 4.66, 10.42 and 13.4 ms).
# Through `copt serve` (one streaming greedy request of 256 prompt tokens at a time,
# bench/gpu_serve_models.py, H200, 2026-12-02) the first token came 3.8 ms (1B: 8.2 ms against 4.4 in-process at
# c8431df) and 3.5 ms (8B: 17.0 against 13.6) later: 3.6 ms per request for the server (HTTP, tokenization, the
# first SSE event), added to every TTFT of copt's engine. In-process a sampled request's first token costs more (the
# captured sampling graph after the prefill; 1B shape, 32-token prompts, bench/gpu_ttft_profile.py, H200, 2026-12-02,
# 3f29203: greedy 3.65 ms, temperature 1.0 4.64, top_p 0.95 4.45, top_k 50 4.45), but through `copt serve` it does
# not show: one streaming request at a time, 256-token prompts, sampled minus greedy TTFT p50 −1.0 to +0.1 ms (mean
# −0.2) over 8 pairs — the script's client in two runs, guidellm and `copt profile endpoint`, 1B and 8B shapes (H200,
# 2026-12-02, bench/gpu_serve_models.py at fd577c7 and with --tester-modes sampled,greedy at 8aee225) — so no
# sampled term is added.
# Packed steps run as one such graph per token bucket since the prefill graphs go through FlashAttention's
# variable-length kernel (timing.infer_time's mixed_step prices them the same way: per chunk prefill_graph_request_s,
# no per-prompt prefill_request_s). In-process engine, 1B shape, one output token per prompt, H200, 2026-12-03
# (bench/gpu_prefill_steps.py; docs/benchmarks.md#time-to-first-token), step medians: eight 256-token prompts 15.8 ms
# (priced 15.8), four 9.5 (9.4), one 2,048-token prompt 15.6 (13.6), a 2,048-token step of nine chunks resuming a
# split prompt 15.5 (16.1), the 44-token rest of a prompt alone 4.2 (4.6).
# The closed- and open-loop replays (closed_loop.py) stream every decoded token through the API process one after
# another at http_token_s each, from when the engine emitted it; a request's answer is complete when its last token
# went out. 16 µs: chosen among 12, 16 and 20 µs on the H200 loads of docs/benchmarks.md#closed-loops-replayed (of the
# 276 closed-loop cells the tests pin, 223, 232 and 231 within ±15%; 225 with the answers' tokens costing 1.25 ms per
# request at its end instead, as before); at 16 µs the API
# process falls 0.6-1.2 ms behind each 256-row decode pass of the 1B (3-3.5 ms), 0.06-0.11 s over a 95-pass chain,
# within the lag its traces showed (0.05-0.27 s), and keeps up with the 8B's passes. The round model keeps
# http_stream_s, the lag that showed at a round's end.
SERVING_ENGINES = {
    "copt": {"prefill_chunk_tokens": 2048, "prefill_request_s": 1.7e-3, "step_fixed_s": 0.02e-3,
             "decode_layer_s": 31e-6, "moe_layer_s": 50e-6, "step_per_seq_s": 3.5e-6, "prefill_graph_tokens": 2048,
             "prefill_graph_layer_s": 0.185e-3,
             "prefill_graph_request_s": 0.32e-3, "http_request_s": 3.6e-3, "http_stream_s": 1.25e-3,
             "api_intake_s": 0.75e-3, "http_token_s": 16e-6},
    "hf-generate": {"prefill_request_s": 0.0, "step_fixed_s": 27e-3, "step_per_seq_s": 0.0},
}
# The host's floor under a step of copt's engine that prefills: its eager prefill layers and the work per prompt
# chunk (scheduling, blocks, the first token's sampling and emission) — the step takes at least this long however
# fast the GPU is. Read off the engine's step traces of closed loops (copt profile endpoint and guidellm), H200,
# copt serve's defaults, 2026-12-02 (bench/gpu_serve_models.py, the traces kept with its results): steps with one
# decode pass and 256+ prompt tokens, 1B shape with 256- and 512-token prompts (586 and 827 steps: 36 and 26 ms
# median, where the step model gives 25 and 21), 8B shape (345 steps, GPU-bound: unchanged). Fitted, step time =
# max(the step model, 3 ms per chunk + 0.5 ms per layer): median step predicted ÷ measured 0.95, 0.96 and 1.06.
# Applied by closed_loop.py's replay.
# Since copt's engine captures prefill graphs for packed steps (up to 8 prompts, 1,024 tokens; one prompt up to 2,048)
# the floor holds only the steps it runs eagerly (timing.infer_time's mixed_step): a resumed prompt, more tokens.
PREFILL_STEP_HOST_PER_CHUNK_S = 3.0e-3
PREFILL_STEP_HOST_PER_LAYER_S = 0.5e-3
# A step of copt's engine that decodes and prefills reads its decode's tokens back and emits them before launching
# the prefill (its decode is not chained: engine.Engine._step), so the host's work per sequence is not hidden behind
# the GPU as in a decode chain. Read off the engine's step traces of the closed and open loops of the b9411c3 run in
# docs/benchmarks.md#closed-loops-replayed (H200, copt serve's defaults; 1B and 8B shapes,
# 256/128): every step with one decode pass and prompt chunks the prefill graphs take and every decode pass run
# alone (6,432 steps), less the chained decode step and the prefill of the graph's token bucket as infer_time prices
# them, least squares over bins of 32 rows (bench/fit_unchained_step.py --masked-graphs): 1.6 ms per step + 18 µs per
# decoding sequence. The next run's traces (step-model, same section) give 1.64 ms + 14.1 µs. The 1B's traces on the
# variable-length prefill graphs (ec8528c, 1,703 steps, each less mixed_step's price of its graph) give 2.0 ms + 25 µs;
# the 8B's a negative intercept and 27 µs (its packed prefill steps priced 2-13% above the measured ones). The four
# sampled traces on those graphs together (the 1B's and 8B's, in-step and long loops, H200, 2026-12-04; 6,031 steps
# at the prices of 2026-12-08) give 1.42 ms + 21.8 µs, and replayed with it the closed and open loops the tests pin
# keep as many figures within ±15% (526) as 1.6 ms + 18 µs does: kept (bench/fit_unchained_step.py over the engine
# traces kept with docs/benchmarks.md#closed-loops-replayed: the 1B's and 8B's loops of 2026-12-04, sampled).
# Per step then (bench/engine_trace_report.py --step-costs) within ±3 ms of the measured medians (1B 1-chunk
# steps 6.6-11.3 ms, 8B 19-29 ms), where the earlier floor (11 ms / 19 ms for any step of one chunk) was off by
# 0.57-1.76×.
# The same host work prices a pure decode step while requests wait for a place (the engine does not chain then), and
# bounds what a decode chain's first pass adds (the shorter of it and the device's pass: timing's chain_start).
UNCHAINED_STEP_S = 1.6e-3
UNCHAINED_STEP_PER_SEQ_S = 18e-6
# The host those costs were measured on, by the time it takes for core/hostspeed.py's reference Python loop: the
# host work of copt's engine (the unchained step above and the engine's per-step and per-sequence work it exposes,
# per prompt chunk and prompt) scales with a serving host's time over this one (timing.host_work_scale). Two H100
# machines whose hosts ran the loop in 5.65 and 13.06 ms (bench/common.host_probe) ran the 1B's packed prefill steps
# (8 prompt chunks beside 32-255 decoding rows, 1,800 steps; engine traces of `copt profile endpoint` closed loops,
# 2026-12-06) in 17.1-20.2 and 20.3-26.4 ms, where the unscaled price is 20.9-26.2 (1.22-1.29 and 0.99-1.03 of the
# measured ones). Scaled, a reference of 13.5 ms prices both within 3% at every row count (1.01-1.03 and 0.98-1.02;
# 11 ms: 1.06 and 1.06-1.08; 15 ms: 0.99-1.02 and 0.95-1.00): the host's work per row and per chunk moves with its
# loop time, while decode passes run alone (chained) took the same 4.1-4.2 ms at 240 rows on both.
HOST_LOOP_REFERENCE_S = 13.5e-3
# What sampled requests (temperature > 0, no top-k/top-p truncation) add per decode step of copt's engine over
# greedy decoding. Sampling runs on the device inside the captured step (Gumbel-max with counter-based noise, async
# scheduling kept), so the cost is one [batch, vocabulary] pass more than the greedy argmax. H200, Llama-3.2-1B
# shape, the same run (docs/benchmarks.md#serve): batch-1 1.216 ms/token greedy, 1.250 at temperature 0.7 and 1.0
# → 34 µs per step; the sampling kernels alone grow by 0.85 µs per row more than the argmax's (28 → 271 µs from 1 to
# 256 rows, argmax 72 → 98 µs). A top-k/top-p sort costs more (98 µs at 1 row, 3.4 ms at 256): not priced here.
SAMPLED_DECODE_STEP_S = 34e-6
SAMPLED_DECODE_PER_SEQ_S = 0.85e-6
# What top-k / top-p truncation adds on top of that: the sampling step of copt's engine alone, captured as a CUDA
# graph on a 128,256-token vocabulary, for 1, 64 and 256 rows (µs), per selection mode the engine runs
# (device_sampling.selection_for). H200, 2026-12-02, bench/gpu_serve_sampling.py --skip engine,http, e14634f (the draw
# modes' temperature and draw fused into their kernels; docs/benchmarks.md#serve): the
# difference to the temperature-only mode ("plain"), interpolated linearly in the rows, is added per decode step.
# Checked at batch 1 against the engine at af4ec2b (same kernels): 1.236 ms/token at temperature 1.0, 1.257 with top_p
# 0.95 (+13.7 µs of graph → 1.250 predicted), 1.269 with top_k 50 (+21.7 → 1.258).
SAMPLING_GRAPH_US = {
    "plain": ((1, 17.4), (64, 77.2), (256, 249.9)),
    "top_p": ((1, 31.1), (64, 272.3), (256, 681.5)),
    "top_k_draw": ((1, 39.1), (64, 240.2), (256, 856.8)),  # every sampled row top_k <= 64
    "top_k_p_draw": ((1, 43.7), (64, 253.4), (256, 912.7)),
    "top_k_wide": ((1, 80.8), (64, 555.7), (256, 1337.1)),  # top_k up to 1,024 (one row sorts on CUDA)
    "top_k_wide_p": ((1, 81.3), (64, 588.2), (256, 1443.0)),
    "sort": ((1, 81.5), (64, 996.9), (256, 3264.6)),  # a larger top_k
}
# What inductor's autotuned kernels save per batch-1 decode step (copt serve's default --compile-mode auto), as a
# share of the weights-over-bandwidth floor. H200, in-process decode profile, one host (docs/benchmarks.md#serve): 8B
# shape 4.701 → 4.379 ms/token (0.322 ms, 9.6% of advise's 3.35 ms floor), 1B 1.201 → 1.171 (0.030 ms, 5.8% of 0.51
# ms); 0.07 in the fit of DECODE_BANDWIDTH_EFFICIENCY. Not measured above batch 1: not applied there.
AUTOTUNED_B1_FLOOR_SHARE = 0.07
# Fraction of link bandwidth NCCL collectives reach (bus bandwidth / link bandwidth, large messages).
COMM_EFFICIENCY = 0.80
# Fraction of ZeRO/DP communication hidden behind backward compute (overlap_comm, bucketed all-reduce).
COMM_OVERLAP = 0.70
# Activation checkpointing recomputes each decoder layer's forward (timing.recompute_flops_per_token: eager the
# whole layer, compiled all but the MLP output projection). Eager H200 anchor (docs/benchmarks.md#h200-baselines):
# 46.6k → 38.2k tok/s (−18%); the FLOP count gives −21%. Compiled: 71.3k → 63.1k (1B shape), 30.6k → 25.5k (3B)
# measured; −15% / −18% priced.

# ---- defaults for cost ----------------------------------------------------------------------------------------
DEFAULT_GPU_HOUR_USD = {"h200": 3.50, "h100-sxm": 2.50, "h100-pcie": 2.00, "a100-80g": 1.50, "a100-40g": 1.10,
                        "h20": 1.20, "h800": 2.30, "b200": 5.00, "l40s": 0.90, "rtx4090": 0.40, "mi300x": 2.50}


# ZeRO-Offload: DeepSpeed CPUAdam seconds per parameter on the host (plus 4 bytes/param over a 25 GB/s host link,
# timing.py): 0.30 ns per parameter in all. Fitted on an H100 with 16 host cores (2026-12-06,
# bench/advise_vs_train.py): the 3B shape under ZeRO-3 + CPU offload, 4 × 2048, 1.51 s/step (advise 1.41); the 1B
# under ZeRO-3 + offload + checkpointing, 8 × 2048, 0.74 s (0.81); the 3B under ZeRO-2 + offload + checkpointing,
# 4 × 2048, 1.44 s (1.55). The host CPU sets this step (CPU Adam and ZeRO-3's Python hooks run there): another
# 16-core H100 machine stepped the 3B in 1.14 s and the 1B in 0.56 s (timing.OFFLOAD_HOST_NOTE), so this prices the
# slower hosts. (The earlier H200 anchor, 1.42 s/step on the 1B shape, ran DeepSpeed's forward in fp32 and priced
# this at 0.65e-9.)
CPU_ADAM_S_PER_PARAM = 0.14e-9

# ---- host memory of a training run -----------------------------------------------------------------------------
# Host bytes per parameter of DeepSpeed's ZeRO-Offload buffers on a node, past HOST_PROCESS_BYTES. DeepSpeed 0.19.8's
# own estimators (estimate_zero3_model_states_mem_needs / estimate_zero2_...) count 18 under ZeRO-3 with
# offload_param (16-bit parameters 2, fp32 masters 4, fp32 gradient partitions 4, Adam moments 8) and 16 with
# offload_optimizer alone, then add a 1.5 safety factor. Measured on 125.8 GiB hosts (H100 and H200 machines,
# 2026-12-06, bench/advise_vs_train.py, host memory in use beyond the idle machine): ZeRO-3 + CPU offload 24 bytes
# per parameter (1B shape 33.5 GB, 3B 80.7 GB with and without checkpointing: within 2%); the 8B shape (193 GB
# predicted) was killed by the kernel's out-of-memory killer at 134 GB. ZeRO-2 + CPU offload 23 (1B 35.3 GB, 3B
# 73.7 GB: −7% and +6%). Not measured: NVMe (ZeRO-Infinity: the fp32 gradient partitions stay on the host),
# DeepSpeed's 4 scaled by ZeRO-3's 24/18.
OFFLOAD_HOST_BYTES_PER_PARAM = {"cpu-zero3": 24.0, "cpu": 23.0, "nvme": 4.0 * 24 / 18}
OFFLOAD_NVME_BYTES_PER_PARAM = {"zero3": 14.0, "other": 12.0}  # fp32 masters + Adam moments (+ 16-bit parameters)
# What one copt train rank holds on the host besides the model: the Python process, torch and CUDA libraries,
# torch.compile's workers. H100 (2026-12-06, bench/advise_vs_train.py, 1B and 3B shapes, no offload): 2.4-3.7 GiB
# in use beyond the idle machine.
HOST_PROCESS_BYTES = 4 * GiB
