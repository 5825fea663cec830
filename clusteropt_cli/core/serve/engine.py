"""copt's in-process generation engine: continuous batching, chunked prefill, speculative decoding.

This is the public, in-process API (used by `copt serve` and by `copt distill traces`)::

    from clusteropt_cli.core.serve.engine import Engine, GenerationRequest
    from clusteropt_cli.recipe.schema.serve import ServeRecipe

    engine = Engine.from_settings(ServeRecipe(model="path/to/model", max_batch_size=32))
    engine.start()
    results = engine.generate([GenerationRequest(prompt_ids=ids, max_new_tokens=64) for ids in prompts])
    handle = engine.submit(GenerationRequest(prompt_ids=ids, max_new_tokens=64, temperature=0.7, seed=1))
    for token_ids in handle:            # or: async for token_ids in handle
        ...
    print(handle.result().text, handle.result().finish_reason)
    engine.stop()

How it works: one background thread runs the scheduler. Every iteration it (1) drops cancelled requests and
frees their rows and KV blocks, (2) admits waiting requests while free blocks cover their prompt (reusing cached
blocks of a shared prefix: kv_blocks.py), (3) runs one decode step for every sequence that is generating (a CUDA
graph per batch-size bucket on GPU; a speculative draft+verify step instead when few sequences run), giving each
the block its next token needs and preempting the newest requests when none is free, and (4) spends the rest of
the `max_batch_tokens` budget on prompt chunks (chunked prefill), so requests join and leave at every step and long
prompts never stall decoding. Models whose sliding-window layers keep a ring use a slot per sequence instead.

This module holds the engine's state and scheduler; requests.py the client-facing objects (requests, results,
handles, errors), loading.py the model load and KV-cache sizing, speculative.py the draft-and-verify step.
"""

from __future__ import annotations

import heapq
import itertools
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from clusteropt_cli.core.serve.kv_blocks import hash_chain as hash_chain_of
from clusteropt_cli.core.serve.kv_budget import DEFAULT_GPU_MEMORY_FRACTION, DEFAULT_MAX_BATCH_SIZE
from clusteropt_cli.core.serve.loading import EngineLoading
from clusteropt_cli.core.serve.requests import (
    EngineDeadError,
    EngineObserver,
    EngineStoppedError,
    GenerationRequest,
    GenerationResult,
    InvalidRequestError,
    QueueFullError,
    RequestHandle,
    TextStream,
    _wake_all,
    is_fatal_device_error,
)
from clusteropt_cli.core.serve.speculative import SpeculativeDecoding
from clusteropt_cli.errors import BadInputError

if TYPE_CHECKING:
    from clusteropt_cli.core.serve.device_sampling import RowSettings
    from clusteropt_cli.recipe.schema.serve import ServeRecipe

# the public in-process API (the request objects live in requests.py; importing them from here keeps working)
__all__ = ["Engine", "EngineConfig", "EngineDeadError", "EngineObserver", "EngineStats", "EngineStoppedError",
           "GenerationRequest", "GenerationResult", "InvalidRequestError", "QueueFullError", "RequestHandle",
           "TextStream"]


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    num_slots: int = 0
    kv_cache_usage: float = 0.0
    kv_cache_tokens: int = 0
    steps: int = 0
    decode_steps: int = 0
    spec_steps: int = 0
    prefill_chunks: int = 0
    prompt_tokens_shared: int = 0  # prompt tokens copied from another choice's KV cache (n > 1) instead of computed
    prompt_tokens: int = 0
    generated_tokens: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    graphs_captured: int = 0
    prefill_graphs: int = 0  # captured prefill steps (token buckets) for prompts that start a sequence
    chained_steps: int = 0  # decode steps launched ahead by async scheduling
    # paged KV cache: blocks, automatic prefix caching (tokens looked up / found), preemptions (recomputed later)
    kv_blocks: int = 0
    block_size: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0
    peak_running: int = 0  # most sequences admitted at once (holding a row and their KV) since start
    # wall seconds the engine thread spent per phase of its steps (where the time goes)
    phase_s: dict[str, float] = field(default_factory=dict)

    def add_phase(self, name: str, seconds: float) -> None:
        self.phase_s[name] = self.phase_s.get(name, 0.0) + seconds

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted / self.spec_drafted if self.spec_drafted else 0.0


_heap_lock = threading.Lock()
_heap_holders = 0  # running engines of this process


def _hold_startup_heap() -> None:
    """A starting engine leaves every object that exists once it is loaded (the model, torch, transformers) out of
    the garbage collector's full collections, as `copt serve` and vLLM do: otherwise a full collection walks that
    heap while every request waits (on the H200 host one in-process 256-request run in three stopped ~0.9 s for one).
    Cyclic garbage of the start-up is collected first; the objects go back to the collector when the process's last
    running engine stops."""
    import gc

    global _heap_holders
    with _heap_lock:
        if _heap_holders == 0:
            gc.collect()
        gc.freeze()
        _heap_holders += 1


def _release_startup_heap() -> None:
    import gc

    global _heap_holders
    with _heap_lock:
        _heap_holders = max(0, _heap_holders - 1)
        if _heap_holders == 0:
            gc.unfreeze()


class StepTrace:
    """Where the engine thread's time goes, step by step (a diagnostic: `COPT_ENGINE_TRACE=<folder>` makes every
    Engine record its steps and finished requests and write them to <folder>/engine-trace-<pid>-<n>.json at stop).
    A step: [start, end, running, waiting, decode steps, chained decode steps, prompt tokens, generated tokens];
    a request: [arrival, first token, finish, prompt tokens, output tokens, request id]. Times are
    time.perf_counter() seconds (CLOCK_MONOTONIC: comparable between processes of one machine); `clock` pairs one
    with time.time()."""

    _written = itertools.count()
    MAX_ENTRIES = 1_000_000  # steps and requests kept each (about 100 MB): a long-running server keeps its first ones

    def __init__(self, folder: str):
        self.folder = folder
        self.clock = (time.time(), time.perf_counter())
        self.steps: list[tuple] = []
        self.requests: list[tuple] = []
        self._open: tuple = ()

    @classmethod
    def from_env(cls) -> StepTrace | None:
        folder = os.environ.get("COPT_ENGINE_TRACE")
        return cls(folder) if folder else None

    @staticmethod
    def _counts(engine: Engine) -> tuple[int, int, int, int]:
        s = engine.stats
        return s.decode_steps, s.chained_steps, s.prompt_tokens, s.generated_tokens

    def before(self, engine: Engine) -> None:
        self._open = (time.perf_counter(), len(engine._running), len(engine._waiting), *self._counts(engine))

    def after(self, engine: Engine) -> None:
        t0, running, waiting, *before = self._open
        now = self._counts(engine)
        if len(self.steps) < self.MAX_ENTRIES:
            self.steps.append((t0, time.perf_counter(), running, waiting,
                               *(a - b for a, b in zip(now, before, strict=True))))

    def finished(self, seq: _Seq, now: float) -> None:
        if len(self.requests) < self.MAX_ENTRIES:
            self.requests.append((seq.t_arrival, seq.t_first, now, len(seq.prompt), len(seq.out), seq.rid))

    def write(self) -> None:
        """Write the trace (a folder that cannot be written is reported on stderr; stopping goes on)."""
        from clusteropt_cli.core.io import write_diagnostic_json

        path = os.path.join(self.folder, f"engine-trace-{os.getpid()}-{next(self._written)}.json")
        write_diagnostic_json(path, {"clock": self.clock, "steps": self.steps, "requests": self.requests},
                              "engine trace")
        self.steps, self.requests = [], []


class _Seq:
    """Engine-side state of one request."""

    __slots__ = ("req", "handle", "rid", "prompt", "out", "num_computed", "slot", "draft_computed", "settings",
                 "temperature", "top_p", "stop_ids", "max_new", "t_arrival", "t_first", "t_last", "drafted",
                 "accepted", "finish_reason", "stop_reason", "text", "prompt_lp", "prompt_rank", "fault", "detok",
                 "leader", "matcher", "blocks", "hashes", "registered")

    def __init__(self, req: GenerationRequest, handle: RequestHandle, stop_ids: set[int], max_new: int,
                 settings: RowSettings):
        self.req, self.handle, self.rid = req, handle, handle.request_id
        self.prompt = list(req.prompt_ids)
        self.out: list[int] = []
        self.num_computed = 0
        self.slot = -1
        self.draft_computed = 0
        self.settings = settings
        self.temperature, self.top_p = float(req.temperature), float(req.top_p)
        self.prompt_lp: list[Any] | None = [None] if req.prompt_logprobs is not None else None
        self.prompt_rank: list[int | None] | None = [None] if req.prompt_logprobs is not None else None
        self.leader: _Seq | None = None  # shares the prompt's KV cache of this sequence (n > 1)
        self.stop_ids, self.max_new = stop_ids, max_new
        self.t_arrival = time.perf_counter()
        self.t_first: float | None = None
        self.t_last = self.t_arrival
        self.drafted = self.accepted = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.text: str | None = None
        self.fault: str | None = None  # why this request failed alone (finish_reason "error")
        self.detok: TextStream | None = None  # incremental text of the output, for stop strings
        self.matcher = req.grammar.matcher() if req.grammar is not None else None  # constrained decoding
        self.blocks: list[int] = []  # paged KV cache: the physical blocks of positions 0, bs, 2·bs, ...
        self.hashes: list[bytes] = []  # prefix-cache hashes of the full blocks of all_ids()
        self.registered = 0  # leading blocks registered in the prefix cache

    @property
    def kv_target(self) -> int:
        """Positions whose KV must be computed before the sequence decodes: its prompt, or (recomputing after a
        preemption) everything but the last token, which the next decode step feeds."""
        return self.length - 1 if self.out else len(self.prompt)

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.out)

    def last_token(self) -> int:
        return self.out[-1] if self.out else self.prompt[-1]

    def all_ids(self) -> list[int]:
        return self.prompt + self.out


@dataclass
class EngineConfig:
    """Engine settings (derived from a ServeRecipe by Engine.from_settings)."""

    model: str
    device: str | None = None  # None: cuda when available
    dtype: str = "auto"
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    max_batch_tokens: int | None = None
    max_model_len: int | None = None
    max_queue: int = 1024
    kv_cache_tokens: int | None = None  # capacity in tokens (None: slots × max_model_len / free GPU memory)
    kv_cache_memory_gib: float | None = None
    draft_model: str | None = None
    tokenizer: str | None = None  # the tokenizer's directory (None: the model's)
    num_speculative_tokens: int = 4
    prompt_lookup: int | None = None
    speculative_max_batch: int = 4
    cuda_graphs: bool | None = None
    compile: bool | None = None  # None: with CUDA graphs
    compile_mode: str = "auto"  # torch.compile mode of the decode layers (runner.decode_compile_modes)
    async_scheduling: bool = True  # greedy decode stretches: launch step k+1 before handling step k's tokens
    # decode-step attention of the compiled layers: "sdpa" (masked SDPA), "flex" (FlexAttention) or "math" (plain
    # tensor ops the compiler fuses); "auto" resolves in resolve_decode_attention
    decode_attention: str = "auto"
    # of the memory free after loading (when gpu_memory_utilization is None)
    gpu_memory_fraction: float = DEFAULT_GPU_MEMORY_FRACTION
    gpu_memory_utilization: float | None = None  # vLLM's meaning: of the device's total memory, for everything
    block_size: int = 16  # tokens per KV block (paged cache)
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # "fp8": KV blocks stored as float8 e4m3 (paged cache)
    kv_layout: str = "auto"  # "paged" (block pool), "slots" (a max_model_len slot per sequence), auto: paged if it can


class Engine(EngineLoading, SpeculativeDecoding):
    """Continuous-batching generation over a paged (or slot) KV cache (see the module docstring for the API)."""

    def __init__(self, config: EngineConfig, observer: EngineObserver | None = None):
        self.config = config
        self.observer = observer or EngineObserver()
        self._loaded = False
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._incoming: deque[_Seq] = deque()
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._free_slots: list[int] = []
        self._stop = False
        self._accepting = False
        self._ids = itertools.count()
        self.stats = EngineStats()
        self.pool: Any = None  # the paged cache's BlockPool (None: slot cache)
        self.error: BaseException | None = None
        self._wakes: dict[Any, list[Any]] | None = None  # asyncio wake-ups collected during a step
        self._trace = StepTrace.from_env()  # COPT_ENGINE_TRACE=<folder>: every step and request, written at stop
        self._holds_heap = False  # started: the start-up heap is out of full collections (_hold_startup_heap)

    @classmethod
    def from_settings(cls, settings: ServeRecipe, observer: EngineObserver | None = None,
                      device: str | None = None) -> Engine:
        """Build from a ServeRecipe (the same settings `copt serve` validates)."""
        gib = settings.kv_cache_memory
        tokens = settings.kv_cache_blocks * settings.block_size if settings.kv_cache_blocks else None
        config = EngineConfig(
            model=settings.model, tokenizer=settings.tokenizer, device=device, dtype=settings.dtype,
            max_batch_size=settings.max_batch_size,
            max_batch_tokens=settings.max_batch_tokens, max_model_len=settings.max_model_len,
            max_queue=settings.max_queue, kv_cache_tokens=tokens, kv_cache_memory_gib=gib,
            draft_model=settings.draft_model, num_speculative_tokens=settings.num_speculative_tokens,
            prompt_lookup=settings.prompt_lookup, speculative_max_batch=settings.speculative_max_batch,
            cuda_graphs=settings.cuda_graphs, compile=settings.compile, compile_mode=settings.compile_mode,
            async_scheduling=settings.async_scheduling is not False,
            decode_attention=settings.decode_attention,
            gpu_memory_utilization=getattr(settings, "gpu_memory_utilization", None),
            block_size=settings.block_size, enable_prefix_caching=settings.enable_prefix_caching,
            kv_cache_dtype=settings.kv_cache_dtype, kv_layout=settings.kv_layout,
        )
        return cls(config, observer=observer)

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> Engine:
        """Load (if needed) and start the scheduler thread."""
        self.load()
        if self._thread is None:
            self._stop = False
            self._accepting = True
            _hold_startup_heap()
            self._holds_heap = True
            self._thread = threading.Thread(target=self._loop, name="copt-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the scheduler; unfinished requests end with finish_reason 'abort'."""
        self._accepting = False
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        for seq in list(self._running) + list(self._waiting) + list(self._incoming):
            self._finish(seq, "abort")
        self._running.clear()
        self._waiting.clear()
        self._incoming.clear()
        if self._trace is not None:
            self._trace.write()
        if self._holds_heap:
            self._holds_heap = False
            _release_startup_heap()

    def close_admission(self) -> None:
        """Refuse new requests (graceful drain); running and queued ones still finish."""
        self._accepting = False

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def idle(self) -> bool:
        return not (self._running or self._waiting or self._incoming)

    # ---- submitting --------------------------------------------------------------------------------------
    def validate(self, request: GenerationRequest) -> None:
        """Raise BadInputError for a request the engine cannot serve."""
        n = len(request.prompt_ids)
        if n == 0:
            raise BadInputError("The prompt is empty.", hint="Send at least one token.")
        if n >= self.max_model_len:
            raise BadInputError(
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt has {n} tokens.",
                hint="Shorten the prompt or start the server with a larger --max-model-len.")
        if request.max_new_tokens < (0 if request.prompt_logprobs is not None else 1):
            raise BadInputError("max_tokens must be at least 1 (0 only with prompt logprobs).",
                                hint="Pass max_tokens >= 1.")
        vocab = self.runner.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in request.prompt_ids):
            raise InvalidRequestError(f"Prompt token ids must be integers in [0, {vocab}).", "prompt",
                                      hint="Check the prompt ids.")
        if request.temperature < 0 or not 0 < request.top_p <= 1:
            raise BadInputError("temperature must be >= 0 and top_p in (0, 1].", hint="Fix the sampling options.")
        from clusteropt_cli.core.serve.device_sampling import MAX_LOGIT_BIAS, MAX_STOP_IDS

        if request.top_k < -1 or not 0 <= request.min_p <= 1 or request.repetition_penalty <= 0:
            raise BadInputError("top_k must be -1, 0 or positive, min_p in [0, 1] and repetition_penalty > 0.",
                                hint="Fix the sampling options.")
        bias = request.logit_bias or {}
        if len(bias) > MAX_LOGIT_BIAS or any(not 0 <= int(t) < vocab for t in bias):
            raise InvalidRequestError(f"logit_bias takes at most {MAX_LOGIT_BIAS} token ids in [0, {vocab}).",
                                      "logit_bias", hint="Check the logit_bias keys.")
        if request.min_tokens and len(set(request.stop_token_ids) | self.eos_ids) > MAX_STOP_IDS:
            raise InvalidRequestError(f"min_tokens suppresses at most {MAX_STOP_IDS} stop token ids.",
                                      "stop_token_ids", hint="Send fewer stop_token_ids.")
        if request.grammar is not None and request.min_tokens:
            raise InvalidRequestError("min_tokens cannot be combined with response_format or tools (the grammar "
                                      "decides where the output ends).", "min_tokens", hint="Drop min_tokens.")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(request, name)
            if k is not None and not 0 <= k <= 20:
                raise InvalidRequestError(f"{name} must be between 0 and 20.", name, hint=f"Pass {name} <= 20.")
        self._validate_request_tensors(request, vocab)

    def _validate_request_tensors(self, request: GenerationRequest, vocab: int) -> None:
        """Everything else a request carries that reaches a tensor: ids index the logits and the sampler's rows,
        floats become logits (a NaN or infinite one would poison the row: never admitted)."""
        import math

        bad = [t for t in request.stop_token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"stop_token_ids must be token ids in [0, {vocab}); got {bad[0]}.",
                                      "stop_token_ids", hint="Send ids of the model's vocabulary.")
        if request.min_tokens < 0 or request.min_tokens > request.max_new_tokens:
            raise InvalidRequestError(f"min_tokens ({request.min_tokens}) must be between 0 and max_tokens "
                                      f"({request.max_new_tokens}).", "min_tokens")
        if request.min_tokens and len(set(request.stop_token_ids) | self.eos_ids) >= vocab:
            raise InvalidRequestError("min_tokens with these stop_token_ids forbids every token of the vocabulary.",
                                      "stop_token_ids", hint="Leave at least one token that does not stop.")
        if request.seed is not None and not -(2**63) <= request.seed < 2**64:
            raise InvalidRequestError("seed must be in [-2^63, 2^64).", "seed")
        for name in ("top_k", "min_tokens"):  # stored in the sampler's int64 rows
            if abs(int(getattr(request, name))) >= 2**31:
                raise InvalidRequestError(f"{name} must be below 2^31.", name)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not math.isfinite(float(getattr(request, name))):
                raise InvalidRequestError(f"{name} must be a finite number.", name)
        if any(not math.isfinite(float(v)) or abs(float(v)) > 100 for v in (request.logit_bias or {}).values()):
            raise InvalidRequestError("logit_bias values must be numbers in [-100, 100].", "logit_bias")

    @property
    def max_request_sequences(self) -> int:
        """The most sequences one request (its prompts × n) may bring: what runs at once plus --max-queue. A request
        of more could never be queued whole (the server answers 400, not a 429 that retrying cannot cure)."""
        return int(self.config.max_queue) + int(self.num_slots)

    def submit(self, request: GenerationRequest, share_prompt_with: RequestHandle | None = None) -> RequestHandle:
        """Queue a request; returns at once with a handle (raises QueueFullError / BadInputError).

        share_prompt_with: an earlier handle with the same prompt (the other choices of an `n > 1` request): this
        one waits for that request's prefill and copies its KV cache instead of computing the prompt again (all
        but the last prompt token, whose logits it computes itself)."""
        if self.error is not None:
            raise EngineDeadError(f"The engine failed: {self.error}", hint="Restart the server.")
        if not self._accepting or self._thread is None:
            raise EngineStoppedError("The engine is not accepting requests (stopped or draining).",
                                     hint="Start the engine (engine.start()) or wait for the restart.")
        self.validate(request)
        with self._cond:
            # requests that will not find a free slot at the next step
            queued = len(self._incoming) + len(self._waiting) - len(self._free_slots)
            if queued >= self.config.max_queue:
                raise QueueFullError(f"The queue is full ({queued} requests waiting).",
                                     hint="Retry later or raise --max-queue.")
            rid = request.request_id or f"req-{next(self._ids)}"
            handle = RequestHandle(request, rid)
            stop_ids = set(request.stop_token_ids) | (set() if request.ignore_eos else set(self.eos_ids))
            room = self.max_model_len - len(request.prompt_ids)
            seq = _Seq(request, handle, stop_ids, min(request.max_new_tokens, room), self._row_settings(request))
            handle._seq = seq
            leader = getattr(share_prompt_with, "_seq", None)
            shares = getattr(self.runner, "can_copy_prefix", False) or (
                self.pool is not None and self.pool.enable_caching)
            if leader is not None and leader.prompt == seq.prompt and request.prompt_logprobs is None and shares:
                seq.leader = leader
            self._incoming.append(seq)
            self._cond.notify_all()
        return handle

    def _row_settings(self, request: GenerationRequest) -> Any:
        from clusteropt_cli.core.serve.device_sampling import RowSettings

        seed = request.seed if request.seed is not None else self._rng.getrandbits(63)
        stops = tuple(sorted(set(request.stop_token_ids) | (set() if request.ignore_eos else self.eos_ids)))
        return RowSettings(
            temperature=float(request.temperature), top_p=float(request.top_p), top_k=max(0, int(request.top_k)),
            min_p=float(request.min_p), seed=int(seed), presence_penalty=float(request.presence_penalty),
            frequency_penalty=float(request.frequency_penalty), repetition_penalty=float(request.repetition_penalty),
            logit_bias={int(k): float(v) for k, v in (request.logit_bias or {}).items()} or None,
            min_tokens=int(request.min_tokens), stop_ids=stops if request.min_tokens else ())

    def generate(self, requests: list[GenerationRequest], timeout: float | None = None) -> list[GenerationResult]:
        """Submit all requests (continuous batching does the rest) and block until every one has finished."""
        self.start()
        handles = []
        for req in requests:
            while True:
                try:
                    handles.append(self.submit(req))
                    break
                except QueueFullError:
                    time.sleep(0.01)
        return [h.result(timeout) for h in handles]

    # ---- the scheduler -----------------------------------------------------------------------------------
    def _loop(self) -> None:
        import torch

        while True:
            with self._cond:
                if self._stop:
                    return
                while self._incoming:
                    self._waiting.append(self._incoming.popleft())
                if not self._running and not self._waiting:
                    self._cond.wait(timeout=0.1)
                    continue
            self._wakes = {}
            trace = self._trace
            if trace is not None:
                trace.before(self)
            try:
                with torch.inference_mode():
                    self._step()
                    self._finish_faulted()
                if trace is not None:
                    trace.after(self)
            except Exception as exc:  # noqa: BLE001 - fail the batch (or the engine), never hang the clients
                self._step_failed(exc)
                if self.error is not None:
                    return
            finally:
                wakes, self._wakes = self._wakes, None
                if wakes:
                    _wake_all(wakes)

    # ---- faults --------------------------------------------------------------------------------------------
    # A request whose own processing raises (its logits transform, its sampling row, its stop checks) fails alone:
    # `_fault` marks it and the step goes on for the others. An exception no request can be blamed for fails the
    # sequences of that step; a device error (the CUDA context is gone) kills the engine: every request fails,
    # submit() raises EngineDeadError, and the server answers 503 on /health and exits non-zero.
    def _fault(self, seq: _Seq, exc: BaseException) -> None:
        if is_fatal_device_error(exc):
            raise exc
        import traceback

        traceback.print_exc()
        if seq.fault is None:
            seq.finish_reason, seq.fault = "error", f"{type(exc).__name__}: {exc}"

    def _finish_faulted(self) -> None:
        for seq in [s for s in self._running if s.fault is not None]:
            self._finish(seq, "error", error=seq.fault)

    def _step_failed(self, exc: BaseException) -> None:
        import traceback

        traceback.print_exc()
        message = f"{type(exc).__name__}: {exc}"
        if is_fatal_device_error(exc):
            self.error = exc
            self._accepting = False
            with self._cond:
                doomed = list(self._running) + list(self._waiting) + list(self._incoming)
                self._incoming.clear()
            self._waiting.clear()
            for seq in doomed:
                self._finish(seq, "error", error=f"the engine failed: {message}")
            self._running.clear()
            return
        for seq in list(self._running):
            self._finish(seq, "error", error=message)
        self._running.clear()

    def _step(self) -> None:
        stats = self.stats
        clock = time.perf_counter
        t0 = clock()
        # 1. cancellations (the gauges say so at once: the step may go on for a decode stretch of many tokens)
        cancelled = False
        if any(s.handle._cancelled for s in self._running):
            for seq in [s for s in self._running if s.handle._cancelled]:
                self._finish(seq, "abort")
            cancelled = True
        if any(s.handle._cancelled for s in self._waiting):
            for seq in [s for s in self._waiting if s.handle._cancelled]:
                self._waiting.remove(seq)
                self._finish(seq, "abort")
            cancelled = True
        if cancelled:
            self._update_gauges()
        # 2. admission into free slots (paged: and the blocks its prompt needs). Paged, a request is admitted only
        # while the prefill already admitted leaves room in a step's token budget (as vLLM schedules): one that
        # waits a step finds the blocks its predecessors computed in the prefix cache instead of computing them too
        pending = 0
        if self.pool is not None:
            pending = sum(s.kv_target - s.num_computed for s in self._running if s.num_computed < s.kv_target)
        while self._waiting and self._free_slots:
            seq = self._waiting[0]
            if self.pool is not None and (pending >= self.max_batch_tokens or not self._admit_blocks(seq)):
                break  # first come, first served: wait for blocks (or for the prefill ahead of it)
            if self.pool is not None:
                pending += seq.kv_target - seq.num_computed
            self._waiting.popleft()
            seq.slot = heapq.heappop(self._free_slots)
            self._running.append(seq)
            if self.pool is not None:
                self.runner.tables.set(seq.slot, 0, seq.blocks)
            try:
                self.runner.sampler.assign(seq.slot, seq.settings, seq.prompt)
                if seq.out and seq.settings.has_penalties:  # resumed after a preemption: its counts so far
                    self.runner.sampler.restore_counts(seq.slot, seq.out)
            except Exception as exc:  # noqa: BLE001 - this request's fault alone (finished after the step)
                self._fault(seq, exc)
        stats.peak_running = max(stats.peak_running, len(self._running))
        # 3. decode (or speculate) for generating sequences
        decoding = [s for s in self._running if s.out and s.finish_reason is None and s.num_computed == s.length - 1]
        if decoding and self.pool is not None:
            lookahead = self.config.num_speculative_tokens if (
                self.draft_runner is not None or self.config.prompt_lookup) else 0
            decoding = self._grow_blocks(decoding, lookahead)
        t1 = clock()
        stats.add_phase("schedule", t1 - t0)
        if decoding:
            use_spec = (self.draft_runner is not None or self.config.prompt_lookup) and (
                len(decoding) <= self.config.speculative_max_batch) and not any(
                s.settings.has_penalties or s.req.logprobs is not None or s.matcher is not None for s in decoding)
            if use_spec:
                self._spec_step(decoding)
                stats.add_phase("speculative", clock() - t1)
            elif self._can_chain(decoding):
                self._decode_chain(decoding)
            else:
                self._decode_step(decoding)
        self._flush_wakes()  # the decode's tokens and finished results go out now, not after this step's prefill
        # 4. chunked prefill with the remaining token budget
        budget = max(self.max_batch_tokens - len(decoding), 16)
        chunks = []
        for seq in self._running:
            if budget <= 0:
                break
            if seq.finish_reason is not None or seq.num_computed >= seq.kv_target:
                continue
            if seq.leader is not None and self.pool is None and not self._share_prompt(seq):
                continue  # waits for the prefill of the request it shares its prompt with
            n = min(seq.kv_target - seq.num_computed, budget)
            chunks.append((seq, n))
            budget -= n
        if chunks:
            self._prefill_step(chunks)
        t2 = clock()
        stats.steps += 1
        self._update_gauges()
        if self.pool is not None:
            stats.prefix_cache_queries, stats.prefix_cache_hits = self.pool.stats.queries, self.pool.stats.hits
        stats.add_phase("bookkeeping", clock() - t2)

    def _update_gauges(self) -> None:
        """The running and waiting counts and the KV-cache usage of the stats (/metrics)."""
        stats = self.stats
        stats.running = len(self._running)
        stats.waiting = len(self._waiting) + len(self._incoming)
        if self.pool is not None:
            stats.kv_cache_usage = self.pool.usage
        else:
            stats.kv_cache_usage = sum(s.length for s in self._running) / max(1, stats.kv_cache_tokens)

    # ---- paged KV cache -------------------------------------------------------------------------------------
    def _admit_blocks(self, seq: _Seq) -> bool:
        """Give a waiting sequence the blocks of the positions it computes before decoding, reusing cached blocks of
        its prefix (True), or leave it waiting: not enough free blocks, or its leader (the first choice of an `n > 1`
        request) has not computed the shared prompt yet (False)."""
        pool = self.pool
        leader = seq.leader
        if leader is not None:
            if leader.finish_reason is not None or leader.handle.done:
                seq.leader = None
            elif leader.num_computed < len(leader.prompt):
                return False
        tokens = seq.all_ids()
        hits: list[int] = []
        if pool.enable_caching and seq.prompt_lp is None:  # prompt logprobs need every position's logits
            seq.hashes = hash_chain_of(tokens, pool.block_size, seq.hashes)
            hits = pool.match(seq.hashes, len(tokens))
        need = pool.blocks_for(seq.kv_target) - len(hits)
        free_hits = sum(1 for b in hits if pool.ref[b] == 0)
        if pool.num_free - free_hits < need:
            return False
        if not seq.out:  # a preempted sequence's lookups are not new queries
            pool.record_lookup(len(tokens), len(hits))
        pool.take(hits)
        seq.blocks = hits + (pool.allocate(need) if need > 0 else [])
        seq.num_computed = seq.registered = len(hits)
        seq.num_computed *= pool.block_size
        if leader is not None:
            self.stats.prompt_tokens_shared += seq.num_computed
            seq.leader = None
        return True

    def _reserve(self, seq: _Seq, position: int) -> bool:
        """Make sure the sequence owns the block of `position` (new blocks go into its block table)."""
        pool = self.pool
        index = position // pool.block_size
        if index < len(seq.blocks):
            return True
        fresh = pool.allocate(index + 1 - len(seq.blocks))
        if fresh is None:
            return False
        self.runner.tables.set(seq.slot, len(seq.blocks), fresh)
        seq.blocks.extend(fresh)
        return True

    def _grow_blocks(self, decoding: list[_Seq], lookahead: int) -> list[_Seq]:
        """Blocks for the positions this step's decoding writes. When the pool runs out, the most recently admitted
        running sequences are preempted (their blocks freed; they are recomputed once blocks free up, as vLLM V1
        does) until the others fit. Returns the sequences that decode."""
        last = self.max_model_len + (self.config.num_speculative_tokens + 1 if lookahead else 0) - 1
        for seq in decoding:
            while seq.slot >= 0 and not self._reserve(seq, min(seq.length - 1 + lookahead, last)):
                victim = self._running[-1]
                self._preempt(victim)
        return [s for s in decoding if s.slot >= 0]

    def _reserve_chain_step(self, seqs: list[_Seq], starts: list[int], steps: int) -> bool:
        """Blocks for the next chained step (position start + steps of each sequence); False ends the stretch (the
        scheduler then preempts)."""
        if self.pool is None:
            return True
        return all(self._reserve(s, start + steps) for s, start in zip(seqs, starts, strict=True)
                   if s.finish_reason is None)

    def _preempt(self, seq: _Seq) -> None:
        """Free a running sequence's blocks and slot; it waits at the head of the queue and recomputes its cache
        (prompt and output so far, mostly prefix-cache hits) when it is admitted again."""
        self._running.remove(seq)
        heapq.heappush(self._free_slots, seq.slot)
        seq.slot = -1
        self.pool.release(seq.blocks)
        seq.blocks, seq.registered, seq.num_computed, seq.draft_computed = [], 0, 0, 0
        self._waiting.appendleft(seq)
        self.stats.preemptions += 1

    def _register_blocks(self, seq: _Seq) -> None:
        """Make the sequence's newly filled blocks findable in the prefix cache."""
        pool = self.pool
        full = min(seq.num_computed, seq.length) // pool.block_size
        if full <= seq.registered or not pool.enable_caching or len(seq.blocks) < full:
            return
        seq.hashes = hash_chain_of(seq.all_ids()[: full * pool.block_size], pool.block_size, seq.hashes)
        for i in range(seq.registered, full):
            pool.register(seq.blocks[i], seq.hashes[i])
        seq.registered = full

    def _share_prompt(self, seq: _Seq) -> bool:
        """For a sequence sharing its prompt with `seq.leader`: copy the leader's KV of all but the last prompt
        token once the leader has computed them (True: go on prefilling, the last token only), or keep waiting
        (False). A leader that is gone leaves the sequence to prefill on its own."""
        leader, shared = seq.leader, len(seq.prompt) - 1
        if seq.num_computed > 0 or shared <= 0 or leader.slot < 0 or leader.finish_reason is not None:
            seq.leader = None
            return True
        if leader.num_computed < shared:
            return False
        self.runner.copy_prefix(leader.slot, seq.slot, shared)
        seq.num_computed = shared
        seq.leader = None
        self.stats.prompt_tokens_shared += shared
        return True

    def _prefill_step(self, chunks: list[tuple[_Seq, int]]) -> None:
        clock = time.perf_counter
        t0 = clock()
        packed, wanted, done = [], [], []
        recomputed = []
        for seq, n in chunks:
            start = seq.num_computed
            tokens = seq.prompt if not seq.out else seq.all_ids()
            packed.append((seq.slot, start, tokens[start : start + n]))
            last = start + n == len(seq.prompt)
            if seq.out:  # recomputing a preempted sequence's cache: no logits, it goes on decoding
                wanted.append([])
                recomputed.append((seq, n))
                continue
            if seq.prompt_lp is not None:  # every position's logits: the next prompt token's logprob
                wanted.append(list(range(n)))
            else:
                wanted.append([n - 1] if last else [])
            if last:
                done.append(seq)
        logits = self.runner.forward_packed(packed, wanted)
        if self.runner.device.type == "cuda":  # attribute the prefill's GPU time to prefill (one sync per chunk step)
            import torch

            torch.cuda.synchronize()
        last_rows, row = [], 0
        for (seq, n), rows in zip(chunks, wanted, strict=True):
            if seq.out:
                continue
            if seq.prompt_lp is not None:
                self._record_prompt_logprobs(seq, logits[row : row + len(rows)], seq.num_computed)
            if seq.num_computed + n == len(seq.prompt):
                last_rows.append(row + len(rows) - 1)
            row += len(rows)
        for seq, n in chunks:
            seq.num_computed += n
            if self.pool is not None:
                self._register_blocks(seq)
        self.stats.prefill_chunks += len(chunks)
        self.stats.prompt_tokens += sum(n for _, n in chunks)
        t1 = clock()
        self.stats.add_phase("prefill_forward", t1 - t0)
        if done:
            if len(last_rows) != logits.shape[0]:
                import torch

                logits = logits.index_select(0, torch.tensor(last_rows, dtype=torch.long, device=logits.device))
            generating = [i for i, s in enumerate(done) if s.max_new > 0]
            for s in done:
                if s.max_new <= 0:  # prompt logprobs only (echo with max_tokens 0)
                    self._finish(s, "length")
            if not generating:
                return
            if len(generating) != len(done):
                import torch

                logits = logits.index_select(0, torch.tensor(generating, dtype=torch.long, device=logits.device))
                done = [done[i] for i in generating]
            tokens = self._choose(logits, done, prefill=True)
            t2 = clock()
            self.stats.add_phase("prefill_sample_sync", t2 - t1)
            self._emit_one_each(done, tokens)
            self.stats.add_phase("emit", clock() - t2)

    def _decode_step(self, seqs: list[_Seq]) -> None:
        from clusteropt_cli.core.serve.sampling import to_host

        clock = time.perf_counter
        t0 = clock()
        slots, positions = [s.slot for s in seqs], [s.length - 1 for s in seqs]
        last = [s.last_token() for s in seqs]
        plain = self.runner.sampler.flags(slots)[0]
        if plain or any(s.req.logprobs is not None or s.matcher is not None for s in seqs):
            logits = self.runner.forward_decode(slots, positions, last)
            t1 = clock()
            tokens = self._choose(logits, seqs)
        else:  # sampled on the device: the decode graph and the sampling graph back to back
            chosen = self.runner.decode_sample(slots, positions, last)
            t1 = clock()
            tokens = to_host(chosen)
        for s in seqs:
            s.num_computed += 1
        if self.pool is not None:
            for s in seqs:
                self._register_blocks(s)
        t2 = clock()
        self.stats.decode_steps += 1
        self._emit_one_each(seqs, tokens)
        t3 = clock()
        stats = self.stats
        stats.add_phase("decode_forward", t1 - t0)
        stats.add_phase("decode_sample_sync", t2 - t1)
        stats.add_phase("emit", t3 - t2)

    # ---- async scheduling: decode stretches fed on the device ------------------------------------------
    CHAIN_MAX_STEPS = 256  # hand control back to the loop at least this often

    def _can_chain(self, seqs: list[_Seq]) -> bool:
        """A stretch of pure decoding: every running sequence decodes, nothing waits for a slot or a prefill, and
        no request wants logprobs or follows a grammar (greedy or sampled: the tokens are chosen on the device
        either way)."""
        if not self.config.async_scheduling or len(seqs) != len(self._running) or self._waiting or self._incoming:
            return False
        return all(s.req.logprobs is None and s.matcher is None for s in seqs)

    def _chain_goes_on(self, seqs: list[_Seq], steps: int) -> bool:
        return (steps < self.CHAIN_MAX_STEPS and not self._stop and not self._incoming
                and all(s.finish_reason is None and not s.handle._cancelled for s in seqs))

    def _decode_chain(self, seqs: list[_Seq]) -> None:
        """Decode steps whose tokens (greedy or sampled) are fed back on the device: step k+1 is launched before
        step k's tokens are read, so emitting, stop checks and streaming overlap the GPU. When the stretch ends (a
        sequence finished or was cancelled, a request arrived) the step already in flight is drained: its tokens are
        kept for the sequences still running, dropped for the others (their slot's extra KV entry is never read)."""
        clock = time.perf_counter
        stats = self.stats
        t0 = clock()
        starts = [s.length - 1 for s in seqs]
        chain = self.runner.start_chain([s.slot for s in seqs], starts, [s.last_token() for s in seqs])
        pending = chain.launch()
        stats.add_phase("decode_forward", clock() - t0)
        steps = 0
        while pending is not None:  # the last pass launches nothing: it drains the step in flight
            steps += 1
            t0 = clock()
            ahead = chain.launch() if (self._chain_goes_on(seqs, steps)
                                       and self._reserve_chain_step(seqs, starts, steps)) else None
            t1 = clock()
            tokens = pending.tokens()
            t2 = clock()
            self._emit_chain_step(seqs, tokens)
            stats.add_phase("decode_forward", t1 - t0)
            stats.add_phase("decode_sample_sync", t2 - t1)
            stats.add_phase("emit", clock() - t2)
            if ahead is not None:
                stats.chained_steps += 1
            pending = ahead

    def _emit_chain_step(self, seqs: list[_Seq], tokens: list[int]) -> None:
        """One chained step's tokens to the sequences still running (and their consumers woken right away)."""
        live = [(s, t) for s, t in zip(seqs, tokens, strict=True)
                if s.finish_reason is None and not s.handle._cancelled]
        self.stats.decode_steps += 1
        if live:
            for s, _ in live:
                s.num_computed += 1
                if self.pool is not None:
                    self._register_blocks(s)
            self._emit_one_each([s for s, _ in live], [t for _, t in live])
        self._flush_wakes()

    def _flush_wakes(self) -> None:
        """Wake the consumers of the tokens emitted so far in this step, without waiting for the step's end."""
        if self._wakes:
            _wake_all(self._wakes)
            self._wakes = {}

    def _choose(self, logits, seqs: list[_Seq], prefill: bool = False) -> list[int]:
        """The next token of each sequence from its logits row (on the device), plus logprobs where asked. When
        the batched choice raises, rows are chosen one by one so that only the request that fails is failed."""
        try:
            return self._choose_rows(logits, seqs, prefill)
        except Exception as exc:  # noqa: BLE001 - find the request that failed: choose row by row
            if is_fatal_device_error(exc):
                raise
        tokens = []
        for i, seq in enumerate(seqs):
            try:
                tokens.extend(self._choose_rows(logits[i : i + 1], [seq]))
            except Exception as exc:  # noqa: BLE001 - this request's fault alone
                self._fault(seq, exc)
                tokens.append(0)
        return tokens

    def _choose_rows(self, logits, seqs: list[_Seq], prefill: bool = False) -> list[int]:
        """The tokens of `seqs` from their logits rows; `prefill`: the first tokens after a prefill step, which
        may go through the captured sampling graph (runner.sample_first_tokens)."""
        from clusteropt_cli.core.serve.sampling import to_host

        sampler = self.runner.sampler
        slots, positions = [s.slot for s in seqs], [s.length for s in seqs]
        constrained = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if constrained:  # the grammar's allowed tokens only, on the device, before any sampling step
            from clusteropt_cli.core.serve.structured import apply_grammar_masks

            t0 = time.perf_counter()
            apply_grammar_masks(logits, constrained, [seqs[i].matcher for i in constrained])
            self.stats.add_phase("grammar_mask", time.perf_counter() - t0)
        if any(s.req.logprobs is not None for s in seqs):
            tokens, logprobs = sampler.sample(logits, slots, positions, logprobs=True)
            host = to_host(tokens)
            self._record_logprobs(seqs, tokens, logprobs)
            return host
        if sampler.flags(slots)[0]:
            return to_host(logits.argmax(-1))
        graphed = getattr(self.runner, "sample_first_tokens", None) if prefill else None
        chosen = graphed(logits, slots, positions) if graphed is not None else None  # through the sampling graph
        return to_host(chosen if chosen is not None else sampler.sample(logits, slots, positions))

    def _record_logprobs(self, seqs: list[_Seq], tokens, logprobs) -> None:
        """Each requesting sequence's token logprob and top alternatives, keyed by its output index."""
        import torch

        from clusteropt_cli.core.serve.device_sampling import LOGPROB_FLOOR

        rows = [i for i, s in enumerate(seqs) if s.req.logprobs is not None]
        index = torch.tensor(rows, dtype=torch.long, device=logprobs.device)
        lp = logprobs.index_select(0, index).clamp_min(LOGPROB_FLOOR)
        chosen = tokens.index_select(0, index)
        values = lp.gather(1, chosen[:, None])[:, 0].tolist()
        k = max(seqs[i].req.logprobs for i in rows)
        top_v, top_i = (lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long()))
        top_v, top_i, chosen = top_v.tolist(), top_i.tolist(), chosen.tolist()
        for j, i in enumerate(rows):
            seq = seqs[i]
            kk = seq.req.logprobs
            top = list(zip(top_i[j][:kk], top_v[j][:kk], strict=True))
            seq.handle.logprobs[len(seq.out)] = (chosen[j], values[j], top)

    def _record_prompt_logprobs(self, seq: _Seq, logits, start: int) -> None:
        """Logprobs (of the model's raw distribution) of prompt tokens start+1 .. from the chunk's rows. A sequence
        preempted during its prefill computes its prompt again from the start: positions already recorded are
        skipped, not appended twice."""
        import torch

        from clusteropt_cli.core.serve.device_sampling import LOGPROB_FLOOR

        skip = len(seq.prompt_lp) - 1 - start  # prompt_lp holds tokens 0 .. len-1 (token 0: None)
        targets = seq.prompt[start + 1 + max(skip, 0) : start + 1 + logits.shape[0]]
        if not targets:
            return
        logits = logits[max(skip, 0) :]
        lp = torch.log_softmax(logits[: len(targets)].float(), -1).clamp_min(LOGPROB_FLOOR)
        t = torch.tensor(targets, dtype=torch.long, device=lp.device)
        chosen = lp.gather(1, t[:, None])
        values = chosen[:, 0].tolist()
        seq.prompt_rank.extend(((lp > chosen).sum(-1) + 1).tolist())  # vLLM's rank: 1 + the tokens more likely
        k = seq.req.prompt_logprobs
        top_v, top_i = (lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long()))
        for tok, v, ti, tv in zip(targets, values, top_i.tolist(), top_v.tolist(), strict=True):
            seq.prompt_lp.append((tok, v, list(zip(ti, tv, strict=True))))

    # ---- output ------------------------------------------------------------------------------------------
    def _emit_one_each(self, seqs: list[_Seq], tokens: list[int]) -> None:
        """One new token per sequence (a decode step): the common case inline, anything special via `_emit`."""
        now = time.perf_counter()
        on_tokens = self.observer.on_tokens
        wakes = self._wakes
        plain = 0
        for seq, tok in zip(seqs, tokens, strict=True):
            if (seq.t_first is None or seq.req.stop or tok in seq.stop_ids or seq.matcher is not None
                    or len(seq.out) + 1 >= seq.max_new or seq.finish_reason is not None):
                self._emit(seq, [tok], now)
                continue
            seq.out.append(tok)
            plain += 1
            on_tokens(now - seq.t_last, 1)
            seq.t_last = now
            seq.handle._push_token(tok, wakes)
        self.stats.generated_tokens += plain

    def _emit(self, seq: _Seq, tokens: list[int], now: float | None = None) -> None:
        if seq.fault is not None:  # failed earlier in this step: its tokens are not its own
            self._finish(seq, "error", error=seq.fault)
            return
        try:
            self._emit_tokens(seq, tokens, now)
        except Exception as exc:  # noqa: BLE001 - this request's fault alone
            self._fault(seq, exc)
            self._finish(seq, "error", error=seq.fault)

    def _emit_tokens(self, seq: _Seq, tokens: list[int], now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        new: list[int] = []
        for tok in tokens:
            if seq.matcher is not None:
                if not seq.matcher.accept_token(tok):
                    raise RuntimeError(f"token {tok} is outside the request's grammar")
                if seq.matcher.is_terminated():  # the grammar's end: its stop token, not part of the output
                    seq.finish_reason, seq.stop_reason = "stop", tok
                    break
            if tok in seq.stop_ids:
                seq.finish_reason, seq.stop_reason = "stop", tok
                break
            seq.out.append(tok)
            new.append(tok)
            if len(seq.out) >= seq.max_new:
                seq.finish_reason = "length"
                break
            if seq.req.stop and self._hit_stop_string(seq):
                break
        if new:
            self.stats.generated_tokens += len(new)
            if seq.t_first is None:
                seq.t_first = now
                self.observer.on_first_token(now - seq.t_arrival)
                if len(new) > 1:
                    self.observer.on_tokens(0.0, len(new) - 1)
            else:
                self.observer.on_tokens((now - seq.t_last) / len(new), len(new))
            seq.t_last = now
        if seq.finish_reason is not None:
            self._finish(seq, seq.finish_reason, pushed=new)
        elif new:
            seq.handle._push(new, wakes=self._wakes)

    def _hit_stop_string(self, seq: _Seq) -> bool:
        """Whether the output now contains a stop string. The text is detokenized incrementally and only its new
        end is searched (a stop string found earlier would have ended the request), so a long output with stop
        strings costs the engine thread the same per token as a short one."""
        stream = seq.detok
        if stream is None:
            stream = seq.detok = TextStream(self.tokenizer)
        before = len(stream.text)
        stream.ids.extend(seq.out[len(stream.ids) :])
        text = stream._text()
        longest = max((len(s) for s in seq.req.stop), default=0)
        start = max(0, before - longest + 1)
        hits = [(i, s) for s in seq.req.stop if s and (i := text.find(s, start)) >= 0]
        if not hits:
            return False
        cut, stop = min(hits)
        seq.finish_reason, seq.stop_reason, seq.text = "stop", stop, text[:cut]
        return True

    def _finish(self, seq: _Seq, reason: str, pushed: list[int] | None = None, error: str | None = None) -> None:
        if seq.handle.done:
            return
        seq.finish_reason = reason
        if seq in self._running:
            self._running.remove(seq)
        if seq.slot >= 0:
            heapq.heappush(self._free_slots, seq.slot)
            seq.slot = -1
        if seq.blocks:
            self.pool.release(seq.blocks)
            seq.blocks, seq.registered = [], 0
        text = seq.text
        if text is None and getattr(self, "tokenizer", None) is not None:
            text = self.tokenizer.decode(seq.out, skip_special_tokens=True)
        now = time.perf_counter()
        result = GenerationResult(
            request_id=seq.rid, prompt_ids=seq.prompt, output_ids=list(seq.out), finish_reason=reason, text=text,
            stop_reason=seq.stop_reason, ttft_s=(seq.t_first - seq.t_arrival) if seq.t_first else None,
            latency_s=now - seq.t_arrival, spec_drafted=seq.drafted, spec_accepted=seq.accepted, error=error,
            logprobs=([seq.handle.logprobs.get(i) for i in range(len(seq.out))]
                      if seq.req.logprobs is not None else None),
            prompt_logprobs=seq.prompt_lp, prompt_ranks=seq.prompt_rank)
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        if self._trace is not None:
            self._trace.finished(seq, now)
        seq.handle._push(pushed or [], result, wakes=self._wakes)
        try:
            self.observer.on_finish(result)
        except Exception:  # noqa: BLE001 - metrics must never break generation
            pass
