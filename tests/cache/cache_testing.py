"""Small builders shared by the allocator tests."""

from __future__ import annotations

from collections.abc import Sequence

from cache import KVCacheManager, Request
from cache.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)

# vLLM's earlier ("baseline") behaviour, which the reference scenarios 1-33 are written for:
# freed blocks all go to the tail, and window groups index every aligned block.
BASELINE = {"unhashed_blocks_to_front": False, "prefix_cache_retention_interval": None}


def v4_rows(spec_type: type, block_size: int, row_bytes: int, **kw) -> KVCacheSpec:
    """A one-head DeepSeek-V4 cache spec of ``row_bytes``-wide rows (uint8, aligned to 576
    bytes, V4's model version unless ``kw`` names others)."""
    kw = {"dtype": "uint8", "alignment": 576, "model_version": "deepseek_v4"} | kw
    return spec_type(block_size=block_size, num_kv_heads=1, head_size=row_bytes, **kw)


def full(block_size: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=64, dtype="bfloat16")


def swa(block_size: int, window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size, num_kv_heads=1, head_size=64, dtype="bfloat16", sliding_window=window
    )


def chunked(block_size: int, chunk: int) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=64,
        dtype="bfloat16",
        attention_chunk_size=chunk,
    )


def config(
    groups: Sequence[KVCacheSpec], num_blocks: int, eagle: Sequence[int] = ()
) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([f"layer.{i}"], spec, is_eagle_group=i in eagle)
            for i, spec in enumerate(groups)
        ],
    )


def manager(
    groups: Sequence[KVCacheSpec], num_blocks: int, *, baseline: bool = True, **kwargs
) -> KVCacheManager:
    kwargs.setdefault("max_model_len", 8192)
    options = dict(BASELINE) if baseline else {}
    options.update(kwargs)
    return KVCacheManager(config(groups, num_blocks), **options)


def request(mgr: KVCacheManager, rid: str, tokens: Sequence[int], **kwargs) -> Request:
    return mgr.new_request(rid, list(tokens), **kwargs)


def ids(blocks) -> list[list[int]]:
    """Block ids per group of a KVCacheBlocks (or a tuple of block lists)."""
    groups = blocks.blocks if hasattr(blocks, "blocks") else blocks
    return [[b.block_id for b in g] for g in groups]


def free_ids(mgr: KVCacheManager) -> list[int]:
    return [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]


def admit(mgr: KVCacheManager, req: Request, num_new_tokens: int | None = None, **kwargs):
    """get_computed_blocks + allocate_slots for a new request; returns (hit tokens, new blocks)."""
    hits, num_hits = mgr.get_computed_blocks(req)
    n = req.num_tokens - num_hits if num_new_tokens is None else num_new_tokens
    new = mgr.allocate_slots(req, n, num_hits, hits, **kwargs)
    return hits, num_hits, new
