"""copt serve's start tells what its longest silent stretch is doing: compiling the decode layers and capturing CUDA
graphs (core/serve/loading.py capture_graphs_with_notice), and how long it took; a runner without graphs says
nothing."""

from __future__ import annotations

import io

from clusteropt_cli.core.serve.loading import capture_graphs_with_notice


class _Runner:
    def __init__(self, use_graphs: bool, decode: int, prefill: int):
        self.use_graphs, self.decode, self.prefill, self.calls = use_graphs, decode, prefill, []

    def capture_graphs(self, max_batch: int) -> int:
        self.calls.append(("decode", max_batch))
        return self.decode

    def capture_prefill_graphs(self, max_tokens: int) -> int:
        self.calls.append(("prefill", max_tokens))
        return self.prefill


def test_a_capturing_start_says_so_before_and_after() -> None:
    log = io.StringIO()
    runner = _Runner(True, 32, 6)
    assert capture_graphs_with_notice(runner, 256, 2048, log) == (32, 6)
    assert runner.calls == [("decode", 256), ("prefill", 2048)]
    before, after = log.getvalue().splitlines()
    assert "capturing CUDA graphs (batches up to 256, prefill up to 2,048 tokens)" in before
    assert after.startswith("copt serve: 32 decode and 6 prefill graphs in ") and after.endswith(" s")


def test_a_failed_capture_points_at_its_warning() -> None:
    log = io.StringIO()
    assert capture_graphs_with_notice(_Runner(True, 0, 0), 8, 512, log) == (0, 0)
    assert "no decode graphs (decoding eagerly: see the warning above)" in log.getvalue().splitlines()[-1]


def test_no_graphs_no_notice() -> None:
    log = io.StringIO()
    runner = _Runner(False, 0, 0)
    assert capture_graphs_with_notice(runner, 8, 512, log) == (0, 0)
    assert log.getvalue() == "" and [name for name, _ in runner.calls] == ["decode", "prefill"]
