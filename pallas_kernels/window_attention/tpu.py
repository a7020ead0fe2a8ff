"""Mosaic TPU kernel of window attention over the paged window cache.

Design notes: pallas_kernels/README.md, "pallas_kernels/window_attention/tpu.py".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import backend
from pallas_kernels.backend import MASK_VALUE
from pallas_kernels.softmax import sink_weight
from pallas_kernels.window_attention.cost import window_call_cost

TOKENS_PER_TILE = 8  # tokens per grid step (largest power of two <= this that divides T)
MAX_TOKENS_PER_CALL = 8192  # bounds the scalar-prefetched metadata (SMEM is 1 MiB)


# over 60 lines: one kernel body: the tile's DMA pipeline and its per-token softmax
def _kernel(
    # scalar prefetch (SMEM)
    req_ref,  # i32[T]
    pos_ref,  # i32[T]
    lo_ref,  # i32[T] first visible position (> pos: nothing visible)
    pages_ref,  # i32[T * NW] physical pages of logical pages lo // S + j
    # inputs
    q_ref,  # [tq, H, D] (VMEM block)
    sink_ref,  # f32[H, 1]
    kv_hbm,  # [P, S, D] (HBM)
    # outputs: out [tq, H, D] | m [tq, H, 1], l [tq, H, 1], acc [tq, H, D]
    *refs,
    tq: int,
    nw: int,
    page: int,
    scale: float,
    return_state: bool,
    align: int,
):
    outs, (slab, sem, tok_slot, n_fetch) = refs[:-4], refs[-4:]
    # grid (core, tile of the core): each TensorCore walks its own run of tiles in order
    step, per_core = pl.program_id(1), pl.num_programs(1)
    tile = pl.program_id(0) * per_core + step
    buf = step % 2

    def page_copy(phys, b, slot):
        return pltpu.make_async_copy(
            kv_hbm.at[phys], slab.at[b, pl.ds(pl.multiple_of(slot * page, page), page)], sem.at[b]
        )

    def issue(t0, b):
        metadata = (req_ref, pos_ref, lo_ref, pages_ref)
        n_fetch[b] = _issue_tile(metadata, page_copy, tok_slot, t0, b, tq=tq, nw=nw, page=page)

    @pl.when(step == 0)
    def _():
        issue(tile * tq, 0)

    @pl.when(step + 1 < per_core)
    def _():
        issue((tile + 1) * tq, 1 - buf)

    def wait(i, c):
        page_copy(0, buf, 0).wait()
        return c

    lax.fori_loop(0, n_fetch[buf], wait, 0)

    rows = nw * page
    sink = sink_ref[...]  # [H, 1]

    def token(i, c):
        t = tile * tq + i
        start = tok_slot[buf, i]

        @pl.when(start < 0)
        def _():
            for o in outs:
                o[i] = jnp.zeros(o.shape[1:], o.dtype)
            if return_state:
                outs[0][i] = jnp.full(outs[0].shape[1:], MASK_VALUE, jnp.float32)

        @pl.when(start >= 0)
        def _():
            p, lo = pos_ref[t], lo_ref[t]
            first = start * page  # slab row of the token's first page
            if align == 1:
                kv = slab[buf, pl.ds(pl.multiple_of(first, page), rows), :]  # [rows, D]
                base = (lo // page) * page  # position of the first slab row read
            else:  # packed rows: read from the sublane tile boundary at or before `first`
                from_row = (first // align) * align
                kv = slab[buf, pl.ds(pl.multiple_of(from_row, align), rows + align), :]
                base = (lo // page) * page - (first - from_row)
            state = _attend(q_ref[i], kv, base, lo, p, scale)
            if return_state:
                for o, x in zip(outs, state):
                    o[i] = x
            else:
                m, denom, acc = state
                outs[0][i] = (acc * sink_weight(m, denom, sink)).astype(outs[0].dtype)

        return c

    lax.fori_loop(0, tq, token, 0)


def _issue_tile(metadata, page_copy, tok_slot, t0, b, *, tq: int, nw: int, page: int):
    """Start the page DMAs of the tile starting at token t0 into slab b; returns their count.

    Consecutive tokens of one request whose windows overlap form a segment whose pages sit in
    the slab once, in logical order; ``tok_slot[b, i]`` gets token i's first slab page (-1: none).
    """
    req_ref, pos_ref, lo_ref, pages_ref = metadata

    def token(i, carry):
        seg_req, seg_lo, seg_hi, seg_start, n_free, count = carry
        t = t0 + i
        r, p, lo = req_ref[t], pos_ref[t], lo_ref[t]
        active = (p >= 0) & (lo <= p)
        first, last = lo // page, p // page
        join = (r == seg_req) & (first >= seg_lo) & (first <= seg_hi + 1)
        start = jnp.where(join, seg_start, n_free)
        new_lo = jnp.where(join, seg_lo, first)
        have = jnp.where(join, seg_hi, first - 1)  # pages new_lo..have are in the slab
        new_hi = jnp.maximum(have, last)

        def fetch(logical, c):
            phys = pages_ref[t * nw + logical - first]
            page_copy(phys, b, start + logical - new_lo).start()
            return c

        lax.fori_loop(jnp.where(active, have + 1, 0), jnp.where(active, new_hi + 1, 0), fetch, 0)
        tok_slot[b, i] = jnp.where(active, start + first - new_lo, -1)
        fetched = jnp.where(active, new_hi - have, 0)
        new = (r, new_lo, new_hi, start, start + new_hi - new_lo + 1, count + fetched)
        old = (seg_req, seg_lo, seg_hi, seg_start, n_free, count + fetched)
        return tuple(jnp.where(active, a, o) for a, o in zip(new, old))

    init = tuple(jnp.int32(v) for v in (-1, 0, -2, 0, 0, 0))
    return lax.fori_loop(0, tq, token, init)[-1]


def _attend(q, kv, base, lo, p, scale: float):
    """One pass of softmax for one token: q [H, D] against slab rows kv [n, D] holding positions
    ``base ..``; rows outside ``lo .. p`` are masked and zeroed. Returns (m, l [H, 1], acc)."""
    if q.dtype != kv.dtype:
        q, kv = q.astype(jnp.float32), kv.astype(jnp.float32)
    prec = backend.mxu_precision(kv.dtype)
    z = lax.dot_general(
        q, kv, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=jnp.float32
    )  # [H, rows]
    n = kv.shape[0]
    col = base + lax.broadcasted_iota(jnp.int32, (1, n), 1)
    seen = (col >= lo) & (col <= p)
    z = jnp.where(seen, z * scale, MASK_VALUE)
    m = jnp.max(z, axis=1, keepdims=True)  # [H, 1], finite: position p is visible
    e = jnp.where(seen, jnp.exp(z - m), 0.0)
    denom = jnp.sum(e, axis=1, keepdims=True)
    row = base + lax.broadcasted_iota(jnp.int32, (n, 1), 0)
    kv = jnp.where((row >= lo) & (row <= p), kv, jnp.zeros_like(kv))
    acc = jnp.dot(
        e.astype(kv.dtype), kv, precision=prec, preferred_element_type=jnp.float32
    )  # [H, D]
    return m, denom, acc


def window_attention(
    q: jax.Array,  # [T, H, D]
    swa_pages: jax.Array,  # [P, S, D]
    swa_tables: jax.Array,  # i32[R, nb]
    token_req: jax.Array,  # i32[T]
    positions: jax.Array,  # i32[T]
    sink: jax.Array,  # f32[H]
    *,
    window: int,
    scale: float,
    replay_start: jax.Array | None = None,
    return_state: bool = False,
    interpret=False,
    tokens_per_tile: int = TOKENS_PER_TILE,
    num_cores: int | None = None,
    max_tokens_per_call: int = MAX_TOKENS_PER_CALL,
):
    """The TPU kernel behind `pallas_kernels.window_attention` (same arguments and results).

    ``num_cores``: TensorCores to split the tiles over (None: the device's, 2 on megacore
    chips); each core walks a contiguous run of tiles with its own prefetch pipeline.
    ``max_tokens_per_call``: longer batches run as several kernel calls (their scalar-prefetched
    metadata must fit in SMEM)."""

    def run(tokens, tq, cores, per_core):
        q, token_req, positions = tokens
        return _window_call(
            q, swa_pages, swa_tables, token_req, positions, sink, window=window, scale=scale,
            replay_start=replay_start, return_state=return_state, interpret=interpret, tq=tq,
            cores=cores, per_core=per_core,
        )  # fmt: skip

    return backend.token_tiles(
        run,
        (q, token_req, positions),
        (0, 0, -1),
        tokens_per_tile=tokens_per_tile,
        num_cores=num_cores,
        max_tokens_per_call=max_tokens_per_call,
    )


def _outputs(q: jax.Array, tq: int, tile_block, return_state: bool):
    """(out_shape, out_specs, bytes written) of `out` or of the f32 state (m, l as [T, H, 1])."""
    num_tokens, heads, dim = q.shape
    if not return_state:
        out_spec = pl.BlockSpec((tq, heads, dim), tile_block)
        return jax.ShapeDtypeStruct(q.shape, q.dtype), out_spec, q.size * backend.itemsize(q.dtype)
    out_shape = (
        jax.ShapeDtypeStruct((num_tokens, heads, 1), jnp.float32),
        jax.ShapeDtypeStruct((num_tokens, heads, 1), jnp.float32),
        jax.ShapeDtypeStruct((num_tokens, heads, dim), jnp.float32),
    )
    out_specs = (
        pl.BlockSpec((tq, heads, 1), tile_block),
        pl.BlockSpec((tq, heads, 1), tile_block),
        pl.BlockSpec((tq, heads, dim), tile_block),
    )
    return out_shape, out_specs, num_tokens * heads * (dim + 2) * 4


def _slab(swa_pages: jax.Array, tq: int, nw: int, heads: int) -> tuple[int, int, int]:
    """(row alignment, slab rows, VMEM bytes) of a tile's page slab.

    Packed (16-bit) rows live in sublane tiles of 16: a token's rows are read from the tile
    boundary before its first page when pages do not fill whole tiles (the extra rows are
    masked like any other row outside the window)."""
    _, page, dim = swa_pages.shape
    packing = 4 // max(1, min(4, backend.itemsize(swa_pages.dtype)))
    align = 8 * packing if packing > 1 and page % (8 * packing) else 1
    slab_rows = (tq + 1) * nw * page + (align if align > 1 else 0)
    vmem = (
        2 * slab_rows * dim * backend.itemsize(swa_pages.dtype)
        + 4 * tq * heads * dim * 4  # q and output blocks, double-buffered (f32 bound)
        + 4 * tq * heads * 128 * 4  # m, l blocks (lane-padded)
        + 8 * nw * page * max(dim, 128) * 4  # matmul temporaries
    )
    return align, slab_rows, vmem


# over 60 lines: one pallas_call: its metadata, specs, scratch and operands read best together
def _window_call(
    q, swa_pages, swa_tables, token_req, positions, sink, *, window, scale, replay_start,
    return_state, interpret, tq, cores, per_core,
):  # fmt: skip
    """One kernel call over whole tiles of ``tq`` tokens, ``per_core`` tiles per core."""
    _, heads, dim = q.shape
    _, page, _ = swa_pages.shape
    nb = swa_tables.shape[1]
    nw = backend.window_pages(window, page)

    lo = jnp.maximum(positions - window + 1, 0)
    if replay_start is not None:
        lo = jnp.maximum(lo, replay_start[token_req])
    logical = lo[:, None] // page + jnp.arange(nw, dtype=jnp.int32)[None, :]
    tok_pages = swa_tables[token_req[:, None], jnp.clip(logical, 0, nb - 1)]  # [T, NW]

    tile_block = lambda c, j, *_: (c * per_core + j, 0, 0)  # noqa: E731
    out_shape, out_specs, out_bytes = _outputs(q, tq, tile_block, return_state)
    cost = window_call_cost(q, swa_pages, window, swa_tables.shape[0], out_bytes)
    align, slab_rows, vmem = _slab(swa_pages, tq, nw, heads)
    kernel = functools.partial(
        _kernel, tq=tq, nw=nw, page=page, scale=scale, return_state=return_state, align=align
    )
    result = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(cores, per_core),
            in_specs=[
                pl.BlockSpec((tq, heads, dim), tile_block),
                pl.BlockSpec((heads, 1), lambda c, j, *_: (0, 0)),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=out_specs,
            scratch_shapes=[
                pltpu.VMEM((2, slab_rows, dim), swa_pages.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SMEM((2, tq), jnp.int32),
                pltpu.SMEM((2,), jnp.int32),
            ],
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"),
            vmem_limit_bytes=int(min(max(32 << 20, 2 * vmem), 100 << 20)),
        ),
        cost_estimate=backend.cost_estimate(**cost.as_estimate()),
        interpret=interpret,
        name="window_attention",
    )(
        token_req,
        positions,
        lo,
        tok_pages.reshape(-1),
        q,
        sink.astype(jnp.float32).reshape(heads, 1),
        swa_pages,
    )
    if return_state:
        m, denom, acc = result
        return m[..., 0], denom[..., 0], acc
    return result
