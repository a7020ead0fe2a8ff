"""The DSpark drafter of DeepSeek-V4.1 (`docs/model.md#dspark-drafter`).

DSpark proposes ``K = dspark_block_size`` tokens at once from a small stack of ``n_mtp_layers``
window-only blocks (the "stages", checkpoint names ``mtp.{i}.*``, layer ids ``n_layers + i``)
that read the backbone's hidden states. For a prefix of T tokens (positions 0 .. T-1):

* **Target hidden.** For every layer in ``dspark_target_layer_ids`` (ascending) take the residual
  stream *entering* that backbone layer (after any Engram update, before its mixing), average its
  ``hc_mult`` copies, and concatenate over the target layers: ``main_hidden`` [T, n_t * dim].
  Stage 0 owns ``main_proj`` (n_t * dim -> dim, an fp8 linear) and ``main_norm``:
  ``main_x = main_norm(main_proj(main_hidden))``; the other stages reuse stage 0's ``main_x``.
* **Context keys.** Each stage turns ``main_x`` into window latents with its *own* ``wkv`` and
  ``kv_norm``, rotated (plain rope, ratio-0 table) at the target token's position, fp8-QDQ'd under
  ``quant_sim`` like a backbone window latent. Only the last ``window_size`` positions
  (T - w .. T-1) are kept: in the incremental form they live in a ring per stage, slot =
  position mod w.
* **Draft block.** Token ids ``[next_token, noise x (K-1)]`` (noise = ``dspark_noise_token_id``)
  at positions T .. T+K-1, where ``next_token`` is the token at position T (the backbone's own
  pick after the prefix). They are embedded with the shared embedding and copied ``hc_mult``
  times; the first stage's pre-mix is the one-hot on copy 0.
* **A stage** is a backbone block with ratio 0 (mHC with the delayed pre-mix, attention, MoE with
  ``dspark_n_routed_experts`` / ``dspark_n_activated_experts``). Its attention differs: every one
  of the K queries sees the same keys, the context keys plus the K block tokens' own latents
  (bidirectional inside the block, no causal mask), with the per-head sink in the softmax
  denominator; the output path (inverse rope at the query position, grouped ``wo_a``, ``wo_b``)
  is the backbone's. The block tokens' latents are never cached.
* **Head.** After the last stage the copies are collapsed with that stage's FFN pre-mix (the
  delayed one) into ``hidden`` [K, dim]; ``logits = head(norm(hidden))`` with the last stage's
  ``norm`` and the backbone's shared LM head. Slot i predicts position T+1+i.
* **Markov head and sampling.** Left to right, slot i adds a low-rank bigram bias of the token
  *in* slot i (``next_token`` for slot 0, the token drafted from slot i-1 otherwise):
  ``bias = markov_head.head @ markov_head.embed[token]`` (fp32), then the slot's token is drafted
  greedily (argmax, the lower id on ties) and feeds slot i+1's bias.
* **Confidence.** ``confidence_head.proj`` (dim + markov_rank -> 1, fp32) of the concatenation
  of the slot's collapsed (un-normed) ``hidden`` and the Markov embedding of the token in the
  slot: a raw score per slot, no squashing.

Forms:

* `draft` — from scratch for a prefix (runs `dsv4.reference.forward_streams` for the targets);
  `draft_from_hidden` — the same from given target hidden states (rows may have different
  lengths);
* `init_draft_cache` / `seed` / `step` — the incremental form over the drafter's own dense window
  rings: `seed` writes the stages' rings from the target hidden of a chunk of committed
  positions, `step` drafts from the rings (optionally seeding the chunk just before it first);
* the paged form (`dsv4.paged.draft`, what the serving engine runs): the stages' window caches
  are the draft layers' KV-cache groups of the paged pools, written through the step's slot
  mapping and read through its block tables; it shares `context_latents` and `run_drafter`
  (the stages and heads, their attention passed in as an ``attend`` function) with the forms
  above.

The numerics follow `dsv4.reference` (fp32 where the official reference is; activation dtype =
the embedding's dtype).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dsv4 import layers as L
from dsv4 import reference
from dsv4.block import decoder_block
from dsv4.config import ModelConfig
from dsv4.inputs import check_model_params, check_token_ids
from dsv4.params import dspark_specs as param_specs
from dsv4.params import require_drafter
from dsv4.quant import fp8_qdq
from dsv4.reference import sink_attention

Params = dict[str, jax.Array]
Cache = dict[str, jax.Array]

__all__ = [
    "Attend",
    "DraftBlock",
    "context_latent",
    "context_latents",
    "draft",
    "draft_from_hidden",
    "draft_over_latents",
    "init_draft_cache",
    "main_projection",
    "param_specs",  # dsv4.params.dspark_specs: the drafter's tensors, beside the backbone's
    "run_drafter",
    "seed",
    "step",
    "target_hidden",
]


class DraftBlock(NamedTuple):
    """One drafted block for a batch of B sequences whose draft block starts at position T.

    ``logits`` f32[B, K, V]: slot i's distribution for position T+1+i, Markov bias included;
    ``tokens`` int32[B, K]: the greedy drafts, ``tokens[:, i]`` for position T+1+i;
    ``confidence`` f32[B, K]: the raw confidence-head score of each slot."""

    logits: jax.Array
    tokens: jax.Array
    confidence: jax.Array


# -- config and parameters ----------------------------------------------------------------------


def _stage(i: int) -> str:
    return f"mtp.{i}."


def _last(cfg: ModelConfig) -> str:
    return _stage(cfg.n_mtp_layers - 1)


@functools.lru_cache(maxsize=16)
def _stage_cfg(cfg: ModelConfig) -> ModelConfig:
    """The config a stage's MoE runs under: the drafter's expert counts."""
    return cfg.replace(
        n_routed_experts=cfg.dspark_n_routed_experts,
        n_activated_experts=cfg.dspark_n_activated_experts,
    )


# -- input checks ---------------------------------------------------------------------------------


def _check_ids(name: str, x, vocab: int) -> None:
    check_token_ids("dspark", name, x, vocab, ndim=np.ndim(x))


def _int_array(name: str, x, shape: tuple[int, ...] | None = None) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must hold integers, got dtype {x.dtype}")
    if shape is not None and x.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {x.shape}")
    return x.astype(jnp.int32)


def _per_row(name: str, x, b: int) -> jax.Array:
    """An int32[B] per-row argument (a scalar is broadcast to every row)."""
    x = jnp.asarray(x)
    if x.ndim == 0:
        x = jnp.broadcast_to(x, (b,))
    return _int_array(name, x, (b,))


def _check_hidden(cfg: ModelConfig, main_hidden) -> jax.Array:
    main_hidden = jnp.asarray(main_hidden)
    width = len(cfg.dspark_target_layer_ids) * cfg.dim
    if main_hidden.ndim != 3 or main_hidden.shape[-1] != width:
        raise ValueError(
            f"main_hidden must be [B, T, {width}] (len(dspark_target_layer_ids) * dim), got "
            f"shape {main_hidden.shape}"
        )
    return main_hidden


# -- the drafter's pieces -----------------------------------------------------------------------


def target_hidden(cfg: ModelConfig, streams: Mapping[int, jax.Array]) -> jax.Array:
    """The drafter's input [B, T, n_t * dim] from the backbone streams entering the target
    layers, ``streams[layer]`` [B, T, hc_mult, dim]: the mean over the copies, concatenated in
    ascending layer order (the order of ``dspark_target_layer_ids``)."""
    require_drafter(cfg)
    missing = [t for t in cfg.dspark_target_layer_ids if t not in streams]
    if missing:
        raise ValueError(f"streams lack the target layers {missing}")
    parts = []
    for layer in cfg.dspark_target_layer_ids:
        s = streams[layer]
        parts.append(jnp.mean(s.astype(jnp.float32), axis=-2).astype(s.dtype))
    return jnp.concatenate(parts, axis=-1)


def main_projection(params: Params, cfg: ModelConfig, main_hidden: jax.Array) -> jax.Array:
    """Stage 0's projection of the target hidden [.., n_t * dim] -> [.., dim]."""
    y = L.linear(main_hidden, params, "mtp.0.main_proj.weight", cfg)
    return L.rms_norm(y, params["mtp.0.main_norm.weight"], cfg.norm_eps)


def context_latent(
    params: Params,
    cfg: ModelConfig,
    i: int,
    main_x: jax.Array,
    pos: jax.Array,
    *,
    qdq: bool | None = None,
) -> jax.Array:
    """Stage i's window latents [.., head_dim] of main_x [.., dim] at positions pos [..],
    fp8-QDQ'd when ``qdq`` (default ``cfg.quant_sim``; the paged path passes False when the
    cache records quantise themselves)."""
    a = _stage(i) + "attn."
    kv = L.rms_norm(
        L.linear(main_x, params, a + "wkv.weight", cfg), params[a + "kv_norm.weight"], cfg.norm_eps
    )
    cos, sin = L.rope_tables(cfg, 0, pos)
    kv = L.apply_rope(kv, cos, sin)
    if cfg.quant_sim if qdq is None else qdq:
        kv = fp8_qdq(kv, 32)
    return kv


def context_latents(
    params: Params,
    cfg: ModelConfig,
    main_hidden: jax.Array,
    pos: jax.Array,
    *,
    qdq: bool | None = None,
) -> list[jax.Array]:
    """Every stage's context latents [.., head_dim] of the target hidden states main_hidden
    [.., n_t * dim] (`target_hidden`) at positions pos [..]: what the stages' window caches
    hold (stage 0's ``main_x`` projected with each stage's own ``wkv`` / ``kv_norm``, rotated
    at pos). ``qdq`` as in `context_latent`."""
    main_x = main_projection(params, cfg, main_hidden)
    return [context_latent(params, cfg, i, main_x, pos, qdq=qdq) for i in range(cfg.n_mtp_layers)]


# attend(i, q, kv, sink) -> f32[B, K, H, head_dim]: stage i's attention of the block queries
# q [B, K, H, head_dim] over its context and the block latents kv [B, K, head_dim] (every query
# sees all K of them), with the per-head sink in the denominator. The dense forms build it from
# latents in memory (`_dense_attend`); `dsv4.paged.draft` reads the paged window caches.
Attend = Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]


def _dense_attend(cfg: ModelConfig, ctx: Sequence[jax.Array], ctx_mask: jax.Array) -> Attend:
    """The block attention over context latents ``ctx[i]`` [B, N, hd] visible where ctx_mask
    [B, N] is set, plus the K block latents: one softmax (`dsv4.reference.sink_attention`)."""

    def attend(i: int, q: jax.Array, kv: jax.Array, sink: jax.Array) -> jax.Array:
        b, k = q.shape[:2]
        keys = jnp.concatenate([ctx[i].astype(kv.dtype), kv], axis=1)
        n = ctx[i].shape[1]
        mask = jnp.concatenate(
            [jnp.broadcast_to(ctx_mask[:, None, :], (b, k, n)), jnp.ones((b, k, k), bool)],
            axis=-1,
        )
        return sink_attention(q, keys, mask, sink, cfg.head_dim**-0.5)

    return attend


def _block_attention(
    h: jax.Array,
    params: Params,
    cfg: ModelConfig,
    i: int,
    cos: jax.Array,
    sin: jax.Array,
    attend: Attend,
) -> jax.Array:
    """Stage i's attention for the normed block inputs h [B, K, dim] at the rope of their
    positions (cos/sin [B, K, rope/2]), its keys given by ``attend``."""
    a = _stage(i) + "attn."
    _, q, kv = L.query_and_latent(h, params, a, cfg, cos, sin, qdq_latent=cfg.quant_sim)
    o = attend(i, q, kv, params[a + "attn_sink"])
    return L.attention_output(o.astype(h.dtype), cos, sin, params, a, cfg)


def draft_over_latents(
    params: Params,
    cfg: ModelConfig,
    ctx: Sequence[jax.Array],
    ctx_mask: jax.Array,
    next_token: jax.Array,
    start: jax.Array,
    slot_tokens: jax.Array | None = None,
    *,
    mesh=None,
) -> DraftBlock:
    """`run_drafter` over context latents ``ctx[i]`` [B, N, hd] (one per stage, visible where
    ctx_mask [B, N]) held in memory."""
    attend = _dense_attend(cfg, ctx, ctx_mask)
    return run_drafter(params, cfg, attend, next_token, start, slot_tokens, mesh=mesh)


def run_drafter(
    params: Params,
    cfg: ModelConfig,
    attend: Attend,
    next_token: jax.Array,
    start: jax.Array,
    slot_tokens: jax.Array | None = None,
    *,
    mesh=None,
) -> DraftBlock:
    """The stages and heads for the block ``[next_token, noise...]`` at positions ``start[b] ..
    start[b] + K - 1``, every stage's attention given by ``attend(i, q, kv, sink)`` (its
    context and the block's own latents; see ``Attend``). ``slot_tokens`` int32[B, K-1]
    (training only: teacher forcing) puts those tokens in slots 1..K-1 for the Markov bias
    instead of the drafts. ``mesh``: the stages' experts dispatch over its ``expert`` axis."""
    k = cfg.dspark_block_size
    b = next_token.shape[0]
    pos = start[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]  # [B, K]
    cos, sin = L.rope_tables(cfg, 0, pos)
    noise = jnp.full((b, k - 1), cfg.dspark_noise_token_id, jnp.int32)
    x = L.embed(params, jnp.concatenate([next_token[:, None], noise], axis=1), cfg)
    pre = jnp.zeros(x.shape[:-1], jnp.float32).at[..., 0].set(1.0)
    moe_cfg = _stage_cfg(cfg)
    eps = cfg.norm_eps

    def attention(i, h, state):
        return _block_attention(h, params, cfg, i, cos, sin, attend), state

    def ffn(i, h, state):  # a stage's experts under the drafter's MoE config
        return L.moe(h, params, _stage(i) + "ffn.", moe_cfg, mesh=mesh), state

    for i in range(cfg.n_mtp_layers):
        x, pre, _ = decoder_block(params, cfg, i, x, pre, attention, ffn, None, prefix=_stage(i))
    last = _last(cfg)
    hidden = L.hc_pre(x, pre)  # [B, K, dim]
    logits = L.lm_head(params, L.rms_norm(hidden, params[last + "norm.weight"], eps))
    table = params[last + "markov_head.embed.weight"]
    markov_w = params[last + "markov_head.head.weight"].astype(jnp.float32)
    token = next_token
    slot_logits, drafted, embeds = [], [], []
    for i in range(k):
        emb = jnp.take(table, token, axis=0).astype(jnp.float32)  # [B, rank]
        bias = jnp.einsum("br,vr->bv", emb, markov_w, preferred_element_type=jnp.float32)
        li = logits[:, i] + bias
        token = jnp.argmax(li, axis=-1).astype(jnp.int32)
        slot_logits.append(li)
        drafted.append(token)
        embeds.append(emb)
        if slot_tokens is not None and i < k - 1:
            token = slot_tokens[:, i]
    feats = jnp.concatenate([hidden.astype(jnp.float32), jnp.stack(embeds, axis=1)], axis=-1)
    proj = params[last + "confidence_head.proj.weight"].astype(jnp.float32)
    confidence = jnp.einsum("bkc,oc->bko", feats, proj, preferred_element_type=jnp.float32)
    return DraftBlock(
        logits=jnp.stack(slot_logits, axis=1),
        tokens=jnp.stack(drafted, axis=1),
        confidence=confidence[..., 0],
    )


# -- from scratch ---------------------------------------------------------------------------------


def draft_from_hidden(
    params: Params,
    cfg: ModelConfig,
    main_hidden: jax.Array,
    next_token: jax.Array,
    *,
    lengths: jax.Array | None = None,
    mesh=None,
) -> DraftBlock:
    """Draft from the target hidden states of a prefix.

    main_hidden [B, T, n_t * dim] (`target_hidden` of positions 0..T-1); next_token int32[B], the
    token at position ``lengths[b]`` that opens the draft block; lengths int32[B] (default T):
    row b's prefix is its first ``lengths[b]`` positions (1..T), the rest is ignored."""
    require_drafter(cfg)
    main_hidden = _check_hidden(cfg, main_hidden)
    b, t, _ = main_hidden.shape
    next_token = _int_array("next_token", next_token, (b,))
    _check_ids("next_token", next_token, cfg.vocab_size)
    w = cfg.window_size
    if lengths is None:
        # only the last w positions are ever visible
        first = max(0, t - w)
        main_hidden = main_hidden[:, first:]
        pos = jnp.arange(first, t, dtype=jnp.int32)
        lengths = jnp.full((b,), t, jnp.int32)
    else:
        lengths = _per_row("lengths", lengths, b)
        pos = jnp.arange(t, dtype=jnp.int32)
    pos = jnp.broadcast_to(pos[None, :], (b, pos.shape[0]))
    ctx_mask = (pos < lengths[:, None]) & (pos >= lengths[:, None] - w)
    ctx = context_latents(params, cfg, main_hidden, pos)
    return draft_over_latents(params, cfg, ctx, ctx_mask, next_token, lengths, mesh=mesh)


def draft(
    params: Params,
    cfg: ModelConfig,
    tokens: jax.Array,
    *,
    next_token: jax.Array | None = None,
    mesh=None,
) -> DraftBlock:
    """Draft the K = ``dspark_block_size`` tokens after a prefix, from scratch.

    tokens int32[B, T] (positions 0..T-1) runs through the backbone for the target hidden
    states; next_token int32[B] is the token at position T that opens the draft block (None:
    the backbone's greedy pick after the prefix). ``logits[:, i]`` is for position T+1+i.
    ``mesh``: the device mesh the experts dispatch over (`dsv4.reference.forward`'s)."""
    require_drafter(cfg)
    check_token_ids("dspark.draft", "tokens", tokens, cfg.vocab_size, ndim=2)
    check_model_params("dspark.draft", params, cfg, drafter=True)
    tokens = jnp.asarray(tokens, jnp.int32)
    b, t = tokens.shape
    if t + cfg.dspark_block_size > cfg.max_seq_len:
        raise ValueError(
            f"a prefix of {t} tokens plus a draft block of {cfg.dspark_block_size} exceeds "
            f"max_seq_len={cfg.max_seq_len}"
        )
    if next_token is not None:
        next_token = _int_array("next_token", next_token, (b,))
        _check_ids("next_token", next_token, cfg.vocab_size)
    layers = cfg.dspark_target_layer_ids
    logits, streams = reference.forward_streams(params, cfg, tokens, layers, mesh=mesh)
    if next_token is None:
        next_token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
    return draft_from_hidden(params, cfg, target_hidden(cfg, streams), next_token, mesh=mesh)


# -- incremental ----------------------------------------------------------------------------------


def _ring(cfg: ModelConfig, i: int) -> str:
    return f"win.{cfg.n_layers + i}"


def init_draft_cache(
    cfg: ModelConfig, batch: int, dtype=jnp.float32, *, fill: float = 0.0
) -> Cache:
    """Empty drafter caches for ``batch`` sequences: per stage i a window ring
    ``win.{n_layers + i}`` [batch, window_size, head_dim] of context latents (slot = position
    mod window_size), and one ``win_pos`` int32[batch, window_size] of the positions the rings
    hold (-1 = empty), shared by the stages. Unwritten rows hold ``fill`` (tests use NaN)."""
    require_drafter(cfg)
    if batch <= 0:
        raise ValueError(f"batch={batch} must be positive")
    w = cfg.window_size
    cache: Cache = {"win_pos": jnp.full((batch, w), -1, jnp.int32)}
    for i in range(cfg.n_mtp_layers):
        cache[_ring(cfg, i)] = jnp.full((batch, w, cfg.head_dim), fill, dtype)
    return cache


def _cache_batch(cfg: ModelConfig, cache: Cache) -> int:
    if "win_pos" not in cache or any(_ring(cfg, i) not in cache for i in range(cfg.n_mtp_layers)):
        raise ValueError("cache is not a drafter cache of this config (see init_draft_cache)")
    return cache["win_pos"].shape[0]


def seed(
    params: Params,
    cfg: ModelConfig,
    cache: Cache,
    main_hidden: jax.Array,
    start: jax.Array,
    lengths: jax.Array | None = None,
) -> Cache:
    """Write the stages' rings from the target hidden states of a chunk of committed positions.

    main_hidden [B, C, n_t * dim] (`target_hidden` of the chunk); start int32[B]: position of
    row b's first chunk entry; lengths int32[B] (default C): its real entries, the rest is
    padding and writes nothing. Only the last window_size real positions of a row are written.
    Seed only committed positions: a rejected draft's state would evict a committed one."""
    require_drafter(cfg)
    b = _cache_batch(cfg, cache)
    main_hidden = _check_hidden(cfg, main_hidden)
    if main_hidden.shape[0] != b:
        raise ValueError(f"main_hidden has batch {main_hidden.shape[0]}, the cache {b}")
    c = main_hidden.shape[1]
    start = _per_row("start", start, b)
    lengths = jnp.full((b,), c, jnp.int32) if lengths is None else _per_row("lengths", lengths, b)
    w = cfg.window_size
    pos = start[:, None] + jnp.arange(c, dtype=jnp.int32)[None, :]  # [B, C]
    real = jnp.arange(c)[None, :] < lengths[:, None]
    write = real & (pos >= (start + lengths)[:, None] - w)
    slot = jnp.where(write, pos % w, w)  # w: out of range, dropped
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, c))
    new = dict(cache)
    new["win_pos"] = cache["win_pos"].at[rows, slot].set(pos, mode="drop")
    main_x = main_projection(params, cfg, main_hidden)
    for i in range(cfg.n_mtp_layers):
        ring = cache[_ring(cfg, i)]
        kv = context_latent(params, cfg, i, main_x, pos)
        new[_ring(cfg, i)] = ring.at[rows, slot].set(kv.astype(ring.dtype), mode="drop")
    return new


def step(
    params: Params,
    cfg: ModelConfig,
    cache: Cache,
    next_token: jax.Array,
    start: jax.Array,
    *,
    main_hidden: jax.Array | None = None,
    lengths: jax.Array | None = None,
    mesh=None,
) -> tuple[DraftBlock, Cache]:
    """Draft the block at positions ``start[b] .. start[b] + K - 1`` from the rings.

    next_token int32[B]: the token at position start[b]; start int32[B]. The context is every
    ring entry at positions start - window_size .. start - 1. With main_hidden [B, C, n_t *
    dim] (and lengths int32[B], default C) positions ``start - lengths .. start - 1`` are
    seeded from it first (commit the verified tokens, then draft). ``mesh``: `draft`'s.

    Returns:
        (the block, the cache updated only by that seeding)."""
    require_drafter(cfg)
    b = _cache_batch(cfg, cache)
    next_token = _int_array("next_token", next_token, (b,))
    _check_ids("next_token", next_token, cfg.vocab_size)
    start = _per_row("start", start, b)
    if main_hidden is not None:
        main_hidden = _check_hidden(cfg, main_hidden)
        c = main_hidden.shape[1]
        lengths = (
            jnp.full((b,), c, jnp.int32) if lengths is None else _per_row("lengths", lengths, b)
        )
        cache = seed(params, cfg, cache, main_hidden, start - lengths, lengths)
    elif lengths is not None:
        raise ValueError("lengths is given without main_hidden")
    held = cache["win_pos"]  # [B, w]
    ctx_mask = (held >= 0) & (held < start[:, None]) & (held >= start[:, None] - cfg.window_size)
    ctx = [cache[_ring(cfg, i)] for i in range(cfg.n_mtp_layers)]
    block = draft_over_latents(params, cfg, ctx, ctx_mask, next_token, start, mesh=mesh)
    return block, cache
