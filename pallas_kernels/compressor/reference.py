"""Pure-jnp compressor over a ragged batch: the oracle of the kernels and the CPU path.

Design notes: pallas_kernels/README.md, "pallas_kernels/compressor/reference.py".
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.compressor.common import pair_pool, prepare, rms_norm, rope_rows

__all__ = ["compressor"]


def _closing_pairs(kv, token_req, positions, query_start_loc, ring_block, ring_pages):
    """(first-member rows [T, 2D], does the row close a group [T]) for ratio 2."""
    t = kv.shape[0]
    c = ring_pages.shape[1]
    first = jnp.arange(t) == query_start_loc[token_req]
    rb = ring_block[token_req]
    from_ring = ring_pages[rb, jnp.mod(positions - 1, c)]
    prev = jnp.roll(kv, 1, axis=0)
    member0 = jnp.where(first[:, None], from_ring, prev)
    closes = (positions >= 0) & (positions % 2 == 1) & (~first | (rb != 0))
    return member0, closes


def _store_ring(kv, token_req, positions, query_start_loc, ring_block, ring_pages):
    p_ring, c, _ = ring_pages.shape
    end = query_start_loc[token_req + 1]
    rb = ring_block[token_req]
    keep = (positions >= 0) & (rb != 0) & (jnp.arange(kv.shape[0]) >= end - c)
    row = jnp.where(keep, rb * c + positions % c, p_ring * c)
    flat = ring_pages.reshape(p_ring * c, -1).at[row].set(kv, mode="drop")
    return flat.reshape(ring_pages.shape)


def compressor(*arrays, ratio: int, eps: float, latent_dtype=None):
    """Compress a ragged batch into paged cache records (reference).

    Args:
      arrays: the ten arrays of `pallas_kernels.compressor`, in its order.
    Returns:
      ``(latent [T, D], comp_pages, ring_pages)``: the pre-rope latents (zeros where no group
      closes), the pages with the new records (None without pages), and the ring (unchanged /
      None for ratio 1).
    """
    a, d, ldt, records = prepare(arrays, ratio=ratio, latent_dtype=latent_dtype)
    kv, token_req, positions, qsl = a.kv, a.token_req, a.positions, a.query_start_loc
    ring_pages = a.ring_pages
    valid = positions >= 0
    if ratio == 1:
        z = rms_norm(kv, a.norm_weight, eps, ldt)
        closes = valid
    else:
        member0, closes = _closing_pairs(kv, token_req, positions, qsl, a.ring_block, ring_pages)
        pooled = pair_pool(member0[:, :d], member0[:, d:], kv[:, :d], kv[:, d:])
        z = rms_norm(pooled.astype(ldt), a.norm_weight, eps, ldt)
    latent = jnp.where(closes[:, None], z, jnp.zeros_like(z))
    angle = (ratio * (positions // ratio)).astype(jnp.float32)[:, None] * a.inv_freq[None, :]
    entry = rope_rows(latent, jnp.cos(angle), jnp.sin(angle)).astype(a.comp_pages.dtype)

    p, e, _ = a.comp_pages.shape
    write = closes & (a.comp_slot >= 0)
    slot = jnp.where(write, a.comp_slot, p * e)
    flat = a.comp_pages.reshape(p * e, d).at[slot].set(entry, mode="drop")
    pages = flat.reshape(a.comp_pages.shape)
    if ratio == 2:
        ring_pages = _store_ring(kv, token_req, positions, qsl, a.ring_block, ring_pages)
    return latent, pages if records else None, ring_pages
