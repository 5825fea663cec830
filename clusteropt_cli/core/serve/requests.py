"""Client-facing objects of the in-process engine: requests, results, the streaming handle, incremental
detokenization, the observer hooks and the errors the engine raises (see engine.py for the API)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from clusteropt_cli.errors import BadInputError, CoptError


class QueueFullError(CoptError):
    """The engine's waiting queue is full (the server answers 429)."""

    exit_code = 1


class EngineStoppedError(CoptError):
    """The engine is not running (stopped, draining or crashed)."""

    exit_code = 1


class EngineDeadError(EngineStoppedError):
    """The engine hit an unrecoverable (device) error: every request fails and the server exits non-zero."""


class InvalidRequestError(BadInputError):
    """A request the engine cannot serve; `param` names the request field (the server answers 400)."""

    def __init__(self, message: str, param: str, hint: str | None = None):
        super().__init__(message, hint)
        self.param = param


# device errors after which the CUDA context cannot be trusted (vLLM: the engine is dead, the process exits)
_FATAL_MARKERS = ("CUDA error", "device-side assert", "illegal memory access", "CUBLAS_STATUS", "cuDNN error",
                  "CUDA driver", "unspecified launch failure", "NCCL error")


def is_fatal_device_error(exc: BaseException) -> bool:
    """Whether `exc` leaves the device unusable (a failed request cannot be told apart from the others)."""
    accelerator_error = getattr(sys.modules.get("torch"), "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    text = f"{type(exc).__name__}: {exc}"
    return any(marker in text for marker in _FATAL_MARKERS)


@dataclass
class GenerationRequest:
    """One generation. Token ids in, token ids out; `stop` strings need the engine's tokenizer."""

    prompt_ids: list[int]
    max_new_tokens: int = 16
    temperature: float = 0.0  # 0 → greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None  # the same seed gives the same tokens whatever else runs
    logprobs: int | None = None  # per output token: its logprob and this many top alternatives (0: none)
    prompt_logprobs: int | None = None  # the same for every prompt token (max_new_tokens may then be 0)
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop ids (EOS is added unless ignore_eos)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    speculative: bool = True  # allow speculative decoding for this request (when the engine has a drafter)
    grammar: Any = None  # structured.Grammar: constrained decoding (response_format, tools)
    request_id: str | None = None


@dataclass
class GenerationResult:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    text: str | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended the request
    ttft_s: float | None = None
    latency_s: float = 0.0
    spec_drafted: int = 0
    spec_accepted: int = 0
    error: str | None = None
    # with request.logprobs: one (token id, logprob, [(id, logprob), ...]) per output token
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    # with request.prompt_logprobs: None for the first prompt token, then as above
    prompt_logprobs: list[tuple[int, float, list[tuple[int, float]]] | None] | None = None
    # with request.prompt_logprobs: each prompt token's rank in its distribution (1: the most likely; None first)
    prompt_ranks: list[int | None] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)


class RequestHandle:
    """A submitted request: iterate (sync or async) over lists of new token ids; `result()` when done."""

    def __init__(self, request: GenerationRequest, request_id: str):
        self.request = request
        self.request_id = request_id
        self._cond = threading.Condition()
        self._chunks: deque[list[int]] = deque()
        self._result: GenerationResult | None = None
        self._cancelled = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event, bool]] = []
        self._blocked = 0  # threads waiting on _cond (result(), sync iteration): the only ones notify_all wakes
        # output index → (token id, logprob, top alternatives), filled before the token is pushed (streaming reads it)
        self.logprobs: dict[int, tuple[int, float, list[tuple[int, float]]]] = {}
        self._t_submit = time.perf_counter()  # handed to the engine (the API trace's "submitted", as RemoteHandle's)

    # engine side
    def _push(self, token_ids: list[int], result: GenerationResult | None = None,
              wakes: dict[Any, list[Any]] | None = None) -> None:
        """Hand new tokens (and the final result) to the consumers. With `wakes`, asyncio consumers are not woken
        here but collected per event loop, so the engine wakes each loop once per step phase (`_wake_all`: after a
        step's decode, and after its prefill)."""
        with self._cond:
            if token_ids:
                self._chunks.append(list(token_ids))
            if result is not None:
                self._result = result
            if self._blocked:
                self._cond.notify_all()
            # streaming consumers wake per chunk; result-only waiters (wait()) wake once, at the end
            waiters = [(loop, ev) for loop, ev, final in self._waiters if result is not None or not final]
        for loop, event in waiters:
            if event.is_set():  # the consumer has not run since the last wake-up: no need to wake it again
                continue
            if wakes is not None:
                wakes.setdefault(loop, []).append(event)
                continue
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the loop is closed
                pass

    def _push_token(self, token: int, wakes: dict[Any, list[Any]]) -> None:
        """`_push([token], wakes=wakes)`, kept lean: a decode step calls it once per running sequence on the engine
        thread."""
        with self._cond:
            self._chunks.append([token])
            if self._blocked:
                self._cond.notify_all()
            for loop, event, final in self._waiters:
                if not final and not event.is_set():
                    wakes.setdefault(loop, []).append(event)

    # another process's consumer (the engine-core process of the split server, engine_core.py)
    def add_step_listener(self, loop: Any, event: Any) -> None:
        """Be told of this handle's new tokens the way an asyncio consumer is: the engine calls
        `loop.call_soon_threadsafe(fn, *args)` once per step phase for all the handles it touched, and `fn` calls
        `event.set()` for each (an object with `is_set()` and `set()`). Tokens pushed before this call are not
        announced: `take()` them once after registering."""
        with self._cond:
            self._waiters.append((loop, event, False))

    def take(self) -> tuple[list[int], GenerationResult | None]:
        """Without blocking: every token id pushed since the last take, and the result once the request ended."""
        with self._cond:
            chunks = list(self._chunks)
            self._chunks.clear()
            result = self._result
        return [t for c in chunks for t in c], result

    # client side
    @property
    def done(self) -> bool:
        return self._result is not None

    def cancel(self) -> None:
        """Stop generating; the slot is freed at the next engine step (finish_reason 'abort')."""
        self._cancelled = True

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Block until the request finished and return its result."""
        with self._cond:
            self._blocked += 1
            try:
                finished = self._cond.wait_for(lambda: self._result is not None, timeout=timeout)
            finally:
                self._blocked -= 1
            if not finished:
                raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
            return self._result

    async def wait(self) -> GenerationResult:
        """Await the final result without blocking the event loop (woken once, when the request ends)."""
        if self._result is not None:
            return self._result
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        with self._cond:
            if self._result is not None:
                return self._result
            self._waiters.append((loop, event, True))
        try:
            await event.wait()
            return self._result
        finally:
            with self._cond:
                self._waiters = [w for w in self._waiters if w[1] is not event]

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            with self._cond:
                self._blocked += 1
                try:
                    self._cond.wait_for(lambda: self._chunks or self._result is not None)
                finally:
                    self._blocked -= 1
                if self._chunks:
                    chunk = self._chunks.popleft()
                else:
                    return
            yield chunk

    async def __aiter__(self):
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        with self._cond:
            self._waiters.append((loop, event, False))
        try:
            while True:
                event.clear()  # before the take: a push after it sets the event again
                with self._cond:
                    chunks = list(self._chunks)
                    self._chunks.clear()
                    finished = self._result is not None
                if chunks:  # everything that arrived since the last wake-up as one chunk (fewer events when behind)
                    yield chunks[0] if len(chunks) == 1 else [t for c in chunks for t in c]
                if finished:  # the result comes with (or after) the last tokens: nothing more can arrive
                    return
                await event.wait()  # at once when tokens came while the consumer had the last ones
        finally:
            with self._cond:
                self._waiters = [w for w in self._waiters if w[1] is not event]


def _set_events(events: list[Any]) -> None:
    for event in events:
        event.set()


def _wake_all(wakes: dict[Any, list[Any]]) -> None:
    """One call_soon_threadsafe per event loop for all the handles a step touched (not one per token)."""
    for loop, events in wakes.items():
        try:
            loop.call_soon_threadsafe(_set_events, events)
        except RuntimeError:  # the loop is closed
            pass


def plain_decoder(tokenizer: Any) -> Any:
    """`tokenizer.decode(ids, skip_special_tokens=True)` as a cheaper callable with the same result where that is
    certain: a fast (tokenizers-backed) transformers tokenizer whose decode is transformers' own and adds nothing to
    the backend's text (no clean-up of tokenization spaces, which transformers also skips for BPE models). There
    the wrapper's own work (argument conversion, kwargs, the clean-up check) costs several times the backend's
    decode of a few streamed tokens. Any other tokenizer: its bound `decode`."""
    slow = partial(tokenizer.decode, skip_special_tokens=True)
    backend = getattr(tokenizer, "_tokenizer", None)
    base = sys.modules.get("transformers.tokenization_utils_base")  # loaded wherever a transformers tokenizer is
    fast = sys.modules.get("transformers.tokenization_utils_tokenizers")
    PreTrainedTokenizerBase = getattr(base, "PreTrainedTokenizerBase", None)  # noqa: N806
    TokenizersBackend = getattr(fast, "TokenizersBackend", None)  # noqa: N806
    if PreTrainedTokenizerBase is None or TokenizersBackend is None:
        return slow
    cls = type(tokenizer)
    if (backend is None or not isinstance(tokenizer, TokenizersBackend)
            or cls.decode is not PreTrainedTokenizerBase.decode or cls._decode is not TokenizersBackend._decode):
        return slow
    if tokenizer.clean_up_tokenization_spaces and not (
            type(tokenizer.backend_tokenizer.model).__name__ == "BPE"
            and not getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
                            False)):
        return slow
    return partial(backend.decode, skip_special_tokens=True)


@contextlib.contextmanager
def frozen_startup_heap() -> Iterator[None]:
    """While serving, leave the objects that exist now (the loaded model, torch, transformers, the app) out of the
    garbage collector's full collections, as vLLM does: with them in the oldest generation every full collection
    walks the whole start-up heap (~0.3 s on the CPU test machine, every second 256-stream run), and it stops the
    engine and every stream while it runs. Cyclic garbage made at start-up is collected first; on exit the objects
    go back to the collector."""
    import gc

    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class TextStream:
    """Incremental detokenization for streaming: yields text deltas, never a partial stop string or UTF-8 char."""

    def __init__(self, tokenizer: Any, stop: list[str] | None = None, decode: Any = None):
        self.tokenizer = tokenizer
        # `decode(ids)` → text, as tokenizer.decode(ids, skip_special_tokens=True) (plain_decoder, made once by the
        # caller for many streams)
        self._decode = decode if decode is not None else plain_decoder(tokenizer)
        self.stop = [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.sent = 0
        # incremental detokenization (as vLLM does it): only the last few tokens are decoded per push;
        # text = decode(ids[:read]); ids[prefix:read] is the window the next tokens are decoded against
        self.text = ""
        self.prefix = 0
        self.read = 0

    def _text(self) -> str:
        window = self.ids[self.prefix :]
        prefix_text = self._decode(self.ids[self.prefix : self.read]) if self.read > self.prefix else ""
        new_text = self._decode(window)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text) :]
            self.prefix, self.read = self.read, len(self.ids)
        return self.text

    def push(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        text = self._text()
        for s in self.stop:  # text already sent holds no stop string: search only where a new one can start
            cut = text.find(s, max(0, self.sent - len(s) + 1))
            if cut >= 0:
                text = text[:cut]
        safe = len(text)
        while safe > self.sent and text[safe - 1] == "\ufffd":
            safe -= 1
        for s in self.stop:  # hold back a suffix that may be the start of a stop string
            for n in range(min(len(s) - 1, safe - self.sent), 0, -1):
                if text[safe - n : safe] == s[:n]:
                    safe -= n
                    break
        delta = text[self.sent : safe]
        self.sent = max(self.sent, safe)
        return delta

    def finish(self, final_text: str | None = None) -> str:
        text = final_text if final_text is not None else self._decode(self.ids)
        delta = text[self.sent :]
        self.sent = len(text)
        return delta


class EngineObserver:
    """Hooks the server uses for its metrics (all called on the engine thread; keep them cheap)."""

    def on_first_token(self, ttft_s: float) -> None: ...

    def on_tokens(self, itl_s: float, count: int) -> None: ...

    def on_finish(self, result: GenerationResult) -> None: ...
