"""The paged KV cache's block pool: reference counts, the prefix-cache map, LRU reuse and the hash chain."""

from __future__ import annotations

import pytest

from clusteropt_cli.core.serve.kv_blocks import ROOT_HASH, BlockPool, block_hash, hash_chain


def test_hash_chain_depends_on_every_earlier_token():
    a = hash_chain(list(range(12)), 4)
    b = hash_chain([99] + list(range(1, 12)), 4)
    assert len(a) == 3 and all(x != y for x, y in zip(a, b, strict=True))  # a change in block 0 changes all
    assert hash_chain(list(range(12)) + [5, 6], 4) == a  # a partial block has no hash
    assert hash_chain(list(range(16)), 4, start=a) == hash_chain(list(range(16)), 4)  # extends what is known
    assert block_hash(ROOT_HASH, [1, 2]) != block_hash(ROOT_HASH, [2, 1])
    # token ids are 64-bit in the digest: ids that agree in their low 32 bits still differ
    assert block_hash(ROOT_HASH, [1]) != block_hash(ROOT_HASH, [1 + 2**32])


def test_allocate_release_and_reference_counts():
    pool = BlockPool(4, 2)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free == 1
    assert pool.allocate(2) is None and pool.num_free == 1  # nothing taken when it cannot be satisfied
    pool.take(a[:1])
    pool.release(a)
    assert pool.ref[a[0]] == 1 and pool.num_free == 3
    pool.release(a[:1])
    pool.check()
    assert pool.num_free == 4
    with pytest.raises(RuntimeError):
        pool.release(a[:1])


def test_prefix_match_reuses_cached_blocks_and_leaves_the_last_token():
    pool = BlockPool(8, 4)
    tokens = list(range(12))
    hashes = hash_chain(tokens, 4)
    blocks = pool.allocate(3)
    for b, h in zip(blocks, hashes, strict=True):
        pool.register(b, h)
    assert pool.match(hashes, 12) == blocks[:2]  # 12 tokens: the block holding the last token is recomputed
    assert pool.match(hashes, 13) == blocks
    pool.release(blocks)
    assert pool.match(hashes, 13) == blocks  # freed blocks keep their contents until reused
    pool.take(blocks[:2])
    assert pool.num_free == 6
    other = hash_chain([7] + tokens[1:], 4)
    assert pool.match(other, 13) == []


def test_duplicate_contents_stay_private():
    pool = BlockPool(4, 2)
    h = hash_chain([1, 2], 2)[0]
    first, second = pool.allocate(2)
    pool.register(first, h)
    pool.register(second, h)
    assert pool.cached == {h: first} and pool.hash_of[second] is None


def test_lru_reuse_evicts_tails_first_and_forgets_their_hash():
    pool = BlockPool(4, 2)
    hashes = hash_chain([1, 2, 3, 4, 5, 6], 2)
    seq = pool.allocate(3)
    for b, h in zip(seq, hashes, strict=True):
        pool.register(b, h)
    pool.release(seq)  # the tail enters the free queue first
    fresh = pool.allocate(2)  # the never-used block, then the sequence's tail
    assert fresh[0] not in seq and fresh[1] == seq[2]
    assert pool.match(hashes, 7) == seq[:2] and pool.stats.evictions == 1
    pool.check()


def test_caching_off_finds_nothing():
    pool = BlockPool(4, 2, enable_caching=False)
    h = hash_chain([1, 2], 2)
    b = pool.allocate(1)
    pool.register(b[0], h[0])
    assert pool.match(h, 3) == [] and not pool.cached


def test_reset_cache_keeps_held_blocks():
    pool = BlockPool(4, 2)
    hashes = hash_chain([1, 2, 3, 4], 2)
    held = pool.allocate(2)
    for b, h in zip(held, hashes, strict=True):
        pool.register(b, h)
    pool.release(held[1:])
    assert pool.reset_cache() == 1
    assert pool.match(hashes, 5) == held[:1]
