"""`KVCacheManager`: the scheduler's interface to the allocator (vLLM's ``kv_cache_manager.py``).

Every ``allocate_slots`` call either succeeds whole or returns None having changed nothing but
the frees of blocks that fell out of a window. The token layout of a call and its steps:
docs/allocator_internals.md, section 6.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from cache import spec as specs
from cache.block_pool import KVCacheBlock
from cache.coordinator import get_kv_cache_coordinator
from cache.events import KVCacheEvent
from cache.layout import resolve_kv_cache_block_sizes
from cache.request import Request
from cache.single_type_kv_cache_manager import allocator_spec


class KVCacheBlocks:
    """Blocks per KV-cache group: ``blocks[g][j]`` is group g's logical block j.

    Treated as immutable (the manager hands out one shared empty instance).
    """

    __slots__ = ("blocks",)

    def __init__(self, blocks: tuple[Sequence[KVCacheBlock], ...]) -> None:
        self.blocks = blocks

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(list(a) + list(b) for a, b in zip(self.blocks, other.blocks)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KVCacheBlocks):
            return NotImplemented
        return self.get_block_ids() == other.get_block_ids()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"KVCacheBlocks({self.get_block_ids()})"

    def get_block_ids(self, allow_none: bool = False) -> tuple[list[int], ...] | None:
        """Block ids per group; None with ``allow_none`` when every group is empty (vLLM's
        form for a running request that got no new block)."""
        if allow_none and not any(self.blocks):
            return None
        return tuple([[b.block_id for b in group] for group in self.blocks])

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of group 0's blocks that carry no hash (single-group callers)."""
        return [b.block_id for b in self.blocks[0] if b.block_hash is None]

    @property
    def num_blocks(self) -> int:
        return sum(len(g) for g in self.blocks)


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups since the last `KVCacheManager.make_prefix_cache_stats` call.

    ``queries`` and ``hits`` count tokens; requests that had been preempted are also counted
    separately (their hits are their own earlier work).
    """

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        """Hit tokens over queried tokens, new requests only (0 when nothing was queried)."""
        return self.hits / self.queries if self.queries else 0.0


def _check_count(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")


class KVCacheManager:
    """Allocates KV-cache blocks for requests across all KV-cache groups, with prefix caching.

    Its constructor's arguments (the config, lengths, caching switches and vLLM-version options):
    docs/allocator_internals.md, section 10.
    """

    def __init__(
        self,
        kv_cache_config: specs.KVCacheConfig,
        max_model_len: int,
        *,
        enable_caching: bool = True,
        hash_block_size: int | None = None,
        use_eagle: bool = False,
        enable_kv_cache_events: bool = False,
        max_num_batched_tokens: int | None = None,
        prefix_cache_retention_interval: int | None = 0,
        unhashed_blocks_to_front: bool = True,
        swa_bounded_replay: bool = False,
        watermark: float = 0.0,
        eagle_drop_once: bool = True,
        log_stats: bool = True,
        scheduler_block_size: int | None = None,
        max_in_flight_tokens: int | None = None,
    ) -> None:
        _check_limits(max_model_len, watermark)
        if swa_bounded_replay:
            kv_cache_config = _with_bounded_replay(kv_cache_config)
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.use_eagle = use_eagle
        self.enable_kv_cache_events = enable_kv_cache_events
        self.log_stats = log_stats
        self.scheduler_block_size, self.hash_block_size = _block_sizes(
            kv_cache_config, enable_caching, hash_block_size, scheduler_block_size
        )
        max_num_batched_tokens = _batch_budget(max_num_batched_tokens, max_in_flight_tokens)
        group_specs = [allocator_spec(g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups]
        self.num_replay_tokens_max = max((s.prefix_replay_tokens for s in group_specs), default=0)
        self.coordinator = get_kv_cache_coordinator(
            kv_cache_config,
            enable_caching=enable_caching,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens or max_model_len,
            use_eagle=use_eagle,
            enable_kv_cache_events=enable_kv_cache_events,
            scheduler_block_size=self.scheduler_block_size,
            hash_block_size=self.hash_block_size,
            prefix_cache_retention_interval=prefix_cache_retention_interval,
            unhashed_blocks_to_front=unhashed_blocks_to_front,
            group_metadata=[
                (_spec_kind(s), getattr(s, "sliding_window", None)) for s in group_specs
            ],
            eagle_drop_once=eagle_drop_once,
        )
        self.block_pool = self.coordinator.block_pool
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        self.prefix_cache_stats = PrefixCacheStats()
        self.empty_kv_cache_blocks = KVCacheBlocks(
            tuple(() for _ in range(self.num_kv_cache_groups))
        )

    # -- properties ---------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use (0.0 - 1.0)."""
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Returns the stats gathered since the last call and starts new ones."""
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def new_request(self, request_id: str, prompt_token_ids: Sequence[int], **kwargs) -> Request:
        """A `Request` hashed at this manager's granularity (when caching is on)."""
        if self.enable_caching:
            kwargs.setdefault("hash_block_size", self.hash_block_size)
        return Request(request_id, prompt_token_ids, **kwargs)

    # -- lookup -------------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest prefix-cache hit for a new request: (blocks per group, hit tokens).

        At most ``num_tokens - 1`` tokens hit (the last token is recomputed for its logits),
        aligned to the scheduler block size. No side effects on the allocator besides
        statistics; it sets ``request.shared_prefix_boundary`` as vLLM's scheduler does.
        """
        self._check_request(request)
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0
        if request.hash_block_size != self.hash_block_size:
            raise ValueError(
                f"request {request.request_id!r} is hashed every {request.hash_block_size} tokens "
                f"but this manager needs {self.hash_block_size}; create it with "
                "KVCacheManager.new_request or Request(..., hash_block_size=manager.hash_block_size)"
            )
        blocks, num_hits, num_uncached = self.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1
        )
        # The junction of a shared prefix that some window group has not cached yet: this
        # request keeps window state there so that siblings can hit it (vLLM 0.32).
        request.shared_prefix_boundary = num_hits + num_uncached if num_uncached else 0
        if self.num_replay_tokens_max and num_hits <= self.num_replay_tokens_max:
            blocks, num_hits = tuple([] for _ in blocks), 0
        if self.log_stats:
            self.prefix_cache_stats.record(
                request.num_tokens, num_hits, request.num_preemptions > 0
            )
        if num_hits == 0:
            return self.empty_kv_cache_blocks, 0
        return KVCacheBlocks(blocks), num_hits

    def num_replay_tokens(self, num_hit_tokens: int) -> int:
        """Hit tokens to recompute under bounded replay (0 when it is off)."""
        return min(self.num_replay_tokens_max, num_hit_tokens)

    # -- allocation ---------------------------------------------------------------------------

    # Over 60 lines: the fast path's checks and counts stay inline (one call per request per step).
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        *,
        num_encoder_tokens: int = 0,
        delay_cache_blocks: bool = False,
        full_sequence_must_fit: bool = False,
        has_scheduled_reqs: bool = True,
        reserved_blocks: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Gives the request slots for ``num_new_tokens`` more tokens (plus lookahead).

        Steps and arguments: docs/allocator_internals.md, sections 6 and 10.

        Returns:
            The newly allocated blocks per group, or None if the pool cannot supply them.
        """
        hit_blocks = None
        if (
            (type(request) is not Request and not isinstance(request, Request))  # subclasses too
            or new_computed_blocks is not None
            or type(num_new_tokens) is not int
            or type(num_new_computed_tokens) is not int
            or type(num_lookahead_tokens) is not int
            or type(num_encoder_tokens) is not int
            or num_new_tokens <= 0
            or num_new_computed_tokens
            or num_lookahead_tokens < 0
            or num_encoder_tokens
            or reserved_blocks
            or num_external_computed_tokens
        ):  # anything but a running request's next tokens: every check (inline: hot path)
            hit_blocks = self._check_allocation(
                request,
                num_new_tokens,
                num_new_computed_tokens,
                new_computed_blocks,
                num_lookahead_tokens,
                num_encoder_tokens,
                reserved_blocks,
                num_external_computed_tokens,
            )
        num_local_computed = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_main = num_local_computed + num_new_tokens
        if num_tokens_main > self.max_model_len:
            self._raise_too_long(request, num_local_computed, num_new_tokens)
        num_tokens_need_slot = num_tokens_main + num_lookahead_tokens
        if num_tokens_need_slot > self.max_model_len:
            num_tokens_need_slot = self.max_model_len
        watermark = reserved_blocks
        if self.watermark_blocks and has_scheduled_reqs and request.num_computed_tokens == 0:
            watermark += self.watermark_blocks
        num_tokens_to_cache = -1  # -1: register nothing; else only final tokens
        if self.enable_caching and not delay_cache_blocks:
            num_tokens_to_cache = len(request.all_token_ids)
            if num_tokens_main < num_tokens_to_cache:
                num_tokens_to_cache = num_tokens_main
        if hit_blocks is None and not full_sequence_must_fit and self.coordinator.plain_path:
            # The common step (decode, next prefill chunk, a first chunk without hits).
            new_blocks = self.coordinator.allocate_plain(
                request, num_local_computed, num_tokens_need_slot, num_tokens_to_cache, watermark
            )
            if new_blocks is None:
                return None
            if new_blocks is self.coordinator.no_new_blocks:
                return self.empty_kv_cache_blocks
            return KVCacheBlocks(new_blocks)
        if full_sequence_must_fit and not self._full_sequence_fits(
            request, hit_blocks, num_local_computed, num_encoder_tokens, watermark
        ):
            return None
        return self._allocate_general(
            request,
            hit_blocks,
            num_local_computed,
            num_tokens_need_slot,
            num_tokens_to_cache,
            num_encoder_tokens,
            watermark,
        )

    def _check_allocation(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: KVCacheBlocks | None,
        num_lookahead_tokens: int,
        num_encoder_tokens: int,
        reserved_blocks: int,
        num_external_computed_tokens: int,
    ) -> tuple[Sequence[KVCacheBlock], ...] | None:
        """Validates `allocate_slots`'s arguments; returns the hit blocks per group, or None
        when there are no hits."""
        if type(request) is not Request:
            self._check_request(request)
        if (
            type(num_new_tokens) is not int
            or type(num_new_computed_tokens) is not int
            or type(num_lookahead_tokens) is not int
            or type(num_encoder_tokens) is not int
            or num_new_tokens < 0
            or num_new_computed_tokens < 0
            or num_lookahead_tokens < 0
            or num_encoder_tokens < 0
        ):
            _check_count("num_new_tokens", num_new_tokens)
            _check_count("num_new_computed_tokens", num_new_computed_tokens)
            _check_count("num_lookahead_tokens", num_lookahead_tokens)
            _check_count("num_encoder_tokens", num_encoder_tokens)
        if num_new_tokens == 0 and num_new_computed_tokens == 0:
            raise ValueError("num_new_tokens must be > 0 when there are no new computed tokens")
        if num_external_computed_tokens:
            raise ValueError(
                f"num_external_computed_tokens={num_external_computed_tokens}: KV connectors are "
                "not supported; only 0 is allowed"
            )
        if reserved_blocks:
            _check_count("reserved_blocks", reserved_blocks)
        hit_blocks = None if new_computed_blocks is None else self._hits(new_computed_blocks)
        if (hit_blocks or num_new_computed_tokens) and self.coordinator.has_request(
            request.request_id
        ):
            raise ValueError(
                f"request {request.request_id!r} already holds blocks; prefix hits are only "
                "given at its first allocation"
            )
        return hit_blocks

    def _raise_too_long(self, request: Request, num_computed: int, num_new_tokens: int) -> None:
        raise ValueError(
            f"request {request.request_id!r} would reach {num_computed + num_new_tokens} tokens "
            f"({num_computed} computed + {num_new_tokens} new), over max_model_len="
            f"{self.max_model_len}"
        )

    def _hits(self, blocks: KVCacheBlocks) -> tuple[Sequence[KVCacheBlock], ...] | None:
        """The hit blocks per group, or None when every group's list is empty."""
        if len(blocks.blocks) != self.num_kv_cache_groups:
            raise ValueError(
                f"new_computed_blocks has {len(blocks.blocks)} groups, the manager has "
                f"{self.num_kv_cache_groups}"
            )
        return blocks.blocks if any(blocks.blocks) else None

    def _full_sequence_fits(
        self,
        request: Request,
        hit_blocks: tuple[Sequence[KVCacheBlock], ...] | None,
        num_local_computed: int,
        num_encoder_tokens: int,
        watermark: int,
    ) -> bool:
        """Whether the whole request fits, with the window kinds at their admission cap."""
        need = self.coordinator.get_num_blocks_to_allocate(
            request.request_id,
            min(request.num_tokens, self.max_model_len),
            hit_blocks or self.empty_kv_cache_blocks.blocks,
            num_local_computed,
            num_encoder_tokens,
            apply_admission_cap=True,
        )
        return need + watermark <= self.block_pool.get_num_free_blocks()

    def _allocate_general(
        self,
        request: Request,
        hit_blocks: tuple[Sequence[KVCacheBlock], ...] | None,
        num_local_computed: int,
        num_tokens_need_slot: int,
        num_tokens_to_cache: int,
        num_encoder_tokens: int,
        watermark: int,
    ) -> KVCacheBlocks | None:
        """`allocate_slots` step by step, as vLLM writes it: free what left a window, count,
        touch the hits, allocate, register full blocks."""
        coordinator = self.coordinator
        request_id = request.request_id
        # Blocks that left a window are freed before counting demand, so they can be reused
        # right away (vLLM does this even when the request then does not fit).
        coordinator.remove_skipped_blocks(
            request_id,
            max(0, num_local_computed - request.num_in_flight_tokens),
            request.num_prompt_tokens,
        )
        need = coordinator.get_num_blocks_to_allocate(
            request_id,
            num_tokens_need_slot,
            hit_blocks or self.empty_kv_cache_blocks.blocks,
            num_local_computed,
            num_encoder_tokens,
        )
        if need + watermark > self.block_pool.get_num_free_blocks():
            return None
        if hit_blocks is not None:
            coordinator.allocate_new_computed_blocks(request_id, hit_blocks, num_local_computed)
        new_blocks = coordinator.allocate_new_blocks(
            request_id, num_tokens_need_slot, num_encoder_tokens
        )
        if num_tokens_to_cache >= 0:
            coordinator.cache_blocks(request, num_tokens_to_cache)
        return self.create_kv_cache_blocks(new_blocks)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Registers the request's full blocks up to ``num_computed_tokens`` (after a delay)."""
        self._check_request(request)
        _check_count("num_computed_tokens", num_computed_tokens)
        if self.enable_caching:
            self.coordinator.cache_blocks(request, min(num_computed_tokens, request.num_tokens))

    # -- release ------------------------------------------------------------------------------

    def free(self, request: Request) -> None:
        """Releases the request's blocks, each group tail first. Unknown requests: no-op."""
        self._check_request(request)
        self.coordinator.free(request.request_id)

    def evict_blocks(self, block_ids: Sequence[int]) -> None:
        """Drops the prefix-index entries of the given blocks (they stay allocated)."""
        self.block_pool.evict_blocks(block_ids)
        for m in self.coordinator.single_type_managers:
            m.tail_settled.clear()  # a running request's tail entry may be gone: re-register
        self.coordinator.forget_quiet_limits()

    def reset_prefix_cache(self) -> bool:
        """Clears the prefix cache; only possible (returns True) when no block is in use."""
        ok = self.block_pool.reset_prefix_cache()
        if ok and self.log_stats:
            self.prefix_cache_stats.reset = True
        return ok

    def take_events(self) -> list[KVCacheEvent]:
        """Returns and clears the KV events recorded since the last call."""
        return self.block_pool.take_events()

    # -- views --------------------------------------------------------------------------------

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's blocks per group (nulls at freed window positions)."""
        if not self.coordinator.has_request(request_id):
            raise KeyError(
                f"request {request_id!r} holds no blocks (unknown, freed or never allocated)"
            )
        return KVCacheBlocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids per group (the block tables; 0 is the null block)."""
        return self.get_blocks(request_id).get_block_ids()

    def get_num_common_prefix_blocks(self, request_id: str) -> list[int]:
        """Zeros: vLLM 0.32 removed cascade attention and keeps this for old schedulers."""
        return [0] * self.num_kv_cache_groups

    def create_kv_cache_blocks(self, blocks: tuple[list[KVCacheBlock], ...]) -> KVCacheBlocks:
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    @staticmethod
    def _check_request(request: Request) -> None:
        if not isinstance(request, Request):
            raise TypeError(f"expected a cache.Request, got {type(request).__name__}")


def _check_limits(max_model_len: int, watermark: float) -> None:
    _check_count("max_model_len", max_model_len)
    if max_model_len == 0:
        raise ValueError("max_model_len must be positive")
    if not 0.0 <= watermark < 1.0:
        raise ValueError(f"watermark must be in [0, 1), got {watermark}")


def _block_sizes(
    kv_cache_config: specs.KVCacheConfig,
    enable_caching: bool,
    hash_block_size: int | None,
    scheduler_block_size: int | None,
) -> tuple[int, int]:
    """(scheduler block, hash block) of the config; a given scheduler block must match."""
    resolved = resolve_kv_cache_block_sizes(
        kv_cache_config, enable_caching=enable_caching, hash_block_size=hash_block_size
    )
    if scheduler_block_size is not None and scheduler_block_size != resolved[0]:
        raise ValueError(
            f"scheduler_block_size={scheduler_block_size} does not match this config's "
            f"{resolved[0]} (the lcm of its group block sizes)"
        )
    return resolved


def _batch_budget(
    max_num_batched_tokens: int | None, max_in_flight_tokens: int | None
) -> int | None:
    """The token budget from either of its two names (they must agree when both are given)."""
    if max_in_flight_tokens is None:
        return max_num_batched_tokens
    if max_num_batched_tokens is not None and max_num_batched_tokens != max_in_flight_tokens:
        raise ValueError(
            f"max_in_flight_tokens={max_in_flight_tokens} and max_num_batched_tokens="
            f"{max_num_batched_tokens} disagree; give one"
        )
    return max_in_flight_tokens


def _with_bounded_replay(config: specs.KVCacheConfig) -> specs.KVCacheConfig:
    """The config with every window-MLA group switched to bounded replay."""
    groups = []
    for g in config.kv_cache_groups:
        s = g.kv_cache_spec
        if isinstance(s, specs.SlidingWindowMLASpec):
            s = dataclasses.replace(s, bounded_replay=True)
        elif isinstance(s, specs.UniformTypeKVCacheSpecs):
            members = {
                name: dataclasses.replace(m, bounded_replay=True)
                if isinstance(m, specs.SlidingWindowMLASpec)
                else m
                for name, m in s.kv_cache_specs.items()
            }
            s = dataclasses.replace(s, kv_cache_specs=members)
        groups.append(dataclasses.replace(g, kv_cache_spec=s))
    return dataclasses.replace(config, kv_cache_groups=groups)


def _spec_kind(spec: specs.KVCacheSpec) -> str:
    """vLLM's spec-kind name for events (e.g. ``mla_attention``, ``sliding_window_mla``)."""
    name = type(spec).__name__.removesuffix("Spec")
    out = []
    for i, ch in enumerate(name):
        if ch.isupper() and i and not name[i - 1].isupper():
            out.append("_")
        out.append(ch.lower())
    return "".join(out)


__all__ = ["KVCacheBlocks", "KVCacheManager", "PrefixCacheStats"]
