"""The CLI tests' fork server (tests/cli_zygote.py) gives what a fresh `python -m clusteropt_cli` gives: exit code,
stdout and stderr apart, the caller's working directory, umask and COPT_ variables; a timeout kills the call's
process group and raises as subprocess.run does; calls a fork could change go to a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.cli_zygote import REPO, Zygote
from tests.integration.test_serve_helpers import free_port


@pytest.fixture(scope="module")
def zygote():
    server = Zygote({**os.environ, "PYTHONPATH": str(REPO)})
    yield server
    if server.process is not None:
        server.process.stdin.close()
        server.process.wait(timeout=30)


def _fresh(args: tuple[str, ...], env: dict, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clusteropt_cli", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=120)


@pytest.mark.parametrize("args", [("--help",), ("advise", "--model", "no-such-model-anywhere"),
                                  ("advise", "--model", "llama-3.2-1b", "--gpu", "h100", "--task", "train",
                                   "--micro-batch", "2", "--seq-len", "512", "--json")])
def test_a_forked_call_equals_a_fresh_interpreter(zygote, args):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    forked, fresh = zygote.run(args, env, None, 120, None), _fresh(args, env)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert forked.args == [sys.executable, "-m", "clusteropt_cli", *args]


def test_the_callers_directory_umask_and_copt_variables_reach_the_call(zygote, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "COPT_NO_SUCH_SETTING": "1"}
    assert zygote.forkable(env, ())
    args = ("advise", "--model", "llama-3.2-1b", "--gpu", "h100", "--task", "train", "--micro-batch", "2",
            "--seq-len", "512", "--emit-recipe", "plan.yaml")
    mask = os.umask(0o027)
    try:
        done = zygote.run(args, env, tmp_path, 120, None)
    finally:
        os.umask(mask)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "plan.yaml").stat().st_mode & 0o777 == 0o640


def test_calls_a_fork_could_change_run_in_a_fresh_interpreter(zygote, monkeypatch):
    base = {**os.environ, "PYTHONPATH": str(REPO)}
    assert zygote.forkable(base, ("advise",))
    assert not zygote.forkable(base, ("--debug", "advise"))
    assert not zygote.forkable({**base, "COPT_DEBUG": "1"}, ("advise",))
    assert not zygote.forkable({**base, "HOME": "/elsewhere"}, ("advise",))  # read by libraries at import
    assert not zygote.forkable({**base, "OMP_NUM_THREADS": "7"}, ("advise",))
    monkeypatch.setenv("COPT_TEST_SUBPROCESS", "1")
    assert not zygote.forkable(base, ("advise",))


def test_a_timeout_kills_the_call_and_raises_as_subprocess_does(zygote, fixtures):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with pytest.raises(subprocess.TimeoutExpired) as timed_out:
        zygote.run(("serve", str(fixtures.student), "--port", str(port)), env, None, 5, None)
    assert timed_out.value.cmd[-2:] == ["--port", str(port)]
    with pytest.raises(ProcessLookupError):
        os.kill(zygote.last_pid, 0)  # killed and reaped by the server
    done = zygote.run(("--help",), env, None, 60, None)  # the server goes on
    assert done.returncode == 0


def test_each_test_starts_in_the_environment_the_suites_fork_server_has():
    """Libraries set variables in os.environ when the test modules import them (at collection) or when a test does
    (KMP_*, TORCHINDUCTOR_CACHE_DIR, HF_XET_HIGH_PERFORMANCE, GPTQModel's HF_HOME): the suite puts the environment
    back after collection and after each test, or every later copt call would take a fresh interpreter (in the whole
    suite, every one did)."""
    from tests.conftest import _WORKER_ENV

    assert Zygote(_WORKER_ENV).unforkable_because({**os.environ, "PYTHONPATH": str(REPO)}, ("advise",)) == []


def test_a_variable_a_test_leaves_behind_is_gone_for_the_next():
    """Two halves of one check, in file order: this test sets a variable the way a library's import does."""
    os.environ["COPT_TEST_LEFT_BEHIND_BY_A_LIBRARY"] = "1"
    os.environ["KMP_DUPLICATE_LIB_OK"] = "True"


def test_the_variable_left_behind_is_gone():
    from tests.conftest import _ENV_AT_START

    assert "COPT_TEST_LEFT_BEHIND_BY_A_LIBRARY" not in os.environ
    assert os.environ.get("KMP_DUPLICATE_LIB_OK") == _ENV_AT_START.get("KMP_DUPLICATE_LIB_OK")
