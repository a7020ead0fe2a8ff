"""Stateful fuzzing of `KVCacheManager` (hypothesis `RuleBasedStateMachine`).

Random request lifecycles (arrive, admit with hits, chunked prefill, decode, speculative decode
with rejections, preemption, finish, prefix-cache reset) run on small pools; after every step
the allocator's invariants are checked (docs/allocator_internals.md, section 3), KV events must
replay to the index, and hits must equal a brute-force oracle over the index (without EAGLE).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from cache_testing import BASELINE, config, full, swa
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

from cache import KVCacheManager, Request
from cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from cache.hashing import make_block_hash_with_group_id, resolve_block_hashes
from cache.layout import for_model, tiny_v41_desc
from cache.single_type_kv_cache_manager import (
    CircularBufferManager,
    FullAttentionManager,
    SlidingWindowManager,
)
from cache.spec import KVCacheConfig

VOCAB = 5
MAX_MODEL_LEN = 160
MAX_PROMPT = 100
MAX_LIVE = 6
MAX_SPEC = 3
NULL = 0
# Prompt = one of a few shared prefixes cut at (mostly block-ish) lengths + a random suffix.
PREFIX_CUTS = (0, 5, 15, 16, 17, 31, 32, 33, 40, 47, 48, 63, 64, 65, 80, 96)
SUFFIX_LENS = (0, 0, 1, 2, 4, 7, 16, 23)
# Weighted actions (repetition = weight).
ACTIONS = (
    *["arrive"] * 3,
    *["admit"] * 4,
    *["step"] * 6,
    *["spec_decode"] * 3,
    "preempt",
    "finish",
    "reset_prefix_cache",
)
# Rough coverage counters (steps, failed allocations, hits, ...), summed over all runs.
STATS: Counter[str] = Counter()

FUZZ_SETTINGS = settings(
    max_examples=8,
    stateful_step_count=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


# -- configurations -----------------------------------------------------------------------------


@dataclass(frozen=True)
class FuzzConfig:
    name: str
    build: Callable[[], KVCacheConfig]
    options: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        return self.name


def _full_only() -> KVCacheConfig:
    return config([full(16)], num_blocks=16)


def _full16_swa32() -> KVCacheConfig:
    return config([full(16), swa(16, 32)], num_blocks=24)


def _full32_swa16() -> KVCacheConfig:
    return config([full(32), swa(16, 32)], num_blocks=24)


def _v41() -> KVCacheConfig:
    return for_model(tiny_v41_desc(), num_gpu_blocks_override=48)


def _v41_eagle_group() -> KVCacheConfig:
    # The last draft layer's SWA group is marked as the EAGLE group (vLLM's positional rule).
    return for_model(tiny_v41_desc(num_speculative_tokens=2), num_gpu_blocks_override=48)


def _configs() -> list[FuzzConfig]:
    out: list[FuzzConfig] = []
    modes = {"default": {}, "baseline": dict(BASELINE)}
    for layout, build in (
        ("full16", _full_only),
        ("full16+swa32/16", _full16_swa32),
        ("full32+swa32/16", _full32_swa16),
    ):
        for mode, opts in modes.items():
            for eagle in (False, True):
                name = f"{layout}-{mode}" + ("-eagle" if eagle else "")
                out.append(FuzzConfig(name, build, {**opts, "use_eagle": eagle}))
    out.append(FuzzConfig("full16-nocache", _full_only, {"enable_caching": False}))
    out.append(FuzzConfig("full16+swa32/16-nocache", _full16_swa32, {"enable_caching": False}))
    for mode, opts in modes.items():
        for eagle in (False, True):
            for bounded in (False, True):
                name = f"v41-{mode}" + ("-eagle" if eagle else "") + ("-bounded" if bounded else "")
                out.append(
                    FuzzConfig(
                        name, _v41, {**opts, "use_eagle": eagle, "swa_bounded_replay": bounded}
                    )
                )
    out.append(FuzzConfig("v41-default-eaglegroup", _v41_eagle_group, {"use_eagle": True}))
    out.append(FuzzConfig("v41-nocache", _v41, {"enable_caching": False}))
    return out


CONFIGS = _configs()


# -- helpers ------------------------------------------------------------------------------------


def next_token(tokens: list[int]) -> int:
    """A deterministic "sampler": identical sequences continue identically (so resends and
    re-admitted requests can hit their outputs too)."""
    a = tokens[-1]
    b = tokens[-2] if len(tokens) > 1 else 0
    return (3 * a + b + len(tokens)) % VOCAB


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Tracked:
    req: Request
    running: bool = False
    # Tokens registered in the prefix index at the last successful allocation.
    cached_upto: int = 0


@dataclass(frozen=True)
class Snapshot:
    ref_cnts: tuple[int, ...]
    hashes: tuple[bytes | None, ...]
    free_order: tuple[int, ...]
    index: frozenset[tuple[bytes, int]]
    tables: dict[str, tuple[tuple[int, ...], ...]]


# -- the state machine --------------------------------------------------------------------------


class AllocatorMachine(RuleBasedStateMachine):
    CFG: FuzzConfig = CONFIGS[0]

    def __init__(self) -> None:
        super().__init__()
        cfg = self.CFG
        self.cfg = cfg
        self.mgr = KVCacheManager(
            cfg.build(), MAX_MODEL_LEN, enable_kv_cache_events=True, **cfg.options
        )
        self.pool = self.mgr.block_pool
        self.num_blocks = self.pool.num_gpu_blocks
        self.caching = self.mgr.enable_caching
        self.managers = self.mgr.coordinator.single_type_managers
        self.kinds = []
        for m in self.managers:
            if isinstance(m, CircularBufferManager):
                self.kinds.append("ring")
            elif isinstance(m, SlidingWindowManager):
                self.kinds.append("window")
            elif isinstance(m, FullAttentionManager):
                self.kinds.append("full")
            else:
                raise AssertionError(f"unexpected manager {type(m).__name__}")
        rng = random.Random(1234)
        self.prefixes = [[rng.randrange(VOCAB) for _ in range(n)] for n in (24, 48, 96)]
        self.history: list[list[int]] = []
        self.reqs: dict[str, Tracked] = {}
        self.next_id = 0
        # Prefix index rebuilt from the KV events: {(key, block_id)}.
        self.event_index: set[tuple[bytes, int]] = set()
        self.prev_tables: dict[str, tuple[tuple[int, ...], ...]] = {}

    # -- state views -------------------------------------------------------------------------

    def table(self, rid: str) -> tuple[tuple[int, ...], ...]:
        if not self.mgr.coordinator.has_request(rid):
            return tuple(() for _ in self.managers)
        return tuple(tuple(g) for g in self.mgr.get_block_ids(rid))

    def index_pairs(self) -> frozenset[tuple[bytes, int]]:
        return frozenset(
            (key, b.block_id)
            for key, blocks in self.pool.cached_block_hash_to_block.items()
            for b in blocks
        )

    def snapshot(self) -> Snapshot:
        return Snapshot(
            ref_cnts=tuple(b.ref_cnt for b in self.pool.blocks),
            hashes=tuple(b.block_hash for b in self.pool.blocks),
            free_order=tuple(b.block_id for b in self.pool.free_block_queue.get_all_free_blocks()),
            index=self.index_pairs(),
            tables={rid: self.table(rid) for rid in self.reqs},
        )

    def key(self, req: Request, group: int, pos: int) -> bytes | None:
        """The index key of the request's block ``pos`` in ``group`` (None: not hashed yet)."""
        hashes = resolve_block_hashes(
            req.block_hashes, self.mgr.hash_block_size, self.managers[group].block_size
        )
        if pos >= len(hashes):
            return None
        return make_block_hash_with_group_id(hashes[pos], group)

    def valid_keys(self, req: Request, group: int, pos: int) -> dict[bytes, int]:
        """Keys block ``pos`` of ``group`` may carry for this request -> prefix tokens covered:
        its full-block key, and (full attention coarser than the hash block) the fine hash of a
        boundary inside it (vLLM 0.32's prompt-tail partial entries)."""
        bs = self.managers[group].block_size
        out: dict[bytes, int] = {}
        full_key = self.key(req, group, pos)
        if full_key is not None:
            out[full_key] = (pos + 1) * bs
        hbs = self.mgr.hash_block_size
        if self.kinds[group] == "full" and bs != hbs:
            for n in range(pos * bs + hbs, (pos + 1) * bs, hbs):
                if n // hbs <= len(req.block_hashes):
                    key = make_block_hash_with_group_id(req.block_hashes[n // hbs - 1], group)
                    out[key] = n
        return out

    def running(self) -> list[str]:
        return sorted(r for r, t in self.reqs.items() if t.running)

    def waiting(self) -> list[str]:
        return sorted(r for r, t in self.reqs.items() if not t.running)

    def can_step(self, t: Tracked) -> bool:
        return t.running and t.req.num_tokens + MAX_SPEC + 2 <= MAX_MODEL_LEN

    def sample(self, req: Request, n: int) -> None:
        toks = list(req.all_token_ids)
        new = []
        for _ in range(n):
            toks.append(next_token(toks))
            new.append(toks[-1])
        req.append_output_token_ids(new)

    # -- checks ------------------------------------------------------------------------------

    def check_hits(self, req: Request, hit_blocks, num_hits: int) -> None:
        mgr = self.mgr
        sbs = mgr.scheduler_block_size
        assert num_hits % sbs == 0, f"hit {num_hits} not a multiple of scheduler block {sbs}"
        assert 0 <= num_hits <= req.num_tokens - 1, (
            f"hit {num_hits} exceeds num_tokens - 1 = {req.num_tokens - 1}"
        )
        if not self.caching:
            assert num_hits == 0, "hit with caching off"
        if mgr.num_replay_tokens_max:
            assert num_hits == 0 or num_hits > mgr.num_replay_tokens_max, (
                f"bounded replay: hit {num_hits} not above the window {mgr.num_replay_tokens_max}"
            )
        if num_hits == 0:
            assert all(len(g) == 0 for g in hit_blocks.blocks), "blocks given for a 0-token hit"
            return
        for g, blocks in enumerate(hit_blocks.blocks):
            bs = self.managers[g].block_size
            if self.kinds[g] == "ring" or not self.managers[g].kv_cache_spec.prefix_cacheable:
                assert len(blocks) == 0, f"group {g} ({self.kinds[g]}) returned hit blocks"
                continue
            assert len(blocks) == num_hits // bs, (
                f"group {g}: {len(blocks)} hit blocks for {num_hits} tokens of block size {bs}"
            )
            for j, b in enumerate(blocks):
                if b.is_null:
                    assert self.kinds[g] == "window", f"null hit block in {self.kinds[g]} group {g}"
                    continue
                expect = self.key(req, g, j)
                assert expect is not None and self.pool.cached_block_hash_to_block.contain(
                    expect, b.block_id
                ), (
                    f"hit block {b.block_id} (group {g}, pos {j}) is not cached under the "
                    f"request's key {expect!r} (its hash: {b.block_hash!r})"
                )
            if self.kinds[g] == "window":
                # The blocks the window reaches back to must be real.
                win = self.managers[g].sliding_window
                need = min(cdiv(win - 1, bs), len(blocks))
                assert all(not b.is_null for b in blocks[len(blocks) - need :]), (
                    f"window group {g}: null within the last {need} hit blocks"
                )
        STATS["hits"] += 1

    def oracle_hit(self, req: Request) -> int:
        """Longest aligned hit every cacheable group can serve, from the event-replayed index
        (no EAGLE). Full attention: every block before it cached; window: the blocks the window
        needs before it cached."""
        mgr = self.mgr
        sbs = mgr.scheduler_block_size
        best = 0
        keys = {key for key, _ in self.event_index}
        limit = min(req.num_tokens - 1, len(req.block_hashes) * mgr.hash_block_size)
        for length in range(sbs, limit + 1, sbs):
            ok = True
            for g, m in enumerate(self.managers):
                if self.kinds[g] == "ring" or not m.kv_cache_spec.prefix_cacheable:
                    continue
                nblk = length // m.block_size
                if self.kinds[g] == "full":
                    lo = 0
                else:
                    lo = max(0, nblk - cdiv(m.sliding_window - 1, m.block_size))
                if any(self.key(req, g, j) not in keys for j in range(lo, nblk)):
                    ok = False
                    break
            if ok:
                best = length
        if mgr.num_replay_tokens_max and best <= mgr.num_replay_tokens_max:
            best = 0
        return best

    def check_free_queue(self) -> None:
        pool = self.pool
        queue = pool.free_block_queue.get_all_free_blocks()
        ids = [b.block_id for b in queue]
        assert len(ids) == len(set(ids)), f"block listed twice in the free queue: {ids}"
        assert NULL not in ids, "the null block is in the free queue"
        assert len(ids) == pool.free_block_queue.num_free_blocks == pool.get_num_free_blocks(), (
            f"free queue holds {len(ids)} blocks, counter says "
            f"{pool.free_block_queue.num_free_blocks}"
        )
        free = set(ids)
        for b in pool.blocks[1:]:
            assert (b.block_id in free) == (b.ref_cnt == 0), (
                f"block {b.block_id}: ref_cnt {b.ref_cnt} but in free queue = {b.block_id in free}"
            )
            assert b.ref_cnt >= 0, f"block {b.block_id} has negative ref_cnt {b.ref_cnt}"
        null = pool.blocks[NULL]
        assert null.is_null and null is pool.null_block, "block 0 is not the null block"
        assert null.block_hash is None, "the null block is hashed"

    def check_usage(self) -> None:
        usable = self.num_blocks - 1
        used = sum(1 for b in self.pool.blocks[1:] if b.ref_cnt > 0)
        assert abs(self.mgr.usage - used / usable) < 1e-9, (
            f"usage {self.mgr.usage} but {used}/{usable} blocks are referenced"
        )
        assert 0.0 <= self.mgr.usage <= 1.0

    def check_tables(self) -> None:
        """Every running request's tables are well formed (`check_group_table`), each block is
        held in one group only with a valid hash (`check_block_hash`), and its ref count is the
        number of table entries holding it."""
        coord = self.mgr.coordinator
        holders: dict[int, int] = {}
        group_of: dict[int, int] = {}
        for m in self.managers:
            for rid in m.req_to_blocks:
                assert rid in self.reqs, f"manager holds blocks for unknown/finished {rid!r}"
        for rid, t in self.reqs.items():
            if not t.running:
                assert not coord.has_request(rid), f"waiting request {rid} holds blocks"
                continue
            for g, ids in enumerate(self.table(rid)):
                self.check_group_table(rid, t, g, ids)
                for j, bid in enumerate(ids):
                    if bid == NULL:
                        continue
                    holders[bid] = holders.get(bid, 0) + 1
                    prev = group_of.setdefault(bid, g)
                    assert prev == g, f"block {bid} held in groups {prev} and {g}"
                    self.check_block_hash(rid, t.req, g, j, bid)
        for b in self.pool.blocks[1:]:
            assert b.ref_cnt == holders.get(b.block_id, 0), (
                f"block {b.block_id}: ref_cnt {b.ref_cnt} but held by "
                f"{holders.get(b.block_id, 0)} (request, group) table entries"
            )

    def check_group_table(self, rid: str, t, g: int, ids: list[int]) -> None:
        """Request ``rid``'s table ``ids`` in group ``g``: no block twice, the group kind's shape,
        enough blocks for the computed tokens, its cached prefix hashed, and no cached block
        past its tokens."""
        req, kind = t.req, self.kinds[g]
        nonnull = [i for i in ids if i != NULL]
        assert len(nonnull) == len(set(nonnull)), f"{rid} group {g}: block twice in one table {ids}"
        if kind == "ring":
            assert len(ids) == 1 and ids[0] != NULL, f"{rid}: ring table {ids}"
        elif kind == "full":
            assert NULL not in ids, f"{rid}: null block in full group {g}: {ids}"
        bs = self.managers[g].block_size
        if kind != "ring":
            assert len(ids) * bs >= req.num_computed_tokens, (
                f"{rid} group {g}: {len(ids)} blocks of {bs} < "
                f"{req.num_computed_tokens} computed tokens"
            )
        if self.caching and kind == "full":
            # Final tokens were registered at the last allocation (hybrid layouts: up
            # to a scheduler-block boundary); a held block cannot be evicted, so every
            # such full block still carries its hash.
            sbs = self.mgr.scheduler_block_size
            for j in range(min(t.cached_upto // sbs * sbs // bs, len(ids))):
                blk = self.pool.blocks[ids[j]]
                assert blk.block_hash is not None, (
                    f"{rid} group {g}: block {ids[j]} at pos {j} is not hashed though "
                    f"{t.cached_upto} tokens were cached"
                )
        ncached = self.managers[g].num_cached_block.get(rid, 0)
        if kind != "ring":
            assert ncached * bs <= req.num_tokens, (
                f"{rid} group {g}: num_cached_block {ncached} beyond {req.num_tokens} tokens"
            )

    def check_block_hash(self, rid: str, req, g: int, j: int, bid: int) -> None:
        """Block ``bid`` at position ``j`` of ``rid``'s group ``g``: if hashed (never a ring
        block), its key and every extra key are ones the request has there."""
        blk = self.pool.blocks[bid]
        if blk.block_hash is None:
            return
        assert self.kinds[g] != "ring", f"ring block {bid} is hashed"
        valid = self.valid_keys(req, g, j)
        assert blk.block_hash in valid, (
            f"{rid} group {g} pos {j}: block {bid} hash {blk.block_hash!r} "
            f"is none of the request's keys there {list(valid)}"
        )
        assert blk.block_hash_num_tokens == valid[blk.block_hash], (
            f"block {bid}: block_hash_num_tokens {blk.block_hash_num_tokens}, "
            f"its key covers {valid[blk.block_hash]} tokens"
        )
        for extra in self.pool.cached_block_hashes_by_block.get(bid, ()):
            assert extra in valid, (
                f"{rid} group {g} pos {j}: block {bid} extra key {extra!r} "
                "is none of the request's keys there"
            )

    def check_append_only(self) -> None:
        for rid, t in self.reqs.items():
            if not t.running:
                continue
            new = self.table(rid)
            old = self.prev_tables.get(rid)
            if old is None:
                continue
            for g, (o, n) in enumerate(zip(old, new)):
                assert len(n) >= len(o), f"{rid} group {g}: table shrank {o} -> {n}"
                for j, (a, b) in enumerate(zip(o, n)):
                    if a != b:
                        STATS["window frees"] += 1
                        assert b == NULL and self.kinds[g] == "window", (
                            f"{rid} group {g} pos {j}: entry changed {a} -> {b} "
                            f"(only window blocks may become null)"
                        )

    def check_index(self) -> None:
        pool = self.pool
        index = pool.cached_block_hash_to_block
        pairs = set()
        extras = pool.cached_block_hashes_by_block
        for key, blocks in index.items():
            assert blocks, f"empty index entry for {key!r}"
            for b in blocks:
                assert not b.is_null, "null block in the prefix index"
                assert b.block_hash == key or key in extras.get(b.block_id, ()), (
                    f"index key {key!r} maps to block {b.block_id} hashed {b.block_hash!r} "
                    f"(extra keys {extras.get(b.block_id)})"
                )
                pairs.add((key, b.block_id))
        for b in pool.blocks:
            if b.block_hash is not None:
                assert index.contain(b.block_hash, b.block_id), (
                    f"block {b.block_id} hashed but not in the index under its key"
                )
                assert b.block_hash not in extras.get(b.block_id, ()), (
                    f"block {b.block_id}: primary key also listed as an extra key"
                )
            else:
                assert b.block_hash_num_tokens is None
                assert not extras.get(b.block_id), (
                    f"block {b.block_id} has extra keys {extras.get(b.block_id)} but no hash"
                )
        if extras:
            STATS["extra keys"] += 1
        if any(len(blocks) > 1 for _, blocks in index.items()):
            STATS["duplicate keys"] += 1
        for bid, keys in extras.items():
            for key in keys:
                assert index.contain(key, bid), f"extra key of block {bid} not in the index"
        if not self.caching:
            assert not pairs, "prefix index not empty with caching off"
        self.replay_events()
        assert self.event_index == pairs, (
            "KV events do not rebuild the prefix index: "
            f"missing {sorted(pairs - self.event_index)[:4]}, "
            f"extra {sorted(self.event_index - pairs)[:4]}"
        )

    def replay_events(self) -> None:
        for ev in self.mgr.take_events():
            if isinstance(ev, BlockStored):
                assert len(ev.block_hashes) == len(ev.block_ids) == len(ev.extra_keys)
                for h, bid in zip(ev.block_hashes, ev.block_ids):
                    pair = (make_block_hash_with_group_id(h, ev.group_idx), bid)
                    assert pair not in self.event_index, f"BlockStored twice for {pair}"
                    self.event_index.add(pair)
            elif isinstance(ev, BlockRemoved):
                STATS["evictions"] += 1
                for h, bid in zip(ev.block_hashes, ev.block_ids, strict=True):
                    pair = (make_block_hash_with_group_id(h, ev.group_idx), bid)
                    assert pair in self.event_index, f"BlockRemoved of unknown {pair}"
                    self.event_index.remove(pair)
            elif isinstance(ev, AllBlocksCleared):
                self.event_index.clear()
            else:
                raise AssertionError(f"unknown event {ev!r}")

    @invariant()
    def invariants(self) -> None:
        STATS["checks"] += 1
        if self.mgr.usage > 0.8:
            STATS["usage>0.8"] += 1
        self.check_free_queue()
        self.check_usage()
        self.check_tables()
        self.check_append_only()
        self.check_index()
        self.prev_tables = {rid: self.table(rid) for rid, t in self.reqs.items() if t.running}

    def check_unchanged_after_failure(self, before: Snapshot, rid: str) -> None:
        """A failed allocate_slots changed nothing but window frees of ``rid`` itself."""
        after = self.snapshot()
        assert after.index == before.index, "failed allocation changed the prefix index"
        assert after.hashes == before.hashes, "failed allocation changed block hashes"
        released: dict[int, int] = {}
        for other, tab in before.tables.items():
            now = after.tables[other]
            if other != rid:
                assert now == tab, f"failed allocation of {rid} changed {other}'s table"
                continue
            for g, (o, n) in enumerate(zip(tab, now)):
                assert len(o) == len(n), f"failed allocation changed {rid}'s group {g} length"
                for a, b in zip(o, n):
                    if a != b:
                        assert b == NULL and self.kinds[g] == "window", (
                            f"failed allocation replaced {a} by {b} in {rid} group {g}"
                        )
                        released[a] = released.get(a, 0) + 1
        for bid in range(1, self.num_blocks):
            expect = before.ref_cnts[bid] - released.get(bid, 0)
            assert after.ref_cnts[bid] == expect, (
                f"failed allocation: block {bid} ref_cnt {before.ref_cnts[bid]} -> "
                f"{after.ref_cnts[bid]}, expected {expect}"
            )
        if not released:
            assert after.free_order == before.free_order, "failed allocation reordered free queue"

    def demand(self, rid: str, need: int, hit_blocks=None, num_local_computed: int = 0) -> int:
        """Free blocks an allocation of ``need`` slots takes (independent of the manager's
        arithmetic): new table entries beyond what the request holds (or skips), plus hit blocks
        that are free now and get touched."""
        tab = self.table(rid)
        total = 0
        for g, m in enumerate(self.managers):
            if self.kinds[g] == "ring":
                total += 0 if tab[g] else 1
                continue
            required = cdiv(need, m.block_size)
            if tab[g]:
                total += max(0, required - len(tab[g]))
                continue
            hits = list(hit_blocks.blocks[g]) if hit_blocks is not None else []
            skipped = 0
            if self.kinds[g] == "window":
                retained = (
                    m.sliding_window - 1 + getattr(m.kv_cache_spec, "extra_retained_tokens", 0)
                )
                skipped = max(0, num_local_computed - retained) // m.block_size
            total += max(0, required - max(skipped, len(hits)))
            total += sum(1 for b in hits[skipped:] if not b.is_null and b.ref_cnt == 0)
        return total

    def check_capacity(self, rid: str, demand: int, before: Snapshot, new_blocks) -> None:
        """None iff the demand exceeds the free blocks (after this request's window frees)."""
        free_now = self.pool.get_num_free_blocks()
        if new_blocks is None:
            assert demand > free_now, (
                f"{rid}: allocation refused though it needs {demand} blocks and {free_now} are free"
            )
            return
        window_freed = sum(
            1
            for o, n in zip(before.tables.get(rid, ()), self.table(rid))
            for a, b in zip(o, n)
            if a != b and before.ref_cnts[a] == 1
        )
        taken = len(before.free_order) + window_freed - free_now
        assert taken == demand, (
            f"{rid}: allocation took {taken} free blocks, the request needed {demand}"
        )

    def check_success(
        self,
        before: Snapshot,
        rid: str,
        new_blocks,
        num_tokens_need_slot: int,
        hit_blocks=None,
    ) -> None:
        after_tab = self.table(rid)
        old_tab = before.tables.get(rid) or tuple(() for _ in self.managers)
        # Blocks this call may hand out: free ones, and this request's own window blocks it
        # freed first (vLLM frees out-of-window blocks before allocating).
        usable = set(before.free_order)
        for o, n in zip(old_tab, after_tab):
            usable.update(a for a, b in zip(o, n) if a != b)
        assert len(new_blocks.blocks) == len(self.managers)
        for g, new in enumerate(new_blocks.get_block_ids()):
            tab = after_tab[g]
            start = len(old_tab[g])
            if hit_blocks is not None and any(hit_blocks.blocks):
                # Admission with hits: [hits, with nulls where out of the window] + new blocks.
                hits = [b.block_id for b in hit_blocks.blocks[g]]
                assert start == 0
                start = len(tab) - len(new)
                assert start >= len(hits), f"{rid} group {g}: hits {hits} not all in {tab}"
                for j in range(start):
                    h = hits[j] if j < len(hits) else NULL
                    assert tab[j] in (h, NULL), f"{rid} group {g}: hit {h} at {j} became {tab[j]}"
                    if tab[j] == NULL:
                        assert self.kinds[g] == "window", f"{rid}: null in {self.kinds[g]} group"
            assert list(tab[start:]) == new, (
                f"{rid} group {g}: returned new blocks {new}, table grew by {tab[start:]}"
            )
            for bid in new:
                assert bid in usable, f"newly allocated block {bid} was neither free nor freed"
                assert self.pool.blocks[bid].ref_cnt == 1, f"new block {bid} shared"
            if self.kinds[g] == "ring":
                assert len(tab) == 1
            else:
                bs = self.managers[g].block_size
                want = max(len(old_tab[g]), cdiv(num_tokens_need_slot, bs), start)
                assert len(tab) == want, (
                    f"{rid} group {g}: table has {len(tab)} blocks, expected {want} for "
                    f"{num_tokens_need_slot} slots"
                )

    # -- rules -------------------------------------------------------------------------------

    # -- actions -----------------------------------------------------------------------------
    # One weighted dispatcher rule instead of one rule per action: hypothesis picks rules
    # nearly uniformly (and swarm-disables some), which starves the interesting ones.

    def spec_candidates(self) -> list[str]:
        return [
            r
            for r in self.running()
            if self.can_step(self.reqs[r])
            and self.reqs[r].req.num_tokens - self.reqs[r].req.num_computed_tokens == 1
        ]

    def enabled(self, action: str) -> bool:
        if action == "arrive":
            return len(self.reqs) < MAX_LIVE
        if action == "admit":
            return any(not t.running for t in self.reqs.values())
        if action == "step":
            return any(self.can_step(t) for t in self.reqs.values())
        if action == "spec_decode":
            return bool(self.spec_candidates())
        if action == "preempt":
            return any(t.running for t in self.reqs.values())
        if action == "finish":
            return bool(self.reqs)
        if action == "reset_prefix_cache":
            return True
        raise AssertionError(action)

    @rule(data=st.data())
    def act(self, data) -> None:
        action = data.draw(st.sampled_from([a for a in ACTIONS if self.enabled(a)]), label="action")
        STATS[action] += 1
        getattr(self, f"do_{action}")(data)

    def do_arrive(self, data) -> None:
        if self.history and data.draw(st.integers(0, 3), label="resend?") == 0:
            prompt = list(data.draw(st.sampled_from(self.history), label="resend"))
        else:
            prefix = self.prefixes[data.draw(st.integers(0, len(self.prefixes) - 1))]
            cut = data.draw(st.sampled_from(PREFIX_CUTS), label="cut")
            n_suffix = data.draw(st.sampled_from(SUFFIX_LENS), label="suffix length")
            suffix = data.draw(
                st.lists(st.integers(0, VOCAB - 1), min_size=n_suffix, max_size=n_suffix),
                label="suffix",
            )
            prompt = (prefix[:cut] + suffix)[:MAX_PROMPT] or [1]
        skip_read = data.draw(st.integers(0, 9), label="skip?") == 0
        rid = f"r{self.next_id}"
        self.next_id += 1
        req = self.mgr.new_request(rid, prompt, skip_reading_prefix_cache=skip_read)
        self.reqs[rid] = Tracked(req)
        self.history.append(prompt)

    def do_admit(self, data) -> None:
        rid = data.draw(st.sampled_from(self.waiting()), label="request")
        t = self.reqs[rid]
        req = t.req
        assert req.num_computed_tokens == 0
        mgr = self.mgr
        before = self.snapshot()
        expect_hits = (
            self.oracle_hit(req) if self.caching and not req.skip_reading_prefix_cache else 0
        )
        hit_blocks, num_hits = mgr.get_computed_blocks(req)
        assert self.snapshot() == before, "get_computed_blocks had side effects"
        self.check_hits(req, hit_blocks, num_hits)
        if not mgr.use_eagle:
            assert num_hits == expect_hits, (
                f"{rid}: hit {num_hits} tokens, the index supports {expect_hits}"
            )
        else:
            assert num_hits <= expect_hits, f"{rid}: EAGLE hit {num_hits} > {expect_hits}"
        replay = mgr.num_replay_tokens(num_hits)
        base = num_hits - replay
        n_total = data.draw(st.integers(1, req.num_tokens - base), label="chunk")
        lookahead = data.draw(st.sampled_from([0, 0, 1, 2, MAX_SPEC]), label="lookahead")
        must_fit = data.draw(st.integers(0, 4), label="must_fit?") == 0
        n_new = max(n_total - replay, 0)
        need = min(num_hits + n_new + lookahead, MAX_MODEL_LEN)
        demand = self.demand(rid, need, hit_blocks, num_hits)
        new = mgr.allocate_slots(
            req,
            n_new,
            num_hits,
            hit_blocks,
            lookahead,
            full_sequence_must_fit=must_fit,
        )
        if new is None:
            STATS["admit_none"] += 1
            after = self.snapshot()
            assert not mgr.coordinator.has_request(rid), f"failed admission left {rid} holding"
            assert after == before, "failed admission changed the allocator state"
            if not must_fit:  # (must_fit refuses on the whole request's admission cap)
                self.check_capacity(rid, demand, before, None)
            return
        self.check_capacity(rid, demand, before, new)
        self.check_success(before, rid, new, need, hit_blocks)
        t.running = True
        t.cached_upto = min(num_hits + n_new, req.num_tokens)
        req.num_computed_tokens = base + n_total
        if req.num_computed_tokens == req.num_tokens:
            self.sample(req, 1)

    def do_step(self, data) -> None:
        """One scheduled chunk: a prefill chunk, or a decode token when the prompt is done."""
        rid = data.draw(
            st.sampled_from([r for r in self.running() if self.can_step(self.reqs[r])]),
            label="request",
        )
        t = self.reqs[rid]
        req = t.req
        remaining = req.num_tokens - req.num_computed_tokens
        assert remaining >= 1
        n = data.draw(st.integers(1, remaining), label="chunk")
        lookahead = data.draw(st.sampled_from([0, 1, MAX_SPEC]), label="lookahead")
        self._run(t, n, lookahead, accepted=None)

    def do_spec_decode(self, data) -> None:
        """A decode step with k drafts; some are rejected (num_computed_tokens -= rejected)."""
        rid = data.draw(st.sampled_from(self.spec_candidates()), label="request")
        k = data.draw(st.integers(1, MAX_SPEC), label="k")
        lookahead = data.draw(st.integers(0, k), label="lookahead")
        accepted = data.draw(st.integers(0, k), label="accepted")
        t = self.reqs[rid]
        t.req.spec_token_ids = [0] * k
        self._run(t, 1 + k, lookahead, accepted=accepted)
        t.req.spec_token_ids = []

    def _run(self, t: Tracked, n: int, lookahead: int, accepted: int | None) -> None:
        req = t.req
        rid = req.request_id
        before = self.snapshot()
        num_tokens_before = req.num_tokens
        need = min(req.num_computed_tokens + n + lookahead, MAX_MODEL_LEN)
        demand = self.demand(rid, need)
        new = self.mgr.allocate_slots(req, n, num_lookahead_tokens=lookahead)
        if new is None:
            STATS["alloc_none"] += 1
            self.check_unchanged_after_failure(before, rid)
            self.check_capacity(rid, demand, before, None)
            return
        self.check_capacity(rid, demand, before, new)
        self.check_success(before, rid, new, need)
        t.cached_upto = min(req.num_computed_tokens + n, num_tokens_before)
        req.num_computed_tokens += n
        if accepted is None:
            if req.num_computed_tokens == req.num_tokens:
                self.sample(req, 1)
        else:
            STATS["spec"] += 1
            rejected = n - 1 - accepted
            req.num_computed_tokens -= rejected
            self.sample(req, accepted + 1)
            assert req.num_tokens == req.num_computed_tokens + 1

    def free_and_check_order(self, t: Tracked) -> None:
        """`free` returns blocks in eviction order: per group, tail first; blocks reaching
        ref_cnt 0 go to the queue's tail, or (vLLM 0.32 default) to its head when unhashed
        (every block with caching off), keeping that order."""
        rid = t.req.request_id
        before = self.snapshot()
        queue = list(before.free_order)
        front = self.mgr.coordinator.block_pool.unhashed_blocks_to_front
        for ids in before.tables.get(rid, ()):
            to_front, to_back = [], []
            for bid in reversed(ids):
                if bid == NULL or before.ref_cnts[bid] != 1:
                    continue
                if front and (before.hashes[bid] is None or not self.caching):
                    to_front.append(bid)
                else:
                    to_back.append(bid)
            queue = to_front + queue + to_back
        self.mgr.free(t.req)
        assert not self.mgr.coordinator.has_request(rid), f"{rid} holds blocks after free"
        after = self.snapshot()
        assert list(after.free_order) == queue, (
            f"free({rid}) left the free queue as {list(after.free_order)}, expected {queue}"
        )
        assert after.index == before.index, "free changed the prefix index (eviction is lazy)"

    def do_preempt(self, data) -> None:
        rid = data.draw(st.sampled_from(self.running()), label="request")
        t = self.reqs[rid]
        self.free_and_check_order(t)
        t.running = False
        t.cached_upto = 0
        t.req.num_computed_tokens = 0
        t.req.num_preemptions += 1
        t.req.spec_token_ids = []

    def do_finish(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)), label="request")
        t = self.reqs[rid]
        self.free_and_check_order(t)  # also covers aborting a waiting request (a no-op)
        del self.reqs[rid]
        self.history.append(list(t.req.all_token_ids[: min(t.req.num_tokens, MAX_PROMPT)]))

    def do_reset_prefix_cache(self, data) -> None:
        idle = all(b.ref_cnt == 0 for b in self.pool.blocks[1:])
        before = self.snapshot()
        ok = self.mgr.reset_prefix_cache()
        assert ok == idle, f"reset_prefix_cache returned {ok} with idle={idle}"
        if ok:
            assert len(self.pool.cached_block_hash_to_block) == 0, "index not cleared"
            assert all(b.block_hash is None for b in self.pool.blocks), "hash survived reset"
        else:
            assert self.snapshot() == before, "a refused reset changed the state"

    def teardown(self) -> None:
        for rid in sorted(self.reqs):
            self.mgr.free(self.reqs[rid].req)
        self.reqs.clear()
        self.check_free_queue()
        self.check_index()
        for b in self.pool.blocks[1:]:
            assert b.ref_cnt == 0, f"block {b.block_id} still referenced after all finished"
        assert self.pool.get_num_free_blocks() == self.num_blocks - 1, "blocks leaked"
        assert self.mgr.usage == 0.0
        for m in self.managers:
            assert not m.req_to_blocks and not m.num_cached_block, "manager state leaked"
        assert self.mgr.reset_prefix_cache(), "reset refused with every request finished"
        self.check_index()


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.name for c in CONFIGS])
def test_fuzz_allocator(cfg: FuzzConfig) -> None:
    machine = type(f"Machine_{cfg.name}", (AllocatorMachine,), {"CFG": cfg})
    run_state_machine_as_test(machine, settings=FUZZ_SETTINGS)
