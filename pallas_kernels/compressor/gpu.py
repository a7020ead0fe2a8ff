"""Triton (Pallas GPU) compressor: one program per token.

Design notes: pallas_kernels/README.md, "pallas_kernels/compressor/gpu.py".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.backend import cost_estimate, gpu_interpret
from pallas_kernels.compressor.common import cost, pair_pool, prepare
from pallas_kernels.compressor.tpu import CLOSES, FROM_RING, token_metadata

__all__ = ["compressor"]


def _norm_scale(x, eps):
    """rsqrt(mean(x^2) + eps) of an f32 row (the factor of `common.rms_norm`)."""
    return jax.lax.rsqrt(jnp.mean(x * x) + eps)


# over 60 lines: one kernel body: pooling, norm and the strided rope halves of one token
def _kernel(
    slot_ref,  # i32[T]
    src_ref,  # i32[T]
    flags_ref,  # i32[T]
    gpos_ref,  # f32[T]
    kv_ref,  # [T, W]
    ring_ref,  # f32[Pr * C, 2D] (ratio 2) | unused
    w_ref,  # [D]
    inv_ref,  # f32[half]
    pages_in,  # aliased with pages_ref
    latent_ref,  # [T, D]
    pages_ref,  # [P * E, D]
    *,
    ratio,
    eps,
    d,
    half,
    latent_dtype,
):
    del pages_in
    t = pl.program_id(0)
    flags = flags_ref[t]
    closes = (flags & CLOSES) != 0
    head = d - 2 * half
    w = w_ref[...].astype(jnp.float32)

    def at(ref, row, off, start, stride):
        """Lanes ``off + start + stride * i`` of one row: all D (stride 1) or the rope tail's
        even / odd half (stride 2)."""
        n = d if stride == 1 else half
        return ref[row, pl.ds(off + start, n, stride=stride)]

    if ratio == 1:

        def pre_norm(start, stride):
            return at(kv_ref, t, 0, start, stride).astype(jnp.float32)

    else:
        prev = jnp.maximum(t - 1, 0)
        src = jnp.maximum(src_ref[t], 0)
        from_ring = (flags & FROM_RING) != 0

        def pre_norm(start, stride):
            a1, s1 = at(kv_ref, t, 0, start, stride), at(kv_ref, t, d, start, stride)
            a0 = jnp.where(
                from_ring, at(ring_ref, src, 0, start, stride), at(kv_ref, prev, 0, start, stride)
            )
            s0 = jnp.where(
                from_ring, at(ring_ref, src, d, start, stride), at(kv_ref, prev, d, start, stride)
            )
            pooled = pair_pool(a0, s0, a1, s1)
            return pooled.astype(latent_dtype).astype(jnp.float32)

    x = pre_norm(0, 1)
    r = _norm_scale(x, eps)
    z = jnp.where(closes, (w * (x * r)).astype(latent_dtype), jnp.zeros((d,), latent_dtype))
    latent_ref[t, :] = z

    slot = slot_ref[t]

    @pl.when(slot >= 0)
    def _write_record():
        lane = jax.lax.broadcasted_iota(jnp.int32, (1, d), 1)
        pltriton.store(
            pages_ref.at[pl.ds(slot, 1), :],
            z.astype(pages_ref.dtype)[None, :],
            mask=lane < head,
        )
        we = w_ref[pl.ds(head, half, stride=2)].astype(jnp.float32)
        wo = w_ref[pl.ds(head + 1, half, stride=2)].astype(jnp.float32)
        ze = (we * (pre_norm(head, 2) * r)).astype(latent_dtype).astype(jnp.float32)
        zo = (wo * (pre_norm(head + 1, 2) * r)).astype(latent_dtype).astype(jnp.float32)
        angle = gpos_ref[t] * inv_ref[...]
        c, s = jnp.cos(angle), jnp.sin(angle)
        y0 = (ze * c - zo * s).astype(latent_dtype).astype(pages_ref.dtype)
        y1 = (ze * s + zo * c).astype(latent_dtype).astype(pages_ref.dtype)
        pages_ref[slot, pl.ds(head, half, stride=2)] = y0
        pages_ref[slot, pl.ds(head + 1, half, stride=2)] = y1


def compressor(*arrays, ratio: int, eps: float, latent_dtype=None, interpret=False):
    """Triton compressor; the arguments and results of `reference.compressor`."""
    a, d, latent_dtype, records = prepare(arrays, ratio=ratio, latent_dtype=latent_dtype)
    kv, inv_freq, comp_pages, ring_pages = a.kv, a.inv_freq, a.comp_pages, a.ring_pages
    t = kv.shape[0]
    half = inv_freq.shape[0]
    for name, n in (("D", d), ("rope / 2", half)):
        if n & (n - 1):
            raise ValueError(f"compressor (gpu): {name}={n} must be a power of two (Triton)")
    p, e, _ = comp_pages.shape
    cap = ring_pages.shape[1] if ratio == 2 else 1
    slot, src, dst, flags, gpos = token_metadata(a, ratio=ratio, cap=cap)
    pages_flat = comp_pages.reshape(p * e, d)
    ring_flat = ring_pages.reshape(-1, 2 * d) if ratio == 2 else jnp.zeros((1, 1), jnp.float32)
    c = cost(t, d, ratio=ratio, record_dtype=comp_pages.dtype, ring_rows=min(t, cap))
    latent, pages_flat = pl.pallas_call(
        functools.partial(_kernel, ratio=ratio, eps=eps, d=d, half=half, latent_dtype=latent_dtype),
        grid=(t,),
        out_shape=[
            jax.ShapeDtypeStruct((t, d), latent_dtype),
            jax.ShapeDtypeStruct(pages_flat.shape, pages_flat.dtype),
        ],
        input_output_aliases={8: 1},
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        cost_estimate=cost_estimate(c["flops"], c["bytes"], transcendentals=2 * t * half),
        interpret=gpu_interpret(interpret),
    )(
        slot,
        src,
        flags,
        gpos,
        kv,
        ring_flat,
        a.norm_weight,
        inv_freq.astype(jnp.float32),
        pages_flat,
    )
    ring = None
    if ratio == 2:
        rows = jnp.where(dst >= 0, dst, ring_flat.shape[0])
        ring = ring_flat.at[rows].set(kv, mode="drop").reshape(ring_pages.shape)
    return latent, pages_flat.reshape(comp_pages.shape) if records else None, ring
