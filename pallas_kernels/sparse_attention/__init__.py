"""Sparse MLA attention over the paged compressed cache, continuing the window's softmax
(pallas_kernels/README.md, kernel 2).

`sparse_attention` is the public entry: it validates the arguments and runs the pure-jnp
`reference` (CPU), the Mosaic TPU kernel (`tpu.py`) or the Pallas Triton GPU kernel (`gpu.py`).
"""

from __future__ import annotations

from typing import Any

import jax

from pallas_kernels import backend
from pallas_kernels.window_attention.reference import State

__all__ = ["sparse_attention"]


# over 60 lines: the public entry: its docstring documents every argument
def sparse_attention(
    q: jax.Array,  # [T, H, D]
    comp_pages: jax.Array,  # [P, E, D]
    comp_tables: jax.Array,  # i32[R, nbc]
    token_req: jax.Array,  # i32[T]
    positions: jax.Array,  # i32[T], -1 = padding
    topk: jax.Array,  # i32[T, K], -1 = none
    sink: jax.Array,  # f32[H]
    *,
    entries_per_block: int,
    scale: float,
    state: State | None = None,
    impl: str | None = None,
    interpret: Any = None,
    debug: bool = False,
    tokens_per_tile: int | None = None,
    max_tokens_per_call: int | None = None,
) -> jax.Array:
    """Adds the selected compressed entries to the window state (or to an empty state), adds the
    sink and normalises: one softmax over window and selected entries, f32 accumulation.

    Args:
      q: queries [T, H, D] (f32 or bf16).
      comp_pages: compressed cache of the kv source [P, E, D]; entry `j` of request `r` lives
        at `comp_pages[comp_tables[r, j // E], j % E]`. Block 0 is the null block.
      comp_tables: block table [R, nbc] (int32).
      token_req: request row of every token [T] (int32).
      positions: absolute position of every token [T]; -1 marks padding (zero output).
      topk: selected request-local entry ids [T, K] (int32), -1 = none. Ids within a row are
        distinct (the indexer's top-k); each selected entry counts once.
      sink: per-head sink logit [H].
      entries_per_block: E, entries per compressed block (`block_size // ratio`).
      scale: logit scale (model: head_dim ** -0.5).
      state: the window's `(m [T, H], l [T, H], acc [T, H, D])` from
        `window_attention(..., return_state=True)`, or None for an empty window.
      impl: None (by backend), "reference", "tpu" or "gpu".
      interpret: kernels only: False, True, or (TPU) `pltpu.InterpretParams(...)`.
      debug: check at run time that every block id is in [0, P), every request row and
        entry id is covered by the table (raises otherwise, naming the first bad entry).
      tokens_per_tile: TPU kernel: tokens per grid step (default 1). With > 1, tokens of one request in
        a tile fetch the union of their picks once (speculative decode: 1 + draft tokens).
        Ignored elsewhere.
      max_tokens_per_call: TPU kernel: longer batches run as several kernel calls (default
        8192, bounded by SMEM). Ignored elsewhere.

    Returns:
      out [T, H, D] in q's dtype.
    """
    shapes = dict(
        q=(q, ("T", "H", "D")),
        comp_pages=(comp_pages, ("P", entries_per_block, "D")),
        comp_tables=(comp_tables, ("R", "nbc")),
        token_req=(token_req, ("T",)),
        positions=(positions, ("T",)),
        topk=(topk, ("T", "K")),
        sink=(sink, ("H",)),
    )
    if state is not None:
        if len(state) != 3:
            raise ValueError(f"state must be (m, l, acc), got {len(state)} arrays")
        shapes.update(
            state_m=(state[0], ("T", "H")),
            state_l=(state[1], ("T", "H")),
            state_acc=(state[2], ("T", "H", "D")),
        )
    backend.check_shapes(**shapes)
    backend.check_int32(
        comp_tables=comp_tables, token_req=token_req, positions=positions, topk=topk
    )
    if debug:
        span = comp_tables.shape[1] * entries_per_block
        backend.check_block_tables(comp_tables, comp_pages.shape[0], "comp_tables")
        backend.check_range(topk, -1, span, "topk", "an entry id the table covers")
        backend.check_range(token_req, 0, comp_tables.shape[0], "token_req", "a request row")
    return backend.dispatch(
        __name__,
        "sparse_attention",
        impl,
        interpret,
        (q, comp_pages, comp_tables, token_req, positions, topk, sink),
        dict(entries_per_block=entries_per_block, scale=scale, state=state),
        tpu_options=dict(tokens_per_tile=tokens_per_tile, max_tokens_per_call=max_tokens_per_call),
    )
