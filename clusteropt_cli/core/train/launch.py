"""Multi-process and multi-node runs: copt re-launches itself under the real launcher (torchrun or the deepspeed
launcher) with the same arguments; every rank then calls run_training. No process management of our own.
`copt train` and `copt distill logits/sft` share this launcher: `child_args` (what the ranks run),
`plan_launch` (the command) and `run_or_launch` (run here, or launch and read rank 0's result file back).

- one node, N processes: `torchrun --standalone --nproc-per-node N -m clusteropt_cli train ARGS`
  (or `deepspeed --num_gpus N --no_local_rank --module clusteropt_cli train ARGS` with --launcher deepspeed;
  ranks read LOCAL_RANK from the environment, so no --local_rank argument is passed)
- M nodes with a hostfile and the deepspeed launcher: one command on the first host, which starts the others
  over ssh/pdsh: `deepspeed --hostfile H --num_nodes M --num_gpus N --master_addr A --master_port P --module ...`
- M nodes with torchrun: the same command on every node, meeting at a c10d rendezvous on the first host.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clusteropt_cli.errors import BadInputError

if TYPE_CHECKING:
    from clusteropt_cli.recipe.schema.base import TrainingOptions

DEFAULT_PORT = 29500


@dataclass
class LaunchPlan:
    launcher: str  # "none" | "torchrun" | "deepspeed"
    world_size: int
    nodes: int
    procs_per_node: int
    command: list[str]  # what copt runs here (empty for "none")
    per_node: bool = False  # torchrun multi-node: run `command` on every node
    hosts: list[dict[str, Any]] = field(default_factory=list)
    master_addr: str | None = None
    master_port: int | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def shell(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (env + " " if env else "") + shlex.join(self.command)


def parse_hostfile(path: str | Path) -> list[dict[str, Any]]:
    """DeepSpeed/MPI hostfile lines `hostname slots=N` (comments and blank lines skipped)."""
    from clusteropt_cli.core.textfiles import read_text_file

    hosts = []
    text = read_text_file(path, "--hostfile", "write one 'hostname slots=N' line per node")
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        slots = None
        for part in parts[1:]:
            if part.startswith("slots="):
                try:
                    slots = int(part.split("=", 1)[1])
                except ValueError:
                    slots = None
        if slots is None or slots < 1:
            raise BadInputError(f"{path}:{number}: expected 'hostname slots=N', got '{raw.strip()}'.",
                                hint="write one 'hostname slots=N' line per node")
        hosts.append({"host": parts[0], "slots": slots})
    if not hosts:
        raise BadInputError(f"--hostfile {path} lists no hosts.", hint="write one 'hostname slots=N' line per node")
    return hosts


# The hidden root flag copt's own launch commands put before the command (`python -m clusteropt_cli --launched-rank
# train ...`): it reaches every rank on every node (an environment variable would not cross the deepspeed launcher's
# ssh), and it is what tells a rank copt launched (its parent validated and prepared the output) from a process
# that merely has WORLD_SIZE and RANK in its environment (any torchrun, SLURM or Kubeflow job).
LAUNCHED_RANK_FLAG = "--launched-rank"
LAUNCHED_RANK_ENV = "COPT_LAUNCHED_RANK"


def is_launched_child() -> bool:
    """True inside a rank copt's own launcher started for this run (see LAUNCHED_RANK_FLAG)."""
    return os.environ.get(LAUNCHED_RANK_ENV) == "1" and "WORLD_SIZE" in os.environ and "RANK" in os.environ


def refuse_outside_launcher(command: str) -> None:
    """Refuse to run as one of several processes an outside launcher started (WORLD_SIZE > 1 without copt's
    launch): copt validates, prepares the output and starts the ranks itself. WORLD_SIZE=1 runs as one process."""
    if is_launched_child() or "WORLD_SIZE" not in os.environ:
        return
    try:
        world = int(os.environ["WORLD_SIZE"])
    except ValueError:
        world = 2
    if world > 1:
        raise BadInputError(f"copt {command} was started as rank {os.environ.get('RANK', '?')} of WORLD_SIZE={world} "
                            "processes by a launcher outside copt.",
                            hint=f"run copt {command} once per node with --gpus N (and --nodes M): copt starts "
                                 "torchrun or deepspeed itself")


def choose_launcher(options: Any) -> str:
    """auto: the deepspeed launcher for multi-node runs with a hostfile (it starts the other nodes itself),
    torchrun otherwise (also for ZeRO on one node: deepspeed.initialize works under torchrun)."""
    if options.launcher != "auto":
        return options.launcher
    return "deepspeed" if options.nodes > 1 and options.hostfile else "torchrun"


def plan_launch(options: Any, copt_args: list[str], python: str | None = None) -> LaunchPlan:
    """The launch command for gpus × nodes processes running `copt <copt_args>` (validated, nothing started)."""
    python = python or sys.executable
    world = int(options.gpus) * int(options.nodes)
    if world == 1:
        return LaunchPlan("none", 1, 1, 1, [])
    hosts = parse_hostfile(options.hostfile) if options.hostfile else []
    if hosts:
        if len(hosts) < options.nodes:
            raise BadInputError(f"--nodes {options.nodes} but --hostfile {options.hostfile} lists {len(hosts)} "
                                "host(s).",
                                hint="list every node in the hostfile or lower --nodes")
        short = [h["host"] for h in hosts[: options.nodes] if h["slots"] < options.gpus]
        if short:
            raise BadInputError(f"--gpus {options.gpus} exceeds the slots of {', '.join(short)} in the hostfile.",
                                hint="lower --gpus or raise the hosts' slots")
    launcher = choose_launcher(options)
    master_addr = options.master_addr or (hosts[0]["host"] if hosts else ("127.0.0.1" if options.nodes == 1 else None))
    if options.nodes > 1 and master_addr is None:
        raise BadInputError(f"--nodes {options.nodes} needs --hostfile or --master-addr (the first node's address).",
                            hint="pass --hostfile with one 'hostname slots=N' line per node")
    port = int(options.master_port or DEFAULT_PORT)
    env: dict[str, str] = {}
    if launcher == "deepspeed":
        command = ["deepspeed"]
        if hosts:
            command += ["--hostfile", str(Path(options.hostfile).resolve()), "--num_nodes", str(options.nodes)]
        command += ["--num_gpus", str(options.gpus), "--master_addr", master_addr, "--master_port", str(port),
                    "--no_local_rank", "--module", "clusteropt_cli", LAUNCHED_RANK_FLAG, *copt_args]
        return LaunchPlan("deepspeed", world, options.nodes, options.gpus, command, hosts=hosts,
                          master_addr=master_addr, master_port=port, env=env)
    command = [python, "-m", "torch.distributed.run"]
    if options.nodes == 1:
        command += ["--standalone", "--nproc-per-node", str(options.gpus)]
    else:
        run_id = hashlib.sha1(shlex.join(copt_args).encode()).hexdigest()[:12]
        command += ["--nnodes", str(options.nodes), "--nproc-per-node", str(options.gpus), "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"{master_addr}:{port}", "--rdzv-id", f"copt-{run_id}"]
    command += ["-m", "clusteropt_cli", LAUNCHED_RANK_FLAG, *copt_args]
    return LaunchPlan("torchrun", world, options.nodes, options.gpus, command, per_node=options.nodes > 1,
                      hosts=hosts, master_addr=master_addr, master_port=port, env=env)


RANK_ERROR_DIR = "COPT_RANK_ERROR_DIR"  # where a launched rank records the copt error it exits with
LAUNCHER_STOP_S = 60.0  # how long a stopped copt waits for its launcher to stop the ranks before killing it


def run_launch(plan: LaunchPlan, env_extra: dict[str, str] | None = None) -> int:
    """Run the launcher in the foreground and return its exit code. All of its output goes to stderr: stdout is
    reserved for the result, which the parent reads from the run's result file (run_or_launch)."""
    import subprocess

    env = {**os.environ, **plan.env, **(env_extra or {})}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, plan.procs_per_node))))
    try:
        proc = subprocess.Popen(plan.command, env=env, stdout=sys.stderr.fileno())
    except FileNotFoundError:
        raise BadInputError(f"The launcher '{plan.command[0]}' is not on PATH.",
                            hint="pip install 'clusteropt-cli[train]' (deepspeed) or use --launcher torchrun") from None
    try:
        return proc.wait()
    except BaseException:  # Ctrl-C or SIGTERM: the launcher passes SIGTERM on to its ranks, which clean up
        import signal

        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=LAUNCHER_STOP_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise


def run_launch_checked(plan: LaunchPlan, what: str) -> None:
    """run_launch; when the processes fail, raise the copt error a rank exited with (its message, hint and exit
    code: a bad input stays exit 2, a full disk exit 7), else a generic error naming the launcher's exit code."""
    import json
    import shutil
    import tempfile

    from clusteropt_cli.errors import CoptError

    errors = tempfile.mkdtemp(prefix="copt-rank-errors-")
    try:
        code = run_launch(plan, {RANK_ERROR_DIR: errors})
        if code == 0:
            return
        for file in sorted(Path(errors).glob("rank-*.json"), key=lambda f: int(f.stem.split("-")[1])):
            try:
                doc = json.loads(file.read_text())
                raise CoptError(str(doc["message"]), doc.get("hint"), exit_code=int(doc["exit_code"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue
    finally:
        shutil.rmtree(errors, ignore_errors=True)
    raise CoptError(f"The {what} processes exited with code {code} (their errors are printed above).",
                    hint="fix the error above; with --save-every, rerun with --resume to continue")


def leave_finished_rank() -> None:
    """End a launched rank whose run is done and written (rank 0's result file, checkpoints, the process group torn
    down) without the interpreter's teardown: there a ZeRO-3 + CPU offload rank's background threads sometimes
    aborted it (SIGABRT, "terminate called without an active exception") after the last step, and the launcher
    reported a finished run as failed."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def record_rank_error(exit_code: int, message: str, hint: str | None) -> None:
    """(in a launched rank) Leave the error for the launching copt, which exits with the same code."""
    import json

    directory = os.environ.get(RANK_ERROR_DIR)
    if not directory or "RANK" not in os.environ:
        return
    try:
        (Path(directory) / f"rank-{int(os.environ['RANK'])}.json").write_text(
            json.dumps({"exit_code": exit_code, "message": message, "hint": hint}))
    except (OSError, ValueError):
        pass


def child_args(settings: TrainingOptions, words: list[str], *, exclude: Iterable[str] = (),
               extra: Iterable[str] = ()) -> list[str]:
    """The copt arguments every rank runs: this process's own (when sys.argv holds this invocation, e.g.
    `copt train ...` or `python -m clusteropt_cli train ...`), or, when copt was called programmatically (a test
    runner's argv), `words` (e.g. ["distill", "sft"]) with every setting as an override, then `extra`."""
    if words[0] in sys.argv[1:]:
        return sys.argv[1:]
    overrides = settings.model_dump(exclude_none=True, exclude=set(exclude))
    return [*words, *(f"{k}={v}" for k, v in overrides.items()), *extra]


def run_or_launch(plan: LaunchPlan, run_here: Callable[[], Any], *, output: str | Path, overwrite: bool,
                  resume: bool, command: str, result_file: str, what: str,
                  log: Callable[[str], None] = lambda _message: None) -> Any:
    """Run in this process (plan.launcher "none": returns run_here()'s value; run_here prepares the output), or
    prepare the output directory (copt's output rule; --overwrite moves the old output aside, restored on failure),
    start the plan's processes (every rank runs run_here) and return rank 0's result read back from
    output/result_file (None when it wrote none). With resume, the checkpoints are checked (exit 2) before launching;
    a failing launch raises the copt error a rank exited with, else a CoptError naming `what` processes."""
    if plan.launcher == "none":
        return run_here()
    from clusteropt_cli.core.io import replacing_output_dir

    out = Path(output)
    if resume:  # a checkpoint that cannot resume: exit 2 before launching
        from clusteropt_cli.core.train.loop import resume_point

        resume_point(out, hashes=False)
    with replacing_output_dir(out, overwrite=overwrite, resume=resume, command=command):
        log(f"launching {plan.world_size} processes with {plan.launcher}: {plan.shell}")
        run_launch_checked(plan, what)  # a rank's copt error keeps its exit code
    path = out / result_file
    return json.loads(path.read_text()) if path.exists() else None
