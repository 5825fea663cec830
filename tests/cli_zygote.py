"""A fork server for the CLI tests: `python -m tests.cli_zygote` imports torch, transformers and copt once, then
forks one process per `copt` call. Each call is still a process of its own (its own exit code, files, signals and
process group, stdout and stderr apart), started the way a user's is, less the interpreter start and the ~5 s of
imports every fresh process pays on a small CPU machine.

A call runs in a fresh interpreter instead when it could see the difference: `--debug` (the libraries' log levels
are set at import), an environment that differs from the server's in a variable read at import time (anything but
COPT_* and a few read at run time), or COPT_TEST_SUBPROCESS=1 for the whole run.

Protocol (one JSON object per line): the client sends {args, env, cwd, umask, stdin, stdout, stderr} (the last
three: file paths); the server answers {"pid": N} once the child runs, then {"status": S} (a returncode as
subprocess gives it: negative for a signal).
"""

from __future__ import annotations

import atexit
import gc
import importlib
import io
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAIN = REPO / "clusteropt_cli" / "__main__.py"
# read when a process runs, not when a library is imported: a call may change them and still be forked (the last two
# are set in the test process by libraries a module's fixtures load: tokenizers reads its variable when it would
# parallelize, torch.cuda its own when asked for a device)
RUNTIME_VARIABLES = {"WORLD_SIZE", "RANK", "LOCAL_RANK", "http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY",
                     "HTTPS_PROXY", "NO_PROXY", "NETRC", "PYTEST_CURRENT_TEST", "TOKENIZERS_PARALLELISM",
                     "PYTORCH_NVML_BASED_CUDA_CHECK"}


def _preload() -> None:
    from clusteropt_cli.app import _QUIET_ENV

    for key, value in _QUIET_ENV.items():  # as copt's main() sets them before anything imports transformers
        os.environ.setdefault(key, value)
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401

    import clusteropt_cli.app  # noqa: F401
    import clusteropt_cli.commands  # noqa: F401

    del transformers


def _child(request: dict, channel: tuple[io.TextIOBase, io.TextIOBase]) -> None:
    """In the forked process: become `python -m clusteropt_cli ARGS` with the caller's env, cwd, umask and files."""
    for stream in channel:
        stream.close()
    os.setpgid(0, 0)  # its own process group, as a shell gives a job: a timeout kills what it started too
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    for fd, path, mode in ((0, request["stdin"], os.O_RDONLY), (1, request["stdout"], os.O_WRONLY),
                           (2, request["stderr"], os.O_WRONLY)):
        opened = os.open(path, mode)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = sys.__stdin__ = open(0, closefd=False)  # noqa: SIM115 - the process's own streams
    sys.stdout = sys.__stdout__ = open(1, "w", closefd=False)  # noqa: SIM115
    sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115
    sys.argv = [str(MAIN), *request["args"]]
    sys.path[0] = os.getcwd()  # as `python -m` puts its working directory first
    sys.modules["__main__"] = importlib.import_module("clusteropt_cli.__main__")  # what spawn re-imports
    from clusteropt_cli.app import main

    try:
        main(request["args"])
        code = 0
    except SystemExit as exit_:  # as the interpreter reads it: None is 0, a message goes to stderr and exits 1
        code = 0 if exit_.code is None else exit_.code if isinstance(exit_.code, int) else 1
        if not isinstance(exit_.code, int | None):
            print(exit_.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - uncaught, as the interpreter reports it
        traceback.print_exc()
        code = 1
    # the interpreter's shutdown less its teardown of every module (seconds with torch loaded): non-daemon threads
    # joined, atexit handlers run, streams flushed
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def serve() -> None:
    """Read requests from stdin, fork a child for each, report its pid and its returncode on stdout."""
    channel = (os.dup(0), os.dup(1))
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)  # nothing the server prints can break the protocol
    _preload()
    gc.freeze()  # children leave the preloaded objects to the parent: no copying them on their first collection
    reader, writer = os.fdopen(channel[0], "r"), os.fdopen(channel[1], "w")
    writer.write(json.dumps({"ready": os.getpid()}) + "\n")
    writer.flush()
    for line in reader:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request, (reader, writer))
        writer.write(json.dumps({"pid": pid}) + "\n")
        writer.flush()
        _, status = os.waitpid(pid, 0)
        writer.write(json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n")
        writer.flush()
    os._exit(0)  # the client is gone; the frozen preloaded objects need no teardown


class Zygote:
    """The client side, one per pytest worker: starts the server on first use, sends calls, enforces timeouts."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = dict(env)
        self.process: subprocess.Popen | None = None
        self.pending = b""
        self.last_pid: int | None = None
        self.lock = threading.Lock()  # one call at a time on the one channel

    def _start(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", "tests.cli_zygote"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=self.env, cwd=REPO)
        self._message(deadline=time.monotonic() + 300)

    def _message(self, deadline: float) -> dict | None:
        """The server's next line, or None at the deadline; a dead server raises."""
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            with selectors.DefaultSelector() as selector:
                selector.register(self.process.stdout, selectors.EVENT_READ)
                if not selector.select(left):
                    continue
            chunk = os.read(self.process.stdout.fileno(), 65536)
            if not chunk:
                raise RuntimeError(f"the CLI fork server exited ({self.process.poll()})")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def forkable(self, env: dict[str, str], args: tuple[str, ...]) -> bool:
        """Whether a forked child would behave as a fresh interpreter for this call."""
        return not self.unforkable_because(env, args)

    def unforkable_because(self, env: dict[str, str], args: tuple[str, ...]) -> list[str]:
        """What makes this call take a fresh interpreter: the flag or setting, or the variables that differ from
        the server's environment; empty when it can fork."""
        if "--debug" in args:
            return ["--debug"]
        if os.environ.get("COPT_TEST_SUBPROCESS") == "1":
            return ["COPT_TEST_SUBPROCESS=1"]
        changed = {key for key in env.keys() | self.env.keys() if env.get(key) != self.env.get(key)}
        return sorted(key for key in changed
                      if not ((key.startswith("COPT_") and key != "COPT_DEBUG") or key in RUNTIME_VARIABLES))

    def run(self, args: tuple[str, ...], env: dict[str, str], cwd: Path | None, timeout: float,
            input: str | None) -> subprocess.CompletedProcess:
        with self.lock:
            return self._run(args, env, cwd, timeout, input)

    def _run(self, args: tuple[str, ...], env: dict[str, str], cwd: Path | None, timeout: float,
             input: str | None) -> subprocess.CompletedProcess:
        if self.process is None or self.process.poll() is not None:
            self._start()
        umask = os.umask(0o022)
        os.umask(umask)
        with tempfile.TemporaryDirectory(prefix="copt-call-") as tmp:
            stdin, stdout, stderr = Path(tmp) / "stdin", Path(tmp) / "stdout", Path(tmp) / "stderr"
            if input is not None:
                stdin.write_text(input)
            stdout.touch()
            stderr.touch()
            request = {"args": list(args), "env": env, "cwd": str(cwd or os.getcwd()), "umask": umask,
                       "stdin": str(stdin) if input is not None else os.devnull, "stdout": str(stdout),
                       "stderr": str(stderr)}
            self.process.stdin.write((json.dumps(request) + "\n").encode())
            self.process.stdin.flush()
            deadline = time.monotonic() + timeout
            pid = self.last_pid = self._message(deadline=time.monotonic() + 60)["pid"]
            done = self._message(deadline)
            command = [sys.executable, "-m", "clusteropt_cli", *args]
            if done is None:  # as subprocess.run: kill it (its process group), then raise
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self._message(deadline=time.monotonic() + 60)
                raise subprocess.TimeoutExpired(command, timeout, output=_read(stdout), stderr=_read(stderr))
            return subprocess.CompletedProcess(command, done["status"], _read(stdout), _read(stderr))


def _read(path: Path) -> str:
    """A captured stream as subprocess.run(text=True) returns it (the locale's encoding, universal newlines)."""
    with open(path, encoding=None, errors="strict", newline=None) as handle:
        return handle.read()


if __name__ == "__main__":
    serve()
