"""One manager per KV-cache group, by attention kind (vLLM's ``single_type_kv_cache_manager``).

A manager keeps each request's list of its group's blocks (entry i: tokens ``[i*B, (i+1)*B)``,
the null block where no longer needed); lists are append-only. Specs map to managers by exact
type (`SPEC_MANAGER_MAP`). See docs/allocator_internals.md, section 4.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar, NamedTuple

from cache import spec as specs
from cache.block_pool import BlockPool, KVCacheBlock
from cache.hashing import BlockHashes, resolve_block_hashes
from cache.request import Request
from cache.util import cdiv


def _cached_prefix_of_group(
    block_hashes: Sequence[bytes],
    max_length: int,
    block_size: int,
    group_id: int,
    block_pool: BlockPool,
) -> list[KVCacheBlock]:
    """One group's cached blocks from the start up to the first miss (at most ``max_length``).

    One dict lookup per block; keys are built lazily up to the first miss and memoised on the
    request (a waiting request is looked up again every step).
    """
    factor = block_size // block_pool.hash_block_size
    num_blocks = min(max_length // block_size, len(block_hashes) // factor)
    raw = block_pool.cached_block_hash_to_block.raw_get
    suffix = group_id.to_bytes(4, "big")
    memo = block_hashes.key_memo(factor, group_id) if isinstance(block_hashes, BlockHashes) else []
    num_memo = len(memo)
    join = b"".join
    out: list[KVCacheBlock] = []
    for i in range(num_blocks):
        if i < num_memo:
            key = memo[i]
        else:
            if factor == 1:
                key = block_hashes[i] + suffix
            elif factor == 2:  # (V4.1-Flash: 64-token blocks over 32-token hashes)
                key = block_hashes[2 * i] + block_hashes[2 * i + 1] + suffix
            else:
                key = join(block_hashes[i * factor : (i + 1) * factor]) + suffix
            memo.append(key)
            num_memo += 1
        block = raw(key)
        if block is None:
            break
        if block.__class__ is dict:  # duplicates under one key: take the first
            block = next(iter(block.values()))
        out.append(block)
    return out


def _extend_cached_prefix(
    computed: tuple[list[KVCacheBlock], ...],
    hashes: Sequence[bytes],
    start: int,
    stop: int,
    group_ids: Sequence[int],
    block_pool: BlockPool,
) -> None:
    """Appends every group's cached block for blocks ``start, start + 1, ...`` up to the first
    block that any group misses (or ``stop``)."""
    for i in range(start, stop):
        cached = block_pool.get_cached_block(hashes[i], group_ids)
        if cached is None:
            break
        for out, block in zip(computed, cached):
            out.append(block)


def _rightmost_aligned_run(
    hashes: Sequence[bytes],
    num_blocks: int,
    need: int,
    step: int,
    shift: int,
    group_ids: Sequence[int],
    block_pool: BlockPool,
) -> tuple[list[list[KVCacheBlock]], int]:
    """The rightmost run of ``need`` blocks cached in every group whose right end ``e`` has
    ``(e + shift) % step == 0``; else the longest cached prefix ending on such an ``e``.

    Returns the run right to left (one block per group per entry) and ``e`` (-1: no hit).
    vLLM scans every block right to left; visiting only aligned ends and jumping below each
    miss finds the same run with far fewer lookups when hits are sparse.
    """
    raw = block_pool.cached_block_hash_to_block.raw_get
    suffixes = [gid.to_bytes(4, "big") for gid in group_ids]
    e = num_blocks - 1
    e -= (e + shift) % step
    while e >= 0:
        run: list[list[KVCacheBlock]] = []
        j = e
        stop = e - need + 1 if e >= need - 1 else 0
        while j >= stop:
            h = hashes[j]
            cached = []
            for suffix in suffixes:  # `BlockPool.get_cached_block`, inlined: the hot probe
                block = raw(h + suffix)
                if block is None:
                    break
                if block.__class__ is dict:  # duplicates: the first one
                    block = next(iter(block.values()))
                cached.append(block)
            else:
                run.append(cached)
                j -= 1
                continue
            break
        else:
            return run, e
        e = j - 1
        e -= (e + shift) % step
    return [], -1


class HitQuery(NamedTuple):
    """One prefix-cache lookup, as `find_longest_cache_hit` is asked it, for a kind's scan."""

    block_hashes: Sequence[bytes]
    max_length: int
    group_ids: Sequence[int]
    block_pool: BlockPool
    kv_cache_spec: specs.KVCacheSpec
    block_size: int
    drop_eagle_block: bool
    alignment_tokens: int

    def hashes(self) -> Sequence[bytes]:
        """The request's hashes at this kind's block size."""
        return resolve_block_hashes(
            self.block_hashes, self.block_pool.hash_block_size, self.block_size
        )

    def no_hit(self) -> tuple[list[KVCacheBlock], ...]:
        """One empty block list per group."""
        return tuple([] for _ in self.group_ids)


class SingleTypeKVCacheManager:
    """Blocks of one KV-cache group for every request.

    Args:
        kv_cache_spec: the group's spec (its ``block_size`` and kind).
        block_pool: the pool shared by all groups.
        enable_caching: prefix caching on.
        kv_cache_group_id: this group's index.
        scheduler_block_size: lcm of all groups' block sizes; hits align to it.
        max_admission_blocks_per_request: window kinds' cap for the full-sequence admission check.
    """

    supports_prefix_caching: ClassVar[bool] = True
    # Whether `get_num_skipped_tokens` can be non-zero (window kinds), and whether
    # `remove_skipped_blocks` can free anything; lets the coordinator skip the others.
    skips_tokens: ClassVar[bool] = False
    frees_blocks: ClassVar[bool] = False
    # Blocks a request holds whatever its length (a ring), or 0 for per-token growth.
    fixed_num_blocks: ClassVar[int] = 0
    # Whether only some full blocks are indexed (`reachable_block_mask`, sliding windows).
    sparse_retention: ClassVar[bool] = False

    def __init__(
        self,
        kv_cache_spec: specs.KVCacheSpec,
        block_pool: BlockPool,
        enable_caching: bool,
        kv_cache_group_id: int,
        scheduler_block_size: int,
        max_admission_blocks_per_request: int | None = None,
    ) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size: int = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.enable_caching = enable_caching
        self.kv_cache_group_id = kv_cache_group_id
        self.scheduler_block_size = scheduler_block_size
        self.cache_hit_alignment_tokens = scheduler_block_size
        self.max_admission_blocks_per_request = max_admission_blocks_per_request
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Leading blocks already registered in the prefix index. A key here also marks the
        # request as allocated before (running), which selects the allocation fast path.
        self.num_cached_block: dict[str, int] = {}
        self._null_block = block_pool.null_block
        self.use_eagle = False
        # Whether `cache_blocks` can register something inside a not-yet-full block, and the
        # requests for which that is settled until their next block fills.
        self.caches_below_blocks = False
        self.tail_settled: set[str] = set()
        # Window kinds whose skipped tokens are ``n - skip_offset`` (see the coordinator).
        self.skip_offset: int | None = None

    # -- capacity -----------------------------------------------------------------------------

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        apply_admission_cap: bool = False,
    ) -> int:
        """Free blocks this group needs to give the request ``num_tokens`` slots.

        Hit blocks that are currently free (evictable) count too: touching them takes them out
        of the free queue. Hits that fall outside the window are not touched, so not counted.
        """
        num_required = self.fixed_num_blocks or cdiv(num_tokens, self.block_size)
        if apply_admission_cap and self.max_admission_blocks_per_request is not None:
            num_required = min(num_required, self.max_admission_blocks_per_request)
        req_blocks = self.req_to_blocks.get(request_id)
        num_req_blocks = len(req_blocks) if req_blocks else 0
        if request_id in self.num_cached_block:
            # Running request: no new hits. After rejected drafts it may hold more blocks
            # than it needs now; they are reused, so the difference can be negative.
            return max(num_required - num_req_blocks, 0)
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_local_blocks = len(new_computed_blocks) + num_req_blocks
        num_new = max(num_required - max(num_skipped_blocks, num_local_blocks), 0)
        first_kept = max(0, num_skipped_blocks - num_req_blocks)
        num_evictable = 0
        for block in new_computed_blocks[first_kept:]:
            if block.ref_cnt == 0 and not block.is_null:
                num_evictable += 1
        return num_new + num_evictable

    # -- allocation ---------------------------------------------------------------------------

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
    ) -> None:
        """Gives a new request its prefix hits: nulls for skipped positions, then the hits."""
        if self.fixed_num_blocks:
            return  # a ring takes no prefix hits
        if self.req_to_blocks.get(request_id):
            raise RuntimeError(
                f"request {request_id!r} already holds blocks in group {self.kv_cache_group_id}"
            )
        num_skipped_blocks = (
            self.get_num_skipped_tokens(num_local_computed_tokens) // self.block_size
        )
        kept = (
            new_computed_blocks[num_skipped_blocks:] if num_skipped_blocks else new_computed_blocks
        )
        if self.enable_caching:
            self.block_pool.touch(kept)
        elif any(not b.is_null for b in kept):
            raise RuntimeError("prefix hits given while prefix caching is disabled")
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        req_blocks.extend([self._null_block] * num_skipped_blocks)
        req_blocks.extend(kept)
        self.num_cached_block[request_id] = len(req_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Extends the request's list to ``cdiv(num_tokens, B)`` entries with fresh blocks."""
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new = (self.fixed_num_blocks or cdiv(num_tokens, self.block_size)) - len(req_blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        req_blocks.extend(new_blocks)
        return new_blocks

    # -- prefix caching -----------------------------------------------------------------------

    def cache_blocks(
        self,
        request: Request,
        num_tokens: int,
        retention_interval: int | None,
        replay_boundaries: Sequence[int],
    ) -> None:
        """Registers the request's newly full blocks (up to ``num_tokens``) in the prefix index.

        Where blocks are coarser than hashes (`caches_below_blocks`), also the prompt's last
        hash boundary inside a block.
        """
        request_id = request.request_id
        if self.supports_prefix_caching and self.kv_cache_spec.prefix_cacheable:
            num_cached = self.num_cached_block.get(request_id, 0)
            num_full = num_tokens // self.block_size
            if num_cached < num_full:
                mask = None  # index every block (dense kinds)
                if self.sparse_retention:
                    mask = self.reachable_block_mask(
                        num_cached, num_full, retention_interval, replay_boundaries
                    )
                self.block_pool.cache_full_blocks(
                    request,
                    self.req_to_blocks[request_id],
                    num_cached,
                    num_full,
                    self.block_size,
                    self.kv_cache_group_id,
                    mask,
                )
                self.num_cached_block[request_id] = num_full
        if self.caches_below_blocks:
            if self._cache_partial_tail_block(request, num_tokens):
                self.tail_settled.add(request_id)
            else:
                self.tail_settled.discard(request_id)

    def _cache_partial_tail_block(self, request: Request, num_tokens: int) -> bool:
        """Registers the prompt's last hash boundary when it ends inside one of our blocks.

        vLLM 0.32 does this for blocks coarser than the hash block (docs/allocator_internals.md,
        section 3). Returns whether nothing more can happen before the next block fills.
        """
        hash_block = self.block_pool.hash_block_size
        limit = request.num_prompt_tokens if self.use_eagle else request.num_prompt_tokens - 1
        boundary = limit // hash_block * hash_block
        if boundary == 0 or boundary % self.block_size == 0:
            return True
        if boundary > num_tokens:
            return False
        blocks = self.req_to_blocks.get(request.request_id)
        idx = boundary // self.block_size
        if blocks is None or idx >= len(blocks):
            return False
        self.block_pool.cache_partial_block(request, blocks[idx], boundary, self.kv_cache_group_id)
        return True

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[bytes],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: specs.KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Longest hit of at most ``max_length`` tokens common to all ``kv_cache_group_ids``.

        Returns one block list per group (nulls at skipped positions) and the hit length; the
        kind's `_longest_hit` does the scan.
        """
        query = HitQuery(
            block_hashes,
            max_length,
            kv_cache_group_ids,
            block_pool,
            kv_cache_spec,
            kv_cache_spec.block_size,
            drop_eagle_block,
            alignment_tokens,
        )
        return cls._longest_hit(query)

    @classmethod
    def _longest_hit(cls, q: HitQuery) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The kind's scan; by default no hit (kinds that are never prefix-cached)."""
        return q.no_hit(), 0

    # -- release ------------------------------------------------------------------------------

    def free(self, request_id: str) -> None:
        """Releases the request's blocks, tail first (tail blocks are evicted first)."""
        blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        self.tail_settled.discard(request_id)
        if not blocks:
            return
        if self.skips_tokens:
            # Window kinds: nulls only ever form a prefix, so stop at the first one.
            null = self._null_block
            live = []
            for block in reversed(blocks):
                if block is null:
                    break
                live.append(block)
            self.block_pool.free_blocks(live)
        else:
            self.block_pool.free_blocks(reversed(blocks))

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens no future query attends to (0 for full attention)."""
        return 0

    def remove_skipped_blocks(
        self, request_id: str, num_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Frees blocks wholly outside the attention window, replacing them by the null block.

        Walks from the last skipped block backwards and stops at the first null: earlier ones
        were nulled by an earlier call, so the cost is amortised O(newly skipped blocks).
        """
        num_skipped_tokens = self.get_num_skipped_tokens(num_computed_tokens)
        if num_skipped_tokens <= 0:
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        self.free_blocks_in_range(
            blocks, 0, min(num_skipped_tokens // self.block_size, len(blocks))
        )

    def free_blocks_in_range(self, blocks: list[KVCacheBlock], first: int, last: int) -> None:
        """Frees ``blocks[first:last]`` into nulls, walking back from the end to the first null
        (earlier ones were nulled before)."""
        null = self._null_block
        freed: list[KVCacheBlock] = []
        for i in range(min(last, len(blocks)) - 1, first - 1, -1):
            block = blocks[i]
            if block is null:
                break
            freed.append(block)
            blocks[i] = null
        if freed:
            self.block_pool.free_blocks(freed)


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention (and MLA): every block kept; hits are prefix-closed, scanned left to right."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.caches_below_blocks = self.block_size != self.block_pool.hash_block_size

    @classmethod
    def _longest_hit(cls, q: HitQuery) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        block_size = q.block_size
        computed: tuple[list[KVCacheBlock], ...]
        if len(q.group_ids) == 1 and block_size % q.block_pool.hash_block_size == 0:
            computed = (
                _cached_prefix_of_group(
                    q.block_hashes, q.max_length, block_size, q.group_ids[0], q.block_pool
                ),
            )
        else:
            hashes = q.hashes()
            computed = q.no_hit()
            stop = min(q.max_length // block_size, len(hashes))
            _extend_cached_prefix(computed, hashes, 0, stop, q.group_ids, q.block_pool)
        hit_length = len(computed[0]) * block_size
        if q.drop_eagle_block and hit_length > 0:
            hit_length -= min(q.alignment_tokens, block_size)
        hit_length -= hit_length % q.alignment_tokens
        keep = cdiv(hit_length, block_size)
        for out in computed:
            del out[keep:]
        return computed, hit_length


class SinkFullAttentionManager(FullAttentionManager):
    """Full attention with attention sinks; ``sink_len`` must be a whole number of blocks."""

    def __init__(self, kv_cache_spec: specs.KVCacheSpec, *args, **kwargs) -> None:
        super().__init__(kv_cache_spec, *args, **kwargs)
        sink_len = getattr(kv_cache_spec, "sink_len", None)
        if not sink_len or sink_len % self.block_size:
            raise ValueError(
                f"sink_len must be a positive multiple of the block size {self.block_size}, got {sink_len}"
            )


class RSWAManager(FullAttentionManager):
    """Reference sliding-window attention: keeps the prompt and the recent window.

    Blocks strictly between the end of the prompt and the start of the decode window are freed
    (replaced by nulls), bounding memory at prompt + window.
    """

    frees_blocks = True

    def remove_skipped_blocks(
        self, request_id: str, num_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        if num_prompt_tokens is None:
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        first_gap = cdiv(num_prompt_tokens, self.block_size)
        window_start = max(num_prompt_tokens, num_computed_tokens - self.kv_cache_spec.rswa_window)
        self.free_blocks_in_range(blocks, first_gap, window_start // self.block_size)


class SkippingManager(SingleTypeKVCacheManager):
    """Kinds whose queries skip leading tokens (windows, chunks): those blocks are freed."""

    skips_tokens = True
    frees_blocks = True


class SlidingWindowManager(SkippingManager):
    """Sliding-window attention: blocks before the window are freed; hits scanned right to left."""

    sparse_retention = True

    def __init__(self, kv_cache_spec: specs.KVCacheSpec, *args, **kwargs) -> None:
        super().__init__(kv_cache_spec, *args, **kwargs)
        self.sliding_window: int = kv_cache_spec.sliding_window
        self.extra_retained_tokens: int = getattr(kv_cache_spec, "extra_retained_tokens", 0)
        self.skip_offset = self.sliding_window - 1 + self.extra_retained_tokens

    @staticmethod
    def _contiguous_blocks_for_hit(window: int, block_size: int, use_eagle: bool) -> int:
        # The query token itself is in the window, so window - 1 earlier tokens are needed;
        # with EAGLE one more block is matched and then dropped.
        return cdiv(window - 1, block_size) + (1 if use_eagle else 0)

    @classmethod
    def _longest_hit(cls, q: HitQuery) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        block_size, alignment = q.block_size, q.alignment_tokens
        hashes = q.hashes()
        need = cls._contiguous_blocks_for_hit(
            q.kv_cache_spec.sliding_window, block_size, q.drop_eagle_block
        )
        max_num_blocks = min(q.max_length // block_size, len(hashes))
        # The run's right end e is aligned when ``(e + 1) * B`` (``e * B`` with the EAGLE drop)
        # is a multiple of the alignment; a shorter run is a prefix the window reaches before.
        need = max(need, 1)  # vLLM's scan always needs one cached block, even for window 1
        run, end = _rightmost_aligned_run(
            hashes,
            max_num_blocks,
            need,
            alignment // math.gcd(block_size, alignment),
            0 if q.drop_eagle_block else 1,
            q.group_ids,
            q.block_pool,
        )
        computed: tuple[list[KVCacheBlock], ...]
        if end < 0:
            computed = q.no_hit()
        else:
            run.reverse()
            lead = [q.block_pool.null_block] * (end + 1 - len(run))
            computed = tuple(lead + [blocks[g] for blocks in run] for g in range(len(run[0])))
            if len(run) < need:
                cls._pop_to_alignment(computed, block_size, alignment)
        if q.drop_eagle_block and computed[0]:
            for out in computed:
                out.pop()
            cls._pop_to_alignment(computed, block_size, alignment)
        return computed, len(computed[0]) * block_size

    @staticmethod
    def _pop_to_alignment(
        computed: tuple[list[KVCacheBlock], ...], block_size: int, alignment: int
    ) -> None:
        while block_size != alignment and (len(computed[0]) * block_size) % alignment:
            for out in computed:
                out.pop()

    def reachable_block_mask(
        self,
        start_block: int,
        end_block: int,
        retention_interval: int | None,
        replay_boundaries: Sequence[int],
    ) -> list[bool] | None:
        """Index only blocks that can end an aligned hit (vLLM's sparse window retention).

        Only the last ``need`` blocks of each aligned segment can serve a hit; which segments
        count depends on ``retention_interval`` (docs/allocator_internals.md, section 4).
        """
        alignment = self.cache_hit_alignment_tokens
        block_size = self.block_size
        if alignment % block_size:
            return None
        need = self._contiguous_blocks_for_hit(self.sliding_window, block_size, self.use_eagle)
        shift = 1 if self.use_eagle else 0
        mask = [False] * (end_block - start_block)
        segment = alignment if retention_interval is None else (retention_interval or None)
        if segment is not None:
            per_segment = segment // block_size
            if need >= per_segment:
                return None
            lo = per_segment - need
            for i in range(max(start_block, shift), end_block):
                if (i - shift) % per_segment >= lo:
                    mask[i - start_block] = True
        if retention_interval is not None:
            for boundary in replay_boundaries:
                end = boundary // alignment * alignment // block_size + shift
                for j in range(max(start_block, end - need), min(end_block, end)):
                    mask[j - start_block] = True
        return mask

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1 - self.extra_retained_tokens)


class ChunkedLocalAttentionManager(SkippingManager):
    """Chunked local attention: tokens attend within their chunk; earlier chunks are freed."""

    def __init__(self, kv_cache_spec: specs.KVCacheSpec, *args, **kwargs) -> None:
        super().__init__(kv_cache_spec, *args, **kwargs)
        self.attention_chunk_size: int = kv_cache_spec.attention_chunk_size

    @classmethod
    def _longest_hit(cls, q: HitQuery) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        block_size = q.block_size
        if q.drop_eagle_block:
            raise ValueError("EAGLE is not supported with chunked local attention")
        if block_size != q.alignment_tokens:
            raise ValueError(
                "chunked local attention needs every group to share its block size "
                f"({block_size}), got hit alignment {q.alignment_tokens}"
            )
        hashes = q.hashes()
        chunk = q.kv_cache_spec.attention_chunk_size
        max_length = q.max_length
        first_block = (max_length // chunk * chunk if max_length > 0 else 0) // block_size
        computed: tuple[list[KVCacheBlock], ...] = tuple(
            [q.block_pool.null_block] * first_block for _ in q.group_ids
        )
        stop = min(max_length // block_size, len(hashes))
        _extend_cached_prefix(computed, hashes, first_block, stop, q.group_ids, q.block_pool)
        return computed, len(computed[0]) * block_size

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size


class CrossAttentionManager(SingleTypeKVCacheManager):
    """Encoder-decoder cross attention: one static allocation per request, never cached."""

    supports_prefix_caching = False

    @classmethod
    def _longest_hit(cls, q: HitQuery) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        raise NotImplementedError("cross-attention KV is per request and never prefix-cached")


class CircularBufferManager(SingleTypeKVCacheManager):
    """A ring (V4.1's compressor state): one block per request for its whole life, never cached."""

    supports_prefix_caching = False
    fixed_num_blocks = 1


SPEC_MANAGER_MAP: dict[type, type[SingleTypeKVCacheManager]] = {
    specs.FullAttentionSpec: FullAttentionManager,
    specs.MLAAttentionSpec: FullAttentionManager,
    specs.HiddenStateCacheSpec: FullAttentionManager,
    specs.SinkFullAttentionSpec: SinkFullAttentionManager,
    specs.RSWASpec: RSWAManager,
    specs.SlidingWindowSpec: SlidingWindowManager,
    specs.SlidingWindowMLASpec: SlidingWindowManager,
    specs.ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
    specs.CrossAttentionSpec: CrossAttentionManager,
    specs.CircularBufferSpec: CircularBufferManager,
}


def allocator_spec(kv_cache_spec: specs.KVCacheSpec) -> specs.KVCacheSpec:
    """The spec the allocator acts on: a uniform-type group acts as its first member."""
    if isinstance(kv_cache_spec, specs.UniformTypeKVCacheSpecs):
        return next(iter(kv_cache_spec.kv_cache_specs.values()))
    return kv_cache_spec


def manager_class_for(kv_cache_spec: specs.KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    """The manager class registered for the spec's exact type."""
    spec = allocator_spec(kv_cache_spec)
    try:
        return SPEC_MANAGER_MAP[type(spec)]
    except KeyError:
        raise ValueError(
            f"no KV-cache manager is registered for {type(spec).__name__}; registered: "
            f"{sorted(t.__name__ for t in SPEC_MANAGER_MAP)}"
        ) from None


def get_manager_for_kv_cache_spec(
    kv_cache_spec: specs.KVCacheSpec,
    block_pool: BlockPool,
    enable_caching: bool,
    kv_cache_group_id: int,
    scheduler_block_size: int,
    max_model_len: int,
    max_num_batched_tokens: int,
) -> SingleTypeKVCacheManager:
    """Builds the manager of one group, with the admission cap for recycling kinds."""
    spec = allocator_spec(kv_cache_spec)
    cap = None
    if isinstance(spec, (specs.SlidingWindowSpec, specs.ChunkedLocalAttentionSpec)):
        cap = spec.max_admission_blocks_per_request(max_model_len, max_num_batched_tokens)
    return manager_class_for(spec)(
        spec,
        block_pool,
        enable_caching,
        kv_cache_group_id,
        scheduler_block_size,
        max_admission_blocks_per_request=cap,
    )
