"""Sliding-window MLA attention over the paged window cache (pallas_kernels/README.md, kernel 1).

`window_attention` is the public entry: it validates the arguments and runs the pure-jnp
`reference` (CPU), the Mosaic TPU kernel (`tpu.py`) or the Pallas Triton GPU kernel (`gpu.py`).
"""

from __future__ import annotations

from typing import Any

import jax

from pallas_kernels import backend
from pallas_kernels.window_attention.reference import State

__all__ = ["State", "window_attention"]


def window_attention(
    q: jax.Array,  # [T, H, D]
    swa_pages: jax.Array,  # [P, S, D]
    swa_tables: jax.Array,  # i32[R, nb]
    token_req: jax.Array,  # i32[T]
    positions: jax.Array,  # i32[T], -1 = padding
    sink: jax.Array,  # f32[H]
    *,
    window: int,
    scale: float,
    replay_start: jax.Array | None = None,  # i32[R]
    return_state: bool = False,
    impl: str | None = None,
    interpret: Any = None,
    debug: bool = False,
    tokens_per_tile: int | None = None,
    num_cores: int | None = None,
    max_tokens_per_call: int | None = None,
) -> jax.Array | State:
    """Sliding-window MLA attention over the paged window cache, the per-head `sink` logit only in
    the denominator (pallas_kernels/README.md, kernel 1); its state feeds `sparse_attention`.

    Args:
      q ... return_state: the README's kernel 1 contract (shapes in the signature's comments).
      impl, interpret, debug: see `pallas_kernels.backend`; `debug` checks every index at run time.
      tokens_per_tile, max_tokens_per_call: TPU tiling (README, "What the implementations add").
      num_cores: TensorCores to split the TPU tiles over (None: `backend.tpu_num_cores()`).
    Returns:
      out [T, H, D] in q's dtype, or the f32 state `(m, l, acc)` when `return_state`.
    """
    backend.check_shapes(
        q=(q, ("T", "H", "D")),
        swa_pages=(swa_pages, ("P", "S", "D")),
        swa_tables=(swa_tables, ("R", "nb")),
        token_req=(token_req, ("T",)),
        positions=(positions, ("T",)),
        sink=(sink, ("H",)),
        **({} if replay_start is None else {"replay_start": (replay_start, ("R",))}),
    )
    backend.check_int32(swa_tables=swa_tables, token_req=token_req, positions=positions)
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if debug:
        names = ("swa_tables", "positions", "a position the table covers")
        num_pages, page, _ = swa_pages.shape
        backend.check_paged_indices(swa_tables, num_pages, page, token_req, positions, names)
    return backend.dispatch(
        __name__,
        "window_attention",
        impl,
        interpret,
        (q, swa_pages, swa_tables, token_req, positions, sink),
        dict(window=window, scale=scale, replay_start=replay_start, return_state=return_state),
        tpu_options=dict(
            tokens_per_tile=tokens_per_tile,
            max_tokens_per_call=max_tokens_per_call,
            num_cores=num_cores,
        ),
    )
