"""Mosaic TPU kernel of sparse attention over the paged compressed cache.

Design notes: pallas_kernels/README.md, "pallas_kernels/sparse_attention/tpu.py".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import backend
from pallas_kernels.softmax import empty_state, online_step, sink_weight
from pallas_kernels.sparse_attention.cost import sparse_call_cost

CHUNK = 128  # slab rows per softmax step (one lane tile of logits)
TOKENS_PER_TILE = 1  # > 1 shares fetched rows between tokens of a request (sorts in XLA)
MAX_TOKENS_PER_CALL = 8192  # bounds the scalar-prefetched metadata (SMEM is 1 MiB)
_ID_BITS = 28  # entry ids below 2^28 (1M-token contexts need 2^20); 3 bits of request slot


# over 60 lines: one kernel body: the row pipeline and the per-token online softmax
def _kernel(
    # scalar prefetch (SMEM)
    pos_ref,  # i32[T]
    seg_ref,  # i32[2 * T]: each token's [lo, hi) range of its tile's row list
    # inputs
    rows_hbm,  # i32[n_tiles, U] row addresses (-1 = empty), HBM
    q_ref,  # [tq, H, D]
    sink_ref,  # f32[H, 1]
    ucol_ref,  # i32[U, 1] entry id of each slot (-1 = empty)
    urow_ref,  # i32[1, U] the same, lane-major
    *refs,
    tq: int,
    per_block: int,
    scale: float,
    with_state: bool,
    packed: bool,
    bitcast_in_kernel: bool,
):
    refs = list(refs)
    topk_ref = refs.pop(0) if tq > 1 else None  # i32[tq, 1, Kp]
    state_refs = [refs.pop(0) for _ in range(3)] if with_state else None
    kv_hbm, o_ref, slab, rows_smem, row_sem, list_sem, n_fetch = refs
    # bf16 rows share 32-bit sublane words in pairs, and a DMA cannot address half a word: fetch
    # the word row holding the entry (rows 2j, 2j+1 -> low, high halves) and unpack by parity.
    words = kv_hbm.bitcast(jnp.uint32) if bitcast_in_kernel else kv_hbm
    row_of = (lambda off: off // 2) if packed else (lambda off: off)
    # grid (core, tile of the core): each TensorCore walks its own run of tiles in order
    step, per_core = pl.program_id(1), pl.num_programs(1)
    tile = pl.program_id(0) * per_core + step
    buf = step % 2
    fetch = (rows_hbm, rows_smem, list_sem, words, row_of, slab, row_sem, n_fetch)
    _fetch_rows(fetch, step, per_core, tile, buf, per_block=per_block)

    sink = sink_ref[...]  # [H, 1]

    def token(i, c):
        t = tile * tq + i

        @pl.when(pos_ref[t] < 0)
        def _():
            o_ref[i] = jnp.zeros(o_ref.shape[1:], o_ref.dtype)

        @pl.when(pos_ref[t] >= 0)
        def _():
            lo, hi = seg_ref[2 * t], seg_ref[2 * t + 1]
            q = q_ref[i]  # [H, D]
            heads, dim = q.shape
            if with_state:
                init = tuple(ref[i] for ref in state_refs)
            else:
                init = empty_state(heads, dim, keepdims=True)
            picks = topk_ref[i] if tq > 1 else None  # [1, Kp]
            chunk = functools.partial(
                _chunk, slab, buf, ucol_ref, urow_ref, q, lo, hi, picks, scale, packed
            )
            m, denom, acc = lax.fori_loop(lo // CHUNK, (hi + CHUNK - 1) // CHUNK, chunk, init)
            o_ref[i] = (acc * sink_weight(m, denom, sink)).astype(o_ref.dtype)

        return c

    lax.fori_loop(0, tq, token, 0)


def _fetch_rows(fetch, step, per_core, tile, buf, *, per_block: int):
    """The kernel's DMA pipeline: the row lists two tiles ahead into SMEM, the rows of the next
    tile into the other slab, then wait for this tile's rows in slab ``buf``."""
    rows_hbm, rows_smem, list_sem, words, row_of, slab, row_sem, n_fetch = fetch
    slots = slab.shape[1]

    def list_copy(which, slot):
        return pltpu.make_async_copy(rows_hbm.at[which], rows_smem.at[slot], list_sem.at[slot])

    def row_copy(addr, b, u):
        src = words.at[addr // per_block, pl.ds(row_of(addr % per_block), 1)]
        return pltpu.make_async_copy(src, slab.at[b, pl.ds(u, 1)], row_sem.at[b])

    def issue(b):
        """Start the row DMAs of the list in rows_smem[b] into slab b."""

        def row(u, count):
            addr = rows_smem[b, u]

            @pl.when(addr >= 0)
            def _():
                row_copy(addr, b, u).start()

            return count + (addr >= 0).astype(jnp.int32)

        n_fetch[b] = lax.fori_loop(0, slots, row, jnp.int32(0))

    @pl.when(step == 0)
    def _():
        first = list_copy(tile, 0)
        first.start()
        first.wait()
        issue(0)

        @pl.when(per_core > 1)
        def _():
            list_copy(tile + 1, 1).start()

    @pl.when(step + 1 < per_core)
    def _():
        list_copy(tile + 1, 1 - buf).wait()
        issue(1 - buf)

        @pl.when(step + 2 < per_core)
        def _():
            list_copy(tile + 2, buf).start()

    def wait(i, c):
        row_copy(0, buf, 0).wait()
        return c

    lax.fori_loop(0, n_fetch[buf], wait, 0)


def _chunk(slab, buf, ucol_ref, urow_ref, q, lo, hi, picks, scale, packed, k, carry):
    """Fold slab rows ``k * CHUNK ..`` of the token's segment ``[lo, hi)`` into its state; with
    ``picks`` [1, Kp] (shared rows) only the rows the token selected count."""
    m, denom, acc = carry
    base = pl.multiple_of(k * CHUNK, CHUNK)
    rows = slab[buf, pl.ds(base, CHUNK), :]  # [C, D]
    ucol = ucol_ref[pl.ds(base, CHUNK), :]  # [C, 1]
    urow = urow_ref[:, pl.ds(base, CHUNK)]  # [1, C]
    scol = base + lax.broadcasted_iota(jnp.int32, (CHUNK, 1), 0)
    srow = base + lax.broadcasted_iota(jnp.int32, (1, CHUNK), 1)
    keep_col = (ucol >= 0) & (scol >= lo) & (scol < hi)
    keep_row = (urow >= 0) & (srow >= lo) & (srow < hi)
    if picks is not None:  # the union holds other tokens' picks too
        hit = ((ucol == picks) & (ucol >= 0)).astype(jnp.float32)  # [C, Kp]
        keep_col &= jnp.max(hit, axis=1, keepdims=True) > 0.5
        ones = jnp.ones((8, hit.shape[1]), jnp.float32)
        count = lax.dot_general(ones, hit, (((1,), (1,)), ((), ())))  # [8, C]
        keep_row &= count[0:1] > 0.5
    if packed:  # exact bf16 -> f32 from the half of the word that holds the row
        odd = (ucol & 1) == 1
        bits = jnp.where(odd, rows & jnp.uint32(0xFFFF0000), rows << 16)
        rows = lax.bitcast_convert_type(bits, jnp.float32).astype(jnp.bfloat16)
    qq, kk = q, rows
    if qq.dtype != kk.dtype:
        qq, kk = qq.astype(jnp.float32), kk.astype(jnp.float32)
    prec = backend.mxu_precision(kk.dtype)
    z = lax.dot_general(
        qq, kk, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=jnp.float32
    )  # [H, C]
    m_new, alpha, e = online_step(m, z, keep_row, scale)
    kk = jnp.where(keep_col, kk, jnp.zeros_like(kk))
    pv = jnp.dot(e.astype(kk.dtype), kk, precision=prec, preferred_element_type=jnp.float32)
    return m_new, alpha * denom + jnp.sum(e, axis=1, keepdims=True), alpha * acc + pv


def row_lists(comp_tables, token_req, positions, topk, *, per_block: int, tq: int):
    """Per tile: the row list (addresses, entry ids) and each token's [lo, hi) segment of it.

    tq == 1: the token's own row. tq > 1: the sorted, de-duplicated union of the tile's picks,
    grouped by request; a token's segment is its request's part.
    """
    num_tokens, kp = topk.shape
    valid = (topk >= 0) & (positions[:, None] >= 0)
    ids = jnp.where(valid, topk, -1)
    safe = jnp.maximum(ids, 0)
    addr = comp_tables[token_req[:, None], safe // per_block] * per_block + safe % per_block
    addr = jnp.where(valid, addr, -1)
    if tq == 1:
        lo = jnp.zeros((num_tokens,), jnp.int32)
        seg = jnp.stack([lo, lo + kp], axis=1)
        return addr, ids, seg
    # One int32 sort key per pick: (the tile-local slot of its request, entry id). A request's
    # slot is the index of its first token in the tile, so keys group picks by request.
    tiles, slots = num_tokens // tq, tq * kp
    tile_req = token_req.reshape(tiles, tq)
    first = jnp.argmax(tile_req[:, :, None] == tile_req[:, None, :], axis=2).astype(jnp.int32)
    none = jnp.int32(2**31 - 1)
    key = jnp.where(
        valid.reshape(tiles, tq, kp),
        (first[..., None] << _ID_BITS) | ids.reshape(tiles, tq, kp),
        none,
    ).reshape(tiles, slots)
    key = jnp.sort(key, axis=1)
    key = jnp.where(jnp.pad(key[:, 1:] == key[:, :-1], ((0, 0), (1, 0))), none, key)
    key = jnp.sort(key, axis=1)  # distinct picks first, grouped by request
    kept = key != none
    slot = jnp.where(kept, key >> _ID_BITS, tq)
    ids_t = jnp.where(kept, key & (2**_ID_BITS - 1), -1)
    req = jnp.take_along_axis(tile_req, jnp.minimum(slot, tq - 1), axis=1)
    safe = jnp.maximum(ids_t, 0)
    addr_t = comp_tables[req, safe // per_block] * per_block + safe % per_block
    addr_t = jnp.where(kept, addr_t, -1)
    lo = jnp.sum(slot[:, None, :] < first[:, :, None], axis=2)
    hi = jnp.sum(slot[:, None, :] <= first[:, :, None], axis=2)
    seg = jnp.stack([lo.reshape(-1), hi.reshape(-1)], axis=1).astype(jnp.int32)
    return addr_t, ids_t, seg


def pack_row_pairs(pages: jax.Array) -> jax.Array:
    """bf16 [P, E, D] -> u32 [P, E / 2, D], rows 2j and 2j+1 in the low and high halves: the
    view Mosaic's ref bitcast gives on the chip. Used only under the checking interpreter, which
    cannot simulate ref bitcasts (it copies the cache; tests only)."""
    bits = lax.bitcast_convert_type(pages, jnp.uint16).astype(jnp.uint32)
    return bits[:, 0::2] | (bits[:, 1::2] << 16)


def sparse_attention(
    q, comp_pages, comp_tables, token_req, positions, topk, sink, *, entries_per_block: int,
    scale: float, state=None, interpret=False, tokens_per_tile: int = TOKENS_PER_TILE,
    num_cores: int | None = None, max_tokens_per_call: int = MAX_TOKENS_PER_CALL,
):  # fmt: skip
    """The TPU kernel behind `pallas_kernels.sparse_attention` (same arguments and results).

    ``num_cores``: TensorCores to split the tiles over (None: the device's, 2 on megacore
    chips); each core walks a contiguous run of tiles with its own prefetch pipeline.
    ``max_tokens_per_call``: longer batches run as several kernel calls (their scalar-prefetched
    metadata must fit in SMEM)."""

    def run(tokens, tq, cores, per_core):
        q, token_req, positions, topk, state = tokens
        return _sparse_call(
            q, comp_pages, comp_tables, token_req, positions, topk, sink,
            entries_per_block=entries_per_block, scale=scale, state=state, interpret=interpret,
            tq=tq, cores=cores, per_core=per_core,
        )  # fmt: skip

    return backend.token_tiles(
        run,
        (q, token_req, positions, topk, None if state is None else tuple(state)),
        (0, 0, -1, -1, 0),
        tokens_per_tile=tokens_per_tile,
        num_cores=num_cores,
        max_tokens_per_call=max_tokens_per_call,
    )


def _operands(q, sink, topk, state, addr, ids, pages, *, tq: int, block):
    """(in_specs, inputs) after the scalar prefetch: row lists, q, sink, slot ids, the top-k
    rows when tokens share rows, the window state, the pages (HBM)."""
    tiles, slots = ids.shape
    _, heads, dim = q.shape
    in_specs = [
        pl.BlockSpec(memory_space=pl.ANY),
        pl.BlockSpec((tq, heads, dim), block),
        pl.BlockSpec((heads, 1), lambda c, j, *_: (0, 0)),
        pl.BlockSpec((None, slots, 1), block),
        pl.BlockSpec((None, 1, slots), block),
    ]
    inputs = [
        addr.reshape(tiles, slots),
        q,
        sink.astype(jnp.float32).reshape(heads, 1),
        ids[:, :, None],
        ids[:, None, :],
    ]
    if tq > 1:
        in_specs.append(pl.BlockSpec((tq, 1, topk.shape[1]), block))
        inputs.append(topk[:, None, :])
    if state is not None:
        m, denom, acc = (x.astype(jnp.float32) for x in state)
        in_specs += [
            pl.BlockSpec((tq, heads, 1), block),
            pl.BlockSpec((tq, heads, 1), block),
            pl.BlockSpec((tq, heads, dim), block),
        ]
        inputs += [m[..., None], denom[..., None], acc]
    in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
    inputs.append(pages)
    return in_specs, inputs


def _check(page_dtype, entries_per_block: int, entries: int, tq: int) -> None:
    """The TPU kernel's limits: f32 or bf16 pages (bf16: pairs of rows), row-sharing keys."""
    packed = page_dtype == jnp.bfloat16
    if not packed and backend.itemsize(page_dtype) != 4:
        raise ValueError(f"comp_pages must be f32 or bf16 for the TPU kernel, got {page_dtype}")
    if packed and entries_per_block % 2:
        raise ValueError(f"bf16 pages need an even entries_per_block, got {entries_per_block}")
    if tq > 8 or entries > 2**_ID_BITS:
        raise ValueError(
            f"row sharing needs tokens_per_tile <= 8 and < 2^{_ID_BITS} entries per request, got "
            f"{tq} tokens per tile and {entries}"
        )


# over 60 lines: one pallas_call: its row lists, specs, scratch and operands read best together
def _sparse_call(
    q, comp_pages, comp_tables, token_req, positions, topk, sink, *, entries_per_block, scale,
    state, interpret, tq, cores, per_core,
):  # fmt: skip
    """One kernel call over whole tiles of ``tq`` tokens, ``per_core`` tiles per core."""
    num_tokens, heads, dim = q.shape
    k = topk.shape[1]
    packed = comp_pages.dtype == jnp.bfloat16
    _check(comp_pages.dtype, entries_per_block, comp_tables.shape[1] * entries_per_block, tq)
    bitcast_in_kernel = packed and not isinstance(interpret, pltpu.InterpretParams)
    slab_dtype = jnp.uint32 if packed else comp_pages.dtype
    kp = backend.cdiv(k, CHUNK) * CHUNK
    topk = jnp.pad(topk, ((0, 0), (0, kp - k)), constant_values=-1)
    tiles, slots = num_tokens // tq, tq * kp
    addr, ids, seg = row_lists(
        comp_tables, token_req, positions, topk, per_block=entries_per_block, tq=tq
    )
    ids = ids.reshape(tiles, slots)

    with_state = state is not None
    tok_block = lambda c, j, *_: (c * per_core + j, 0, 0)  # noqa: E731
    pages = comp_pages if bitcast_in_kernel or not packed else pack_row_pairs(comp_pages)
    in_specs, inputs = _operands(q, sink, topk, state, addr, ids, pages, tq=tq, block=tok_block)

    isz = backend.itemsize
    cost = sparse_call_cost(q, comp_pages, k, with_state)
    vmem = (
        2 * slots * dim * isz(comp_pages.dtype)
        + 2 * slots * 128 * 4  # the lane-padded id column
        + 6 * tq * heads * dim * 4  # q, out, acc blocks (f32 bound), double-buffered
        + 8 * CHUNK * max(dim, kp) * 4  # temporaries
    )
    kernel = functools.partial(
        _kernel,
        tq=tq,
        per_block=entries_per_block,
        scale=scale,
        with_state=with_state,
        packed=packed,
        bitcast_in_kernel=bitcast_in_kernel,
    )
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(cores, per_core),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((tq, heads, dim), tok_block),
            scratch_shapes=[
                pltpu.VMEM((2, slots, dim), slab_dtype),
                pltpu.SMEM((2, slots), jnp.int32),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SMEM((2,), jnp.int32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"),
            vmem_limit_bytes=int(min(max(32 << 20, 2 * vmem), 100 << 20)),
        ),
        cost_estimate=backend.cost_estimate(**cost.as_estimate()),
        interpret=interpret,
        name="sparse_attention",
    )(positions, seg.reshape(-1), *inputs)
