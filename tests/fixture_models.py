"""Tiny trained models for the tests: a Llama-family teacher, a smaller student and a draft model.

All three share one byte-level BPE tokenizer trained locally on Python standard-library sources, and all
three are *trained* on that text (so quantization and distillation tests measure something real). Nothing
is downloaded. Built once per machine and cached (keyed by this file's hash and the library versions);
`python -m tests.fixture_models` builds them and prints the paths.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

TRAIN_FILES = [
    "textwrap.py", "argparse.py", "json/decoder.py", "json/encoder.py", "collections/__init__.py",
    "functools.py", "string.py", "csv.py", "difflib.py", "heapq.py", "bisect.py", "fractions.py",
    "calendar.py", "pprint.py", "queue.py", "sched.py", "graphlib.py", "colorsys.py", "dataclasses.py",
    "enum.py", "random.py", "tokenize.py", "fnmatch.py", "glob.py", "gettext.py", "base64.py", "contextlib.py",
]
EVAL_FILES = ["statistics.py", "shlex.py"]  # held out: never seen in training

SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
                  "<think>", "</think>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
VOCAB_SIZE = 1024
SEQ_LEN = 128

# name → (LlamaConfig overrides, training steps, learning rate)
MODELS = {
    "teacher": (dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=384), 500, 3e-3),
    "student": (dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                     intermediate_size=192), 60, 3e-3),
    "draft": (dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                   intermediate_size=192), 200, 3e-3),
}


@dataclass(frozen=True)
class Fixtures:
    root: Path
    teacher: Path
    student: Path
    draft: Path
    tokenizer: Path
    train_text: Path
    eval_text: Path
    info: dict


def _stdlib_text(files: list[str]) -> str:
    lib = Path(sysconfig.get_paths()["stdlib"])
    return "\n\n".join((lib / f).read_text(encoding="utf-8") for f in files)


def _cache_root() -> Path:
    import tokenizers
    import torch
    import transformers

    key = hashlib.sha256(Path(__file__).read_bytes())
    key.update(f"{sys.version_info[:2]}{torch.__version__}{transformers.__version__}{tokenizers.__version__}".encode())
    base = Path(os.environ.get("COPT_FIXTURE_CACHE", Path.home() / ".cache" / "copt-test-fixtures"))
    return base / key.hexdigest()[:16]


def _train_tokenizer(text: str, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text.split("\n\n"), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   pad_token="<|pad|>", unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 1024
    fast.save_pretrained(out)
    return fast


def _blocks(ids: list[int], seq_len: int):
    import torch

    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def eval_loss(model, blocks, batch: int = 16) -> float:
    """Mean next-token cross-entropy over the blocks."""
    import torch

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(blocks), batch):
            x = blocks[i : i + batch]
            out = model(input_ids=x, labels=x)
            total += out.loss.item() * len(x)
            count += len(x)
    return total / max(count, 1)


def _train_model(name: str, tokenizer, train_blocks, eval_blocks, out: Path) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    overrides, steps, lr = MODELS[name]
    torch.manual_seed(1234)
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=1024, rms_norm_eps=1e-5,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, **overrides)
    model = LlamaForCausalLM(config)
    random_loss = eval_loss(model, eval_blocks)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / steps))))
    gen = torch.Generator().manual_seed(99)
    batch = 16
    for _ in range(steps):
        idx = torch.randint(0, len(train_blocks), (batch,), generator=gen)
        x = train_blocks[idx]
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    trained_loss = eval_loss(model, eval_blocks)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    info = {"params": sum(p.numel() for p in model.parameters()), "steps": steps,
            "eval_loss_random_init": random_loss, "eval_loss": trained_loss}
    (out / "fixture.json").write_text(json.dumps(info, indent=2))
    return info


def build_fixtures(root: Path | None = None) -> Fixtures:
    """Build (or reuse) the fixture models; safe to call from several processes at once."""
    import torch

    root = Path(root) if root else _cache_root()
    root.mkdir(parents=True, exist_ok=True)
    done = root / "DONE.json"
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            threads = torch.get_num_threads()
            # one thread: the models are tiny, and on a busy 2-core host a second spinning OpenMP thread made a
            # teacher step 17x slower (5.1 s vs 0.31 s measured), without helping on an idle one
            torch.set_num_threads(1)
            try:
                train_text, eval_text = _stdlib_text(TRAIN_FILES), _stdlib_text(EVAL_FILES)
                (root / "train.txt").write_text(train_text)
                (root / "eval.txt").write_text(eval_text)
                tokenizer = _train_tokenizer(train_text, root / "tokenizer")
                train_blocks = _blocks(tokenizer(train_text)["input_ids"], SEQ_LEN)
                eval_blocks = _blocks(tokenizer(eval_text)["input_ids"], SEQ_LEN)[:64]
                info = {"vocab_size": len(tokenizer), "seq_len": SEQ_LEN, "train_tokens": train_blocks.numel(),
                        "eval_tokens": eval_blocks.numel()}
                for name in MODELS:
                    info[name] = _train_model(name, tokenizer, train_blocks, eval_blocks, root / name)
                done.write_text(json.dumps(info, indent=2))
            finally:
                torch.set_num_threads(threads)
    info = json.loads(done.read_text())
    return Fixtures(root, root / "teacher", root / "student", root / "draft", root / "tokenizer",
                    root / "train.txt", root / "eval.txt", info)


if __name__ == "__main__":
    import time

    start = time.time()
    fx = build_fixtures(Path(sys.argv[1]) if len(sys.argv) > 1 else None)
    print(json.dumps({"root": str(fx.root), "seconds": round(time.time() - start, 1), **fx.info}, indent=2))
