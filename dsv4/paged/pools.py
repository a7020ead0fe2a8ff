"""Device page pools: the byte buffers behind every paged cache, built from a ``KVCacheConfig``.

`PoolLayout` gives every cache layer a typed view of its pages (``"aliased"``: vLLM's one byte
pool, exactly what `cache.layout` sizes; ``"separate"``: one buffer per layer, for debugging);
the read / write functions decode and encode records through block tables and slot mappings,
never clamping a bad id. Each function and the page byte layout: docs/cache.md#dsv4pagedpools.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from cache.layout import (
    ModelCacheDesc,
    compressed_kv_name,
    indexer_k_name,
    ring_name,
    swa_cache_name,
)
from cache.spec import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    UniformTypeKVCacheSpecs,
)
from dsv4.config import ModelConfig
from dsv4.paged.records import NAN_BYTE, CacheFormats, get_record

__all__ = [
    "AliasKind",
    "GroupPool",
    "LayerPool",
    "PoolLayout",
    "cache_desc",
    "check_block_ids",
    "check_slots",
    "config_pool_bytes",
    "fill_blocks",
    "init_pools",
    "layer_kinds",
    "read_blocks",
    "read_for_table",
    "read_layer",
    "read_ring",
    "read_ring_for_table",
    "read_selected",
    "selected_is_smaller",
    "window_page_bound",
    "write_layer",
    "write_ring",
]

AliasKind = Literal["aliased", "separate"]
POOL_KEY = "pool"  # the buffer key of the aliased layout's shared pool


# ---------------------------------------------------------------------------------------------
# ModelConfig -> ModelCacheDesc
# ---------------------------------------------------------------------------------------------


def cache_desc(
    cfg: ModelConfig,
    formats: CacheFormats,
    *,
    block_size: int,
    swa_block_size: int,
    num_speculative_tokens: int = 0,
    page_alignment: int | None = None,
    indexer_page_alignment: int | None = None,
    swa_bounded_replay: bool = False,
) -> ModelCacheDesc:
    """The cache layout description of a model whose caches store ``formats`` records.

    Record bytes come from the formats, ring rows are ``[a | s]`` of ``2 · head_dim`` floats;
    block sizes and alignments are the platform's (docs/cache.md#cache-specs-and-block-sizes).
    Draft layers (``n_mtp_layers``) get SWA caches.

    Raises:
        ValueError: if a record cannot store its dim (e.g. ``mxfp4`` for a dim that is not a
            multiple of 32), or the layout description is invalid.
    """
    formats.check_dims(cfg.head_dim, cfg.index_head_dim)
    return ModelCacheDesc(
        compress_ratios=cfg.compress_ratios,
        kv_source_layer_ids=cfg.kv_source_layers,
        index_source_layer_ids=cfg.index_source_layers,
        num_hidden_layers=cfg.n_layers,
        num_draft_layers=cfg.n_mtp_layers,
        sliding_window=cfg.window_size,
        block_size=block_size,
        swa_block_size=swa_block_size,
        num_speculative_tokens=num_speculative_tokens,
        swa_record_bytes=get_record(formats.window).record_bytes(cfg.head_dim),
        compressed_record_bytes=get_record(formats.compressed).record_bytes(cfg.head_dim),
        indexer_key_bytes=get_record(formats.index).record_bytes(cfg.index_head_dim),
        page_alignment=page_alignment,
        indexer_page_alignment=indexer_page_alignment,
        record_dtype="uint8",
        ring_floats_per_row=2 * cfg.head_dim,
        swa_bounded_replay=swa_bounded_replay,
    )


def layer_kinds(cfg: ModelConfig) -> dict[str, tuple[str, int]]:
    """Every cache layer name of a model -> ``(kind, layer id)``, kind in ``"swa"``,
    ``"compressed"``, ``"index"``, ``"ring"`` (the names of `cache.layout`)."""
    out: dict[str, tuple[str, int]] = {}
    kv_sources = set(cfg.kv_source_layers)
    for layer in range(cfg.n_layers + cfg.n_mtp_layers):
        if layer in kv_sources:
            out[compressed_kv_name(layer)] = ("compressed", layer)
            out[indexer_k_name(layer)] = ("index", layer)
            if cfg.ratio(layer) == 2:
                out[ring_name(layer)] = ("ring", layer)
        out[swa_cache_name(layer)] = ("swa", layer)
    return out


def config_pool_bytes(kv_cache_config: KVCacheConfig) -> int:
    """Device bytes the tensors of a ``KVCacheConfig`` take: packed views (``block_stride``
    set) all view one pool buffer, counted once; other tensors are buffers of their own."""
    packed = {t.size for t in kv_cache_config.kv_cache_tensors if t.block_stride is not None}
    if len(packed) > 1:
        raise ValueError(f"packed tensors disagree on the pool size: {sorted(packed)}")
    plain = sum(t.size for t in kv_cache_config.kv_cache_tensors if t.block_stride is None)
    return sum(packed) + plain


# ---------------------------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LayerPool:
    """Where one cache layer's pages live and how they are encoded (block ``b``'s page is
    ``pools[buffer][b, offset : offset + page_bytes]``)."""

    name: str  # cache layer name (`cache.layout`'s ``*_name`` functions)
    kind: str  # "swa" | "compressed" | "index" | "ring"
    layer_id: int  # model layer
    group: int  # KV-cache group index (the block table that addresses this layer)
    buffer: str  # key of the buffer in the pools dict
    offset: int  # byte offset of this layer's page inside a buffer row
    page_bytes: int  # bytes of one page, alignment padding included
    states: int  # states (rows) per page (block_size // tokens_per_state; ring: capacity)
    tokens_per_state: int  # raw tokens per state (compress ratio; 1 for SWA and rings)
    record: str  # record format name
    dim: int  # values per state

    @property
    def record_bytes(self) -> int:
        return get_record(self.record).record_bytes(self.dim)

    @property
    def data_bytes(self) -> int:
        return get_record(self.record).data_bytes(self.dim)

    @property
    def scale_bytes(self) -> int:
        return get_record(self.record).scale_bytes(self.dim)

    @property
    def used_bytes(self) -> int:
        """Bytes of the page that hold records (``page_bytes`` minus alignment padding)."""
        return self.states * self.record_bytes

    @property
    def num_slots_per_block(self) -> int:
        return self.states


@dataclasses.dataclass(frozen=True)
class GroupPool:
    """One KV-cache group: its block size in tokens, spec class and layers (in page order)."""

    group: int
    kind: str
    block_size: int
    layer_names: tuple[str, ...]
    page_bytes: int  # the group's own bytes per block (sum of its layers' pages)


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    """The device layout of every paged cache (see the module docstring). Build it with
    `PoolLayout.build`; look layers up with `layer`. Hashable (a static jit argument)."""

    alias: str  # "aliased" or "separate"
    num_blocks: int  # blocks in the shared id space (block 0 is the null block)
    formats: CacheFormats  # the record formats
    buffers: tuple[tuple[str, int], ...]  # (key, row bytes): buffer key is uint8[num_blocks, row]
    layers: tuple[LayerPool, ...]  # one per cache layer, in the config's group order
    groups: tuple[GroupPool, ...]  # one per KV-cache group

    @classmethod
    def build(
        cls,
        cfg: ModelConfig,
        kv_cache_config: KVCacheConfig,
        formats: CacheFormats,
        layout: AliasKind = "aliased",
    ) -> PoolLayout:
        """The layout of ``kv_cache_config``'s caches for model ``cfg`` storing ``formats``.

        Raises:
            ValueError: unknown ``layout``; a cache layer the model does not have; a layer whose
                state bytes in the config are not its record's bytes (the config was built for
                other formats: use `cache_desc` with these formats); pages of one group that
                overlap or leave their buffer row.
        """
        if layout not in ("aliased", "separate"):
            raise ValueError(f"layout must be 'aliased' or 'separate', got {layout!r}")
        formats.check_dims(cfg.head_dim, cfg.index_head_dim)
        kinds = layer_kinds(cfg)
        num_blocks = kv_cache_config.num_blocks
        placement = (
            _aliased_placement(kv_cache_config)
            if layout == "aliased"
            else _separate_placement(kv_cache_config)
        )
        layers, groups = [], []
        for gid, group in enumerate(kv_cache_config.kv_cache_groups):
            members = _layer_specs(group)
            groups.append(
                GroupPool(
                    group=gid,
                    kind=type(members[0][1]).__name__,
                    block_size=group.kv_cache_spec.block_size,
                    layer_names=tuple(name for name, _ in members),
                    page_bytes=sum(spec.page_size_bytes for _, spec in members),
                )
            )
            for name, spec in members:
                layers.append(_layer_pool(name, spec, gid, kinds, formats, cfg, placement))
        buffers = tuple(dict.fromkeys((key, row) for key, _, row in placement.values()))
        if len({key for key, _ in buffers}) != len(buffers):
            raise ValueError(f"buffers disagree on their row bytes: {buffers}")
        out = cls(
            alias=layout,
            num_blocks=num_blocks,
            formats=formats,
            buffers=buffers,
            layers=tuple(layers),
            groups=tuple(groups),
        )
        out._check_pages()
        return out

    # -- lookups -------------------------------------------------------------------------------
    @functools.cached_property
    def _by_name(self) -> dict[str, LayerPool]:
        return {lp.name: lp for lp in self.layers}

    def layer(self, name: str) -> LayerPool:
        """The `LayerPool` of a cache layer name; a ValueError lists some known names."""
        try:
            return self._by_name[name]
        except KeyError:
            known = [lp.name for lp in self.layers[:4]]
            raise ValueError(
                f"no cache layer {name!r} in this layout ({len(self.layers)} layers, e.g. {known})"
            ) from None

    def names(self, kind: str | None = None) -> tuple[str, ...]:
        """Cache layer names, optionally only those of one kind."""
        return tuple(lp.name for lp in self.layers if kind is None or lp.kind == kind)

    def group_of(self, name: str) -> int:
        """KV-cache group index (block table) of a cache layer."""
        return self.layer(name).group

    def buffer_shapes(self) -> dict[str, tuple[int, int]]:
        """Buffer key -> ``(num_blocks, row bytes)`` (all ``uint8``)."""
        return {key: (self.num_blocks, row) for key, row in self.buffers}

    def abstract_pools(self) -> dict[str, jax.ShapeDtypeStruct]:
        """Shapes and dtypes of `init_pools`'s result (for ``jax.eval_shape`` / AOT lowering)."""
        return {k: jax.ShapeDtypeStruct(s, jnp.uint8) for k, s in self.buffer_shapes().items()}

    # -- figures -------------------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        """Device bytes one block id costs: the sum of the buffers' rows (aliased: the block
        stride, i.e. the largest group's page set; separate: every layer's page)."""
        return sum(row for _, row in self.buffers)

    def pool_bytes(self) -> int:
        """Device bytes of all buffers (aliased: equals `config_pool_bytes` of the config)."""
        return self.num_blocks * self.bytes_per_block()

    # -- validation ----------------------------------------------------------------------------
    def _check_pages(self) -> None:
        rows = dict(self.buffers)
        spans: dict[tuple[int, str], list[tuple[int, int, str]]] = {}
        for lp in self.layers:
            if lp.used_bytes > lp.page_bytes:
                raise ValueError(
                    f"layer {lp.name!r}: {lp.states} {lp.record!r} records of dim {lp.dim} need "
                    f"{lp.used_bytes} B but its page has {lp.page_bytes} B"
                )
            if lp.offset < 0 or lp.offset + lp.page_bytes > rows[lp.buffer]:
                raise ValueError(
                    f"layer {lp.name!r}: page [{lp.offset}, {lp.offset + lp.page_bytes}) leaves "
                    f"its buffer row of {rows[lp.buffer]} B"
                )
            spans.setdefault((lp.group, lp.buffer), []).append(
                (lp.offset, lp.offset + lp.page_bytes, lp.name)
            )
        for (group, _), items in spans.items():
            items.sort()
            for (_, end, a), (start, _, b) in itertools.pairwise(items):
                if start < end:
                    raise ValueError(
                        f"group {group}: pages of {a!r} and {b!r} overlap (a block row would "
                        "hold both; within one group pages must be disjoint)"
                    )


def _layer_specs(group: KVCacheGroupSpec) -> list[tuple[str, KVCacheSpec]]:
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return [(name, spec.kv_cache_specs[name]) for name in group.layer_names]
    return [(name, spec) for name in group.layer_names]


def _aliased_placement(config: KVCacheConfig) -> dict[str, tuple[str, int, int]]:
    """Layer name -> (buffer key, offset, row bytes) of the config's own tensors."""
    out: dict[str, tuple[str, int, int]] = {}
    num_blocks = config.num_blocks
    for i, tensor in enumerate(config.kv_cache_tensors):
        if tensor.block_stride is not None:
            key, offset, row = POOL_KEY, tensor.offset, tensor.block_stride
            if tensor.size != row * num_blocks:
                raise ValueError(
                    f"packed tensor of {tensor.shared_by} has {tensor.size} B, not block_stride "
                    f"{row} x {num_blocks} blocks"
                )
        else:
            if tensor.size % num_blocks:
                raise ValueError(
                    f"tensor of {tensor.shared_by} has {tensor.size} B, not a multiple of "
                    f"{num_blocks} blocks"
                )
            key, offset, row = f"tensor{i}", 0, tensor.size // num_blocks
        for name in tensor.shared_by:
            if name in out:
                raise ValueError(f"layer {name!r} is backed by two KV-cache tensors")
            out[name] = (key, offset, row)
    return out


def _separate_placement(config: KVCacheConfig) -> dict[str, tuple[str, int, int]]:
    return {
        name: (name, 0, spec.page_size_bytes)
        for group in config.kv_cache_groups
        for name, spec in _layer_specs(group)
    }


def _layer_pool(
    name: str,
    spec: KVCacheSpec,
    gid: int,
    kinds: Mapping[str, tuple[str, int]],
    formats: CacheFormats,
    cfg: ModelConfig,
    placement: Mapping[str, tuple[str, int, int]],
) -> LayerPool:
    if name not in kinds:
        raise ValueError(
            f"KV-cache group {gid} has layer {name!r}, which this model config has no cache for"
        )
    if name not in placement:
        raise ValueError(f"layer {name!r} of group {gid} is backed by no KV-cache tensor")
    if not isinstance(spec, AttentionSpec) or spec.num_heads != 1:
        raise ValueError(f"layer {name!r}: expected a one-head attention spec, got {spec!r}")
    kind, layer_id = kinds[name]
    record = formats.record(kind)
    dim = {"ring": 2 * cfg.head_dim, "index": cfg.index_head_dim}.get(kind, cfg.head_dim)
    need = get_record(record).record_bytes(dim)
    if spec.state_content_size_bytes != need:
        raise ValueError(
            f"layer {name!r} ({kind}): the KVCacheConfig stores {spec.state_content_size_bytes}-B"
            f" states but {record!r} records of dim {dim} are {need} B; build the config from "
            "dsv4.paged.pools.cache_desc(cfg, formats, ...) with the same formats"
        )
    buffer, offset, _ = placement[name]
    return LayerPool(
        name=name,
        kind=kind,
        layer_id=layer_id,
        group=gid,
        buffer=buffer,
        offset=offset,
        page_bytes=spec.page_size_bytes,
        states=spec.num_states,
        tokens_per_state=spec.tokens_per_state,
        record=record,
        dim=dim,
    )


# ---------------------------------------------------------------------------------------------
# Buffers, reads and writes
# ---------------------------------------------------------------------------------------------


def init_pools(layout: PoolLayout, *, fill: str = "zeros") -> dict[str, jax.Array]:
    """Fresh buffers: ``fill="zeros"`` (all bytes 0: every record decodes to 0) or ``"nan"``
    (all bytes 0xFF: every record of every format decodes to NaN)."""
    if fill == "zeros":
        byte = 0
    elif fill == "nan":
        byte = NAN_BYTE
    else:
        raise ValueError(f"fill must be 'zeros' or 'nan', got {fill!r}")
    return {key: jnp.full(shape, byte, jnp.uint8) for key, shape in layout.buffer_shapes().items()}


def fill_blocks(
    layout: PoolLayout,
    pools: Mapping[str, jax.Array],
    block_ids: jax.Array,
    *,
    fill: str = "zeros",
) -> dict[str, jax.Array]:
    """Reset whole blocks: every byte of rows ``block_ids i32[K]`` of every buffer set to 0
    (``fill="zeros"``) or 0xFF (``"nan"``); ids outside ``[0, num_blocks)`` (e.g. -1 padding)
    are skipped.

    Why: an aliased block handed from one group to another still holds the old group's bytes; vLLM
    zeroes such blocks when groups mix precisions, and ``"nan"`` is the tests' poisoned variant.
    """
    byte = {"zeros": 0, "nan": NAN_BYTE}.get(fill)
    if byte is None:
        raise ValueError(f"fill must be 'zeros' or 'nan', got {fill!r}")
    ids = jnp.asarray(block_ids, jnp.int32).reshape(-1)
    ids = jnp.where((ids >= 0) & (ids < layout.num_blocks), ids, layout.num_blocks)
    out = dict(pools)
    for key, _ in layout.buffers:
        out[key] = pools[key].at[ids].set(jnp.uint8(byte), mode="drop")
    return out


def _decode_pages(lp: LayerPool, pages: jax.Array) -> jax.Array:
    """``uint8[k, >= used_bytes]`` page bytes -> ``f32[k, states, dim]``."""
    n, db, sb = lp.states, lp.data_bytes, lp.scale_bytes
    k = pages.shape[0]
    records = pages[:, : n * db].reshape(k, n, db)
    if sb:
        scales = pages[:, n * db : n * (db + sb)].reshape(k, n, sb)
        records = jnp.concatenate([records, scales], axis=-1)
    return get_record(lp.record).decode(records, lp.dim)


SCALED_RECORDS = ("fp8_132",)  # records a kernel can read as (values, one scale per record)


def _split_pages(lp: LayerPool, pages: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``uint8[k, >= used_bytes]`` pages of ``fp8_132`` records -> (e4m3 values
    ``[k, states, dim]``, f32 scales ``[k, states]``), bytes reinterpreted, nothing rounded."""
    n, db, sb = lp.states, lp.data_bytes, lp.scale_bytes
    k = pages.shape[0]
    values = jax.lax.bitcast_convert_type(pages[:, : n * db].reshape(k, n, db), jnp.float8_e4m3fn)
    scale_bytes = pages[:, n * db : n * (db + sb)].reshape(k, n, sb)
    return values, jax.lax.bitcast_convert_type(scale_bytes, jnp.float32)


def _check_scaled(lp: LayerPool) -> None:
    if lp.record not in SCALED_RECORDS:
        raise ValueError(
            f"scaled=True reads records of {SCALED_RECORDS}; layer {lp.name!r} holds "
            f"{lp.record!r} records"
        )


def _buffer(layout: PoolLayout, pools: Mapping[str, jax.Array], lp: LayerPool) -> jax.Array:
    """The buffer holding ``lp``'s pages, shape-checked against the layout."""
    try:
        buf = pools[lp.buffer]
    except KeyError:
        raise ValueError(
            f"pools has no buffer {lp.buffer!r} (layer {lp.name!r}); keys: {sorted(pools)[:4]}"
            f"{'...' if len(pools) > 4 else ''} — were they built for a {layout.alias} layout?"
        ) from None
    want = (layout.num_blocks, dict(layout.buffers)[lp.buffer])
    if tuple(buf.shape) != want or buf.dtype != jnp.uint8:
        raise ValueError(
            f"pools[{lp.buffer!r}] is {buf.dtype}{list(buf.shape)}, the layout expects "
            f"uint8{list(want)}"
        )
    return buf


def _safe_blocks(ids: jax.Array, num_blocks: int) -> jax.Array:
    """``ids`` flattened, those outside ``[0, num_blocks)`` mapped to ``num_blocks`` (one row
    past the buffer: reads NaN, writes drop) — never clamped to another block."""
    flat = ids.reshape(-1)
    return jnp.where((flat >= 0) & (flat < num_blocks), flat, num_blocks)


def _gather_bytes(
    buf: jax.Array, lp: LayerPool, blocks: jax.Array, cols: jax.Array, size: int
) -> jax.Array:
    """``uint8[K, size]``: the ``size`` bytes of row ``blocks[i]`` from column ``cols[i]``, one
    gather that touches only those rows; a row past the buffer (`_safe_blocks`), or a run
    outside layer ``lp``'s bytes, reads 0xFF bytes, NaN in every record format. XLA:CPU runs
    `_gather_in_layer`, every other platform `_gather_in_buffer`: the same bytes."""
    return jax.lax.platform_dependent(
        cpu=lambda: _gather_in_layer(buf, lp, blocks, cols, size),
        default=lambda: _gather_in_buffer(buf, lp, blocks, cols, size),
    )


def _gather_in_layer(buf, lp: LayerPool, blocks, cols, size: int) -> jax.Array:
    """`_gather_bytes` from a static slice of layer ``lp``'s columns (fused into the gather's
    loop, not copied)."""
    # Why: XLA:CPU's cost model charges a gather for its whole operand and splits a fusion
    # reading a large pool over threads; the layer's columns keep a decode step's small reads
    # on one thread (still split above about 256 KB of the layer's bytes).
    start, stop = lp.offset, lp.offset + lp.used_bytes
    return _gather_rows(buf[:, start:stop], blocks, cols - start, size)


def _gather_in_buffer(buf, lp: LayerPool, blocks, cols, size: int) -> jax.Array:
    """`_gather_bytes` indexing the whole buffer (XLA:TPU would copy a slice of it); a run
    outside the layer's bytes is sent past the buffer's columns."""
    inside = (cols >= lp.offset) & (cols + size <= lp.offset + lp.used_bytes)
    return _gather_rows(buf, blocks, jnp.where(inside, cols, buf.shape[1]), size)


def _gather_rows(operand, blocks, first, size: int) -> jax.Array:
    """``uint8[K, size]``: row ``blocks[i]`` of ``operand`` from column ``first[i]``, 0xFF
    where the run is not wholly inside ``operand``."""
    return jax.lax.gather(
        operand,
        jnp.stack([blocks, first], axis=-1),
        jax.lax.GatherDimensionNumbers(
            offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0, 1)
        ),
        slice_sizes=(1, size),
        mode=jax.lax.GatherScatterMode.FILL_OR_DROP,
        fill_value=NAN_BYTE,
    )


DECODE_CHUNK = 256  # pages decoded per step of a long read's loop (`read_layer`'s ``chunk``)


def _decode_in_chunks(lp: LayerPool, n: int, rows_of, dtype, chunk: int | None) -> jax.Array:
    """``dtype[n, states, dim]``: pages ``0 .. n-1`` decoded, ``rows_of(start, size)`` giving
    the bytes ``uint8[size, >= used_bytes]`` of pages ``start .. start+size-1``. Above ``chunk``
    pages (None: never) the decode runs in a loop of ``chunk`` pages written into the result:
    a decode's intermediates (f32 values, unpacked FP4 codes, several times the result on
    XLA:TPU) then exist for one chunk at a time, not for the whole pool."""
    if chunk is None or n <= chunk:
        return _decode_pages(lp, rows_of(0, n)).astype(dtype)

    def body(i, out):
        start = jnp.minimum(i * chunk, n - chunk)  # the last chunk overlaps the one before
        pages = _decode_pages(lp, rows_of(start, chunk)).astype(dtype)
        return jax.lax.dynamic_update_slice_in_dim(out, pages, start, 0)

    out = jnp.zeros((n, lp.states, lp.dim), dtype)
    return jax.lax.fori_loop(0, -(-n // chunk), body, out)


# Jitted cores over one buffer (the layer is static): one fused computation per layer when
# called eagerly, inlined under the caller's jit (which should donate the pools).
@functools.partial(jax.jit, static_argnums=(0, 2, 3, 4))
def _read_core(lp: LayerPool, buf: jax.Array, scaled: bool = False, dtype=None, chunk=None):
    if scaled:
        return _split_pages(lp, buf[:, lp.offset : lp.offset + lp.used_bytes])

    def rows_of(start, size):
        rows = buf if size == buf.shape[0] else jax.lax.dynamic_slice_in_dim(buf, start, size)
        return rows[:, lp.offset : lp.offset + lp.used_bytes]

    return _decode_in_chunks(lp, buf.shape[0], rows_of, dtype or jnp.float32, chunk)


@functools.partial(jax.jit, static_argnums=(0, 1, 4, 5, 6))
def _read_blocks_core(
    lp: LayerPool,
    num_blocks: int,
    buf: jax.Array,
    ids: jax.Array,
    scaled: bool = False,
    dtype=None,
    chunk=None,
):
    flat = _safe_blocks(ids, num_blocks)

    def rows_of(start, size):
        some = flat if size == flat.shape[0] else jax.lax.dynamic_slice_in_dim(flat, start, size)
        return _gather_bytes(buf, lp, some, jnp.full_like(some, lp.offset), lp.used_bytes)

    if scaled:
        values, scales = _split_pages(lp, rows_of(0, flat.shape[0]))
        return values.reshape(*ids.shape, lp.states, lp.dim), scales.reshape(*ids.shape, lp.states)
    pages = _decode_in_chunks(lp, flat.shape[0], rows_of, dtype or jnp.float32, chunk)
    return pages.reshape(*ids.shape, lp.states, lp.dim)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _write_core(
    lp: LayerPool, num_blocks: int, buf: jax.Array, slots: jax.Array, values: jax.Array
) -> jax.Array:
    records = get_record(lp.record).encode(values)  # [T, record_bytes]
    n, db, sb = lp.states, lp.data_bytes, lp.scale_bytes
    valid = (slots >= 0) & (slots < num_blocks * n)
    block = jnp.where(valid, slots // n, num_blocks)  # out of range -> dropped, never clamped
    row = jnp.where(valid, slots % n, 0)

    def put(buf, col, part):
        # one contiguous run of bytes per record (a window of the row), not a scatter of
        # single bytes: XLA:TPU rewrites a byte scatter into one over the flattened buffer
        # and copies the whole pool into that layout and back for every write
        return jax.lax.scatter(
            buf,
            jnp.stack([block, col], axis=-1),
            part,
            jax.lax.ScatterDimensionNumbers(
                update_window_dims=(1,),
                inserted_window_dims=(0,),
                scatter_dims_to_operand_dims=(0, 1),
            ),
            mode=jax.lax.GatherScatterMode.FILL_OR_DROP,
        )

    buf = put(buf, lp.offset + row * db, records[:, :db])
    if sb:
        buf = put(buf, lp.offset + n * db + row * sb, records[:, db:])
    return buf


def read_layer(
    layout: PoolLayout,
    pools: Mapping[str, jax.Array],
    name: str,
    *,
    dtype=jnp.float32,
    scaled: bool = False,
    chunk: int | None = DECODE_CHUNK,
):
    """Every page of layer ``name`` decoded: ``dtype[num_blocks, states, dim]`` (f32 default), the
    kernels' ``swa_pages`` / ``comp_pages`` / ``ikey_pages`` / ``ring_pages`` (block 0 = null).

    ``scaled=True`` (``fp8_132`` records only) returns ``(values e4m3, scales f32)`` undecoded, as
    the indexer takes them; ``chunk`` decodes that many pages at a time (the same values, with one
    chunk's intermediates held).
    """
    lp = layout.layer(name)
    if scaled:
        _check_scaled(lp)
        return _read_core(lp, _buffer(layout, pools, lp), True)
    return _read_core(lp, _buffer(layout, pools, lp), False, jnp.dtype(dtype), _chunk(chunk))


def read_blocks(
    layout: PoolLayout,
    pools: Mapping[str, jax.Array],
    name: str,
    block_ids: jax.Array,
    *,
    dtype=jnp.float32,
    scaled: bool = False,
    chunk: int | None = DECODE_CHUNK,
):
    """Pages ``block_ids i32[...]`` of layer ``name`` decoded: ``dtype[..., states, dim]``
    (``scaled=True``: the ``fp8_132`` records as ``(values, scales)``; ``chunk``: see
    `read_layer`).

    An id outside ``[0, num_blocks)`` is never clamped: its page reads as NaN (run
    `check_block_ids` in debug mode to get an error instead)."""
    lp = layout.layer(name)
    ids = jnp.asarray(block_ids, jnp.int32)
    buf = _buffer(layout, pools, lp)
    if scaled:
        _check_scaled(lp)
        return _read_blocks_core(lp, layout.num_blocks, buf, ids, True)
    return _read_blocks_core(
        lp, layout.num_blocks, buf, ids, False, jnp.dtype(dtype), _chunk(chunk)
    )


def _chunk(chunk: int | None) -> int | None:
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk must be a positive int (pages) or None, got {chunk!r}")
    return chunk


def write_layer(
    layout: PoolLayout,
    pools: Mapping[str, jax.Array],
    name: str,
    slots: jax.Array,
    values: jax.Array,
) -> dict[str, jax.Array]:
    """Encode ``values f32[T, dim]`` and store row ``t`` at ``slots[t]`` of layer ``name``.

    ``slot = block · states + row``; ``-1`` means no write, and slots out of range are dropped,
    never clamped (`check_slots` reports them, and duplicates, in debug mode). Only the written
    records' bytes change. Returns a new pools dict (only ``pools[buffer]`` replaced).
    """
    lp = layout.layer(name)
    buf = _buffer(layout, pools, lp)
    slots = jnp.asarray(slots, jnp.int32)
    values = jnp.asarray(values)
    if slots.ndim != 1 or values.shape != (slots.shape[0], lp.dim):
        raise ValueError(
            f"write_layer({name!r}): need slots i32[T] and values [T, {lp.dim}], got "
            f"{list(slots.shape)} and {list(values.shape)}"
        )
    return {**pools, lp.buffer: _write_core(lp, layout.num_blocks, buf, slots, values)}


def _ring(layout: PoolLayout, name: str) -> LayerPool:
    lp = layout.layer(name)
    if lp.kind != "ring":
        raise ValueError(f"{name!r} is a {lp.kind} cache, not a compressor ring")
    return lp


def read_ring(layout: PoolLayout, pools: Mapping[str, jax.Array], name: str) -> jax.Array:
    """A compressor ring: ``f32[num_blocks, capacity, 2 · head_dim]`` (``[a | s]`` rows);
    request ``r`` owns block ``ring_block[r]`` (0 = none) and row ``p % capacity``."""
    _ring(layout, name)
    return read_layer(layout, pools, name)


def write_ring(
    layout: PoolLayout,
    pools: Mapping[str, jax.Array],
    name: str,
    slots: jax.Array,
    rows: jax.Array,
) -> dict[str, jax.Array]:
    """Store raw ``rows f32[T, 2 · head_dim]`` at ring ``slots`` (``block · capacity +
    p % capacity``, -1 = none); see `write_layer`."""
    _ring(layout, name)
    return write_layer(layout, pools, name, slots, rows)


# ---------------------------------------------------------------------------------------------
# Reads of only the pages a step's block tables reference
# ---------------------------------------------------------------------------------------------


def window_page_bound(num_tokens: int, num_requests: int, window: int, page: int) -> int:
    """Most window-table columns ``T`` tokens of ``R`` requests can read (``page`` = S tokens
    per page), given that each request's positions in the batch are contiguous:
    ``T // S + R · ((W + 2S - 4) // S + 1)``. The derivation:
    docs/cache.md#dsv4pagedpoolswindow_page_bound.
    """
    if min(num_tokens, num_requests) < 0 or min(window, page) < 1:
        raise ValueError(
            f"need num_tokens, num_requests >= 0 and window, page >= 1, got {num_tokens}, "
            f"{num_requests}, {window}, {page}"
        )
    return num_tokens // page + num_requests * ((window + 2 * page - 4) // page + 1)


def _int_array(what: str, x, ndim: int) -> jax.Array:
    x = jnp.asarray(x)
    if x.ndim != ndim or not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(
            f"{what} must be an integer array of {ndim} dims, got {x.dtype}{list(x.shape)}"
        )
    return x.astype(jnp.int32)


def _gathered_table(table: jax.Array) -> jax.Array:
    """``1 + arange`` in the table's shape: entry ``[r, j]`` -> gathered page ``1 + r·nb + j``."""
    return 1 + jnp.arange(table.size, dtype=jnp.int32).reshape(table.shape)


def _window_pages(table, positions, token_req, *, window: int, page: int, capacity: int):
    """Block ids to decode ``i32[capacity + 2]`` and the remapped table ``i32[R, nb]`` for the
    window columns of every request (see `read_for_table`): id 0 (the null block) first, then
    the needed columns request after request, then id -1 (a NaN page for any column past the
    capacity, which contiguous positions never need)."""
    num_req, nb = table.shape
    real = positions >= 0
    big = jnp.iinfo(jnp.int32).max
    first = jax.ops.segment_min(jnp.where(real, positions, big), token_req, num_req)
    last = jax.ops.segment_max(jnp.where(real, positions, -1), token_req, num_req)
    active = last >= 0  # requests without tokens (and padding rows) need nothing
    lo = jnp.maximum(first - window + 1, 0) // page
    hi = jnp.minimum(last // page, nb - 1)  # the table has no column past nb - 1
    count = jnp.where(active & (hi >= lo), hi - lo + 1, 0)
    end = 1 + jnp.cumsum(count)  # packed pages of request r: [end[r] - count[r], end[r])
    start = end - count
    # packed page k (1 <= k <= capacity) -> request, column, block id
    k = jnp.arange(1, capacity + 1, dtype=jnp.int32)
    r_of_k = jnp.searchsorted(end, k, side="right").astype(jnp.int32)
    used = k < end[-1]
    r_safe = jnp.where(used, r_of_k, 0)
    col = jnp.where(used, lo[r_safe] + k - start[r_safe], 0)
    ids = jnp.where(used, table[r_safe, col], 0)
    ids = jnp.concatenate([jnp.zeros(1, jnp.int32), ids, jnp.full(1, -1, jnp.int32)])
    j = jnp.arange(nb, dtype=jnp.int32)[None, :]
    need = active[:, None] & (j >= lo[:, None]) & (j <= hi[:, None])
    slot = start[:, None] + j - lo[:, None]
    slot = jnp.where(slot <= capacity, slot, capacity + 1)  # overflow: the NaN page, not 0
    return ids, jnp.where(need, slot, 0)


def read_for_table(
    layout: PoolLayout,
    pools: Mapping[str, jax.Array],
    name: str,
    table: jax.Array,
    *,
    dtype=jnp.float32,
    positions: jax.Array | None = None,
    token_req: jax.Array | None = None,
    window: int | None = None,
    scaled: bool = False,
    chunk: int | None = DECODE_CHUNK,
) -> tuple[Any, jax.Array]:
    """Decode only the pages of layer ``name`` that block table ``table i32[R, nb]`` lets a
    kernel read: ``(pages dtype[P', states, dim], table2 i32[R, nb])`` with ``pages[table2[r, j]]``
    the decoded page ``table[r, j]``, for the kernel in place of the pool and ``table``. Window
    layers also need ``positions``, ``token_req`` and ``window``; bad ids read NaN. Each kind's
    rule, and the ValueErrors: docs/cache.md#dsv4pagedpoolsread_for_table.
    """
    lp = layout.layer(name)
    table = _int_array(f"read_for_table({name!r}): table", table, 2)
    num_req, nb = table.shape
    if lp.kind == "ring":
        raise ValueError(f"{name!r} is a compressor ring: use read_ring_for_table")
    if lp.kind != "swa":
        if num_req * nb + 1 >= layout.num_blocks:
            return read_layer(layout, pools, name, dtype=dtype, scaled=scaled, chunk=chunk), table
        ids = jnp.concatenate([jnp.zeros(1, jnp.int32), table.reshape(-1)])
        pages = read_blocks(layout, pools, name, ids, dtype=dtype, scaled=scaled, chunk=chunk)
        return pages, _gathered_table(table)
    if positions is None or token_req is None or window is None:
        raise ValueError(
            f"read_for_table({name!r}): a window layer needs positions, token_req and window"
        )
    if window < 1:
        raise ValueError(f"read_for_table({name!r}): window must be >= 1, got {window}")
    positions = _int_array(f"read_for_table({name!r}): positions", positions, 1)
    token_req = _int_array(f"read_for_table({name!r}): token_req", token_req, 1)
    if token_req.shape != positions.shape:
        raise ValueError(
            f"read_for_table({name!r}): positions {list(positions.shape)} and token_req "
            f"{list(token_req.shape)} must both be [T]"
        )
    page = lp.states  # one token per state
    bound = window_page_bound(positions.shape[0], num_req, window, page)
    capacity = min(bound, num_req * nb)
    if capacity + 2 >= layout.num_blocks:
        return read_layer(layout, pools, name, dtype=dtype, scaled=scaled, chunk=chunk), table
    ids, table2 = _window_pages(
        table, positions, token_req, window=window, page=page, capacity=capacity
    )
    return read_blocks(layout, pools, name, ids, dtype=dtype, scaled=scaled, chunk=chunk), table2


def selected_is_smaller(layout: PoolLayout, name: str, table_shape, topk_shape) -> bool:
    """Whether `read_selected` decodes fewer records than `read_for_table` would for a step
    with block table ``table_shape`` ``(R, nb)`` and picks ``topk_shape`` ``(T, K)``: ``T·K``
    entries against ``min(R·nb + 1, num_blocks)`` whole pages (static: shapes only)."""
    lp = layout.layer(name)
    num_req, nb = table_shape
    num_tokens, k = topk_shape
    pages = min(num_req * nb + 1, layout.num_blocks)
    return num_tokens * k < pages * lp.states


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _read_entries_core(lp: LayerPool, num_blocks: int, dtype, buf, blocks, rows, valid):
    n, db, sb = lp.states, lp.data_bytes, lp.scale_bytes
    flat_b = _safe_blocks(blocks, num_blocks)
    flat_r = rows.reshape(-1)
    records = _gather_bytes(buf, lp, flat_b, lp.offset + flat_r * db, db)
    if sb:
        scales = _gather_bytes(buf, lp, flat_b, lp.offset + n * db + flat_r * sb, sb)
        records = jnp.concatenate([records, scales], -1)
    values = get_record(lp.record).decode(records, lp.dim).reshape(*blocks.shape, lp.dim)
    return jnp.where(valid[..., None], values.astype(dtype), jnp.zeros((), dtype))


def read_selected(
    layout: PoolLayout,
    pools: Mapping[str, jax.Array],
    name: str,
    table: jax.Array,
    token_req: jax.Array,
    positions: jax.Array,
    topk: jax.Array,
    *,
    dtype=jnp.float32,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Decode only the entries of compressed-entry layer ``name`` that ``topk i32[T, K]``
    (request-local entry ids, -1 = none) picks for each token, instead of whole pages: ``T·K``
    records, fewer than `read_for_table` decodes whenever `selected_is_smaller`.

    Returns:
        ``(pages dtype[T, K', dim], table2 i32[T, 1], token_req2 i32[T], topk2 i32[T, K'])``,
        K' = K rounded up to even: token ``t``'s pick ``j`` is entry ``j`` of its own page ``t``
        (docs/cache.md#dsv4pagedpoolsread_selected, with the ValueErrors).
    """
    lp = layout.layer(name)
    if lp.kind != "compressed":
        raise ValueError(f"read_selected reads compressed-entry layers; {name!r} is {lp.kind!r}")
    table = _int_array(f"read_selected({name!r}): table", table, 2)
    token_req = _int_array(f"read_selected({name!r}): token_req", token_req, 1)
    positions = _int_array(f"read_selected({name!r}): positions", positions, 1)
    topk = _int_array(f"read_selected({name!r}): topk", topk, 2)
    num_tokens, k = topk.shape
    if token_req.shape != (num_tokens,) or positions.shape != (num_tokens,):
        raise ValueError(
            f"read_selected({name!r}): token_req {list(token_req.shape)} and positions "
            f"{list(positions.shape)} must be [T] = [{num_tokens}] (topk is {list(topk.shape)})"
        )
    valid = (topk >= 0) & (positions[:, None] >= 0)
    ids = jnp.where(valid, topk, 0)
    blocks = table[token_req[:, None], ids // lp.states]
    buf = _buffer(layout, pools, lp)
    pages = _read_entries_core(
        lp, layout.num_blocks, jnp.dtype(dtype), buf, blocks, ids % lp.states, valid
    )
    own = jnp.arange(num_tokens, dtype=jnp.int32)
    picks = jnp.where(valid, jnp.arange(k, dtype=jnp.int32)[None, :], -1)
    if k % 2:  # an even page: TPU kernels pair the rows of 16-bit pages
        pages = jnp.pad(pages, ((0, 0), (0, 1), (0, 0)))
        picks = jnp.pad(picks, ((0, 0), (0, 1)), constant_values=-1)
    return pages, own[:, None], own, picks


def read_ring_for_table(
    layout: PoolLayout, pools: Mapping[str, jax.Array], name: str, ring_block: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Only the ring pages of ``ring_block i32[R]`` (0 = no ring): ``(f32[R + 1, capacity,
    2 · head_dim], ring_block2 i32[R])`` with page 0 = block 0 and ``ring_block2[r] = 1 + r``
    where ``ring_block[r] != 0`` (else 0, so "no ring" stays 0) — or, when ``R + 1 >=
    num_blocks``, `read_ring` and ``ring_block`` itself. Writes (`write_ring`) still go to the
    pool; ids outside ``[0, num_blocks)`` read NaN, never clamped."""
    _ring(layout, name)
    ring_block = _int_array(f"read_ring_for_table({name!r}): ring_block", ring_block, 1)
    num_req = ring_block.shape[0]
    if num_req + 1 >= layout.num_blocks:
        return read_ring(layout, pools, name), ring_block
    ids = jnp.concatenate([jnp.zeros(1, jnp.int32), ring_block])
    ring_block2 = jnp.where(ring_block != 0, jnp.arange(1, num_req + 1, dtype=jnp.int32), 0)
    return read_blocks(layout, pools, name, ids), ring_block2


# ---------------------------------------------------------------------------------------------
# Debug checks (host side)
# ---------------------------------------------------------------------------------------------


def _first_bad(bad: np.ndarray, values: np.ndarray) -> tuple[int, tuple[int, ...]]:
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    return int(values[where]), where


def check_slots(layout: PoolLayout, name: str, slots, *, allow_null_block: bool = False) -> None:
    """Raise a ValueError unless every slot of layer ``name`` is -1 (no write) or a slot of a
    real block: ``[states, num_blocks · states)`` (``[0, ...)`` with ``allow_null_block``; block
    0 is the null block, which nothing writes). Valid slots must also be distinct (a scatter
    with duplicate slots keeps an unspecified one). Host side: pass numpy or concrete arrays."""
    lp = layout.layer(name)
    s = np.asarray(slots)
    if not np.issubdtype(s.dtype, np.integer):
        raise ValueError(f"layer {name!r}: slots must be integers, got {s.dtype}")
    lo = 0 if allow_null_block else lp.states
    hi = layout.num_blocks * lp.states
    bad = (s != -1) & ((s < lo) | (s >= hi))
    what = f"layer {name!r} ({lp.kind}, group {lp.group})"
    if bad.any():
        value, where = _first_bad(bad, s)
        block = value // lp.states if value >= 0 else None
        why = " (block 0 is the null block)" if block == 0 else ""
        raise ValueError(
            f"{what}: slot {value} at index {list(where)} is outside [{lo}, {hi}) = blocks "
            f"[{lo // lp.states}, {layout.num_blocks}) x {lp.states} states{why}; -1 = no write"
        )
    valid = s[s != -1]
    uniq, counts = np.unique(valid, return_counts=True)
    if (counts > 1).any():
        dup = int(uniq[counts > 1][0])
        raise ValueError(
            f"{what}: slot {dup} is written {int(counts[counts > 1][0])} times in one step "
            f"(block {dup // lp.states}, row {dup % lp.states})"
        )


def check_block_ids(layout: PoolLayout, group: int, block_table) -> None:
    """Raise a ValueError unless every id of ``block_table`` (any shape, e.g. ``[R, max_blocks]``
    of group ``group``) is in ``[0, num_blocks)`` (0 = the null block, used as padding)."""
    if not 0 <= group < len(layout.groups):
        raise ValueError(f"no KV-cache group {group}; the layout has {len(layout.groups)}")
    t = np.asarray(block_table)
    if not np.issubdtype(t.dtype, np.integer):
        raise ValueError(f"group {group}: block ids must be integers, got {t.dtype}")
    bad = (t < 0) | (t >= layout.num_blocks)
    if bad.any():
        value, where = _first_bad(bad, t)
        g = layout.groups[group]
        raise ValueError(
            f"group {group} ({g.kind}, e.g. layer {g.layer_names[0]!r}): block id {value} at "
            f"{list(where)} is outside [0, {layout.num_blocks})"
        )
