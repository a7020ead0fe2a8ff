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
    num_cores: int | None = None,
    max_tokens_per_call: int | None = None,
) -> jax.Array:
    """Adds the selected compressed entries to the window state (or to an empty state), adds the
    sink and normalises: one softmax over window and selected entries (README, kernel 2).

    Args:
      q ... state: the README's kernel 2 contract (shapes in the signature's comments).
      impl, interpret, debug: see `pallas_kernels.backend`; `debug` checks every index at run time.
      tokens_per_tile, max_tokens_per_call: TPU tiling (README, "What the implementations add").
      num_cores: TensorCores to split the TPU tiles over (None: `backend.tpu_num_cores()`).
    Returns:
      out [T, H, D] in q's dtype.
    """
    args = (q, comp_pages, comp_tables, token_req, positions, topk, sink)
    _check_shapes(*args, state, entries_per_block)
    backend.check_int32(
        comp_tables=comp_tables, token_req=token_req, positions=positions, topk=topk
    )
    if debug:
        names = ("comp_tables", "topk", "an entry id the table covers")
        num_pages = comp_pages.shape[0]
        backend.check_paged_indices(
            comp_tables, num_pages, entries_per_block, token_req, topk, names
        )
    return backend.dispatch(
        __name__,
        "sparse_attention",
        impl,
        interpret,
        args,
        dict(entries_per_block=entries_per_block, scale=scale, state=state),
        tpu_options=dict(
            tokens_per_tile=tokens_per_tile,
            max_tokens_per_call=max_tokens_per_call,
            num_cores=num_cores,
        ),
    )


def _check_shapes(
    q, comp_pages, comp_tables, token_req, positions, topk, sink, state, entries_per_block
) -> None:
    """Ranks and sizes of the arguments, the window state's included."""
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
