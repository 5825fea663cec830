"""server.observe_many: queued inter-token samples enter a histogram as one increment per bucket and one of the sum
— the same exposition as one observe() per token (values on bucket bounds, above the last bound, zero)."""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")


def _exposition(feed) -> str:
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from clusteropt_cli.core.serve.server import ITL_BUCKETS

    registry = CollectorRegistry()
    histogram = Histogram("itl", "inter-token latency", ["model_name"], buckets=ITL_BUCKETS,
                          registry=registry).labels("m")
    feed(histogram)
    return "\n".join(line for line in generate_latest(registry).decode().splitlines() if "_created" not in line)


SAMPLES = [(0.0, 1), (0.0005, 3), (0.0007, 2), (0.001, 1), (0.013, 40), (0.0999, 5), (2.5, 1), (3.0, 2), (0.25, 7)]


def test_batched_samples_give_the_per_token_exposition():
    from clusteropt_cli.core.serve.server import observe_many

    def one_by_one(histogram):
        for value, count in SAMPLES:
            for _ in range(count):
                histogram.observe(value)

    want = _exposition(one_by_one)
    got = _exposition(lambda h: observe_many(h, SAMPLES))
    assert got == want
    assert 'itl_bucket{le="+Inf",model_name="m"} 62.0' in got  # every sample counted once


def test_other_histogram_layouts_take_samples_one_by_one():
    from clusteropt_cli.core.serve.server import observe_many

    class Plain:
        def __init__(self):
            self.seen = []

        def observe(self, value):
            self.seen.append(value)

    plain = Plain()
    observe_many(plain, [(0.5, 2), (0.1, 1)])
    assert plain.seen == [0.5, 0.5, 0.1]
