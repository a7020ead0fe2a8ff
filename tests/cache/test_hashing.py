"""Chained block hashes: granularity, chaining, extra keys, coarse views."""

from __future__ import annotations

import hashlib
import pickle

import pytest

from cache import BlockPool, Request
from cache.hashing import (
    BlockHashListWithBlockSize,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
    none_hash,
    sha256,
)
from cache.single_type_kv_cache_manager import FullAttentionManager
from cache.spec import FullAttentionSpec


def reference_hashes(tokens, block_size, extra=lambda start: None):
    """SHA-256 of the pickled (parent, tokens, extra keys) chain, as vLLM defines it."""
    parent = none_hash(sha256, 0)
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        payload = (parent, tuple(tokens[start : start + block_size]), extra(start))
        parent = hashlib.sha256(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)).digest()
        out.append(parent)
    return out


def test_prompt_and_appended_blocks_match_the_reference_chain():
    tokens = list(range(1000, 1075))
    req = Request("r", tokens[:37], hash_block_size=8)
    assert req.block_hashes == reference_hashes(tokens[:37], 8)
    for t in tokens[37:]:
        req.append_output_token_ids(t)
    assert req.block_hashes == reference_hashes(tokens, 8)
    req.append_output_token_ids([1, 2, 3, 4, 5])
    assert len(req.block_hashes) == len(tokens + [1, 2, 3, 4, 5]) // 8


def test_custom_hash_function_and_extra_keys_take_the_general_path():
    tokens = list(range(40))
    salted = Request("r", tokens, hash_block_size=8, cache_salt="s")
    assert salted.block_hashes == reference_hashes(tokens, 8, lambda s: ("s",) if s == 0 else None)
    # A wrapper is not `sha256` itself, so it takes the general path: same bytes.
    generic = Request("r", tokens, hash_block_size=8, hash_fn=lambda obj: sha256(obj))
    assert generic.block_hashes == reference_hashes(tokens, 8)
    other_seed = Request("r", tokens, hash_block_size=8, hash_seed=1)
    assert other_seed.block_hashes[0] != generic.block_hashes[0]


def test_keys_and_coarse_views():
    key = make_block_hash_with_group_id(b"abc", 258)
    assert get_block_hash(key) == b"abc" and get_group_id(key) == 258
    fine = [bytes([i]) * 4 for i in range(7)]
    view = BlockHashListWithBlockSize(fine, 4, 8)
    assert len(view) == 3
    assert view[1] == fine[2] + fine[3]
    assert list(view) == [view[0], view[1], view[2]]
    with pytest.raises(IndexError):
        view[3]
    with pytest.raises(ValueError, match="not a multiple"):
        BlockHashListWithBlockSize(fine, 4, 6)


def test_memoised_coarse_hashes_equal_the_lazy_view():
    req = Request("r", list(range(50)), hash_block_size=4)
    for factor in (1, 2, 4):
        view = BlockHashListWithBlockSize(list(req.block_hashes), 4, 4 * factor)
        assert req.block_hashes.coarse(factor) == list(view)
    req.append_output_token_ids(list(range(50, 90)))
    for factor in (2, 4):
        view = BlockHashListWithBlockSize(list(req.block_hashes), 4, 4 * factor)
        assert req.block_hashes.coarse(factor) == list(view)


def test_lazily_memoised_keys_equal_the_index_keys():
    mgr_tokens = list(range(40))
    req = Request("r", mgr_tokens, hash_block_size=4)
    pool = BlockPool(20, enable_caching=True, hash_block_size=4)
    blocks = pool.get_new_blocks(5)
    pool.cache_full_blocks(req, blocks, 0, 5, 8, 3)
    memo = req.block_hashes.key_memo(2, 3)
    assert memo == []
    (hit,), length = FullAttentionManager.find_longest_cache_hit(
        req.block_hashes, 39, [3], pool, _full(8), False, 8
    )
    assert [b.block_id for b in hit] == [b.block_id for b in blocks[:4]] and length == 32
    assert memo == [make_block_hash_with_group_id(h, 3) for h in req.block_hashes.coarse(2)[:4]]
    assert all(pool.cached_block_hash_to_block.get_one_block(k) is not None for k in memo)


def _full(block_size):
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype="bfloat16")
