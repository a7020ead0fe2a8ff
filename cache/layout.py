"""Grouping layers into KV-cache groups, sizing the shared block pool, and the V4.1 layout.

Pure data: the result, a ``KVCacheConfig``, is what the allocator manages and what the device
side reads to build its page arrays. Grouping follows vLLM's decision tree; sizing shares one
pool of blocks between all groups. See docs/allocator_internals.md, section 8.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from cache.spec import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    iter_layer_specs,
)
from cache.util import cdiv

# Block size vLLM's cache config starts from; used when a model has no cache groups at all.
DEFAULT_BLOCK_SIZE = 16

# ---------------------------------------------------------------------------------------------
# Grouping
# ---------------------------------------------------------------------------------------------


def is_kv_cache_spec_uniform(specs: Mapping[str, KVCacheSpec]) -> bool:
    """Whether all layers can share one merged spec (no layers counts as uniform)."""
    if not specs:
        return True
    values = list(specs.values())
    try:
        type(values[0]).merge(values)
    except ValueError:
        return False
    return True


def create_kv_cache_group_specs(
    specs: Mapping[str, KVCacheSpec], grouped_layer_names: list[list[str]]
) -> list[KVCacheGroupSpec]:
    """One group per list of layer names, with the merged spec of its layers."""
    groups = []
    for names in grouped_layer_names:
        layer_specs = [specs[name] for name in names]
        groups.append(KVCacheGroupSpec(list(names), type(layer_specs[0]).merge(layer_specs)))
    return groups


def unify_hybrid_kv_cache_specs(specs: Mapping[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """Rewrite local-attention specs as full attention (hybrid manager disabled).

    Sliding window -> ``FullAttentionSpec(sliding_window=W)``, chunked local ->
    ``FullAttentionSpec(attention_chunk_size=C)``, SWA-MLA -> ``MLAAttentionSpec`` with the full
    layers' block size: every token keeps a block; only compute stays local.

    Raises:
        ValueError: if the rewritten specs still are not of one type.
    """
    specs = dict(specs)
    if is_kv_cache_spec_uniform(specs) or UniformTypeKVCacheSpecs.is_uniform_type(specs):
        return specs
    values = specs.values()
    has_full = any(isinstance(s, FullAttentionSpec) for s in values)
    has_local = any(isinstance(s, (SlidingWindowSpec, ChunkedLocalAttentionSpec)) for s in values)
    if has_full and has_local:
        full_sizes = {s.block_size for s in values if isinstance(s, FullAttentionSpec)}
        full_block = next(iter(full_sizes)) if len(full_sizes) == 1 else None
        specs = {name: _promote_to_full(spec, full_block) for name, spec in specs.items()}
    if not (is_kv_cache_spec_uniform(specs) or UniformTypeKVCacheSpecs.is_uniform_type(specs)):
        kinds = sorted({type(s).__name__ for s in specs.values()})
        raise ValueError(
            "Hybrid KV-cache manager is disabled but these specs cannot be unified into one "
            f"type: {kinds}"
        )
    return specs


def _promote_to_full(spec: KVCacheSpec, full_block_size: int | None) -> KVCacheSpec:
    if isinstance(spec, SlidingWindowMLASpec):
        target, keep = MLAAttentionSpec, {"sliding_window"}
    elif isinstance(spec, SlidingWindowSpec):
        target, keep = FullAttentionSpec, {"sliding_window"}
    elif isinstance(spec, ChunkedLocalAttentionSpec):
        target, keep = FullAttentionSpec, {"attention_chunk_size"}
    else:
        return spec
    block_size = full_block_size or spec.block_size
    shared = {f.name for f in dataclasses.fields(AttentionSpec)} | keep
    if target is MLAAttentionSpec:
        shared |= {"cache_dtype_str", "alignment", "model_version"}
    kwargs = {name: getattr(spec, name) for name in shared}
    kwargs["block_size"] = block_size
    if spec.page_size_padded is not None:
        scaled_real = spec.real_page_size_bytes * block_size // spec.block_size
        auto_padded = getattr(spec, "alignment", None) is not None
        kwargs["page_size_padded"] = (
            None if auto_padded else max(spec.page_size_padded, scaled_real)
        )
    return target(**kwargs)


def unify_kv_cache_spec_page_size(specs: Mapping[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """Make every page as large as the largest by scaling up smaller layers' block sizes.

    Raises:
        NotImplementedError: if a page does not divide the largest page. (vLLM 0.32 pads
            non-MLA pages in that case; we keep the stricter baseline rule.)
    """
    page_sizes = {spec.page_size_bytes for spec in specs.values()}
    if len(page_sizes) <= 1:
        return dict(specs)
    max_page = max(page_sizes)
    unified = {}
    for name, spec in specs.items():
        page = spec.page_size_bytes
        if max_page % page:
            raise NotImplementedError(
                f"Layer {name!r}: page of {page} B does not divide the largest page "
                f"({max_page} B), so its block size cannot be scaled to match"
            )
        unified[name] = (
            spec
            if page == max_page
            else spec.copy_with_new_block_size(spec.block_size * (max_page // page))
        )
        if unified[name].page_size_bytes != max_page:
            raise NotImplementedError(
                f"Layer {name!r}: scaling the block size gives a {unified[name].page_size_bytes}"
                f" B page, not {max_page} B (alignment padding does not scale)"
            )
    return unified


def _get_kv_cache_groups_uniform_page_size(
    specs: Mapping[str, KVCacheSpec],
) -> list[KVCacheGroupSpec]:
    """Equal-size groups over buckets of mergeable specs (all pages equal).

    Group size = the smallest bucket, unless the largest is < 1.5x the smallest (then the
    largest, padding the others). A bucket of n layers gives ``cdiv(n, group_size)`` groups with
    strided members (group i = layers i, i+k, ...), which keeps pipeline stages balanced.
    """
    buckets: list[list[str]] = []
    bucket_specs: list[list[KVCacheSpec]] = []
    for name, spec in specs.items():
        for names, members in zip(buckets, bucket_specs, strict=True):
            try:
                type(members[0]).merge([*members, spec])
            except ValueError:
                continue
            names.append(name)
            members.append(spec)
            break
        else:
            buckets.append([name])
            bucket_specs.append([spec])
    sizes = [len(names) for names in buckets]
    group_size = min(sizes)
    if max(sizes) < group_size * 1.5:
        group_size = max(sizes)
    grouped = []
    for names in buckets:
        num_groups = cdiv(len(names), group_size)
        grouped.extend(names[i::num_groups] for i in range(num_groups))
    return create_kv_cache_group_specs(specs, grouped)


def get_kv_cache_groups(
    specs: Mapping[str, KVCacheSpec],
    *,
    disable_hybrid_kv_cache_manager: bool = False,
    packed_layout: bool = False,
) -> list[KVCacheGroupSpec]:
    """Split layers into KV-cache groups (one block table each); see the module docstring.

    Args:
        specs: layer name -> spec, in registration order (it breaks ties, orders strided groups).
        disable_hybrid_kv_cache_manager: treat local attention as full attention.
        packed_layout: use vLLM 0.32's block-outermost packing (DeepSeek V4/V4.1 backends).

    Returns:
        The groups, in a deterministic order.
    """
    if disable_hybrid_kv_cache_manager:
        specs = unify_hybrid_kv_cache_specs(specs)
    if not specs:
        return []
    if is_kv_cache_spec_uniform(specs):
        return create_kv_cache_group_specs(specs, [list(specs)])
    if uniform := UniformTypeKVCacheSpecs.from_specs(specs):
        return [KVCacheGroupSpec(list(specs), uniform)]
    hidden = {n: s for n, s in specs.items() if isinstance(s, HiddenStateCacheSpec)}
    rest = {n: s for n, s in specs.items() if n not in hidden}
    if packed_layout:
        groups = get_packed_kv_cache_groups(rest)
        if groups is None:  # one page size: nothing to pack
            groups = _get_kv_cache_groups_uniform_page_size(rest)
        return groups + [KVCacheGroupSpec([n], s) for n, s in hidden.items()]
    if hidden:
        raise NotImplementedError(
            f"Hidden-state cache layers {sorted(hidden)} are only supported with one spec type "
            "or packed_layout=True"
        )
    if any(isinstance(s, SlidingWindowMLASpec) for s in specs.values()):
        return group_and_unify_kv_cache_specs(specs)
    return _get_kv_cache_groups_uniform_page_size(unify_kv_cache_spec_page_size(specs))


# --- DeepSeek-V4.0 layer-tuple grouping ------------------------------------------------------


def approximate_gcd(values: Sequence[int], *, lower_bound: int = 1) -> int:
    """The d in ``[lower_bound, max(values)]`` minimising the padding ``sum(round_up(x, d) - x)``;
    ties go to the larger d. Returns ``lower_bound`` if it exceeds every value."""
    if not values or any(x <= 0 for x in values):
        raise ValueError(f"values must be a non-empty list of positive ints, got {list(values)}")
    best_d, best_pad = max(1, lower_bound), None
    for d in range(max(1, lower_bound), max(values) + 1):
        pad = sum(-x % d for x in values)
        if best_pad is None or pad <= best_pad:
            best_d, best_pad = d, pad
    return best_d


def group_and_unify_kv_cache_specs(specs: Mapping[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """DeepSeek-V4.0 grouping into ``UniformTypeKVCacheSpecs`` groups of aligned layer tuples.

    MLA layers form one full group; SWA-MLA layers are bucketed by (block size, window), padded
    to the full group's pages and split into strided groups of layer tuples
    (docs/allocator_internals.md, section 8).

    Raises:
        ValueError: if other spec types are present, there is no MLA layer, a bucket page
            exceeds every full page, or a bucket's page sizes have unequal layer counts.
    """
    others = sorted(
        {type(s).__name__ for s in specs.values() if not isinstance(s, MLAAttentionSpec)}
        - {SlidingWindowMLASpec.__name__}
    )
    if others:
        raise ValueError(
            f"DeepSeek-V4.0 grouping takes MLA and SWA-MLA specs only, got also {others}; "
            "V4.1 layouts (with CircularBufferSpec rings) need packed_layout=True"
        )
    full = {n: s for n, s in specs.items() if isinstance(s, MLAAttentionSpec)}
    buckets: dict[tuple[int, int], dict[str, KVCacheSpec]] = defaultdict(dict)
    for name, spec in specs.items():
        if isinstance(spec, SlidingWindowMLASpec):
            buckets[(spec.block_size, spec.sliding_window)][name] = spec
    full_spec = UniformTypeKVCacheSpecs.from_specs(full) if full else None
    if full_spec is None:
        raise ValueError(
            "DeepSeek-V4.0 grouping needs MLA layers of one block size, got "
            f"{sorted({s.block_size for s in full.values()})}"
        )
    bucket_specs = [UniformTypeKVCacheSpecs.from_specs(b) for b in buckets.values()]
    counts = [s.get_max_layers_per_page_size() for s in (full_spec, *bucket_specs)]
    num_layer_tuples = approximate_gcd(counts, lower_bound=counts[0])
    full_pages = sorted({s.page_size_bytes for s in full.values()})
    groups = [KVCacheGroupSpec(list(full), full_spec)]
    for bucket in buckets.values():
        layers_per_page = _pad_to_full_pages(bucket, full_pages)
        counts_per_page = {len(names) for names in layers_per_page.values()}
        if len(counts_per_page) != 1:
            raise ValueError(
                "Within a SWA-MLA bucket every (padded) page size needs the same number of "
                f"layers, got { ({p: len(n) for p, n in layers_per_page.items()}) }"
            )
        num_groups = cdiv(counts_per_page.pop(), num_layer_tuples)
        tuples = list(zip(*layers_per_page.values(), strict=True))
        padded = {n: s for names in layers_per_page.values() for n, s in names.items()}
        groups += _strided_groups(tuples, num_groups, padded)
    return groups


group_and_unify = group_and_unify_kv_cache_specs


def _pad_to_full_pages(
    bucket: Mapping[str, KVCacheSpec], full_pages: list[int]
) -> dict[int, dict[str, KVCacheSpec]]:
    """Pad each layer's page to the nearest full-group page >= it; layers keyed by padded page."""
    out: dict[int, dict[str, KVCacheSpec]] = defaultdict(dict)
    for name, spec in bucket.items():
        page = spec.page_size_bytes
        target = next((p for p in full_pages if p >= page), None)
        if target is None:
            raise ValueError(
                f"Layer {name!r}: page of {page} B exceeds every full-MLA page {full_pages}"
            )
        out[target][name] = spec if target == page else _with_page(spec, target)
    return out


def _with_page(spec: KVCacheSpec, page_size_padded: int) -> KVCacheSpec:
    return dataclasses.replace(spec, page_size_padded=page_size_padded)


# --- Packed (block-outermost) grouping, vLLM 0.32 --------------------------------------------


def get_packed_kv_cache_groups(
    specs: Mapping[str, KVCacheSpec],
) -> list[KVCacheGroupSpec] | None:
    """Group mixed-page layers for a block-outermost layout (one block = one slab holding one
    page of every layer of a group). None if all pages are already equal.

    Uniform-type buckets; balanced ones split into groups of equal repeats, state buckets only
    as far as needed to fit (docs/allocator_internals.md, section 8).
    """
    if len({s.page_size_bytes for s in specs.values()}) <= 1:
        return None
    buckets = [_PackedBucket.of(bucket) for bucket in _uniform_type_buckets(specs)]
    repeats = _packed_repeats(buckets)
    anchor_bytes = max(
        b.widest_group_bytes(
            len(b.spec.kv_cache_specs) if b.is_state(repeats) else b.num_groups(repeats)
        )
        for b in buckets
    )
    groups = []
    for b in buckets:
        num_groups = b.num_groups(repeats)
        if b.is_state(repeats):
            per_block = max(anchor_bytes // b.spec.first_spec.page_size_bytes, 1)
            num_groups = max(num_groups, cdiv(len(b.spec.kv_cache_specs), per_block))
        if num_groups == 1:
            groups.append(KVCacheGroupSpec(list(b.spec.kv_cache_specs), b.spec))
        else:
            pattern = list(zip(*b.by_page.values(), strict=True))
            groups += _strided_groups(pattern, num_groups, b.spec.kv_cache_specs)
    return groups


def _uniform_type_buckets(specs: Mapping[str, KVCacheSpec]) -> list[dict[str, KVCacheSpec]]:
    """Layers bucketed greedily, in order, by whether they form one uniform type."""
    buckets: list[dict[str, KVCacheSpec]] = []
    for name, spec in specs.items():
        for bucket in buckets:
            if UniformTypeKVCacheSpecs.is_uniform_type({**bucket, name: spec}):
                bucket[name] = spec
                break
        else:
            buckets.append({name: spec})
    return buckets


class _PackedBucket(NamedTuple):
    """One uniform-type bucket of the packed layout and its layers by page size."""

    spec: UniformTypeKVCacheSpecs
    by_page: dict[int, list[str]]
    balanced: bool  # every page size has the same number of layers (a repeating pattern)

    @classmethod
    def of(cls, bucket: dict[str, KVCacheSpec]) -> _PackedBucket:
        by_page: dict[int, list[str]] = defaultdict(list)
        for name, spec in bucket.items():
            by_page[spec.page_size_bytes].append(name)
        balanced = len({len(names) for names in by_page.values()}) == 1
        return cls(UniformTypeKVCacheSpecs.from_specs(bucket), by_page, balanced)

    def num_groups(self, repeats: int | None) -> int:
        if self.balanced and repeats:
            return cdiv(self.spec.get_max_layers_per_page_size(), repeats)
        return 1

    def is_state(self, repeats: int | None) -> bool:
        """Rings, and sliding windows when nothing sets the repeats: split only to fit."""
        first = self.spec.first_spec
        return isinstance(first, CircularBufferSpec) or (
            repeats is None and isinstance(first, SlidingWindowSpec)
        )

    def widest_group_bytes(self, num_groups: int) -> int:
        return sum(cdiv(len(names), num_groups) * page for page, names in self.by_page.items())


def _packed_repeats(buckets: list[_PackedBucket]) -> int | None:
    """Repeats per group: `approximate_gcd` of the balanced buckets' repeat counts, or None
    when no balanced bucket mixes page sizes."""
    min_repeats = max(
        (
            b.spec.get_max_layers_per_page_size()
            for b in buckets
            if b.balanced and len(b.by_page) > 1
        ),
        default=0,
    )
    if not min_repeats:
        return None
    counts = [b.spec.get_max_layers_per_page_size() for b in buckets if b.balanced]
    return approximate_gcd(counts, lower_bound=min_repeats)


def _strided_groups(
    pattern: list[tuple[str, ...]], num_groups: int, member_specs: Mapping[str, KVCacheSpec]
) -> list[KVCacheGroupSpec]:
    """``num_groups`` groups taking every ``num_groups``-th repeat of ``pattern`` (group i:
    repeats i, i + n, ...), which keeps pipeline stages balanced."""
    groups = []
    for i in range(num_groups):
        names = [name for repeat in pattern[i::num_groups] for name in repeat]
        members = {name: member_specs[name] for name in names}
        groups.append(KVCacheGroupSpec(names, UniformTypeKVCacheSpecs.from_specs(members)))
    return groups


# ---------------------------------------------------------------------------------------------
# Sizing
# ---------------------------------------------------------------------------------------------


def _layer_specs(group: KVCacheGroupSpec) -> list[tuple[str, KVCacheSpec]]:
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return [(name, spec.kv_cache_specs[name]) for name in group.layer_names]
    return [(name, spec) for name in group.layer_names]


def _is_layer_tuple_layout(groups: list[KVCacheGroupSpec]) -> bool:
    return len(groups) > 1 and all(
        isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs) for g in groups
    )


def pool_bytes_per_block(groups: list[KVCacheGroupSpec], *, packed_layout: bool = False) -> int:
    """Bytes one block id costs in the shared pool (the divisor of the memory budget).

    * packed: the widest group's sum of pages (every block is a slab that size);
    * one group: the sum of its layers' pages;
    * V4.0 layer tuples: tuple bytes (the full group's distinct pages) x ``num_layer_tuples``;
    * uniform page P: ``P x`` the most layers in a group.
    """
    if not groups:
        return 0
    if packed_layout or len(groups) == 1:
        return max(sum(s.page_size_bytes for _, s in _layer_specs(g)) for g in groups)
    if _is_layer_tuple_layout(groups):
        tuple_bytes, num_tuples = _layer_tuple_geometry(groups)
        return tuple_bytes * num_tuples
    pages = {s.page_size_bytes for g in groups for _, s in _layer_specs(g)}
    if len(pages) != 1:
        raise ValueError(f"groups of mixed page sizes {sorted(pages)} need packed_layout=True")
    return pages.pop() * max(len(g.layer_names) for g in groups)


def _layer_tuple_geometry(groups: list[KVCacheGroupSpec]) -> tuple[int, int]:
    """(bytes of one layer tuple, number of tuples) of a V4.0 layer-tuple layout."""
    full_pages = {s.page_size_bytes for _, s in _layer_specs(groups[0])}
    num_tuples = max(max(_count_by_page(g).values()) for g in groups)
    return sum(full_pages), num_tuples


def _count_by_page(group: KVCacheGroupSpec) -> dict[int, int]:
    counts: dict[int, int] = defaultdict(int)
    for _, spec in _layer_specs(group):
        counts[spec.page_size_bytes] += 1
    return counts


def get_kv_cache_config_from_groups(
    groups: list[KVCacheGroupSpec],
    available_memory_bytes: int,
    *,
    num_gpu_blocks_override: int | None = None,
    packed_layout: bool = False,
) -> KVCacheConfig:
    """Size the pool for these groups and describe its tensors.

    ``num_blocks = available_memory_bytes // pool_bytes_per_block`` unless overridden. With no
    groups the pool still has one block (the null block).
    """
    if not groups:
        return KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=[])
    per_block = pool_bytes_per_block(groups, packed_layout=packed_layout)
    num_blocks = available_memory_bytes // per_block
    if num_gpu_blocks_override is not None:
        num_blocks = num_gpu_blocks_override
    if num_blocks <= 0:
        raise ValueError(
            f"available_memory_bytes={available_memory_bytes} holds no block of {per_block} B; "
            "give more memory or set num_gpu_blocks_override"
        )
    if packed_layout:
        tensors = _packed_tensors(groups, num_blocks, per_block)
    elif len(groups) == 1 and isinstance(groups[0].kv_cache_spec, UniformTypeKVCacheSpecs):
        tensors = [
            KVCacheTensor(spec.page_size_bytes * num_blocks, [name])
            for name, spec in _layer_specs(groups[0])
        ]
    elif _is_layer_tuple_layout(groups):
        tensors = _layer_tuple_tensors(groups, num_blocks)
    else:
        page = per_block // max(len(g.layer_names) for g in groups)
        tensors = [
            KVCacheTensor(
                page * num_blocks, [g.layer_names[i] for g in groups if i < len(g.layer_names)]
            )
            for i in range(max(len(g.layer_names) for g in groups))
        ]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)


def _packed_tensors(
    groups: list[KVCacheGroupSpec], num_blocks: int, block_stride: int
) -> list[KVCacheTensor]:
    """One view per layer into the pool: a group lays its pages side by side in each slab,
    layers of the same spec contiguous (vLLM orders them by spec, then by layer)."""
    tensors = []
    for group in groups:
        by_spec: dict[KVCacheSpec, list[str]] = defaultdict(list)
        for name, spec in _layer_specs(group):
            by_spec[spec].append(name)
        offset = 0
        for spec, names in by_spec.items():
            for name in names:
                tensors.append(
                    KVCacheTensor(block_stride * num_blocks, [name], offset, block_stride)
                )
                offset += spec.page_size_bytes
    return tensors


def _layer_tuple_tensors(groups: list[KVCacheGroupSpec], num_blocks: int) -> list[KVCacheTensor]:
    """One buffer per (tuple slot, page size), shared by that slot's layer in every group."""
    pages = sorted({s.page_size_bytes for _, s in _layer_specs(groups[0])})
    _, num_tuples = _layer_tuple_geometry(groups)
    slots: dict[int, list[list[str]]] = {p: [[] for _ in range(num_tuples)] for p in pages}
    for group in groups:
        seen: dict[int, int] = defaultdict(int)
        for name, spec in _layer_specs(group):
            page = spec.page_size_bytes
            slots[page][seen[page]].append(name)
            seen[page] += 1
    return [
        KVCacheTensor(page * num_blocks, names) for page in pages for names in slots[page] if names
    ]


def get_kv_cache_config(
    specs: Mapping[str, KVCacheSpec],
    available_memory_bytes: int,
    *,
    num_gpu_blocks_override: int | None = None,
    disable_hybrid_kv_cache_manager: bool = False,
    packed_layout: bool = False,
) -> KVCacheConfig:
    """Group the layers (``get_kv_cache_groups``) and size the pool for them.

    Args:
        specs: layer name -> spec, in registration order.
        available_memory_bytes: device bytes for the cache pool.
        num_gpu_blocks_override: use this many blocks instead of what the memory allows.
        disable_hybrid_kv_cache_manager, packed_layout: see ``get_kv_cache_groups``.
    """
    groups = get_kv_cache_groups(
        specs,
        disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager,
        packed_layout=packed_layout,
    )
    return get_kv_cache_config_from_groups(
        groups,
        available_memory_bytes,
        num_gpu_blocks_override=num_gpu_blocks_override,
        packed_layout=packed_layout,
    )


def resolve_kv_cache_block_sizes(
    kv_cache_config: KVCacheConfig,
    *,
    enable_caching: bool = True,
    hash_block_size: int | None = None,
) -> tuple[int, int]:
    """``(scheduler_block_size, hash_block_size)`` for a config: the lcm of the groups' block
    sizes, and the given hash block or else the gcd of the prefix-cacheable groups' block sizes
    (docs/allocator_internals.md, section 8).

    Raises:
        ValueError: a hash block or ``tokens_per_state`` that does not fit the block sizes.
    """
    groups = kv_cache_config.kv_cache_groups
    if len(groups) <= 1:
        block = groups[0].kv_cache_spec.block_size if groups else DEFAULT_BLOCK_SIZE
        if enable_caching and groups and hash_block_size not in (None, block):
            raise ValueError(
                f"hash_block_size={hash_block_size} is invalid with a single KV-cache group; "
                f"hits land on its block size ({block}). Leave it unset or set it to {block}"
            )
        return block, block
    sizes = [g.kv_cache_spec.block_size for g in groups]
    scheduler_block = math.lcm(*sizes)
    if not enable_caching:
        return scheduler_block, scheduler_block
    hashing = [g.kv_cache_spec.block_size for g in groups if g.kv_cache_spec.prefix_cacheable]
    hashing = hashing or sizes
    hash_block = hash_block_size if hash_block_size is not None else math.gcd(*hashing)
    if hash_block <= 0 or any(size % hash_block for size in hashing):
        raise ValueError(
            f"hash_block_size={hash_block} must divide every prefix-cacheable group block size "
            f"{hashing} (all group block sizes: {sizes})"
        )
    ratios = {
        spec.tokens_per_state
        for g in groups
        for spec in iter_layer_specs(g.kv_cache_spec)
        if spec.prefix_cacheable and getattr(spec, "tokens_per_state", 1) > 1
    }
    if any(scheduler_block % r for r in ratios):
        raise ValueError(
            f"Prefix-cache hits land on multiples of {scheduler_block} tokens, which must be a "
            f"multiple of every compress ratio {sorted(ratios)}"
        )
    return scheduler_block, hash_block


def blocks_per_request(
    group: KVCacheGroupSpec, max_model_len: int, max_num_batched_tokens: int
) -> int:
    """Most blocks one request takes from the pool for this group."""
    spec = group.kv_cache_spec
    need = spec.max_memory_usage_bytes(max_model_len, max_num_batched_tokens)
    return cdiv(need, spec.page_size_bytes)


def max_concurrency(
    kv_cache_config: KVCacheConfig, max_model_len: int, max_num_batched_tokens: int
) -> float:
    """How many ``max_model_len`` requests fit at once (vLLM's
    ``get_max_concurrency_for_kv_cache_config``): ``num_blocks`` over the blocks one request
    takes summed over groups (all groups draw from the one pool)."""
    need = sum(
        blocks_per_request(g, max_model_len, max_num_batched_tokens)
        for g in kv_cache_config.kv_cache_groups
    )
    return kv_cache_config.num_blocks / need if need else math.inf


get_max_concurrency_for_kv_cache_config = max_concurrency


# ---------------------------------------------------------------------------------------------
# Memory report
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupMemory:
    """What one group costs a request, in pool bytes (a block costs ``pool_bytes_per_block``
    whatever group holds it).

    Fields:
        group_id, kind (spec class of the group's first layer), block_size (tokens), num_layers.
        page_bytes: the group's own bytes per block (sum of its layers' pages).
        fixed_bytes_per_request: bytes a request holds whatever its length (windows, rings).
        bytes_per_token: growth per token of context (full-attention groups), else 0.
        max_blocks_per_request: blocks one ``max_model_len`` request can hold.
    """

    group_id: int
    kind: str
    block_size: int
    num_layers: int
    page_bytes: int
    fixed_bytes_per_request: int
    bytes_per_token: float
    max_blocks_per_request: int


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryReport:
    """Per-group costs plus the pool totals of one ``KVCacheConfig``."""

    num_blocks: int
    pool_bytes_per_block: int
    max_model_len: int
    max_concurrency: float
    groups: tuple[GroupMemory, ...]

    @property
    def fixed_bytes_per_request(self) -> int:
        return sum(g.fixed_bytes_per_request for g in self.groups)

    @property
    def bytes_per_token(self) -> float:
        return sum(g.bytes_per_token for g in self.groups)

    def __str__(self) -> str:
        total = self.num_blocks * self.pool_bytes_per_block
        lines = [
            f"KV-cache pool: {self.num_blocks} blocks x {self.pool_bytes_per_block:,} B = "
            f"{total / 2**30:.3f} GiB; max concurrency at {self.max_model_len:,} tokens: "
            f"{self.max_concurrency:.2f}",
            f"{'group':>5}  {'kind':<28}{'block':>6}{'layers':>7}{'page B':>10}"
            f"{'fixed B/req':>14}{'B/token':>12}{'max blocks':>11}",
        ]
        for g in self.groups:
            lines.append(
                f"{g.group_id:>5}  {g.kind:<28}{g.block_size:>6}{g.num_layers:>7}"
                f"{g.page_bytes:>10,}{g.fixed_bytes_per_request:>14,}{g.bytes_per_token:>12,.1f}"
                f"{g.max_blocks_per_request:>11,}"
            )
        lines.append(
            f"per request: {self.fixed_bytes_per_request:,} B fixed + "
            f"{self.bytes_per_token:,.1f} B per token"
        )
        return "\n".join(lines)


def memory_report(
    kv_cache_config: KVCacheConfig,
    max_model_len: int,
    max_num_batched_tokens: int,
    *,
    packed_layout: bool = False,
) -> MemoryReport:
    """Per-group memory costs of a config (see ``GroupMemory``)."""
    groups = kv_cache_config.kv_cache_groups
    per_block = pool_bytes_per_block(groups, packed_layout=packed_layout)
    rows = []
    for gid, group in enumerate(groups):
        first = iter_layer_specs(group.kv_cache_spec)[0]
        blocks = blocks_per_request(group, max_model_len, max_num_batched_tokens)
        grows = isinstance(first, FullAttentionSpec)
        rows.append(
            GroupMemory(
                group_id=gid,
                kind=type(first).__name__,
                block_size=group.kv_cache_spec.block_size,
                num_layers=len(group.layer_names),
                page_bytes=sum(s.page_size_bytes for _, s in _layer_specs(group)),
                fixed_bytes_per_request=0 if grows else blocks * per_block,
                bytes_per_token=per_block / group.kv_cache_spec.block_size if grows else 0.0,
                max_blocks_per_request=blocks,
            )
        )
    return MemoryReport(
        num_blocks=kv_cache_config.num_blocks,
        pool_bytes_per_block=per_block,
        max_model_len=max_model_len,
        max_concurrency=max_concurrency(kv_cache_config, max_model_len, max_num_batched_tokens),
        groups=tuple(rows),
    )


# ---------------------------------------------------------------------------------------------
# DeepSeek-V4.1 layouts
# ---------------------------------------------------------------------------------------------


def compressed_kv_name(layer_id: int) -> str:
    """Cache layer name of a kv source's compressed-KV cache."""
    return f"model.layers.{layer_id}.attn"


def indexer_k_name(layer_id: int) -> str:
    """Cache layer name of a kv-and-index source's indexer key cache."""
    return f"model.layers.{layer_id}.attn.indexer.k_cache"


def swa_cache_name(layer_id: int) -> str:
    """Cache layer name of a layer's sliding-window cache (every layer has one)."""
    return f"model.layers.{layer_id}.attn.swa_cache"


def ring_name(layer_id: int) -> str:
    """Cache layer name of an r=2 kv source's compressor ring."""
    return f"model.layers.{layer_id}.attn.compressor.state_cache"


def ring_capacity(num_speculative_tokens: int) -> int:
    """Ring rows: drafts + bonus token + the previous row, as a power of two, at least 8."""
    return max(8, 1 << (num_speculative_tokens + 1).bit_length())


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelCacheDesc:
    """What the cache layout needs from a V4.1 config (layer plan and record sizes).

    Defaults are DeepSeek-V4.1-Flash on SM90/H200 (584-B records, 576-B alignment, 132-B FP8
    indexer keys, ``block_size`` 64); the fields: docs/allocator_internals.md, section 10.
    """

    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    num_hidden_layers: int
    num_draft_layers: int = 0
    sliding_window: int = 128
    block_size: int = 64
    swa_block_size: int = 32
    num_speculative_tokens: int = 0
    swa_record_bytes: int = 584
    compressed_record_bytes: int = 584
    indexer_key_bytes: int = 132
    page_alignment: int | None = 576
    indexer_page_alignment: int | None = 576
    record_dtype: str = "uint8"
    ring_floats_per_row: int = 1024
    swa_bounded_replay: bool = False

    def __post_init__(self) -> None:
        for name in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids"):
            object.__setattr__(self, name, tuple(int(x) for x in getattr(self, name)))
        self._validate()

    @property
    def num_layers(self) -> int:
        """Backbone plus draft layers."""
        return self.num_hidden_layers + self.num_draft_layers

    def ratio(self, layer_id: int) -> int:
        """Compress ratio of a layer (0 when the list is shorter, as in vLLM)."""
        ratios = self.compress_ratios
        return ratios[layer_id] if layer_id < len(ratios) else 0

    def kv_source_of(self, layer_id: int) -> int | None:
        """The latest kv source <= ``layer_id`` for an r>0 layer, else None."""
        return _latest_at_most(self.kv_source_layer_ids, layer_id) if self.ratio(layer_id) else None

    def index_source_of(self, layer_id: int) -> int | None:
        """The latest index source <= ``layer_id`` for an r>0 layer, else None."""
        if not self.ratio(layer_id):
            return None
        return _latest_at_most(self.index_source_layer_ids, layer_id)

    def _validate(self) -> None:
        for name in (
            "num_hidden_layers",
            "sliding_window",
            "block_size",
            "swa_block_size",
            "swa_record_bytes",
            "compressed_record_bytes",
            "indexer_key_bytes",
            "ring_floats_per_row",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelCacheDesc.{name}={value!r} must be a positive int")
        for name in ("num_draft_layers", "num_speculative_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"ModelCacheDesc.{name}={getattr(self, name)} must be >= 0")
        if len(self.compress_ratios) > self.num_layers:
            raise ValueError(
                f"compress_ratios has {len(self.compress_ratios)} entries for {self.num_layers} "
                "layers (backbone + draft)"
            )
        for layer, r in enumerate(self.compress_ratios):
            if r not in (0, 1, 2):
                raise ValueError(f"layer {layer}: compress ratio {r} not in {{0, 1, 2}}")
            if r and layer >= self.num_hidden_layers:
                raise ValueError(f"draft layer {layer} has compress ratio {r}; drafts must be 0")
        self._validate_sources()
        for layer in range(self.num_layers):
            self._validate_layer(layer)

    def _validate_sources(self) -> None:
        for name in ("kv_source_layer_ids", "index_source_layer_ids"):
            for s in getattr(self, name):
                if not 0 <= s < self.num_hidden_layers:
                    raise ValueError(
                        f"{name} has layer {s}; sources must be backbone layers "
                        f"0..{self.num_hidden_layers - 1}"
                    )
                if self.ratio(s) == 0:
                    raise ValueError(f"{name} has layer {s} whose compress ratio is 0")
        missing = sorted(set(self.kv_source_layer_ids) - set(self.index_source_layer_ids))
        if missing:
            raise ValueError(
                f"kv sources {missing} are not index sources; nobody would write their index "
                "keys (kv_source_layer_ids must be a subset of index_source_layer_ids)"
            )

    def _validate_layer(self, layer: int) -> None:
        r = self.ratio(layer)
        if not r:
            return
        if self.block_size % r:
            raise ValueError(f"block_size={self.block_size} is not a multiple of ratio {r}")
        for what, src in (("kv", self.kv_source_of(layer)), ("index", self.index_source_of(layer))):
            if src is None:
                raise ValueError(
                    f"layer {layer} has compress ratio {r} but no {what} source <= {layer}"
                )
            if self.ratio(src) != r:
                raise ValueError(
                    f"layer {layer} (ratio {r}) shares the {what} source {src} of ratio "
                    f"{self.ratio(src)}; ratios inside a sharing group must match"
                )

    @classmethod
    def from_config(cls, cfg: Any, **overrides: Any) -> ModelCacheDesc:
        """Read the fields from any object (or mapping) that has attributes of these names;
        missing ones take the defaults, ``overrides`` win. Without ``num_draft_layers`` the
        ratios past ``num_hidden_layers`` count as draft layers."""
        values = {}
        for f in dataclasses.fields(cls):
            if isinstance(cfg, Mapping):
                if f.name in cfg:
                    values[f.name] = cfg[f.name]
            elif hasattr(cfg, f.name):
                values[f.name] = getattr(cfg, f.name)
        values.update(overrides)
        if "num_draft_layers" not in values and "num_hidden_layers" in values:
            extra = len(values.get("compress_ratios", ())) - values["num_hidden_layers"]
            values["num_draft_layers"] = max(0, extra)
        values.setdefault("compress_ratios", ())
        values.setdefault("kv_source_layer_ids", ())
        values.setdefault("index_source_layer_ids", ())
        return cls(**values)


def _latest_at_most(ids: tuple[int, ...], layer: int) -> int | None:
    below = [s for s in ids if s <= layer]
    return max(below) if below else None


def v41_flash_desc(**overrides: Any) -> ModelCacheDesc:
    """DeepSeek-V4.1-Flash (40 backbone + 3 DSpark layers) on SM90, H200 record sizes.

    Layers 0-1 SWA only, 2-19 r=2, 20-39 r=1. As in the released config.json, layers 2, 8, 14,
    20 own a compressor, a compressed cache and index keys (kv sources); 24, 28, 32, 36 are
    index sources only (reindex: they score layer 20's keys).
    """
    fields_ = {
        "compress_ratios": (0, 0) + (2,) * 18 + (1,) * 20 + (0,) * 3,
        "kv_source_layer_ids": (2, 8, 14, 20),
        "index_source_layer_ids": (2, 8, 14, 20, 24, 28, 32, 36),
        "num_hidden_layers": 40,
        "num_draft_layers": 3,
        "sliding_window": 128,
        "block_size": 64,
    }
    fields_.update(overrides)
    return ModelCacheDesc(**fields_)


def tiny_v41_desc(**overrides: Any) -> ModelCacheDesc:
    """The 8 + 1 layer test topology that covers every V4.1 role (SWA, full r=2 and r=1, reuse,
    reindex, draft). Records are plain bf16 rows of head_dim 64 (128 B), index keys bf16 rows of
    32 (64 B), no alignment; B=16, SWA block 4, window 8, ring 8 rows of 2 x 64 floats."""
    fields_ = {
        "compress_ratios": (0, 2, 2, 1, 1, 1, 1, 0, 0),
        "kv_source_layer_ids": (1, 3),
        "index_source_layer_ids": (1, 3, 5),
        "num_hidden_layers": 8,
        "num_draft_layers": 1,
        "sliding_window": 8,
        "block_size": 16,
        "swa_block_size": 4,
        "swa_record_bytes": 128,
        "compressed_record_bytes": 128,
        "indexer_key_bytes": 64,
        "page_alignment": None,
        "indexer_page_alignment": None,
        "ring_floats_per_row": 128,
    }
    fields_.update(overrides)
    return ModelCacheDesc(**fields_)


def v41_layer_specs(desc: ModelCacheDesc) -> dict[str, KVCacheSpec]:
    """Every cache layer of a V4.1 model, in vLLM's registration order: per layer the
    compressed KV (kv sources), the indexer keys (kv sources, which are index sources), the SWA
    cache (every layer, draft included), then the ring (r=2 kv sources)."""
    kv_sources = set(desc.kv_source_layer_ids)
    specs: dict[str, KVCacheSpec] = {}
    for layer in range(desc.num_layers):
        r = desc.ratio(layer)
        if layer in kv_sources:
            specs[compressed_kv_name(layer)] = _compressed_spec(desc, r)
            specs[indexer_k_name(layer)] = _indexer_spec(desc, r)
        specs[swa_cache_name(layer)] = _swa_spec(desc)
        if layer in kv_sources and r == 2:
            specs[ring_name(layer)] = _ring_spec(desc)
    return specs


def _compressed_spec(desc: ModelCacheDesc, r: int) -> MLAAttentionSpec:
    return _mla_rows_spec(desc, r, desc.compressed_record_bytes, desc.page_alignment)


def _indexer_spec(desc: ModelCacheDesc, r: int) -> MLAAttentionSpec:
    return _mla_rows_spec(desc, r, desc.indexer_key_bytes, desc.indexer_page_alignment)


def _mla_rows_spec(
    desc: ModelCacheDesc, r: int, row_bytes: int, alignment: int | None
) -> MLAAttentionSpec:
    """A full-attention cache of packed rows, one per ``r`` tokens (compressed KV, index keys)."""
    return MLAAttentionSpec(
        block_size=desc.block_size,
        num_kv_heads=1,
        head_size=row_bytes,
        dtype=desc.record_dtype,
        state_content_bytes=row_bytes,
        tokens_per_state=r,
        alignment=alignment,
        model_version="deepseek_v4",
    )


def _swa_spec(desc: ModelCacheDesc) -> SlidingWindowMLASpec:
    return SlidingWindowMLASpec(
        block_size=desc.swa_block_size,
        num_kv_heads=1,
        head_size=desc.swa_record_bytes,
        dtype=desc.record_dtype,
        state_content_bytes=desc.swa_record_bytes,
        sliding_window=desc.sliding_window,
        alignment=desc.page_alignment,
        model_version="deepseek_v4",
        bounded_replay=desc.swa_bounded_replay,
    )


def _ring_spec(desc: ModelCacheDesc) -> CircularBufferSpec:
    return CircularBufferSpec(
        block_size=ring_capacity(desc.num_speculative_tokens),
        num_kv_heads=1,
        head_size=desc.ring_floats_per_row,
        head_size_v=0,
        dtype="float32",
    )


def for_model(
    desc: ModelCacheDesc,
    *,
    available_memory_bytes: int | None = None,
    num_gpu_blocks_override: int | None = None,
) -> KVCacheConfig:
    """The V4.1 cache layout of a layer plan: packed groups (compressed KV + indexer keys in one
    full bucket, SWA caches in a sliding bucket, rings in a state bucket) and the pool size.

    With draft layers and ``num_speculative_tokens > 0`` the group holding the last draft
    layer's SWA cache is marked ``is_eagle_group`` (vLLM's positional rule for DSpark).

    Raises:
        ValueError: if neither a memory budget nor a block count is given.
    """
    if available_memory_bytes is None and num_gpu_blocks_override is None:
        raise ValueError("for_model needs available_memory_bytes or num_gpu_blocks_override")
    specs = v41_layer_specs(desc)
    groups = get_kv_cache_groups(specs, packed_layout=True)
    if desc.num_draft_layers and desc.num_speculative_tokens:
        last = next(reversed(specs))
        groups = [dataclasses.replace(g, is_eagle_group=last in g.layer_names) for g in groups]
    return get_kv_cache_config_from_groups(
        groups,
        available_memory_bytes or 0,
        num_gpu_blocks_override=num_gpu_blocks_override,
        packed_layout=True,
    )
