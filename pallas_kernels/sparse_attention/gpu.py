"""Pallas Triton-backend GPU kernel of sparse attention over the paged compressed cache.

Design notes: pallas_kernels/README.md, "pallas_kernels/sparse_attention/gpu.py".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.softmax import empty_state, sink_weight
from pallas_kernels.sparse_attention.cost import sparse_call_cost
from pallas_kernels.triton_ops import attend_chunk

BLOCK_HEADS = 16
BLOCK_KEYS = 32
NUM_WARPS = 4


def _kernel(
    req_ref,  # i32[T]
    pos_ref,  # i32[T]
    tables_ref,  # i32[R * nbc]
    kv_ref,  # [P * E, D]
    q_ref,  # [BH, D]
    sink_ref,  # f32[BH]
    topk_ref,  # i32[Kp]
    *refs,  # (m [BH], l [BH], acc [BH, D]) if with_state, then out [BH, D]
    nbc: int,
    per_block: int,
    block_keys: int,
    scale: float,
    with_state: bool,
):
    o_ref = refs[-1]
    t = pl.program_id(0)
    r, p = req_ref[t], pos_ref[t]
    q = q_ref[...]
    heads, dim = q.shape
    if with_state:
        init = (refs[0][...], refs[1][...], refs[2][...])
    else:
        init = empty_state(heads, dim, keepdims=False)

    def chunk(c, carry):
        ids = topk_ref[pl.ds(c * block_keys, block_keys)]
        picked = ids >= 0
        ids = jnp.maximum(ids, 0)
        blocks = tables_ref[r * nbc + ids // per_block]
        keys = kv_ref[blocks * per_block + ids % per_block]  # [BK, D]
        keys = jnp.where(picked[:, None], keys, jnp.zeros_like(keys))
        return attend_chunk(carry, q, keys, picked, scale)

    num_chunks = jnp.where(p >= 0, jnp.int32(topk_ref.shape[0] // block_keys), jnp.int32(0))
    m, denom, acc = lax.fori_loop(jnp.int32(0), num_chunks, chunk, init)
    out = acc * sink_weight(m, denom, sink_ref[...])[:, None]
    o_ref[...] = jnp.where(p >= 0, out, 0.0).astype(o_ref.dtype)


def _operands(args, state, qspec, bh: int, kp: int):
    """(in_specs, inputs) of the kernel: the gathered arrays whole, q / sink / top-k / state
    blocked per (token, head block)."""
    q, comp_pages, comp_tables, token_req, positions, topk, sink = args
    whole = pl.BlockSpec()  # the whole array: gathered from inside the kernel
    head_block = pl.BlockSpec((bh,), lambda t, h: (h,))
    topk_row = pl.BlockSpec((None, kp), lambda t, h: (t, 0))
    in_specs = [whole, whole, whole, whole, qspec, head_block, topk_row]
    inputs = [
        token_req,
        positions,
        comp_tables.reshape(-1),
        comp_pages.reshape(comp_pages.shape[0] * comp_pages.shape[1], q.shape[2]),
        q,
        sink.astype(jnp.float32),
        topk,
    ]
    if state is not None:
        vec = pl.BlockSpec((None, bh), lambda t, h: (t, h))
        in_specs += [vec, vec, qspec]
        inputs += [x.astype(jnp.float32) for x in state]
    return in_specs, inputs


def sparse_attention(
    q, comp_pages, comp_tables, token_req, positions, topk, sink, *, entries_per_block: int,
    scale: float, state=None, interpret: bool = False, block_heads: int = BLOCK_HEADS,
    block_keys: int = BLOCK_KEYS,
):  # fmt: skip
    """The GPU kernel behind `pallas_kernels.sparse_attention` (same arguments and results)."""
    num_tokens, heads, dim = q.shape
    k = topk.shape[1]
    bh = min(block_heads, heads)
    if heads % bh:
        raise ValueError(f"heads={heads} must be a multiple of block_heads={bh}")
    kp = max(block_keys, 1 << (k - 1).bit_length())  # Triton shapes are powers of two
    bk = min(block_keys, kp)
    topk = jnp.pad(topk, ((0, 0), (0, kp - k)), constant_values=-1)

    qspec = pl.BlockSpec((None, bh, dim), lambda t, h: (t, h, 0))
    with_state = state is not None
    in_specs, inputs = _operands(
        (q, comp_pages, comp_tables, token_req, positions, topk, sink), state, qspec, bh, kp
    )
    cost = sparse_call_cost(q, comp_pages, k, with_state)
    kernel = functools.partial(
        _kernel,
        nbc=comp_tables.shape[1],
        per_block=entries_per_block,
        block_keys=bk,
        scale=scale,
        with_state=with_state,
    )
    return pl.pallas_call(
        kernel,
        grid=(num_tokens, heads // bh),
        in_specs=in_specs,
        out_specs=qspec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=2),
        cost_estimate=pl.CostEstimate(**cost.as_estimate()),
        interpret=interpret,
        name="sparse_attention",
    )(*inputs)
