"""The quality model of the quantization benchmarks: a small Llama trained on Python sources (the standard library,
optionally the installed packages), with its own BPE tokenizer and held-out files, so that quantization methods are
compared on real weights. Used by gpu_quantize.py's quality part."""

from __future__ import annotations

import json
import math
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import free_gpu as free

SMALL = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=1536, tie_word_embeddings=False, max_position_embeddings=2048, rms_norm_eps=1e-5)
# --quality-model medium: ~150 M parameters (with the 8,192 BPE), for the question whether AWQ's W4 advantage shows on
# a larger model; train it on --corpus python (stdlib + installed packages), not the stdlib alone (it would memorize)
MEDIUM = dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=8,
              intermediate_size=2816, tie_word_embeddings=False, max_position_embeddings=2048, rms_norm_eps=1e-5)
TINY = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=256, tie_word_embeddings=False, max_position_embeddings=512, rms_norm_eps=1e-5)
# held out of the quality part's training corpus (and of its tokenizer); ~225k characters, ~65k tokens
EVAL_FILES = ["statistics.py", "shlex.py", "textwrap.py", "string.py", "fractions.py", "calendar.py", "heapq.py",
              "configparser.py"]
# test directories of the stdlib (Lib/test, idlelib/idle_test, lib2to3/tests, tkinter/test, ...) and installed
# packages stay out of the quality part's training corpus
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
def stdlib_text(files: list[str]) -> str:
    lib = Path(sysconfig.get_paths()["stdlib"])
    return "\n\n".join((lib / f).read_text(encoding="utf-8") for f in files if (lib / f).is_file())


def train_tokenizer(texts: list[str], out: Path, vocab: int = 8192):
    """Byte-level BPE of `vocab` tokens trained on texts (eos <|endoftext|> = 0, pad <|pad|> = 1)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   pad_token="<|pad|>")
    fast.model_max_length = 8192
    fast.save_pretrained(out)
    return fast


@dataclass
class QualitySetup:
    """Sizes of the quality part: the H200 run (gpu_setup) or the CPU check of the script (smoke_setup)."""

    device: str
    model: dict
    vocab: int
    corpus_chars: int  # training text cap
    tokenizer_chars: int  # the BPE is trained on an evenly spread subset of the files of about this size
    train_s: float
    max_epochs: float  # training also stops after this many passes over the corpus (no memorization)
    batch: int
    seq: int  # training block, calibration sample and evaluation block length
    peak_lr: float
    warmup_steps: int
    eval_tokens: int  # held-out tokens scored by copt quantize (ppl_before/after) and at the end of training
    curve_tokens: int  # held-out tokens scored at each point of the training curve
    curve_points: int
    calib_samples: int
    cases: list[tuple[str, int]] = field(default_factory=list)  # (method, weight bits)
    symmetric: bool = True  # integer weight quantization without (True) or with zero points
    awq_duo_scaling: bool | str = True  # the recipe's awq_duo_scaling (llm-compressor's default: True)
    awq_also: tuple = ()  # extra AWQ cases on the same model: (name suffix, recipe overrides), e.g. duo=true
    corpus: str = "stdlib"  # "python": the stdlib and the installed packages' sources


def stdlib_corpus(max_chars: int, with_packages: bool = False) -> tuple[list[str], list[str]]:
    """The stdlib's .py sources (sorted; no test directories, no EVAL_FILES) up to max_chars: (names, texts).
    with_packages: then the .py sources of the installed packages (site-packages), with exact duplicates and any
    file named like a held-out file left out (vendored copies must not leak the evaluation text)."""
    import hashlib
    import site

    held_out = set(EVAL_FILES)
    held_out_names = {Path(f).name for f in EVAL_FILES}
    roots = [(Path(sysconfig.get_paths()["stdlib"]), "", SKIP_DIRS)]
    if with_packages:
        package_dirs = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()}
        # and any other install target on sys.path (e.g. the --target dir of the carried wheels)
        package_dirs |= {p for p in sys.path if p and Path(p).is_dir() and any(Path(p).glob("*.dist-info"))}
        roots += [(Path(d), f"packages/{i}/", SKIP_DIRS - {"site-packages", "dist-packages"})
                  for i, d in enumerate(sorted(package_dirs)) if Path(d).is_dir()]
    names, texts, seen, total = [], [], set(), 0
    for root, prefix, skip in roots:
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root)
            if not prefix and rel.as_posix() in held_out:
                continue
            if prefix and path.name in held_out_names:
                continue
            if skip & set(rel.parts[:-1]):
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            digest = hashlib.sha1(text.encode()).digest()
            if digest in seen:
                continue
            if total + len(text) > max_chars:
                return names, texts
            seen.add(digest)
            names.append(prefix + rel.as_posix())
            texts.append(text)
            total += len(text)
    return names, texts


def tokenize_docs(tokenizer, docs: list[str], batch: int = 64):
    """All documents as one token stream (eos after each), batched through the fast tokenizer."""
    import torch

    ids: list[int] = []
    for i in range(0, len(docs), batch):
        for doc_ids in tokenizer(docs[i : i + batch], add_special_tokens=False)["input_ids"]:
            ids.extend(doc_ids)
            ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def write_calib_ids(tokenizer, ids, path: Path, n: int, seq_len: int) -> Path:
    """n calibration samples of the training stream at seeded random offsets (decoded to text for copt)."""
    import torch

    gen = torch.Generator().manual_seed(1)
    starts = torch.randint(0, len(ids) - seq_len - 16, (n,), generator=gen).tolist()
    path.write_text("".join(json.dumps({"text": tokenizer.decode(ids[s : s + seq_len + 16].tolist())}) + "\n"
                            for s in starts))
    return path


def lr_at(step: int, progress: float, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warmup over `warmup` steps, then cosine from peak to floor×peak over training progress (0..1)."""
    warm = min(1.0, (step + 1) / warmup)
    return peak * warm * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def autocast(device: str):
    """bf16 autocast on the GPU; plain fp32 on the CPU."""
    import torch

    return torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda")


def training_ppl(model, blocks, device: str) -> float:
    """Perplexity of the model under training (fp32 weights, autocast) over equal-length blocks."""
    import torch

    model.eval()
    total = torch.zeros((), device=device)
    with torch.no_grad(), autocast(device):
        for i in range(0, len(blocks), 16):
            x = blocks[i : i + 16]
            total += model(input_ids=x, labels=x).loss.float() * len(x)
    model.train()
    return math.exp(total.item() / len(blocks))


def train_small(work: Path, tokenizer, ids, eval_text: str, setup: QualitySetup) -> tuple[Path, dict]:
    """Train the small Llama until train_s seconds or max_epochs passes (whichever first); each pass visits the
    corpus's blocks once in a seeded random order (shifted by a random offset after the first pass). Records the
    held-out perplexity along the way and, on the saved bf16 weights, exactly as copt quantize scores it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from clusteropt_cli.core.quantize.evaluate import eval_blocks, perplexity

    device, seq, bs = setup.device, setup.seq, setup.batch
    tokens = ids.to(device)
    corpus_tokens = len(tokens)
    heldout = eval_blocks(tokenizer, eval_text, seq, setup.curve_tokens).to(device)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=0, eos_token_id=0, pad_token_id=1, **setup.model)
    model = LlamaForCausalLM(config).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=setup.peak_lr, betas=(0.9, 0.95), fused=device == "cuda")

    token_budget = setup.max_epochs * corpus_tokens
    curve: list[dict] = []
    step = seen = epoch = pos = 0
    blocks = perm = None
    progress = eval_s = lr = 0.0
    interval_loss, interval_steps, next_point = torch.zeros((), device=device), 0, 1
    model.train()
    start = time.perf_counter()
    while progress < 1.0:
        if perm is None or pos + bs > len(perm):
            epoch += perm is not None
            offset = 0 if epoch == 0 else int(torch.randint(0, seq, (1,), generator=gen))
            n_blocks = (corpus_tokens - offset) // seq
            blocks = tokens[offset : offset + n_blocks * seq].view(n_blocks, seq)
            perm, pos = torch.randperm(n_blocks, generator=gen).to(device), 0
        batch = blocks[perm[pos : pos + bs]]
        pos += bs
        lr = lr_at(step, progress, setup.peak_lr, setup.warmup_steps)
        for group in opt.param_groups:
            group["lr"] = lr
        with autocast(device):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        seen += batch.numel()
        interval_loss += loss.detach().float()
        interval_steps += 1
        train_time = time.perf_counter() - start - eval_s
        progress = max(train_time / setup.train_s, seen / token_budget)
        if progress >= next_point / setup.curve_points or progress >= 1.0:
            t = time.perf_counter()
            point = {"step": step, "tokens_seen": seen, "epochs": round(seen / corpus_tokens, 3),
                     "train_s": round(train_time, 2), "lr": lr, "train_loss": (interval_loss / interval_steps).item(),
                     "heldout_ppl": training_ppl(model, heldout, device)}
            curve.append(point)
            print(f"  train step {step:>5}  epochs {point['epochs']:5.2f}  train loss {point['train_loss']:.3f}  "
                  f"held-out ppl {point['heldout_ppl']:.2f}", flush=True)
            interval_loss, interval_steps = torch.zeros((), device=device), 0
            next_point = int(progress * setup.curve_points) + 1
            eval_s += time.perf_counter() - t
    train_s = time.perf_counter() - start - eval_s
    model.eval()
    model.to(torch.bfloat16)
    full = eval_blocks(tokenizer, eval_text, seq, setup.eval_tokens)
    heldout_bf16 = perplexity(model, full)
    n_train = max(1, min(len(full), corpus_tokens // seq))
    train_bf16 = perplexity(model, tokens[: n_train * seq].view(n_train, seq))
    out = work / "small-trained"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    info = {"params": sum(p.numel() for p in model.parameters()), "train_steps": step, "tokens_seen": seen,
            "epochs": seen / corpus_tokens, "train_seconds": train_s, "tokens_per_s": seen / max(train_s, 1e-9),
            "stopped_by": "max_epochs" if seen >= token_budget else "time", "batch": bs, "seq": seq,
            "peak_lr": setup.peak_lr, "warmup_steps": setup.warmup_steps, "lr_schedule": "warmup + cosine to 0.1x",
            "final_train_loss": curve[-1]["train_loss"], "heldout_ppl_fp32_autocast": curve[-1]["heldout_ppl"],
            "heldout_ppl": heldout_bf16.ppl, "heldout_tokens": heldout_bf16.tokens,
            "train_text_ppl": train_bf16.ppl, "curve": curve}
    del model, opt, tokens, blocks, perm, heldout
    free()
    return out, info
