"""The decoder block and the one loop over the layers, shared by every forward path.

The whole-sequence reference, the dense-cache model, the paged step and training all run
`decoder_layers`; they differ only in the attention they pass in: a function
``attention(layer, h, state) -> (out, state)`` that reads and writes its caches through
``state`` (a pytree the path defines: what earlier layers hand down, the caches it writes).
Nothing is kept between calls, so the loop traces the same under `jax.jit` every time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from dsv4 import engram
from dsv4 import layers as L
from dsv4.config import ModelConfig

__all__ = ["Attention", "FeedForward", "decoder_block", "decoder_layers", "model_moe"]

# (layer, normed input h [.., dim], state) -> (output [.., dim], state)
Attention = Callable[[int, jax.Array, Any], tuple[jax.Array, Any]]
FeedForward = Callable[[int, jax.Array, Any], tuple[jax.Array, Any]]


def model_moe(params, cfg: ModelConfig, mesh=None) -> FeedForward:
    """The model's FFN (`dsv4.layers.moe`, experts dispatched over ``mesh``'s ``expert`` axis),
    state passed through: what inference runs."""

    def ffn(layer: int, h: jax.Array, state):
        return L.moe(h, params, f"layers.{layer}.ffn.", cfg, mesh=mesh), state

    return ffn


def decoder_block[S](
    params,
    cfg: ModelConfig,
    layer: int,
    x: jax.Array,
    pre: jax.Array,
    attention: Attention,
    ffn: FeedForward,
    state: S,
    *,
    prefix: str | None = None,
    many_tokens: bool = False,
) -> tuple[jax.Array, jax.Array, S]:
    """One layer on the residual streams x [.., hc, dim]: the attention sub-block, then the FFN
    sub-block, each between its hyper-connection mixes (mHC). ``pre`` [.., hc], the previous
    layer's FFN pre-mix (the embedding's first copy at layer 0), collapses the streams into the
    attention's input; ``prefix``: the params names (``layers.{layer}.``); ``many_tokens``: the
    mixes' layout for thousands of tokens (`dsv4.layers.hc_mixes`).

    Returns:
        (streams x, the pre-mix for the next layer, state).
    """
    p = f"layers.{layer}." if prefix is None else prefix
    a_pre, a_post, a_comb = L.hc_mixes(x, params, p + "hc_attn", cfg, many_tokens=many_tokens)
    h = L.rms_norm(L.hc_pre(x, pre), params[p + "attn_norm.weight"], cfg.norm_eps)
    y, state = attention(layer, h, state)
    x = L.hc_post(y, x, a_post, a_comb, many_tokens=many_tokens)
    f_pre, f_post, f_comb = L.hc_mixes(x, params, p + "hc_ffn", cfg, many_tokens=many_tokens)
    h = L.rms_norm(L.hc_pre(x, a_pre), params[p + "ffn_norm.weight"], cfg.norm_eps)
    y, state = ffn(layer, h, state)
    x = L.hc_post(y, x, f_post, f_comb, many_tokens=many_tokens)
    return x, f_pre, state


def decoder_layers[S](
    params,
    cfg: ModelConfig,
    tokens: jax.Array,
    attention: Attention,
    state: S,
    *,
    engram_rows: tuple[jax.Array, jax.Array] | None = None,
    capture: tuple[int, ...] = (),
    ffn: FeedForward | None = None,
    many_tokens: bool = False,
    mesh=None,
) -> tuple[jax.Array, S, dict[int, jax.Array]]:
    """Embedding, every decoder layer, and the final collapse and norm of tokens int[..].

    Args:
        attention: each layer's attention over its caches (module docstring).
        state: the attention's (and ``ffn``'s) state entering layer 0.
        engram_rows: (table rows int32[.., engram layers, cols], live bool[..]) for Engram.
        capture: layers whose entering stream [.., hc, dim] is returned (the drafter's input).
        ffn: the FFN sub-block; the model's MoE (`model_moe`) by default.
        many_tokens: the mixes' layout for thousands of tokens (training).
        mesh: the device mesh the default FFN dispatches its experts over (None: none).

    Returns:
        (the LM head's input [.., dim], the final state, the captured streams by layer).
    """
    for layer in capture:
        if not 0 <= layer < cfg.n_layers:
            raise ValueError(f"layer {layer} is not a backbone layer (0..{cfg.n_layers - 1})")
    if cfg.engram_layer_ids and engram_rows is None:
        raise ValueError("an Engram model needs the tokens' engram_rows")
    ffn = model_moe(params, cfg, mesh) if ffn is None else ffn
    x = L.embed(params, tokens, cfg)  # [.., hc, dim]
    pre = jnp.zeros(x.shape[:-1], jnp.float32).at[..., 0].set(1.0)
    streams: dict[int, jax.Array] = {}
    for layer in range(cfg.n_layers):
        if layer in cfg.engram_layer_ids:
            rows, live = engram_rows
            li = cfg.engram_layer_ids.index(layer)
            values = engram.table_rows(params, layer, rows[..., li, :])
            x = engram.apply(x, params, layer, cfg, values, live)
        if layer in capture:
            streams[layer] = x
        x, pre, state = decoder_block(
            params, cfg, layer, x, pre, attention, ffn, state, many_tokens=many_tokens
        )
    return L.final_hidden(params, x, pre, cfg), state, streams
