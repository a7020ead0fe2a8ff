"""KVCacheManager: bad input, events, bounded replay, statistics."""

from __future__ import annotations

import dataclasses

import pytest
from cache_testing import admit, config, free_ids, full, manager, request, swa

from cache import BlockRemoved, BlockStored, KVCacheBlocks, KVCacheManager, Request
from cache.hashing import make_block_hash_with_group_id
from cache.layout import for_model, tiny_v41_desc
from cache.spec import FullAttentionSpec, SlidingWindowMLASpec


def snapshot(mgr: KVCacheManager) -> tuple:
    tables = {
        rid: [b.block_id for b in blocks]
        for m in mgr.coordinator.single_type_managers
        for rid, blocks in m.req_to_blocks.items()
    }
    refs = [b.ref_cnt for b in mgr.block_pool.blocks[1:]]
    hashes = [b.block_hash for b in mgr.block_pool.blocks]
    return free_ids(mgr), tables, refs, hashes


@pytest.fixture
def busy():
    mgr = manager([full(), swa(16, 32)], num_blocks=40, max_model_len=256)
    a = request(mgr, "a", range(70))
    admit(mgr, a)
    a.num_computed_tokens = 70
    return mgr, a


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_new_tokens": -1}, "num_new_tokens must be an int >= 0, got -1"),
        ({"num_new_tokens": 1, "num_lookahead_tokens": -2}, "num_lookahead_tokens"),
        ({"num_new_tokens": 1.5}, "num_new_tokens"),
        ({"num_new_tokens": 0}, "num_new_tokens must be > 0"),
        ({"num_new_tokens": 187}, "over max_model_len=256"),
    ],
)
def test_bad_allocate_arguments_leave_manager_unchanged(busy, kwargs, message):
    mgr, a = busy
    before = snapshot(mgr)
    with pytest.raises(ValueError, match=message):
        mgr.allocate_slots(a, **kwargs)
    assert snapshot(mgr) == before


def test_vllm_compatible_arguments(busy):
    mgr, a = busy
    free = mgr.num_free_blocks
    with pytest.raises(ValueError, match="KV connectors are not supported"):
        mgr.allocate_slots(a, 1, num_external_computed_tokens=16)
    b = request(mgr, "b", range(500, 540))
    assert mgr.allocate_slots(b, 40, reserved_blocks=free - 1) is None  # needs 3 + 3 blocks
    assert mgr.allocate_slots(b, 40, reserved_blocks=free - 6) is not None
    with pytest.raises(ValueError, match="scheduler_block_size=32 does not match"):
        manager([full(), swa(16, 32)], 40, scheduler_block_size=32)
    same = manager([full(), swa(16, 32)], 40, scheduler_block_size=16, max_in_flight_tokens=64)
    assert same.coordinator.single_type_managers[1].max_admission_blocks_per_request == 7


def test_hits_for_a_running_request_are_refused(busy):
    mgr, a = busy
    b = request(mgr, "b", range(70))
    hits, num_hits = mgr.get_computed_blocks(b)
    assert num_hits == 64
    before = snapshot(mgr)
    with pytest.raises(ValueError, match="already holds blocks"):
        mgr.allocate_slots(a, 1, num_hits, hits)
    assert snapshot(mgr) == before


def test_wrong_number_of_hit_groups(busy):
    mgr, _ = busy
    b = request(mgr, "b", range(70))
    hits, num_hits = mgr.get_computed_blocks(b)
    bad = KVCacheBlocks(hits.blocks[:1])
    with pytest.raises(ValueError, match="1 groups, the manager has 2"):
        mgr.allocate_slots(b, 6, num_hits, bad)


def test_request_hashed_at_another_granularity(busy):
    mgr, _ = busy
    with pytest.raises(ValueError, match="hashed every 8 tokens but this manager needs 16"):
        mgr.get_computed_blocks(Request("x", range(40), hash_block_size=8))


def test_unknown_requests(busy):
    mgr, _ = busy
    with pytest.raises(KeyError, match="'nope'"):
        mgr.get_block_ids("nope")
    before = snapshot(mgr)
    mgr.free(Request("nope", [1]))  # vLLM: freeing a request that never got blocks is a no-op
    assert snapshot(mgr) == before
    with pytest.raises(TypeError, match=r"cache\.Request"):
        mgr.free("a")


def test_bad_requests_and_configs():
    with pytest.raises(ValueError, match="at least one token"):
        Request("r", [])
    with pytest.raises(ValueError, match="non-empty string"):
        Request("", [1])
    with pytest.raises(ValueError, match="max_model_len must be an int >= 0"):
        KVCacheManager(config([full()], 10), -1)
    with pytest.raises(ValueError, match="multiple of the scheduler block size"):
        manager([full(), swa(16, 32)], 10, prefix_cache_retention_interval=24)
    with pytest.raises(ValueError, match="no sliding-window KV-cache group"):
        manager([full()], 10, prefix_cache_retention_interval=32)

    @dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
    class MyAttentionSpec(FullAttentionSpec):
        pass

    spec = MyAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="bfloat16")
    with pytest.raises(ValueError, match="no KV-cache manager is registered for MyAttentionSpec"):
        manager([spec], 10)


def _replay_index(events) -> set[tuple[bytes, int]]:
    index: set[tuple[bytes, int]] = set()
    for event in events:
        if isinstance(event, BlockStored):
            for h, bid in zip(event.block_hashes, event.block_ids, strict=True):
                index.add((make_block_hash_with_group_id(h, event.group_idx), bid))
        elif isinstance(event, BlockRemoved):
            for h, bid in zip(event.block_hashes, event.block_ids, strict=True):
                index.discard((make_block_hash_with_group_id(h, event.group_idx), bid))
        else:
            index.clear()
    return index


def test_events_rebuild_the_prefix_index():
    mgr = manager(
        [full(32), swa(16, 32)], num_blocks=12, enable_kv_cache_events=True, baseline=False
    )
    events = []
    for i in range(6):
        r = request(mgr, f"r{i}", [7] * 40 + list(range(100 * i, 100 * i + 30)))
        admit(mgr, r)
        events += mgr.take_events()
        mgr.free(r)
    pool_index = {
        (key, b.block_id)
        for key, blocks in mgr.block_pool.cached_block_hash_to_block.items()
        for b in blocks
    }
    assert any(isinstance(e, BlockRemoved) for e in events)
    assert _replay_index(events) == pool_index
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert {e.group_idx for e in stored} == {0, 1}
    assert {e.kv_cache_spec_kind for e in stored} == {"full_attention", "sliding_window"}


def test_prefix_cache_stats():
    mgr = manager([full()], num_blocks=20)
    admit(mgr, request(mgr, "a", range(40)))
    admit(mgr, request(mgr, "b", range(40)))
    stats = mgr.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 80, 32)
    assert stats.hit_rate == pytest.approx(0.4)
    assert mgr.make_prefix_cache_stats().requests == 0


def _tiny_v41(**kwargs):
    cfg = for_model(tiny_v41_desc(), num_gpu_blocks_override=400)
    return KVCacheManager(cfg, 512, max_num_batched_tokens=64, **kwargs)


def test_v41_groups_and_ring():
    mgr = _tiny_v41()
    kinds = [type(m).__name__ for m in mgr.coordinator.single_type_managers]
    assert kinds == ["SlidingWindowManager", "FullAttentionManager", "CircularBufferManager"]
    r = mgr.new_request("r", range(100))
    _, _, new = admit(mgr, r)
    assert [len(g) for g in new.blocks] == [25, 7, 1]
    r.num_computed_tokens = 100
    r.append_output_token_ids(5)
    new = mgr.allocate_slots(r, 1)
    assert len(new.blocks[2]) == 0  # the ring is allocated once
    table = mgr.get_blocks("r").blocks
    assert not any(b.is_null for b in table[1]) and sum(b.is_null for b in table[0]) == 23
    assert all(b.block_hash is None for b in table[2])


@pytest.mark.parametrize("bounded_replay", [False, True])
def test_v41_bounded_replay(bounded_replay):
    mgr = _tiny_v41(swa_bounded_replay=bounded_replay)
    a = mgr.new_request("a", range(100))
    admit(mgr, a)
    window_hashed = [b.block_hash is not None for b in mgr.get_blocks("a").blocks[0]]
    assert any(window_hashed) != bounded_replay
    mgr.free(a)
    hits, num_hits = mgr.get_computed_blocks(mgr.new_request("b", range(100)))
    assert num_hits == 96
    assert mgr.num_replay_tokens(num_hits) == (8 if bounded_replay else 0)
    assert all(not g for g in hits.blocks[0::2]) == bounded_replay  # window and ring: no hits


@pytest.mark.parametrize("bounded_replay", [False, True])
def test_bounded_replay_drops_hits_within_the_window(bounded_replay):
    window = SlidingWindowMLASpec(
        block_size=16, num_kv_heads=1, head_size=64, dtype="bfloat16", sliding_window=32
    )
    mgr = manager(
        [full(), window],
        num_blocks=40,
        swa_bounded_replay=bounded_replay,
        baseline=not bounded_replay,
    )
    admit(mgr, request(mgr, "a", range(70)))
    assert mgr.hash_block_size == 16
    short = mgr.get_computed_blocks(request(mgr, "b", range(20)))[1]
    assert short == (0 if bounded_replay else 16)
    hits, num_hits = mgr.get_computed_blocks(request(mgr, "c", range(60)))
    assert num_hits == 48 and mgr.num_replay_tokens(num_hits) == (32 if bounded_replay else 0)
