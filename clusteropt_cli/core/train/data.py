"""Training data: read .txt/.jsonl locally, tokenize, pack into fixed-length blocks, and walk them in a
deterministic, resumable order (shared by `copt train` and `copt distill`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clusteropt_cli.core.textfiles import check_regular_file, jsonl_rows, read_text_file, string_field
from clusteropt_cli.errors import BadInputError

IGNORE_INDEX = -100


def read_texts(path: str | Path, text_field: str = "text", flag: str = "--data") -> list[str]:
    """Documents of a .txt file (the whole file is one document) or a .jsonl file (one `text_field` per line);
    errors name `flag`."""
    path = Path(path)
    hint = f"Pass an existing .txt file or a .jsonl file with a '{text_field}' field to {flag}."
    if path.suffix == ".jsonl":
        texts = []
        for number, row in jsonl_rows(path, flag, hint):
            text = string_field(row, text_field)
            if text is None:
                raise BadInputError(f"{flag} {path}:{number} has no string '{text_field}' field.", hint=hint)
            texts.append(text)
        if not any(t.strip() for t in texts):
            raise BadInputError(f"{flag} {path} holds no text (no non-empty '{text_field}' records).", hint=hint)
        return texts
    _check_text_suffix(path, flag)
    text = read_text_file(path, flag, hint)
    if not text.strip():
        raise BadInputError(f"{flag} {path} is empty.", hint=hint)
    return [text]


# what read_texts reads: .jsonl a record a line, the others whole, as one document
TEXT_SUFFIXES = (".jsonl", ".txt", ".md", ".text", "")


def _check_text_suffix(path: Path, flag: str) -> None:
    """Refuse a file whose suffix is not one of TEXT_SUFFIXES."""
    if path.suffix not in TEXT_SUFFIXES:
        raise BadInputError(f"{flag} {path} is neither .txt nor .jsonl.",
                            hint="Convert it to .txt or .jsonl (text field).")


def check_text_input(path: str | Path, flag: str, text_field: str = "text", *, read: bool = False) -> None:
    """Before any model loads: `path` is a regular .txt or .jsonl file (a missing path, a directory, a pipe or a
    device named as such); with `read`, it holds text as read_texts reads it (empty, not UTF-8: the same messages
    a --data file gets when it is read). For held-out files, small enough to read twice."""
    path = Path(path)
    check_regular_file(path, flag, hint=f"Pass a .txt or .jsonl file (with a '{text_field}' field) to {flag}.")
    _check_text_suffix(path, flag)
    if read:
        read_texts(path, text_field, flag)


def pack_token_ids(documents: list[list[int]], seq_len: int, eos_id: int | None) -> Any:
    """Concatenate documents (eos between them) and cut into [n_blocks, seq_len] int64 blocks; the tail is dropped."""
    import torch

    stream: list[int] = []
    for ids in documents:
        stream.extend(ids)
        if eos_id is not None:
            stream.append(eos_id)
    n_blocks = len(stream) // seq_len
    if n_blocks == 0:
        raise BadInputError(f"The data has {len(stream)} tokens, fewer than one block of --seq-len {seq_len}.",
                            hint="Lower --seq-len or give more data.")
    return torch.tensor(stream[: n_blocks * seq_len], dtype=torch.long).view(n_blocks, seq_len)


class PackedDataset:
    """Fixed-length token blocks; item i is {"input_ids": LongTensor[seq_len], "labels": same} (causal LM:
    the model shifts labels itself)."""

    def __init__(self, blocks: Any):
        self.blocks = blocks

    def __len__(self) -> int:
        return int(self.blocks.shape[0])

    def __getitem__(self, index: int) -> dict[str, Any]:
        block = self.blocks[index]
        return {"input_ids": block, "labels": block}

    @property
    def num_tokens(self) -> int:
        return int(self.blocks.numel())


def build_text_dataset(path: str | Path, tokenizer: Any, seq_len: int, text_field: str = "text",
                       flag: str = "--data") -> PackedDataset:
    """Read, tokenize (no special tokens, eos between documents) and pack a text file into seq_len blocks."""
    texts = read_texts(path, text_field, flag)
    encoded = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    return PackedDataset(pack_token_ids(encoded, seq_len, tokenizer.eos_token_id))


def collate(examples: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack equally shaped examples into a batch."""
    import torch

    return {key: torch.stack([ex[key] for ex in examples]) for key in examples[0]}


@dataclass
class DataCursor:
    """Deterministic order over a dataset with a resumable position.

    Each epoch uses a permutation seeded by (seed, epoch); `position` counts examples consumed in the epoch.
    With `world_size` > 1, every rank takes its own slice of each global batch (data parallelism) — the global
    order does not depend on the number of ranks, so a run resumed on another world size sees the same data.
    """

    num_examples: int
    seed: int = 0
    epoch: int = 0
    position: int = 0
    shuffle: bool = True
    _order: list[int] = field(default_factory=list, repr=False)

    def _permutation(self) -> list[int]:
        import torch

        if not self.shuffle:
            return list(range(self.num_examples))
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return torch.randperm(self.num_examples, generator=generator).tolist()

    def next_indices(self, global_batch: int) -> list[int]:
        """The next `global_batch` example indices (wrapping into the next epoch when needed)."""
        out: list[int] = []
        while len(out) < global_batch:
            if not self._order:
                self._order = self._permutation()
            if self.position >= self.num_examples:
                self.epoch += 1
                self.position = 0
                self._order = self._permutation()
            take = min(global_batch - len(out), self.num_examples - self.position)
            out.extend(self._order[self.position : self.position + take])
            self.position += take
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_examples": self.num_examples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if int(state["num_examples"]) != self.num_examples:
            raise BadInputError(
                f"The checkpoint was taken on data with {state['num_examples']} blocks; this data has "
                f"{self.num_examples}.", hint="Resume with the same --data and --seq-len, or start a new --output.")
        self.epoch, self.position, self.seed = int(state["epoch"]), int(state["position"]), int(state["seed"])
        self._order = []
