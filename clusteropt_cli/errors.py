"""One error family for copt: a message, a hint naming the fix, and an exit code.

Exit codes (documented in the README):
    0  success
    1  internal error (a bug: run again with --debug and report it)
    2  bad input: a flag, a file, a recipe key, a command line that cannot work
    3  a missing optional dependency (install the extra named in the hint)
    4  unsupported hardware (e.g. FP8 on a GPU below compute capability 8.9)
    5  out of memory
    6  a check failed: the plan does not fit (--fail-if-oom), a prediction missed (--tolerance), training diverged
    7  no space left on the device an output is written to (the partial files are removed)
    130 interrupted (Ctrl-C); 143 terminated (SIGTERM)
"""

from __future__ import annotations

from collections.abc import Callable


class CoptError(Exception):
    """Base of every error copt reports to a user."""

    exit_code: int = 1

    def __init__(self, message: str, hint: str | None = None, *, exit_code: int | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        if exit_code is not None:
            self.exit_code = exit_code

    def __str__(self) -> str:
        return self.message


class BadInputError(CoptError):
    """A flag, file or value that cannot work."""

    exit_code = 2


class RecipeError(BadInputError):
    """A recipe that does not validate; `problems` lists every issue found, each naming its key."""

    def __init__(self, message: str, problems: list[str] | None = None, hint: str | None = None):
        self.problems = list(problems or [])
        if self.problems:
            message = message + "\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(message, hint)


class MissingDependencyError(CoptError):
    """An optional backend is not installed."""

    exit_code = 3


class UnsupportedHardwareError(CoptError):
    """The hardware cannot run what was asked."""

    exit_code = 4


class OutOfMemoryError(CoptError):
    """A GPU or the host ran out of memory, or would: weights larger than the host memory are refused up front."""

    exit_code = 5


class CheckFailedError(CoptError):
    """A gate failed: the plan does not fit, or a measurement missed its prediction."""

    exit_code = 6


class DiskFullError(CoptError):
    """An output ran out of space on its filesystem (ENOSPC); the partial files were removed."""

    exit_code = 7


def missing_extra(extra: str, module: str) -> MissingDependencyError:
    """The error for an optional extra whose module does not import."""
    return MissingDependencyError(
        f"'{module}' is not installed; it comes with the '{extra}' extra.",
        hint=f"pip install 'clusteropt-cli[{extra}]'",
    )


# Modules that belong to an extra: an ImportError naming one becomes a MissingDependencyError.
EXTRA_OF_MODULE: dict[str, str] = {
    "llmcompressor": "quantize",
    "compressed_tensors": "quantize",
    "gptqmodel": "gptq",
    "optimum": "gptq",
    "deepspeed": "train",
    "fastapi": "serve",
    "uvicorn": "serve",
    "prometheus_client": "serve",
    "aiohttp": "profile",
    "trl": "distill",
    "math_verify": "distill",
    "matplotlib": "profile",
    "openai": "dev",
}


def _from_import_error(exc: ImportError) -> CoptError | None:
    name = (exc.name or "").split(".")[0]
    if name in EXTRA_OF_MODULE:
        return missing_extra(EXTRA_OF_MODULE[name], name)
    return None


def _disk_full(exc: BaseException) -> CoptError | None:
    from clusteropt_cli.core.io import disk_full_error, is_disk_full

    if not is_disk_full(exc):
        return None
    path = getattr(exc, "filename", None)
    return disk_full_error(path) if path else DiskFullError(
        "No space left on device while writing an output.",
        hint="Free space there or choose an --output on a larger filesystem.")


def _from_os_error(exc: OSError) -> CoptError | None:
    mapped = _disk_full(exc)
    if mapped is not None:
        return mapped
    if isinstance(exc, PermissionError) and exc.filename:
        return BadInputError(f"Permission denied: {exc.filename}.",
                             hint="Choose a path you can read (inputs) or write (--output and the other outputs).")
    if isinstance(exc, (IsADirectoryError, NotADirectoryError)) and exc.filename:
        kind = "a directory" if isinstance(exc, IsADirectoryError) else "not a directory"
        return BadInputError(f"{exc.filename} is {kind}.", hint="Check the paths given to copt.")
    mapped = _model_files_mismatch(exc)
    if mapped is not None:
        return mapped
    text = str(exc)
    if "is not a local folder" in text or "does not appear to have a file named" in text or (
        "Can't load" in text and "config" in text
    ):
        return BadInputError(
            f"Model not found: {text.splitlines()[0]}",
            hint="Pass a local Hugging Face model directory (with config.json); copt never downloads weights.",
        )
    return None


def _from_runtime_error(exc: RuntimeError) -> CoptError | None:
    mapped = _disk_full(exc)
    if mapped is not None:
        return mapped
    text = str(exc)
    if "can't allocate memory" in text:  # torch's CPU allocator (DefaultCPUAllocator)
        return _host_oom(exc)
    if "out of memory" in text.lower():
        return OutOfMemoryError(
            "The device ran out of memory.",
            hint="add --activation-checkpointing, lower --micro-batch, or run 'copt advise --symptom oom'",
        )
    return _model_files_mismatch(exc)


def _host_oom(exc: BaseException) -> CoptError:
    """Python's MemoryError or torch's CPU allocator failing: the host's RAM, not a GPU's."""
    detail = str(exc).splitlines()[0].split("DefaultCPUAllocator: ")[-1] if str(exc) else ""
    return OutOfMemoryError("The host ran out of memory" + (f": {detail}" if detail else "."),
                            hint="Use a smaller dtype (bf16), a GPU, or a smaller model; lower the batch size.")


# what transformers and tokenizers raise when a model directory's files do not fit together or cannot be parsed
_MODEL_FILE_ERRORS = ("ignore_mismatched_sizes", "size mismatch for", "Couldn't instantiate the backend tokenizer",
                      "is not a valid JSON file", "Error no file named")


def _model_files_mismatch(exc: BaseException) -> CoptError | None:
    text = str(exc)
    if any(marker in text for marker in _MODEL_FILE_ERRORS):
        return BadInputError(f"The model directory's files cannot be loaded: {text.splitlines()[0][:300]}",
                             hint="config.json, the weights and the tokenizer files must come from the same "
                                  "save_pretrained; restore the directory from the model's source.")
    return None


def _torch_oom(exc: BaseException) -> CoptError | None:
    return OutOfMemoryError(
        f"The device ran out of memory: {str(exc).splitlines()[0] if str(exc) else 'CUDA OOM'}",
        hint="add --activation-checkpointing, lower --micro-batch, or run 'copt advise --symptom oom'",
    )


# Library exceptions → a CoptError with a next step. Matched by class name first (so torch need not be
# imported to build the table), then by isinstance for the builtin families.
_BY_CLASS_NAME: dict[str, Callable[[BaseException], CoptError | None]] = {
    "OutOfMemoryError": _torch_oom,  # torch.cuda.OutOfMemoryError / torch.OutOfMemoryError
}
_BY_TYPE: list[tuple[type[BaseException], Callable]] = [
    (MemoryError, _host_oom),
    (ImportError, _from_import_error),
    (OSError, _from_os_error),
    (RuntimeError, _from_runtime_error),
    (ValueError, _model_files_mismatch),
]


def map_exception(exc: BaseException) -> CoptError | None:
    """Translate a library exception into a CoptError with a hint, or None when it is unknown (a bug)."""
    if isinstance(exc, CoptError):
        return exc
    for cls in type(exc).__mro__:
        handler = _BY_CLASS_NAME.get(cls.__name__)
        if handler is not None and cls.__module__.startswith("torch"):
            mapped = handler(exc)
            if mapped is not None:
                return mapped
    for base, handler in _BY_TYPE:
        if isinstance(exc, base):
            mapped = handler(exc)
            if mapped is not None:
                return mapped
    return _disk_full(exc)  # a full disk behind any library's own error type (safetensors' SafetensorError)
