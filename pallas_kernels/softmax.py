"""The online-softmax pieces window and sparse attention share: jnp, usable inside a kernel body.

A state is `(m, l, acc)`: running max (floored at MASK_VALUE), sum of `e^{z - m}` and the
weighted value sum, without the sink (pallas_kernels/README.md, "Online softmax with a sink").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.backend import MASK_VALUE

__all__ = ["empty_state", "online_step", "sink_weight"]


def empty_state(heads: int, dim: int, *, keepdims: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The f32 state of no keys: m = MASK_VALUE, l = 0, acc = 0 (m, l [H] or [H, 1])."""
    vec = (heads, 1) if keepdims else (heads,)
    return (
        jnp.full(vec, MASK_VALUE, jnp.float32),
        jnp.zeros(vec, jnp.float32),
        jnp.zeros((heads, dim), jnp.float32),
    )


def online_step(m, dots, keep, scale: float):
    """One chunk of logits against the running max: the caller rescales its state by `alpha`
    and adds `e` (`l = alpha * l + sum(e)`, `acc = alpha * acc + e @ v`).

    Args:
      m: the running max, [H] or [H, 1].
      dots: q.k of the chunk [H, C] (f32), scaled here; keep: visible keys [C] or [1, C].
    Returns:
      m_new, alpha = e^{m - m_new}, e = e^{z - m_new} [H, C] (0 where hidden).
    """
    keepdims = m.ndim == dots.ndim  # else m is [H] and keep [C]: widen them to [H, C]
    row = (lambda x: x) if keepdims else (lambda x: x[None, :])
    col = (lambda x: x) if keepdims else (lambda x: x[:, None])
    z = dots * scale
    z = jnp.where(row(keep), z, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(z, axis=1, keepdims=keepdims))
    alpha = jnp.exp(m - m_new)
    e = jnp.where(row(keep), jnp.exp(z - col(m_new)), 0.0)
    return m_new, alpha, e


def sink_weight(m, denom, sink):
    """The factor that normalises `acc` with the sink logit in the denominator only:
    `out = acc * sink_weight(m, l, sink)`, i.e. `acc e^{m} / (l e^{m} + e^{sink})`, computed
    stably. m, denom and sink broadcast together ([H], [H, 1] or [T, H])."""
    top = jnp.maximum(m, sink)
    w = jnp.exp(m - top)
    return w / (denom * w + jnp.exp(sink - top))
