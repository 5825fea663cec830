"""copt serve's BatchEncoder: short prompts tokenized on the event loop as they come, longer concurrent ones in one
call of the tokenizer on a worker, each getting exactly what tokenizer.encode gives it; a text the tokenizer fails
fails its request alone."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from clusteropt_cli.core.serve.batch_encoder import BatchEncoder

TEXTS = ["def f(x):\n    return x + 1", "Hello, world! Ünïcödé — 中文 🙂", " leading and trailing spaces ",
         "<|im_start|>user\nhi<|im_end|>", "a", "\n\n\t", "the " * 300]


def _encoder(tokenizer, inline_chars: int = 0):
    """inline_chars 0: every text through the worker's batches."""
    pool = ThreadPoolExecutor(2)

    async def off_loop(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(pool, lambda: fn(*args))

    return BatchEncoder(tokenizer, off_loop, inline_chars=inline_chars)


@pytest.mark.parametrize("which", ["fixture", "smollm2"])
def test_concurrent_prompts_get_the_tokenizers_own_ids(which, fixtures, real_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(fixtures.teacher if which == "fixture" else real_model.model)
    calls = []
    real_call = tokenizer.__call__

    class Counting:
        def __call__(self, texts, **kw):
            calls.append(len(texts))
            return real_call(texts, **kw)

    counting = Counting()
    encoder = _encoder(counting)

    async def run():
        jobs = [encoder.encode([t], special) for special in (True, False) for t in TEXTS]
        jobs.append(encoder.encode(TEXTS[:3], True))  # a request with several prompts
        return await asyncio.gather(*jobs)

    got = asyncio.run(run())
    expected = [[tokenizer.encode(t, add_special_tokens=special)] for special in (True, False) for t in TEXTS]
    expected.append([tokenizer.encode(t, add_special_tokens=True) for t in TEXTS[:3]])
    assert got == expected
    # the first request went alone, every one that waited meanwhile in one call per add_special_tokens value
    assert len(calls) <= 3 and sum(calls) == 2 * len(TEXTS) + 3


def test_a_text_the_tokenizer_fails_fails_its_request_alone():
    class Picky:
        def __call__(self, texts, **kw):
            if any("poison" in t for t in texts):
                raise ValueError("cannot tokenize poison")
            return {"input_ids": [[len(t)] for t in texts]}

    encoder = _encoder(Picky())

    async def run():
        return await asyncio.gather(encoder.encode(["ab"]), encoder.encode(["poison"]), encoder.encode(["abc", "d"]),
                                    return_exceptions=True)

    ok, bad, several = asyncio.run(run())
    assert ok == [[2]] and several == [[3], [1]]
    assert isinstance(bad, ValueError)


def test_a_cancelled_request_leaves_the_batch_to_the_others():
    class Slow:
        def __call__(self, texts, **kw):
            import time

            time.sleep(0.05)
            return {"input_ids": [[len(t)] for t in texts]}

    encoder = _encoder(Slow())

    async def run():
        first = asyncio.ensure_future(encoder.encode(["x"]))
        await asyncio.sleep(0)
        gone = asyncio.ensure_future(encoder.encode(["yy"]))
        kept = asyncio.ensure_future(encoder.encode(["zzz"]))
        await asyncio.sleep(0.01)
        gone.cancel()
        return await first, await kept, gone.cancelled()

    assert asyncio.run(run()) == ([[1]], [[3]], True)


def test_short_prompts_are_tokenized_on_the_loop_and_long_ones_on_the_worker(fixtures):
    import threading

    from transformers import AutoTokenizer

    from clusteropt_cli.core.serve.batch_encoder import INLINE_ENCODE_CHARS

    tokenizer = AutoTokenizer.from_pretrained(fixtures.teacher)
    threads = []

    class Recording:
        def __call__(self, texts, **kw):
            if any("poison" in t for t in texts):
                raise ValueError("cannot tokenize poison")
            threads.append((threading.current_thread() is threading.main_thread(), len(texts)))
            return tokenizer(texts, **kw)

    encoder = _encoder(Recording(), inline_chars=INLINE_ENCODE_CHARS)
    long_text = "the " * (INLINE_ENCODE_CHARS // 4 + 1)

    async def run():
        return await asyncio.gather(encoder.encode(TEXTS[:3]), encoder.encode([long_text], False),
                                    encoder.encode(["poison"]), return_exceptions=True)

    short, long_ids, bad = asyncio.run(run())
    assert short == [tokenizer.encode(t) for t in TEXTS[:3]]
    assert long_ids == [tokenizer.encode(long_text, add_special_tokens=False)]
    assert isinstance(bad, ValueError)  # raised to that request alone
    assert threads == [(True, 3), (False, 1)]  # the short request on the loop's thread, the long one on a worker
