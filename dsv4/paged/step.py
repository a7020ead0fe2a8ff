"""The paged model step: one ragged batch over the paged caches (`docs/architecture.md`).

`paged_step(params, cfg, layout, pools, batch)` runs the T scheduled tokens of R requests
(chunked prefills and decodes mixed) through DeepSeek-V4.1. Per layer, in the order vLLM runs
them:

1. the window latent of every token is written at ``slot_mapping[swa group]`` (overwrite by
   position: a rejected speculative token is simply rewritten later);
2. kv sources compress: the pre-rope latent of every row that closes a group (ratio-2 pairs
   straddling a chunk boundary are closed from the ring), its entry rotated at the group's first
   position and its index key written at the compressed slot of their groups; the chunk's last
   raw rows go to the ring;
3. index sources score their kv source's index keys and select the top-k (candidate blocks at
   the candidate source, masked at later index sources); reuse layers take the latest top-k;
4. one softmax over the window (read through the window block table) and the selected
   compressed entries (read through the compressed block table), with the per-head sink.

Writes go through slot mappings, straight into the pools. Reads go through block tables, but the
step decodes only the pages its tables reference (`pools.read_for_table` /
`pools.read_ring_for_table`): every entry of the index-key tables, the columns of the window
table that the batch's windows cover, one ring page per request — plus a copy of the null block —
and hands the kernels those pages with a table remapped into them. The sparse attention reads
K picked entries per token, so where the batch's T·K picks are fewer than the compressed pages
its table references, only those entries are decoded (`pools.read_selected`: each token's picks
on a page of its own), not the pages. Long reads decode ``pools.DECODE_CHUNK`` pages at a time. Each read comes
after the layer's writes (a window includes its own token; an entry closed in this step is
visible). Where the page count bound is not smaller than the pool (a static choice by shapes), the
whole pool is decoded and the original table used. The step never allocates and never clamps (a
slot of -1 writes nothing; an out-of-range id reads NaN, and the builder's debug check catches
it).
Caches are whatever `dsv4.paged.pools` holds (aliased or separate pools of f32 / bf16 / fp8 /
FP4 records); the attention math runs through `pallas_kernels` (the jnp references on CPU, the
Pallas kernels on TPU and GPU). On a mesh of more than one device (the steps' ``mesh=``, static)
each kernel runs inside a `jax.shard_map` (XLA cannot partition a Pallas call): the window and
sparse attention with their heads split over ``model``, the indexer and the compressor whole on
every device (`local_kernel`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from cache.layout import compressed_kv_name, indexer_k_name, ring_name, swa_cache_name
from dsv4 import engram
from dsv4 import layers as L
from dsv4.block import decoder_layers
from dsv4.config import ModelConfig, Role, rope_inv_freq
from dsv4.inputs import check_model_params, check_token_ids
from dsv4.paged import pools as P
from dsv4.paged.batch import StepBatch
from pallas_kernels.backend import tpu_num_cores
from pallas_kernels.compressor import compressor
from pallas_kernels.indexer import indexer_topk
from pallas_kernels.sparse_attention import sparse_attention
from pallas_kernels.window_attention import window_attention

__all__ = [
    "ATTENTION_HEADS",
    "data_shards",
    "engram_rows",
    "local_kernel",
    "paged_forward",
    "paged_forward_streams",
    "paged_step",
    "paged_step_data_parallel",
    "paged_step_data_parallel_jit",
    "paged_step_jit",
    "records_quantise",
    "stack_shards",
]


def records_quantise(layout, kind: str) -> bool:
    """Whether the cache records of this kind already quantise (so the step must not QDQ)."""
    return layout.formats.record(kind) not in ("f32", "bf16")


def local_kernel(kernel, args: tuple, kwargs: dict, heads: dict | None = None, *, mesh=None):
    """``kernel(*args, **kwargs)``, inside a `jax.shard_map` over ``mesh`` when it has more than
    one device: XLA cannot partition a Pallas call, so each device runs the kernel on its own
    operands. ``heads`` maps an argument (position or keyword) to its head dim: those, and every
    output at dim 1, split over ``model`` when it divides ``args[0]``'s heads; the rest is
    replicated (`docs/scale_out.md#kernels-on-a-mesh`). Without such a mesh: called as it is."""
    if mesh is None or mesh.empty or mesh.size == 1:
        return kernel(*args, **kwargs)
    model = dict(mesh.shape).get("model", 1)
    split = bool(heads) and model > 1 and args[0].shape[1] % model == 0
    heads = {str(k): d for k, d in (heads or {}).items()}  # pytree dict keys: one type
    named = {str(i): a for i, a in enumerate(args)} | kwargs

    def is_operand(v) -> bool:
        leaves = jax.tree.leaves(v)
        return bool(leaves) and all(isinstance(leaf, jax.Array) for leaf in leaves)

    operands = {k: v for k, v in named.items() if is_operand(v)}

    def spec(key):
        d = heads.get(key)
        return PartitionSpec() if not split or d is None else PartitionSpec(*[None] * d, "model")

    def body(local):
        merged = named | local
        return kernel(*(merged[str(i)] for i in range(len(args))), **{k: merged[k] for k in kwargs})

    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=({k: jax.tree.map(lambda _, k=k: spec(k), v) for k, v in operands.items()},),
        out_specs=PartitionSpec(None, "model") if split else PartitionSpec(),
        check_vma=False,
    )(operands)


def core_options(mesh) -> dict[str, int]:
    """The attention kernels' ``num_cores`` read from ``mesh``'s device (nothing without a mesh:
    the kernels then ask the default device), so a step lowered for another chip splits its
    tiles over that chip's TensorCores with no ambient mesh."""
    return {} if mesh is None else {"num_cores": tpu_num_cores(mesh)}


# the head axis of window / sparse attention's operands (q [T, H, D], sink [H]): `local_kernel`
ATTENTION_HEADS = {0: 1, 5: 0}


def _attention(
    x, params, layer: int, cfg: ModelConfig, layout, pools, batch: StepBatch, shared, kern, scaled,
    mesh,
):  # fmt: skip
    """One layer's attention over the step's batch: the window latents written and read, then
    (compressed layers) the compressor at kv sources, the top-k at index sources and one
    softmax over the window and the picked entries. ``shared`` carries the latest top-k (and
    candidate blocks) from index sources to the layers that reuse them; it is updated here."""
    info = cfg.plan[layer]
    a = f"layers.{layer}.attn."
    r = info.ratio
    pos = batch.positions
    real = pos >= 0
    safe_pos = jnp.where(real, pos, 0)
    tok_req = batch.token_req
    cos, sin = L.rope_tables(cfg, r, safe_pos)  # [T, rope/2]
    qdq_latent = cfg.quant_sim and not records_quantise(layout, "swa")
    qr, q, kv = L.query_and_latent(x, params, a, cfg, cos, sin, qdq_latent=qdq_latent)
    swa_pages, swa_table, pools = _window_pages(layer, cfg, layout, pools, batch, kv, q.dtype)
    scale = cfg.head_dim**-0.5
    sink = params[a + "attn_sink"]
    win_kwargs = dict(window=cfg.window_size, scale=scale, replay_start=batch.replay_start, **kern,
                      **core_options(mesh))  # fmt: skip
    if not r:
        o = local_kernel(
            window_attention,
            (q, swa_pages, swa_table, tok_req, pos, sink),
            win_kwargs,
            ATTENTION_HEADS,
            mesh=mesh,
        )
        return L.attention_output(o.astype(x.dtype), cos, sin, params, a, cfg), pools

    if info.role is Role.FULL:
        pools = _compress(x, params, a, layer, cfg, layout, pools, batch, kern, mesh)
    visible = jnp.where(real, (safe_pos + 1) // r, 0)
    if info.role in (Role.FULL, Role.REINDEX):
        qi, w = L.index_query(x, qr, params, a, cfg, cos, sin)
        _select(qi, w, x.dtype, layer, cfg, layout, pools, batch, visible, shared, kern, scaled,
                mesh)  # fmt: skip
    state = local_kernel(
        window_attention,
        (q, swa_pages, swa_table, tok_req, pos, sink),
        dict(win_kwargs, return_state=True),
        ATTENTION_HEADS,
        mesh=mesh,
    )
    topk = shared["topk"]
    o, pools = _sparse(q, sink, state, layer, cfg, layout, pools, batch, topk, kern, mesh)
    return L.attention_output(o.astype(x.dtype), cos, sin, params, a, cfg), pools


def _window_pages(layer: int, cfg: ModelConfig, layout, pools, batch: StepBatch, kv, dtype):
    """Write the window latents ``kv`` [T, head_dim] of the layer's tokens, then read the pages
    their windows cover: ``(pages, table, pools)``, the pages in ``dtype`` with the window
    table remapped into them."""
    pos = batch.positions
    swa = swa_cache_name(layer)
    g_swa = layout.group_of(swa)
    pools = P.write_layer(layout, pools, swa, batch.window_slots[g_swa], kv)
    # read after the write: the window of token p includes p itself
    swa_pages, swa_table = P.read_for_table(
        layout,
        pools,
        swa,
        batch.block_tables[g_swa],
        dtype=dtype,
        positions=pos,
        token_req=batch.token_req,
        window=cfg.window_size,
    )
    # The window pages are read now but used after the compressor's writes (kv sources):
    # without this, XLA fuses the read into the attention, after the writes, and copies the
    # whole pool to keep the old bytes for it (a step that costs O(pool) instead of O(batch)).
    return jax.lax.optimization_barrier((swa_pages, swa_table, pools))


def _select(qi, w, dtype, layer: int, cfg: ModelConfig, layout, pools, batch, visible, shared,
            kern, scaled, mesh) -> None:  # fmt: skip
    """The indexer of an index source: the top-k compressed entries of each token among its
    ``visible`` [T] ones, from index queries ``qi`` and weights ``w``, into ``shared["topk"]``
    (and, at the candidate source, its candidate blocks into ``shared["candidates"]``)."""
    info = cfg.plan[layer]
    ikey_name = indexer_k_name(info.kv_source)
    g_ikey = layout.group_of(ikey_name)
    # keys and queries in the activation dtype (bf16 when serving): half the bytes the
    # indexer streams; its scores accumulate in f32 either way. fp8 index-key records go
    # to the indexer as they are (e4m3 rows + scales: half the bytes again)
    ikey_pages, ikey_table = P.read_for_table(
        layout, pools, ikey_name, batch.block_tables[g_ikey], dtype=dtype, scaled=scaled
    )
    e_ikey = layout.layer(ikey_name).states
    kw: dict[str, Any] = dict(entries_per_block=e_ikey, k=cfg.index_topk, **kern)
    if scaled:
        ikey_pages, kw["key_scales"] = ikey_pages
    if info.is_candidate_source or info.uses_candidates:
        kw.update(
            candidate_block_size=cfg.candidate_block_size,
            candidate_topk_blocks=cfg.candidate_topk_blocks,
        )
    if not info.is_candidate_source and info.uses_candidates:
        kw["candidates"] = shared["candidates"]
    out = local_kernel(
        indexer_topk,
        (qi.astype(dtype), w.astype(jnp.float32), ikey_pages, ikey_table, batch.token_req,
         batch.positions, visible),
        kw,
        mesh=mesh,
    )  # fmt: skip
    if info.is_candidate_source:
        shared["topk"], shared["candidates"] = out
    else:
        shared["topk"] = out


def _sparse(q, sink, state, layer: int, cfg: ModelConfig, layout, pools, batch, topk, kern, mesh):
    """The sparse attention of a compressed layer: queries ``q`` [T, H, D] over the compressed
    entries ``topk`` [T, K] picks, merged with the window attention's ``state``. Returns the
    output [T, H, D] and the pools."""
    comp_name = compressed_kv_name(cfg.plan[layer].kv_source)
    e_comp = layout.layer(comp_name).states
    pos, sel_req = batch.positions, batch.token_req
    table = batch.block_tables[layout.group_of(comp_name)]
    # entries closed in this step were written by _compress before, so they are visible here
    if P.selected_is_smaller(layout, comp_name, table.shape, topk.shape):
        # only the picked entries, each token's on a page of its own (the whole pool's
        # decode is what a long-context step held otherwise: O(context), not O(T·K))
        comp_pages, comp_table, sel_req, topk = P.read_selected(
            layout, pools, comp_name, table, sel_req, pos, topk, dtype=q.dtype
        )
        e_comp = topk.shape[1]
    else:
        comp_pages, comp_table = P.read_for_table(layout, pools, comp_name, table, dtype=q.dtype)
    # decoded before the pools move on: without this barrier XLA:TPU held more decoded pages
    # at once (the released-width 12-layer step at 16 x 65,536 tokens: 12.1 GiB of
    # temporaries against 9.6, `planner.compiled_step`)
    comp_pages, comp_table, pools = jax.lax.optimization_barrier((comp_pages, comp_table, pools))
    o = local_kernel(
        sparse_attention,
        (q, comp_pages, comp_table, sel_req, pos, topk, sink),
        dict(
            entries_per_block=e_comp,
            scale=cfg.head_dim**-0.5,
            state=state,
            **kern,
            **core_options(mesh),
        ),
        {0: 1, 6: 0, "state": 1},
        mesh=mesh,
    )
    return o, pools


def _compress(x, params, a: str, layer: int, cfg: ModelConfig, layout, pools, batch, kern, mesh):
    """Compressor of a kv source: compressed entries, index keys and (ratio 2) ring rows."""
    r = cfg.plan[layer].ratio
    pos = batch.positions
    real = pos >= 0
    tok_req = batch.token_req
    comp_name, ikey_name = compressed_kv_name(layer), indexer_k_name(layer)
    inv_freq = jnp.asarray(np.asarray(rope_inv_freq(cfg, r), np.float32))
    # records are written below through the pools (any record format), not by the kernel: it
    # gets no slots and no pages, and gives the latents in the activation dtype
    if r == 1:
        kv = L.linear(x, params, a + "compressor.wkv.weight", cfg)
        latent, _, _ = local_kernel(
            compressor,
            (kv, tok_req, pos, batch.query_start_loc, params[a + "compressor.norm.weight"],
             inv_freq, None, None, None, None),
            dict(ratio=1, eps=cfg.norm_eps, latent_dtype=x.dtype, **kern),
            mesh=mesh,
        )  # fmt: skip
    else:
        xf = x.astype(jnp.float32)
        a_ = jnp.einsum("td,od->to", xf, params[a + "compressor.wkv.weight"].astype(jnp.float32))
        s_ = jnp.einsum("td,od->to", xf, params[a + "compressor.wgate.weight"].astype(jnp.float32))
        kv = jnp.concatenate([a_, s_], axis=-1)
        rname = ring_name(layer)
        g_ring = layout.group_of(rname)
        # only the batch's ring pages, read before this chunk's rows are written to the pool
        ring, ring_block = P.read_ring_for_table(
            layout, pools, rname, batch.block_tables[g_ring][:, 0]
        )
        # the ring rows are read before this chunk's rows overwrite them: the writes wait for
        # the read, so XLA updates the pool in place instead of copying all of it first
        ring, ring_block, pools = jax.lax.optimization_barrier((ring, ring_block, pools))
        latent, _, _ = local_kernel(
            compressor,
            (kv, tok_req, pos, batch.query_start_loc, params[a + "compressor.norm.weight"],
             inv_freq, None, ring_block, None, ring),
            dict(ratio=2, eps=cfg.norm_eps, latent_dtype=x.dtype, **kern),
            mesh=mesh,
        )  # fmt: skip
        pools = P.write_ring(layout, pools, rname, batch.ring_slots[g_ring], kv)
    latent = latent.astype(x.dtype)
    gpos = jnp.where(real, pos - pos % r, 0)
    gcos, gsin = L.rope_tables(cfg, r, gpos)
    k, c = L.key_and_entry(
        latent,
        params,
        a,
        cfg,
        gcos,
        gsin,
        qdq_key=cfg.quant_sim and not records_quantise(layout, "index"),
        qdq_entry=cfg.quant_sim and not records_quantise(layout, "compressed"),
    )
    g_comp, g_ikey = layout.group_of(comp_name), layout.group_of(ikey_name)
    pools = P.write_layer(layout, pools, comp_name, batch.state_slots[(g_comp, r)], c)
    pools = P.write_layer(layout, pools, ikey_name, batch.state_slots[(g_ikey, r)], k)
    return pools


def engram_rows(params, cfg: ModelConfig, batch: StepBatch) -> tuple[jax.Array, jax.Array]:
    """Engram's table rows int32[T, engram layers, columns] of the step's tokens, and bool[T],
    False at padding and at tokens that take part in no n-gram. A look-back inside the
    request's chunk reads the batch's tokens (device-fed ones included); one before the chunk
    reads ``batch.engram_prev``."""
    n = cfg.engram_max_ngram_size
    m = n - 1
    t = batch.token_ids.shape[0]
    if batch.engram_prev is None or batch.engram_prev.shape[-1] != m:
        got = None if batch.engram_prev is None else batch.engram_prev.shape
        raise ValueError(
            f"an Engram model needs batch.engram_prev of shape [R, {m}] (build_batch(..., "
            f"engram_lookback={m})), got {got}"
        )
    pos = batch.positions
    idx = jnp.arange(t)
    offset = idx - batch.query_start_loc[batch.token_req]  # index inside the request's chunk
    looked = []
    for k in range(n):
        inside = offset >= k
        tok = batch.token_ids[jnp.maximum(idx - k, 0)]
        if k:
            before = batch.engram_prev[batch.token_req, jnp.clip(k - offset - 1, 0, m - 1)]
            tok = jnp.where(inside, tok, before)
        cid = jnp.where(tok >= 0, engram.compressed_ids(params, jnp.maximum(tok, 0)), engram.DEAD)
        looked.append(jnp.where(pos - k >= 0, cid, engram.DEAD))
    look = jnp.stack(looked, axis=-1)  # [T, n]
    pad = engram.compressed_ids(params, jnp.int32(cfg.engram_pad_id))
    return engram.row_ids(cfg, look, pad), (pos >= 0) & (look[:, 0] != engram.DEAD)


def paged_forward(
    params,
    cfg: ModelConfig,
    layout,
    pools: dict[str, jax.Array],
    batch: StepBatch,
    *,
    impl: str | None = None,
    interpret: Any = False,
    scaled_index_keys: bool = True,
    mesh=None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The backbone over one step's batch: the LM head's input for every token, [T, dim] in the
    activation dtype (`dsv4.layers.final_hidden`), and the updated pools.

    Args:
        impl: the attention kernels (`pallas_kernels`; None: jnp on CPU, Pallas on TPU / GPU).
        interpret: the Pallas kernels' interpret mode.
        scaled_index_keys: ``fp8_132`` index keys to the indexer undecoded (half the bytes).
        mesh: the device mesh (kernels per device, experts dispatched over ``expert``).
    """
    h, pools, _ = paged_forward_streams(
        params, cfg, layout, pools, batch, (), impl=impl, interpret=interpret,
        scaled_index_keys=scaled_index_keys, mesh=mesh,
    )  # fmt: skip
    return h, pools


def paged_forward_streams(
    params,
    cfg: ModelConfig,
    layout,
    pools: dict[str, jax.Array],
    batch: StepBatch,
    layers: tuple[int, ...] = (),
    *,
    impl: str | None = None,
    interpret: Any = False,
    scaled_index_keys: bool = True,
    shard_axis: bool = False,
    mesh=None,
) -> tuple[jax.Array, dict[str, jax.Array], dict[int, jax.Array]]:
    """`paged_forward`, and the residual stream [T, hc, dim] entering each layer of ``layers``
    (after its Engram update, before its attention's mix): what the DSpark drafter reads.

    ``shard_axis`` (`paged_step_data_parallel`): the pools, every batch field and the results
    carry a leading axis of D data shards; what reads the pools or per-request fields runs per
    shard (`jax.vmap`, split over ``mesh``'s ``data`` axis), the rest on all D x T tokens."""
    kern = {"impl": impl} if impl in (None, "reference") else {"impl": impl, "interpret": interpret}
    scaled = scaled_index_keys and layout.formats.record("index") in P.SCALED_RECORDS

    def attention(layer, h, pools, batch, shared):
        shared = dict(shared)
        att, pools = _attention(
            h, params, layer, cfg, layout, pools, batch, shared, kern, scaled, mesh
        )
        return att, pools, shared

    def rows_of(batch):
        return engram_rows(params, cfg, batch)

    if shard_axis:
        attention, rows_of = _per_shard(attention, rows_of, mesh)

    def block_attention(layer, h, state):
        pools, shared = state
        att, pools, shared = attention(layer, h, pools, batch, shared)
        return att, (pools, shared)

    # tokens [T] ([D, T] with shard_axis), and so every per-token array
    h, (pools, _), streams = decoder_layers(
        params,
        cfg,
        batch.token_ids,
        block_attention,
        (pools, {}),
        engram_rows=rows_of(batch) if cfg.engram_layer_ids else None,
        capture=layers,
        mesh=mesh,
    )
    return h, pools, streams


def _per_shard(attention, rows_of, mesh):
    """``attention(layer, h, pools, batch, shared)`` and ``rows_of(batch)`` over a leading axis
    of data shards (`jax.vmap`; ``spmd_axis_name="data"`` on a mesh with a ``data`` axis of
    more than one device, where each shard's tokens and pools are also pinned to its devices)."""
    split = "data" if data_shards(mesh) > 1 else None
    per_shard = jax.vmap(attention, in_axes=(None, 0, 0, 0, 0), spmd_axis_name=split)
    rows_of = jax.vmap(rows_of, spmd_axis_name=split)
    if split is None:
        return per_shard, rows_of
    # a shard's tokens whole on each of its devices (the MoE leaves them split over every
    # axis), and its pools on its own devices: otherwise XLA splits the page writes over the
    # shard's devices and gathers the shard's whole pools back
    on_data = functools.partial(
        jax.lax.with_sharding_constraint, shardings=NamedSharding(mesh, PartitionSpec(split))
    )

    def pinned(layer, h, pools, batch, shared):
        att, pools, shared = per_shard(layer, on_data(h), pools, on_data(batch), shared)
        return on_data(att), on_data(pools), shared

    return pinned, rows_of


def paged_step(
    params,
    cfg: ModelConfig,
    layout,
    pools: dict[str, jax.Array],
    batch: StepBatch,
    *,
    all_logits: bool = False,
    shard_axis: bool = False,
    **kw,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One step: logits f32[R, vocab] at ``batch.logits_indices`` (or f32[T, vocab] for every
    token with ``all_logits``) and the updated pools.

    ``batch`` is a `dsv4.paged.batch.StepBatch` (built by `build_batch`); ``shard_axis``: the
    data-parallel step (`paged_step_data_parallel`); the other keywords (``impl``,
    ``interpret``, ``scaled_index_keys``, ``mesh``) are those of `paged_forward`."""
    where = "paged_step_data_parallel" if shard_axis else "paged_step"
    if not isinstance(batch, StepBatch):
        raise TypeError(f"{where}: batch must be a StepBatch (build_batch), got {type(batch)}")
    # under jit (the engine's step) only shapes are checked, once per trace
    if shard_axis:
        _check_shards(pools, batch, kw.get("mesh"))
    ndim = 2 if shard_axis else 1
    check_token_ids(where, "batch.token_ids", batch.token_ids, cfg.vocab_size, ndim=ndim)
    check_model_params(where, params, cfg)
    # the pools keep their placement: with shard_axis every layer's attention pins them to data
    h, pools, _ = paged_forward_streams(
        params, cfg, layout, pools, batch, (), shard_axis=shard_axis, **kw
    )
    if not all_logits:
        idx = batch.logits_indices
        h = jnp.take_along_axis(h, idx[..., None], axis=1) if shard_axis else h[idx]
    return L.lm_head(params, h), pools


def _jitted(step, doc: str):
    """``step(params, cfg, layout, pools, batch, **kw)`` under jit as ``(params, pools, batch, *,
    cfg, layout, **kw)``, the config, layout, switches and mesh static and the pools donated
    (updated in place on device)."""

    @functools.partial(
        jax.jit,
        static_argnames=("cfg", "layout", "all_logits", "impl", "interpret", "scaled_index_keys",
                         "mesh"),
        donate_argnames=("pools",),
    )  # fmt: skip
    def jitted(params, pools, batch, *, cfg, layout, all_logits=False, impl=None,
               interpret=False, scaled_index_keys=True, mesh=None):  # fmt: skip
        return step(
            params, cfg, layout, pools, batch, all_logits=all_logits, impl=impl,
            interpret=interpret, scaled_index_keys=scaled_index_keys, mesh=mesh,
        )  # fmt: skip

    jitted.__doc__ = doc
    return jitted


paged_step_jit = _jitted(paged_step, "`paged_step` under jit; the pools are donated.")


# -- data-parallel attention: one set of pools and one batch per data shard --------------------


def data_shards(mesh) -> int:
    """The ``data`` axis size of ``mesh``; 1 without a mesh or without such an axis."""
    if mesh is None or mesh.empty:
        return 1
    return dict(mesh.shape).get("data", 1)


def stack_shards(trees) -> Any:
    """One pytree of ``D`` pytrees of equal structure and shapes (per-shard pools, or per-shard
    `StepBatch`es built with the same buckets): every leaf stacked on a new leading axis of
    size ``D``, the layout `paged_step_data_parallel` takes.

    Raises:
        ValueError: no trees, or trees whose structures or leaf shapes differ (shards of a batch
            must share their token, request and table-width buckets), naming the shard.
    """
    trees = list(trees)
    if not trees:
        raise ValueError("stack_shards: no shards")
    first, treedef = jax.tree.flatten(trees[0])
    leaves = [first]
    for i, tree in enumerate(trees[1:], 1):
        got, other = jax.tree.flatten(tree)
        if other != treedef:
            raise ValueError(f"stack_shards: shard {i} has another structure than shard 0")
        for a, b in zip(first, got):
            if np.shape(a) != np.shape(b):
                raise ValueError(
                    f"stack_shards: shard {i} has a leaf of shape {np.shape(b)} where shard 0 "
                    f"has {np.shape(a)}: build every shard's batch with the same buckets"
                )
        leaves.append(got)
    stack = np.stack if all(isinstance(x, np.ndarray) for x in first) else jnp.stack
    return jax.tree.unflatten(treedef, [stack(xs) for xs in zip(*leaves)])


def _check_shards(pools: dict[str, jax.Array], batch: StepBatch, mesh) -> None:
    """Raise `paged_step_data_parallel`'s ValueError where ``batch`` has no leading shard axis
    ``D``, a pool's leading axis is not ``D``, or ``D`` is not a multiple of ``mesh``'s
    ``data`` size."""
    d = batch.token_ids.shape[0] if batch.token_ids.ndim == 2 else None
    if d is None:
        raise ValueError(
            f"paged_step_data_parallel: batch.token_ids must be [D, T] (stack_shards of the "
            f"shards' batches), got shape {list(batch.token_ids.shape)}"
        )
    for key, buf in pools.items():
        if buf.shape[:1] != (d,):
            raise ValueError(
                f"paged_step_data_parallel: pool {key!r} has shape {list(buf.shape)}, expected "
                f"a leading shard axis of {d} (stack_shards of {d} pools)"
            )
    n = data_shards(mesh)
    if d % n:
        raise ValueError(
            f"paged_step_data_parallel: {d} shards cannot be split over the mesh's data axis "
            f"of {n}: give a multiple of {n}"
        )


def paged_step_data_parallel(
    params, cfg: ModelConfig, layout, pools: dict[str, jax.Array], batch: StepBatch, **kw
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """vLLM's data-parallel attention: ``D`` independent steps in one program, each over its own
    requests and pools (a leading shard axis: `stack_shards`), sharing the params; returns
    logits f32[D, R, vocab] (f32[D, T, vocab] with ``all_logits``) and the pools [D, ...],
    shard ``i``'s those of `paged_step` on shard ``i``; keywords: `paged_step`'s
    (`docs/scale_out.md#data-parallel-attention`).

    Raises:
        ValueError: ``D`` not a multiple of the mesh's ``data`` size, or pools whose leading
            axis is not ``D``.
    """
    return paged_step(params, cfg, layout, pools, batch, shard_axis=True, **kw)


paged_step_data_parallel_jit = _jitted(
    paged_step_data_parallel, "`paged_step_data_parallel` under jit; the pools are donated."
)
