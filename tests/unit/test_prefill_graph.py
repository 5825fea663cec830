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


def _generate_eager_and_through(engine, prompts: list[list[int]], graphs: list, new_tokens: int):
    """Greedy outputs of `prompts` submitted together, without prefill graphs and then through `graphs`."""
    from clusteropt_cli.core.serve.requests import GenerationRequest

    runner = engine.runner

    def run() -> list[list[int]]:
        reqs = [GenerationRequest(prompt_ids=p, max_new_tokens=new_tokens, ignore_eos=True) for p in prompts]
        return [r.output_ids for r in engine.generate(reqs)]

    saved = runner._prefill_graphs
    try:
        runner._prefill_graphs = []
        eager = run()
        runner._prefill_graphs = graphs
        return eager, run()
    finally:
        runner._prefill_graphs = saved


def test_engine_output_is_the_same_through_the_graph_step(engine):
    """Greedy generation with prefill steps through the (eager) graph body equals generation without it; several
    prompts arrive together, so steps pack several fresh segments."""
    runner = engine.runner
    graphs = [PrefillGraph(runner, 128, None, capture=False, single=s) for s in (True, False)]
    calls = []
    for g in graphs:
        g.run = (lambda f: lambda *a: calls.append(1) or f(*a))(g.run)
    eager, through = _generate_eager_and_through(engine, _prompts(engine, [3, 17, 40, 9], seed=2), graphs, 8)
    assert calls, "no prefill step went through the graph body"
    assert through == eager


def _reference_kernel(calls=None):
    """runner.reference_varlen in flash_varlen's place (the graph's variable-length kernel on CUDA)."""
    from clusteropt_cli.core.serve.runner import reference_varlen

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, scaling):
        if calls is not None:
            calls.append((cu_q.tolist(), cu_k.tolist(), max_q, max_k))
        return reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scaling)

    return kernel


def test_varlen_graph_steps_match_the_eager_packed_forward(engine):
    """Through the variable-length kernel the graph takes what the masked graphs send eagerly: a prompt resumed
    after its first chunk (its 20 cached tokens read from the pool) packed with new prompts, and a continuation
    alone. Logits and KV writes equal the eager per-segment path's; the padding is one segment over the scratch
    block and the unused segments are empty."""
    runner = engine.runner
    rows_blocks = {1: [40, 41, 42], 2: [50], 3: [60, 61]}
    used = _blocks(runner, rows_blocks)
    p1, p2, p3 = _prompts(engine, [37, 12, 23], seed=3)
    steps = [([(1, 0, p1[:20]), (2, 0, p2)], [[], [11]]),
             ([(1, 20, p1[20:]), (3, 0, p3)], [[16], [22]]),
             ([(2, 12, p3[:3])], [[2]])]
    calls = []
    graph = PrefillGraph(runner, 64, None, capture=False, kernel=_reference_kernel(calls))
    assert all(graph.fits(chunks) for chunks, _ in steps)

    def run(through_graph: bool):
        for k, v in runner.caches:
            k[used] = 0
            v[used] = 0
        with torch.inference_mode():
            logits = [(graph.run if through_graph else runner.forward_packed)(chunks, wanted).clone()
                      for chunks, wanted in steps]
            kv = [(k[used].clone(), v[used].clone()) for k, v in runner.caches]
        return logits, kv

    got_logits, got_kv = run(True)
    want_logits, want_kv = run(False)
    for got, want in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for (gk, gv), (wk, wv) in zip(got_kv, want_kv, strict=True):
        torch.testing.assert_close(gk, wk, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(gv, wv, rtol=1e-4, atol=1e-4)
    cu_q, cu_k, max_q, max_k = calls[runner.num_layers]  # the second step's first layer
    assert (max_q, max_k) == (64, 128)
    assert cu_q[:3] == [0, 17, 40] and cu_k[:3] == [0, 37, 60]  # 17 new tokens over 37 keys, then a new prompt
    assert cu_q[3:-1] == [40] * (len(cu_q) - 4) and cu_q[-1] == 64  # empty segments, then 24 padding tokens
    assert cu_k[-1] == 60 + 24


def test_runner_sends_a_varlen_graph_what_fits_it(engine):
    from clusteropt_cli.core.serve.runner import PREFILL_GRAPH_VARLEN_SEGMENTS

    runner = engine.runner
    kernel = _reference_kernel()
    small, large = (PrefillGraph(runner, t, None, capture=False, kernel=kernel) for t in (16, 64))
    saved, runner._prefill_graphs = runner._prefill_graphs, [small, large]
    try:
        a, b = _prompts(engine, [30, 10], seed=1)
        pick = runner._prefill_graph_for
        assert pick([(1, 0, a[:9])], [[8]]) is small
        assert pick([(1, 0, a), (2, 0, b)], [[29], []]) is large
        assert pick([(1, 16, a[:10])], [[9]]) is small  # resumed: 16 cached keys, as many as the bucket's tokens
        assert pick([(1, 17, a[:10])], [[9]]) is large  # 17 cached keys: the next bucket
        assert pick([(1, 40, a), (2, 30, b)], [[29], [9]]) is None  # 70 cached keys: more than any bucket takes
        assert pick([(1, 0, a)], [list(range(30))]) is None  # prompt logprobs: every position's logits
        many = [(i, 0, [5]) for i in range(PREFILL_GRAPH_VARLEN_SEGMENTS)]
        assert pick(many, [[0]] * len(many)) is large
        assert pick([*many, (99, 0, [5])], [[0]] * (len(many) + 1)) is None
    finally:
        runner._prefill_graphs = saved


def test_engine_output_is_the_same_through_varlen_graph_steps(engine, monkeypatch):
    """Greedy generation with every prefill step through the (eager) varlen graph body equals generation without
    it, with prompts split over several steps by a small token budget (resumed segments through the graph)."""
    calls = []
    graphs = [PrefillGraph(engine.runner, t, None, capture=False, kernel=_reference_kernel(calls))
              for t in (16, 32, 64)]
    monkeypatch.setattr(engine, "max_batch_tokens", 24)
    eager, through = _generate_eager_and_through(engine, _prompts(engine, [3, 17, 40, 9, 33], seed=4), graphs, 6)

    def resumed(cu_q: list[int], cu_k: list[int]) -> bool:  # a segment attending to more keys than its queries
        return any(cu_k[i + 1] - cu_k[i] > cu_q[i + 1] - cu_q[i] for i in range(len(cu_q) - 1))

    assert any(resumed(q, k) for q, k, _, _ in calls), "no resumed prompt went through the graph"
    assert through == eager
