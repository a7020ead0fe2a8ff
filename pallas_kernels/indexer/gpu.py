"""Triton (Pallas GPU) indexer: block maxima, exact block pre-selection, rescoring, exact top-k.

Design notes: pallas_kernels/README.md, "pallas_kernels/indexer/gpu.py".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.backend import cdiv, cost_estimate, gpu_interpret
from pallas_kernels.indexer.common import check_indexer_args, cost, weighted_relu_sum

__all__ = ["indexer_topk"]

CHUNK = 128  # entries scored per step
SELECT_CHUNK = 1024  # values per counting step
TOKENS_PER_TILE = 4  # consecutive tokens sharing one key stream in `_blocks_kernel`
INT_MIN = -(2**31)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _params():
    return pltriton.CompilerParams(num_warps=4, num_stages=2)


def _dots(q, keys):
    """q [M, Di] . keys [C, Di] -> [M, C] in f32 on the tensor cores."""
    return jax.lax.dot_general(
        q,
        keys.astype(q.dtype),
        (((1,), (1,)), ((), ())),
        preferred_element_type=jnp.float32,
        precision=jax.lax.Precision.HIGHEST,
    )


def _score(q, w, keys):
    """sum_h w_h relu(q_h . k) for ``keys = (rows [C, Di], scales [C] or None)`` -> [C] (f32).
    A key's scale (a power of two) multiplies its score: exactly the score of the scaled key."""
    rows, scale = keys
    # bf16 queries: DeepSeek's bf16 roundings; a power-of-two scale commutes with them
    s = weighted_relu_sum(_dots(q, rows), w[:, None], 0, bf16=q.dtype == jnp.bfloat16)
    if scale is not None:
        s = s * scale
    return jnp.where(s == 0.0, 0.0, s)


def _score_stacked(q, w, keys, tokens):
    """`_score` of ``tokens`` stacked tokens in one matmul: q [tokens * H, Di], w [tokens * H],
    keys ([C, Di], [C] or None) -> [tokens, C] (f32)."""
    rows, scale = keys
    dots = _dots(q, rows).reshape(tokens, q.shape[0] // tokens, rows.shape[0])
    ww = w.reshape(tokens, q.shape[0] // tokens)[:, :, None]
    s = weighted_relu_sum(dots, ww, 1, bf16=q.dtype == jnp.bfloat16)
    if scale is not None:
        s = s * scale[None, :]
    return jnp.where(s == 0.0, 0.0, s)


def _gather_keys(tab_ref, keys_ref, scales_ref, r, nb, e, entry):
    """(key rows [C, Di], their scales [C] or None) of request-local entries ``entry`` [C]
    (clamped into the table)."""
    entry = jnp.clip(entry, 0, nb * e - 1)
    row = tab_ref[r * nb + entry // e] * e + entry % e
    return keys_ref[row], None if scales_ref is None else scales_ref[row]


# over 60 lines: one kernel body: the tile's shared key stream and its two scoring paths
def _blocks_kernel(
    req_ref, vis_ref, tab_ref, q_ref, w_ref, keys_ref, *rest, nb, e, bs, tq, ihp, scaled
):
    """Block maxima of the ``tq`` tokens of one tile: q [tq * ihp, Di], w [tq * ihp] and the
    output rows [tq, blocks] are the tile's; req / vis (padded to whole tiles) are whole."""
    scales_ref, bm_ref = rest if scaled else (None, *rest)
    t0 = pl.program_id(0) * tq
    r0 = req_ref[t0]
    reqs = [req_ref[t0 + i] for i in range(tq)]
    vis = [vis_ref[t0 + i] for i in range(tq)]
    n_max = functools.reduce(jnp.maximum, vis)
    # one matmul for the whole tile when it is one request (Triton shapes: powers of two only)
    stackable = tq > 1 and tq & (tq - 1) == 0
    same = functools.reduce(jnp.logical_and, [r == r0 for r in reqs[1:]], jnp.bool_(True))
    per = CHUNK // bs
    minus_inf = jnp.full((CHUNK,), -jnp.inf, jnp.float32)

    def step(c, carry):
        cols = pl.ds(c * per, per)
        entry = c * CHUNK + jnp.arange(CHUNK, dtype=jnp.int32)

        def scored():
            keys0 = _gather_keys(tab_ref, keys_ref, scales_ref, r0, nb, e, entry)  # the tile's

            def stacked():
                s = _score_stacked(q_ref[...], w_ref[...], keys0, tq)
                n = vis_ref[pl.ds(t0, tq)]
                s = jnp.where(entry[None, :] < n[:, None], s, -jnp.inf)
                bm_ref[:, cols] = jnp.max(s.reshape(tq, per, bs), axis=2)

            def token_by_token():
                for i in range(tq):
                    rows = pl.ds(i * ihp, ihp)

                    def shared(rows=rows):
                        return _score(q_ref[rows, :], w_ref[rows], keys0)

                    def own(i=i, rows=rows):
                        keys = _gather_keys(tab_ref, keys_ref, scales_ref, reqs[i], nb, e, entry)
                        return _score(q_ref[rows, :], w_ref[rows], keys)

                    def visible(i=i, shared=shared, own=own):
                        if i == 0:  # the tile's first token: its request's keys are keys0
                            return shared()
                        return jax.lax.cond(reqs[i] == r0, shared, own)

                    s = jax.lax.cond(c * CHUNK < vis[i], visible, lambda: minus_inf)
                    s = jnp.where(entry < vis[i], s, -jnp.inf)
                    bm_ref[i, cols] = jnp.max(s.reshape(per, bs), axis=1)

            if stackable:
                jax.lax.cond(same, stacked, token_by_token)
            else:
                token_by_token()

        def unseen():
            for i in range(tq):
                bm_ref[i, cols] = jnp.full((per,), -jnp.inf, jnp.float32)

        jax.lax.cond(c * CHUNK < n_max, scored, unseen)
        return carry

    jax.lax.fori_loop(0, bm_ref.shape[1] // per, step, 0)


def _order_key(x):
    b = jax.lax.bitcast_convert_type(x, jnp.int32)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


def _select_kernel(pin_ref, vals_ref, ids_ref, out_ref, *, k, id_bits):
    """Ids of the k highest values (ties: lower id; value -inf never), -1 padded."""
    t = pl.program_id(0)
    pin = pin_ref[t]
    m = vals_ref.shape[0]
    ch = min(SELECT_CHUNK, m)

    def load(c):
        v = vals_ref[pl.ds(c * ch, ch)]
        ids = ids_ref[pl.ds(c * ch, ch)]
        v = jnp.where((ids == pin) & (pin >= 0), jnp.inf, v)
        return _order_key(v), ids, v > -jnp.inf

    def count(pred):
        def body(c, acc):
            key, ids, ok = load(c)
            return acc + jnp.sum((ok & pred(key, ids)).astype(jnp.int32))

        return jax.lax.fori_loop(0, m // ch, body, jnp.int32(0))

    total = count(lambda key, ids: key == key)

    def key_bit(i, thr_u):
        cand = thr_u | jnp.left_shift(jnp.int32(1), 31 - i)
        cand_key = cand ^ jnp.int32(INT_MIN)
        return jnp.where(count(lambda key, ids: key >= cand_key) >= k, cand, thr_u)

    tau = jax.lax.fori_loop(0, 32, key_bit, jnp.int32(0)) ^ jnp.int32(INT_MIN)
    need = k - count(lambda key, ids: key > tau)

    def cut_bit(i, cut):
        cand = cut | jnp.left_shift(jnp.int32(1), id_bits - 1 - i)
        n = count(lambda key, ids: (key == tau) & (ids < cand))
        return jnp.where(n < need, cand, cut)

    cut = jax.lax.fori_loop(0, id_bits, cut_bit, jnp.int32(0))
    small = total <= k
    tau = jnp.where(small, jnp.int32(INT_MIN), tau)
    cut = jnp.where(small, jnp.int32(2**31 - 1), cut)
    picked = jnp.minimum(total, k)
    width = out_ref.shape[0]
    dummy = width // 2  # past every real slot; written by unpicked lanes, then dropped
    lane = jnp.arange(width, dtype=jnp.int32)
    pltriton.store(
        out_ref.at[pl.ds(0, width)], jnp.full((width,), -1, jnp.int32), mask=lane >= picked
    )

    def compact(c, off):
        key, ids, ok = load(c)
        pick = ok & ((key > tau) | ((key == tau) & (ids <= cut)))
        pos = off + jnp.cumsum(pick.astype(jnp.int32)) - 1
        out_ref[jnp.where(pick, pos, dummy)] = ids
        return off + jnp.sum(pick.astype(jnp.int32))

    jax.lax.fori_loop(0, m // ch, compact, jnp.int32(0))


def _rescore_kernel(req_ref, vis_ref, tab_ref, q_ref, w_ref, keys_ref, *rest, nb, e, bs, scaled):
    scales_ref, blocks_ref, vals_ref, ids_ref = rest if scaled else (None, *rest)
    t = pl.program_id(0)
    r, n = req_ref[t], vis_ref[t]
    q, w = q_ref[...], w_ref[...]
    per = CHUNK // bs

    def step(c, carry):
        blk = blocks_ref[pl.ds(c * per, per)]
        entry = (blk[:, None] * bs + jnp.arange(bs, dtype=jnp.int32)[None, :]).reshape(CHUNK)
        ok = (jnp.repeat(blk, bs) >= 0) & (entry < n)
        s = _score(q, w, _gather_keys(tab_ref, keys_ref, scales_ref, r, nb, e, entry))
        vals_ref[pl.ds(c * CHUNK, CHUNK)] = jnp.where(ok, s, -jnp.inf)
        ids_ref[pl.ds(c * CHUNK, CHUNK)] = jnp.where(ok, entry, -1)
        return carry

    jax.lax.fori_loop(0, blocks_ref.shape[0] // per, step, 0)


def _per_token(*shape):
    return pl.BlockSpec((None, *shape), lambda t: (t,) + (0,) * len(shape))


def _whole(x):
    return pl.BlockSpec(x.shape, lambda t: (0,) * x.ndim)


def _select(vals, ids, pin, k, id_bits, interpret):
    t, m = vals.shape
    kp = _pow2(max(k, 1))
    out = pl.pallas_call(
        functools.partial(_select_kernel, k=k, id_bits=id_bits),
        grid=(t,),
        in_specs=[_whole(pin), _per_token(m), _per_token(m)],
        out_specs=_per_token(2 * kp),
        out_shape=jax.ShapeDtypeStruct((t, 2 * kp), jnp.int32),
        compiler_params=_params(),
        interpret=interpret,
    )(pin, vals, ids)
    return out[:, :k]


def _block_maxima(
    token_req, vis, tab, q, w, keys, scales, *, nb, e, bs, nblocks, tq, estimate, interpret
):
    """`_blocks_kernel` over tiles of ``tq`` tokens: f32[T, nblocks]."""
    t, ihp, di = q.shape
    tiles = cdiv(t, tq)
    pad = tiles * tq - t
    if pad:  # padding tokens: nothing visible, the last token's request (shares its tile)
        token_req = jnp.pad(token_req, (0, pad), mode="edge")
        vis = jnp.pad(vis, (0, pad))
        q = jnp.pad(q, ((0, pad), (0, 0), (0, 0)))
        w = jnp.pad(w, ((0, pad), (0, 0)))
    bm = pl.pallas_call(
        functools.partial(
            _blocks_kernel, nb=nb, e=e, bs=bs, tq=tq, ihp=ihp, scaled=scales is not None
        ),
        grid=(tiles,),
        in_specs=[
            _whole(token_req),
            _whole(vis),
            _whole(tab),
            pl.BlockSpec((tq * ihp, di), lambda j: (j, 0)),
            pl.BlockSpec((tq * ihp,), lambda j: (j,)),
            _whole(keys),
            *([] if scales is None else [_whole(scales)]),
        ],
        out_specs=pl.BlockSpec((tq, nblocks), lambda j: (j, 0)),
        out_shape=jax.ShapeDtypeStruct((tiles * tq, nblocks), jnp.float32),
        compiler_params=_params(),
        cost_estimate=estimate,
        interpret=interpret,
    )(
        token_req,
        vis,
        tab,
        q.reshape(-1, di),
        w.reshape(-1),
        keys,
        *([] if scales is None else [scales]),
    )
    return bm[:t]


def _block_selection(bm, vis, *, mode, k, bs, n_entries, cb, interpret):
    """From block maxima f32[T, nblocks]: the top ``min(k, blocks)`` blocks, -1 padded to a
    whole chunk (they hold the exact top-k), and a source's ``cb`` candidate blocks (newest
    pinned) or None."""
    t, nblocks = bm.shape
    block_ids = jnp.broadcast_to(jnp.arange(nblocks, dtype=jnp.int32), bm.shape)
    no_pin = jnp.full((t,), -1, jnp.int32)
    bits = max(1, nblocks.bit_length())
    blocks_out = None
    if mode == "source":
        newest = jnp.where(vis > 0, (vis - 1) // bs, -1)
        blocks_out = _select(bm, block_ids, newest, cb, bits, interpret)
    kb = min(k, cdiv(n_entries, bs))
    blocks = _select(bm, block_ids, no_pin, kb, bits, interpret)
    pad = _pow2(max(kb, CHUNK // bs)) - kb
    return jnp.pad(blocks, ((0, 0), (0, pad)), constant_values=-1), blocks_out


# over 60 lines: the three-kernel pipeline (block maxima, block selection, rescoring) in order
def indexer_topk(
    qi, weights, ikey_pages, comp_tables, token_req, positions, visible, *,
    entries_per_block: int, k: int, candidate_block_size: int = 0, candidate_topk_blocks: int = 0,
    candidates=None, key_scales=None, tokens_per_tile: int = TOKENS_PER_TILE, interpret=False,
):  # fmt: skip
    """Triton indexer; same arguments and results as `reference.indexer_topk`.

    ``tokens_per_tile`` consecutive tokens share one program of `_blocks_kernel` and the keys it
    gathers (see the module docstring); the results do not depend on it.
    """
    mode = check_indexer_args(
        qi, weights, ikey_pages, comp_tables, token_req, positions, visible,
        entries_per_block=entries_per_block, k=k, candidate_block_size=candidate_block_size,
        candidate_topk_blocks=candidate_topk_blocks, candidates=candidates, key_scales=key_scales,
    )  # fmt: skip
    interpret = gpu_interpret(interpret)
    tq = tokens_per_tile
    if isinstance(tq, bool) or not isinstance(tq, int) or tq < 1:
        raise ValueError(f"indexer_topk (gpu): tokens_per_tile={tq!r} must be an int >= 1")
    t, ih, di = qi.shape
    e = entries_per_block
    p = ikey_pages.shape[0]
    _, nb = comp_tables.shape
    if di & (di - 1) or di < 16:
        raise ValueError(f"indexer_topk (gpu): index head dim {di} must be a power of two >= 16")
    bs = candidate_block_size if mode != "plain" else 8
    if bs & (bs - 1) or bs > CHUNK:
        raise ValueError(f"indexer_topk (gpu): candidate_block_size={bs} must be a power of two")
    ihp = max(16, _pow2(ih))
    q = jnp.pad(qi, ((0, 0), (0, ihp - ih), (0, 0)))
    w = jnp.pad(weights.astype(jnp.float32), ((0, 0), (0, ihp - ih)))  # padded heads weigh 0
    n_entries = nb * e
    vis = jnp.where(positions >= 0, jnp.clip(visible, 0, n_entries), 0).astype(jnp.int32)
    keys = ikey_pages.reshape(p * e, di)  # fp8 keys are converted to q's dtype in registers
    scales = None if key_scales is None else key_scales.reshape(p * e).astype(jnp.float32)
    extra = () if scales is None else (scales,)
    tab = comp_tables.reshape(-1)
    id_bits = max(1, n_entries.bit_length())
    scalars = (token_req, vis, tab)
    common_specs = [_whole(token_req), _whole(vis), _whole(tab), _per_token(ihp, di)]
    common_specs += [_per_token(ihp), _whole(keys), *(_whole(x) for x in extra)]
    # the key stream is read once per tile (plus once per token of a tile straddling requests
    # that is not in the tile's first request: data-dependent, not counted)
    c = cost(
        t,
        ih,
        di,
        n_entries,
        k=k,
        key_dtype=ikey_pages.dtype,
        q_dtype=qi.dtype,
        key_reads=cdiv(t, tq),
        key_scale_bytes=0 if scales is None else 4,
    )

    if mode == "consumer":
        cbp = _pow2(max(candidates.shape[1], CHUNK // bs))
        blocks = jnp.pad(candidates, ((0, 0), (0, cbp - candidates.shape[1])), constant_values=-1)
        blocks_out = None
    else:
        bm = _block_maxima(
            token_req, vis, tab, q, w, keys, scales, nb=nb, e=e, bs=bs,
            nblocks=_pow2(max(cdiv(n_entries, bs), CHUNK // bs)), tq=tq,
            estimate=cost_estimate(c["flops"], c["bytes"]), interpret=interpret,
        )  # fmt: skip
        blocks, blocks_out = _block_selection(
            bm, vis, mode=mode, k=k, bs=bs, n_entries=n_entries, cb=candidate_topk_blocks,
            interpret=interpret,
        )  # fmt: skip
    m = blocks.shape[1] * bs
    vals, ids = pl.pallas_call(
        functools.partial(_rescore_kernel, nb=nb, e=e, bs=bs, scaled=scales is not None),
        grid=(t,),
        in_specs=[*common_specs, _per_token(blocks.shape[1])],
        out_specs=[_per_token(m), _per_token(m)],
        out_shape=[
            jax.ShapeDtypeStruct((t, m), jnp.float32),
            jax.ShapeDtypeStruct((t, m), jnp.int32),
        ],
        compiler_params=_params(),
        interpret=interpret,
    )(*scalars, q, w, keys, *extra, blocks)
    topk = _select(vals, ids, jnp.full((t,), -1, jnp.int32), k, id_bits, interpret)
    return topk if blocks_out is None else (topk, blocks_out)
