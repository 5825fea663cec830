"""Prompt texts tokenized for copt serve's API process: short ones on the event loop, long ones batched on a worker.

Any trip to a worker thread costs more than the tokenizing under streaming load: the worker's Python layer holds the
GIL against the event loop streaming every other request, and the result waits for the loop to pick it up. On the
H200 (Llama-3.2-1B shape, `copt profile endpoint`, 64 streaming clients) a request spent a median 22 ms between
reaching the app and its submission to the engine with one worker call per prompt, 14 ms with the waiting prompts
batched into one call, and 0.5 ms tokenized on the loop when it comes in (its encode 0.3 ms): prompts up to
INLINE_ENCODE_CHARS characters go that way. Longer ones (a long document must not stall every stream) are batched
as vLLM's micro-batching tokenizer does: whatever waits when the worker frees up goes in one call of the tokenizer
on a list — a fast tokenizer's encode_batch, which runs in Rust threads with the GIL released.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

# Prompts up to this many characters in all (about a thousand tokens; under a millisecond of tokenizing) are
# tokenized on the event loop when they come in.
INLINE_ENCODE_CHARS = 4096


class BatchEncoder:
    """`await encode(texts, add_special_tokens)`: the token ids of each text, as `tokenizer.encode` gives them.

    Texts of `inline_chars` characters or fewer in all are tokenized at once, on the caller's thread (the event
    loop). Longer ones go to `off_loop(fn, *args)`, which runs fn on a worker thread: every call waiting when the
    previous batch ends goes in the next one (no timer: a lone request waits for nothing); a batch the tokenizer
    fails is retried text by text, so only the request whose text fails gets the exception."""

    def __init__(self, tokenizer: Any, off_loop: Callable[..., Awaitable[Any]],
                 on_batch: Callable[[float, float, float, int], None] | None = None,
                 inline_chars: int = INLINE_ENCODE_CHARS):
        self.tokenizer, self.off_loop, self.inline_chars = tokenizer, off_loop, inline_chars
        self.on_batch = on_batch  # (queued, started, ended, texts) of each batch: the API trace's record
        self._waiting: list[tuple[list[str], bool, asyncio.Future, float]] = []
        self._task: asyncio.Future | None = None  # the drain running now (kept: a task no one holds may be collected)

    def _encode(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        ids = self.tokenizer(texts, add_special_tokens=add_special_tokens, return_attention_mask=False)["input_ids"]
        return [list(x) for x in ids]

    async def encode(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        if not texts:
            return []
        if sum(map(len, texts)) <= self.inline_chars:
            started = time.perf_counter()
            ids = self._encode(texts, bool(add_special_tokens))
            if self.on_batch is not None:
                self.on_batch(started, started, time.perf_counter(), len(texts))
            return ids
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((texts, bool(add_special_tokens), future, time.perf_counter()))
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting, []
            for special in (True, False):
                group = [(texts, future, queued) for texts, flag, future, queued in batch
                         if flag is special and not future.done()]
                if group:
                    await self._run(group, special)

    async def _run(self, group: list[tuple[list[str], asyncio.Future, float]], special: bool) -> None:
        flat = [text for texts, _, _ in group for text in texts]
        started = time.perf_counter()
        try:
            ids = await self.off_loop(self._encode, flat, special)
            if self.on_batch is not None:
                self.on_batch(min(queued for _, _, queued in group), started, time.perf_counter(), len(flat))
        except Exception:  # noqa: BLE001 - one request's text: find it, fail that request alone
            for texts, future, _ in group:
                try:
                    result = await self.off_loop(self._encode, texts, special)
                except Exception as exc:  # noqa: BLE001
                    if not future.done():
                        future.set_exception(exc)
                else:
                    if not future.done():
                        future.set_result(result)
            return
        start = 0
        for texts, future, _ in group:
            if not future.done():  # (a request whose client went away was cancelled)
                future.set_result(ids[start:start + len(texts)])
            start += len(texts)
