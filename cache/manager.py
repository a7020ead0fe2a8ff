"""Alias of `cache.kv_cache_manager` (the README's former home of `KVCacheManager`)."""

from cache.kv_cache_manager import KVCacheBlocks, KVCacheManager, PrefixCacheStats

__all__ = ["KVCacheBlocks", "KVCacheManager", "PrefixCacheStats"]
