"""The whole-sequence reference forward: the oracle every other path is tested against.

`forward(params, cfg, tokens)` runs DeepSeek-V4.1 over ``tokens[B, T]`` (positions 0..T-1) at
once, with no cache, in plain jnp, written for clarity rather than speed: attention is a dense
masked softmax over the window keys and *all* compressed entries, where the sparse selection
(indexer top-k, candidate blocks) only decides which compressed entries are unmasked. The math is
`docs/model.md#the-forward-math`, with two deliberate choices:

* every index source scores against its own kv source's index keys (the official reference
  reads another layer's keys on some decode steps, a defect described in
  `docs/model.md#facts-from-running-the-official-reference`);
* a top-k pick whose score is -inf (possible when the candidate mask leaves fewer finite scores
  than k) is invalid, like a pick beyond the visible entries.

Top-k ties go to the lower index (``jax.lax.top_k``), for candidate blocks too.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dsv4 import engram
from dsv4 import layers as L
from dsv4.block import decoder_layers
from dsv4.config import ModelConfig, Role
from dsv4.inputs import check_model_params, check_positions, check_token_ids
from dsv4.layers import (
    NEG_INF,
    index_scores,
    select_candidate_blocks,
    sink_attention,
    topk_indices,
)

__all__ = [
    "NEG_INF",
    "Shared",
    "engram_rows",
    "forward",
    "forward_streams",
    "index_scores",
    "select_candidate_blocks",
    "sequence_entries",
    "sink_attention",
    "topk_indices",
]


class Shared(NamedTuple):
    """What attention layers hand down the stack within one whole-sequence forward
    (docs/model.md#layer-roles): each kv source's entries and index keys, the latest top-k and
    candidate blocks."""

    compressed: dict[int, jax.Array]  # kv source -> [B, N, head_dim]
    index_keys: dict[int, jax.Array]  # kv source -> [B, N, index_head_dim]
    topk: jax.Array | None = None  # [B, T, k]
    candidates: jax.Array | None = None  # [B, T, N] bool


def sequence_entries(
    x: jax.Array, params, a: str, ratio: int, cfg: ModelConfig, *, detach_keys: bool = False
) -> tuple[jax.Array, jax.Array]:
    """(index keys [B, N, index_head_dim], compressed entries [B, N, head_dim]) of the complete
    groups of a kv source's input x [B, T, D], rotated at each group's first position.
    ``detach_keys`` (training): the keys read the latents under stop_gradient."""
    z = L.group_latents(x, params, a, ratio, cfg)  # [B, N, hd], pre-rope
    gcos, gsin = L.rope_tables(cfg, ratio, jnp.arange(z.shape[1]) * ratio)
    q = cfg.quant_sim
    k, c = L.key_and_entry(z, params, a, cfg, gcos, gsin, qdq_key=q, qdq_entry=q)
    if detach_keys:
        k, _ = L.key_and_entry(jax.lax.stop_gradient(z), params, a, cfg, gcos, gsin,
                               qdq_key=q, qdq_entry=q)  # fmt: skip
    return k, c


def _attention(x, params, layer: int, cfg: ModelConfig, shared: Shared):
    info = cfg.plan[layer]
    a = f"layers.{layer}.attn."
    b, t, _ = x.shape
    r = info.ratio
    pos = jnp.arange(t)
    cos, sin = L.rope_tables(cfg, r, pos)  # [T, rope/2]

    qr, q, kv = L.query_and_latent(x, params, a, cfg, cos, sin, qdq_latent=cfg.quant_sim)
    # window: query t sees positions max(0, t - w + 1) .. t
    win_mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - cfg.window_size)
    win_mask = jnp.broadcast_to(win_mask, (b, t, t))

    n = t // r if r else 0
    if r and n > 0:
        visible = jnp.broadcast_to((pos + 1) // r, (b, t))
        if info.role is Role.FULL:
            k, c = sequence_entries(x, params, a, r, cfg)
            shared = shared._replace(
                index_keys={**shared.index_keys, layer: k},
                compressed={**shared.compressed, layer: c},
            )
        if info.owns_indexer:
            qi, w = L.index_query(x, qr, params, a, cfg, cos, sin)
            scores = index_scores(qi, w, shared.index_keys[info.kv_source], visible)
            topk, candidates = L.select_entries(scores, visible, info, cfg, shared.candidates)
            shared = shared._replace(topk=topk, candidates=candidates)
        sel = shared.topk  # [B, T, k]
        comp_mask = jnp.zeros((b, t, n + 1), bool)
        comp_mask = jnp.put_along_axis(
            comp_mask, jnp.where(sel >= 0, sel, n), True, axis=-1, inplace=False
        )[..., :n]
        comp = shared.compressed[info.kv_source]
        keys = jnp.concatenate(
            [
                jnp.broadcast_to(kv[:, None], (b, t, t, cfg.head_dim)),
                jnp.broadcast_to(comp[:, None], (b, t, n, cfg.head_dim)),
            ],
            axis=2,
        )
        mask = jnp.concatenate([win_mask, comp_mask], axis=-1)
        o = sink_attention(q, keys, mask, params[a + "attn_sink"], cfg.head_dim**-0.5)
    else:
        o = sink_attention(q, kv, win_mask, params[a + "attn_sink"], cfg.head_dim**-0.5)
    o = o.astype(x.dtype)
    return L.attention_output(o, cos, sin, params, a, cfg), shared


def forward(params, cfg: ModelConfig, tokens: jax.Array, *, mesh=None) -> jax.Array:
    """Logits float32[B, T, vocab] of DeepSeek-V4.1 for tokens int32[B, T] at positions 0..T-1.
    ``mesh``: the device mesh (`dsv4.sharding.make_mesh`) whose ``expert`` axis the routed
    experts dispatch their tokens over (`dsv4.expert_parallel`); static under `jax.jit`."""
    return forward_streams(params, cfg, tokens, (), mesh=mesh)[0]


def engram_rows(params, cfg: ModelConfig, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Engram's table rows int32[B, T, engram layers, columns] of whole sequences tokens
    int32[B, T], and bool[B, T], False at tokens that take part in no n-gram."""
    b, t = tokens.shape
    cids = engram.compressed_ids(params, tokens)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    none_before = jnp.zeros((b, cfg.engram_max_ngram_size - 1), jnp.int32)
    look = engram.lookback(cids, none_before, pos, cfg.engram_max_ngram_size)
    pad = engram.compressed_ids(params, jnp.int32(cfg.engram_pad_id))
    return engram.row_ids(cfg, look, pad), cids != engram.DEAD


def forward_streams(
    params, cfg: ModelConfig, tokens: jax.Array, layers: tuple[int, ...] = (), *, mesh=None
) -> tuple[jax.Array, dict[int, jax.Array]]:
    """`forward`'s logits, and the residual stream [B, T, hc, dim] entering each layer of
    ``layers`` (after its Engram update, before its attention's mix): what the DSpark drafter
    reads from its target layers. ``mesh``: as `forward`'s."""
    check_token_ids("reference.forward", "tokens", tokens, cfg.vocab_size, ndim=2)
    check_positions("reference.forward", np.shape(tokens)[1] - 1, cfg, "a sequence of that length")
    check_model_params("reference.forward", params, cfg)
    tokens = jnp.asarray(tokens)
    rows = engram_rows(params, cfg, tokens) if cfg.engram_layer_ids else None

    def attention(layer, h, shared):
        return _attention(h, params, layer, cfg, shared)

    h, _, streams = decoder_layers(
        params, cfg, tokens, attention, Shared({}, {}), engram_rows=rows, capture=layers, mesh=mesh
    )
    return L.lm_head(params, h), streams
