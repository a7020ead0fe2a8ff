"""Indexer top-k (kernel 3 of pallas_kernels/README.md): weighted ReLU scores of index queries
against paged index keys, the candidate blocks of the two-level selection, and the exact top-k.

Design notes: pallas_kernels/README.md, "pallas_kernels/indexer/__init__.py".
"""

from __future__ import annotations

from typing import Any

import jax

from pallas_kernels.backend import check_block_tables, dispatch
from pallas_kernels.indexer.common import cost

__all__ = ["cost", "indexer_topk"]


def indexer_topk(
    qi: jax.Array,  # [T, IH, Di]
    weights: jax.Array,  # [T, IH]
    ikey_pages: jax.Array,  # [P, E, Di]
    comp_tables: jax.Array,  # i32[R, nb]
    token_req: jax.Array,  # i32[T]
    positions: jax.Array,  # i32[T], -1 = padding
    visible: jax.Array,  # i32[T]
    *,
    entries_per_block: int,
    k: int,
    candidate_block_size: int = 0,
    candidate_topk_blocks: int = 0,
    candidates: jax.Array | None = None,  # i32[T, CB]
    key_scales: jax.Array | None = None,  # f32[P, E]
    tokens_per_tile: int | None = None,
    impl: str | None = None,
    interpret: Any = False,
    debug: bool = False,
):
    """Top-k compressed entries per token (pallas_kernels/README.md, kernel 3): weighted ReLU
    scores against the request's visible index keys, exact top-k, ties to the lower index.

    Args:
      qi ... candidates, key_scales, tokens_per_tile: the README's kernel 3 contract and additions.
      impl, interpret, debug: see `pallas_kernels.backend`; `debug` checks ``comp_tables``' ids.
    Returns:
      ``topk`` i32[T, k] (-1 = none), or ``(topk, blocks)`` for a candidate source.
    """
    if debug:
        check_block_tables(comp_tables, ikey_pages.shape[0], "comp_tables")
    options = dict(
        entries_per_block=entries_per_block,
        k=k,
        candidate_block_size=candidate_block_size,
        candidate_topk_blocks=candidate_topk_blocks,
        candidates=candidates,
        key_scales=key_scales,
    )
    return dispatch(
        __name__,
        "indexer_topk",
        impl,
        interpret,
        (qi, weights, ikey_pages, comp_tables, token_req, positions, visible),
        options,
        kernel_options=dict(tokens_per_tile=tokens_per_tile),
    )
