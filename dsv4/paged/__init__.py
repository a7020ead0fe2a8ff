"""Paged KV caches on device (vLLM's layout, in JAX).

* `records` — byte record formats of one cache state (f32, bf16, mxfp8, nvfp4, fp8_132, mxfp4,
  v4_584), bit-exact encode / decode, and `CacheFormats` (one record per cache kind, presets);
* `pools` — page pools built from a ``KVCacheConfig`` (`PoolLayout`, aliased or separate),
  typed reads and slot-mapped writes, host-side debug checks.
"""

from dsv4.paged import pools, records
from dsv4.paged.pools import (
    GroupPool,
    LayerPool,
    PoolLayout,
    cache_desc,
    check_block_ids,
    check_slots,
    config_pool_bytes,
    fill_blocks,
    init_pools,
    layer_kinds,
    read_blocks,
    read_layer,
    read_ring,
    write_layer,
    write_ring,
)
from dsv4.paged.records import CacheFormats, RecordFormat, get_record

__all__ = [
    "CacheFormats",
    "GroupPool",
    "LayerPool",
    "PoolLayout",
    "RecordFormat",
    "cache_desc",
    "check_block_ids",
    "check_slots",
    "config_pool_bytes",
    "fill_blocks",
    "get_record",
    "init_pools",
    "layer_kinds",
    "pools",
    "read_blocks",
    "read_layer",
    "read_ring",
    "records",
    "write_layer",
    "write_ring",
]
