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
      qi, weights, ikey_pages, comp_tables, token_req, positions, visible: as in the README.
      entries_per_block, k, candidate_block_size, candidate_topk_blocks, candidates: the
        README's contract (a candidate source or consumer of the two-level selection).
      key_scales: f32[P, E] scale per index key (fp8 records): the key is row times scale; the
        kernels stream the 8-bit rows (GPU scales each score, TPU decodes each chunk in VMEM).
      tokens_per_tile: kernels only (None = default): a tile's tokens of one request read the
        request's index keys from HBM once.
      impl, interpret: see `pallas_kernels.backend`.
      debug: check at run time that every block id of ``comp_tables`` is in ``[0, P)``.
    Returns:
      ``topk`` i32[T, k] (request-local entry ids, -1 = none, order free), or ``(topk,
      blocks)`` for a candidate source, ``blocks`` i32[T, candidate_topk_blocks] (-1 = none).
      A padding token (position -1) gets -1 everywhere.
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
