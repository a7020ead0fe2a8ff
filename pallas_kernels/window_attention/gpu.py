"""Pallas Triton-backend GPU kernel of window attention over the paged window cache.

Design notes: pallas_kernels/README.md, "pallas_kernels/window_attention/gpu.py".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.softmax import empty_state, sink_weight
from pallas_kernels.triton_ops import attend_chunk
from pallas_kernels.window_attention.cost import window_call_cost

BLOCK_HEADS = 16  # heads per program (tl.dot needs >= 16 rows)
BLOCK_KEYS = 32  # key positions per loop step
NUM_WARPS = 4


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
        kpos = lo + c * block_keys + jnp.arange(block_keys, dtype=jnp.int32)
        seen = kpos <= p
        kpos = jnp.minimum(kpos, p)
        blocks = tables_ref[r * nb + kpos // page]
        keys = kv_ref[blocks * page + kpos % page]  # [BK, D]
        return attend_chunk(carry, q, keys, seen, scale)

    init = empty_state(heads, dim, keepdims=False)
    m, denom, acc = lax.fori_loop(jnp.int32(0), (count + block_keys - 1) // block_keys, chunk, init)
    if return_state:
        outs[0][...] = m
        outs[1][...] = denom
        outs[2][...] = acc
    else:
        outs[0][...] = (acc * sink_weight(m, denom, sink_ref[...])[:, None]).astype(outs[0].dtype)


def _outputs(q: jax.Array, bh: int, qspec, return_state: bool):
    """(out_shape, out_specs, bytes written) of `out` [T, H, D] or the f32 state."""
    num_tokens, heads, dim = q.shape
    if not return_state:
        return jax.ShapeDtypeStruct(q.shape, q.dtype), qspec, q.size * q.dtype.itemsize
    out_shape = (
        jax.ShapeDtypeStruct((num_tokens, heads), jnp.float32),
        jax.ShapeDtypeStruct((num_tokens, heads), jnp.float32),
        jax.ShapeDtypeStruct((num_tokens, heads, dim), jnp.float32),
    )
    vec = pl.BlockSpec((None, bh), lambda t, h: (t, h))
    return out_shape, (vec, vec, qspec), num_tokens * heads * (dim + 2) * 4


def window_attention(
    q, swa_pages, swa_tables, token_req, positions, sink, *, window: int, scale: float,
    replay_start=None, return_state: bool = False, interpret: bool = False,
    block_heads: int = BLOCK_HEADS, block_keys: int = BLOCK_KEYS,
):  # fmt: skip
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
    out_shape, out_specs, out_bytes = _outputs(q, bh, qspec, return_state)
    # num_requests = T: every token reads its whole window (shared via L2)
    cost = window_call_cost(q, swa_pages, window, num_tokens, out_bytes)
    whole = pl.BlockSpec()  # the whole array: gathered from inside the kernel
    kernel = functools.partial(
        _kernel, nb=nb, page=page, block_keys=bk, scale=scale, return_state=return_state
    )
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[whole, whole, whole, whole, whole, qspec, pl.BlockSpec((bh,), lambda t, h: (h,))],
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
