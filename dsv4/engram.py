"""Engram (`docs/model.md#engram`) on device: n-gram row ids, the table lookup, the gate.

An Engram layer adds, before its block, a gated value to every copy of the residual stream. The
value and one key per copy come from a linear map (``wkv``) of table rows fetched by hashed
n-grams of the token and the ``max_ngram_size - 1`` tokens before it. This module computes all of
it inside jit, so every path (the reference, the dense-cache steps, `generate`, the paged step)
runs the same code:

* compressed ids: ``params["engram.token_map"]`` int32[vocab] maps a token id to its compressed id,
  or to `DEAD` (-1) for a token outside the tokenizer's vocabulary (it takes part in no n-gram
  and its gate is 0, as image tokens in DeepSeek's model). The map is built on the host from the
  tokenizer (`dsv4.engram_hash`), stored in the params, and is not a checkpoint tensor;
* look-backs: ``look`` int32[..., max_ngram_size], entry k the compressed id of position p - k,
  `DEAD` for a position before the sequence start. Callers assemble it from their own history
  (the chunk itself plus the ids before it: a ring in the dense cache, the request's tokens in
  the engine);
* row ids: DeepSeek's hash needs 64-bit integers (odd 63-bit multipliers, XOR, a modulo per
  (n, head) prime). JAX runs 32-bit integers unless x64 is switched on for the whole process, so
  the 64-bit products, XORs and remainders are computed exactly from 32-bit halves
  (`_mul_wide`, `_mod_u64`); `dsv4.engram_hash` is the host transcription in numpy int64 that the
  tests compare it with;
* the update: rows dequantised (params hold them as floats) and cast to the compute dtype,
  flattened, ``wkv`` -> [hc keys | value]; per copy ``delta = <x_c, q_c k_c K_c> rrms(x_c)
  rrms(K_c) / sqrt(dim)`` and ``gate = sigmoid(sign(delta) sqrt(max(|delta|, 1e-6)))``;
  ``x_c + gate_c v`` in fp32, cast back.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dsv4 import layers as L
from dsv4.config import ModelConfig
from dsv4.engram_hash import DEAD, EngramHashing
from dsv4.formats import HostTable, QuantisedWeight

__all__ = [
    "DEAD",
    "TOKEN_MAP",
    "HostTable",
    "apply",
    "compressed_ids",
    "hashing",
    "lookback",
    "row_ids",
    "table_rows",
]

TOKEN_MAP = "engram.token_map"  # params key of the compressed token map (not in checkpoints)
_GATE_FLOOR = 1e-6


@functools.lru_cache(maxsize=32)
def _hashing(key: tuple) -> EngramHashing:
    layer_ids, max_ngram, heads, vocab, compressed = key
    # pad_id is data (the token map's image of engram_pad_id), supplied on device: 0 here
    return EngramHashing.build(layer_ids=layer_ids, max_ngram_size=max_ngram, n_heads=heads,
                               engram_vocab_size=vocab, compressed_vocab_size=compressed,
                               pad_id=0)  # fmt: skip


def hashing(cfg: ModelConfig) -> EngramHashing:
    """The host hashing constants of ``cfg`` (primes, offsets, multipliers; pad id 0)."""
    if not cfg.engram_layer_ids:
        raise ValueError("this config has no Engram layers (engram_layer_ids is empty)")
    return _hashing(
        (
            cfg.engram_layer_ids,
            cfg.engram_max_ngram_size,
            cfg.engram_n_heads,
            cfg.engram_vocab_size,
            cfg.engram_compressed_vocab_size,
        )
    )


def compressed_ids(params, tokens: jax.Array) -> jax.Array:
    """int32[...] compressed id (or `DEAD`) of every token id in ``tokens`` int32[...]."""
    return jnp.take(params[TOKEN_MAP], tokens, axis=0, mode="clip")


def lookback(cids: jax.Array, prev: jax.Array, pos: jax.Array, max_ngram: int) -> jax.Array:
    """Look-backs int32[B, T, max_ngram] of a chunk.

    ``cids`` int32[B, T] compressed ids of the chunk (row b holds positions pos[b, 0] ..);
    ``prev`` int32[B, max_ngram - 1] the ids of the positions just before the chunk, entry j for
    position pos[b, 0] - 1 - j (any value where that position is before 0); ``pos`` int32[B, T].
    """
    t = cids.shape[1]
    cols = []
    for k in range(max_ngram):
        idx = jnp.arange(t) - k  # chunk index of position p - k
        in_chunk = idx >= 0
        from_chunk = cids[:, jnp.maximum(idx, 0)]
        from_prev = prev[:, jnp.clip(-idx - 1, 0, max(max_ngram - 2, 0))] if k else from_chunk
        src = jnp.where(in_chunk[None, :], from_chunk, from_prev)
        cols.append(jnp.where(pos - k >= 0, src, DEAD))
    return jnp.stack(cols, axis=-1)


# -- exact 64-bit arithmetic from uint32 halves ----------------------------------------------


def _mul_wide(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(hi, lo) uint32 of the 64-bit product of uint32 a and b (16-bit limbs)."""
    m16 = jnp.uint32(0xFFFF)
    a0, a1 = a & m16, a >> 16
    b0, b1 = b & m16, b >> 16
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = p01 + p10
    mid_carry = (mid < p01).astype(jnp.uint32)
    lo = p00 + (mid << 16)
    lo_carry = (lo < p00).astype(jnp.uint32)
    hi = p11 + (mid >> 16) + (mid_carry << 16) + lo_carry
    return hi, lo


def _mod_u64(hi: jax.Array, lo: jax.Array, p: jax.Array) -> jax.Array:
    """(hi * 2**32 + lo) mod p for uint32 halves and uint32 p < 2**28 (Horner over the 8
    nibbles of lo: every intermediate stays below 2**32)."""
    r = hi % p
    for shift in range(28, -4, -4):
        r = (r * jnp.uint32(16) + ((lo >> shift) & jnp.uint32(0xF))) % p
    return r


def _split(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    v = np.asarray(values, np.int64).astype(np.uint64)
    return (v >> np.uint64(32)).astype(np.uint32), (v & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def row_ids(cfg: ModelConfig, look: jax.Array, pad: jax.Array) -> jax.Array:
    """int32[..., engram layers, columns]: the table rows of every position.

    ``look`` int32[..., max_ngram_size] (see `lookback`); ``pad`` int32[] the compressed id of
    ``cfg.engram_pad_id``. From the first look-back that is `DEAD` on, it and every longer one
    read ``pad`` (the blocking is cumulative)."""
    h = hashing(cfg)
    n = cfg.engram_max_ngram_size
    dead = jnp.cumsum((look == DEAD).astype(jnp.int32), axis=-1) > 0
    tok = jnp.where(dead, pad, look).astype(jnp.uint32)  # [..., n]
    m_hi, m_lo = _split(h.multipliers)  # [layers, n]
    primes = h.primes.reshape(len(h.layer_ids), n - 1, h.n_heads).astype(np.uint32)
    per_layer = []
    for li in range(len(h.layer_ids)):
        roll_hi = roll_lo = None
        cols = []
        for k in range(n):
            c = tok[..., k]
            lo_hi, lo = _mul_wide(c, jnp.uint32(m_lo[li, k]))
            hi = jnp.uint32(m_hi[li, k]) * c + lo_hi  # the product is < 2**63: no wrap
            if k == 0:
                roll_hi, roll_lo = hi, lo
                continue
            roll_hi, roll_lo = roll_hi ^ hi, roll_lo ^ lo
            p = jnp.asarray(primes[li, k - 1])  # [heads]
            cols.append(_mod_u64(roll_hi[..., None], roll_lo[..., None], p))
        rows = jnp.concatenate(cols, axis=-1).astype(jnp.int32)
        per_layer.append(rows + jnp.asarray(h.offsets[li], jnp.int32))
    return jnp.stack(per_layer, axis=-2)


# -- the tables -------------------------------------------------------------------------------


def table_rows(params, layer: int, rows: jax.Array) -> jax.Array:
    """Rows ``rows`` int32[..., columns] of layer ``layer``'s table: [..., columns, head_dim]
    (from the device array in the params, or from a `HostTable` through the host; a
    `dsv4.formats.QuantisedWeight` table gathers its codes and scales, then dequantises)."""
    table = params[f"layers.{layer}.engram.embed.weight"]
    if isinstance(table, QuantisedWeight):
        return table.take(rows, mode="clip").astype(table.dtype)
    if isinstance(table, HostTable):
        out = jax.ShapeDtypeStruct((*rows.shape, table.shape[1]), ml_dtypes.bfloat16)
        return jax.pure_callback(table.gather, out, rows, vmap_method="sequential")
    return jnp.take(table, rows, axis=0, mode="clip")


# -- the update -------------------------------------------------------------------------------


def apply(
    x: jax.Array,
    params,
    layer: int,
    cfg: ModelConfig,
    values: jax.Array,
    live: jax.Array,
) -> jax.Array:
    """The stream after layer ``layer``'s Engram update.

    x [B, T, hc, dim] the residual stream; ``values`` [B, T, columns, head_dim] the layer's table
    rows of every token (dequantised); ``live`` bool[B, T], False where the gate is shut (a
    `DEAD` token, padding)."""
    e = f"layers.{layer}.engram."
    hc, d = cfg.hc_mult, cfg.dim
    # the reference dequantises rows in fp32 and hands them on in bf16; keep the compute dtype
    flat = values.astype(x.dtype).reshape(*values.shape[:-2], -1)
    kv = L.linear(flat, params, e + "wkv.weight", cfg)
    key = kv[..., : hc * d].astype(jnp.float32).reshape(*kv.shape[:-1], hc, d)
    value = kv[..., hc * d :].astype(jnp.float32)
    weight = params[e + "q_weight"].astype(jnp.float32) * params[e + "k_weight"].astype(jnp.float32)
    h = x.astype(jnp.float32)
    eps = cfg.norm_eps
    rstd = jax.lax.rsqrt(jnp.mean(h * h, axis=-1) + eps) * jax.lax.rsqrt(
        jnp.mean(key * key, axis=-1) + eps
    )
    dot = jnp.sum(h * weight * key, axis=-1) * rstd * d**-0.5
    gate = jax.nn.sigmoid(jnp.copysign(jnp.sqrt(jnp.maximum(jnp.abs(dot), _GATE_FLOOR)), dot))
    gate = jnp.where(live[..., None], gate, 0.0)
    return (h + gate[..., None] * value[..., None, :]).astype(x.dtype)
