"""Incremental inference with dense per-sequence caches: chunked prefill of any size, then decode.

`init_cache(cfg, batch, max_len)` allocates, per sequence of the batch:

* ``win.{L}`` — every layer's window ring of ``window_size`` latents (slot = position mod w), and
  one ``win_pos`` ring of the positions held (-1 = empty), shared by all layers;
* ``comp.{S}`` / ``ikey.{S}`` — for every kv source S, its compressed entries (rotated at their
  group's first position, quantisation-simulated when ``quant_sim``) and index keys, row j for
  group j, ``max_len // ratio`` rows;
* ``state_kv.{S}`` / ``state_score.{S}`` — for ratio-2 kv sources, the fp32 projections and gate
  logits of the tokens of a group still open at the end of a chunk (slot = position mod ratio).

`forward_step(params, cfg, cache, tokens, start, lengths)` runs a chunk ``tokens[B, T]``; row b
holds positions ``start[b] .. start[b] + T - 1`` of which the first ``lengths[b]`` are real (the
rest is padding that reads nothing and writes nothing). The math is the reference's
(`dsv4.reference`), with the cache standing in for the part of the sequence before the chunk; the
tests check every position of every chunking against `reference.forward`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsv4 import engram
from dsv4 import layers as L
from dsv4.block import decoder_layers
from dsv4.config import ModelConfig, Role
from dsv4.inputs import check_model_params, check_positions, check_token_ids, concrete
from dsv4.layers import index_scores, sink_attention

Cache = dict[str, jax.Array]

__all__ = ["forward_step", "forward_step_streams", "init_cache"]


def init_cache(
    cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32, *, fill: float = 0.0
) -> Cache:
    """Empty caches for ``batch`` sequences of up to ``max_len`` tokens. Rows not yet written
    hold ``fill`` (tests pass NaN to prove that no unwritten row is ever read)."""
    if max_len <= 0 or batch <= 0:
        raise ValueError(f"batch={batch} and max_len={max_len} must be positive")
    w = cfg.window_size
    cache: Cache = {"win_pos": jnp.full((batch, w), -1, jnp.int32)}
    if cfg.engram_layer_ids:
        # the compressed ids of the last max_ngram_size - 1 positions (slot = position mod that)
        m = cfg.engram_max_ngram_size - 1
        cache["engram_hist"] = jnp.full((batch, m), engram.DEAD, jnp.int32)
    for info in cfg.plan:
        cache[f"win.{info.layer}"] = jnp.full((batch, w, cfg.head_dim), fill, dtype)
        if info.role is Role.FULL:
            n = max_len // info.ratio
            cache[f"comp.{info.layer}"] = jnp.full((batch, n, cfg.head_dim), fill, dtype)
            cache[f"ikey.{info.layer}"] = jnp.full((batch, n, cfg.index_head_dim), fill, dtype)
            if info.ratio > 1:
                shape = (batch, info.ratio, cfg.head_dim)
                cache[f"state_kv.{info.layer}"] = jnp.full(shape, fill, jnp.float32)
                cache[f"state_score.{info.layer}"] = jnp.full(shape, -jnp.inf, jnp.float32)
    return cache


class _Step:
    """Per-chunk quantities shared by all layers."""

    def __init__(
        self, cfg: ModelConfig, cache: Cache, start: jax.Array, lengths: jax.Array, t: int
    ):
        b = start.shape[0]
        self.t = t
        self.start = start
        self.pos = start[:, None] + jnp.arange(t)[None, :]  # [B, T]
        self.valid = jnp.arange(t)[None, :] < lengths[:, None]  # [B, T]
        self.end = start + lengths  # [B] first position after the chunk
        w = cfg.window_size
        old_pos = cache["win_pos"]  # [B, w]
        p = self.pos
        # window visibility: ring entries written by earlier chunks, then the chunk itself
        ring_ok = (old_pos[:, None, :] >= 0) & (old_pos[:, None, :] < start[:, None, None])
        ring_ok &= old_pos[:, None, :] > p[:, :, None] - w
        chunk_ok = self.valid[:, None, :] & (p[:, None, :] <= p[:, :, None])
        chunk_ok &= p[:, None, :] > p[:, :, None] - w
        self.win_mask = jnp.concatenate([ring_ok, chunk_ok], axis=-1)  # [B, T, w + T]
        # ring writes: the last w real tokens of the chunk (distinct slots); others dropped
        write = self.valid & (p >= self.end[:, None] - w)
        self.ring_slot = jnp.where(write, p % w, w)  # w = out of range -> dropped
        self.rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
        self.new_win_pos = old_pos.at[self.rows, self.ring_slot].set(p, mode="drop")
        self.cache_write = jnp.ones((b, t), bool)


def _write_ring(ring: jax.Array, kv: jax.Array, st: _Step) -> jax.Array:
    return ring.at[st.rows, st.ring_slot].set(kv.astype(ring.dtype), mode="drop")


def _compressor(
    x, params, a: str, layer: int, ratio: int, cfg: ModelConfig, cache: Cache, st: _Step
):
    """Pre-rope latents at the rows that close a group ([B, T, hd], garbage elsewhere), the mask
    of those rows, and the updated open-group state."""
    if ratio == 1:
        z = L.linear(x, params, a + "compressor.wkv.weight", cfg)
        z = L.rms_norm(z, params[a + "compressor.norm.weight"], cfg.norm_eps)
        return z, st.valid, {}
    xf = x.astype(jnp.float32)
    kv = jnp.einsum("btd,od->bto", xf, params[a + "compressor.wkv.weight"].astype(jnp.float32))
    sc = jnp.einsum("btd,od->bto", xf, params[a + "compressor.wgate.weight"].astype(jnp.float32))
    skv, ssc = cache[f"state_kv.{layer}"], cache[f"state_score.{layer}"]
    p, t = st.pos, st.t
    members_kv, members_sc = [], []
    for m in range(ratio):
        mpos = p - (ratio - 1) + m  # position of group member m for a token closing its group
        in_chunk = mpos >= st.start[:, None]
        idx = jnp.clip(jnp.arange(t)[None, :] - (ratio - 1) + m, 0, t - 1)
        from_chunk_kv = jnp.take_along_axis(kv, idx[..., None], axis=1)
        from_chunk_sc = jnp.take_along_axis(sc, idx[..., None], axis=1)
        slot = jnp.mod(mpos, ratio)
        from_state_kv = jnp.take_along_axis(skv, slot[..., None], axis=1)
        from_state_sc = jnp.take_along_axis(ssc, slot[..., None], axis=1)
        members_kv.append(jnp.where(in_chunk[..., None], from_chunk_kv, from_state_kv))
        members_sc.append(jnp.where(in_chunk[..., None], from_chunk_sc, from_state_sc))
    gkv = jnp.stack(members_kv, axis=2)  # [B, T, R, hd]
    gsc = jax.nn.softmax(jnp.stack(members_sc, axis=2), axis=2)
    z = jnp.sum(gkv * gsc, axis=2).astype(x.dtype)
    z = L.rms_norm(z, params[a + "compressor.norm.weight"], cfg.norm_eps)
    closes = st.valid & ((p + 1) % ratio == 0)
    # tokens of the group still open after the chunk wait in the state
    open_from = (st.end // ratio) * ratio
    keep = st.valid & (p >= open_from[:, None])
    slot = jnp.where(keep, p % ratio, ratio)
    new_state = {
        f"state_kv.{layer}": skv.at[st.rows, slot].set(kv, mode="drop"),
        f"state_score.{layer}": ssc.at[st.rows, slot].set(sc, mode="drop"),
    }
    return z, closes, new_state


def _attention(
    x, params, layer: int, cfg: ModelConfig, cache: Cache, new: Cache, st: _Step, shared
):
    info = cfg.plan[layer]
    a = f"layers.{layer}." + "attn."
    b, t, _ = x.shape
    r = info.ratio
    cos, sin = L.rope_tables(cfg, r, st.pos)  # [B, T, rope/2]
    qr, q, kv = L.query_and_latent(x, params, a, cfg, cos, sin, qdq_latent=cfg.quant_sim)
    ring = cache[f"win.{layer}"]
    keys = [ring.astype(kv.dtype), kv]
    masks = [st.win_mask]
    new[f"win.{layer}"] = _write_ring(ring, kv, st)

    if r:
        src = info.kv_source
        if info.role is Role.FULL:
            z, closes, state = _compressor(x, params, a, layer, r, cfg, cache, st)
            new.update(state)
            gcos, gsin = L.rope_tables(cfg, r, st.pos - (r - 1))  # group's first position
            k, c = L.key_and_entry(
                z, params, a, cfg, gcos, gsin, qdq_key=cfg.quant_sim, qdq_entry=cfg.quant_sim
            )
            comp, ikey = cache[f"comp.{layer}"], cache[f"ikey.{layer}"]
            write = closes & st.cache_write
            row = jnp.where(write, st.pos // r, comp.shape[1])  # out of range -> dropped
            new[f"comp.{layer}"] = comp.at[st.rows, row].set(c.astype(comp.dtype), mode="drop")
            new[f"ikey.{layer}"] = ikey.at[st.rows, row].set(k.astype(ikey.dtype), mode="drop")
        comp = new[f"comp.{src}"]
        n = comp.shape[1]
        # padding rows see nothing (their keys would be rows nobody wrote)
        visible = jnp.where(st.valid, (st.pos + 1) // r, 0)  # [B, T]
        if info.role in (Role.FULL, Role.REINDEX):
            qi, w = L.index_query(x, qr, params, a, cfg, cos, sin)
            scores = index_scores(qi, w, new[f"ikey.{src}"].astype(qi.dtype), visible)
            shared["topk"], shared["candidates"] = L.select_entries(
                scores, visible, info, cfg, shared.get("candidates")
            )
        sel = shared["topk"]
        if t == 1 and sel.shape[-1] < n:
            # decode: the query attends to its window and its k selected entries, gathered,
            # not to all n entries under a mask (k keys instead of n per query and row)
            keys.append(_selected_entries(comp, sel[:, 0]).astype(kv.dtype))
            masks.append(sel >= 0)
        else:
            comp_mask = jnp.zeros((b, t, n + 1), bool)
            comp_mask = jnp.put_along_axis(
                comp_mask, jnp.where(sel >= 0, sel, n), True, axis=-1, inplace=False
            )[..., :n]
            keys.append(comp.astype(kv.dtype))
            masks.append(comp_mask)
    keys = jnp.concatenate(keys, axis=1)
    mask = jnp.concatenate(masks, axis=-1)
    o = sink_attention(q, keys, mask, params[a + "attn_sink"], cfg.head_dim**-0.5).astype(x.dtype)
    return L.attention_output(o, cos, sin, params, a, cfg)


def _selected_entries(comp: jax.Array, sel: jax.Array) -> jax.Array:
    """Rows ``sel`` [B, k] of comp [B, N, hd] (row 0 for a pick of -1, which the caller masks;
    `sink_attention` keeps masked keys out of the sum): [B, k, hd]."""
    return jnp.take_along_axis(comp, jnp.where(sel >= 0, sel, 0)[..., None], axis=1)


def _engram_rows(params, cfg: ModelConfig, cache: Cache, tokens: jax.Array, st: _Step):
    """Engram's table rows [B, T, engram layers, columns] of the chunk, the mask of the tokens
    whose gate is open, and the updated history ring."""
    m = cfg.engram_max_ngram_size - 1
    hist = cache["engram_hist"]
    cids = engram.compressed_ids(params, tokens)
    # entry j: position start - 1 - j (a negative position is marked DEAD by lookback)
    prev = jnp.take_along_axis(hist, jnp.mod(st.start[:, None] - 1 - jnp.arange(m), m), axis=1)
    look = engram.lookback(cids, prev, st.pos, cfg.engram_max_ngram_size)
    pad = engram.compressed_ids(params, jnp.int32(cfg.engram_pad_id))
    rows = engram.row_ids(cfg, look, pad)
    write = st.valid & (st.pos >= st.end[:, None] - m)
    slot = jnp.where(write, st.pos % m, m)  # m = out of range -> dropped
    new_hist = hist.at[st.rows, slot].set(cids, mode="drop")
    return rows, st.valid & (cids != engram.DEAD), new_hist


def forward_step(
    params,
    cfg: ModelConfig,
    cache: Cache,
    tokens: jax.Array,
    start: jax.Array,
    lengths: jax.Array,
    write_from: jax.Array | None = None,
    *,
    mesh=None,
) -> tuple[jax.Array, Cache]:
    """One chunk for every row: logits float32[B, T, vocab] and the updated cache.

    tokens int32[B, T]; start int32[B] (position of each row's first token); lengths int32[B]
    (real tokens per row, 0..T). Rows must continue exactly where their cache ends.
    ``write_from`` int32[B] (`docs/serving.md#bounded-replay`): tokens below it write only
    their window latents. ``mesh``: the device mesh the experts dispatch over."""
    logits, new, _ = forward_step_streams(params, cfg, cache, tokens, start, lengths, (),
                                          write_from, mesh=mesh)  # fmt: skip
    return logits, new


def forward_step_streams(
    params,
    cfg: ModelConfig,
    cache: Cache,
    tokens: jax.Array,
    start: jax.Array,
    lengths: jax.Array,
    layers: tuple[int, ...] = (),
    write_from: jax.Array | None = None,
    *,
    mesh=None,
) -> tuple[jax.Array, Cache, dict[int, jax.Array]]:
    """`forward_step`, plus the residual stream [B, T, hc, dim] of the chunk entering each layer
    of ``layers`` (after its Engram update): what the DSpark drafter's `seed` reads."""
    _check_step(params, cfg, cache, tokens, start, lengths, write_from)
    b, t = np.shape(tokens)
    tokens = jnp.asarray(tokens)
    start = jnp.asarray(start, jnp.int32).reshape(b)
    lengths = jnp.asarray(lengths, jnp.int32).reshape(b)
    st = _Step(cfg, cache, start, lengths, t)
    if write_from is not None:
        st.cache_write = st.pos >= jnp.asarray(write_from, jnp.int32).reshape(b)[:, None]
    new: Cache = dict(cache)
    new["win_pos"] = st.new_win_pos
    rows = None
    if cfg.engram_layer_ids:
        table_rows, live, new["engram_hist"] = _engram_rows(params, cfg, cache, tokens, st)
        rows = (table_rows, live)

    def attention(layer, h, state):
        new, shared = dict(state[0]), dict(state[1])
        out = _attention(h, params, layer, cfg, cache, new, st, shared)
        return out, (new, shared)

    h, (new, _), streams = decoder_layers(
        params, cfg, tokens, attention, (new, {}), engram_rows=rows, capture=layers, mesh=mesh
    )
    return L.lm_head(params, h), new, streams


def _check_step(params, cfg: ModelConfig, cache: Cache, tokens, start, lengths, write_from) -> None:
    """`forward_step`'s arguments: token ids, the cache's batch, and (where concrete) start >= 0
    where the row's cache ends (unless a ``write_from`` replay), lengths in 0..T and every
    position inside ``max_seq_len`` and the cache's rows."""
    where = "model.forward_step"
    check_token_ids(where, "tokens", tokens, cfg.vocab_size, ndim=2, lengths=lengths)
    check_model_params(where, params, cfg)
    b, t = np.shape(tokens)
    if np.shape(cache.get("win_pos", ()))[:1] != (b,):
        raise ValueError(
            f"{where}: the cache holds {np.shape(cache.get('win_pos', ()))[:1]} sequences, tokens "
            f"{b} (init_cache(cfg, batch={b}, max_len))"
        )
    first, real = concrete(start), concrete(lengths)
    if first is None or real is None:
        return
    first = np.broadcast_to(np.reshape(first, -1), (b,))
    real = np.broadcast_to(np.reshape(real, -1), (b,))
    if (first < 0).any() or (real < 0).any() or (real > t).any():
        raise ValueError(
            f"{where}: start={first.tolist()} must be >= 0 and lengths={real.tolist()} in 0..{t}"
        )
    held = concrete(cache["win_pos"]) if write_from is None else None  # a replay rewinds
    if held is not None:  # the ring holds each row's latest positions (-1: none yet)
        latest = held.max(axis=1)
        for row in np.flatnonzero((real > 0) & (latest != first - 1)):
            raise ValueError(
                f"{where}: row {row} starts at position {first[row]}, but its cache ends at "
                f"position {latest[row]}: start must be {latest[row] + 1} (rows continue "
                "exactly where their cache ends)"
            )
    end = first + real  # [B] the first position after each row's chunk
    check_positions(where, int(end.max()) - 1, cfg, "the chunk")
    for info in cfg.plan:
        rows = cache.get(f"comp.{info.layer}")
        if info.role is Role.FULL and rows is not None:
            held = rows.shape[1] * info.ratio
            if (end // info.ratio > rows.shape[1]).any():
                raise ValueError(
                    f"{where}: the chunk ends at position {int(end.max())}, past the cache's "
                    f"{held} positions (init_cache's max_len)"
                )
