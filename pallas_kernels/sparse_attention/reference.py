"""Pure-jnp sparse attention over the paged compressed cache: the test oracle and the CPU path.

Every token gathers its selected entries through the block table, continues the window's softmax
state (or an empty one), adds the sink and normalises: one softmax over window and selection.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.window_attention.reference import State, finish, merge_states, softmax_state


def selected_keys(
    comp_pages: jax.Array,  # [P, E, D]
    comp_tables: jax.Array,  # i32[R, nbc]
    token_req: jax.Array,  # i32[T]
    positions: jax.Array,  # i32[T], -1 = padding
    topk: jax.Array,  # i32[T, K], -1 = none
) -> tuple[jax.Array, jax.Array]:
    """The selected entries of every token: keys f32[T, K, D] (zero where masked), mask [T, K]."""
    per_block = comp_pages.shape[1]
    mask = (topk >= 0) & (positions[:, None] >= 0)
    ids = jnp.where(mask, topk, 0)
    blocks = comp_tables[token_req[:, None], ids // per_block]
    keys = comp_pages[blocks, ids % per_block].astype(jnp.float32)
    return jnp.where(mask[..., None], keys, 0.0), mask


def sparse_attention(
    q, comp_pages, comp_tables, token_req, positions, topk, sink, *, entries_per_block: int,
    scale: float, state: State | None = None,
) -> jax.Array:  # fmt: skip
    """Sparse MLA attention (pallas_kernels/README.md, kernel 2), in plain jnp: out [T, H, D].
    The arguments of `pallas_kernels.sparse_attention`."""
    if comp_pages.shape[1] != entries_per_block:
        raise ValueError(
            f"comp_pages holds {comp_pages.shape[1]} entries per block, "
            f"entries_per_block={entries_per_block}"
        )
    keys, mask = selected_keys(comp_pages, comp_tables, token_req, positions, topk)
    sel = softmax_state(q, keys, mask, scale)
    if state is not None:
        sel = merge_states(tuple(x.astype(jnp.float32) for x in state), sel)
    return finish(sel, sink, positions, q.dtype)
