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

import jax
import jax.numpy as jnp

from dsv4 import engram
from dsv4 import layers as L
from dsv4.config import ModelConfig, Role

__all__ = ["engram_rows", "forward", "forward_streams", "select_candidate_blocks", "topk_indices"]

NEG_INF = -jnp.inf


def select_candidate_blocks(
    scores: jax.Array, visible: jax.Array, topk_blocks: int, block_size: int
) -> jax.Array:
    """Boolean mask [.., N] of the entries in each row's top candidate blocks.

    ``scores`` [.., N] has -inf at entries the row cannot see; ``visible`` [..] is the number of
    visible entries. A block scores its best entry; the block holding the newest visible entry is
    pinned (+inf); the top ``min(topk_blocks, blocks)`` blocks are kept unless their score is
    -inf."""
    n = scores.shape[-1]
    pad = -n % block_size
    padded = jnp.pad(scores, [(0, 0)] * (scores.ndim - 1) + [(0, pad)], constant_values=NEG_INF)
    blocks = jnp.max(padded.reshape(*scores.shape[:-1], -1, block_size), axis=-1)
    nb = blocks.shape[-1]
    newest = (visible - 1) // block_size
    blocks = jnp.where(jnp.arange(nb) == newest[..., None], jnp.inf, blocks)
    vals, ids = jax.lax.top_k(blocks, min(topk_blocks, nb))
    keep_block = jnp.zeros(blocks.shape, bool)
    keep_block = jnp.put_along_axis(keep_block, ids, vals > NEG_INF, axis=-1, inplace=False)
    return jnp.repeat(keep_block, block_size, axis=-1)[..., :n]


def topk_indices(scores: jax.Array, visible: jax.Array, k: int) -> jax.Array:
    """Top-k entry ids [.., min(k, N)] of ``scores`` [.., N]; -1 for picks at or beyond
    ``visible`` or with score -inf. Ties: lower index first."""
    kk = min(k, scores.shape[-1])
    vals, ids = jax.lax.top_k(scores, kk)
    ok = (ids < visible[..., None]) & (vals > NEG_INF)
    return jnp.where(ok, ids, -1)


def index_scores(q: jax.Array, w: jax.Array, keys: jax.Array, visible: jax.Array) -> jax.Array:
    """sum_h w[.., h] relu(q[.., h, :] . key[j]) for queries q [B, T, IH, d], keys [B, N, d];
    entries j >= visible [B, T] are -inf."""
    dots = jnp.einsum("bthd,bnd->bthn", q, keys, preferred_element_type=jnp.float32)
    # an elementwise product and a plain reduction over heads, not a matmul: the summation
    # order then does not depend on the batch shape, so equal scores (common once q and k are
    # FP4-simulated) stay bit-equal between a prefill and a decode and ties break the same way
    s = _round_like(jnp.sum(_score_terms(dots, w, q.dtype), axis=2), q.dtype)
    n = keys.shape[1]
    return jnp.where(jnp.arange(n) < visible[..., None], s, NEG_INF)


def _round_like(x: jax.Array, dtype) -> jax.Array:
    """f32 x rounded to ``dtype`` and back (nothing for f32)."""
    return x if dtype == jnp.float32 else x.astype(dtype).astype(jnp.float32)


def _score_terms(dots: jax.Array, w: jax.Array, dt) -> jax.Array:
    """relu(q.k) * w per index head, f32 [.., IH, N]. With bf16 queries (serving: ``dt``) these
    are DeepSeek's bf16 tensors: the dot rounded to bf16, the product too (its sum over heads,
    in f32, is rounded once more by the caller)."""
    return _round_like(jax.nn.relu(_round_like(dots, dt)) * w.astype(jnp.float32)[..., None], dt)


def sink_attention(
    q: jax.Array, keys: jax.Array, mask: jax.Array, sink: jax.Array, scale: float
) -> jax.Array:
    """One softmax per (token, head) over the unmasked keys with a sink logit in the
    denominator. q [B, T, H, d], keys [B, T, K, d] or [B, K, d], mask [B, T, K]; out fp32.

    As DeepSeek's attention kernel: the exponentials are taken against the largest unmasked
    logit (the sink enters the denominator only), and V is multiplied by the probabilities
    rounded to q's dtype when that is not f32 (bf16: the kernel's cast before P.V); the
    denominator sums them in f32."""
    if keys.ndim == 3:
        # keys no query may see could be anything (NaN in tests): keep them out of p @ V
        keys = jnp.where(jnp.any(mask, axis=1)[..., None], keys, 0)
        logits = jnp.einsum("bthd,bkd->bthk", q, keys, preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("bthd,btkd->bthk", q, keys, preferred_element_type=jnp.float32)
    logits = jnp.where(mask[:, :, None, :], logits * scale, NEG_INF)
    sink = sink.astype(jnp.float32)[:, None]  # [H, 1]
    m = jnp.maximum(jnp.max(logits, axis=-1, keepdims=True), -1e30)
    p = jnp.exp(logits - m)
    denom = jnp.sum(p, axis=-1, keepdims=True) + jnp.exp(sink - m)
    if q.dtype != jnp.float32:
        p = p.astype(q.dtype).astype(jnp.float32)
    if keys.ndim == 3:
        return jnp.einsum("bthk,bkd->bthd", p, keys.astype(jnp.float32)) / denom
    return jnp.einsum("bthk,btkd->bthd", p, keys.astype(jnp.float32)) / denom


class _Shared:
    """What attention layers hand down the stack within one forward (docs/model.md#layer-roles)."""

    def __init__(self) -> None:
        self.compressed: dict[int, jax.Array] = {}  # kv source -> [B, N, head_dim]
        self.index_keys: dict[int, jax.Array] = {}  # kv source -> [B, N, index_head_dim]
        self.topk: jax.Array | None = None  # [B, T, k]
        self.candidates: jax.Array | None = None  # [B, T, N] bool


def _compress(x: jax.Array, params, a: str, ratio: int, cfg: ModelConfig) -> jax.Array:
    """Pre-rope latents of the complete groups of x [B, T, D]: [B, T // ratio, head_dim]."""
    b, t, _ = x.shape
    n = t // ratio
    if ratio == 1:
        z = L.linear(x, params, a + "compressor.wkv.weight", cfg)
    else:
        xf = x.astype(jnp.float32)[:, : n * ratio]
        kv = jnp.einsum("btd,od->bto", xf, params[a + "compressor.wkv.weight"].astype(jnp.float32))
        g = jnp.einsum("btd,od->bto", xf, params[a + "compressor.wgate.weight"].astype(jnp.float32))
        kv = kv.reshape(b, n, ratio, -1)
        g = jax.nn.softmax(g.reshape(b, n, ratio, -1), axis=2)
        z = jnp.sum(kv * g, axis=2).astype(x.dtype)
    return L.rms_norm(z, params[a + "compressor.norm.weight"], cfg.norm_eps)


def _attention(x, params, layer: int, cfg: ModelConfig, shared: _Shared) -> jax.Array:
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
            z = _compress(x, params, a, r, cfg)  # [B, n, hd], pre-rope
            gpos = jnp.arange(n) * r
            gcos, gsin = L.rope_tables(cfg, r, gpos)
            k, c = L.key_and_entry(
                z, params, a, cfg, gcos, gsin, qdq_key=cfg.quant_sim, qdq_entry=cfg.quant_sim
            )
            shared.index_keys[layer] = k
            shared.compressed[layer] = c
        if info.role in (Role.FULL, Role.REINDEX):
            qi, w = L.index_query(x, qr, params, a, cfg, cos, sin)
            scores = index_scores(qi, w, shared.index_keys[info.kv_source], visible)
            if info.is_candidate_source:
                shared.candidates = select_candidate_blocks(
                    scores, visible, cfg.candidate_topk_blocks, cfg.candidate_block_size
                )
            elif info.uses_candidates:
                scores = jnp.where(shared.candidates, scores, NEG_INF)
            shared.topk = topk_indices(scores, visible, cfg.index_topk)
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
    return L.attention_output(o, cos, sin, params, a, cfg)


def forward(params, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Logits float32[B, T, vocab] of DeepSeek-V4.1 for tokens int32[B, T] at positions 0..T-1."""
    return forward_streams(params, cfg, tokens, ())[0]


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
    params, cfg: ModelConfig, tokens: jax.Array, layers: tuple[int, ...] = ()
) -> tuple[jax.Array, dict[int, jax.Array]]:
    """`forward`'s logits, and the residual stream [B, T, hc, dim] entering each layer of
    ``layers`` (after its Engram update, before its attention's mix): what the DSpark drafter
    reads from its target layers."""
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be int32[B, T], got shape {tokens.shape}")
    for layer in layers:
        if not 0 <= layer < cfg.n_layers:
            raise ValueError(f"layer {layer} is not a backbone layer (0..{cfg.n_layers - 1})")
    x = L.embed(params, tokens, cfg)  # [B, T, hc, D]
    pre = jnp.zeros(x.shape[:-1], jnp.float32).at[..., 0].set(1.0)
    shared = _Shared()
    if cfg.engram_layer_ids:
        rows, live = engram_rows(params, cfg, tokens)
    streams: dict[int, jax.Array] = {}
    for layer in range(cfg.n_layers):
        p = f"layers.{layer}."
        if layer in cfg.engram_layer_ids:
            li = cfg.engram_layer_ids.index(layer)
            values = engram.table_rows(params, layer, rows[:, :, li])
            x = engram.apply(x, params, layer, cfg, values, live)
        if layer in layers:
            streams[layer] = x
        a_pre, a_post, a_comb = L.hc_mixes(x, params, p + "hc_attn", cfg)
        h = L.rms_norm(L.hc_pre(x, pre), params[p + "attn_norm.weight"], cfg.norm_eps)
        x = L.hc_post(_attention(h, params, layer, cfg, shared), x, a_post, a_comb)
        f_pre, f_post, f_comb = L.hc_mixes(x, params, p + "hc_ffn", cfg)
        h = L.rms_norm(L.hc_pre(x, a_pre), params[p + "ffn_norm.weight"], cfg.norm_eps)
        x = L.hc_post(L.moe(h, params, p + "ffn.", cfg), x, f_post, f_comb)
        pre = f_pre
    return L.head(params, x, pre, cfg), streams
