"""The allocator scenarios of docs/allocator_internals.md section 9, one named test each.

Scenarios 30-33 (sizing) and 37/40 (V4 grouping, admission caps) are in test_layout.py and
test_spec.py; 34-36 (scheduler) in tests/serving. Unless a test says otherwise it runs with
vLLM's earlier ("baseline") free ordering and dense window indexing, as the scenarios assume;
where vLLM 0.32's defaults change the answer, the test checks both.
"""

from __future__ import annotations

import pytest
from cache_testing import admit, chunked, free_ids, full, ids, manager, request, swa

from cache import AllBlocksCleared, BlockPool, Request
from cache.block_pool import BlockHashToBlockMap, KVCacheBlock
from cache.hashing import generate_block_hash_extra_keys, make_block_hash_with_group_id
from cache.single_type_kv_cache_manager import ChunkedLocalAttentionManager, SlidingWindowManager

COMMON = list(range(48))


# -- block pool / free list --------------------------------------------------------------------


def test_scenario_01_null_block_and_first_allocation():
    pool = BlockPool(11, enable_caching=True, hash_block_size=16)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 10
    assert [b.block_id for b in pool.get_new_blocks(4)] == [1, 2, 3, 4]


def test_scenario_02_block_hash_to_block_map():
    index = BlockHashToBlockMap()
    blocks = [KVCacheBlock(i) for i in range(4)]
    index.insert(b"key0", blocks[0])
    index.insert(b"key0", blocks[3])
    index.insert(b"key1", blocks[1])
    index.insert(b"key2", blocks[2])
    assert index.pop(b"key1", 1) is blocks[1]
    assert index.get_one_block(b"key1") is None
    assert index.pop(b"key0", 0) is blocks[0]
    assert index.get_one_block(b"key0") is blocks[3]
    assert index.pop(b"key2", 2) is blocks[2]
    assert index.pop(b"key0", 3) is blocks[3]
    assert len(index) == 0
    index.insert(b"key0", blocks[0])
    assert index.pop(b"key0", 100) is None
    assert index.get_one_block(b"key0") is blocks[0]


def test_scenario_03_hash_cleared_on_reuse():
    mgr = manager([full()], num_blocks=2)
    a = request(mgr, "a", range(16))
    _, _, new = admit(mgr, a)
    block = new.blocks[0][0]
    assert block.block_hash is not None
    mgr.free(a)
    b = request(mgr, "b", range(100, 115))
    _, _, new = admit(mgr, b)
    assert new.blocks[0][0] is block and block.block_hash is None


# -- single-group prefix caching ---------------------------------------------------------------


def _scenario_4_5():
    mgr = manager([full()], num_blocks=11)
    a = request(mgr, "a", COMMON + list(range(100, 107)))
    hits, num_hits, new = admit(mgr, a)
    assert num_hits == 0 and ids(new) == [[1, 2, 3, 4]]
    b = request(mgr, "b", COMMON + list(range(200, 205)))
    hits, num_hits, new = admit(mgr, b)
    return mgr, a, b, hits, num_hits, new


def test_scenario_04_first_request_hashes_full_blocks():
    mgr = manager([full()], num_blocks=11)
    a = request(mgr, "a", COMMON + list(range(100, 107)))
    hits, num_hits, new = admit(mgr, a)
    assert num_hits == 0 and ids(new) == [[1, 2, 3, 4]]
    blocks = new.blocks[0]
    for i in range(3):
        assert blocks[i].block_hash == make_block_hash_with_group_id(a.block_hashes[i], 0)
        assert blocks[i].ref_cnt == 1
    assert blocks[3].block_hash is None
    # Chained: each hash differs from a hash of the block's tokens alone.
    assert len(set(a.block_hashes)) == 3


def test_scenario_05_second_request_hits_common_prefix():
    mgr, a, b, hits, num_hits, new = _scenario_4_5()
    assert ids(hits) == [[1, 2, 3]] and num_hits == 48
    assert ids(new) == [[5]]
    assert [blk.ref_cnt for blk in hits.blocks[0]] == [2, 2, 2]
    assert mgr.block_pool.get_num_free_blocks() == 5


def test_scenario_06_free_order():
    mgr, a, b, *_ = _scenario_4_5()
    mgr.free(a)
    mgr.free(b)
    assert free_ids(mgr) == [6, 7, 8, 9, 10, 4, 5, 3, 2, 1]


def test_scenario_06_free_order_unhashed_to_front():
    mgr = manager([full()], num_blocks=11, baseline=False)
    a = request(mgr, "a", COMMON + list(range(100, 107)))
    admit(mgr, a)
    b = request(mgr, "b", COMMON + list(range(200, 205)))
    admit(mgr, b)
    mgr.free(a)
    mgr.free(b)
    assert free_ids(mgr) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]


def test_scenario_07_hit_from_free_list_then_lru_eviction():
    mgr, a, b, *_ = _scenario_4_5()
    mgr.free(a)
    mgr.free(b)
    c = request(mgr, "c", COMMON + list(range(300, 306)))
    hits, num_hits, new = admit(mgr, c)
    assert ids(hits) == [[1, 2, 3]] and ids(new) == [[6]]
    assert mgr.block_pool.get_num_free_blocks() == 6
    assert all(b.ref_cnt == 0 for b in mgr.block_pool.free_block_queue.get_all_free_blocks())
    mgr.free(c)
    d = request(mgr, "d", [99] * 160)
    hits, num_hits, new = admit(mgr, d)
    assert num_hits == 0
    assert ids(new) == [[7, 8, 9, 10, 4, 5, 6, 3, 2, 1]]
    assert mgr.block_pool.get_num_free_blocks() == 0


def test_scenario_08_decode_allocates_and_hashes_incrementally():
    mgr = manager([full()], num_blocks=11)
    a = request(mgr, "a", COMMON + list(range(100, 107)))
    admit(mgr, a)
    a.num_computed_tokens = 55
    a.append_output_token_ids([8] * 4)
    new = mgr.allocate_slots(a, 4)
    assert new is not None and ids(new) == [[]]
    table = mgr.get_blocks("a").blocks[0]
    assert len(table) == 4 and table[-1].block_hash is None
    a.num_computed_tokens = 59
    a.append_output_token_ids([8] * 19)
    new = mgr.allocate_slots(a, 19)
    assert len(new.blocks[0]) == 1
    table = mgr.get_blocks("a").blocks[0]
    assert table[-2].block_hash is not None and table[-1].block_hash is None


def test_scenario_09_eviction_order_across_requests():
    mgr = manager([full()], num_blocks=11)
    a = request(mgr, "a", list(range(87)))
    assert ids(admit(mgr, a)[2]) == [[1, 2, 3, 4, 5, 6]]
    b = request(mgr, "b", list(range(1000, 1048)))
    assert ids(admit(mgr, b)[2]) == [[7, 8, 9]]
    assert mgr.block_pool.get_num_free_blocks() == 1
    mgr.free(a)
    mgr.free(b)
    assert free_ids(mgr) == [10, 6, 5, 4, 3, 2, 1, 9, 8, 7]
    c = request(mgr, "c", list(range(35)))
    hits, num_hits, new = admit(mgr, c)
    assert ids(hits) == [[1, 2]] and num_hits == 32
    assert ids(new) == [[10]]
    assert mgr.block_pool.get_num_free_blocks() == 7


def test_scenario_10_hit_blocks_not_evicted_by_same_request():
    mgr = manager([full()], num_blocks=3)
    a = request(mgr, "a", list(range(16)))
    admit(mgr, a)
    b = request(mgr, "b", list(range(16, 32)))
    admit(mgr, b)
    mgr.free(a)
    mgr.free(b)
    c = request(mgr, "c", list(range(32)))
    hits, num_hits, new = admit(mgr, c)
    assert ids(hits) == [[1]] and num_hits == 16
    assert ids(new) == [[2]]


def test_scenario_11_failed_allocation_leaves_hits_untouched():
    mgr = manager([full()], num_blocks=11)
    a = request(mgr, "a", COMMON)
    admit(mgr, a)
    b = request(mgr, "b", COMMON * 2)
    hits, num_hits, new = admit(mgr, b)
    assert num_hits == 48 and len(new.blocks[0]) == 3
    mgr.free(b)
    b_blocks = list(hits.blocks[0]) + list(new.blocks[0])
    assert [blk.ref_cnt for blk in b_blocks] == [1, 1, 1, 0, 0, 0]
    c = request(mgr, "c", list(range(500, 532)))
    admit(mgr, c)
    assert mgr.block_pool.get_num_free_blocks() == 5
    d = request(mgr, "d", COMMON * 3)
    hits, num_hits = mgr.get_computed_blocks(d)
    assert num_hits == 96 and len(hits.blocks[0]) == 6
    assert mgr.allocate_slots(d, 48, num_hits, hits) is None
    assert [blk.ref_cnt for blk in b_blocks] == [1, 1, 1, 0, 0, 0]
    assert mgr.block_pool.get_num_free_blocks() == 5


def test_scenario_12_caching_disabled():
    mgr = manager([full(4)], num_blocks=5, enable_caching=False)
    a = request(mgr, "a", range(10))
    assert len(admit(mgr, a)[2].blocks[0]) == 3
    mgr.free(a)
    b = request(mgr, "b", range(16))
    hits, num_hits, new = admit(mgr, b)
    assert num_hits == 0 and len(new.blocks[0]) == 4
    c = request(mgr, "c", range(4))
    assert mgr.allocate_slots(c, 4) is None


def test_scenario_13_skip_reading_allows_duplicate_cached_blocks():
    mgr = manager([full()], num_blocks=11)
    a = request(mgr, "a", COMMON + list(range(100, 107)), skip_reading_prefix_cache=True)
    hits, num_hits, new = admit(mgr, a)
    assert num_hits == 0 and ids(new) == [[1, 2, 3, 4]]
    b = request(mgr, "b", COMMON + list(range(200, 205)))
    hits, num_hits, _ = admit(mgr, b)
    assert ids(hits) == [[1, 2, 3]]
    c = request(mgr, "c", COMMON + list(range(300, 307)), skip_reading_prefix_cache=True)
    hits, num_hits, new = admit(mgr, c)
    assert num_hits == 0
    c_blocks = new.blocks[0]
    assert {b.block_id for b in c_blocks}.isdisjoint({1, 2, 3, 4})
    a_blocks = mgr.get_blocks("a").blocks[0]
    for i in range(3):
        assert c_blocks[i].block_hash == a_blocks[i].block_hash
        assert mgr.block_pool.cached_block_hash_to_block.contain(
            a_blocks[i].block_hash, c_blocks[i].block_id
        )


def test_scenario_14_full_prompt_hit_recomputes_last_block():
    mgr = manager([full()], num_blocks=11)
    a = request(mgr, "a", range(32))
    admit(mgr, a)
    mgr.free(a)
    b = request(mgr, "b", range(32))
    hits, num_hits = mgr.get_computed_blocks(b)
    assert num_hits == 16 and len(hits.blocks[0]) == 1


def test_scenario_15_reset_prefix_cache():
    mgr = manager([full()], num_blocks=11, enable_kv_cache_events=True)
    a = request(mgr, "a", range(40))
    admit(mgr, a)
    index = mgr.block_pool.cached_block_hash_to_block
    assert not mgr.reset_prefix_cache()
    assert len(index) == 2
    mgr.free(a)
    mgr.take_events()
    assert mgr.reset_prefix_cache()
    assert len(mgr.block_pool.cached_block_hash_to_block) == 0
    assert all(b.block_hash is None for b in mgr.block_pool.blocks)
    assert mgr.take_events() == [AllBlocksCleared()]


# -- hashing -----------------------------------------------------------------------------------


def test_scenario_16_cache_salt():
    mgr = manager([full()], num_blocks=11)
    tokens = list(range(53))
    a = request(mgr, "a", tokens, cache_salt="salt1")
    assert generate_block_hash_extra_keys(a, 0, 16) == ("salt1",)
    assert generate_block_hash_extra_keys(a, 16, 32) is None
    assert generate_block_hash_extra_keys(a, 32, 48) is None
    admit(mgr, a)
    b = request(mgr, "b", tokens, cache_salt="salt1")
    assert mgr.get_computed_blocks(b)[1] == 48
    c = request(mgr, "c", tokens, cache_salt="salt2")
    assert mgr.get_computed_blocks(c)[1] == 0
    d = request(mgr, "d", tokens)
    assert mgr.get_computed_blocks(d)[1] == 0


def test_scenario_17_multimodal_extra_keys():
    mgr = manager([full()], num_blocks=11)
    mm = [("aaa", 11, 10), ("bbb", 30, 18)]
    tokens = list(range(48)) + [7, 8, 9]
    a = request(mgr, "a", tokens, mm_features=mm)
    # vLLM's later format: each item with its start offset relative to the block start.
    assert generate_block_hash_extra_keys(a, 0, 16) == (("aaa", 11),)
    assert generate_block_hash_extra_keys(a, 16, 32) == (("aaa", -5), ("bbb", 14))
    assert generate_block_hash_extra_keys(a, 32, 48) == (("bbb", -2),)
    admit(mgr, a)
    b = request(mgr, "b", list(range(48)) + [70, 80], mm_features=mm)
    assert mgr.get_computed_blocks(b)[1] == 48
    c = request(
        mgr, "c", list(range(48)) + [70, 80], mm_features=[("aaa", 11, 10), ("ccc", 30, 18)]
    )
    assert mgr.get_computed_blocks(c)[1] == 16


def test_scenario_18_multi_group_index_keys():
    pool = BlockPool(11, enable_caching=True, hash_block_size=4)
    req = Request("r", list(range(14)), hash_block_size=4)
    assert len(req.block_hashes) == 3
    g0 = pool.get_new_blocks(3)
    g1 = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, g0, 0, 2, 4, 0)
    pool.cache_full_blocks(req, g1, 0, 3, 4, 1)
    assert len(pool.cached_block_hash_to_block) == 5
    h2 = req.block_hashes[2]
    assert pool.get_cached_block(h2, [0]) is None
    assert pool.get_cached_block(h2, [1]) == [g1[2]]
    assert pool.get_cached_block(h2, [0, 1]) is None


# -- EAGLE -------------------------------------------------------------------------------------


def test_scenario_19_eagle_drops_last_block():
    mgr = manager([full()], num_blocks=11, use_eagle=True)
    admit(mgr, request(mgr, "a", range(48)))
    hits, num_hits = mgr.get_computed_blocks(request(mgr, "b", range(48)))
    assert num_hits == 16 and len(hits.blocks[0]) == 1


def test_scenario_20_eagle_partial_prompt():
    mgr = manager([full()], num_blocks=11, use_eagle=True)
    admit(mgr, request(mgr, "a", range(37)))
    assert mgr.get_computed_blocks(request(mgr, "b", range(37)))[1] == 16


@pytest.mark.parametrize("baseline", [True, False])
def test_scenario_21_eagle_sliding_window(baseline):
    mgr = manager([swa(16, 16)], num_blocks=11, use_eagle=True, baseline=baseline)
    a = request(mgr, "a", range(37))
    _, _, new = admit(mgr, a)
    b = request(mgr, "b", range(37))
    hits, num_hits = mgr.get_computed_blocks(b)
    assert num_hits == 16
    mgr.block_pool.evict_blocks([new.blocks[0][0].block_id])
    assert mgr.get_computed_blocks(b)[1] == 0


# -- hybrid coordinator ------------------------------------------------------------------------


def _hybrid_22(**kwargs):
    mgr = manager([full(), swa(16, 32), swa(16, 32)], num_blocks=21, **kwargs)
    a = request(mgr, "a", range(55))
    assert ids(admit(mgr, a)[2]) == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    return mgr, a


@pytest.mark.parametrize("baseline", [True, False])
def test_scenario_22_hybrid_hit(baseline):
    mgr, a = _hybrid_22(baseline=baseline)
    b = request(mgr, "b", range(53))
    hits, num_hits, new = admit(mgr, b)
    assert num_hits == 48
    assert ids(hits) == [[1, 2, 3], [0, 6, 7], [0, 10, 11]]
    assert ids(new) == [[13], [14], [15]]


@pytest.mark.parametrize(
    ("evict", "expected"),
    [
        ({1: [0], 2: [0]}, 48),
        ({0: [0]}, 0),
        ({0: [2], 1: [2], 2: [2]}, 32),
        ({0: [2]}, 32),
        ({1: [2]}, 32),
        ({0: [2], 1: [0], 2: [0]}, 0),
    ],
    ids=["swa-first", "full-first", "all-last", "full-last", "one-swa-last", "disagree"],
)
def test_scenario_23_hybrid_fixed_point(evict, expected):
    mgr, a = _hybrid_22()
    table = mgr.get_blocks("a").blocks
    b = request(mgr, "b", range(53))
    admit(mgr, b)
    mgr.free(a)
    mgr.free(b)
    mgr.evict_blocks([table[g][i].block_id for g, idx in evict.items() for i in idx])
    c = request(mgr, "c", range(53))
    hits, num_hits = mgr.get_computed_blocks(c)
    assert num_hits == expected
    assert [len(h) for h in hits.blocks] == ([expected // 16] * 3 if expected else [0, 0, 0])


@pytest.mark.parametrize(("eagle_drop_once", "expected"), [(False, 64), (True, 80)])
def test_scenario_24_eagle_hybrid(eagle_drop_once, expected):
    mgr = manager(
        [full(), swa(16, 48), swa(16, 48)],
        num_blocks=31,
        use_eagle=True,
        eagle_drop_once=eagle_drop_once,
    )
    a = request(mgr, "a", range(103))
    assert ids(admit(mgr, a)[2]) == [list(range(1, 8)), list(range(8, 15)), list(range(15, 22))]
    b = request(mgr, "b", range(101))
    hits, num_hits, new = admit(mgr, b)
    assert num_hits == expected
    if not eagle_drop_once:
        # The reference's numbers (vLLM before the fix of issue #32802).
        assert ids(hits) == [[1, 2, 3, 4], [0, 9, 10, 11], [0, 16, 17, 18]]
        assert ids(new) == [[22, 23, 24], [25, 26, 27], [28, 29, 30]]
    else:
        # vLLM 0.32: the window groups match one block past the candidate before dropping.
        assert ids(hits) == [[1, 2, 3, 4, 5], [0, 0, 10, 11, 12], [0, 0, 17, 18, 19]]


def test_scenario_25_different_block_sizes():
    mgr = manager([full(32), swa(16, 32)], num_blocks=100)
    assert (mgr.scheduler_block_size, mgr.hash_block_size) == (32, 16)
    a = request(mgr, "a", range(160))
    _, _, new = admit(mgr, a, num_new_tokens=112)
    assert ids(new) == [[1, 2, 3, 4], list(range(5, 12))]
    b = request(mgr, "b", range(113))
    hits, num_hits = mgr.get_computed_blocks(b)
    assert num_hits == 96 and [len(h) for h in hits.blocks] == [3, 6]
    mgr.evict_blocks([10, 11])
    hits, num_hits = mgr.get_computed_blocks(b)
    assert num_hits == 64 and [len(h) for h in hits.blocks] == [2, 4]


# -- sliding-window / chunked-local managers ---------------------------------------------------


def _pool_with_cached(pattern: list[bool], hash_block_size: int = 2):
    """A pool and a request whose block i is cached in group 0 iff pattern[i]."""
    pool = BlockPool(len(pattern) + 2, enable_caching=True, hash_block_size=hash_block_size)
    req = Request(
        "r", list(range(len(pattern) * hash_block_size + 1)), hash_block_size=hash_block_size
    )
    blocks = pool.get_new_blocks(len(pattern))
    for i, cached in enumerate(pattern):
        if cached:
            pool.cache_full_blocks(req, blocks, i, i + 1, hash_block_size, 0)
    return pool, req, blocks


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("F", 0),
        ("T", 1),
        ("TF", 1),
        ("TT", 2),
        ("TTF", 2),
        ("TTT", 3),
        ("TTTF", 3),
        ("TTFTFFTTFTTT", 12),
        ("TTFTFFTTFFF", 8),
        ("TTFTFFTTFFFT", 8),
    ],
)
def test_scenario_26_sliding_window_hits(pattern, expected):
    cached = [c == "T" for c in pattern]
    pool, req, blocks = _pool_with_cached(cached)
    spec = swa(2, 4)
    (hit,), length = SlidingWindowManager.find_longest_cache_hit(
        req.block_hashes, len(cached) * 2, [0], pool, spec, False, 2
    )
    assert length == expected * 2 and len(hit) == expected
    assert all(b.is_null for b in hit[: max(0, expected - 2)])
    assert [b.block_id for b in hit[max(0, expected - 2) :]] == [
        blocks[i].block_id for i in range(max(0, expected - 2), expected)
    ]


def _manager_with_table(manager_cls, spec, table_ids):
    pool = BlockPool(max(table_ids) + 1, True, spec.block_size, unhashed_blocks_to_front=False)
    m = manager_cls(spec, pool, True, 0, spec.block_size)
    blocks = [pool.blocks[i] for i in table_ids]
    for b in blocks:
        pool.free_block_queue.remove(b)
        b.ref_cnt = 1
    m.req_to_blocks["r"] = list(blocks)
    return m, pool


@pytest.mark.parametrize(
    ("computed", "num_null"), [(0, 0), (4, 0), (5, 1), (6, 1), (7, 2), (11, 4)]
)
def test_scenario_27_sliding_window_remove_skipped_blocks(computed, num_null):
    m, pool = _manager_with_table(SlidingWindowManager, swa(2, 4), list(range(1000, 1011)))
    before = pool.free_block_queue.get_all_free_blocks()
    m.remove_skipped_blocks("r", computed)
    table = m.req_to_blocks["r"]
    assert [b.is_null for b in table] == [True] * num_null + [False] * (11 - num_null)
    freed = pool.free_block_queue.get_all_free_blocks()[len(before) :]
    assert [b.block_id for b in freed] == list(range(999 + num_null, 999, -1))


def test_scenario_27_incremental_frees_stop_at_first_null():
    m, pool = _manager_with_table(SlidingWindowManager, swa(2, 4), list(range(1000, 1011)))
    m.remove_skipped_blocks("r", 7)
    n = pool.get_num_free_blocks()
    m.remove_skipped_blocks("r", 11)
    freed = pool.free_block_queue.get_all_free_blocks()[n:]
    assert [b.block_id for b in freed] == [1003, 1002]


@pytest.mark.parametrize(("computed", "num_null"), [(4, 2), (6, 2), (12, 6)])
def test_scenario_28_chunked_local_remove_skipped_blocks(computed, num_null):
    m, _ = _manager_with_table(ChunkedLocalAttentionManager, chunked(2, 4), list(range(1000, 1011)))
    m.remove_skipped_blocks("r", computed)
    assert sum(b.is_null for b in m.req_to_blocks["r"]) == num_null
    assert all(b.is_null for b in m.req_to_blocks["r"][:num_null])


@pytest.mark.parametrize(
    ("pattern", "tail", "expected"), [("T", 0, 1), ("T", 1, 1), ("TTF", 0, 2), ("TTTF", 0, 4)]
)
def test_scenario_28_chunked_local_hits(pattern, tail, expected):
    cached = [c == "T" for c in pattern]
    pool, req, _ = _pool_with_cached(cached)
    (hit,), length = ChunkedLocalAttentionManager.find_longest_cache_hit(
        req.block_hashes, len(cached) * 2 + tail, [0], pool, chunked(2, 4), False, 2
    )
    assert length == expected * 2 and len(hit) == expected


def test_scenario_29_blocks_to_allocate_counts_evictable_hits():
    pool = BlockPool(100, enable_caching=True, hash_block_size=2)
    m = SlidingWindowManager(swa(2, 4), pool, True, 0, 2)
    hits = [pool.blocks[i] for i in range(1, 11)]
    assert all(b.ref_cnt == 0 for b in hits)
    assert m.get_num_blocks_to_allocate("1", 40, hits, 0) == 20
    hits = [pool.null_block] * 5 + [pool.blocks[i] for i in range(11, 16)]
    assert m.get_num_blocks_to_allocate("2", 40, hits, 0) == 15


def test_scenario_33_lookahead_slots():
    for lookahead in (2, 4):
        mgr = manager([full(4)], num_blocks=11)
        r = request(mgr, "r", range(3))
        new = mgr.allocate_slots(r, 3, num_lookahead_tokens=lookahead)
        assert len(new.blocks[0]) == 2


# -- DeepSeek-V4 layout (block 256 / SWA 64 window 128 / C4-state 4 window 8 / C128 8 window 128)


def _dsv4_manager(**kwargs):
    return manager(
        [full(256), swa(64, 128), swa(64, 128), swa(4, 8), swa(8, 128)],
        num_blocks=4000,
        max_num_batched_tokens=8192,
        **kwargs,
    )


def _hashed_indices(mgr, rid):
    return [
        [i for i, b in enumerate(g) if b.block_hash is not None] for g in mgr.get_blocks(rid).blocks
    ]


def test_scenario_37_block_sizes():
    mgr = _dsv4_manager()
    assert (mgr.scheduler_block_size, mgr.hash_block_size) == (256, 4)


def test_scenario_38_window_cache_mask():
    mgr = _dsv4_manager()
    a = request(mgr, "a", range(1024))
    admit(mgr, a)
    mla, swa1, swa2, c4, c128 = _hashed_indices(mgr, "a")
    assert mla == [0, 1, 2, 3]
    assert swa1 == swa2 == [2, 3, 6, 7, 10, 11, 14, 15]
    assert c4 == [62, 63, 126, 127, 190, 191, 254, 255]
    assert c128 == [*range(16, 32), *range(48, 64), *range(80, 96), *range(112, 128)]


def test_scenario_38_retention_zero_keeps_only_the_replay_boundary():
    mgr = _dsv4_manager(baseline=False)
    a = request(mgr, "a", range(1024))
    admit(mgr, a)
    mla, swa1, _, c4, c128 = _hashed_indices(mgr, "a")
    # vLLM 0.32's default: only the tail a resend (hit <= 1023 -> 768) can end on.
    assert mla == [0, 1, 2, 3]
    assert swa1 == [10, 11] and c4 == [190, 191] and c128 == list(range(80, 96))


@pytest.mark.parametrize("baseline", [True, False])
def test_scenario_39_hit_lengths(baseline):
    mgr = _dsv4_manager(baseline=baseline)
    a = request(mgr, "a", range(600))
    admit(mgr, a)
    mgr.free(a)
    b = request(mgr, "b", range(600))
    hits, num_hits = mgr.get_computed_blocks(b)
    assert num_hits == 512
    mla, swa1, swa2, c4, c128 = hits.blocks
    assert len(mla) == 2
    assert [i for i, x in enumerate(swa1) if not x.is_null] == [6, 7]
    assert [i for i, x in enumerate(c4) if not x.is_null] == [126, 127]
    assert [i for i, x in enumerate(c128) if not x.is_null] == list(range(48, 64))
    for n in (1, 100, 256):
        assert mgr.get_computed_blocks(request(mgr, f"short{n}", range(n)))[1] == 0


def test_scenario_39_exact_block_prompt_and_missing_window_block():
    mgr = _dsv4_manager()
    admit(mgr, request(mgr, "x", range(10_000, 10_512)))
    assert mgr.get_computed_blocks(request(mgr, "y", range(10_000, 10_512)))[1] == 256
    a = request(mgr, "a", range(600))
    admit(mgr, a)
    swa_table = mgr.get_blocks("a").blocks[1]
    mgr.free(a)
    mgr.evict_blocks([swa_table[7].block_id])
    hits, num_hits = mgr.get_computed_blocks(request(mgr, "b", range(600)))
    assert num_hits == 256 and len(hits.blocks[0]) == 1


def test_scenario_40_admission_caps_and_skipped_blocks():
    mgr = _dsv4_manager(max_model_len=1 << 20)
    caps = [m.max_admission_blocks_per_request for m in mgr.coordinator.single_type_managers]
    assert caps == [None, 131, 131, 2051, 1041]
    a = request(mgr, "a", range(300))
    admit(mgr, a)
    a.num_computed_tokens = 300
    a.append_output_token_ids(1)
    mgr.allocate_slots(a, 1)
    nulls = [sum(b.is_null for b in g) for g in mgr.get_blocks("a").blocks]
    assert nulls == [0, 2, 2, 73, 21]
