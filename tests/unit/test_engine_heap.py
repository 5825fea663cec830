"""A running engine keeps the start-up heap (the loaded model, torch, transformers) out of the garbage collector's
full collections, as `copt serve` does; the objects go back when the process's last running engine stops."""

from __future__ import annotations

import gc

import pytest

pytest.importorskip("torch")


def test_running_engines_freeze_the_start_up_heap(fixtures):
    from clusteropt_cli.core.serve import engine as engine_module
    from clusteropt_cli.core.serve.engine import Engine, EngineConfig

    def engine() -> Engine:
        return Engine(EngineConfig(model=str(fixtures.teacher), device="cpu", max_batch_size=2, max_model_len=64))

    running = engine_module._heap_holders  # engines other tests of this process left running
    first = engine().start()
    frozen = gc.get_freeze_count()
    assert frozen > 1000 and engine_module._heap_holders == running + 1  # the loaded model's objects among them
    second = engine().start()
    assert gc.get_freeze_count() >= frozen and engine_module._heap_holders == running + 2
    first.stop()
    assert gc.get_freeze_count() >= frozen  # the second one still runs
    second.stop()
    second.stop()  # stopping twice releases nothing twice
    assert engine_module._heap_holders == running
    if running == 0:
        assert gc.get_freeze_count() == 0
