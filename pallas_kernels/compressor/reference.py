"""Pure-jnp compressor over a ragged batch: the oracle of the kernels and the CPU path.

Semantics (pallas_kernels/README.md, kernel 4; docs/model.md#compressor and its ring):

* ratio 1: ``latent[t] = RMSNorm(kv[t])`` for every real token, in kv's dtype.
* ratio 2: ``kv[t] = [a | s]`` (f32). A token at an odd position ``p`` closes the group
  ``(p - 1, p)``: per channel, a softmax over the pair's ``s`` weights their ``a``; the pooled
  row is rounded to the record dtype (``comp_pages.dtype``, or ``latent_dtype``) and RMS-normed. The first member is
  the previous token of the chunk, or, for a chunk starting at an odd position, ring row
  ``(p - 1) % C`` of the request's ring block (read before this call writes the ring). A request
  without a ring block (``ring_block[r] == 0``) cannot close such a group: its latent row stays
  zero and nothing is written for it.
* Latent rows that close no group, and padding rows (``positions == -1``), are zeros.
* The entry ``RoPE(latent)`` at the group's first position ``ratio * (p // ratio)`` (interleaved
  pairs on the last ``2 * len(inv_freq)`` dims, f32 math) is written, cast to the record dtype,
  at ``comp_slot[t] = block * E + offset`` when the slot is not -1 and the row closes a group
  (the paged step gives -1 to every other row anyway).
* Ring (ratio 2): the last ``min(len, C)`` real tokens of each chunk store their raw ``[a | s]``
  at row ``p % C`` of the request's ring block (none when the block is 0).
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
