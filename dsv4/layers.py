"""Building blocks shared by every forward path (reference, dense-cache incremental, paged).

Each function computes one piece of `docs/model.md#the-forward-math` on arrays with a token axis
and knows nothing about caches. Numerics follow the official reference: the activation dtype is
the dtype of the embedding; RMSNorm, rotary embedding, hyper-connection mixing, routing and the
SwiGLU interior run in fp32 and cast back; with ``cfg.quant_sim`` the activations entering an
fp8 or fp4 GEMM are fake-quantised to fp8 (power-of-two scales per ``fp8_block_size``).

A weight is read as ``params[name].astype(dtype)`` (after indexing its leading expert axis, if
any), never reshaped or used before that cast: a `dsv4.formats.QuantisedWeight` (fp8 / FP4
weights kept in their released bytes) dequantises there, so every path runs the same code on
dequantised and on released params.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsv4.config import ModelConfig, rope_inv_freq
from dsv4.expert_parallel import ambient_expert_mesh, routed_experts, swiglu
from dsv4.params import quantised_weights
from dsv4.quant import fp4_qdq_e4m3, fp4_qdq_pow2, fp8_qdq

Params = dict[str, jax.Array]

__all__ = [
    "apply_rope",
    "attention_output",
    "embed",
    "hc_mixes",
    "hc_post",
    "hc_pre",
    "head",
    "linear",
    "moe",
    "rms_norm",
    "rope_tables",
    "swiglu",
]


@functools.lru_cache(maxsize=64)
def _quantised(cfg: ModelConfig) -> frozenset[str]:
    return quantised_weights(cfg)


def linear(x: jax.Array, params: Params, name: str, cfg: ModelConfig) -> jax.Array:
    """``x @ W.T`` for the weight ``name`` (shape [out, in]); fp32 accumulation, output in x's
    dtype. Under ``quant_sim`` a quantised weight's input is fp8-QDQ'd per block first."""
    w = params[name]
    if cfg.quant_sim and name in _quantised(cfg):
        x = fp8_qdq(x, cfg.fp8_block_size)
    y = jnp.einsum("...i,oi->...o", x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * xf).astype(x.dtype)


# -- rotary embedding --------------------------------------------------------------------------


def rope_tables(cfg: ModelConfig, ratio: int, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape positions.shape + [rope_head_dim / 2] for a layer of this ratio
    (plain table for ratio 0, YaRN with the compress theta otherwise)."""
    inv = jnp.asarray(np.asarray(rope_inv_freq(cfg, ratio), np.float32))
    angle = positions.astype(jnp.float32)[..., None] * inv
    return jnp.cos(angle), jnp.sin(angle)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, *, inverse: bool = False) -> jax.Array:
    """Rotate the last ``2 * cos.shape[-1]`` dims of x as interleaved (even, odd) pairs.

    ``cos``/``sin`` broadcast against x's leading axes (insert head axes as needed)."""
    r = 2 * cos.shape[-1]
    head, tail = x[..., :-r], x[..., -r:]
    t = tail.astype(jnp.float32).reshape(*tail.shape[:-1], r // 2, 2)
    x0, x1 = t[..., 0], t[..., 1]
    if inverse:
        sin = -sin
    y0 = x0 * cos - x1 * sin
    y1 = x0 * sin + x1 * cos
    rot = jnp.stack([y0, y1], axis=-1).reshape(tail.shape).astype(x.dtype)
    return jnp.concatenate([head, rot], axis=-1)


# -- hyper-connections ------------------------------------------------------------------------


def hc_mixes(
    x: jax.Array, params: Params, prefix: str, cfg: ModelConfig
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(pre [.., hc], post [.., hc], comb [.., hc, hc]) from the stream x [.., hc, dim].

    comb[i, j] mixes copy i into copy j and is projected onto the doubly stochastic matrices by
    Sinkhorn iterations (fp32 throughout)."""
    hc = cfg.hc_mult
    fn = params[prefix + "_fn"].astype(jnp.float32)
    base = params[prefix + "_base"].astype(jnp.float32)
    scale = params[prefix + "_scale"].astype(jnp.float32)
    v = x.astype(jnp.float32).reshape(*x.shape[:-2], hc * x.shape[-1])
    rs = jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + cfg.norm_eps)
    # the projection to hc * (2 + hc) mixes (24) written as a multiply-and-reduce, not a
    # matmul: XLA fuses it with the norm, where XLA:CPU's matmul library took several times
    # longer on a decode batch (18 % of generate's whole batch-8 step, tiny_v41)
    m = jnp.sum(v[..., None, :] * fn, axis=-1) * rs
    eps = cfg.hc_eps
    pre = jax.nn.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2.0 * jax.nn.sigmoid(m[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = (m[..., 2 * hc :] * scale[2] + base[2 * hc :]).reshape(*m.shape[:-1], hc, hc)
    comb = jnp.exp(comb - jnp.max(comb, axis=-1, keepdims=True))
    comb = comb / jnp.sum(comb, axis=-1, keepdims=True) + eps
    comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)

    def sinkhorn_round(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    # a loop, not an unrolled chain: same operations, far less to compile
    comb = jax.lax.fori_loop(0, cfg.hc_sinkhorn_iters - 1, sinkhorn_round, comb)
    return pre, post, comb


def hc_pre(x: jax.Array, pre: jax.Array) -> jax.Array:
    """Collapse the copies: sum_c pre_c x_c (fp32 accumulation)."""
    return jnp.sum(pre[..., None] * x.astype(jnp.float32), axis=-2).astype(x.dtype)


def hc_post(y: jax.Array, residual: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
    """Expand: copy j = post_j y + sum_i comb[i, j] residual_i.

    The sum over the hc_mult (4) copies is written out as multiply-adds, not as a matmul: a
    [hc, hc] x [hc, dim] product per token is a batch of tiny matmuls, which XLA:CPU runs one
    per token (at batch 8 it cost several times the rest of the mixing)."""
    r = residual.astype(jnp.float32)
    mixed = post[..., None] * y[..., None, :].astype(jnp.float32)
    for i in range(r.shape[-2]):
        mixed = mixed + comb[..., i, :, None] * r[..., i, None, :]
    return mixed.astype(y.dtype)


# -- embedding, head ---------------------------------------------------------------------------


def embed(params: Params, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Token embedding replicated into hc_mult copies: [.., hc, dim]."""
    h = jnp.take(params["embed.weight"], tokens, axis=0)
    return jnp.broadcast_to(h[..., None, :], (*h.shape[:-1], cfg.hc_mult, h.shape[-1]))


def head(params: Params, x: jax.Array, pre: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Final collapse with the last FFN's pre-mix, norm, and the fp32 LM head."""
    return lm_head(params, final_hidden(params, x, pre, cfg))


def final_hidden(params: Params, x: jax.Array, pre: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The LM head's input [.., dim]: the streams collapsed with the last pre-mix, normed."""
    return rms_norm(hc_pre(x, pre), params["norm.weight"], cfg.norm_eps)


def lm_head(params: Params, h: jax.Array) -> jax.Array:
    """fp32 logits [.., vocab] of `final_hidden` states h [.., dim]."""
    return jnp.einsum(
        "...d,vd->...v",
        h.astype(jnp.float32),
        params["head.weight"].astype(jnp.float32),
        preferred_element_type=jnp.float32,
    )


# -- attention output projection ----------------------------------------------------------------


def attention_output(
    o: jax.Array, cos: jax.Array, sin: jax.Array, params: Params, prefix: str, cfg: ModelConfig
) -> jax.Array:
    """Inverse rope at the query position, grouped low-rank ``wo_a``, then ``wo_b``.

    o: [.., H, head_dim] in the activation dtype; cos/sin: [.., rope/2]."""
    o = apply_rope(o, cos[..., None, :], sin[..., None, :], inverse=True)
    g = cfg.o_groups
    o = o.reshape(*o.shape[:-2], g, -1)
    wo_a = params[prefix + "wo_a.weight"].astype(o.dtype).reshape(g, cfg.o_lora_rank, -1)
    z = jnp.einsum("...gd,grd->...gr", o, wo_a, preferred_element_type=jnp.float32)
    z = z.astype(o.dtype).reshape(*z.shape[:-2], g * cfg.o_lora_rank)
    return linear(z, params, prefix + "wo_b.weight", cfg)


# -- MoE -----------------------------------------------------------------------------------------


_swiglu = swiglu  # the old private name, still read by dsv4.train


def route(x: jax.Array, params: Params, prefix: str, cfg: ModelConfig):
    """(weights [.., k] fp32, expert ids [.., k]) of the sqrt-softplus router."""
    logits = jnp.einsum(
        "...d,ed->...e",
        x.astype(jnp.float32),
        params[prefix + "gate.weight"].astype(jnp.float32),
        preferred_element_type=jnp.float32,
    )
    scores = jnp.sqrt(jax.nn.softplus(logits / cfg.gate_temp))
    biased = scores + params[prefix + "gate.bias"].astype(jnp.float32)
    _, ids = jax.lax.top_k(biased, cfg.n_activated_experts)
    w = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.norm_topk_prob and cfg.n_activated_experts > 1:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return w * cfg.route_scale, ids


def _all_experts(x, dense_w, w1, w2, w3, cfg: ModelConfig, *, quant: bool) -> jax.Array:
    """sum_e dense_w[:, e] * expert_e(x), f32 [n, dim], for x [n, dim] (activation dtype),
    dense_w f32 [n, e] (zero where a token does not route), w1 / w3 [e, inter, dim] and
    w2 [e, dim, inter].

    The weights are the left operands of the matmuls, read as stored ([e * inter, dim], and
    [dim, inter] per expert), the tokens the right ones. With the tokens on the left, XLA:CPU
    copies every expert's weights into another layout on each call, which made this branch
    (taken from n * k > e tokens: batched decode) cost several times the gather branch."""
    dt = x.dtype
    e, inter, dim = w1.shape

    def up(w):  # [e, inter, n]
        flat = w.astype(dt).reshape(e * inter, dim)
        y = jnp.einsum("od,nd->on", flat, x, preferred_element_type=jnp.float32)
        return y.reshape(e, inter, -1).astype(dt)

    act = (dense_w.T[:, None, :] * swiglu(up(w1), up(w3), cfg.swiglu_limit)).astype(dt)
    if quant:  # fp8 blocks run along inter
        act = jnp.swapaxes(fp8_qdq(jnp.swapaxes(act, 1, 2), cfg.fp8_block_size), 1, 2)
    if dt == jnp.float32:
        return jnp.einsum("edi,ein->nd", w2.astype(dt), act, preferred_element_type=jnp.float32)
    out = jnp.einsum("edi,ein->edn", w2.astype(dt), act, preferred_element_type=jnp.float32)
    return jnp.sum(out.astype(dt).astype(jnp.float32), axis=0).T


def moe(x: jax.Array, params: Params, prefix: str, cfg: ModelConfig) -> jax.Array:
    """Routed experts (top-k) plus the shared expert, for x [.., dim]."""
    shape = x.shape
    xf = x.reshape(-1, shape[-1])
    n = xf.shape[0]
    weights, ids = route(xf, params, prefix, cfg)
    k, e = cfg.n_activated_experts, cfg.n_routed_experts
    w1 = params[prefix + "experts.w1.weight"]
    w2 = params[prefix + "experts.w2.weight"]
    w3 = params[prefix + "experts.w3.weight"]
    quant = cfg.quant_sim and (prefix + "experts.w1.weight") in _quantised(cfg)
    xq = fp8_qdq(xf, cfg.fp8_block_size) if quant else xf
    dt = x.dtype
    mesh = ambient_expert_mesh(cfg)
    if mesh is not None:
        # an expert-parallel mesh: tokens travel to their experts' devices and back. Weights
        # kept in their released formats are dequantised whole (each device its experts); the
        # barrier makes that wait for this layer's input. Without it XLA:GPU ran many layers'
        # dequantisations early: the H100 compile of a 12-layer released-width step held
        # 38.3 GiB of temporaries, 7.5 GiB with it (`dsv4.compiled_step`).
        ws = (w1, w2, w3)
        if not all(isinstance(w, jax.Array) for w in ws):
            xq, ws = jax.lax.optimization_barrier((xq, ws))
        ws = tuple(w.astype(dt) for w in ws)
        y = routed_experts(xq, weights, ids, *ws, cfg, mesh, quant=quant)
    elif n * k <= e:
        # few tokens: gather each token's selected experts
        g = jnp.einsum("nd,nkid->nki", xq, w1[ids].astype(dt), preferred_element_type=jnp.float32)
        u = jnp.einsum("nd,nkid->nki", xq, w3[ids].astype(dt), preferred_element_type=jnp.float32)
        act = (weights[..., None] * swiglu(g.astype(dt), u.astype(dt), cfg.swiglu_limit)).astype(dt)
        if quant:
            act = fp8_qdq(act, cfg.fp8_block_size)
        out = jnp.einsum(
            "nki,nkdi->nkd", act, w2[ids].astype(dt), preferred_element_type=jnp.float32
        )
        y = jnp.sum(out.astype(dt).astype(jnp.float32), axis=1)
    else:
        # many tokens: every expert on every token, combined by the (mostly zero) routing weights
        dense_w = jnp.zeros((n, e), jnp.float32).at[jnp.arange(n)[:, None], ids].set(weights)
        y = _all_experts(xq, dense_w, w1, w2, w3, cfg, quant=quant)
    s = prefix + "shared_experts."
    sg = linear(xf, params, s + "w1.weight", cfg)
    su = linear(xf, params, s + "w3.weight", cfg)
    sy = linear(swiglu(sg, su, cfg.swiglu_limit).astype(dt), params, s + "w2.weight", cfg)
    y = y + sy.astype(jnp.float32)
    return y.astype(dt).reshape(shape)


# -- attention projections shared by every path ----------------------------------------------


def query_and_latent(
    x: jax.Array, params: Params, a: str, cfg: ModelConfig, cos, sin, *, qdq_latent: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(c_q, q [.., H, head_dim], window latent [.., head_dim]) of normed inputs x [.., dim]:
    the query path (no per-head q norm in V4.1) and the K = V window latent, both rotated at the
    token positions of ``cos``/``sin`` [.., rope/2]; the latent fp8-QDQ'd when ``qdq_latent``."""
    lead = x.shape[:-1]
    qr = rms_norm(
        linear(x, params, a + "wq_a.weight", cfg), params[a + "q_norm.weight"], cfg.norm_eps
    )
    q = linear(qr, params, a + "wq_b.weight", cfg).reshape(*lead, cfg.n_heads, cfg.head_dim)
    q = apply_rope(q, cos[..., None, :], sin[..., None, :])
    kv = rms_norm(
        linear(x, params, a + "wkv.weight", cfg), params[a + "kv_norm.weight"], cfg.norm_eps
    )
    kv = apply_rope(kv, cos, sin)
    if qdq_latent:
        kv = fp8_qdq(kv, 32)
    return qr, q, kv


def index_query(x, qr, params: Params, a: str, cfg: ModelConfig, cos, sin):
    """(index queries [.., IH, index_head_dim], head weights [.., IH]) of an index source: the
    queries rotated at the token positions (FP4-QDQ'd under quant_sim), the weights with the
    1/sqrt(head_dim * heads) scale folded in."""
    ih, ihd = cfg.index_n_heads, cfg.index_head_dim
    qi = linear(qr, params, a + "indexer.wq_b.weight", cfg).reshape(*qr.shape[:-1], ih, ihd)
    qi = apply_rope(qi, cos[..., None, :], sin[..., None, :])
    if cfg.quant_sim:
        qi = fp4_qdq_pow2(qi, 32)
    w = linear(x, params, a + "indexer.weights_proj.weight", cfg) * (ihd**-0.5 * ih**-0.5)
    return qi, w


def key_and_entry(latent, params: Params, a: str, cfg: ModelConfig, gcos, gsin, *, qdq_key: bool,
                  qdq_entry: bool):  # fmt: skip
    """(index key, compressed entry) of pre-rope compressor latents, both rotated at their
    group's first position (``gcos``/``gsin``): the key ``k_norm(wk latent)``, FP4-QDQ'd per 32
    with power-of-two scales when ``qdq_key``; the entry the latent itself, FP4-QDQ'd per 16
    with e4m3 scales when ``qdq_entry``."""
    k = rms_norm(
        linear(latent, params, a + "indexer.wk.weight", cfg),
        params[a + "indexer.k_norm.weight"],
        cfg.norm_eps,
    )
    k = apply_rope(k, gcos, gsin)
    c = apply_rope(latent, gcos, gsin)
    if qdq_key:
        k = fp4_qdq_pow2(k, 32)
    if qdq_entry:
        c = fp4_qdq_e4m3(c, 16)
    return k, c
