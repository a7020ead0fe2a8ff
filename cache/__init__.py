"""Host-side KV-cache allocator mirroring vLLM v1's hybrid KV-cache coordinator.

Pure Python; never imports jax. Start with `cache.layout` (specs -> KV-cache groups and a
`KVCacheConfig`), then drive a `KVCacheManager` with `Request` objects.
"""

from cache.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from cache.kv_cache_manager import KVCacheBlocks, KVCacheManager, PrefixCacheStats
from cache.request import Request

__all__ = [
    "AllBlocksCleared",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheEvent",
    "KVCacheManager",
    "PrefixCacheStats",
    "Request",
]
