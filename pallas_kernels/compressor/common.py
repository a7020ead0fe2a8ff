"""Math helpers (usable inside kernels), argument checks and the cost model of the compressor."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "Arrays",
    "check_compressor_args",
    "cost",
    "pair_pool",
    "prepare",
    "rms_norm",
    "rope_rows",
]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, dtype) -> jax.Array:
    """RMSNorm over the last axis in f32, rounded to ``dtype`` (the model's `layers.rms_norm`)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * xf).astype(dtype)


def pair_pool(a0, s0, a1, s1):
    """Per-channel softmax over a pair of tokens, applied to their values (f32)."""
    m = jnp.maximum(s0, s1)
    e0 = jnp.exp(s0 - m)
    e1 = jnp.exp(s1 - m)
    den = e0 + e1
    return a0 * (e0 / den) + a1 * (e1 / den)


def rope_rows(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the last ``2 * cos.shape[-1]`` dims of rows x [.., D] as interleaved pairs.

    ``cos``/``sin`` [.., R/2]. Math in f32, result in x's dtype (the model's
    `layers.apply_rope`)."""
    r = 2 * cos.shape[-1]
    head, tail = x[..., :-r], x[..., -r:]
    t = tail.astype(jnp.float32).reshape(*tail.shape[:-1], r // 2, 2)
    x0, x1 = t[..., 0], t[..., 1]
    y0 = x0 * cos - x1 * sin
    y1 = x0 * sin + x1 * cos
    rot = jnp.stack([y0, y1], axis=-1).reshape(tail.shape).astype(x.dtype)
    return jnp.concatenate([head, rot], axis=-1)


def _fail(msg: str):
    raise ValueError(f"compressor: {msg}")


def records_or_placeholder(kv, comp_slot, comp_pages, latent_dtype, ratio):
    """``(comp_slot, comp_pages, latent_dtype, records)`` for an implementation.

    ``comp_pages=None`` (with ``comp_slot=None``) asks for the latents and ring only: the
    implementations then run on a one-block f32 placeholder no slot points at and return ``None``
    for the pages; the latent dtype rule: pallas_kernels/README.md, "What the implementations add".
    """
    records = comp_pages is not None
    if records != (comp_slot is not None):
        _fail(
            "comp_slot and comp_pages go together: give both (write records) or neither "
            f"(latents only), got comp_slot={'None' if comp_slot is None else 'an array'} and "
            f"comp_pages={'None' if comp_pages is None else 'an array'}"
        )
    if not records:
        if kv.ndim != 2:
            _fail(f"kv must be [T, D] (ratio 1) or [T, 2D] (ratio 2), got {kv.shape}")
        if ratio == 2 and latent_dtype is None:
            _fail("ratio 2 without comp_pages needs latent_dtype (the dtype the pooled row is "
                  "rounded to)")  # fmt: skip
        d = kv.shape[1] // (2 if ratio == 2 else 1)
        comp_slot = jnp.full((kv.shape[0],), -1, jnp.int32)
        comp_pages = jnp.zeros((1, 8, d), jnp.float32)
    if latent_dtype is None:
        latent_dtype = kv.dtype if ratio == 1 else comp_pages.dtype
    return comp_slot, comp_pages, jnp.dtype(latent_dtype), records


class Arrays(NamedTuple):
    """The ten arrays of `pallas_kernels.compressor`, in its order (see there)."""

    kv: Any
    token_req: Any
    positions: Any
    query_start_loc: Any
    norm_weight: Any
    inv_freq: Any
    comp_slot: Any
    ring_block: Any
    comp_pages: Any
    ring_pages: Any


def prepare(arrays: tuple[Any, ...], *, ratio: int, latent_dtype: Any):
    """The implementations' first step: `records_or_placeholder`, then the static checks.

    Returns:
      (Arrays with the placeholder records, latent width D, latent dtype, records written?).
    """
    a = Arrays(*arrays)
    comp_slot, comp_pages, latent_dtype, records = records_or_placeholder(
        a.kv, a.comp_slot, a.comp_pages, latent_dtype, ratio
    )
    a = a._replace(comp_slot=comp_slot, comp_pages=comp_pages)
    return a, check_compressor_args(a, ratio=ratio), latent_dtype, records


def check_compressor_args(a: Arrays, *, ratio: int) -> int:
    """Static checks; returns the latent width D."""
    if ratio not in (1, 2):
        _fail(f"ratio must be 1 or 2 (V4.1's kv sources), got {ratio}")
    kv, ring_block, comp_pages, ring_pages = a.kv, a.ring_block, a.comp_pages, a.ring_pages
    if kv.ndim != 2:
        _fail(f"kv must be [T, D] (ratio 1) or [T, 2D] (ratio 2), got {kv.shape}")
    t = kv.shape[0]
    d = kv.shape[1] // ratio
    if ratio == 2:
        if kv.shape[1] % 2:
            _fail(f"kv_score must be [T, 2D], got odd width {kv.shape[1]}")
        if kv.dtype != jnp.float32:
            _fail(f"kv_score (ratio 2) must be f32, got {kv.dtype}")
        if ring_pages is None or ring_block is None:
            _fail("ratio 2 needs ring_pages and ring_block")
        if ring_pages.ndim != 3 or ring_pages.shape[2] != 2 * d:
            _fail(f"ring_pages must be [P, C, 2D={2 * d}], got {ring_pages.shape}")
        if ring_pages.dtype != jnp.float32:
            _fail(f"ring_pages must be f32, got {ring_pages.dtype}")
    if comp_pages.ndim != 3 or comp_pages.shape[2] != d:
        _fail(f"comp_pages must be [P, E, D={d}], got {comp_pages.shape}")
    if a.norm_weight.shape != (d,):
        _fail(f"norm_weight must be [D={d}], got {a.norm_weight.shape}")
    if a.inv_freq.ndim != 1 or 2 * a.inv_freq.shape[0] > d:
        _fail(f"inv_freq must be [rope/2] with rope <= D={d}, got {a.inv_freq.shape}")
    for name in ("token_req", "positions", "comp_slot"):
        x = getattr(a, name)
        if x.shape != (t,) or x.dtype != jnp.int32:
            _fail(f"{name} must be i32[T={t}], got {x.dtype}{list(x.shape)}")
    qsl = a.query_start_loc
    if qsl.ndim != 1 or qsl.dtype != jnp.int32:
        _fail(f"query_start_loc must be i32[R + 1], got {qsl.dtype}")
    if ring_block is not None and (
        ring_block.shape != (qsl.shape[0] - 1,) or ring_block.dtype != jnp.int32
    ):
        _fail(
            f"ring_block must be i32[R={qsl.shape[0] - 1}], got "
            f"{ring_block.dtype}{list(ring_block.shape)}"
        )
    return d


def cost(
    num_tokens: int, dim: int, *, ratio: int, record_dtype=jnp.bfloat16, ring_rows: int = 0
) -> dict[str, int]:
    """Bytes and FLOPs of one compressor call over ``num_tokens`` tokens of latent ``dim``.

    Reads each token's input row once (f32 ``[a | s]`` for ratio 2), writes one record per
    closed group and one latent row per token, plus ``ring_rows`` raw rows to and from the ring.
    FLOPs: pooling (6 per channel and pair), norm (4 per channel), rope (6 per rotated pair,
    counted on all channels as an upper bound)."""
    rb = np.dtype(record_dtype).itemsize
    in_b = num_tokens * dim * (8 if ratio == 2 else rb)
    groups = num_tokens // ratio
    bytes_ = in_b + groups * dim * rb + num_tokens * dim * rb + ring_rows * 2 * dim * 4 * 2
    flops = num_tokens * dim * (6 * (ratio == 2) + 4) + groups * dim * 3
    return {"flops": int(flops), "bytes": int(bytes_)}
