"""Quantise-dequantise (QDQ) primitives of the official reference's quantisation simulation.

Each maps a float array to what the reference sees after storing it in a low-precision format and
reading it back, blockwise along the last axis (`fp8_qdq`, `fp4_qdq_pow2`, `fp4_qdq_e4m3`); the
formats and scale rules: docs/model.md#dsv4quant.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas  # first, for stable compilation-cache keys (dsv4/__init__.py)
import jax.numpy as jnp
import numpy as np

__all__ = [
    "E2M1_MIDS",
    "E2M1_TIE_UP",
    "E2M1_VALUES",
    "FP4_MAX",
    "FP8_MAX",
    "e2m1_round",
    "fp4_qdq_e4m3",
    "fp4_qdq_pow2",
    "fp8_qdq",
    "pow2_scale",
]

FP8_MAX = 448.0
FP4_MAX = 6.0
# code 0..15 -> value; bit 3 is the sign
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
# midpoints between consecutive e2m1 magnitudes
E2M1_MIDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
# at an exact midpoint round-to-nearest-even goes up when the upper code is even
E2M1_TIE_UP = np.array([False, True, False, True, False, True, False])


def pow2_scale(amax: jax.Array, max_value: float) -> jax.Array:
    """``2^ceil(log2(amax / max_value))`` for positive normal amax, bit-exact (fp32)."""
    x = amax.astype(jnp.float32) * jnp.float32(1.0 / max_value)
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    exp = (bits >> 23) & 0xFF
    mant = bits & ((1 << 23) - 1)
    e = exp - 127 + (mant != 0).astype(jnp.int32)
    return jax.lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


def _blocks(x: jax.Array, block: int) -> jax.Array:
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"last axis {n} is not a multiple of the quantisation block {block}")
    return x.astype(jnp.float32).reshape(*x.shape[:-1], n // block, block)


def fp8_qdq(x: jax.Array, block: int = 32) -> jax.Array:
    """e4m3 with a power-of-two scale per ``block`` values; returns x's dtype."""
    xb = _blocks(x, block)
    amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1, keepdims=True), 1e-4)
    s = pow2_scale(amax, FP8_MAX)
    q = jnp.clip(xb / s, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    return (q * s).reshape(x.shape).astype(x.dtype)


def e2m1_round(v: jax.Array) -> jax.Array:
    """Nearest e2m1 value (round-to-nearest-even) of fp32 ``v`` already within [-6, 6]."""
    mag = jnp.abs(v)[..., None]
    mids = jnp.asarray(E2M1_MIDS)
    code = jnp.sum(mag > mids, axis=-1) + jnp.sum((mag == mids) & jnp.asarray(E2M1_TIE_UP), -1)
    out = jnp.asarray(E2M1_VALUES[:8])[code]
    return jnp.where(jnp.signbit(v), -out, out)


def fp4_qdq_pow2(x: jax.Array, block: int = 32) -> jax.Array:
    """e2m1 with a power-of-two (e8m0) scale per ``block`` values; returns x's dtype."""
    xb = _blocks(x, block)
    amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1, keepdims=True), FP4_MAX * 2.0**-126)
    s = pow2_scale(amax, FP4_MAX)
    v = jnp.clip(xb / s, -FP4_MAX, FP4_MAX)
    return (e2m1_round(v) * s).reshape(x.shape).astype(x.dtype)


def fp4_qdq_e4m3(x: jax.Array, block: int = 16) -> jax.Array:
    """e2m1 with an e4m3 scale (``amax / 6`` rounded) per ``block`` values; returns x's dtype."""
    xb = _blocks(x, block)
    amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1, keepdims=True), FP4_MAX * 2.0**-9)
    s = jnp.clip(amax / FP4_MAX, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    v = jnp.clip(xb / s, -FP4_MAX, FP4_MAX)
    return (e2m1_round(v) * s).reshape(x.shape).astype(x.dtype)
