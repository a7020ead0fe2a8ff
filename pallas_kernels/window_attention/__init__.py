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


# over 60 lines: the public entry: its docstring documents every argument
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
    max_tokens_per_call: int | None = None,
) -> jax.Array | State:
    """Each query attends to positions `max(0, p - window + 1, replay_start[r]) .. p` of its
    request in the paged window cache (K = V, one shared latent head), with the per-head `sink`
    logit only in the denominator: `out = sum_k e^{z_k} v_k / (sum_k e^{z_k} + e^{sink})`,
    `z = scale * q.k`.

    Args:
      q: queries [T, H, D] (f32 or bf16).
      swa_pages: window cache of one layer [P, S, D]; position `p` of request `r` lives at
        `swa_pages[swa_tables[r, p // S], p % S]`. Block 0 is the null block.
      swa_tables: block table [R, nb] (int32).
      token_req: request row of every token [T] (int32).
      positions: absolute position of every token [T] (int32); -1 marks padding (zero output).
      sink: per-head sink logit [H].
      window: window length in tokens, including the query itself.
      scale: logit scale (model: head_dim ** -0.5).
      replay_start: first visible position of every request [R] (SWA bounded replay) or None.
      return_state: return the f32 state `(m [T, H], l [T, H], acc [T, H, D])` without the sink
        (`l = sum e^{z - m}`, `acc = sum e^{z - m} v`, `m` floored at -1e30) instead of `out`,
        for `sparse_attention(state=...)`.
      impl: None (by backend), "reference", "tpu" or "gpu".
      interpret: kernels only: False, True, or (TPU) `pltpu.InterpretParams(...)`.
      debug: check at run time that every block id is in [0, P), every request row and
        position is covered by the table (raises otherwise, naming the first bad entry).
      tokens_per_tile: TPU kernel: tokens per grid step (default 8); a tile's tokens of one request share
        fetched pages. Ignored elsewhere.
      max_tokens_per_call: TPU kernel: longer batches run as several kernel calls (default
        8192, bounded by SMEM). Ignored elsewhere.

    Returns:
      out [T, H, D] in q's dtype, or the state triple when `return_state`.
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
        span = swa_tables.shape[1] * swa_pages.shape[1]
        backend.check_block_tables(swa_tables, swa_pages.shape[0], "swa_tables")
        backend.check_range(positions, -1, span, "positions", "a position the table covers")
        backend.check_range(token_req, 0, swa_tables.shape[0], "token_req", "a request row")
    return backend.dispatch(
        __name__,
        "window_attention",
        impl,
        interpret,
        (q, swa_pages, swa_tables, token_req, positions, sink),
        dict(window=window, scale=scale, replay_start=replay_start, return_state=return_state),
        tpu_options=dict(tokens_per_tile=tokens_per_tile, max_tokens_per_call=max_tokens_per_call),
    )
