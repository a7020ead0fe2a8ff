"""Indexer top-k (kernel 3 of pallas_kernels/README.md): weighted ReLU scores of index queries
against paged index keys, the candidate blocks of the two-level selection, and the exact top-k.

`indexer_topk(..., impl=None, interpret=False)` runs the pure-jnp reference on CPU, the Mosaic
kernel on TPU and the Triton kernel on GPU (`pallas_kernels._backend.resolve_impl`). The kernels
keep every score on chip and select without a sort (see `tpu.py` / `gpu.py`).
"""

from __future__ import annotations

from typing import Any

import jax

from pallas_kernels._backend import check_block_tables, resolve_impl
from pallas_kernels.indexer import reference
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
    impl = resolve_impl(impl)
    if debug:
        check_block_tables(comp_tables, ikey_pages.shape[0], "comp_tables")
    kwargs = dict(
        entries_per_block=entries_per_block,
        k=k,
        candidate_block_size=candidate_block_size,
        candidate_topk_blocks=candidate_topk_blocks,
        candidates=candidates,
        key_scales=key_scales,
    )
    args = (qi, weights, ikey_pages, comp_tables, token_req, positions, visible)
    if impl == "reference":
        return reference.indexer_topk(*args, **kwargs)
    if tokens_per_tile is not None:
        kwargs["tokens_per_tile"] = tokens_per_tile
    if impl == "tpu":
        # reason: a backend loads on its own platform only (Pallas TPU: ~0.5 s)
        from pallas_kernels.indexer import tpu

        return tpu.indexer_topk(*args, **kwargs, interpret=interpret)
    # reason: a backend loads on its own platform only (Pallas Triton: ~0.5 s)
    from pallas_kernels.indexer import gpu

    return gpu.indexer_topk(*args, **kwargs, interpret=interpret)
