"""Captured prefill steps (runner.PrefillGraph): the step layout the graph reads (one staging row, padding to the
scratch block, the block-diagonal causal mask or the causal single segment) gives the logits and the KV cache writes
of the eager packed forward, and the runner sends only steps the graph can run through it (segments starting at
position 0, last-token logits). On CUDA the same body is replayed as a graph; here it runs eagerly."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from clusteropt_cli.core.serve.engine import Engine, EngineConfig  # noqa: E402
from clusteropt_cli.core.serve.runner import PREFILL_GRAPH_SEGMENTS, PrefillGraph  # noqa: E402


@pytest.fixture(scope="module")
def engine(fixtures):
    eng = Engine(EngineConfig(model=str(fixtures.teacher), max_batch_size=8, max_model_len=256, device="cpu",
                              enable_prefix_caching=False))  # the same prompts twice: computed both times
    eng.start()
    assert eng.runner.paged
    yield eng
    eng.stop()


def _prompts(engine, lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.runner.vocab_size
    return [torch.randint(3, vocab - 1, (n,), generator=gen).tolist() for n in lengths]


def _blocks(runner, rows_blocks):
    for row, blocks in rows_blocks.items():
        runner.tables.set(row, 0, blocks)
    runner.tables.flush()
    return [b for blocks in rows_blocks.values() for b in blocks]


@pytest.mark.parametrize("single", [True, False])
def test_graph_step_matches_the_eager_packed_forward(engine, single):
    runner = engine.runner
    lengths = [37] if single else [37, 5, 20]
    rows_blocks = {1: [40, 41, 42], 2: [50], 3: [60, 61]} if not single else {1: [40, 41, 42]}
    used = _blocks(runner, rows_blocks)
    chunks = [(row, 0, p) for row, p in zip(rows_blocks, _prompts(engine, lengths), strict=True)]
    wanted = [[len(p) - 1] for _, _, p in chunks]
    if not single:
        wanted[1] = []  # a segment whose prompt goes on in the next step: no logits
    graph = PrefillGraph(runner, 64, None, capture=False, single=single)
    with torch.inference_mode():
        got = graph.run(chunks, wanted)
        got_kv = [(k[used].clone(), v[used].clone()) for k, v in runner.caches]
        for k, v in runner.caches:
            k[used] = 0
            v[used] = 0
        want = runner.forward_packed(chunks, wanted)
        want_kv = [(k[used].clone(), v[used].clone()) for k, v in runner.caches]
    assert got.shape == want.shape == (sum(map(len, wanted)), runner.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for (gk, gv), (wk, wv) in zip(got_kv, want_kv, strict=True):
        # only the tokens of the step were written, each where its table says (padding went to the scratch block)
        torch.testing.assert_close(gk, wk, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(gv, wv, rtol=1e-4, atol=1e-4)


def test_runner_sends_only_steps_the_graph_can_run(engine):
    runner = engine.runner
    single = PrefillGraph(runner, 64, None, capture=False, single=True)
    packed = PrefillGraph(runner, 64, None, capture=False, single=False)
    small = PrefillGraph(runner, 16, None, capture=False, single=True)
    saved, runner._prefill_graphs = runner._prefill_graphs, [small, single, packed]
    try:
        a, b = _prompts(engine, [30, 10], seed=1)
        pick = runner._prefill_graph_for
        assert pick([(1, 0, a)], [[29]]) is single  # the smallest single-segment bucket that holds 30 tokens
        assert pick([(1, 0, a[:9])], [[8]]) is small
        assert pick([(1, 0, a), (2, 0, b)], [[29], [9]]) is packed
        assert pick([(1, 0, a), (2, 0, b)], [[29], []]) is packed  # a chunk without logits
        assert pick([(1, 16, a)], [[29]]) is None  # continues a sequence: reads its cached keys
        assert pick([(1, 0, a)], [list(range(30))]) is None  # prompt logprobs: every position's logits
        assert pick([(1, 0, a + a + a)], [[89]]) is None  # larger than every bucket
        many = [(i, 0, [5]) for i in range(PREFILL_GRAPH_SEGMENTS + 1)]
        assert pick(many, [[0]] * len(many)) is None
    finally:
        runner._prefill_graphs = saved


def test_engine_output_is_the_same_through_the_graph_step(engine):
    """Greedy generation with prefill steps through the (eager) graph body equals generation without it; several
    prompts arrive together, so steps pack several fresh segments."""
    from clusteropt_cli.core.serve.requests import GenerationRequest

    runner = engine.runner
    prompts = _prompts(engine, [3, 17, 40, 9], seed=2)

    def run() -> list[list[int]]:
        reqs = [GenerationRequest(prompt_ids=p, max_new_tokens=8, ignore_eos=True) for p in prompts]
        return [r.output_ids for r in engine.generate(reqs)]

    saved = runner._prefill_graphs
    graphs = [PrefillGraph(runner, 128, None, capture=False, single=s) for s in (True, False)]
    calls = []
    for g in graphs:
        g.run = (lambda f: lambda *a: calls.append(1) or f(*a))(g.run)
    try:
        runner._prefill_graphs = []
        eager = run()
        runner._prefill_graphs = graphs
        through = run()
    finally:
        runner._prefill_graphs = saved
    assert calls, "no prefill step went through the graph body"
    assert through == eager
