"""Mosaic TPU compressor: one grid step per tile of ``TILE`` consecutive tokens.

Design notes: pallas_kernels/README.md, "pallas_kernels/compressor/tpu.py".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.backend import cdiv, cost_estimate, tpu_interpret
from pallas_kernels.compressor.common import cost, pair_pool, prepare, rms_norm

__all__ = ["compressor", "token_metadata"]

TILE = 8
CLOSES, FROM_RING = 1, 2


def token_metadata(a, *, ratio: int, cap: int):
    """Per-token addresses and flags: (slot, ring_src, ring_dst, flags, group_pos).

    ``slot``: record row in the flattened pages or -1; ``ring_src``: flattened ring row the
    token's pair starts from or -1; ``ring_dst``: flattened ring row the token's raw row is
    stored to or -1; ``flags``: CLOSES | FROM_RING bits; ``group_pos`` f32: the group's first
    position (rope angle). ``a``: the compressor's `common.Arrays`."""
    token_req, positions, query_start_loc = a.token_req, a.positions, a.query_start_loc
    comp_slot, ring_block = a.comp_slot, a.ring_block
    t = positions.shape[0]
    valid = positions >= 0
    if ratio == 1:
        closes = valid
        from_ring = jnp.zeros((t,), bool)
        ring_src = ring_dst = jnp.full((t,), -1, jnp.int32)
    else:
        first = jnp.arange(t) == query_start_loc[token_req]
        rb = ring_block[token_req]
        odd = positions % 2 == 1
        closes = valid & odd & (~first | (rb != 0))
        from_ring = closes & first
        ring_src = jnp.where(from_ring, rb * cap + jnp.mod(positions - 1, cap), -1)
        end = query_start_loc[token_req + 1]
        keep = valid & (rb != 0) & (jnp.arange(t) >= end - cap)
        ring_dst = jnp.where(keep, rb * cap + positions % cap, -1)
    slot = jnp.where(closes & (comp_slot >= 0), comp_slot, -1)
    flags = closes.astype(jnp.int32) * CLOSES + from_ring.astype(jnp.int32) * FROM_RING
    group_pos = (ratio * (positions // ratio)).astype(jnp.float32)
    return slot, ring_src, ring_dst, flags, group_pos


def rope_lanes(inv_freq, d):
    """Per-lane inverse frequency [1, D] (0 on the un-rotated head, each frequency on both lanes
    of its pair) and the sign of the sine term (-1 on even lanes, +1 on odd)."""
    half = inv_freq.shape[0]
    head = d - 2 * half
    inv = jnp.concatenate([jnp.zeros((head,), jnp.float32), jnp.repeat(inv_freq, 2)])
    sign = jnp.where(jnp.arange(d) % 2 == 0, -1.0, 1.0).astype(jnp.float32)
    return inv[None, :], sign[None, :]


def rotate(z, group_pos, inv_lane, sign_lane):
    """Interleaved-pair rotation of rows z [N, D] at positions group_pos [N, 1] (f32 math).

    ``y[2i] = x[2i] c - x[2i+1] s`` and ``y[2i+1] = x[2i+1] c + x[2i] s``: the partner lane
    comes from two lane rolls, the sign from ``sign_lane``."""
    d = z.shape[-1]
    x = z.astype(jnp.float32)
    angle = group_pos * inv_lane
    lane = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
    nxt = pltpu.roll(x, d - 1, 1)  # x[l + 1] at lane l
    prv = pltpu.roll(x, 1, 1)  # x[l - 1] at lane l
    partner = jnp.where(lane % 2 == 0, nxt, prv)
    return x * jnp.cos(angle) + partner * (sign_lane * jnp.sin(angle))


# over 60 lines: one kernel body: a tile's ring reads, pooling, norm, rotation and DMAs
def _kernel(
    slot_ref,  # SMEM i32[Tp]
    src_ref,  # SMEM i32[Tp]
    dst_ref,  # SMEM i32[Tp]
    kv_ref,  # VMEM [TILE, W]
    prev_ref,  # VMEM [8, W]: its last row is the token before the tile
    flags_ref,  # VMEM i32[TILE, 1]
    gpos_ref,  # VMEM f32[TILE, 1]
    w_ref,  # VMEM [1, D]
    inv_ref,  # VMEM f32[1, D]
    sign_ref,  # VMEM f32[1, D]
    pages_in,  # HBM (aliased to pages_hbm)
    *rest,
    ratio,
    eps,
    d,
    latent_dtype,
):
    if ratio == 2:
        _, latent_ref, pages_hbm, ring_hbm, ring_rows, raw_ref, entry_ref, sems = rest
    else:
        latent_ref, pages_hbm, entry_ref, sems = rest
        ring_hbm = ring_rows = raw_ref = None
    base = pl.program_id(0) * TILE
    kv = kv_ref[...]
    flags = flags_ref[...]
    closes = (flags & CLOSES) != 0

    if ratio == 1:
        z = rms_norm(kv, w_ref[...], eps, latent_dtype)
    else:

        def ring_copy(j):
            row = jnp.maximum(src_ref[base + j], 0)
            return pltpu.make_async_copy(ring_hbm.at[pl.ds(row, 1)], ring_rows.at[j], sems.at[0])

        for j in range(TILE):

            @pl.when(src_ref[base + j] >= 0)
            def _start(j=j):
                ring_copy(j).start()

        for j in range(TILE):

            @pl.when(src_ref[base + j] >= 0)
            def _wait(j=j):
                ring_copy(j).wait()

        # the previous token's row: shift the tile down one row, row 0 from the block before
        row = jax.lax.broadcasted_iota(jnp.int32, kv.shape, 0)
        shifted = pltpu.roll(kv, 1, 0)
        shifted = jnp.where(row == 0, prev_ref[7:8, :], shifted)
        ring = jnp.concatenate([ring_rows[j] for j in range(TILE)], axis=0)
        member0 = jnp.where((flags & FROM_RING) != 0, ring, shifted)
        for j in range(TILE):  # one row per tile-aligned slot: single-row DMAs stay aligned
            raw_ref[j] = kv[j : j + 1]
        pooled = pair_pool(member0[:, :d], member0[:, d:], kv[:, :d], kv[:, d:])
        z = rms_norm(pooled.astype(latent_dtype), w_ref[...], eps, latent_dtype)

    latent = jnp.where(closes, z, jnp.zeros_like(z))
    latent_ref[...] = latent
    entry = rotate(latent, gpos_ref[...], inv_ref[...], sign_ref[...])
    entry = entry.astype(entry_ref.dtype)
    for j in range(TILE):
        entry_ref[j] = entry[j : j + 1]

    def record_copy(j):
        row = jnp.maximum(slot_ref[base + j], 0)
        return pltpu.make_async_copy(entry_ref.at[j], pages_hbm.at[pl.ds(row, 1)], sems.at[1])

    def ring_store(j):
        row = jnp.maximum(dst_ref[base + j], 0)
        return pltpu.make_async_copy(raw_ref.at[j], ring_hbm.at[pl.ds(row, 1)], sems.at[2])

    def for_stores(fn):  # fn: start or wait, on every record and ring row the tile stores
        for j in range(TILE):

            @pl.when(slot_ref[base + j] >= 0)
            def _record(j=j):
                fn(record_copy(j))

            if ratio == 2:

                @pl.when(dst_ref[base + j] >= 0)
                def _ring(j=j):
                    fn(ring_store(j))

    for_stores(lambda cp: cp.start())
    for_stores(lambda cp: cp.wait())


def compressor(*arrays, ratio: int, eps: float, latent_dtype=None, interpret=False):
    """Mosaic TPU compressor; the arguments and results of `reference.compressor`."""
    a, d, latent_dtype, records = prepare(arrays, ratio=ratio, latent_dtype=latent_dtype)
    comp_pages, ring_pages = a.comp_pages, a.ring_pages
    if comp_pages.dtype.itemsize != 4:
        # a record is one row of a tiled HBM array; rows of a 16-bit array are packed in pairs,
        # so a single-row DMA cannot address one (Mosaic: "unit subtile (2)")
        raise NotImplementedError(
            f"compressor (tpu): comp_pages of {comp_pages.dtype} records; the TPU kernel writes "
            "32-bit records (f32 here, the quantised formats later)"
        )
    t, width = a.kv.shape
    cap = ring_pages.shape[1] if ratio == 2 else 1
    slot, src, dst, flags, gpos = token_metadata(a, ratio=ratio, cap=cap)
    tp = cdiv(max(t, 1), TILE) * TILE
    pad = tp - t

    def pad_rows(x, value):
        return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=value)

    kv_p = pad_rows(a.kv, 0)
    slot, src, dst = (pad_rows(x, -1) for x in (slot, src, dst))
    flags = pad_rows(flags, 0)[:, None]
    gpos = pad_rows(gpos, 0)[:, None]
    inv_lane, sign_lane = rope_lanes(a.inv_freq.astype(jnp.float32), d)
    tiles = (kv_p, flags, gpos, inv_lane, sign_lane)
    in_specs, out_specs, out_shape, scratch, aliases, operands = _specs(
        tiles, a, ratio=ratio, width=width, tp=tp, latent_dtype=latent_dtype
    )
    c = cost(t, d, ratio=ratio, record_dtype=comp_pages.dtype, ring_rows=min(t, cap))
    outs = pl.pallas_call(
        functools.partial(_kernel, ratio=ratio, eps=eps, d=d, latent_dtype=latent_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(tp // TILE,),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        out_shape=out_shape,
        input_output_aliases=aliases,
        # sequential: a tile's ring reads must precede later tiles' ring writes
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        cost_estimate=cost_estimate(c["flops"], c["bytes"], transcendentals=2 * t * d),
        interpret=tpu_interpret(interpret),
    )(slot, src, dst, *operands)
    latent = outs[0][:t]
    pages = outs[1].reshape(comp_pages.shape)
    ring = outs[2].reshape(ring_pages.shape) if ratio == 2 else None
    return latent, pages if records else None, ring


def _specs(tiles, a, *, ratio: int, width: int, tp: int, latent_dtype):
    """(in_specs, out_specs, out_shape, scratch, aliases, operands) of the kernel: token tiles in
    VMEM, the record pages (and ratio 2's ring) aliased in place in HBM."""
    comp_pages, ring_pages = a.comp_pages, a.ring_pages
    p, e, d = comp_pages.shape
    pages_flat = comp_pages.reshape(p * e, d)
    row_block = lambda i, *_: (i, 0)  # noqa: E731
    whole = lambda i, *_: (0, 0)  # noqa: E731
    in_specs = [
        pl.BlockSpec((TILE, width), row_block),
        pl.BlockSpec((8, width), lambda i, *_: (jnp.maximum(i * (TILE // 8) - 1, 0), 0)),
        pl.BlockSpec((TILE, 1), row_block),
        pl.BlockSpec((TILE, 1), row_block),
        pl.BlockSpec((1, d), whole),
        pl.BlockSpec((1, d), whole),
        pl.BlockSpec((1, d), whole),
        pl.BlockSpec(memory_space=pltpu.HBM),
    ]
    out_specs = [pl.BlockSpec((TILE, d), row_block), pl.BlockSpec(memory_space=pltpu.HBM)]
    out_shape = [
        jax.ShapeDtypeStruct((tp, d), latent_dtype),
        jax.ShapeDtypeStruct(pages_flat.shape, pages_flat.dtype),
    ]
    kv_p, flags, gpos, inv_lane, sign_lane = tiles
    operands = [kv_p, kv_p, flags, gpos, a.norm_weight[None, :], inv_lane, sign_lane, pages_flat]
    scratch = [pltpu.VMEM((TILE, 1, d), comp_pages.dtype), pltpu.SemaphoreType.DMA((3,))]
    # operand indices count the 3 scalar-prefetch arrays
    aliases = {3 + 7: 1}
    if ratio == 2:
        ring_flat = ring_pages.reshape(-1, 2 * d)
        in_specs.append(pl.BlockSpec(memory_space=pltpu.HBM))
        out_specs.append(pl.BlockSpec(memory_space=pltpu.HBM))
        out_shape.append(jax.ShapeDtypeStruct(ring_flat.shape, ring_flat.dtype))
        operands.append(ring_flat)
        scratch[:0] = [pltpu.VMEM((TILE, 1, width), jnp.float32)] * 2  # ring rows, raw rows
        aliases[3 + 8] = 2
    return in_specs, out_specs, out_shape, scratch, aliases, operands
