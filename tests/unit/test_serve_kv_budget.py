"""copt serve's default max_model_len and its --gpu-memory-utilization arithmetic (core/serve/kv_budget.py)."""

from __future__ import annotations

import pytest

from clusteropt_cli.core.serve.kv_budget import (
    LengthChoice,
    activation_reserve,
    checkpoint_weight_bytes,
    choose_max_model_len,
    describe_choice,
    utilization_budget,
)

GIB = 2**30
LLAMA_31_8B = 32 * 2 * 8 * 128 * 2  # KV bytes per token, bf16: 128 KiB
CONTEXT = 131072


def test_full_context_when_max_batch_size_sequences_of_it_fit():
    exact = 64 * CONTEXT * LLAMA_31_8B
    assert choose_max_model_len(CONTEXT, LLAMA_31_8B, exact, 64) == LengthChoice(
        CONTEXT, 64, "64 sequences of the model's full context fit")
    # one byte less: the longest power of two below the context that keeps 64
    below = choose_max_model_len(CONTEXT, LLAMA_31_8B, exact - 1, 64)
    assert (below.max_model_len, below.slots) == (65536, 64)
    # a single-user server takes the whole context from a small budget
    assert choose_max_model_len(CONTEXT, LLAMA_31_8B, 17 * GIB, 1).max_model_len == CONTEXT


def test_the_longest_power_of_two_that_keeps_the_concurrency():
    # an H200 with ~100 GiB left for the cache: 819,200 tokens = 64 × 12,800 → 8,192 each
    choice = choose_max_model_len(CONTEXT, LLAMA_31_8B, 100 * GIB, 64)
    assert (choice.max_model_len, choice.slots) == (8192, 64)
    assert "8,192 tokens is the longest power of two that keeps 64" in choice.reason
    assert choose_max_model_len(CONTEXT, LLAMA_31_8B, 64 * 16384 * LLAMA_31_8B, 64).max_model_len == 16384
    assert choose_max_model_len(CONTEXT, LLAMA_31_8B, 64 * 16384 * LLAMA_31_8B - 1, 64).max_model_len == 8192


def test_never_below_4096_unless_the_budget_forces_it():
    # 64 × 4,096 tokens would be 32 GiB: 4,096 tokens for the 20 sequences 10 GiB holds, not 64 short ones
    choice = choose_max_model_len(CONTEXT, LLAMA_31_8B, 10 * GIB, 64)
    assert (choice.max_model_len, choice.slots) == (4096, 20)
    # not one 4,096-token sequence fits in 256 MiB (2,048 tokens): one sequence of 2,048
    assert choose_max_model_len(CONTEXT, LLAMA_31_8B, 256 * 2**20, 64) == LengthChoice(
        2048, 1, "not one sequence of 4,096 tokens fits; one of 2,048 does")
    # not even 128 tokens: no slot (the engine refuses to start)
    assert choose_max_model_len(CONTEXT, LLAMA_31_8B, 127 * LLAMA_31_8B, 64).slots == 0


def test_contexts_shorter_than_the_floor_are_kept_whole():
    assert choose_max_model_len(2048, 1000, 64 * 2048 * 1000, 64) == LengthChoice(
        2048, 64, "64 sequences of the model's full context fit")
    choice = choose_max_model_len(2048, 1000, 10 * 2048 * 1000, 64)
    assert (choice.max_model_len, choice.slots) == (2048, 10)


def test_budgets_in_tokens_speculative_columns_and_length_dependent_bytes():
    # a budget in tokens (--kv-cache-blocks): one byte per token
    assert choose_max_model_len(8192, 1, 4 * 8192, 4).max_model_len == 8192
    # speculative decoding's verification columns belong to every slot
    assert choose_max_model_len(8192, 1, 4 * 8192, 4, extra_tokens=5).max_model_len == 4096
    assert choose_max_model_len(8192, 1, 4 * 8197, 4, extra_tokens=5).max_model_len == 8192
    # sliding-window rings: fewer bytes per token over a longer slot (asked for the slot's length)
    asked = []

    def ringed(length):
        asked.append(length)
        return 1000 if length > 4096 else 2000

    assert choose_max_model_len(16384, ringed, 2 * 16384 * 1000, 2).max_model_len == 16384
    assert asked == [16384]


def test_gpu_memory_utilization_is_the_whole_engine_within_a_fraction_of_the_device():
    total = 141 * GIB
    # the engine (16 GiB of weights and context, 2 GiB for activations) and its cache within 0.9 × total
    assert utilization_budget(total, 140 * GIB, 16 * GIB, 0.9, 2 * GIB) == int(total * 0.9) - 18 * GIB
    # what other processes hold does not shrink the budget (vLLM's meaning) ...
    assert utilization_budget(total, 100 * GIB, 16 * GIB, 0.5, 2 * GIB) == int(total * 0.5) - 18 * GIB
    # ... but the fraction must be free at start-up, or the engine refuses (as vLLM does)
    with pytest.raises(ValueError, match="only 100.0 GiB are free"):
        utilization_budget(total, 100 * GIB, 16 * GIB, 0.9, 2 * GIB)


def test_weights_estimated_from_the_checkpoint_before_loading(tmp_path):
    from types import SimpleNamespace

    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"\0" * 600)
    (tmp_path / "ignored.bin").write_bytes(b"\0" * 999)  # safetensors take precedence
    assert checkpoint_weight_bytes(tmp_path, 2, SimpleNamespace(dtype="float32")) == 800  # fp32 served in bf16
    assert checkpoint_weight_bytes(tmp_path, 2, SimpleNamespace(dtype="bfloat16")) == 1600
    assert checkpoint_weight_bytes(tmp_path, 4, SimpleNamespace(dtype="bfloat16")) == 3200
    quantized = SimpleNamespace(dtype="bfloat16", quantization_config={"quant_method": "compressed-tensors"})
    assert checkpoint_weight_bytes(tmp_path, 2, quantized) == 1600  # as stored
    assert checkpoint_weight_bytes(tmp_path / "missing", 2) == 0


def test_activation_reserve_grows_with_the_step_and_the_vocabulary():
    from types import SimpleNamespace

    small = SimpleNamespace(hidden_size=64, intermediate_size=128, vocab_size=1000)
    big = SimpleNamespace(hidden_size=4096, intermediate_size=14336, vocab_size=128256)
    assert activation_reserve(small, 512, 4, 4) == 2 * (512 * 512 * 4 + 4 * 1000 * 8) + GIB
    # 2 × (2048 tokens × (4 × 4096 + 2 × 14336) × 2 bytes + 64 × 128256 × 4 × 2) + 1 GiB
    assert activation_reserve(big, 2048, 64, 2) == 2 * (2048 * 45056 * 2 + 64 * 128256 * 8) + GIB


def test_the_start_up_line_says_what_was_chosen_why_and_how_to_change_it():
    choice = choose_max_model_len(CONTEXT, LLAMA_31_8B, 100 * GIB, 64)
    line = describe_choice(choice, CONTEXT, 64, 64 * 8192 * LLAMA_31_8B, "--gpu-memory-utilization 0.9")
    assert line.startswith("copt serve: max_model_len 8,192 of the model's 131,072-token context, 64 concurrent")
    assert "64.00 GiB of KV cache" in line and "--max-model-len" in line and "--gpu-memory-utilization" in line
    # fewer slots measured after loading than planned: said so
    assert "the memory measured after loading holds 60" in describe_choice(choice, CONTEXT, 60, 1, "x")


def test_engine_serves_the_full_context_by_default_and_says_so(fixtures, capfd):
    from clusteropt_cli.core.serve.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model=str(fixtures.teacher), device="cpu", max_batch_size=2))
    engine.load()  # the teacher's context is 1,024 tokens: the paged pool holds it
    err = capfd.readouterr().err
    assert engine.max_model_len == 1024 and engine.num_slots == 2 and engine.pool is not None
    assert "copt serve: max_model_len 1,024 of the model's 1,024-token context; paged KV cache of 2,048 tokens" in err
    assert "holds 2 sequences of that length, more when shorter" in err and "--max-model-len sets the length" in err
    # paged: a budget of 1,500 tokens holds one 1,024-token sequence; the length stays and four rows share the pool
    engine = Engine(EngineConfig(model=str(fixtures.teacher), device="cpu", max_batch_size=4,
                                 kv_cache_tokens=1500))
    engine.load()
    err = capfd.readouterr().err
    assert (engine.max_model_len, engine.num_slots, engine.pool.num_blocks) == (1024, 4, 93)
    assert "holds 1 sequences of that length" in err and "--kv-cache-blocks: 1,500 tokens" in err
    # the slot layout: one max_model_len slot per sequence, so the concurrency goes
    engine = Engine(EngineConfig(model=str(fixtures.teacher), device="cpu", max_batch_size=4,
                                 kv_cache_tokens=1500, kv_layout="slots"))
    engine.load()
    err = capfd.readouterr().err
    assert (engine.max_model_len, engine.num_slots) == (1024, 1)
    assert "4 sequences of 1,024 tokens do not fit; only 1 does" in err and "--kv-cache-blocks: 1,500 tokens" in err
    # an explicit --max-model-len is taken as given (no length line)
    engine = Engine(EngineConfig(model=str(fixtures.teacher), device="cpu", max_batch_size=2, max_model_len=256))
    engine.load()
    assert engine.max_model_len == 256 and "max_model_len" not in capfd.readouterr().err
