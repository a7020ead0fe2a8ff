"""Unit tests of the model math: config and layer plan, rope, mHC, selection, sparse == dense,
quantisation-simulation primitives, and the reference forward's behaviour under quant_sim/bf16."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv4 import layers as L
from dsv4 import model, reference
from dsv4.config import ModelConfig, Role, rope_inv_freq, tiny_v41, v41_flash
from dsv4.params import init_params
from dsv4.quant import fp4_qdq_e4m3, fp4_qdq_pow2, fp8_qdq, pow2_scale

# -- config and plan ----------------------------------------------------------------------------


def test_released_plan():
    plan = v41_flash().plan
    assert plan.by_role(Role.FULL) == (2, 8, 14, 20)
    assert plan.by_role(Role.REINDEX) == (24, 28, 32, 36)
    assert plan.by_role(Role.SWA) == (0, 1)
    assert len(plan.by_role(Role.REUSE)) == 40 - 4 - 4 - 2
    assert plan[20].is_candidate_source
    assert [i.layer for i in plan if i.uses_candidates] == [24, 28, 32, 36]
    assert plan[13].kv_source == 8 and plan[13].index_source == 8
    assert plan[25].kv_source == 20 and plan[25].index_source == 24
    assert {plan[i].ratio for i in range(2, 20)} == {2}
    assert {plan[i].ratio for i in range(20, 40)} == {1}


def test_tiny_plan_covers_every_role():
    plan = tiny_v41().plan
    roles = [i.role for i in plan]
    assert roles == [
        Role.SWA,
        Role.FULL,
        Role.REUSE,
        Role.FULL,
        Role.REUSE,
        Role.REINDEX,
        Role.REUSE,
        Role.SWA,
    ]
    assert plan[4].kv_source == 3  # latest source at or below, not layer 1
    assert plan[6].index_source == 5 and plan[6].kv_source == 3
    assert plan[3].is_candidate_source and plan[5].uses_candidates
    assert not plan[1].uses_candidates


@pytest.mark.parametrize(
    "changes, match",
    [
        (
            dict(kv_source_layers=(1,), index_source_layers=(1, 3), candidate_source_layer=-1),
            "layer 3 has ratio 1 but its kv source 1 has ratio 2",
        ),
        (dict(compress_ratios=(0, 2, 2, 1, 1, 1, 3, 0, 0)), "layer 6 has compress ratio 3"),
        (dict(kv_source_layers=(1, 3, 5), index_source_layers=(1, 3)), "layer 5 is a kv source"),
        (dict(kv_source_layers=(3,), index_source_layers=(3, 5)), "layer 1 has compress ratio 2"),
        (dict(candidate_source_layer=5), "candidate source layer 5"),
        (dict(kv_source_layers=(0, 3)), "layer 0 is in kv_source_layers"),
        (dict(compress_ratios=(0, 2, 2, 1, 1, 1, 1, 0, 2)), "draft layer 8"),
        (dict(n_heads=5), "o_groups"),
        (dict(dim=0), "dim=0"),
    ],
)
def test_invalid_configs_name_the_problem(changes, match):
    with pytest.raises(ValueError, match=match):
        tiny_v41(**changes)


def test_config_is_hashable_and_static():
    a, b = tiny_v41(), tiny_v41()
    assert a == b and hash(a) == hash(b)
    assert {a: 1}[b] == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.dim = 3  # type: ignore[misc]


# V4.1-Flash's config.json as the HF export writes it (the text model under text_config)
_V41_FLASH_HF = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "quantization_config": {
        "quant_method": "fp8",
        "weight_block_size": [32, 32],
        "scale_fmt": "ue8m0",
        "expert_dtype": "fp4",
    },
    "vision_config": {"hidden_size": 1024},
    "text_config": {
        "model_type": "deepseek_v41_text",
        "vocab_size": 129280,
        "hidden_size": 5120,
        "num_hidden_layers": 40,
        "num_nextn_predict_layers": 3,
        "num_attention_heads": 64,
        "num_key_value_heads": 1,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 1280,
        "o_lora_rank": 1024,
        "o_groups": 8,
        "sliding_window": 128,
        "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
        "kv_source_layer_ids": [2, 8, 14, 20],
        "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
        "candidate_source_layer_id": 20,
        "candidate_topk_blocks": 2048,
        "candidate_block_size": 8,
        "index_n_heads": 32,
        "index_head_dim": 128,
        "index_topk": 512,
        "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "max_position_embeddings": 1048576,
        "rms_norm_eps": 1e-20,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "n_routed_experts": 384,
        "n_shared_experts": 1,
        "num_experts_per_tok": 6,
        "moe_intermediate_size": 2304,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "engram_layer_ids": [1, 14],
        "engram_n_heads": 8,
        "dspark_block_size": 5,
        "dspark_target_layer_ids": [37, 38, 39],
    },
}


def test_config_from_hf_json_with_text_config():
    hf = _V41_FLASH_HF
    cfg = ModelConfig.from_dict(hf)
    assert cfg == v41_flash()
    # inference names (the reference's inference/config.json) give the same config
    inf = {k: v for k, v in cfg.to_dict().items() if k != "quant_sim"}
    assert ModelConfig.from_dict(inf) == cfg
    assert ModelConfig.from_dict(cfg.to_hf_dict()) == cfg
    with pytest.raises(ValueError, match="unknown config keys"):
        ModelConfig.from_dict({**inf, "hiden_size": 3})
    # transformers writes the torch storage dtype at the top level ("dtype" since 4.56,
    # "torch_dtype" before): that is not the inference dtype, the quantised storage comes from
    # quantization_config
    for key in ("dtype", "torch_dtype"):
        for value in ("bfloat16", "torch.bfloat16", "float32", "auto"):
            assert ModelConfig.from_dict({**hf, key: value}) == cfg, (key, value)
    both = {**hf, "dtype": "bfloat16", "torch_dtype": "bfloat16"}
    assert ModelConfig.from_dict(both) == cfg
    # the same in text_config (where some exporters put it)
    nested = {**hf, "text_config": {**hf["text_config"], "torch_dtype": "bfloat16"}}
    assert ModelConfig.from_dict(nested) == cfg
    # without quantization_config the weights are plain, experts included
    plain = {k: v for k, v in hf.items() if k != "quantization_config"}
    bf16 = ModelConfig.from_dict({**plain, "dtype": "bfloat16"})
    assert (bf16.dtype, bf16.expert_dtype) == ("bf16", None)
    assert bf16 == cfg.replace(dtype="bf16", expert_dtype=None)
    # the inference config's own dtype names still set the field
    assert ModelConfig.from_dict({**inf, "dtype": "bf16"}).dtype == "bf16"
    with pytest.raises(ValueError, match=r"'dtype'='int3'.*inference dtype.*torch storage"):
        ModelConfig.from_dict({**hf, "dtype": "int3"})


# -- rope ---------------------------------------------------------------------------------------


def test_rope_tables_plain_and_yarn():
    cfg = tiny_v41()
    plain = np.array(rope_inv_freq(cfg, 0))
    d = cfg.rope_head_dim
    np.testing.assert_allclose(plain, 1.0 / 10000.0 ** (np.arange(0, d, 2) / d), rtol=1e-12)
    yarn = np.array(rope_inv_freq(cfg, 1))
    base = 1.0 / 160000.0 ** (np.arange(0, d, 2) / d)

    def corr(rot):
        return d * math.log(cfg.original_seq_len / (rot * 2 * math.pi)) / (2 * math.log(160000.0))

    lo, hi = max(math.floor(corr(32)), 0), min(math.ceil(corr(1)), d - 1)
    ramp = np.clip((np.arange(d // 2) - lo) / max(hi - lo, 1e-3), 0, 1)
    want = base / cfg.rope_factor * ramp + base * (1 - ramp)
    np.testing.assert_allclose(yarn, want, rtol=1e-12)
    assert yarn[0] == base[0] and yarn[-1] < base[-1]  # high frequencies kept, low ones scaled


def test_rope_interleaved_pairs_and_inverse():
    cfg = tiny_v41()
    x = jax.random.normal(jax.random.PRNGKey(0), (5, 64))
    pos = jnp.arange(5) * 37
    cos, sin = L.rope_tables(cfg, 1, pos)
    y = L.apply_rope(x, cos, sin)
    np.testing.assert_array_equal(y[:, :48], x[:, :48])  # only the last rope dims rotate
    # pair i = dims (48 + 2i, 48 + 2i + 1) as a complex number times e^{i p f}
    z = np.asarray(x[:, 48::2]) + 1j * np.asarray(x[:, 49::2])
    rot = z * np.exp(1j * np.asarray(pos)[:, None] * np.array(rope_inv_freq(cfg, 1)))
    np.testing.assert_allclose(np.asarray(y[:, 48::2]), rot.real, atol=1e-5)
    np.testing.assert_allclose(np.asarray(y[:, 49::2]), rot.imag, atol=1e-5)
    back = L.apply_rope(y, cos, sin, inverse=True)
    np.testing.assert_allclose(back, x, atol=1e-5)


# -- mHC ----------------------------------------------------------------------------------------


def test_sinkhorn_mix_is_doubly_stochastic(tiny_params, tiny_cfg):
    x = jax.random.normal(jax.random.PRNGKey(1), (3, 7, tiny_cfg.hc_mult, tiny_cfg.dim))
    for layer in (0, 5):
        pre, post, comb = L.hc_mixes(x, tiny_params, f"layers.{layer}.hc_attn", tiny_cfg)
        np.testing.assert_allclose(comb.sum(-1), 1.0, atol=1e-5)
        np.testing.assert_allclose(comb.sum(-2), 1.0, atol=1e-5)
        assert (comb > 0).all()
        assert ((post > 0) & (post < 2)).all()
        assert (pre > 0).all()


def test_hc_pre_post():
    x = jax.random.normal(jax.random.PRNGKey(2), (2, 4, 8))
    pre = jnp.array([[0.1, 0.2, 0.3, 0.4], [1.0, 0.0, 0.0, 0.0]])
    np.testing.assert_allclose(L.hc_pre(x, pre)[1], x[1, 0], atol=1e-6)
    y = jax.random.normal(jax.random.PRNGKey(3), (2, 8))
    post = jnp.ones((2, 4))
    comb = jnp.broadcast_to(jnp.eye(4), (2, 4, 4))
    np.testing.assert_allclose(L.hc_post(y, x, post, comb), x + y[:, None], atol=1e-6)


# -- selection ----------------------------------------------------------------------------------


def test_topk_ties_go_to_the_lower_index_and_invalid_picks_are_dropped():
    s = jnp.array([[0.0, 2.0, 0.0, -0.0, 2.0, 0.0, -jnp.inf, -jnp.inf]])
    idx = reference.topk_indices(s, jnp.array([6]), 4)
    assert list(np.asarray(idx[0])) == [1, 4, 0, 2]
    # -inf scores and entries at or beyond `visible` are never picked
    idx = reference.topk_indices(s, jnp.array([2]), 4)
    assert sorted(np.asarray(idx[0]).tolist()) == [-1, -1, 0, 1]


def test_candidate_blocks_pin_the_newest_and_drop_unreachable():
    scores = jnp.array(
        [[5.0, 1.0, 0.0, 0.0, 9.0, 0.0, 0.0, 0.0, 2.0, -jnp.inf, -jnp.inf, -jnp.inf]]
    )
    # visible 9: blocks of 4 score [5, 9, +inf(newest: entry 8)], keep the top 2
    keep = reference.select_candidate_blocks(scores, jnp.array([9]), 2, 4)
    assert np.asarray(keep[0]).tolist() == [False] * 4 + [True] * 4 + [True] * 4
    # nothing visible: no block kept, even the "newest"
    none = reference.select_candidate_blocks(jnp.full((1, 12), -jnp.inf), jnp.array([0]), 2, 4)
    assert not np.asarray(none).any()


def _dense_forward(params, cfg, tokens):
    """Independent dense V4.1: every layer with ratio R attends to its window and to *all*
    visible compressed entries of its kv source; no indexer at all."""
    b, t = tokens.shape
    x = L.embed(params, tokens, cfg)
    pre = jnp.zeros(x.shape[:-1]).at[..., 0].set(1.0)
    pos = jnp.arange(t)
    entries = {}
    for layer in range(cfg.n_layers):
        info = cfg.plan[layer]
        p, a = f"layers.{layer}.", f"layers.{layer}.attn."
        a_pre, a_post, a_comb = L.hc_mixes(x, params, p + "hc_attn", cfg)
        h = L.rms_norm(L.hc_pre(x, pre), params[p + "attn_norm.weight"], cfg.norm_eps)
        r = info.ratio
        cos, sin = L.rope_tables(cfg, r, pos)
        qr = L.rms_norm(
            L.linear(h, params, a + "wq_a.weight", cfg), params[a + "q_norm.weight"], cfg.norm_eps
        )
        q = L.linear(qr, params, a + "wq_b.weight", cfg).reshape(b, t, cfg.n_heads, -1)
        q = L.apply_rope(q, cos[:, None], sin[:, None])
        kv = L.rms_norm(
            L.linear(h, params, a + "wkv.weight", cfg), params[a + "kv_norm.weight"], cfg.norm_eps
        )
        kv = L.apply_rope(kv, cos, sin)
        keys, mask = (
            [kv],
            [(pos[None] <= pos[:, None]) & (pos[None] > pos[:, None] - cfg.window_size)],
        )
        if r:
            if info.role is Role.FULL:
                n = t // r
                if r == 1:
                    z = L.linear(h, params, a + "compressor.wkv.weight", cfg)
                else:
                    hh = h[:, : n * r].reshape(b, n, r, -1)
                    kvp = hh @ params[a + "compressor.wkv.weight"].T
                    g = jax.nn.softmax(hh @ params[a + "compressor.wgate.weight"].T, axis=2)
                    z = (kvp * g).sum(2)
                z = L.rms_norm(z, params[a + "compressor.norm.weight"], cfg.norm_eps)
                gc, gs = L.rope_tables(cfg, r, jnp.arange(n) * r)
                entries[layer] = L.apply_rope(z, gc, gs)
            c = entries[info.kv_source]
            keys.append(c)
            mask.append(jnp.arange(c.shape[1])[None] < ((pos + 1) // r)[:, None])
        k = jnp.concatenate(keys, 1)
        m = jnp.concatenate(mask, -1)
        logits = jnp.einsum("bthd,bkd->bthk", q, k) * cfg.head_dim**-0.5
        logits = jnp.where(m[None, :, None], logits, -jnp.inf)
        sink = params[a + "attn_sink"][None, None, :, None]
        mx = jnp.maximum(logits.max(-1, keepdims=True), sink)
        e = jnp.exp(logits - mx)
        o = jnp.einsum("bthk,bkd->bthd", e, k) / (e.sum(-1, keepdims=True) + jnp.exp(sink - mx))
        x = L.hc_post(L.attention_output(o, cos, sin, params, a, cfg), x, a_post, a_comb)
        f_pre, f_post, f_comb = L.hc_mixes(x, params, p + "hc_ffn", cfg)
        h = L.rms_norm(L.hc_pre(x, a_pre), params[p + "ffn_norm.weight"], cfg.norm_eps)
        x = L.hc_post(L.moe(h, params, p + "ffn.", cfg), x, f_post, f_comb)
        pre = f_pre
    return L.head(params, x, pre, cfg)


def test_sparse_path_equals_dense_when_topk_covers_everything(tiny_params, tiny_cfg):
    t = 40
    tokens = jax.random.randint(jax.random.PRNGKey(5), (1, t), 3, tiny_cfg.vocab_size)
    wide = tiny_cfg.replace(index_topk=64, candidate_topk_blocks=64)
    dense = jax.jit(_dense_forward, static_argnums=1)(tiny_params, wide, tokens)
    sparse = jax.jit(reference.forward, static_argnums=1)(tiny_params, wide, tokens)
    np.testing.assert_allclose(sparse, dense, atol=1e-4, rtol=0)
    # with the tiny config's real top-k (16 of up to 40 entries) selection matters
    narrow = jax.jit(reference.forward, static_argnums=1)(tiny_params, tiny_cfg, tokens)
    assert np.abs(np.asarray(narrow) - np.asarray(dense)).max() > 1e-3


# -- quantisation simulation -------------------------------------------------------------------


def _np_pow2(amax, qmax):
    return np.exp2(np.ceil(np.log2(amax / qmax)))


def test_fp8_qdq_matches_ml_dtypes():
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32) * 3
    x[0, :32] = 0.0  # all-zero block: amax floored at 1e-4
    blocks = x.reshape(4, 2, 32)
    s = _np_pow2(np.maximum(np.abs(blocks).max(-1, keepdims=True), 1e-4), 448.0)
    q = np.clip(blocks / s, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(fp8_qdq(jnp.asarray(x))), (q * s).reshape(4, 64))


def test_pow2_scale_is_exact_at_powers_of_two():
    amax = jnp.array([448.0, 449.0, 224.0, 1e-4, 6.0], jnp.float32)
    got = np.asarray(pow2_scale(amax, 448.0))
    assert got[0] == 1.0 and got[1] == 2.0 and got[2] == 0.5
    assert got[3] == 2.0 ** math.ceil(math.log2(1e-4 / 448))


def test_fp4_qdq_pow2_and_e4m3_match_independent_rounding():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)

    def e2m1(v):  # nearest grid value, ties to the even code
        mag = np.abs(v)
        d = np.abs(mag[..., None] - grid)
        best = d.min(-1, keepdims=True)
        cands = np.where(d == best, np.arange(8), 99)
        code = np.where((cands % 2 == 0) & (cands < 99), cands, 99).min(-1)
        code = np.where(code == 99, cands.min(-1), code)
        return np.sign(v) * grid[code]

    b = x.reshape(3, 2, 32)
    s = _np_pow2(np.maximum(np.abs(b).max(-1, keepdims=True), 6 * 2.0**-126), 6.0)
    want = (e2m1(np.clip(b / s, -6, 6)) * s).reshape(3, 64)
    np.testing.assert_array_equal(np.asarray(fp4_qdq_pow2(jnp.asarray(x))), want)
    b = x.reshape(3, 4, 16)
    amax = np.maximum(np.abs(b).max(-1, keepdims=True), 6 * 2.0**-9)
    s = (amax / 6).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    want = (e2m1(np.clip(b / s, -6, 6)) * s).reshape(3, 64)
    np.testing.assert_array_equal(np.asarray(fp4_qdq_e4m3(jnp.asarray(x))), want)


def test_quant_sim_incremental_path_and_effect(tiny_params, tiny_cfg):
    """Under quant_sim the incremental path computes the reference's math: one chunk of the
    same shape reproduces it bit for bit. Chunked, the matmuls run at other shapes and round in
    another order; a last-ulp difference that lands on a quantisation boundary moves a value by
    one fp8/e2m1 step and the change propagates through the caches (measured on this prompt:
    ~0.1-0.3 max abs logit difference after the first flip, none before). So the chunked check
    is statistical, and the effect of quant_sim itself must be much larger than 1e-4."""
    cfg = tiny_cfg.replace(quant_sim=True)
    t = 40
    tokens = jax.random.randint(jax.random.PRNGKey(9), (1, t), 3, cfg.vocab_size)
    ref_q = np.asarray(jax.jit(reference.forward, static_argnums=1)(tiny_params, cfg, tokens))
    ref_f = np.asarray(jax.jit(reference.forward, static_argnums=1)(tiny_params, tiny_cfg, tokens))
    step = jax.jit(model.forward_step, static_argnums=1)
    cache = model.init_cache(cfg, 1, t, fill=np.nan)
    one, _ = step(tiny_params, cfg, cache, tokens, jnp.array([0]), jnp.array([t]))
    np.testing.assert_allclose(np.asarray(one), ref_q, atol=1e-5, rtol=0)
    lg1, cache = step(tiny_params, cfg, cache, tokens[:, :27], jnp.array([0]), jnp.array([27]))
    lg2, cache = step(tiny_params, cfg, cache, tokens[:, 27:], jnp.array([27]), jnp.array([13]))
    inc = np.concatenate([np.asarray(lg1), np.asarray(lg2)], axis=1)
    np.testing.assert_allclose(inc[:, :27], ref_q[:, :27], atol=1e-4, rtol=0)
    diff = np.abs(inc - ref_q)
    assert diff.max() < 1.0 and diff.mean() < 0.05, (diff.max(), diff.mean())
    assert np.abs(ref_q - ref_f).mean() > 10 * diff.mean()


def test_bf16_params_run_close_to_fp32(tiny_params, tiny_cfg):
    """bf16 activations track fp32 (measured: ~0.05 max abs logit difference per position)
    except where rounding flips a top-k selection (a few positions, up to ~2)."""
    t = 24
    tokens = jax.random.randint(jax.random.PRNGKey(4), (1, t), 3, tiny_cfg.vocab_size)
    bf = init_params(tiny_cfg, jax.random.PRNGKey(0), jnp.bfloat16)
    assert bf["layers.0.attn.wq_a.weight"].dtype == jnp.bfloat16
    assert bf["layers.0.hc_attn_fn"].dtype == jnp.float32  # stored f32 in the checkpoint
    fwd = jax.jit(reference.forward, static_argnums=1)
    lo = np.asarray(fwd(bf, tiny_cfg, tokens))[0]
    hi = np.asarray(fwd(tiny_params, tiny_cfg, tokens))[0]
    assert lo.dtype == np.float32 and np.isfinite(lo).all()
    per_pos = np.abs(lo - hi).max(-1)
    assert np.median(per_pos) < 0.1, per_pos
    cos = (lo * hi).sum(-1) / np.linalg.norm(lo, axis=-1) / np.linalg.norm(hi, axis=-1)
    assert cos.mean() > 0.95, cos
