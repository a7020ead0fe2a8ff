"""Pieces the Triton-backend (GPU) attention kernels share: exact f32 dots and the online-softmax
step over one chunk of gathered keys (window and sparse attention walk their keys the same way).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.softmax import online_step

__all__ = ["attend_chunk", "f32_dot"]


def f32_dot(a, b, *, trans_b=False):
    """f32-accumulating dot without TF32 (f32 results must match the reference)."""
    if a.dtype == jnp.float32 or b.dtype == jnp.float32:
        return pltriton.dot(
            a.astype(jnp.float32), b.astype(jnp.float32), trans_b=trans_b, allow_tf32=False
        )
    return pltriton.dot(a, b, trans_b=trans_b).astype(jnp.float32)


def attend_chunk(carry, q, keys, keep, scale: float):
    """Fold keys [C, D] (K = V; `keep` [C] marks the visible ones) into the f32 state
    `(m [H], l [H], acc [H, D])` of queries q [H, D]; returns the new state."""
    m, denom, acc = carry
    m_new, alpha, e = online_step(m, f32_dot(q, keys, trans_b=True), keep, scale)
    denom = alpha * denom + jnp.sum(e, axis=1)
    acc = alpha[:, None] * acc + f32_dot(e.astype(keys.dtype), keys)
    return m_new, denom, acc
