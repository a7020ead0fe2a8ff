"""Coordinators: fan every allocator operation out to the groups' managers, and find the
longest prefix-cache hit common to all groups (vLLM's ``kv_cache_coordinator.py``).

One class per case: caching off, one group, several groups (an iterative fixed point over the
groups' lookups). See docs/allocator_internals.md, section 5.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from cache import spec as specs
from cache.block_pool import BlockPool, KVCacheBlock
from cache.request import Request
from cache.single_type_kv_cache_manager import (
    CrossAttentionManager,
    SingleTypeKVCacheManager,
    allocator_spec,
    get_manager_for_kv_cache_spec,
)


def replay_boundaries(
    num_prompt_tokens: int, scheduler_block_size: int, use_eagle: bool
) -> tuple[int, ...]:
    """Token positions a later request repeating this prompt can resume at.

    A resend of the same prompt is capped at ``num_prompt_tokens - 1`` (its last token is
    recomputed for logits). With EAGLE the groups match one block past a boundary and drop it,
    so the boundaries are one block lower, for a resend and for a longer sibling alike.
    """
    if not use_eagle:
        return (num_prompt_tokens - 1,)
    block = scheduler_block_size
    resend = (num_prompt_tokens - 1) // block * block
    extension = num_prompt_tokens // block * block
    return tuple(sorted({max(resend - block, 0), max(extension - block, 0)}))


def validate_retention_interval(
    retention_interval: int | None,
    scheduler_block_size: int,
    groups: Sequence[specs.KVCacheGroupSpec],
) -> None:
    """``prefix_cache_retention_interval``: None (dense), 0, or a multiple of the scheduler block."""
    if retention_interval is None:
        return
    if not isinstance(retention_interval, int) or retention_interval < 0:
        raise ValueError(
            f"prefix_cache_retention_interval must be None or an int >= 0, got {retention_interval!r}"
        )
    has_window = any(
        isinstance(allocator_spec(g.kv_cache_spec), specs.SlidingWindowSpec) for g in groups
    )
    if not has_window:
        if retention_interval:
            raise ValueError(
                f"prefix_cache_retention_interval={retention_interval} has no effect: no "
                "sliding-window KV-cache group; set it to 0"
            )
        return
    if retention_interval % scheduler_block_size:
        raise ValueError(
            f"prefix_cache_retention_interval ({retention_interval}) must be a multiple of the "
            f"scheduler block size ({scheduler_block_size})"
        )


def _check_scheduler_block_size(
    scheduler_block_size: int, groups: Sequence[specs.KVCacheGroupSpec]
) -> None:
    for g in groups:
        if scheduler_block_size % g.kv_cache_spec.block_size:
            raise ValueError(
                f"scheduler block size {scheduler_block_size} is not a multiple of a group's "
                f"block size {g.kv_cache_spec.block_size}"
            )


def _eagle_group_ids(groups: Sequence[specs.KVCacheGroupSpec], use_eagle: bool) -> set[int]:
    """The groups marked ``is_eagle_group``; with ``use_eagle`` and none marked, all of them."""
    marked = {i for i, g in enumerate(groups) if getattr(g, "is_eagle_group", False)}
    if use_eagle and not marked:
        return set(range(len(groups)))
    return marked


_UNBOUNDED = 1 << 62  # above any token count


class KVCacheCoordinator:
    """Owns the block pool and one manager per group; fans operations out to them."""

    def __init__(
        self,
        kv_cache_config: specs.KVCacheConfig,
        max_model_len: int,
        max_num_batched_tokens: int,
        use_eagle: bool,
        enable_caching: bool,
        enable_kv_cache_events: bool,
        scheduler_block_size: int,
        hash_block_size: int,
        prefix_cache_retention_interval: int | None,
        unhashed_blocks_to_front: bool,
        group_metadata: Sequence[tuple[str, int | None]],
        eagle_drop_once: bool = True,
    ) -> None:
        self.kv_cache_config = kv_cache_config
        self.eagle_drop_once = eagle_drop_once
        groups = kv_cache_config.kv_cache_groups
        _check_scheduler_block_size(scheduler_block_size, groups)
        self.scheduler_block_size = scheduler_block_size
        self.hash_block_size = hash_block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(
            kv_cache_config.num_blocks,
            enable_caching,
            hash_block_size,
            enable_kv_cache_events,
            unhashed_blocks_to_front=unhashed_blocks_to_front,
            group_metadata=group_metadata,
        )
        self.eagle_group_ids = _eagle_group_ids(groups, use_eagle)
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            get_manager_for_kv_cache_spec(
                g.kv_cache_spec,
                self.block_pool,
                enable_caching,
                i,
                scheduler_block_size,
                max_model_len,
                max_num_batched_tokens,
            )
            for i, g in enumerate(groups)
        )
        validate_retention_interval(prefix_cache_retention_interval, scheduler_block_size, groups)
        self.retention_interval = prefix_cache_retention_interval
        managers = self.single_type_managers
        self.plain_path = not any(isinstance(m, CrossAttentionManager) for m in managers)
        self._caching = tuple(
            m
            for m in managers
            if m.enable_caching and m.supports_prefix_caching and m.kv_cache_spec.prefix_cacheable
        )
        # Hybrid layouts register blocks only up to a scheduler-block boundary (see
        # `get_num_cacheable_tokens`); 0 = no alignment.
        self._cache_alignment = 0
        self._build_plans()

    def allocate_plain(
        self,
        request: Request,
        num_computed_tokens: int,
        num_tokens_need_slot: int,
        num_tokens_to_cache: int,
        reserved_blocks: int,
    ) -> tuple[Sequence[KVCacheBlock], ...] | None:
        """`KVCacheManager.allocate_slots` for a request taking no new prefix hits, fused.

        Frees what left a window, checks capacity, allocates, then registers full blocks up to
        ``num_tokens_to_cache`` (-1: none): the per-manager steps' decisions in one pass, since
        this runs for every request in every step (docs/allocator_internals.md, section 5).
        """
        rid = request.request_id
        processed = num_computed_tokens - request.num_in_flight_tokens
        if processed < 0:
            processed = 0
        quiet = self._quiet.get(rid)
        if quiet is not None:
            if (
                num_tokens_need_slot < quiet[0]
                and processed < quiet[1]
                and num_tokens_to_cache < quiet[2]
                and reserved_blocks <= self.block_pool.free_block_queue.num_free_blocks
            ):
                # Nothing to free, allocate or register below these limits (`_quiet_limits`);
                # the request's tables are as the call that set them left them.
                return self.no_new_blocks
            del self._quiet[rid]
        if self._freeing:
            self._free_skipped_plain(rid, processed, request.num_prompt_tokens)
        need, todo = self._plain_demand(rid, num_computed_tokens, num_tokens_need_slot)
        if need + reserved_blocks > self.block_pool.free_block_queue.num_free_blocks:
            return None
        new_blocks = self.no_new_blocks if todo is None else self._take_new_blocks(rid, todo)
        if num_tokens_to_cache >= 0 and self._caching:
            self._cache_plain(request, num_tokens_to_cache)
        if self._quiet_ok:
            limits = self._quiet_limits(rid, processed)
            if limits is not None:
                self._quiet[rid] = limits
        return new_blocks

    def _plain_demand(
        self, rid: str, num_computed_tokens: int, num_tokens_need_slot: int
    ) -> tuple[int, list[tuple[int, dict, int]] | None]:
        """`get_num_blocks_to_allocate` of every group without hits: (free blocks needed, the
        (group, tables, blocks to add) of each group that grows, or None when none does)."""
        need = 0
        todo = None
        for i, m, tables, block_size, fixed, skips, cached in self._plan:
            blocks = tables.get(rid)
            held = len(blocks) if blocks else 0
            required = fixed or -(-num_tokens_need_slot // block_size)
            if required <= held:
                continue
            if todo is None:
                todo = []
            todo.append((i, tables, required - held))
            if skips and rid not in cached:
                skipped = m.get_num_skipped_tokens(num_computed_tokens) // block_size
                if skipped > held:
                    held = skipped
                if required > held:
                    need += required - held
            else:
                need += required - held
        return need, todo

    def _free_skipped_plain(self, rid: str, processed: int, num_prompt_tokens: int) -> None:
        """`remove_skipped_blocks` of every freeing group, by its skip offset where it has one."""
        null = self.block_pool.null_block
        for m, tables, block_size, offset in self._freeing:
            if offset is None:
                m.remove_skipped_blocks(rid, processed, num_prompt_tokens)
                continue
            blocks = tables.get(rid)
            if not blocks:
                continue
            num_skipped = (processed - offset) // block_size
            if num_skipped <= 0:
                continue
            if num_skipped > len(blocks):
                num_skipped = len(blocks)
            if blocks[num_skipped - 1] is not null:
                m.free_blocks_in_range(blocks, 0, num_skipped)

    def _take_new_blocks(
        self, rid: str, todo: list[tuple[int, dict, int]]
    ) -> tuple[Sequence[KVCacheBlock], ...]:
        """`allocate_new_blocks` for the groups `allocate_plain` found growing."""
        new_blocks = list(self.no_new_blocks)
        for i, tables, k in todo:
            new = self.block_pool.get_new_blocks(k)
            blocks = tables.get(rid)
            if blocks is None:
                tables[rid] = new[:]
            else:
                blocks.extend(new)
            new_blocks[i] = new
        return tuple(new_blocks)

    def _cache_plain(self, request: Request, num_tokens_to_cache: int) -> None:
        """`cache_blocks`, asking only the groups that gained a block to register."""
        rid = request.request_id
        align = self._cache_alignment
        boundaries = None
        for m, cached, block_size, use_eagle, below, settled in self._cache_plan:
            n = num_tokens_to_cache
            if align:
                aligned = n // align * align
                n = min(n, aligned + block_size) if use_eagle and aligned else aligned
            if n // block_size > cached.get(rid, 0) or (below and rid not in settled):
                if boundaries is None:
                    boundaries = self._boundaries(request)
                m.cache_blocks(request, n, self.retention_interval, boundaries)

    def _quiet_limits(self, rid: str, processed: int) -> tuple[int, int, int] | None:
        """Bounds under which `allocate_plain` for ``rid`` has nothing to do, from its tables
        as they are now: (slots needed, processed tokens, tokens to cache), each exclusive.

        Every other coordinator method drops them (docs/allocator_internals.md, section 5).
        """
        slots = _UNBOUNDED
        for _, _, tables, block_size, fixed, _, _ in self._plan:
            blocks = tables.get(rid)
            held = len(blocks) if blocks else 0
            if fixed:
                if fixed > held:
                    return None
                continue
            limit = held * block_size + 1  # the first slot count that needs another block
            if limit < slots:
                slots = limit
        proc = _UNBOUNDED
        null = self.block_pool.null_block
        for _, tables, block_size, offset in self._freeing:
            blocks = tables.get(rid)
            if not blocks:
                continue
            skipped = (processed - offset) // block_size
            if skipped < 0:
                skipped = 0
            elif skipped > len(blocks):
                skipped = len(blocks)
            if skipped and blocks[skipped - 1] is not null:
                return None
            # entries below `skipped` are null (nulls form a prefix): the next block leaves
            # the window when the processed tokens skip one more block
            limit = offset + (skipped + 1) * block_size
            if limit < proc:
                proc = limit
        cache = _UNBOUNDED
        align = self._cache_alignment
        for _, cached, block_size, use_eagle, below, settled in self._cache_plan:
            if use_eagle or (below and rid not in settled):
                return None
            target = (cached.get(rid, 0) + 1) * block_size  # a cacheable prefix this long
            if align:
                target = -(-target // align) * align
            if target < cache:
                cache = target
        return slots, proc, cache

    def forget_quiet_limits(self) -> None:
        """Drops every request's `_quiet_limits` (for changes outside the request's own
        calls, e.g. `KVCacheManager.evict_blocks` unsettling prompt-tail entries)."""
        self._quiet.clear()

    def _build_plans(self) -> None:
        """Per-manager constants of the fused path (refreshed when EAGLE flags change)."""
        managers = self.single_type_managers
        # request id -> `_quiet_limits`; only where every freeing kind skips by an offset
        self._quiet: dict[str, tuple[int, int, int]] = {}
        self._quiet_ok = all(m.skip_offset is not None for m in managers if m.frees_blocks)
        self.no_new_blocks = tuple(() for _ in managers)
        self._freeing = tuple(
            (m, m.req_to_blocks, m.block_size, m.skip_offset) for m in managers if m.frees_blocks
        )
        self._plan = tuple(
            (
                i,
                m,
                m.req_to_blocks,
                m.block_size,
                m.fixed_num_blocks,
                m.skips_tokens,
                m.num_cached_block,
            )
            for i, m in enumerate(managers)
        )
        self._cache_plan = tuple(
            (
                m,
                m.num_cached_block,
                m.block_size,
                m.use_eagle,
                m.caches_below_blocks,
                m.tail_settled,
            )
            for m in self._caching
        )

    def _boundaries(self, request: Request) -> tuple[int, ...]:
        boundaries = replay_boundaries(
            request.num_prompt_tokens, self.scheduler_block_size, bool(self.eagle_group_ids)
        )
        if request.shared_prefix_boundary:
            # vLLM 0.32 keeps window state at a shared-prefix junction too (see
            # `KVCacheManager.get_computed_blocks`), so siblings can hit there.
            boundaries = (*boundaries, request.shared_prefix_boundary)
        return boundaries

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        total_computed_tokens: int,
        num_encoder_tokens: int = 0,
        apply_admission_cap: bool = False,
    ) -> int:
        total = 0
        for i, manager in enumerate(self.single_type_managers):
            if isinstance(manager, CrossAttentionManager):
                total += manager.get_num_blocks_to_allocate(
                    request_id, num_encoder_tokens, (), 0, apply_admission_cap
                )
            else:
                total += manager.get_num_blocks_to_allocate(
                    request_id,
                    num_tokens,
                    new_computed_blocks[i],
                    total_computed_tokens,
                    apply_admission_cap,
                )
        return total

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        num_local_computed_tokens: int,
    ) -> None:
        """Touches every group's hits (all groups first, then nothing else can evict them)."""
        self._quiet.pop(request_id, None)
        managers = self.single_type_managers
        if any(request_id in m.num_cached_block for m in managers):
            if any(new_computed_blocks):
                raise ValueError(
                    f"request {request_id!r} is running; it cannot take new prefix hits"
                )
            return
        for manager, blocks in zip(managers, new_computed_blocks):
            manager.add_local_computed_blocks(request_id, blocks, num_local_computed_tokens)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_encoder_tokens: int = 0
    ) -> tuple[list[KVCacheBlock], ...]:
        self._quiet.pop(request_id, None)
        return tuple(
            m.allocate_new_blocks(
                request_id,
                num_encoder_tokens if isinstance(m, CrossAttentionManager) else num_tokens,
            )
            for m in self.single_type_managers
        )

    def get_num_cacheable_tokens(
        self, num_computed_tokens: int, manager: SingleTypeKVCacheManager
    ) -> int:
        """The prefix of ``num_computed_tokens`` a group registers in the prefix index.

        Hybrid layouts (vLLM 0.32): hits land on scheduler-block boundaries, so blocks are
        registered only up to one; an EAGLE group keeps one block more (it matches one block
        past a hit, then drops it).
        """
        align = self._cache_alignment
        if not align:
            return num_computed_tokens
        aligned = num_computed_tokens // align * align
        if manager.use_eagle and aligned > 0:
            return min(num_computed_tokens, aligned + manager.block_size)
        return aligned

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        self._quiet.pop(request.request_id, None)
        boundaries = self._boundaries(request)
        for manager in self.single_type_managers:
            if manager.enable_caching:
                manager.cache_blocks(
                    request,
                    self.get_num_cacheable_tokens(num_computed_tokens, manager),
                    self.retention_interval,
                    boundaries,
                )

    def free(self, request_id: str) -> None:
        self._quiet.pop(request_id, None)
        for manager in self.single_type_managers:
            manager.free(request_id)

    def remove_skipped_blocks(
        self, request_id: str, num_computed_tokens: int, num_prompt_tokens: int
    ) -> None:
        self._quiet.pop(request_id, None)
        for manager in self.single_type_managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens, num_prompt_tokens)

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return tuple(m.req_to_blocks.get(request_id) or [] for m in self.single_type_managers)

    def has_request(self, request_id: str) -> bool:
        return any(request_id in m.req_to_blocks for m in self.single_type_managers)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int, int]:
        """(hit blocks per group, hit tokens, uncached shared-prefix tokens).

        The last value is how much longer the longest single-group hit was than the common
        one: a shared prefix some window group has not cached (0 unless hybrid).
        """
        raise NotImplementedError


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Prefix caching off: any number of groups (even none), never a hit."""

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int, int]:
        return tuple([] for _ in self.single_type_managers), 0, 0


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """Exactly one group; hashes are at its block size."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        manager = self.single_type_managers[0]
        if self.hash_block_size != manager.block_size:
            raise ValueError(
                f"one KV-cache group of block size {manager.block_size} needs hash_block_size "
                f"equal to it, got {self.hash_block_size}"
            )
        manager.use_eagle = 0 in self.eagle_group_ids
        self._spec = manager.kv_cache_spec
        self._build_plans()

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int, int]:
        manager = self.single_type_managers[0]
        if not manager.supports_prefix_caching or not self._spec.prefix_cacheable:
            return ([],), 0, 0
        blocks, length = manager.find_longest_cache_hit(
            block_hashes,
            max_cache_hit_length,
            (0,),
            self.block_pool,
            self._spec,
            manager.use_eagle,
            manager.block_size,
        )
        return blocks, length, 0


class SpecGroup(NamedTuple):
    """Groups sharing one spec: looked up together (a hit must exist in every member)."""

    spec: specs.KVCacheSpec
    group_ids: list[int]
    manager_cls: type[SingleTypeKVCacheManager]
    use_eagle: bool


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several groups; the common hit is found by an iterative fixed point.

    Each pass asks every attention group for its longest hit not above the current candidate,
    until none lowers it; EAGLE groups drop a block at most once per candidate length with
    ``eagle_drop_once`` (vLLM 0.32). See docs/allocator_internals.md, section 5.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        groups = self.kv_cache_config.kv_cache_groups
        cacheable = [
            i
            for i, m in enumerate(self.single_type_managers)
            if m.supports_prefix_caching and m.kv_cache_spec.prefix_cacheable
        ]
        for i in cacheable:
            block_size = self.single_type_managers[i].block_size
            if block_size % self.hash_block_size:
                raise ValueError(
                    f"group {i}'s block size {block_size} is not a multiple of the hash block "
                    f"size {self.hash_block_size}"
                )
        self.attention_groups: list[SpecGroup] = []
        for i in cacheable:
            manager = self.single_type_managers[i]
            use_eagle = i in self.eagle_group_ids
            for k, group in enumerate(self.attention_groups):
                if group.spec == manager.kv_cache_spec and group.manager_cls is type(manager):
                    group.group_ids.append(i)
                    if use_eagle and not group.use_eagle:
                        self.attention_groups[k] = group._replace(use_eagle=True)
                    break
            else:
                self.attention_groups.append(
                    SpecGroup(manager.kv_cache_spec, [i], type(manager), use_eagle)
                )
        if not self.attention_groups:
            raise ValueError(
                f"prefix caching needs at least one prefix-cacheable KV-cache group; groups: "
                f"{[type(g.kv_cache_spec).__name__ for g in groups]}"
            )
        self._cache_alignment = self.scheduler_block_size
        # Full attention first: its cheap left-to-right scan gives a tight first bound.
        self.attention_groups.sort(key=lambda g: not isinstance(g.spec, specs.FullAttentionSpec))
        for group in self.attention_groups:
            if group.use_eagle:
                for gid in group.group_ids:
                    self.single_type_managers[gid].use_eagle = True
        self._build_plans()

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int, int]:
        num_groups = len(self.single_type_managers)
        hit_blocks: list[list[KVCacheBlock] | None] = [None] * num_groups
        hit_lengths = [0] * num_groups
        groups = self.attention_groups
        is_simple_hybrid = len(groups) == 2 and isinstance(groups[0].spec, specs.FullAttentionSpec)
        alignment = self.scheduler_block_size
        hash_tokens = len(block_hashes) * self.hash_block_size
        eagle_verified: set[int] = set()
        hit_length = max_cache_hit_length
        longest = 0
        while True:
            cur = hit_length
            for idx, (spec, group_ids, manager_cls, use_eagle) in enumerate(groups):
                first = group_ids[0]
                if isinstance(spec, specs.FullAttentionSpec) and hit_blocks[first] is not None:
                    cur = min(cur, hit_lengths[first])
                    continue
                if not self.eagle_drop_once:
                    drop, max_length = use_eagle, cur
                else:
                    drop = use_eagle and idx not in eagle_verified
                    max_length = min(cur + spec.block_size, hash_tokens) if drop else cur
                blocks, new_length = manager_cls.find_longest_cache_hit(
                    block_hashes, max_length, group_ids, self.block_pool, spec, drop, alignment
                )
                if drop:
                    eagle_verified.add(idx)
                elif new_length < cur:
                    eagle_verified.clear()
                cur = new_length
                for gid, b in zip(group_ids, blocks):
                    hit_blocks[gid] = b
                    hit_lengths[gid] = new_length
                longest = max(longest, cur)
            if cur >= hit_length:
                break
            hit_length = cur
            if is_simple_hybrid:
                break
        for group in groups:
            if isinstance(group.spec, specs.FullAttentionSpec):
                keep = -(-hit_length // group.spec.block_size)
                for gid in group.group_ids:
                    if hit_blocks[gid] is not None:
                        del hit_blocks[gid][keep:]
        blocks_out = tuple(b if b is not None else [] for b in hit_blocks)
        return blocks_out, hit_length, longest - hit_length


def get_kv_cache_coordinator(
    kv_cache_config: specs.KVCacheConfig, *, enable_caching: bool, **kwargs
) -> KVCacheCoordinator:
    """The coordinator vLLM would pick for this config."""
    if not enable_caching:
        cls: type[KVCacheCoordinator] = KVCacheCoordinatorNoPrefixCache
    elif len(kv_cache_config.kv_cache_groups) == 1:
        cls = UnitaryKVCacheCoordinator
    else:
        cls = HybridKVCacheCoordinator
    return cls(kv_cache_config, enable_caching=enable_caching, **kwargs)
