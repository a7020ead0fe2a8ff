"""Mosaic TPU indexer: one grid step per tile of tokens, every score on chip, selection
without a sort.

Design notes: pallas_kernels/README.md, "pallas_kernels/indexer/tpu.py".
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.backend import (
    cdiv,
    cost_estimate,
    double_buffered,
    mxu_precision,
    tpu_interpret,
)
from pallas_kernels.indexer.common import check_indexer_args, cost, weighted_relu_sum

__all__ = ["indexer_topk"]

LANES = 128
CHUNK_ENTRIES = 512  # entries per key DMA chunk (rounded to a multiple of lcm(E, 128))
TOKENS_PER_TILE = 8  # tokens per grid step (a request's tokens in a tile share the key stream)
STACK_HEADS = 16  # whole-tile matmuls need the heads to fill (bf16) sublane tiles
SCORE_VMEM_BUDGET = 40 << 20  # bytes of f32 score rows a tile may keep in VMEM
INT_MIN = -(2**31)


def _order_key(x):
    """int32 keys with the order of the f32 values (-0.0 is canonicalised by the caller)."""
    b = pltpu.bitcast(x, jnp.int32)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


def _count(vals_ref, nrows, pred, ids_ref=None):
    """Number of lanes of rows ``< nrows`` of ``vals_ref`` where ``pred(x, idx)`` holds; the
    id of a lane is ``ids_ref``'s entry, or its flat position when there is none."""
    ntiles = cdiv_dyn(nrows, 8)

    def body(i, acc):
        rows = pl.ds(pl.multiple_of(i * 8, 8), 8)
        x = vals_ref[rows, :]
        row = i * 8 + jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
        if ids_ref is None:
            idx = row * LANES + jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
        else:
            idx = ids_ref[rows, :]
        hit = pred(x, idx) & (row < nrows) & (x > -jnp.inf)
        return acc + hit.astype(jnp.int32)

    acc = jax.lax.fori_loop(0, ntiles, body, jnp.zeros((8, LANES), jnp.int32))
    return jnp.sum(acc)


def _qk(q, keys):
    """q [M, Di] . keys [C, Di] -> f32 [M, C] on the MXU."""
    return jax.lax.dot_general(
        q,
        keys.astype(q.dtype),
        (((1,), (1,)), ((), ())),
        precision=mxu_precision(q.dtype),
        preferred_element_type=jnp.float32,
    )


def cdiv_dyn(a, b):
    return (a + b - 1) // b


def _select(vals_ref, nrows, k, index_bits, ids_ref=None):
    """The selection "k highest, ties to the lower index" over the finite-or-+inf lanes of rows
    ``< nrows``: returns ``(tau, cut)`` such that lane ``(x, idx)`` is picked iff
    ``key(x) > tau`` or ``key(x) == tau and idx <= cut``."""
    total = _count(vals_ref, nrows, lambda x, idx: x == x, ids_ref)

    def key_bit(i, thr_u):
        cand = thr_u | jnp.left_shift(jnp.int32(1), 31 - i)  # bit 31 wraps to INT_MIN
        cand_key = cand ^ jnp.int32(INT_MIN)
        n = _count(vals_ref, nrows, lambda x, idx: _order_key(x) >= cand_key, ids_ref)
        return jnp.where(n >= k, cand, thr_u)

    thr_u = jax.lax.fori_loop(0, 32, key_bit, jnp.int32(0))
    tau = thr_u ^ jnp.int32(INT_MIN)
    n_gt = _count(vals_ref, nrows, lambda x, idx: _order_key(x) > tau, ids_ref)
    need = k - n_gt

    # the largest cut with fewer than `need` ties at indices < cut, built from the top bit
    def cut_bit(i, cut):
        cand = cut | jnp.left_shift(jnp.int32(1), index_bits - 1 - i)
        n = _count(vals_ref, nrows, lambda x, idx: (_order_key(x) == tau) & (idx < cand), ids_ref)
        return jnp.where(n < need, cand, cut)

    cut = jax.lax.fori_loop(0, index_bits, cut_bit, jnp.int32(0))
    # every finite lane is picked when there are at most k of them
    small = total <= k
    tau = jnp.where(small, jnp.int32(INT_MIN), tau)
    cut = jnp.where(small, jnp.int32(2**31 - 1), cut)
    return tau, cut


def _compact(vals_ref, nrows, tau, cut, out_ref, id_shift, ids_ref=None):
    """Write the ids (``idx >> id_shift``) of the picked lanes to ``out_ref`` [K/128, 128]
    (-1 elsewhere), in index order."""
    out_ref[...] = jnp.full(out_ref.shape, -1, jnp.int32)
    lane_r = jax.lax.broadcasted_iota(jnp.int32, (LANES, LANES), 0)
    lane_c = jax.lax.broadcasted_iota(jnp.int32, (LANES, LANES), 1)
    strict_upper = (lane_r < lane_c).astype(jnp.float32)  # rank = sum of picks to the left
    lane = jax.lax.broadcasted_iota(jnp.int32, (1, LANES), 1)
    hi = jax.lax.Precision.HIGHEST

    def body(r, off):
        x = vals_ref[pl.ds(r, 1), :]
        idx = r * LANES + lane if ids_ref is None else ids_ref[pl.ds(r, 1), :]
        key = _order_key(x)
        pick = (x > -jnp.inf) & ((key > tau) | ((key == tau) & (idx <= cut)))
        c = jnp.sum(pick.astype(jnp.int32))

        @pl.when(c > 0)
        def _append():
            m8 = jnp.broadcast_to(pick.astype(jnp.float32), (8, LANES))
            rank8 = jnp.dot(m8, strict_upper, precision=hi, preferred_element_type=jnp.float32)
            ids8 = jnp.broadcast_to((idx >> id_shift).astype(jnp.float32), (8, LANES))
            rank_t = jnp.transpose(rank8)[:, 0:1]  # [128, 1]
            pick_t = jnp.transpose(m8)[:, 0:1]
            onehot = jnp.where((rank_t == lane_c.astype(jnp.float32)) & (pick_t > 0), 1.0, 0.0)
            packed = jnp.dot(ids8, onehot, precision=hi, preferred_element_type=jnp.float32)
            packed = packed[0:1, :].astype(jnp.int32)  # ids at lanes 0 .. c - 1
            s = off % LANES
            j = off // LANES
            rolled = pltpu.roll(packed, s, 1)
            here = (lane >= s) & (lane < s + c)
            out_ref[pl.ds(j, 1), :] = jnp.where(here, rolled, out_ref[pl.ds(j, 1), :])

            @pl.when(s + c > LANES)
            def _spill():
                there = lane < s + c - LANES
                row = out_ref[pl.ds(j + 1, 1), :]
                out_ref[pl.ds(j + 1, 1), :] = jnp.where(there, rolled, row)

        return off + c

    jax.lax.fori_loop(0, nrows, body, jnp.int32(0))


def _segment_end(req_ref, t0, s, tq):
    """First tile row after ``s`` whose token belongs to another request than row ``s``'s
    (tokens of one request are contiguous in the ragged batch)."""
    r = req_ref[t0 + s]
    end = s + 1
    for i in range(1, tq):
        end = jnp.where((end == i) & (req_ref[t0 + i] == r), i + 1, end)
    return end


def _kernel_refs(rest, *, mode: str, scaled: bool):
    """The kernel's refs after q and w, by name: (cand, tables, keys, scales, out, scaled
    buffers, blocks out, scores, aux scores, lane ids, key buffer, sems, table row, table sem);
    None where the mode has none."""
    rest = list(rest)
    cand_ref = rest.pop(0) if mode == "consumer" else None  # SMEM i32[tq, 1, cbw]
    tab_hbm, keys_hbm = rest[:2]  # tables i32[R, 1, nbp] and keys stay in HBM
    rest = rest[2:]
    scales_hbm = rest.pop(0) if scaled else None  # f32[P, E, 1] (HBM)
    out_ref = rest.pop(0)
    # scaled keys: per chunk, the scales' DMA buffer and semaphores, and the decoded keys
    scaled_bufs = tuple(rest[-3:]) if scaled else None
    if scaled:
        rest = rest[:-3]
    blk_ref = rest.pop(0) if mode == "source" else None
    aux_ref = ids_ref = None
    if mode == "consumer":
        sc_ref, ids_ref, kbuf, sems, tab_ref, tab_sem = rest
    elif mode == "source":
        sc_ref, aux_ref, kbuf, sems, tab_ref, tab_sem = rest
    else:
        sc_ref, kbuf, sems, tab_ref, tab_sem = rest
    head = (cand_ref, tab_hbm, keys_hbm, scales_hbm, out_ref, scaled_bufs)
    return (*head, blk_ref, sc_ref, aux_ref, ids_ref, kbuf, sems, tab_ref, tab_sem)


def _kernel(
    req_ref,  # SMEM i32[Tp]
    vis_ref,  # SMEM i32[Tp] (0 for padding tokens)
    q_ref,  # VMEM [tq, IH, Di]
    w_ref,  # VMEM f32[tq, IH, 1]
    *rest,
    mode,
    tq,
    e,
    ce,
    k,
    cbs,
    cb,
    index_bits,
    stack,
    scaled,
):
    refs = _kernel_refs(rest, mode=mode, scaled=scaled)
    cand_ref, tab_hbm, keys_hbm, scales_hbm, out_ref, scaled_bufs = refs[:6]
    blk_ref, sc_ref, aux_ref, ids_ref, kbuf, sems, tab_ref, tab_sem = refs[6:]
    t0 = pl.program_id(0) * tq

    def load_table(r):
        copy = pltpu.make_async_copy(tab_hbm.at[r], tab_ref, tab_sem.at[0])
        copy.start()
        copy.wait()

    def segment(s):
        """Tile rows ``s .. end - 1`` (one request): its table row, then the key stream read
        once for all of them; returns ``end``."""
        end = _segment_end(req_ref, t0, s, tq)
        load_table(req_ref[t0 + s])
        if mode == "consumer":

            def one(i, carry):
                _consumer(
                    cand_ref.at[i], tab_ref, keys_hbm, q_ref.at[i], w_ref.at[i], vis_ref[t0 + i],
                    out_ref.at[i], sc_ref, ids_ref, kbuf, sems, e=e, cbs=cbs, k=k,
                    index_bits=index_bits,
                )  # fmt: skip
                return carry

            jax.lax.fori_loop(s, end, one, 0)
        else:
            _score_segment(
                vis_ref, t0, s, end, tab_ref, keys_hbm, q_ref, w_ref, sc_ref, kbuf, sems, tq, e, ce,
                stack, None if scales_hbm is None else (scales_hbm, *scaled_bufs),
            )  # fmt: skip
        return end

    jax.lax.while_loop(lambda s: s < tq, segment, jnp.int32(0))
    if mode == "consumer":
        return

    select = functools.partial(
        _select_token, vis_ref, t0, sc_ref, aux_ref, blk_ref, out_ref,
        mode=mode, ce=ce, k=k, cbs=cbs, cb=cb, index_bits=index_bits,
    )  # fmt: skip
    jax.lax.fori_loop(0, tq, select, 0)


def _select_token(vis_ref, t0, sc_ref, aux_ref, blk_ref, out_ref, i, carry, *, mode, ce, k, cbs,
                  cb, index_bits):  # fmt: skip
    """Tile row ``i``'s outputs from its scores: a source's candidate blocks (block maxima by
    lane rolls on each block's first lane, the newest block pinned), then its top-k."""
    n = vis_ref[t0 + i]
    nrows = cdiv_dyn(n, ce) * (ce // LANES)
    vals = sc_ref.at[i]
    if mode == "source":
        newest = jnp.where(n > 0, ((n - 1) // cbs) * cbs, -1)

        def block_max(j, c):
            rows = pl.ds(pl.multiple_of(j * 8, 8), 8)
            x = vals[rows, :]
            m = x
            sh = 1
            while sh < cbs:
                m = jnp.maximum(m, pltpu.roll(m, LANES - sh, 1))  # lane l sees l + sh
                sh *= 2
            row = j * 8 + jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
            idx = row * LANES + jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
            m = jnp.where(idx == newest, jnp.inf, m)
            aux_ref[rows, :] = jnp.where(idx % cbs == 0, m, -jnp.inf)
            return c

        jax.lax.fori_loop(0, cdiv_dyn(nrows, 8), block_max, 0)
        tau, cut = _select(aux_ref, nrows, cb, index_bits)
        _compact(aux_ref, nrows, tau, cut, blk_ref.at[i], int(math.log2(cbs)))
    tau, cut = _select(vals, nrows, k, index_bits)
    _compact(vals, nrows, tau, cut, out_ref.at[i], 0)
    return carry


def _score_segment(vis_ref, t0, s, end, tab_ref, keys_hbm, q_ref, w_ref, sc_ref, kbuf, sems, tq,
                   e, ce, stack, scaled=None):  # fmt: skip
    """Stream the keys of the segment's request once, in double-buffered chunks of ``ce``
    entries up to the segment's largest visible count, and score every row of the segment
    against each chunk it can see (row ``i``'s scores go to ``sc_ref[i]``). With ``stack``, a
    segment that is the whole tile scores all its tokens with one matmul per 128 entries.
    ``scaled = (scales_hbm, sbuf, ssems, dbuf)``: fp8 rows with a scale each, see `_chunk_keys`."""
    bf16 = q_ref.dtype == jnp.bfloat16  # score with DeepSeek's bf16 roundings
    n_max = jnp.int32(0)
    for i in range(tq):
        in_seg = (i >= s) & (i < end)
        n_max = jnp.maximum(n_max, jnp.where(in_seg, vis_ref[t0 + i], 0))
    nchunks = cdiv_dyn(n_max, ce)
    for_pages = functools.partial(
        _for_pages, tab_ref, keys_hbm, kbuf, sems, scaled, n_max, e=e, pages_per_chunk=ce // e
    )

    @pl.when(nchunks > 0)
    def _first():
        for_pages(0, 0, lambda cp: cp.start())

    lane = jax.lax.broadcasted_iota(jnp.int32, (1, LANES), 1)
    tile = (vis_ref, t0, q_ref, w_ref, sc_ref, lane)

    def chunk(c, carry):
        slot = double_buffered(c, nchunks, for_pages)
        keys_at = _chunk_keys(kbuf, slot, scaled, ce)
        per_token = functools.partial(
            _score_rows, tile, keys_at, c, s, end, tq=tq, ce=ce, bf16=bf16
        )
        if not stack:
            per_token()
            return carry
        whole = (s == 0) & (end == tq)
        pl.when(jnp.logical_not(whole))(per_token)
        pl.when(whole)(functools.partial(_score_stacked, tile, keys_at, c, tq=tq, ce=ce, bf16=bf16))
        return carry

    jax.lax.fori_loop(0, nchunks, chunk, 0)


def _for_pages(tab_ref, keys_hbm, kbuf, sems, scaled, n_max, c, slot, fn, *, e, pages_per_chunk):
    """Apply ``fn`` (start or wait) to the DMAs of chunk ``c``'s pages (and their scales) that
    hold entries below ``n_max``, into buffer ``slot``."""

    def page_copy(c, i, slot):
        page = tab_ref[0, c * pages_per_chunk + i]
        return pltpu.make_async_copy(
            keys_hbm.at[page], kbuf.at[slot, pl.ds(i * e, e)], sems.at[slot]
        )

    def scale_copy(c, i, slot):
        scales_hbm, sbuf, ssems, _ = scaled
        page = tab_ref[0, c * pages_per_chunk + i]
        return pltpu.make_async_copy(
            scales_hbm.at[page], sbuf.at[slot, pl.ds(i * e, e)], ssems.at[slot]
        )

    for i in range(pages_per_chunk):

        @pl.when((c * pages_per_chunk + i) * e < n_max)
        def _(i=i):
            fn(page_copy(c, i, slot))
            if scaled is not None:
                fn(scale_copy(c, i, slot))


def _chunk_keys(kbuf, slot, scaled, ce):
    """``keys_at(sb)``: the chunk's 128 keys of slice ``sb``. Scaled (fp8) keys are decoded
    once per chunk into ``dbuf`` (row x scale, exact for power-of-two scales)."""
    if scaled is None:

        def keys_at(sb):
            return kbuf[slot, pl.ds(sb * LANES, LANES), :]

        return keys_at
    _, sbuf, _, dbuf = scaled
    for sb in range(ce // LANES):
        rows = pl.ds(sb * LANES, LANES)
        decoded = kbuf[slot, rows, :].astype(jnp.float32) * sbuf[slot, rows, :]
        dbuf[rows, :] = decoded.astype(dbuf.dtype)

    def keys_at(sb):
        return dbuf[pl.ds(sb * LANES, LANES), :]

    return keys_at


def _score_rows(tile, keys_at, c, s, end, *, tq, ce, bf16):
    """Score chunk ``c`` for each token of the segment ``s .. end - 1`` that sees it."""
    vis_ref, t0, q_ref, w_ref, sc_ref, lane = tile
    for i in range(tq):
        n = vis_ref[t0 + i]

        @pl.when((i >= s) & (i < end) & (c * ce < n))
        def _row(i=i, n=n):
            q = q_ref[i]
            w = w_ref[i].astype(jnp.float32)
            for sb in range(ce // LANES):
                keys = keys_at(sb).astype(q.dtype)
                dots = _qk(q, keys)
                sc = weighted_relu_sum(dots, w, 0, keepdims=True, bf16=bf16)
                idx = c * ce + sb * LANES + lane
                sc = jnp.where(idx < n, jnp.where(sc == 0.0, 0.0, sc), -jnp.inf)
                sc_ref[i, pl.ds(c * (ce // LANES) + sb, 1), :] = sc


def _score_stacked(tile, keys_at, c, *, tq, ce, bf16):
    """The tile is one request: one [tq * IH, Di] x [Di, 128] matmul per slice feeds the MXU tq
    times more rows per pushed key tile; rows past a token's own count are -inf (rows of chunks
    it cannot see lie past its selection's rows)."""
    vis_ref, t0, q_ref, w_ref, sc_ref, lane = tile
    q = q_ref[...]
    tq_, ih, di = q.shape
    q = q.reshape(tq_ * ih, di)
    w = w_ref[...].astype(jnp.float32)  # [tq, IH, 1]
    tok = jax.lax.broadcasted_iota(jnp.int32, (tq, LANES), 0)
    nvec = jnp.zeros((tq, LANES), jnp.int32)
    for i in range(tq):
        nvec = jnp.where(tok == i, vis_ref[t0 + i], nvec)
    for sb in range(ce // LANES):
        keys = keys_at(sb).astype(q.dtype)
        dots = _qk(q, keys).reshape(tq_, ih, LANES)
        sc = weighted_relu_sum(dots, w, 1, bf16=bf16)  # [tq, 128]
        idx = c * ce + sb * LANES + lane
        sc = jnp.where(idx < nvec, jnp.where(sc == 0.0, 0.0, sc), -jnp.inf)
        sc_ref[:, pl.ds(c * (ce // LANES) + sb, 1), :] = sc[:, None, :]


# over 60 lines: one kernel step: a consumer's block DMAs, scoring and selection
def _consumer(
    cand_ref,
    tab_ref,
    keys_hbm,
    q_ref,
    w_ref,
    n,
    out_ref,
    sc_ref,
    ids_ref,
    kbuf,
    sems,
    *,
    e,
    cbs,
    k,
    index_bits,
):
    """A candidate consumer scores only the entries of its listed blocks: groups of
    ``128 / cbs`` blocks are DMA'd (one copy per block, double-buffered) into a 128-row key
    buffer and scored with one matmul into one row of ``sc_ref``; ``ids_ref`` holds each lane's
    entry id (-1: none). The keys of other blocks are never read."""
    per = LANES // cbs
    ngroups = cand_ref.shape[1] // per
    lane = jax.lax.broadcasted_iota(jnp.int32, (1, LANES), 1)
    q = q_ref[...]
    w = w_ref[...].astype(jnp.float32)

    def block_copy(g, i, slot):
        first = jnp.maximum(cand_ref[0, g * per + i], 0) * cbs
        page = tab_ref[0, first // e]
        return pltpu.make_async_copy(
            keys_hbm.at[page, pl.ds(first % e, cbs)],
            kbuf.at[slot, pl.ds(i * cbs, cbs)],
            sems.at[slot],
        )

    def for_blocks(g, slot, fn):
        for i in range(per):
            b = cand_ref[0, g * per + i]

            @pl.when((b >= 0) & (b * cbs < n))
            def _(i=i):
                fn(block_copy(g, i, slot))

    for_blocks(0, 0, lambda cp: cp.start())

    def group(g, carry):
        slot = double_buffered(g, ngroups, for_blocks)
        ids = jnp.full((1, LANES), -1, jnp.int32)
        for i in range(per):
            b = cand_ref[0, g * per + i]
            entry = b * cbs + lane % cbs
            ok = (b >= 0) & (entry < n) & (lane // cbs == i)
            ids = jnp.where(ok, entry, ids)
        keys = kbuf[slot].astype(q.dtype)
        dots = _qk(q, keys)
        s = weighted_relu_sum(dots, w, 0, keepdims=True, bf16=q.dtype == jnp.bfloat16)
        s = jnp.where(ids >= 0, jnp.where(s == 0.0, 0.0, s), -jnp.inf)
        sc_ref[pl.ds(g, 1), :] = s
        ids_ref[pl.ds(g, 1), :] = ids
        return carry

    jax.lax.fori_loop(0, ngroups, group, 0)
    tau, cut = _select(sc_ref, ngroups, k, index_bits, ids_ref)
    _compact(sc_ref, ngroups, tau, cut, out_ref, 0, ids_ref)


def _round_up(x, m):
    return cdiv(x, m) * m


def tile_size(tokens_per_tile: int, score_row_bytes: int, budget: int = SCORE_VMEM_BUDGET) -> int:
    """Tokens per grid step: ``tokens_per_tile`` capped so the tile's score rows fit the VMEM
    budget (a token's scores take ``score_row_bytes``)."""
    return max(1, min(tokens_per_tile, budget // max(score_row_bytes, 1)))


class _Layout(NamedTuple):
    """Static sizes of one call: tile, padded tokens, key chunk, table width, score rows..."""

    tq: int  # tokens per grid step
    tp: int  # tokens padded to whole tiles
    ce: int  # entries per key DMA chunk
    nbp: int  # table width padded to whole chunks
    nr: int  # score rows of 128 lanes per token
    index_bits: int
    kp: int  # k padded to lanes
    cbp: int  # candidate_topk_blocks padded to lanes
    cbw: int  # a consumer's candidate list padded to whole groups
    groups: int  # a consumer's score rows


def _layout(mode, t, nb, e, k, cbs, cb, candidates, tokens_per_tile) -> _Layout:
    """The static sizes of a call (and the TPU kernel's limits on them)."""
    if not isinstance(tokens_per_tile, int) or tokens_per_tile < 1:
        raise ValueError(f"indexer_topk (tpu): tokens_per_tile={tokens_per_tile!r} must be >= 1")
    if mode != "plain" and (cbs & (cbs - 1) or LANES % cbs):
        raise ValueError(
            f"indexer_topk (tpu): candidate_block_size={cbs} must be a power of two <= 128"
        )
    if mode == "consumer" and e % cbs:
        raise ValueError(
            f"indexer_topk (tpu): a consumer's candidate blocks ({cbs} entries) must not straddle "
            f"pages of entries_per_block={e}"
        )
    if LANES % e and e % LANES:
        raise ValueError(
            f"indexer_topk (tpu): entries_per_block={e} must divide 128 or be a multiple of it"
        )
    unit = math.lcm(e, LANES)
    ce = _round_up(min(max(CHUNK_ENTRIES, unit), _round_up(nb * e, unit)), unit)
    nbp = _round_up(nb, ce // e)
    nr = _round_up(nbp * e // LANES, 8)
    per = LANES // max(cbs, 1)
    cbw = _round_up(candidates.shape[1], per) if mode == "consumer" else 0
    # a consumer scores one token at a time into one scratch: any tile size fits
    tq = tokens_per_tile if mode == "consumer" else tile_size(tokens_per_tile, nr * LANES * 4)
    return _Layout(
        tq=tq,
        tp=_round_up(t, tq),
        ce=ce,
        nbp=nbp,
        nr=nr,
        index_bits=max(1, (nr * LANES - 1).bit_length()),
        kp=_round_up(k, LANES),
        cbp=_round_up(max(cb, 1), LANES),
        cbw=cbw,
        groups=_round_up(max(cbw // per, 1), 8),
    )


def _operands(lay, mode, arrays, candidates, key_scales):
    """(scalar prefetch, in_specs, operands, out_specs, out_shape): tiles of q and w, the
    consumer's candidates (SMEM), tables, keys and scales left in HBM, the top-k (and blocks)."""
    qi, weights, ikey_pages, comp_tables, token_req, positions, visible = arrays
    t, ih, di = qi.shape
    e, nb = ikey_pages.shape[1], comp_tables.shape[1]
    pad = lay.tp - t
    tables = jnp.pad(comp_tables, ((0, 0), (0, lay.nbp - nb)))[:, None, :]
    vis = jnp.where(positions >= 0, jnp.clip(visible, 0, nb * e), 0).astype(jnp.int32)
    vis = jnp.pad(vis, (0, pad))  # padding tokens see nothing
    req = jnp.pad(token_req, (0, pad), mode="edge")  # ... and join the last request's segment
    qp = jnp.pad(qi, ((0, pad), (0, 0), (0, 0)))
    wp = jnp.pad(weights.astype(jnp.float32), ((0, pad), (0, 0)))[:, :, None]
    per_tile = lambda i, *_: (i, 0, 0)  # noqa: E731
    in_specs = [pl.BlockSpec((lay.tq, ih, di), per_tile), pl.BlockSpec((lay.tq, ih, 1), per_tile)]
    operands = [qp, wp]
    if mode == "consumer":
        width = ((0, pad), (0, lay.cbw - candidates.shape[1]))
        padded = jnp.pad(candidates, width, constant_values=-1)
        in_specs.append(pl.BlockSpec((lay.tq, 1, lay.cbw), per_tile, memory_space=pltpu.SMEM))
        operands.append(padded[:, None, :])
    in_specs += [pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)]
    operands += [tables, ikey_pages]
    if key_scales is not None:  # one scale per key, DMA'd with its page (a column per chunk)
        in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
        operands.append(key_scales.astype(jnp.float32)[..., None])
    out_specs = [pl.BlockSpec((lay.tq, lay.kp // LANES, LANES), per_tile)]
    out_shape = [jax.ShapeDtypeStruct((lay.tp, lay.kp // LANES, LANES), jnp.int32)]
    if mode == "source":
        out_specs.append(pl.BlockSpec((lay.tq, lay.cbp // LANES, LANES), per_tile))
        out_shape.append(jax.ShapeDtypeStruct((lay.tp, lay.cbp // LANES, LANES), jnp.int32))
    return (req, vis), in_specs, operands, out_specs, out_shape


def _scratch(lay, mode, key_dtype, q_dtype, di, scaled):
    """(scratch shapes, VMEM bytes): score rows (or a consumer's compact rows and lane ids),
    the double-buffered key chunks, the table row, and the fp8 scales and decoded chunk."""
    kbytes = jnp.dtype(key_dtype).itemsize
    if mode == "consumer":
        scratch = [
            pltpu.VMEM((lay.groups, LANES), jnp.float32),
            pltpu.VMEM((lay.groups, LANES), jnp.int32),
            pltpu.VMEM((2, LANES, di), key_dtype),
        ]
        vmem = lay.groups * LANES * 8 + 2 * LANES * di * kbytes
    else:
        scratch = [pltpu.VMEM((lay.tq, lay.nr, LANES), jnp.float32)]
        if mode == "source":
            scratch.append(pltpu.VMEM((lay.nr, LANES), jnp.float32))
        scratch.append(pltpu.VMEM((2, lay.ce, di), key_dtype))
        vmem = lay.nr * LANES * 4 * (lay.tq + (mode == "source")) + 2 * lay.ce * di * kbytes
    scratch += [
        pltpu.SemaphoreType.DMA((2,)),
        pltpu.SMEM((1, lay.nbp), jnp.int32),
        pltpu.SemaphoreType.DMA((1,)),
    ]
    if scaled:  # the chunk's scales, their semaphores, the chunk decoded to q's dtype
        scratch += [
            pltpu.VMEM((2, lay.ce, 1), jnp.float32),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.VMEM((lay.ce, di), q_dtype),
        ]
        vmem += 2 * lay.ce * LANES * 4 + lay.ce * di * jnp.dtype(q_dtype).itemsize
    return scratch, vmem


# over 60 lines: one pallas_call: checks, layout, cost and the call read best together
def indexer_topk(
    qi, weights, ikey_pages, comp_tables, token_req, positions, visible, *,
    entries_per_block: int, k: int, candidate_block_size: int = 0, candidate_topk_blocks: int = 0,
    candidates=None, key_scales=None, tokens_per_tile: int = TOKENS_PER_TILE, interpret=False,
):  # fmt: skip
    """Mosaic TPU indexer; same arguments and results as `reference.indexer_topk`.

    ``tokens_per_tile``: tokens per grid step (capped by the VMEM their scores need); the
    tokens of one request within a tile read the key stream once."""
    mode = check_indexer_args(
        qi, weights, ikey_pages, comp_tables, token_req, positions, visible,
        entries_per_block=entries_per_block, k=k, candidate_block_size=candidate_block_size,
        candidate_topk_blocks=candidate_topk_blocks, candidates=candidates, key_scales=key_scales,
    )  # fmt: skip
    if key_scales is not None and mode == "consumer":
        # a consumer DMAs blocks of a few entries, below the 8-bit sublane tile: its scaled
        # (fp8) keys are decoded to q's dtype here, one XLA pass over the pages
        ikey_pages = (ikey_pages.astype(jnp.float32) * key_scales[..., None]).astype(qi.dtype)
        key_scales = None
    t, ih, di = qi.shape
    e, nb, cbs, cb = (
        entries_per_block,
        comp_tables.shape[1],
        candidate_block_size,
        candidate_topk_blocks,
    )
    lay = _layout(mode, t, nb, e, k, cbs, cb, candidates, tokens_per_tile)
    arrays = (qi, weights, ikey_pages, comp_tables, token_req, positions, visible)
    scalars, in_specs, operands, out_specs, out_shape = _operands(
        lay, mode, arrays, candidates, key_scales
    )
    scratch, vmem = _scratch(lay, mode, ikey_pages.dtype, qi.dtype, di, key_scales is not None)
    # the CostEstimate assumes the worst case of one key stream per token (decode); a prefill
    # chunk of one request reads it once per tile
    c = cost(
        t,
        ih,
        di,
        min(nb * e, candidates.shape[1] * cbs) if mode == "consumer" else nb * e,
        k=k,
        key_dtype=ikey_pages.dtype,
        q_dtype=qi.dtype,
        candidate_topk_blocks=cb,
        entries_per_block=e,
        key_scale_bytes=4 if key_scales is not None else 0,
    )
    kernel = functools.partial(
        _kernel, mode=mode, tq=lay.tq, e=e, ce=lay.ce, k=k, cbs=max(cbs, 1), cb=cb,
        index_bits=lay.index_bits, stack=lay.tq > 1 and ih % STACK_HEADS == 0,
        scaled=key_scales is not None,
    )  # fmt: skip
    outs = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(lay.tp // lay.tq,),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",),
            vmem_limit_bytes=int(max(32 << 20, vmem + (16 << 20))),
        ),
        cost_estimate=cost_estimate(c["flops"], c["bytes"]),
        interpret=tpu_interpret(interpret),
    )(*scalars, *operands)
    topk = outs[0].reshape(lay.tp, lay.kp)[:t, :k]
    if mode == "source":
        return topk, outs[1].reshape(lay.tp, lay.cbp)[:t, :cb]
    return topk
