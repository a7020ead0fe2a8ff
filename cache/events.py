"""KV-cache events, as vLLM publishes them for cache-aware routing.

Every event names the KV-cache group it concerns (``group_idx``), so a consumer can keep one
prefix index per group; replaying the events in order rebuilds the allocator's prefix index
(tests check exactly that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks of one group became cached in one ``cache_full_blocks`` call.

    ``block_hashes`` and ``block_ids`` (our addition) have one entry per newly hashed block (null
    and masked blocks add none); ``parent_block_hash`` is the hash of the block before the first
    (None at the start); ``token_ids`` spans all the call's blocks.
    """

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None]
    group_idx: int
    block_ids: list[int]
    kv_cache_spec_kind: str = ""
    kv_cache_spec_sliding_window: int | None = None
    medium: str = "GPU"


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """A cached block of group ``group_idx`` was evicted (one hash per event)."""

    block_hashes: list[bytes]
    group_idx: int
    block_ids: list[int]
    medium: str = "GPU"


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The prefix cache was reset."""

    medium: str = "GPU"


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
