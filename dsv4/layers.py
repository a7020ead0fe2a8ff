"""Building blocks shared by every forward path (reference, dense cache, paged step, training),
which `dsv4.block` puts together into decoder layers.

Each function computes one piece of `docs/model.md#the-forward-math` on arrays with a token axis
and knows nothing about caches; where training's thousands of tokens per call want another
layout, the function takes a keyword for it (``many_tokens``, ``tile``), same math. Numerics
follow the official reference: the activation dtype is
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
    "NEG_INF",
    "apply_rope",
    "attention_output",
    "embed",
    "final_hidden",
    "group_latents",
    "hc_mixes",
    "hc_post",
    "hc_pre",
    "head",
    "index_query",
    "index_scores",
    "key_and_entry",
    "linear",
    "lm_head",
    "moe",
    "query_and_latent",
    "rms_norm",
    "rope_tables",
    "route",
    "select_candidate_blocks",
    "select_entries",
    "sink_attention",
    "sink_softmax",
    "swiglu",
    "topk_indices",
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
    x: jax.Array, params: Params, prefix: str, cfg: ModelConfig, *, many_tokens: bool = False
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(pre [.., hc], post [.., hc], comb [.., hc, hc]) from the stream x [.., hc, dim].

    comb[i, j] mixes copy i into copy j and is projected onto the doubly stochastic matrices by
    Sinkhorn iterations (fp32 throughout). ``many_tokens`` (training: thousands of tokens per
    call) picks the layout that suits them: the projection as a matmul and the Sinkhorn sums over
    comb laid out ``[hc, hc, tokens]`` (whole vectors of tokens added, not 4-element minor axes:
    about ten times faster forward and backward on a CPU); the same math."""
    hc = cfg.hc_mult
    fn = params[prefix + "_fn"].astype(jnp.float32)
    base = params[prefix + "_base"].astype(jnp.float32)
    scale = params[prefix + "_scale"].astype(jnp.float32)
    v = x.astype(jnp.float32).reshape(*x.shape[:-2], hc * x.shape[-1])
    rs = jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + cfg.norm_eps)
    if many_tokens:
        m = jnp.einsum("...k,mk->...m", v, fn, preferred_element_type=jnp.float32) * rs
    else:
        # the projection to hc * (2 + hc) mixes (24) written as a multiply-and-reduce, not a
        # matmul: XLA fuses it with the norm, where XLA:CPU's matmul library took several times
        # longer on a decode batch (18 % of generate's whole batch-8 step, tiny_v41)
        m = jnp.sum(v[..., None, :] * fn, axis=-1) * rs
    eps = cfg.hc_eps
    pre = jax.nn.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2.0 * jax.nn.sigmoid(m[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = (m[..., 2 * hc :] * scale[2] + base[2 * hc :]).reshape(*m.shape[:-1], hc, hc)
    # rows and columns of comb: axes (-1, -2), or (1, 0) in the many-token layout [i, j, ..]
    row, col = (1, 0) if many_tokens else (-1, -2)
    if many_tokens:
        comb = jnp.moveaxis(comb, (-2, -1), (0, 1))
    comb = jnp.exp(comb - jnp.max(comb, axis=row, keepdims=True))
    comb = comb / jnp.sum(comb, axis=row, keepdims=True) + eps
    comb = comb / (jnp.sum(comb, axis=col, keepdims=True) + eps)

    def sinkhorn_round(_, c):
        c = c / (jnp.sum(c, axis=row, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=col, keepdims=True) + eps)

    # a loop, not an unrolled chain: same operations, far less to compile
    comb = jax.lax.fori_loop(0, cfg.hc_sinkhorn_iters - 1, sinkhorn_round, comb)
    if many_tokens:
        comb = jnp.moveaxis(comb, (0, 1), (-2, -1))
    return pre, post, comb


def hc_pre(x: jax.Array, pre: jax.Array) -> jax.Array:
    """Collapse the copies: sum_c pre_c x_c (fp32 accumulation)."""
    return jnp.sum(pre[..., None] * x.astype(jnp.float32), axis=-2).astype(x.dtype)


def hc_post(
    y: jax.Array,
    residual: jax.Array,
    post: jax.Array,
    comb: jax.Array,
    *,
    many_tokens: bool = False,
) -> jax.Array:
    """Expand: copy j = post_j y + sum_i comb[i, j] residual_i.

    The sum over the hc_mult (4) copies is written out as multiply-adds, not as a matmul: a
    [hc, hc] x [hc, dim] product per token is a batch of tiny matmuls, which XLA:CPU runs one
    per token (at batch 8 it cost several times the rest of the mixing). With ``many_tokens``
    (training) it is one einsum: faster forward and backward over thousands of tokens."""
    r = residual.astype(jnp.float32)
    mixed = post[..., None] * y[..., None, :].astype(jnp.float32)
    if many_tokens:
        return (mixed + jnp.einsum("...ij,...id->...jd", comb, r)).astype(y.dtype)
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


def moe(
    x: jax.Array,
    params: Params,
    prefix: str,
    cfg: ModelConfig,
    *,
    tile: int | None = None,
    return_load: bool = False,
):
    """Routed experts (top-k) plus the shared expert, for x [.., dim]; with ``return_load``
    also the tokens routed to each expert, int32[n_routed_experts] (what balances the router in
    training). ``tile`` (training) runs each routed expert on its own tokens only, in tiles of
    that many rows (`_tiled_experts`); by default the expert-parallel mesh, gather (few tokens)
    or all-experts (many) branch below is taken."""
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
    mesh = ambient_expert_mesh(cfg) if tile is None else None
    if tile is not None:
        y = _tiled_experts(xq, weights, ids, w1, w2, w3, cfg, tile, quant=quant)
    elif mesh is not None:
        # an expert-parallel mesh: tokens travel to their experts' devices and back. Weights
        # kept in their released formats are dequantised whole (each device its experts); the
        # barrier makes that wait for this layer's input. Without it XLA:GPU ran many layers'
        # dequantisations early: the H100 compile of a 12-layer released-width step held
        # 38.3 GiB of temporaries, 7.5 GiB with it (`planner.compiled_step`).
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
    y = (y + sy.astype(jnp.float32)).astype(dt).reshape(shape)
    if return_load:
        return y, jnp.bincount(ids.reshape(-1), length=e).astype(jnp.int32)
    return y


def _tiled_experts(x, weights, ids, w1, w2, w3, cfg: ModelConfig, tile: int, *, quant: bool):
    """sum_k weights[:, k] * expert_{ids[:, k]}(x), f32 [n, dim], for x [n, dim], computing each
    expert on its own tokens only.

    The all-experts branch of `moe` does ``n_routed_experts / n_activated_experts`` times the
    work. Here the (token, expert) assignments are sorted by expert, each expert's run padded to
    a multiple of ``tile`` rows, and every tile multiplied by its expert's weights: the same
    sums, in another order, on at most ``n * k + n_routed_experts * (tile - 1)`` rows (what
    makes training's thousands of tokens per call fast)."""
    n, d = x.shape
    k, e = cfg.n_activated_experts, cfg.n_routed_experts
    a = n * k
    expert = ids.reshape(-1)  # [a]: assignment j = (token j // k, its (j % k)-th expert)
    order = jnp.argsort(expert, stable=True)
    counts = jnp.bincount(expert, length=e)
    padded = -(-counts // tile) * tile
    ends = jnp.cumsum(padded)
    run = expert[order]
    dest = (ends - padded)[run] + jnp.arange(a) - (jnp.cumsum(counts) - counts)[run]
    rows = -(-(a + e * (tile - 1)) // tile) * tile
    tiles = rows // tile
    slot = jnp.full((rows,), a, jnp.int32).at[dest].set(order.astype(jnp.int32))  # a = empty
    tok = slot // k  # n for an empty row: the zero row appended below
    dt = x.dtype
    xs = jnp.concatenate([x, jnp.zeros((1, d), dt)])[tok].reshape(tiles, tile, d)
    ws = jnp.concatenate([weights.reshape(-1), jnp.zeros((1,), jnp.float32)])[slot]
    te = jnp.minimum(jnp.searchsorted(ends, jnp.arange(tiles) * tile, side="right"), e - 1)
    f32 = jnp.float32

    def up(w):  # [tiles, tile, inter]
        return jnp.einsum("tsd,tid->tsi", xs, w[te].astype(dt), preferred_element_type=f32).astype(
            dt
        )

    act = (ws.reshape(tiles, tile, 1) * swiglu(up(w1), up(w3), cfg.swiglu_limit)).astype(dt)
    if quant:
        act = fp8_qdq(act, cfg.fp8_block_size)
    out = jnp.einsum("tsi,tdi->tsd", act, w2[te].astype(dt), preferred_element_type=f32)
    return jnp.zeros((n + 1, d), f32).at[tok].add(out.reshape(rows, d))[:n]


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


# -- compressed entries, sparse selection and the sink softmax -------------------------------

NEG_INF = -jnp.inf


def group_latents(x: jax.Array, params: Params, a: str, ratio: int, cfg: ModelConfig) -> jax.Array:
    """Pre-rope compressor latents of the complete groups of a whole sequence x [B, T, D]:
    [B, T // ratio, head_dim] (each group's rows mixed by their softmax-gated weights)."""
    b, t, _ = x.shape
    n = t // ratio
    if ratio == 1:
        z = linear(x, params, a + "compressor.wkv.weight", cfg)
    else:
        xf = x.astype(jnp.float32)[:, : n * ratio]
        kv = jnp.einsum("btd,od->bto", xf, params[a + "compressor.wkv.weight"].astype(jnp.float32))
        g = jnp.einsum("btd,od->bto", xf, params[a + "compressor.wgate.weight"].astype(jnp.float32))
        kv = kv.reshape(b, n, ratio, -1)
        g = jax.nn.softmax(g.reshape(b, n, ratio, -1), axis=2)
        z = jnp.sum(kv * g, axis=2).astype(x.dtype)
    return rms_norm(z, params[a + "compressor.norm.weight"], cfg.norm_eps)


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


def select_entries(
    scores: jax.Array, visible: jax.Array, info, cfg: ModelConfig, candidates: jax.Array | None
) -> tuple[jax.Array, jax.Array | None]:
    """(top-k entry ids [.., k], candidate mask) of an index source's scores [.., N]: the
    candidate source picks its candidate blocks (the mask it returns), a later index source
    keeps its picks inside ``candidates``; ``info`` is the layer's `cfg.plan` entry."""
    if info.is_candidate_source:
        candidates = select_candidate_blocks(
            scores, visible, cfg.candidate_topk_blocks, cfg.candidate_block_size
        )
    elif info.uses_candidates:
        scores = jnp.where(candidates, scores, NEG_INF)
    return topk_indices(scores, visible, cfg.index_topk), candidates


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


def sink_softmax(
    logits: jax.Array, mask: jax.Array, sink: jax.Array, scale: float, dtype
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(p, p for P.V, denominator) of one softmax per (token, head) over the unmasked logits
    f32 [B, T, H, K] (mask [B, T, K]) with the per-head sink [H] in the denominator only.

    As DeepSeek's attention kernel: the exponentials are taken against the largest unmasked
    logit; P.V reads them rounded to ``dtype`` (q's) when that is not f32 (bf16: the kernel's
    cast); the denominator [B, T, H, 1] sums them in f32."""
    logits = jnp.where(mask[:, :, None, :], logits * scale, NEG_INF)
    m = jnp.maximum(jnp.max(logits, axis=-1, keepdims=True), -1e30)
    p = jnp.exp(logits - m)
    denom = jnp.sum(p, axis=-1, keepdims=True) + jnp.exp(sink.astype(jnp.float32)[:, None] - m)
    pv = p.astype(dtype).astype(jnp.float32) if dtype != jnp.float32 else p
    return p, pv, denom


def sink_attention(
    q: jax.Array, keys: jax.Array, mask: jax.Array, sink: jax.Array, scale: float
) -> jax.Array:
    """Attention with K = V under `sink_softmax`: q [B, T, H, d], keys [B, T, K, d] or
    [B, K, d], mask [B, T, K]; out fp32 [B, T, H, d]."""
    if keys.ndim == 3:
        # keys no query may see could be anything (NaN in tests): keep them out of p @ V
        keys = jnp.where(jnp.any(mask, axis=1)[..., None], keys, 0)
        logits = jnp.einsum("bthd,bkd->bthk", q, keys, preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("bthd,btkd->bthk", q, keys, preferred_element_type=jnp.float32)
    _, p, denom = sink_softmax(logits, mask, sink, scale, q.dtype)
    if keys.ndim == 3:
        return jnp.einsum("bthk,bkd->bthd", p, keys.astype(jnp.float32)) / denom
    return jnp.einsum("bthk,btkd->bthd", p, keys.astype(jnp.float32)) / denom
