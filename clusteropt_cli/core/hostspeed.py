"""How fast this host runs the kind of Python a serving engine's host side runs.

copt's engine does part of each step on the host: per sequence it reads the step's tokens back, appends them, checks
stops and hands them to the API process; per prompt chunk it schedules, fills the block tables and stages the first
token. Where no GPU work hides that work (a step that decodes and prefills, a small model's step) its time moves with
the host's single-thread speed: the same H100 ran the 1B's packed prefill steps 1.2–1.3× faster on one host than
another. advise prices that work for the machines it was calibrated on (calibration.HOST_LOOP_REFERENCE_S) and
scales it by this probe's ratio when it knows the serving host's.
"""

from __future__ import annotations

import time

LOOP_ITERATIONS = 100_000
DEFAULT_REPEATS = 7


def _reference_loop() -> int:
    """A fixed pure-Python loop of dictionary lookups and integer adds (what bench/common.host_probe has timed in
    every benchmark run since 614c260)."""
    table = {i: i * 3 for i in range(1000)}
    total = 0
    for i in range(LOOP_ITERATIONS):
        total += table[i % 1000]
    return total


def python_loop_seconds(repeats: int = DEFAULT_REPEATS) -> float:
    """The reference loop's time in seconds: the fastest of `repeats` runs, the one other processes disturbed least
    (about 5–15 ms on the servers measured; 0.05–0.1 s of probing in all). A host whose cores are all busy still
    reads slower than it serves; --host-loop-ms then gives the idle figure."""
    _reference_loop()  # a first run to bring the core out of idle (not timed)
    times = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        _reference_loop()
        times.append(time.perf_counter() - start)
    return min(times)
