"""Compressor (kernel 4 of pallas_kernels/README.md): gated pair pooling (ratio 2) or the plain
path (ratio 1), RMSNorm, RoPE at the group's first position, the slot-mapped record write and
the ring rows of open groups.

Design notes: pallas_kernels/README.md, "pallas_kernels/compressor/__init__.py".
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.backend import check_block_tables, dispatch
from pallas_kernels.compressor.common import cost

__all__ = ["compressor", "cost"]


def compressor(
    kv: jax.Array,  # [T, D] (ratio 1) | f32[T, 2D] (ratio 2: [a | s])
    token_req: jax.Array,  # i32[T]
    positions: jax.Array,  # i32[T], -1 = padding
    query_start_loc: jax.Array,  # i32[R + 1]
    norm_weight: jax.Array,  # [D]
    inv_freq: jax.Array,  # f32[rope / 2]
    comp_slot: jax.Array | None,  # i32[T], -1 = no write; None (with comp_pages): no records
    ring_block: jax.Array | None,  # i32[R], 0 = none (ratio 2 only)
    comp_pages: jax.Array | None,  # [P, E, D]; None: latents (and ring) only
    ring_pages: jax.Array | None,  # f32[Pr, C, 2D] (ratio 2 only)
    *,
    ratio: int,
    eps: float,
    latent_dtype: Any = None,
    impl: str | None = None,
    interpret: Any = False,
    debug: bool = False,
):
    """Compress one ragged batch into the paged cache (pallas_kernels/README.md, kernel 4).
    Under `jit`, donate ``comp_pages`` / ``ring_pages`` so the kernels update them in place.

    Args:
      kv ... ring_pages, latent_dtype: the README's kernel 4 contract and additions.
      impl, interpret, debug: see `pallas_kernels.backend`; `debug` checks slot and ring blocks.
    Returns:
      ``(latent [T, D], comp_pages, ring_pages)`` (pages None where not given; ring None, ratio 1).
    """
    if debug:
        if comp_pages is not None and comp_slot is not None:
            e = comp_pages.shape[1]
            blocks = jnp.where(comp_slot >= 0, comp_slot // e, 0)
            check_block_tables(blocks, comp_pages.shape[0], "comp_slot // entries_per_block")
        if ring_block is not None and ring_pages is not None:
            check_block_tables(ring_block, ring_pages.shape[0], "ring_block")
    args = (kv, token_req, positions, query_start_loc, norm_weight, inv_freq, comp_slot)
    args += (ring_block, comp_pages, ring_pages)
    kwargs = dict(ratio=ratio, eps=eps, latent_dtype=latent_dtype)
    return dispatch(__name__, "compressor", impl, interpret, args, kwargs)
