"""advise memory/time models: published figures, the H200 anchors, and the CPU quantity measured for real."""

from __future__ import annotations

import pytest

from clusteropt_cli.core.advise.memory import cpu_training_bytes, kv_cache_bytes, model_states, train_memory
from clusteropt_cli.core.advise.plan import InferPlan, Target, TrainPlan
from clusteropt_cli.core.advise.timing import bubble_fraction, train_time, zero_comm_bytes
from clusteropt_cli.hardware import get_gpu
from clusteropt_cli.modelspec import load_model_spec

GiB = 1024**3


def _states_total(n: float, zero: int, dp: int) -> float:
    return sum(model_states(n, "bf16", "adamw", zero, dp, deepspeed=True).values())


def test_70b_model_states_1_12_tb() -> None:
    n = 70e9
    assert _states_total(n, 0, 1) / 1e12 == pytest.approx(1.12, rel=0.01)
    # torch autocast layout (fp32 weights + fp32 grads + Adam) is also 16 bytes/param
    assert sum(model_states(n, "bf16", "adamw", 0, 1, deepspeed=False).values()) == 16 * n


@pytest.mark.parametrize(("zero", "gb"), [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_7_5b_on_64_gpus(zero: int, gb: float) -> None:
    assert _states_total(7.5e9, zero, 64) / 1e9 == pytest.approx(gb, rel=0.05)


def test_gpt3_weights_and_llama2_kv() -> None:
    gpt3 = load_model_spec("gpt3-175b")
    assert gpt3.num_params * 2 / 1e9 == pytest.approx(350, rel=0.01)
    llama2 = load_model_spec({"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
                              "num_attention_heads": 32, "intermediate_size": 11008, "vocab_size": 32000})
    assert kv_cache_bytes(llama2, InferPlan(batch=1, prompt_len=1, gen_len=0)) == 0.5 * 2**20


def test_bubble_formulas() -> None:
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)  # (p-1)/(m+p-1)
    assert bubble_fraction(4, 8, virtual_stages=2) == pytest.approx(3 / 16)  # (p-1)/(v*m)
    assert bubble_fraction(1, 8) == 0.0


def test_zero3_communication_is_1_5x_dp() -> None:
    assert zero_comm_bytes(1e9, 3, 8) == pytest.approx(1.5 * zero_comm_bytes(1e9, 0, 8))
    assert zero_comm_bytes(1e9, 2, 8) == zero_comm_bytes(1e9, 0, 8)


def test_h200_anchor_within_10_percent(monkeypatch) -> None:
    """docs/benchmarks.md#h200-baselines: 1B shape, 8 × 2048, fused AdamW, bf16 autocast: 73.8 GiB; ckpt 42.5. A
    plain loop (`out = model(...)`), priced with its logits held through backward (75.4 / 44.0 GiB; 71.4 / 40.1
    when they are not, as in copt's own loops)."""
    from clusteropt_cli.core.advise import calibration as cal

    monkeypatch.setattr(cal, "LOGITS_HELD_IN_BACKWARD", True)
    spec, target = load_model_spec("llama-3.2-1b"), Target(get_gpu("h200"))
    eager = {"compile": False, "loss_impl": "hf"}  # the eager HF loop those figures were measured on
    plain = train_memory(spec, TrainPlan(micro_batch=8, seq_len=2048, **eager), target)
    ckpt = train_memory(spec, TrainPlan(micro_batch=8, seq_len=2048, activation_checkpointing=True, **eager), target)
    assert plain.model_states_bytes / GiB == pytest.approx(18.4, rel=0.01)
    assert plain.per_gpu_bytes / GiB == pytest.approx(73.8, rel=0.10)
    assert ckpt.per_gpu_bytes / GiB == pytest.approx(42.5, rel=0.10)
    assert plain.fits and ckpt.fits
    # and on an 80 GB H100 the plain plan is called OOM while checkpointing fits
    h100 = Target(get_gpu("h100-sxm"))
    assert train_memory(spec, TrainPlan(micro_batch=8, seq_len=2048, **eager), h100).fits is False
    assert train_memory(spec, TrainPlan(micro_batch=8, seq_len=2048, activation_checkpointing=True, **eager),
                        h100).fits


def test_h200_anchor_speed() -> None:
    spec, target = load_model_spec("llama-3.2-1b"), Target(get_gpu("h200"))
    tps = train_time(spec, TrainPlan(micro_batch=8, seq_len=2048, compile=False), target).figures["tokens_per_s"]
    tps_ckpt = train_time(spec, TrainPlan(micro_batch=8, seq_len=2048, activation_checkpointing=True, compile=False),
                          target).figures["tokens_per_s"]
    assert tps == pytest.approx(46.6e3, rel=0.10)
    assert tps_ckpt == pytest.approx(38.2e3, rel=0.10)


def test_eager_attention_is_quadratic() -> None:
    spec, target = load_model_spec("llama-3.2-1b"), Target(get_gpu("h200"))

    def act(attn: str, seq: int) -> float:
        return train_memory(spec, TrainPlan(micro_batch=1, seq_len=seq, attn=attn, compile=False), target
                            ).breakdown["activations"]

    assert act("sdpa", 4096) / act("sdpa", 2048) == pytest.approx(2.0, rel=0.02)
    assert act("eager", 4096) / act("eager", 2048) > 2.5


@pytest.mark.parametrize(("precision", "attn", "ckpt"), [("fp32", "sdpa", False), ("bf16", "sdpa", False),
                                                        ("bf16", "eager", False), ("bf16", "sdpa", True)])
def test_cpu_quantity_matches_measurement(precision: str, attn: str, ckpt: bool) -> None:
    """Predicted CPU peak_mem_bytes vs saved_tensors_hooks on a real HF Llama (GQA, tied head)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.cpu_step_memory import measure_cpu_training_step

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True, attn_implementation=attn)
    model = LlamaForCausalLM(cfg)
    if ckpt:
        model.gradient_checkpointing_enable()
    measured = measure_cpu_training_step(model, torch.randint(0, 512, (2, 64)), precision)
    spec = load_model_spec(cfg.to_dict())
    predicted = cpu_training_bytes(spec, TrainPlan(micro_batch=2, seq_len=64, precision=precision, attn=attn,
                                                   activation_checkpointing=ckpt, loss_impl="hf"))  # model(labels)
    assert predicted["model_states"] == measured["model_states"]
    assert predicted["saved_tensors"] == pytest.approx(measured["saved_tensors"], rel=0.01)
    assert predicted["peak_mem_bytes"] == pytest.approx(measured["peak_mem_bytes"], rel=0.01)


# DeepSpeed 0.19.8 buffers for the Llama-3.2-1B shape, 4 × 2048, checkpointing, 2 GPUs (deepspeed_terms docstring)
_P = 1_235_814_400


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_deepspeed_buffers_1b_on_2_gpus(zero: int) -> None:
    spec = load_model_spec({"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16,
                            "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 8192,
                            "vocab_size": 128256, "tie_word_embeddings": True, "head_dim": 64})
    assert spec.num_params == _P
    # the model's own loss (fp32 logits) keeps these pins about DeepSpeed's buffers; copt train's config (5e7 buckets)
    plan = TrainPlan(micro_batch=4, seq_len=2048, activation_checkpointing=True, zero=zero, loss_impl="hf")
    mem = train_memory(spec, plan, Target(get_gpu("h200"), gpus_per_node=2))
    ds = mem.deepspeed_buffers
    assert mem.peak_phase == "loss-backward"
    assert mem.breakdown["optimizer"] == pytest.approx(6 * _P)  # fp32 master + Adam m, v over 2 ranks
    if zero in (1, 2):
        assert mem.breakdown["weights"] == pytest.approx(2 * _P)  # bit16_groups_flat, not partitioned
        assert ds["loss"] == {}  # no gradient or bucket exists at the loss of a steady-state step
        assert ds["end-of-backward"] == pytest.approx({"ipg_buckets": 2 * 5e7 * 2, "grads_in_partition": _P})
        assert ds["optimizer-step"] == pytest.approx({"grads_in_partition": _P, "flat_grad_partition": _P,
                                                      "fp32_grad_partition": 2 * _P})
        # 21.57 GiB; 21.64 measured on 2×H200 (bench/gpu_advise.py --zero: the engine returns the loss alone)
        assert mem.per_gpu_bytes / 1e9 == pytest.approx(23.17, abs=0.01)
    else:
        assert mem.breakdown["weights"] == pytest.approx(_P)  # bf16 partition
        loss = ds["loss"]
        assert loss["grad_partitions_flat_buffer"] == pytest.approx(_P)
        assert loss["ipg_bucket"] == 1e8
        assert loss["prefetch_bucket"] == 1e8
        # tied embedding/head (262.7M) + layers 13-15 (60.8M each) recur within stage3_max_reuse_distance
        layer = (_P - 128256 * 2048) / 16
        assert loss["gathered_params"] == pytest.approx(2 * (128256 * 2048 + 3 * layer))
        assert mem.per_gpu_bytes / 1e9 == pytest.approx(24.26, abs=0.01)  # 1.8 GB less than with 5e8 buckets


# `copt serve DIR` with its defaults of then (--max-batch-size 64) on the H200, bench/gpu_serve_models.py at 81019d3
# (docs/benchmarks.md, real model sizes), 64 and 256 streaming clients sent at once, prompts of 256 tokens, 128 output
# tokens; copt's own client: output tok/s, TTFT p50 (s), TPOT p50 (s). No serve constant was fitted to these
# throughputs and TTFTs (the client TPOT's prefill share was chosen after seeing them).
HELD_OUT = {("llama-3.1-8b", 64, 0.0): (5764, 0.373, 8.01e-3), ("llama-3.1-8b", 64, 1.0): (5631, 0.355, 8.41e-3),
            ("llama-3.1-8b", 256, 0.0): (5447, 3.189, 11.31e-3), ("llama-3.1-8b", 256, 1.0): (5162, 3.307, 11.67e-3),
            ("llama-3.2-1b", 64, 0.0): (15582, 0.201, 2.66e-3), ("llama-3.2-1b", 64, 1.0): (13753, 0.195, 3.06e-3),
            ("llama-3.2-1b", 256, 0.0): (14860, 1.295, 4.06e-3), ("llama-3.2-1b", 256, 1.0): (13049, 1.440, 4.51e-3)}
# where advise misses by more than 15% (predicted ÷ measured), pinned so that a change in either shows (the 1B's
# decode steps since they are priced per layer: 5-7% cheaper than these H200 runs of 2026-12-02 measured them)
KNOWN_MISSES = {("llama-3.2-1b", 256, 0.0, "output_tokens_per_s"): 1.16,
                ("llama-3.2-1b", 256, 0.0, "tpot_s"): 0.76,
                ("llama-3.2-1b", 256, 0.0, "ttft_s"): 0.85,
                ("llama-3.2-1b", 64, 1.0, "output_tokens_per_s"): 1.17,
                ("llama-3.2-1b", 256, 1.0, "output_tokens_per_s"): 1.20,
                ("llama-3.2-1b", 256, 1.0, "tpot_s"): 0.77,
                ("llama-3.2-1b", 256, 1.0, "ttft_s"): 0.83,
                ("llama-3.2-1b", 64, 0.0, "ttft_s"): 0.75,
                ("llama-3.2-1b", 64, 1.0, "ttft_s"): 0.77}


# The same bench at ee152cc with `copt serve DIR --max-batch-size 256` (every client's request runs at once), 1B
# shape; no constant was fitted to it either.
HELD_OUT_256 = {("llama-3.2-1b", 64, 0.0): (14585, 0.185, 2.86e-3), ("llama-3.2-1b", 64, 1.0): (16008, 0.163, 2.63e-3),
                ("llama-3.2-1b", 256, 0.0): (21998, 0.532, 6.74e-3),
                ("llama-3.2-1b", 256, 1.0): (19278, 0.695, 6.98e-3)}
KNOWN_MISSES_256 = {("llama-3.2-1b", 256, 1.0, "ttft_s"): 0.85,
                    ("llama-3.2-1b", 64, 0.0, "output_tokens_per_s"): 1.185,
                    ("llama-3.2-1b", 64, 0.0, "tpot_s"): 0.81,
                    ("llama-3.2-1b", 64, 0.0, "ttft_s"): 0.81}

# `copt serve DIR` with today's defaults (--max-batch-size 256), H200, 2026-12-02, bench/gpu_serve_models.py
# (docs/benchmarks.md, real model sizes), copt's own client as above. The TTFT model (half the round's prefill, and
# the API process's intake per request) was read off this run's engine traces: not held out for TTFT.
DEFAULTS_256 = {("llama-3.1-8b", 64, 0.0): (5831, 0.404, 8.18e-3), ("llama-3.1-8b", 64, 1.0): (5703, 0.337, 8.41e-3),
                ("llama-3.1-8b", 256, 0.0): (8072, 1.304, 19.87e-3),
                ("llama-3.1-8b", 256, 1.0): (7671, 1.320, 21.25e-3),
                ("llama-3.2-1b", 64, 0.0): (16913, 0.151, 2.50e-3), ("llama-3.2-1b", 64, 1.0): (16098, 0.169, 2.68e-3),
                ("llama-3.2-1b", 256, 0.0): (21598, 0.544, 6.76e-3),
                ("llama-3.2-1b", 256, 1.0): (16356, 0.707, 9.27e-3)}
# the copt client's 1B sampled 256-client load ran slow in that run (guidellm's 24,463 tok/s, the engine's 25,605)
KNOWN_MISSES_DEFAULTS = {("llama-3.1-8b", 64, 0.0, "ttft_s"): 0.83,
                         ("llama-3.2-1b", 256, 1.0, "output_tokens_per_s"): 1.28,
                         ("llama-3.2-1b", 256, 1.0, "tpot_s"): 0.705,
                         ("llama-3.2-1b", 256, 1.0, "ttft_s"): 0.83}
# The same defaults measured by the third-party tester (guidellm 0.8: temperature 1, no top_p, two requests per
# stream, its own --seed per run) and by `copt profile endpoint` (top_p 0.95, closed loop for 10 s), H200,
# 2026-12-02, bench/gpu_serve_models.py at fd577c7 (no prompt served from the prefix cache: the server's counters
# read 0 hits for every load). Closed-loop clients fall out of step after their first round (the 8B's), so their TPOT
# is compared with tpot_out_of_step_s (each request decodes through a whole round's prefill); their TTFT p50 is then
# set by the queue the spread arrivals keep, which advise does not model: the in-step figure overshoots it on the 8B
# shape (guidellm's first round alone: 1.13).
THIRD_PARTY = {("llama-3.1-8b", 64, "guidellm"): (5899, 0.151, 9.27e-3),
               ("llama-3.1-8b", 256, "guidellm"): (8108, 0.478, 26.90e-3),
               ("llama-3.1-8b", 64, "profile"): (5511, 0.163, 9.64e-3),
               ("llama-3.1-8b", 256, "profile"): (8025, 0.328, 28.76e-3),
               ("llama-3.2-1b", 64, "guidellm"): (15035, 0.167, 2.89e-3),
               ("llama-3.2-1b", 256, "guidellm"): (19935, 0.625, 7.50e-3),
               ("llama-3.2-1b", 64, "profile"): (14152, 0.132, 3.49e-3),
               ("llama-3.2-1b", 256, "profile"): (17185, 0.459, 10.69e-3)}
# (guidellm's 1B streams stayed nearly in step at 256: later rounds started within 0.5 s)
KNOWN_MISSES_THIRD_PARTY = {("llama-3.1-8b", 256, "guidellm", "ttft_s"): 2.79,
                            ("llama-3.1-8b", 256, "profile", "ttft_s"): 4.07,
                            ("llama-3.1-8b", 64, "guidellm", "ttft_s"): 2.23,
                            ("llama-3.1-8b", 64, "profile", "ttft_s"): 2.06,
                            ("llama-3.2-1b", 256, "guidellm", "tpot_out_of_step_s"): 1.25,
                            ("llama-3.2-1b", 256, "profile", "output_tokens_per_s"): 1.22,
                            ("llama-3.2-1b", 256, "profile", "ttft_s"): 1.29}


def _check_held_out(case: tuple, measured: tuple, known_misses: dict, tpot_key: str = "tpot_s",
                    **plan_settings) -> None:
    """advise's figures against what the clients measured: within ±15% except the known misses, which stay where
    they were measured (±3%)."""
    from clusteropt_cli.core.advise.timing import infer_time

    model, clients, temperature = case
    top_p = plan_settings.pop("top_p", 0.95 if temperature else 1.0)
    plan_settings = {"prompt_len": 256, "gen_len": 128, **plan_settings}
    plan = InferPlan(batch=clients, continuous_batching=True, temperature=temperature, top_p=top_p, **plan_settings)
    figures = infer_time(load_model_spec(model), plan, Target(get_gpu("h200"))).figures
    for name, value in zip(("output_tokens_per_s", "ttft_s", tpot_key), measured, strict=True):
        ratio = figures[name] / value
        known = known_misses.get((*case, name))
        if known is None:
            assert 0.85 <= ratio <= 1.15, (case, name, ratio)
        else:
            assert ratio == pytest.approx(known, rel=0.03), (case, name, ratio)


@pytest.mark.parametrize("case", sorted(HELD_OUT))
def test_serving_predictions_against_the_h200_held_out_loads(case) -> None:
    """`copt serve DIR --max-batch-size 64` (the default then)."""
    _check_held_out(case, HELD_OUT[case], KNOWN_MISSES, max_batch_size=64)


@pytest.mark.parametrize("case", sorted(DEFAULTS_256))
def test_serving_predictions_against_copt_serves_defaults(case) -> None:
    """`copt serve DIR` with its defaults: advise's plan leaves the cap to the schema's default."""
    _check_held_out(case, DEFAULTS_256[case], KNOWN_MISSES_DEFAULTS)


def _check_tester(case: tuple, measured: tuple, known_misses: dict, **plan_settings) -> None:
    """A closed-loop tester's sampled load (guidellm without top_p, copt profile endpoint with top_p 0.95) against
    advise, its TPOT against the out-of-step figure."""
    model, clients, tester = case
    misses = {(model, clients, 1.0, name): ratio for (m, c, t, name), ratio in known_misses.items()
              if (m, c, t) == case}
    _check_held_out((model, clients, 1.0), measured, misses, tpot_key="tpot_out_of_step_s",
                    top_p=1.0 if tester == "guidellm" else 0.95, **plan_settings)


@pytest.mark.parametrize("case", sorted(THIRD_PARTY))
def test_serving_predictions_against_guidellm_and_profile_endpoint(case) -> None:
    _check_tester(case, THIRD_PARTY[case], KNOWN_MISSES_THIRD_PARTY)


# Held out for tpot_out_of_step_s (predicted at a4294c3, before the run): another workload, prompts of 512 tokens and
# 256 output tokens, 32 and 128 clients, 1B shape, copt serve's defaults, H200, 2026-12-02, bench/gpu_serve_models.py
# at 61350ef (docs/benchmarks.md, real model sizes); guidellm four requests per stream, profile endpoint 15 s loops.
HELD_OUT_512 = {("llama-3.2-1b", 32, "guidellm"): (11551, 0.152, 2.12e-3),
                ("llama-3.2-1b", 128, "guidellm"): (19676, 0.309, 5.40e-3),
                ("llama-3.2-1b", 32, "profile"): (12284, 0.100, 2.19e-3),
                ("llama-3.2-1b", 128, "profile"): (20961, 0.148, 5.39e-3)}
KNOWN_MISSES_512 = {("llama-3.2-1b", 128, "guidellm", "output_tokens_per_s"): 1.20,
                    ("llama-3.2-1b", 128, "guidellm", "ttft_s"): 1.25,
                    ("llama-3.2-1b", 128, "profile", "ttft_s"): 2.61,
                    ("llama-3.2-1b", 32, "guidellm", "output_tokens_per_s"): 1.26,
                    ("llama-3.2-1b", 32, "guidellm", "ttft_s"): 0.65}


@pytest.mark.parametrize("case", sorted(HELD_OUT_512))
def test_out_of_step_tpot_held_out_on_longer_requests(case) -> None:
    """Closed-loop testers' TPOT on a workload no constant saw: within ±15% of the out-of-step figure."""
    _check_tester(case, HELD_OUT_512[case], KNOWN_MISSES_512, prompt_len=512, gen_len=256)


@pytest.mark.parametrize("case", sorted(HELD_OUT_256))
def test_serving_predictions_against_the_h200_loads_at_256_running(case) -> None:
    """`copt serve DIR --max-batch-size 256`: the plan carries the cap."""
    _check_held_out(case, HELD_OUT_256[case], KNOWN_MISSES_256, max_batch_size=256)


# Batch 1 through `copt serve DIR` with its defaults (--compile-mode auto: autotuned batch-1 kernels), H200,
# bench/gpu_serve_models.py (docs/benchmarks.md, real model sizes), ms/token of one streaming request of 128 tokens,
# median of 3, greedy and sampled (temperature 1, top_p 0.95). The autotuning's share was fitted to the in-process
# decode profile, not to these.
BATCH_ONE = {("llama-3.1-8b", 0.0): 4.438, ("llama-3.1-8b", 1.0): 4.480, ("llama-3.2-1b", 0.0): 1.157,
             ("llama-3.2-1b", 1.0): 1.201}


@pytest.mark.parametrize("case", sorted(BATCH_ONE))
def test_batch_one_decode_against_copt_serves_defaults(case) -> None:
    from clusteropt_cli.core.advise.timing import infer_time

    model, temperature = case
    plan = InferPlan(batch=1, prompt_len=256, gen_len=128, continuous_batching=True, temperature=temperature,
                     top_p=0.95 if temperature else 1.0)
    figures = infer_time(load_model_spec(model), plan, Target(get_gpu("h200"))).figures
    assert figures["tpot_s"] * 1e3 == pytest.approx(BATCH_ONE[case], rel=0.05)


def test_serving_prediction_reproduces_the_h200_engine_anchor() -> None:
    """Batch-1 decode 1.16 ms/token through the server (1.22 before the autotuned batch-1 kernels); HF static
    generate at batch 64: 2,372 tok/s; vLLM has no measured overheads (roofline)."""
    from clusteropt_cli.core.advise.timing import infer_time

    target = Target(get_gpu("h200"))
    spec = load_model_spec("llama-3.2-1b")
    served = infer_time(spec, InferPlan(batch=256, prompt_len=144, gen_len=128, continuous_batching=True), target)
    one = infer_time(spec, InferPlan(batch=1, prompt_len=144, gen_len=128, continuous_batching=True), target)
    assert one.figures["tpot_s"] == pytest.approx(1.16e-3, rel=0.05)
    static = infer_time(spec, InferPlan(batch=64, prompt_len=144, gen_len=128), target)
    assert static.figures["output_tokens_per_s"] == pytest.approx(2372, rel=0.10)
    # vLLM has no measured overheads here: its figures are the roofline, an upper bound over copt's engine
    vllm = infer_time(spec, InferPlan(batch=256, prompt_len=144, gen_len=128, continuous_batching=True,
                                      engine="vllm"), target)
    assert vllm.figures["output_tokens_per_s"] > 3 * served.figures["output_tokens_per_s"]
    assert vllm.notes and "roofline" in vllm.notes[0]


def test_out_of_step_clients_decode_through_a_whole_rounds_prefill() -> None:
    """In step, a request decodes through about half of its round's prefill; out of step, through all of it; one
    client decodes through none."""
    from clusteropt_cli.core.advise.timing import infer_time

    spec, target = load_model_spec("llama-3.1-8b"), Target(get_gpu("h200"))
    f = infer_time(spec, InferPlan(batch=256, prompt_len=256, gen_len=128, continuous_batching=True), target).figures
    assert f["tpot_out_of_step_s"] == pytest.approx((128 * f["decode_step_s"] + f["prefill_s"]) / 127)
    assert f["tpot_s"] == pytest.approx((128 * f["decode_step_s"] + 0.5 * f["prefill_s"]) / 127)
    one = infer_time(spec, InferPlan(batch=1, prompt_len=256, gen_len=128, continuous_batching=True), target).figures
    assert one["tpot_out_of_step_s"] == one["tpot_s"] == one["decode_step_s"]
