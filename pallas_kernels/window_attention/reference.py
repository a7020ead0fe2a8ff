"""Pure-jnp window attention over the paged window cache: the test oracle and the CPU path.

Obviously correct rather than fast: every token gathers its `window` key positions from the pages
through the block table, masks what it may not see, and runs one softmax with the sink.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.backend import MASK_VALUE
from pallas_kernels.softmax import sink_weight

State = tuple[jax.Array, jax.Array, jax.Array]


def window_keys(
    swa_pages: jax.Array,  # [P, S, D]
    swa_tables: jax.Array,  # i32[R, nb]
    token_req: jax.Array,  # i32[T]
    positions: jax.Array,  # i32[T], -1 = padding
    *,
    window: int,
    replay_start: jax.Array | None = None,  # i32[R]
) -> tuple[jax.Array, jax.Array]:
    """The window of every token: keys f32[T, window, D] (zero where masked) and mask [T, window].

    Slot `w` of token `t` holds position `positions[t] - window + 1 + w` of its request; it is
    visible when that position is >= max(0, replay_start[r]) and the token is not padding.
    """
    page_size = swa_pages.shape[1]
    key_pos = positions[:, None] - window + 1 + jnp.arange(window, dtype=jnp.int32)[None, :]
    first = jnp.zeros_like(positions)
    if replay_start is not None:
        first = jnp.maximum(first, replay_start[token_req])
    mask = (key_pos >= first[:, None]) & (positions[:, None] >= 0)
    safe_pos = jnp.where(mask, key_pos, 0)
    blocks = swa_tables[token_req[:, None], safe_pos // page_size]  # [T, W]
    keys = swa_pages[blocks, safe_pos % page_size].astype(jnp.float32)  # [T, W, D]
    # Masked slots may hold anything (the null block is NaN in tests): zero them so that
    # 0 * NaN never reaches the value sum.
    keys = jnp.where(mask[..., None], keys, 0.0)
    return keys, mask


def softmax_state(
    q: jax.Array,  # [T, H, D]
    keys: jax.Array,  # f32[T, K, D], zero where masked
    mask: jax.Array,  # bool[T, K]
    scale: float,
) -> State:
    """The unnormalised softmax state over `keys` (no sink): m, l f32[T, H], acc f32[T, H, D].

    `m` is floored at MASK_VALUE so that an empty key set gives (MASK_VALUE, 0, 0).
    """
    z = jnp.einsum("thd,tkd->thk", q.astype(jnp.float32), keys) * scale
    z = jnp.where(mask[:, None, :], z, -jnp.inf)
    m = jnp.maximum(jnp.max(z, axis=-1), MASK_VALUE)
    p = jnp.exp(z - m[..., None])  # exp(-inf) = 0 on masked keys
    # the kernels multiply V by the probabilities in q's dtype (bf16 when serving: what the
    # MXU / tensor cores take, and what DeepSeek's kernel does); the denominator stays f32
    pv = p if q.dtype == jnp.float32 else p.astype(q.dtype).astype(jnp.float32)
    return m, jnp.sum(p, axis=-1), jnp.einsum("thk,tkd->thd", pv, keys)


def merge_states(a: State, b: State) -> State:
    """The state of the union of two disjoint key sets."""
    m = jnp.maximum(a[0], b[0])
    wa, wb = jnp.exp(a[0] - m), jnp.exp(b[0] - m)
    return m, a[1] * wa + b[1] * wb, a[2] * wa[..., None] + b[2] * wb[..., None]


def finish(state: State, sink: jax.Array, positions: jax.Array, dtype) -> jax.Array:
    """Add the sink to the denominator and normalise; padding tokens give zeros."""
    m, denom, acc = state
    out = acc * sink_weight(m, denom, sink.astype(jnp.float32)[None, :])[..., None]
    return jnp.where(positions[:, None, None] >= 0, out, 0.0).astype(dtype)


def window_attention(
    q, swa_pages, swa_tables, token_req, positions, sink, *, window: int, scale: float,
    replay_start=None, return_state: bool = False,
) -> jax.Array | State:  # fmt: skip
    """Sliding-window MLA attention (pallas_kernels/README.md, kernel 1), in plain jnp; the
    arguments of `pallas_kernels.window_attention`.

    Returns out [T, H, D] in q's dtype, or with `return_state=True` the f32 state
    (m [T, H], l [T, H], acc [T, H, D]) without the sink.
    """
    keys, mask = window_keys(
        swa_pages, swa_tables, token_req, positions, window=window, replay_start=replay_start
    )
    state = softmax_state(q, keys, mask, scale)
    if return_state:
        return state
    return finish(state, sink, positions, q.dtype)
