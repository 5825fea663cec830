"""Engine loading: the tokenizer, model(s), the default max_model_len and the KV-cache size (the slots)."""

from __future__ import annotations

from typing import Any

from clusteropt_cli.errors import BadInputError


def resolve_decode_attention(choice: str, paged: bool = False, cuda: bool = False) -> str:
    """The decode-step attention for `auto`. Paged cache on CUDA: the Triton paged-decode kernel, which reads each
    sequence's blocks in place (gathering the blocks for the compiled plain-ops form cost 14× at batch 1 on an
    H200). Slot cache: plain tensor ops the compiler fuses (math); measured on an H200 (Llama-3.2-1B shape, one
    host): batch-1 decode 1.234 ms/token against 1.420 with masked SDPA (memory-efficient kernel over the padded
    bucket) and 1.377 with FlexAttention. The runner falls back to SDPA where the decode layers are not compiled."""
    if choice != "auto":
        return choice
    return "paged" if paged and cuda else "math"


CPU_KV_FRACTION = 0.1  # of the memory available after loading the model
CPU_KV_MAX_BYTES = 4 * 2**30  # vLLM's CPU backend reserved 4 GiB by default (VLLM_CPU_KVCACHE_SPACE)


def cpu_kv_capacity(per_token: int, cache_len: int, max_batch_size: int,
                    available: int | None = None) -> tuple[int, str]:
    """KV-cache capacity (tokens) on a device without a memory query of its own (the CPU), and why.

    What `max_batch_size` full-length sequences need, at most 10% of the memory available now (the model is
    loaded) and 4 GiB — never the ~11 GiB that 64 sequences × 4096 tokens of a 30-layer fp32 model would pin —
    but always one full sequence while it fits in half the available memory."""
    if available is None:
        import psutil

        available = int(psutil.virtual_memory().available)
    wanted = max_batch_size * cache_len
    budget = min(int(available * CPU_KV_FRACTION), CPU_KV_MAX_BYTES)
    capacity = min(wanted, budget // per_token)
    if capacity >= wanted:
        return wanted, f"--max-batch-size {max_batch_size} full sequences"
    why = (f"{CPU_KV_FRACTION:.0%} of {available / 2**30:.1f} GiB available" if budget < CPU_KV_MAX_BYTES
           else f"at most {CPU_KV_MAX_BYTES / 2**30:.0f} GiB")
    if capacity < cache_len and cache_len * per_token <= available // 2:
        return cache_len, f"one sequence: {why} holds less"
    return capacity, why


def capture_graphs_with_notice(runner: Any, max_batch: int, max_batch_tokens: int, log: Any) -> tuple[int, int]:
    """The runner's decode and prefill CUDA graphs (their layers compiled on the way), with a line to `log` before and
    after where it captures any: the longest silent stretch of a start (on an H200, 1B shape: the server healthy after
    112.6 s on a machine's second start, not within 200 s on its first). Returns (decode graphs, prefill graphs)."""
    import time

    capturing = bool(getattr(runner, "use_graphs", False))
    if capturing:
        print(f"copt serve: compiling the decode layers and capturing CUDA graphs (batches up to {max_batch}, "
              f"prefill up to {max_batch_tokens:,} tokens); a first start on a machine takes longest, later ones "
              "reuse torch.compile's cache ...", file=log, flush=True)
    started = time.perf_counter()
    decode = runner.capture_graphs(max_batch)
    prefill = runner.capture_prefill_graphs(max_batch_tokens)
    if capturing:
        done = (f"{decode} decode and {prefill} prefill graphs" if decode
                else "no decode graphs (decoding eagerly: see the warning above)")
        print(f"copt serve: {done} in {time.perf_counter() - started:.0f} s", file=log, flush=True)
    return decode, prefill


class EngineLoading:
    """Engine.load and the KV sizing it does (a part of Engine: it sets the engine's runner, slots and limits)."""

    def load(self) -> None:
        """Load the tokenizer, model(s) and allocate the KV cache (called by start())."""
        if self._loaded:
            return
        import torch
        from transformers import AutoConfig, AutoTokenizer
        from transformers.utils import logging as hf_logging

        from clusteropt_cli.core.serve.architectures import make_runner
        from clusteropt_cli.core.serve.kv_budget import (
            activation_reserve,
            choose_max_model_len,
            default_max_batch_tokens,
            describe_choice,
            utilization_budget,
        )
        from clusteropt_cli.core.serve.runner import ModelRunner, resolve_dtype

        hf_logging.disable_progress_bar()
        cfg = self.config
        device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer or cfg.model)
        hf_config = AutoConfig.from_pretrained(cfg.model)
        text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        ctx = int(getattr(text_config, "max_position_embeddings", 4096) or 4096)
        if cfg.max_model_len and cfg.max_model_len > ctx:
            raise BadInputError(f"--max-model-len {cfg.max_model_len} exceeds the model's context of {ctx} tokens.",
                                hint=f"Pass --max-model-len {ctx} or less.")
        spec_extra = cfg.num_speculative_tokens + 1 if (cfg.draft_model or cfg.prompt_lookup) else 0
        dtype = resolve_dtype(cfg.dtype, device, getattr(hf_config, "dtype", None))
        elt = torch.empty((), dtype=dtype).element_size()
        from clusteropt_cli.core.serve.architectures import inspect_architecture, pages_kv_cache

        # a paged cache unless asked for slots, a layer keeps a sliding-window ring or the model is served through
        # transformers' own attention (the runner decides finally)
        plan_paged = pages_kv_cache(inspect_architecture(text_config, ctx), cfg.kv_layout)
        if cfg.kv_cache_dtype == "fp8":
            if cfg.kv_layout == "slots" or not plan_paged:
                raise BadInputError("--kv-cache-dtype fp8 needs the paged KV cache (models without sliding-window "
                                    "layers).", hint="Drop --kv-cache-dtype or --kv-layout slots.")
            if device.startswith("cuda") and torch.cuda.get_device_capability(torch.device(device)) < (8, 9):
                name = torch.cuda.get_device_name(torch.device(device))
                raise BadInputError(f"--kv-cache-dtype fp8 needs FP8 hardware (compute capability 8.9 or later: Ada, "
                                    f"Hopper, Blackwell); {name} has none.", hint="Drop --kv-cache-dtype fp8.")
        kv_elt = 1 if cfg.kv_cache_dtype == "fp8" else elt  # KV bytes per element (the model keeps its dtype)
        draft_text = None
        if cfg.draft_model:
            draft_config = AutoConfig.from_pretrained(cfg.draft_model)
            draft_text = draft_config.get_text_config() if hasattr(draft_config, "get_text_config") else draft_config

        def bytes_per_token(length: int) -> int:  # of a slot `length` tokens long, draft model included
            n = ModelRunner.kv_bytes_per_token_of(text_config, kv_elt, length)
            if draft_text is not None:
                n += ModelRunner.kv_bytes_per_token_of(draft_text, kv_elt, length)
            return n

        cuda = device.startswith("cuda")
        self.max_batch_tokens = int(cfg.max_batch_tokens or default_max_batch_tokens(device))
        free_at_start = total = None
        reserve = 0
        if cuda:
            torch.cuda.empty_cache()  # blocks cached by this process (an engine before this one) count as free
            free_at_start, total = torch.cuda.mem_get_info(torch.device(device))
            reserve = activation_reserve(text_config, self.max_batch_tokens, cfg.max_batch_size, elt)
            sized_by_memory = cfg.kv_cache_tokens is None and cfg.kv_cache_memory_gib is None
            if cfg.gpu_memory_utilization is not None and sized_by_memory:
                try:  # as vLLM: the memory free at start-up must cover utilization × total
                    utilization_budget(total, free_at_start, 0, cfg.gpu_memory_utilization, 0)
                except ValueError as exc:
                    raise BadInputError(f"{exc}.", hint="Lower --gpu-memory-utilization, or free the GPU "
                                        "(other processes hold the rest).") from exc
        self.length_choice = None
        self.length_budget_why = ""
        if cfg.max_model_len:
            max_len = int(cfg.max_model_len)
        else:  # the full context when the budget holds --max-batch-size sequences of it (kv_budget.py)
            budget, per_token_of, self.length_budget_why = self._planned_kv_budget(
                device, hf_config, elt, bytes_per_token, free_at_start, total, reserve)
            # paged: the full context as soon as one sequence of it fits (vLLM's rule: shorter ones share the pool)
            wanted = 1 if plan_paged else cfg.max_batch_size
            self.length_choice = choose_max_model_len(ctx, per_token_of, budget, wanted, spec_extra)
            max_len = self.length_choice.max_model_len
        cache_len = max_len + spec_extra
        per_token = bytes_per_token(cache_len)
        use_graphs = cfg.cuda_graphs if cfg.cuda_graphs is not None else device.startswith("cuda")

        use_compile = cfg.compile if cfg.compile is not None else use_graphs
        # copt's slot attention for verified architectures, transformers' own otherwise (with a notice)
        self.runner = make_runner(cfg.model, device=device, dtype=cfg.dtype, num_slots=None, max_len=cache_len,
                                  cuda_graphs=use_graphs, compile_decode=use_compile, compile_mode=cfg.compile_mode,
                                  decode_attention=resolve_decode_attention(cfg.decode_attention, plan_paged, cuda))
        self.draft_runner = None
        if cfg.draft_model:
            self.draft_runner = make_runner(cfg.draft_model, device=device, dtype=cfg.dtype, num_slots=None,
                                            max_len=cache_len, cuda_graphs=False)
            if self.draft_runner.vocab_size != self.runner.vocab_size:
                raise BadInputError(
                    f"--draft-model vocabulary ({self.draft_runner.vocab_size}) differs from the model's "
                    f"({self.runner.vocab_size}).", hint="Use a draft model trained with the same tokenizer.")
        capacity = cfg.kv_cache_tokens
        if capacity is None and cfg.kv_cache_memory_gib is not None:
            capacity = int(cfg.kv_cache_memory_gib * 2**30 // per_token)
        if capacity is None and device.startswith("cuda"):
            # weights are loaded: size the cache from free GPU memory (never from system RAM)
            free, total = torch.cuda.mem_get_info(torch.device(device))
            if cfg.gpu_memory_utilization is not None:  # vLLM's budget: the whole engine within util × total
                engine_bytes = max(0, free_at_start - free)  # what loading took (weights, context, kernels)
                budget = int(total * cfg.gpu_memory_utilization) - engine_bytes - reserve
                if budget <= 0:
                    raise BadInputError(
                        f"--gpu-memory-utilization {cfg.gpu_memory_utilization} leaves no room for a KV cache: the "
                        f"engine holds {engine_bytes / 2**30:.1f} GiB after loading and keeps "
                        f"{reserve / 2**30:.1f} GiB for activations, of {cfg.gpu_memory_utilization} × "
                        f"{total / 2**30:.1f} GiB.", hint="Raise --gpu-memory-utilization.")
                capacity = int(budget // per_token)
            else:
                capacity = int(free * cfg.gpu_memory_fraction // per_token)
        self.kv_cache_choice = None
        if capacity is None:  # CPU: from the model's bytes per token and the machine's available memory
            capacity, self.kv_cache_choice = cpu_kv_capacity(per_token, cache_len, cfg.max_batch_size)
        paged = plan_paged and getattr(self.runner, "can_page", False) and (
            self.draft_runner is None or getattr(self.draft_runner, "can_page", False))
        if cfg.kv_layout == "paged" and not paged:
            raise BadInputError("This model cannot use the paged KV cache (a sliding-window layer or a model served "
                                "through transformers' own attention).", hint="Drop --kv-layout paged.")
        if paged:
            spare = cache_len - max_len
            if not cfg.max_model_len and capacity < cache_len:
                # the length planned before loading does not fit the memory measured after it (a quantized
                # checkpoint dequantized at load, another process): the longest power of two that does
                fitted = 1 << max(0, (capacity - spare).bit_length() - 1)
                if fitted >= 128:
                    max_len, cache_len = fitted, fitted + spare
                    self.runner.max_len = cache_len
                    if self.draft_runner is not None:
                        self.draft_runner.max_len = cache_len
                    self.length_budget_why += "; shortened to what the memory measured after loading holds"
            self._allocate_paged(capacity, cache_len, device)
        else:
            slots = min(cfg.max_batch_size, capacity // cache_len)
            if slots < 1:
                raise BadInputError(
                    f"The KV cache holds {capacity} tokens, less than one sequence of {cache_len} tokens.",
                    hint="Raise --kv-cache-blocks / --kv-cache-memory, or lower --max-model-len.")
            self.runner.allocate(slots)
            if self.draft_runner is not None:
                self.draft_runner.allocate(slots)
            self.num_slots = slots
            self.stats.kv_cache_tokens = slots * cache_len
        slots = self.num_slots
        self.max_model_len = max_len
        self.stats.num_slots = slots
        self.kv_cache_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in self.runner.caches)
        import sys

        if self.kv_cache_choice is not None:
            held = (f"{self.pool.num_blocks:,} blocks × {self.pool.block_size} tokens" if paged
                    else f"{slots} sequences × {cache_len} tokens")
            print(f"copt serve: KV cache on {device}: {held} = {self.kv_cache_bytes / 2**30:.2f} GiB "
                  f"({per_token / 1024:.0f} KiB per token; {self.kv_cache_choice}); --kv-cache-memory or "
                  "--kv-cache-blocks set it.", file=sys.stderr, flush=True)
        if self.length_choice is not None:
            if paged:
                full = self.pool.num_blocks // self.pool.blocks_for(cache_len)
                print(f"copt serve: max_model_len {max_len:,} of the model's {ctx:,}-token context; paged KV cache "
                      f"of {self.pool.num_blocks * self.pool.block_size:,} tokens ({self.kv_cache_bytes / 2**30:.2f} "
                      f"GiB; {self.length_budget_why}) holds {full:,} sequences of that length, more when shorter "
                      f"(at most --max-batch-size {slots} run at once). --max-model-len sets the length; "
                      "--gpu-memory-utilization (or --kv-cache-memory) the pool.", file=sys.stderr, flush=True)
            else:
                print(describe_choice(self.length_choice, ctx, slots, self.kv_cache_bytes, self.length_budget_why),
                      file=sys.stderr, flush=True)
        self.stats.graphs_captured, self.stats.prefill_graphs = capture_graphs_with_notice(
            self.runner, slots, self.max_batch_tokens, sys.stderr)
        self.eos_ids = self._eos_ids()
        from clusteropt_cli.core.serve.sampling import generation_defaults

        self.sampling_defaults = generation_defaults(cfg.model)  # what vLLM applies when a request omits them
        self.model_name = cfg.model
        self._free_slots = list(range(slots))  # a min-heap: lowest slot first keeps decode batches small
        import random

        self._rng = random.Random(0)  # seeds of requests that send none
        self._loaded = True

    def _allocate_paged(self, capacity: int, cache_len: int, device: str) -> None:
        """A block pool of `capacity` tokens shared by --max-batch-size rows (a draft model's pool mirrors it)."""
        import torch

        from clusteropt_cli.core.serve.kv_blocks import BlockPool

        cfg = self.config
        block_size = int(cfg.block_size)
        num_blocks = capacity // block_size
        per_sequence = -(-cache_len // block_size)
        if num_blocks < per_sequence:
            raise BadInputError(
                f"The KV cache holds {num_blocks * block_size:,} tokens, less than one sequence of {cache_len:,} "
                "tokens.", hint="Raise --kv-cache-blocks / --kv-cache-memory, or lower --max-model-len.")
        kv_dtype = torch.float8_e4m3fn if cfg.kv_cache_dtype == "fp8" else None
        rows = int(cfg.max_batch_size)
        self.runner.allocate_paged(rows, num_blocks, block_size, kv_dtype)
        if self.draft_runner is not None:
            self.draft_runner.allocate_paged(rows, num_blocks, block_size, kv_dtype, tables=self.runner.tables)
        # a draft model's cache of a cached block may never have been computed: no prefix caching with one
        caching = cfg.enable_prefix_caching and self.draft_runner is None
        self.pool = BlockPool(num_blocks, block_size, enable_caching=caching)
        self.num_slots = rows
        self.stats.kv_blocks, self.stats.block_size = num_blocks, block_size
        self.stats.kv_cache_tokens = num_blocks * block_size

    def _planned_kv_budget(self, device: str, hf_config: Any, elt: int, bytes_per_token: Any,
                           free_at_start: int | None, total: int | None, reserve: int) -> tuple[int, Any, str]:
        """The KV budget the default max_model_len is chosen for, before the weights are loaded: (budget, bytes per
        token (or 1 for a budget in tokens), why). Loading measures the real one; the slots follow it."""
        from clusteropt_cli.core.serve.kv_budget import checkpoint_weight_bytes, utilization_budget

        cfg = self.config
        if cfg.kv_cache_tokens is not None:
            return int(cfg.kv_cache_tokens), 1, f"--kv-cache-blocks: {cfg.kv_cache_tokens:,} tokens"
        if cfg.kv_cache_memory_gib is not None:
            gib = cfg.kv_cache_memory_gib
            return int(gib * 2**30), bytes_per_token, f"--kv-cache-memory {gib:g} GiB"
        if not device.startswith("cuda"):
            import psutil

            available = int(psutil.virtual_memory().available)
            budget = min(int(available * CPU_KV_FRACTION), CPU_KV_MAX_BYTES)
            return budget, bytes_per_token, (f"CPU: {budget / 2**30:.1f} GiB, {CPU_KV_FRACTION:.0%} of the memory "
                                             f"available, at most {CPU_KV_MAX_BYTES / 2**30:.0f} GiB")
        weights = checkpoint_weight_bytes(cfg.model, elt, hf_config)
        if cfg.draft_model:
            weights += checkpoint_weight_bytes(cfg.draft_model, elt)
        if cfg.gpu_memory_utilization is not None:
            budget = utilization_budget(total, free_at_start, weights, cfg.gpu_memory_utilization, reserve)
            return budget, bytes_per_token, (f"--gpu-memory-utilization {cfg.gpu_memory_utilization:g} of "
                                             f"{total / 2**30:.0f} GiB, less the weights and activations")
        budget = int((free_at_start - weights) * cfg.gpu_memory_fraction)
        return budget, bytes_per_token, (f"{cfg.gpu_memory_fraction:.0%} of the GPU memory free after the weights")

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.runner.model, "generation_config", None), self.runner.model.config):
            eos = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, (list, tuple)):
                ids.update(int(e) for e in eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids
