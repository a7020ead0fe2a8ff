"""The DSpark drafter (`dsv4.dspark`).

* the released ``mtp.*`` tensors, written out by hand from DeepSeek's V4.1-Flash
  ``inference/model.py`` (``DSparkBlock``, ``DSparkMarkovHead``, ``DSparkConfidenceHead`` and the
  backbone ``Block`` a stage inherits), against `dsv4.params.checkpoint_tensors`;
* the drafter against a float64 numpy transcription of the math (docs/model.md#dspark-drafter),
  written from the definitions without `dsv4.layers`;
* structural facts: the bidirectional block (slot 0 depends on the noise slots), the window of
  context positions, the Markov bias and confidence of slot i depending on the token *in* slot i,
  the targets being the streams *entering* their layers;
* the incremental form (`seed` / `step` over NaN-filled rings) equal to drafting from scratch at
  every step of ragged chunkings and token-by-token growth;
* clear errors for bad input.

Params are drawn with numpy from `dspark.param_specs` (the same init kinds as
`dsv4.params.init_params`, whose eager random draws would cost seconds here).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from released_tensors import BF16, E8M0, F8, block, experts

from dsv4 import dspark, reference
from dsv4.config import tiny_v41, v41_flash
from dsv4.params import abstract_params, checkpoint_tensors, param_specs

CFG = tiny_v41(
    n_mtp_layers=3,
    compress_ratios=(0, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
    dspark_block_size=3,
    dspark_target_layer_ids=(5, 6, 7),
    dspark_markov_rank=16,
    dspark_noise_token_id=500,  # prompts draw ids below 480, so the noise id is never in them
    dspark_n_routed_experts=8,
    dspark_n_activated_experts=2,
)
K = CFG.dspark_block_size
W = CFG.window_size
S = 24  # positions of the test sequences (three windows)
BUCKET = S  # chunk width of every seed / step call: one compile serves every chunk size
TOL = 1e-4


def numpy_params(cfg, seed: int = 0) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, spec in param_specs(cfg).items():
        z = rng.standard_normal(spec.shape)
        kind = spec.init
        if kind in ("linear", "hc_fn"):
            v = z / np.sqrt(spec.shape[-1])
        elif kind in ("embed", "normal"):
            v = z
        elif kind == "norm":
            v = 1.0 + 0.1 * z
        elif kind == "bias":
            v = 0.1 * z
        elif kind == "hc_base":
            v = 0.5 * z
        elif kind == "hc_scale":
            v = 0.5 + 0.5 * rng.uniform(size=spec.shape)
        else:
            v = np.zeros(spec.shape)
        out[name] = jnp.asarray(v, jnp.float32)
    return out


@pytest.fixture(scope="module")
def params():
    return numpy_params(CFG)


@pytest.fixture(scope="module")
def hidden():
    """Target hidden states [2, S, 3 * dim] (random: the drafter is tested apart from the
    backbone) and the tokens that open each position's draft block [2, S + 1]."""
    rng = np.random.default_rng(1)
    h = rng.standard_normal((2, S, 3 * CFG.dim)).astype(np.float32)
    toks = rng.integers(3, 480, (2, S + 1)).astype(np.int32)
    return h, toks


@functools.cache
def _scratch():
    return jax.jit(dspark.draft_from_hidden, static_argnums=1)


def scratch(params, h, next_token, lengths):
    """From-scratch drafts, hidden padded with NaN to S positions (one compile for all T)."""
    h = np.asarray(h, np.float32)
    pad = np.full((h.shape[0], S - h.shape[1], h.shape[2]), np.nan, np.float32)
    out = _scratch()(
        params,
        CFG,
        jnp.asarray(np.concatenate([h, pad], axis=1)),
        jnp.asarray(next_token, jnp.int32),
        lengths=jnp.asarray(lengths, jnp.int32),
    )
    return jax.tree.map(np.asarray, out)


# -- parameters and checkpoint names ----------------------------------------------------------------
# V4.1-Flash's 3 drafter stages: the released block with 128 experts of width 2304
# (`released_tensors.py`); the first stage adds the main projection, the last the heads
# (markov rank 256)

FIRST_STAGE = {
    "main_proj.weight": (F8, (5120, 15360)),
    "main_proj.scale": (E8M0, (160, 480)),
    "main_norm.weight": (BF16, (5120,)),
}
LAST_STAGE = {
    "norm.weight": (BF16, (5120,)),
    "markov_head.embed.weight": (BF16, (129280, 256)),
    "markov_head.head.weight": (BF16, (129280, 256)),
    "confidence_head.proj.weight": (BF16, (1, 5376)),
}


def released_mtp() -> dict[str, tuple[str, tuple[int, ...]]]:
    out = {}
    for i in range(3):
        extra = block(128) | experts(128)  # 128 drafter experts, 3 target layers
        if i == 0:
            extra |= FIRST_STAGE
        if i == 2:
            extra |= LAST_STAGE
        out |= {f"mtp.{i}.{k}": v for k, v in extra.items()}
    return out


def test_released_mtp_tensors():
    want = released_mtp()
    assert len(want) == 3 * (29 + 128 * 6) + 3 + 4
    got = {
        t.name: (t.dtype, tuple(t.shape))
        for t in checkpoint_tensors(v41_flash())
        if t.name.startswith("mtp.")
    }
    assert sorted(set(want) - set(got)) == []
    assert sorted(set(got) - set(want)) == []
    assert {k: got[k] for k in want if got[k] != want[k]} == {}


def test_abstract_params_hold_the_drafter():
    shapes = abstract_params(v41_flash())
    mtp = {k: v for k, v in shapes.items() if k.startswith("mtp.")}
    assert mtp["mtp.1.ffn.experts.w1.weight"].shape == (128, 2304, 5120)
    assert mtp["mtp.1.ffn.experts.w2.weight"].shape == (128, 5120, 2304)
    assert mtp["mtp.0.main_proj.weight"].shape == (5120, 15360)
    assert mtp["mtp.2.confidence_head.proj.weight"].shape == (1, 5376)
    assert {v.dtype for v in mtp.values()} == {jnp.dtype(jnp.float32)}
    n_values = sum(1 for k, (dt, _) in released_mtp().items() if dt != E8M0)
    assert len(mtp) == n_values - 3 * 128 * 3 + 3 * 3  # experts stacked: 3 tensors per stage
    # stage-specific heads only where DeepSeek's DSparkBlock builds them
    tiny = dspark.param_specs(CFG)
    assert "mtp.0.main_proj.weight" in tiny and "mtp.1.main_proj.weight" not in tiny
    assert tiny["mtp.0.main_proj.weight"].shape == (64, 3 * 64)
    heads = {k for k in tiny if k.endswith(("markov_head.embed.weight", ".0.norm.weight",
                                              ".1.norm.weight", ".2.norm.weight"))}  # fmt: skip
    assert heads == {"mtp.2.markov_head.embed.weight", "mtp.2.norm.weight"}


# -- a float64 numpy transcription ---------------------------------------------------------------


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, pos, inverse=False):
    """Rotate the last rope_head_dim dims of x [..., n, (H,) d] as adjacent complex pairs at the
    positions pos [n]."""
    r = CFG.rope_head_dim
    inv = 1.0 / CFG.rope_theta ** (np.arange(0, r, 2) / r)
    phase = np.exp(1j * np.outer(pos, inv) * (-1 if inverse else 1))  # [n, r/2]
    if x.ndim == 3:
        phase = phase[:, None, :]
    tail = x[..., -r:]
    z = (tail[..., 0::2] + 1j * tail[..., 1::2]) * phase
    out = x.copy()
    out[..., -r::2] = z.real
    out[..., -r + 1 :: 2] = z.imag
    return out


def _mixes(x, p, name):
    """pre [n, hc], post [n, hc], comb [n, hc, hc] of the stream x [n, hc, dim]."""
    hc, eps = CFG.hc_mult, CFG.hc_eps
    v = x.reshape(x.shape[0], -1)
    m = v @ p[name + "_fn"].T / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + CFG.norm_eps)
    s, b = p[name + "_scale"], p[name + "_base"]
    pre = 1 / (1 + np.exp(-(s[0] * m[:, :hc] + b[:hc]))) + eps
    post = 2 / (1 + np.exp(-(s[1] * m[:, hc : 2 * hc] + b[hc : 2 * hc])))
    c = (s[2] * m[:, 2 * hc :] + b[2 * hc :]).reshape(-1, hc, hc)
    c = np.exp(c - c.max(-1, keepdims=True))
    c = c / c.sum(-1, keepdims=True) + eps
    c = c / (c.sum(-2, keepdims=True) + eps)
    for _ in range(CFG.hc_sinkhorn_iters - 1):
        c = c / (c.sum(-1, keepdims=True) + eps)
        c = c / (c.sum(-2, keepdims=True) + eps)
    return pre, post, c


def _expand(y, x, post, comb):
    return post[..., None] * y[:, None, :] + np.einsum("nij,nid->njd", comb, x)


def _swiglu_ffn(h, w1, w2, w3):
    lim = CFG.swiglu_limit
    g = np.minimum(h @ w1.T, lim)
    u = np.clip(h @ w3.T, -lim, lim)
    return (g / (1 + np.exp(-g)) * u) @ w2.T


def _moe(h, p, f, margins):
    out = np.zeros_like(h)
    k = CFG.dspark_n_activated_experts
    for n in range(h.shape[0]):
        score = np.sqrt(np.log1p(np.exp(h[n] @ p[f + "gate.weight"].T)))
        biased = score + p[f + "gate.bias"]
        order = np.argsort(-biased, kind="stable")
        margins.append(biased[order[k - 1]] - biased[order[k]])
        sel = order[:k]
        wts = score[sel] / (score[sel].sum() + 1e-20) * CFG.route_scale
        for e, wt in zip(sel, wts, strict=True):
            w1, w2, w3 = (p[f + f"experts.{j}.weight"][e] for j in ("w1", "w2", "w3"))
            out[n] += wt * _swiglu_ffn(h[n : n + 1], w1, w2, w3)[0]
        s = f + "shared_experts."
        out[n] += _swiglu_ffn(h[n : n + 1], p[s + "w1.weight"], p[s + "w2.weight"],
                              p[s + "w3.weight"])[0]  # fmt: skip
    return out


def _attend(h, ctx_x, t, p, a):
    """One stage's attention for one sequence: block inputs h [K, dim] at positions t..t+K-1,
    context main_x rows ctx_x [n, dim] at positions t-n..t-1, every query sees every key."""
    eps, hd, nh, g = CFG.norm_eps, CFG.head_dim, CFG.n_heads, CFG.o_groups
    qpos = t + np.arange(K)
    ctx_keys = _rope(_rms(ctx_x @ p[a + "wkv.weight"].T, p[a + "kv_norm.weight"], eps),
                     np.arange(t - len(ctx_x), t))  # fmt: skip
    own = _rope(_rms(h @ p[a + "wkv.weight"].T, p[a + "kv_norm.weight"], eps), qpos)
    keys = np.concatenate([ctx_keys, own])
    q = _rms(h @ p[a + "wq_a.weight"].T, p[a + "q_norm.weight"], eps) @ p[a + "wq_b.weight"].T
    q = _rope(q.reshape(K, nh, hd), qpos)
    o = np.zeros((K, nh, hd))
    for i in range(K):
        for j in range(nh):
            logit = keys @ q[i, j] / np.sqrt(hd)
            sink = p[a + "attn_sink"][j]
            top = max(logit.max(), sink)
            e = np.exp(logit - top)
            o[i, j] = e @ keys / (e.sum() + np.exp(sink - top))
    o = _rope(o, qpos, inverse=True).reshape(K, g, -1)
    wo_a = p[a + "wo_a.weight"].reshape(g, CFG.o_lora_rank, -1)
    z = np.einsum("kgd,grd->kgr", o, wo_a).reshape(K, -1)
    return z @ p[a + "wo_b.weight"].T


def numpy_drafter(params, main_hidden, next_token, lengths):
    """(logits [B, K, V], tokens [B, K], confidence [B, K], MoE top-k margins) in float64."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    eps, hc, last = CFG.norm_eps, CFG.hc_mult, f"mtp.{CFG.n_mtp_layers - 1}."
    logits, tokens, conf, margins = [], [], [], []
    for b, t in enumerate(lengths):
        mh = np.asarray(main_hidden[b, :t], np.float64)[max(0, t - W) :]
        main_x = _rms(mh @ p["mtp.0.main_proj.weight"].T, p["mtp.0.main_norm.weight"], eps)
        ids = [int(next_token[b])] + [CFG.dspark_noise_token_id] * (K - 1)
        x = np.repeat(p["embed.weight"][ids][:, None, :], hc, axis=1)
        pre = np.zeros((K, hc))
        pre[:, 0] = 1.0
        for i in range(CFG.n_mtp_layers):
            s = f"mtp.{i}."
            a_pre, a_post, a_comb = _mixes(x, p, s + "hc_attn")
            h = _rms(np.einsum("nc,ncd->nd", pre, x), p[s + "attn_norm.weight"], eps)
            x = _expand(_attend(h, main_x, t, p, s + "attn."), x, a_post, a_comb)
            f_pre, f_post, f_comb = _mixes(x, p, s + "hc_ffn")
            h = _rms(np.einsum("nc,ncd->nd", a_pre, x), p[s + "ffn_norm.weight"], eps)
            x = _expand(_moe(h, p, s + "ffn.", margins), x, f_post, f_comb)
            pre = f_pre
        hid = np.einsum("nc,ncd->nd", pre, x)
        lg = _rms(hid, p[last + "norm.weight"], eps) @ p["head.weight"].T
        prev, row_t, row_c = ids[0], [], []
        for i in range(K):
            e = p[last + "markov_head.embed.weight"][prev]
            lg[i] += p[last + "markov_head.head.weight"] @ e
            row_c.append(p[last + "confidence_head.proj.weight"][0] @ np.concatenate([hid[i], e]))
            prev = int(np.argmax(lg[i]))
            row_t.append(prev)
        logits.append(lg)
        tokens.append(row_t)
        conf.append(row_c)
    return np.array(logits), np.array(tokens), np.array(conf), np.array(margins)


def test_drafter_matches_numpy_transcription(params, hidden):
    h, toks = hidden
    lengths = [5, 19]  # a partial window and a full one
    nxt = [toks[0, 5], toks[1, 19]]
    got = scratch(params, h, nxt, lengths)
    logits, tokens, conf, margins = numpy_drafter(params, h, nxt, lengths)
    assert margins.min() > 1e-3  # routing far from ties: fp32 and fp64 pick the same experts
    np.testing.assert_allclose(got.logits, logits, atol=TOL, rtol=TOL)
    np.testing.assert_allclose(got.confidence, conf, atol=TOL, rtol=TOL)
    np.testing.assert_array_equal(got.tokens, tokens)
    assert got.tokens.dtype == np.int32


def test_target_hidden_is_the_mean_of_the_copies_in_layer_order():
    rng = np.random.default_rng(2)
    streams = {n: rng.standard_normal((2, 3, CFG.hc_mult, CFG.dim)).astype(np.float32)
               for n in (7, 5, 6, 1)}  # fmt: skip
    got = np.asarray(dspark.target_hidden(CFG, {k: jnp.asarray(v) for k, v in streams.items()}))
    want = np.concatenate([streams[n].mean(axis=2) for n in (5, 6, 7)], axis=-1)
    np.testing.assert_allclose(got, want, atol=1e-6)
    with pytest.raises(ValueError, match=r"target layers \[7\]"):
        dspark.target_hidden(CFG, {5: streams[5], 6: streams[6]})


# -- structure ------------------------------------------------------------------------------------


def test_markov_bias_and_confidence_of_slot_i_follow_the_token_in_slot_i(params, hidden):
    h, toks = hidden
    lengths, nxt = [9, 14], toks[:, 9]
    got = scratch(params, h, nxt, lengths)
    table = "mtp.2.markov_head.embed.weight"
    plain = scratch({**params, table: jnp.zeros_like(params[table])}, h, nxt, lengths)
    slot_tokens = np.concatenate([np.asarray(nxt)[:, None], got.tokens[:, :-1]], axis=1)
    emb = np.asarray(params[table])[slot_tokens]  # [B, K, rank]
    bias = emb @ np.asarray(params["mtp.2.markov_head.head.weight"]).T
    np.testing.assert_allclose(got.logits - plain.logits, bias, atol=1e-5)
    proj = np.asarray(params["mtp.2.confidence_head.proj.weight"])[0, CFG.dim :]
    np.testing.assert_allclose(got.confidence - plain.confidence, emb @ proj, atol=1e-5)
    # greedy, left to right: each slot's token is the argmax of its biased logits
    np.testing.assert_array_equal(got.tokens, got.logits.argmax(-1))
    np.testing.assert_array_equal(plain.tokens, plain.logits.argmax(-1))


def test_block_is_bidirectional(params, hidden):
    h, toks = hidden
    lengths = [12, 12]
    nxt = np.array([7, 9], np.int32)
    base = scratch(params, h, nxt, lengths)
    emb = params["embed.weight"]
    noise = CFG.dspark_noise_token_id
    moved = scratch({**params, "embed.weight": emb.at[noise].add(0.5)}, h, nxt, lengths)
    # a causal block would leave slot 0 alone: only the noise slots hold the noise embedding
    assert np.abs(moved.logits[:, 0] - base.logits[:, 0]).max() > 1e-3
    moved = scratch({**params, "embed.weight": emb.at[nxt[0]].add(0.5)}, h, nxt, lengths)
    assert (np.abs(moved.logits[0] - base.logits[0]).max(-1) > 1e-3).all()
    np.testing.assert_allclose(moved.logits[1], base.logits[1], atol=1e-6)  # other row


def test_context_is_the_last_window_of_target_positions(params, hidden):
    h, toks = hidden
    t = 20
    lengths, nxt = [t, t], toks[:, t]
    base = scratch(params, h, nxt, lengths)
    older = h.copy()
    older[:, : t - W] += 3.0  # before the window
    older[:, t:] = 1e4  # beyond the prefix
    np.testing.assert_allclose(scratch(params, older, nxt, lengths).logits, base.logits, atol=1e-6)
    oldest = h.copy()
    oldest[:, t - W] += 3.0  # the window's first position
    assert np.abs(scratch(params, oldest, nxt, lengths).logits - base.logits).max() > 1e-3


@functools.cache
def _drafts():
    def run(params, tokens, next_token):
        logits, streams = reference.forward_streams(params, CFG, tokens, (5, 6, 7))
        return (
            dspark.draft(params, CFG, tokens),
            dspark.draft(params, CFG, tokens, next_token=next_token),
            logits,
            dspark.target_hidden(CFG, streams),
        )

    return jax.jit(run)


def test_draft_runs_the_backbone_and_reads_the_streams_entering_the_targets(params, hidden):
    _, toks = hidden
    t = 13
    prefix, nxt = jnp.asarray(toks[:, :t]), jnp.asarray(toks[:, t])
    greedy, given, logits, main_hidden = jax.tree.map(np.asarray, _drafts()(params, prefix, nxt))
    assert main_hidden.shape == (2, t, 3 * CFG.dim)
    pick = logits[:, -1].argmax(-1)
    for out, first in ((greedy, pick), (given, toks[:, t])):
        want = scratch(params, main_hidden, first, [t, t])
        np.testing.assert_allclose(out.logits, want.logits, atol=TOL, rtol=0)
        np.testing.assert_allclose(out.confidence, want.confidence, atol=TOL, rtol=0)
        np.testing.assert_array_equal(out.tokens, want.tokens)
    # the last target layer's own weights shape only what leaves it: the drafts keep still
    layer7 = {k: v * 1.5 if k.startswith("layers.7.") else v for k, v in params.items()}
    _, given7, _, _ = jax.tree.map(np.asarray, _drafts()(layer7, prefix, nxt))
    np.testing.assert_allclose(given7.logits, given.logits, atol=1e-6)
    layer6 = {k: v * 1.5 if k.startswith("layers.6.attn.") else v for k, v in params.items()}
    _, given6, _, _ = jax.tree.map(np.asarray, _drafts()(layer6, prefix, nxt))
    assert np.abs(given6.logits - given.logits).max() > 1e-3


# -- incremental ----------------------------------------------------------------------------------


@functools.cache
def _incremental():
    return (
        jax.jit(dspark.seed, static_argnums=1),
        jax.jit(dspark.step, static_argnums=1),
        jax.jit(
            lambda p, c, nt, st, mh, ln: dspark.step(p, CFG, c, nt, st, main_hidden=mh, lengths=ln)
        ),
    )


@pytest.mark.parametrize(
    "chunks",
    [
        ([5, 3, 11], [1, 12, 2]),  # chunks across window boundaries, longer than the window
        ([S], [8, 8]),  # one shot (three windows) and window-sized chunks
    ],
)
def test_incremental_equals_from_scratch_at_every_step(params, hidden, chunks):
    h, toks = hidden
    seed, step, seed_and_step = _incremental()
    cache = dspark.init_draft_cache(CFG, 2, fill=np.nan)
    done = [0, 0]
    queues = [list(c) for c in chunks]
    event = 0
    while done != [S, S]:
        n = [q.pop(0) if q else min(1, S - d) for q, d in zip(queues, done, strict=True)]
        chunk = np.full((2, BUCKET, h.shape[2]), np.nan, np.float32)  # padding: NaN
        for r in range(2):
            chunk[r, : n[r]] = h[r, done[r] : done[r] + n[r]]
        end = [d + m for d, m in zip(done, n, strict=True)]
        nxt = jnp.asarray(toks[[0, 1], end])
        if event % 2 == 0:  # seed and draft in one call
            out, cache = seed_and_step(params, cache, nxt, jnp.asarray(end), chunk, jnp.asarray(n))
        else:
            cache = seed(params, CFG, cache, chunk, jnp.asarray(done), jnp.asarray(n))
            out, same = step(params, CFG, cache, nxt, jnp.asarray(end))
            for k in cache:  # drafting writes nothing
                np.testing.assert_array_equal(np.asarray(same[k]), np.asarray(cache[k]))
        out = jax.tree.map(np.asarray, out)
        want = scratch(params, h, np.asarray(nxt), end)
        assert np.isfinite(out.logits).all() and np.isfinite(out.confidence).all()
        np.testing.assert_allclose(out.logits, want.logits, atol=TOL, rtol=0)
        np.testing.assert_allclose(out.confidence, want.confidence, atol=TOL, rtol=0)
        np.testing.assert_array_equal(out.tokens, want.tokens)
        done = end
        event += 1
    held = np.asarray(cache["win_pos"])
    np.testing.assert_array_equal(np.sort(held, axis=1), np.tile(np.arange(S - W, S), (2, 1)))
    np.testing.assert_array_equal(held % W, np.tile(np.arange(W), (2, 1)))  # slot = pos mod w
    # drafting from an earlier position (after a rollback) sees no ring entry at or after it
    at = jnp.full((2,), S - 1, jnp.int32)
    base, _ = step(params, CFG, cache, nxt, at)
    chunk = np.full((2, BUCKET, h.shape[2]), np.nan, np.float32)
    chunk[:, 0] = h[:, S - 1] + 3.0
    moved = seed(params, CFG, cache, chunk, at, jnp.ones(2, jnp.int32))
    np.testing.assert_array_equal(step(params, CFG, moved, nxt, at)[0].logits, base.logits)


def test_cache_layout():
    cache = dspark.init_draft_cache(CFG, 3, jnp.bfloat16, fill=np.nan)
    assert set(cache) == {"win.8", "win.9", "win.10", "win_pos"}  # draft layers 8, 9, 10
    assert cache["win.9"].shape == (3, W, CFG.head_dim) and cache["win.9"].dtype == jnp.bfloat16
    assert (np.asarray(cache["win_pos"]) == -1).all()


# -- errors ---------------------------------------------------------------------------------------


def test_bad_input_is_named(params):
    no_drafter = tiny_v41()
    toks = jnp.zeros((2, 4), jnp.int32)
    for call in (
        lambda: dspark.draft(params, no_drafter, toks),
        lambda: dspark.param_specs(no_drafter),
        lambda: dspark.init_draft_cache(no_drafter, 1),
    ):
        with pytest.raises(ValueError, match=r"no DSpark drafter .*dspark_block_size=0"):
            call()
    with pytest.raises(ValueError, match=r"shape \[4\]"):
        dspark.draft(params, CFG, jnp.zeros(4, jnp.int32))
    with pytest.raises(ValueError, match=r"no tokens \(shape \[2, 0\]\)"):
        dspark.draft(params, CFG, jnp.zeros((2, 0), jnp.int32))
    with pytest.raises(TypeError, match="tokens must hold integer token ids"):
        dspark.draft(params, CFG, jnp.zeros((2, 4)))
    with pytest.raises(ValueError, match=r"tokens\[1, 2\] = 512 is outside"):
        dspark.draft(params, CFG, toks.at[1, 2].set(512))
    with pytest.raises(ValueError, match=r"next_token must have shape \(2,\), got \(2, 1\)"):
        dspark.draft(params, CFG, toks, next_token=jnp.zeros((2, 1), jnp.int32))
    with pytest.raises(ValueError, match=r"next_token\[1\] = -1 is outside"):
        dspark.draft(params, CFG, toks, next_token=jnp.array([3, -1]))
    with pytest.raises(ValueError, match="max_seq_len=512"):
        dspark.draft(params, CFG, jnp.zeros((1, 510), jnp.int32))
    cache = dspark.init_draft_cache(CFG, 2)
    with pytest.raises(ValueError, match=r"main_hidden must be \[B, T, 192\]"):
        dspark.seed(params, CFG, cache, jnp.zeros((2, 3, 64)), 0)
    with pytest.raises(ValueError, match=r"next_token must have shape \(2,\)"):
        dspark.step(params, CFG, cache, jnp.zeros(3, jnp.int32), 4)
    with pytest.raises(ValueError, match=r"next_token\[1\] = 600 is outside"):
        dspark.step(params, CFG, cache, jnp.array([1, 600]), 4)
    with pytest.raises(ValueError, match="lengths is given without main_hidden"):
        dspark.step(params, CFG, cache, jnp.array([1, 2]), 4, lengths=jnp.array([1, 1]))
    with pytest.raises(ValueError, match="not a drafter cache"):
        dspark.step(params, CFG, {"win_pos": cache["win_pos"]}, jnp.array([1, 2]), 4)


def test_incremental_drafter_over_the_backbone_with_engram(engram_params, engram_cfg):
    """The tiny model with Engram and the 3-stage drafter: the prompt goes through the dense
    backbone in chunks (`model.forward_step_streams` gives the target layers' streams of each
    chunk), `seed` writes them into the drafter's rings and `step` drafts; at every step this
    equals drafting from scratch over the whole prefix (the reference's streams)."""
    from dsv4 import model

    cfg, params = engram_cfg, engram_params
    targets = cfg.dspark_target_layer_ids
    rng = np.random.default_rng(3)
    seq, bucket = 40, 16
    tokens = rng.integers(3, 300, (2, seq + 1)).astype(np.int32)  # ids past 258: DEAD
    _, ref = jax.jit(reference.forward_streams, static_argnums=(1, 3))(
        params, cfg, jnp.asarray(tokens[:, :seq]), targets
    )
    ref_hidden = dspark.target_hidden(cfg, ref)
    backbone = jax.jit(model.forward_step_streams, static_argnums=(1, 6))
    seed = jax.jit(dspark.seed, static_argnums=1)
    step = jax.jit(dspark.step, static_argnums=1)
    scratch = jax.jit(dspark.draft_from_hidden, static_argnums=1)
    cache = model.init_cache(cfg, 2, seq + 8, fill=np.nan)
    rings = dspark.init_draft_cache(cfg, 2, fill=np.nan)
    done = np.zeros(2, np.int32)
    for n in ([7, 1], [16, 16], [1, 9], [3, 1], [13, 13]):
        n = np.asarray(n, np.int32)
        chunk = np.full((2, bucket), 5, np.int32)
        for r in range(2):
            chunk[r, : n[r]] = tokens[r, done[r] : done[r] + n[r]]
        _, cache, streams = backbone(params, cfg, cache, jnp.asarray(chunk), done, n, targets)
        hidden = dspark.target_hidden(cfg, streams)
        rings = seed(params, cfg, rings, hidden, jnp.asarray(done), jnp.asarray(n))
        end = done + n
        nxt = jnp.asarray(tokens[[0, 1], end])
        out, _ = step(params, cfg, rings, nxt, jnp.asarray(end))
        want = scratch(params, cfg, ref_hidden, nxt, lengths=jnp.asarray(end))
        np.testing.assert_allclose(np.asarray(out.logits), np.asarray(want.logits), atol=TOL)
        np.testing.assert_allclose(
            np.asarray(out.confidence), np.asarray(want.confidence), atol=TOL
        )
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(want.tokens))
        done = end
