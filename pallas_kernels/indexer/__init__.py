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
    """Top-k compressed entries per token (pallas_kernels/README.md, kernel 3).

    Returns ``topk`` i32[T, k] (request-local entry ids, -1 = none, order free), or
    ``(topk, blocks)`` for a candidate source (``candidate_topk_blocks > 0`` and no
    ``candidates``), ``blocks`` i32[T, candidate_topk_blocks] (-1 = none). A padding token
    (position -1) gets -1 everywhere. ``debug=True`` checks at run time that every block id of
    ``comp_tables`` is in ``[0, P)`` (raises otherwise; nothing is clamped).

    ``key_scales``: a scale per index key (e.g. ``ikey_pages`` holding the e4m3 values of fp8
    index-key records and ``key_scales`` their power-of-two f32 scales): the key is the row
    times its scale; the kernels stream the 8-bit rows as they are (half the bytes of bf16 keys):
    the GPU kernel scales each score, the TPU kernel decodes each chunk in VMEM.

    ``tokens_per_tile`` (kernels only; None = the kernel's default): tokens per program; the
    tokens of one request within a tile (a prefill chunk, speculative rows) read the request's
    index keys from HBM once instead of once each.
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
