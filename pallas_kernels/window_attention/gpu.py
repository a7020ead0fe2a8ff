"""Pallas Triton-backend GPU kernel of window attention over the paged window cache.

Targets NVIDIA Hopper (H100/H200, sm_90), where it is compile-tested; the Triton backend also
serves Ampere (A100, sm_80) and Ada. jax 0.12 deprecates the Pallas Triton backend (it still
ships and compiles); a Mosaic GPU version is the follow-up for Blackwell and for TMA/WGMMA speed. One program per (token, block of `BH` heads):

* Triton has no scalar prefetch: the block table (flattened) and the pages (viewed as rows
  [P * S, D]) are plain inputs, and keys are gathered with vector-indexed ref loads.
* The program walks its token's window `lo .. p` in chunks of `BK` positions; positions past `p`
  are clamped to `p` before the table lookup and masked afterwards, so the kernel only ever reads
  rows inside the window (never the null block or a stale page).
* Online softmax in f32 (`pltriton.dot` with f32 accumulation, no TF32 for f32 inputs); the sink
  enters only the denominator at the end. Heads of one token share their key rows through L2.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels._backend import MASK_VALUE
from pallas_kernels.window_attention.cost import window_cost

BLOCK_HEADS = 16  # heads per program (tl.dot needs >= 16 rows)
BLOCK_KEYS = 32  # key positions per loop step
NUM_WARPS = 4


def _dot(a, b, *, trans_b=False):
    """f32-accumulating dot without TF32 (f32 results must match the reference)."""
    if a.dtype == jnp.float32 or b.dtype == jnp.float32:
        return pltriton.dot(
            a.astype(jnp.float32), b.astype(jnp.float32), trans_b=trans_b, allow_tf32=False
        )
    return pltriton.dot(a, b, trans_b=trans_b).astype(jnp.float32)


def _kernel(
    req_ref,  # i32[T]
    pos_ref,  # i32[T]
    lo_ref,  # i32[T]
    tables_ref,  # i32[R * nb]
    kv_ref,  # [P * S, D]
    q_ref,  # [BH, D]
    sink_ref,  # f32[BH]
    *outs,  # out [BH, D] | m [BH], l [BH], acc [BH, D]
    nb: int,
    page: int,
    block_keys: int,
    scale: float,
    return_state: bool,
):
    t = pl.program_id(0)
    r, p, lo = req_ref[t], pos_ref[t], lo_ref[t]
    q = q_ref[...]
    heads, dim = q.shape
    count = jnp.where(p >= 0, jnp.maximum(p - lo + 1, 0), 0)

    def chunk(c, carry):
        m, denom, acc = carry
        kpos = lo + c * block_keys + jnp.arange(block_keys, dtype=jnp.int32)
        seen = kpos <= p
        kpos = jnp.minimum(kpos, p)
        blocks = tables_ref[r * nb + kpos // page]
        keys = kv_ref[blocks * page + kpos % page]  # [BK, D]
        z = _dot(q, keys, trans_b=True) * scale  # [BH, BK]
        z = jnp.where(seen[None, :], z, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(z, axis=1))
        alpha = jnp.exp(m - m_new)
        e = jnp.where(seen[None, :], jnp.exp(z - m_new[:, None]), 0.0)
        denom = alpha * denom + jnp.sum(e, axis=1)
        acc = alpha[:, None] * acc + _dot(e.astype(keys.dtype), keys)
        return m_new, denom, acc

    init = (
        jnp.full((heads,), MASK_VALUE, jnp.float32),
        jnp.zeros((heads,), jnp.float32),
        jnp.zeros((heads, dim), jnp.float32),
    )
    m, denom, acc = lax.fori_loop(jnp.int32(0), (count + block_keys - 1) // block_keys, chunk, init)
    if return_state:
        outs[0][...] = m
        outs[1][...] = denom
        outs[2][...] = acc
    else:
        sink = sink_ref[...]
        top = jnp.maximum(m, sink)
        w = jnp.exp(m - top)
        outs[0][...] = (acc * (w / (denom * w + jnp.exp(sink - top)))[:, None]).astype(
            outs[0].dtype
        )


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
    interpret: bool = False,
    block_heads: int = BLOCK_HEADS,
    block_keys: int = BLOCK_KEYS,
):
    """The GPU kernel behind `pallas_kernels.window_attention` (same arguments and results)."""
    num_tokens, heads, dim = q.shape
    num_pages, page, _ = swa_pages.shape
    nb = swa_tables.shape[1]
    bh = min(block_heads, heads)
    if heads % bh:
        raise ValueError(f"heads={heads} must be a multiple of block_heads={bh}")
    bk = min(block_keys, 1 << (window - 1).bit_length())
    lo = jnp.maximum(positions - window + 1, 0)
    if replay_start is not None:
        lo = jnp.maximum(lo, replay_start[token_req])

    grid = (num_tokens, heads // bh)
    qspec = pl.BlockSpec((None, bh, dim), lambda t, h: (t, h, 0))
    if return_state:
        out_shape = (
            jax.ShapeDtypeStruct((num_tokens, heads), jnp.float32),
            jax.ShapeDtypeStruct((num_tokens, heads), jnp.float32),
            jax.ShapeDtypeStruct((num_tokens, heads, dim), jnp.float32),
        )
        vec = pl.BlockSpec((None, bh), lambda t, h: (t, h))
        out_specs = (vec, vec, qspec)
        out_bytes = num_tokens * heads * (dim + 2) * 4
    else:
        out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
        out_specs = qspec
        out_bytes = q.size * q.dtype.itemsize
    cost = window_cost(
        num_tokens=num_tokens,
        num_requests=num_tokens,  # every token reads its whole window (shared via L2)
        heads=heads,
        dim=dim,
        window=window,
        page_size=page,
        q_bytes=q.dtype.itemsize,
        kv_bytes=swa_pages.dtype.itemsize,
        out_bytes_total=out_bytes,
    )
    whole = pl.BlockSpec()  # the whole array: gathered from inside the kernel
    kernel = functools.partial(
        _kernel, nb=nb, page=page, block_keys=bk, scale=scale, return_state=return_state
    )
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            whole,
            whole,
            whole,
            whole,
            whole,
            qspec,
            pl.BlockSpec((bh,), lambda t, h: (h,)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=2),
        cost_estimate=pl.CostEstimate(**cost.as_estimate()),
        interpret=interpret,
        name="window_attention",
    )(
        token_req,
        positions,
        lo,
        swa_tables.reshape(-1),
        swa_pages.reshape(num_pages * page, dim),
        q,
        sink.astype(jnp.float32),
    )
