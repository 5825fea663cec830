"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, block tables, automatic prefix caching.

Pure Python (no torch): the engine asks it which physical blocks a sequence owns; the runner keeps the tensors.

* A block holds `block_size` consecutive tokens of one sequence, in every layer. A sequence owns a list of blocks
  (its block table): token at position p lives in block `table[p // block_size]`, offset `p % block_size`.
* Automatic prefix caching, vLLM's scheme: a block that is full and computed is registered under the hash of its
  tokens and of every token before it (a hash chain: hash(parent hash, block tokens)). A new sequence whose first
  full blocks hash the same reuses those blocks copy-free (reference-counted) and skips computing them. Hashes are
  BLAKE2b digests, not Python's `hash`: a client that could craft a colliding prompt would read another client's
  cache.
* Freed blocks keep their contents and hash until they are reused: the free queue is LRU (a freed sequence's tail
  blocks go first, as in vLLM, so a shared prefix outlives the suffixes hanging off it). Allocation pops the least
  recently used free block and drops its hash.
* At most (len(tokens) - 1) // block_size blocks of a prompt are ever taken from the cache: the last prompt token
  is always computed (its logits choose the first output token) and no sequence writes into a shared block.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

ROOT_HASH = b"copt-kv-v1"


def block_hash(parent: bytes, tokens: list[int] | tuple[int, ...]) -> bytes:
    """The hash of a full block: its parent's hash (ROOT_HASH for the first block) and its token ids."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


def hash_chain(tokens: list[int], block_size: int, start: list[bytes] | None = None) -> list[bytes]:
    """Hashes of every full block of `tokens`, extending `start` (the hashes already known, in order)."""
    hashes = list(start or [])
    parent = hashes[-1] if hashes else ROOT_HASH
    for i in range(len(hashes), len(tokens) // block_size):
        parent = block_hash(parent, tokens[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens."""
    return -(-int(num_tokens) // int(block_size))


def cacheable_blocks(prompt_tokens: int, shared_tokens: int, block_size: int) -> int:
    """Blocks of a prompt that a prefix of `shared_tokens` tokens, already cached, supplies: its full blocks, at most
    (prompt_tokens - 1) // block_size (BlockPool.match: the last prompt token is always computed)."""
    return max(0, min(int(shared_tokens), int(prompt_tokens) - 1)) // int(block_size)


def max_concurrent_sequences(num_blocks: int, block_size: int, seq_tokens: int, max_seqs: int,
                             prompt_tokens: int | None = None, shared_tokens: int = 0) -> int:
    """Sequences of `seq_tokens` KV positions a pool of `num_blocks` holds at once, at most `max_seqs` (the batch
    cap): each owns blocks_for(seq_tokens) blocks, less the cacheable blocks of a prefix of `shared_tokens` tokens
    that every one shares (stored once) — (num_blocks - S) // (blocks - S). What admission by free blocks
    (Engine._admit_blocks) reaches once the shared prefix is cached; vLLM V1's block manager follows the same rules."""
    need = blocks_for(seq_tokens, block_size)
    shared = cacheable_blocks(seq_tokens if prompt_tokens is None else prompt_tokens, shared_tokens, block_size)
    shared = min(shared, need)
    if num_blocks < need:
        return 0
    if need == shared:  # nothing private (cannot happen: the last prompt token always gets a block of its own)
        return int(max_seqs)
    return int(min(max_seqs, (num_blocks - shared) // (need - shared)))


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found in the cache
    evictions: int = 0  # cached blocks reused for other contents

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockPool:
    """`num_blocks` blocks of `block_size` tokens; reference counts, the prefix-cache map and the LRU free queue."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a block pool needs at least one block of at least one token")
        self.num_blocks, self.block_size, self.enable_caching = int(num_blocks), int(block_size), enable_caching
        self.ref = [0] * self.num_blocks
        self.hash_of: list[bytes | None] = [None] * self.num_blocks
        self.cached: dict[bytes, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(self.num_blocks))
        self.stats = PrefixCacheStats()

    # ---- capacity ------------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free ones, cached contents included)."""
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    # ---- prefix cache -----------------------------------------------------------------------------------------
    def match(self, hashes: list[bytes], num_tokens: int) -> list[int]:
        """The cached blocks a sequence of `num_tokens` tokens whose full blocks hash to `hashes` may reuse (the
        longest run from its start, at most (num_tokens - 1) // block_size blocks). Does not take them."""
        if not self.enable_caching:
            return []
        found = []
        for h in hashes[: max(0, (num_tokens - 1) // self.block_size)]:
            block = self.cached.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def record_lookup(self, num_tokens: int, hit_blocks: int) -> None:
        self.stats.queries += num_tokens
        self.stats.hits += hit_blocks * self.block_size

    def register(self, block: int, h: bytes) -> None:
        """Make a full, computed block findable under its hash (a block with the same contents already cached
        keeps the entry: this one stays private and is reused like any other when freed)."""
        if not self.enable_caching or self.hash_of[block] is not None:
            return
        if h not in self.cached:
            self.cached[h] = block
            self.hash_of[block] = h

    # ---- ownership ---------------------------------------------------------------------------------------------
    def take(self, blocks: list[int]) -> None:
        """Add a reference to each of `blocks` (cache hits: they leave the free queue while referenced)."""
        for b in blocks:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        """`n` fresh blocks (least recently freed first, their cached contents forgotten), or None when fewer than
        `n` are free (nothing taken)."""
        if n > len(self.free):
            return None
        out = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            h = self.hash_of[block]
            if h is not None:
                self.hash_of[block] = None
                if self.cached.get(h) == block:
                    del self.cached[h]
                self.stats.evictions += 1
            self.ref[block] = 1
            out.append(block)
        return out

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block nobody holds joins the free queue. The tail goes in first,
        so it is reused before the prefix it extends."""
        for b in reversed(blocks):
            if self.ref[b] <= 0:
                raise RuntimeError(f"KV block {b} released more often than taken")
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None

    def reset_cache(self) -> int:
        """Forget every cached block that nobody holds (vLLM's reset_prefix_cache); returns how many."""
        dropped = 0
        for b in list(self.free):
            h = self.hash_of[b]
            if h is not None:
                self.hash_of[b] = None
                if self.cached.get(h) == b:
                    del self.cached[h]
                dropped += 1
        return dropped

    def check(self) -> None:
        """Raise when the accounting is inconsistent (tests, soak runs)."""
        free = set(self.free)
        for b in range(self.num_blocks):
            if (self.ref[b] == 0) != (b in free):
                raise AssertionError(f"block {b}: ref {self.ref[b]} but {'in' if b in free else 'not in'} the free "
                                     "queue")
        for h, b in self.cached.items():
            if self.hash_of[b] != h:
                raise AssertionError(f"cached block {b} does not carry its hash")
