"""Start the embedded engine and its HTTP server from validated ServeRecipe settings."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clusteropt_cli.errors import BadInputError

if TYPE_CHECKING:
    from clusteropt_cli.recipe.schema.serve import ServeRecipe


def _check_model_dir(path: str, flag: str) -> None:
    from clusteropt_cli.modelspec import check_model_files, read_config_json, refuse_config_file

    refuse_config_file(path, flag)
    p = Path(path).expanduser()
    if not p.is_dir() or not (p / "config.json").is_file():
        raise BadInputError(f"{flag} '{path}' is not a local model directory (no config.json there).",
                            hint="Pass a Hugging Face model directory; copt never downloads weights.")
    read_config_json(p / "config.json", flag)
    check_model_files(p, flag)


API_KEY_ENV = ("COPT_API_KEY", "VLLM_API_KEY")  # read in this order when --api-key / api_key is not given


def resolve_api_key(settings: ServeRecipe, environ: dict[str, str] | None = None) -> tuple[str | None, str | None]:
    """(key, where it came from): --api-key / the recipe's api_key, else the first of API_KEY_ENV that is set (so
    the key need not appear in `ps`). An empty or non-ASCII key is refused before anything loads."""
    import os

    from clusteropt_cli.recipe.schema.serve import api_key_problems

    if settings.api_key is not None:
        return settings.api_key, "--api-key"
    env = os.environ if environ is None else environ
    for name in API_KEY_ENV:
        if name in env:
            problems = api_key_problems(env[name], name)
            if problems:
                raise BadInputError(problems[0] + ".", hint=f"Set {name} to the key, or unset it.")
            return env[name], name
    return None, None


def is_loopback(host: str) -> bool:
    import ipaddress

    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def server_limits(settings: ServeRecipe) -> Any:
    from clusteropt_cli.core.serve.server import ServerLimits

    return ServerLimits(max_request_bytes=settings.max_request_bytes, max_prompt_chars=settings.max_prompt_chars,
                        trust_request_chat_template=settings.trust_request_chat_template,
                        metrics_public=settings.metrics_public, read_timeout=settings.read_timeout,
                        write_timeout=settings.write_timeout, max_connections=settings.max_connections)


# what copt serve's serve extra installs for speed on a GPU: the split server's IPC, uvicorn's fast loop and parser
SPEED_PACKAGES = {"zmq": "pyzmq", "msgpack": "msgpack", "uvloop": "uvloop", "httptools": "httptools"}


def missing_speed_packages() -> list[str]:
    """The distributions of SPEED_PACKAGES that are not installed (found without importing them)."""
    import importlib.util

    return [dist for module, dist in SPEED_PACKAGES.items() if importlib.util.find_spec(module) is None]


def resolve_api_server_count(settings: ServeRecipe, warn: Callable[[str], None] | None = None) -> ServeRecipe:
    """The settings with api_server_count decided when it was left unset: one API-server process in front of the
    engine core when the engine will run on a GPU (on an H200, 256 streaming clients on the 1B shape: 1.6-1.7x the
    single process's output tokens/s, batch-1 decode within 0.5%), none on a CPU, where the two would share the
    same few cores, or when ZeroMQ/msgpack are missing. On a GPU, `warn` is told which of SPEED_PACKAGES are
    missing (a server that silently runs slower than the one measured is worse than a line on stderr)."""
    import torch

    on_gpu = torch.cuda.is_available()
    missing = missing_speed_packages()
    if on_gpu and missing and warn is not None:
        single = settings.api_server_count is None and {"pyzmq", "msgpack"} & set(missing)
        warn(f"{', '.join(missing)} not installed: "
             + ("one process serves HTTP and runs the engine, " if single else "")
             + "slower under load than copt serve's defaults on a GPU. pip install 'clusteropt-cli[serve]' "
             "installs them.")
    if settings.api_server_count is not None:
        return settings
    split = on_gpu and "pyzmq" not in missing and "msgpack" not in missing
    return settings.model_copy(update={"api_server_count": 1 if split else 0})


def check_settings(settings: ServeRecipe) -> None:
    """Validate what can be checked before loading anything (paths, port, option combinations)."""
    from clusteropt_cli.deps import require

    require("fastapi", "serve")
    require("uvicorn", "serve")
    if settings.api_server_count:  # the split server's IPC
        require("zmq", "serve")
        require("msgpack", "serve")
    _check_model_dir(settings.model, "MODEL")
    if settings.draft_model:
        _check_model_dir(settings.draft_model, "--draft-model")
    if settings.tokenizer is not None:
        from clusteropt_cli.modelspec import tokenizer_dir_problem

        if (problem := tokenizer_dir_problem(settings.tokenizer)) is not None:
            raise BadInputError(problem + ".", hint="Pass the directory that holds the model's tokenizer files, or "
                                                    "leave --tokenizer out to use MODEL's.")
    else:
        from clusteropt_cli.modelspec import tokenizer_code_problem

        if (problem := tokenizer_code_problem(Path(settings.model).expanduser())) is not None:
            raise BadInputError(f"MODEL {settings.model}: {problem}.",
                                hint="Pass --tokenizer DIR with a tokenizer transformers implements (e.g. one "
                                     "save_pretrained as a PreTrainedTokenizerFast from this tokenizer.json).")
    if settings.tensor_parallel > 1 or settings.pipeline_parallel > 1:
        raise BadInputError("The embedded engine runs on one device; --tensor-parallel/--pipeline-parallel need "
                            "vLLM.", hint="Use --engine vllm (on a machine with vLLM installed).")
    if settings.quantization:
        raise BadInputError("--quantization is a vLLM option; the embedded engine reads the checkpoint's own "
                            "quantization config.", hint="Drop --quantization or use --engine vllm.")
    if settings.kv_cache_dtype == "int8":
        raise BadInputError("--kv-cache-dtype int8 needs vLLM; the embedded engine stores the KV cache in the model "
                            "dtype or fp8.", hint="Use --kv-cache-dtype fp8, --engine vllm, or drop --kv-cache-dtype.")
    if settings.port:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((settings.host, settings.port))
            except OSError as exc:
                raise BadInputError(f"Cannot bind {settings.host}:{settings.port}: {exc.strerror}.",
                                    hint="Pick another --port (or stop the process using it).") from None


def serve_transformers(settings: ServeRecipe, on_ready: Callable[[str, dict], None] | None = None) -> int:
    """Load the engine, serve until SIGTERM, drain, return the exit status."""
    from clusteropt_cli.core.serve.engine import Engine
    from clusteropt_cli.core.serve.engine_core import engine_info
    from clusteropt_cli.core.serve.server import run_server

    if settings.api_server_count:
        from clusteropt_cli.core.serve.multiprocess import serve_split

        return serve_split(settings, on_ready)
    engine = Engine.from_settings(settings)
    engine.start()
    name = settings.served_model_name or settings.model
    info = engine_info(engine, settings)
    return run_server(engine, host=settings.host, port=settings.port, served_model_name=name,
                      api_key=settings.api_key, grace_period=settings.grace_period,
                      on_ready=(lambda url: on_ready(url, info)) if on_ready else None,
                      limits=server_limits(settings))
