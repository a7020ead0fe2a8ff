"""Engram in the model (`docs/model.md#engram`): the device hash, the gate, and every path against
the whole-sequence reference.

The n-gram row ids are checked against the rule written out below in Python integers (no numpy
arithmetic), and against `dsv4.engram_hash` at the released sizes; the gated update against a
numpy transcription of DeepSeek's formula; the dense-cache chunkings and `generate` against
`reference.forward` with Engram on a kv-source layer (1) and a reuse layer (4) of the tiny model.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4 import engram, model, reference
from dsv4.config import ModelConfig, tiny_v41, v41_flash
from dsv4.engram_hash import DEAD, EngramHashing
from dsv4.generation import generate
from dsv4.params import byte_token_map

SEQ = 72
BUCKET = 16
TOL = 1e-4


def _definition(cfg: ModelConfig, hist: list[int], p: int, pad: int) -> list[list[int]]:
    """Row ids of position p: the rule of docs/model.md#engram in Python ints."""
    n, heads, vocab = (
        cfg.engram_max_ngram_size,
        cfg.engram_n_heads,
        cfg.engram_compressed_vocab_size,
    )
    # successive primes above engram_vocab_size - 1, in (layer, n, head) order, never reused
    primes, taken = [], set()
    for _ in cfg.engram_layer_ids:
        layer = []
        for _ in range(n - 1):
            c = cfg.engram_vocab_size - 1
            for _ in range(heads):
                c += 1
                while c in taken or any(c % d == 0 for d in range(2, int(c**0.5) + 1)):
                    c += 1
                taken.add(c)
                layer.append(c)
        primes.append(layer)
    look, blocked = [], False
    for k in range(n):
        blocked = blocked or p - k < 0 or hist[p - k] == DEAD
        look.append(pad if blocked else hist[p - k])
    out = []
    for li, layer_id in enumerate(cfg.engram_layer_ids):
        bound = max(1, ((2**63 - 1) // vocab) // 2)
        draws = np.random.default_rng(10007 * layer_id).integers(0, bound, size=n, dtype=np.int64)
        mult = [int(m) * 2 + 1 for m in draws]
        ids, x, offset = [], look[0] * mult[0], 0
        for size in range(2, n + 1):
            x ^= look[size - 1] * mult[size - 1]
            for head in range(heads):
                prime = primes[li][(size - 2) * heads + head]
                ids.append(x % prime + offset)
                offset += prime
        out.append(ids)
    return out


def test_device_row_ids_follow_the_definition(engram_cfg, engram_params):
    tm = np.asarray(engram_params[engram.TOKEN_MAP])
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 300, size=(2, 30)).astype(np.int32)  # ids past 258 are DEAD
    rows, live = jax.jit(reference.engram_rows, static_argnums=1)(
        engram_params, engram_cfg, jnp.asarray(tokens)
    )
    pad = int(tm[engram_cfg.engram_pad_id])
    for b in range(2):
        hist = tm[tokens[b]].tolist()
        assert DEAD in hist
        want = [_definition(engram_cfg, hist, p, pad) for p in range(30)]
        assert np.asarray(rows[b]).tolist() == want
        np.testing.assert_array_equal(np.asarray(live[b]), np.asarray(hist) != DEAD)


def test_device_row_ids_at_released_sizes():
    """The 32-bit-halves arithmetic against numpy int64 with the released constants (8 heads,
    4-grams, 16M, 99092 compressed ids), over random and extreme compressed ids."""
    cfg = v41_flash()
    h = EngramHashing.build(layer_ids=cfg.engram_layer_ids, max_ngram_size=4, n_heads=8,
                            engram_vocab_size=16_000_000, compressed_vocab_size=99092,
                            pad_id=77)  # fmt: skip
    rng = np.random.default_rng(1)
    hist = rng.integers(0, 99092, size=500)
    hist[:8] = 99091  # the largest products
    hist[200:210] = 0
    hist[rng.choice(500, 20, replace=False)] = DEAD
    want = h.hash_ids(hist)
    pos = np.arange(500)
    look = np.stack(
        [np.where(pos - k >= 0, hist[np.maximum(pos - k, 0)], DEAD) for k in range(4)], -1
    )
    got = jax.jit(engram.row_ids, static_argnums=0)(
        cfg, jnp.asarray(look, jnp.int32), jnp.int32(77)
    )
    np.testing.assert_array_equal(np.asarray(got), want)
    assert np.asarray(got).max() < max(cfg.engram_table_rows)


def test_gate_and_update_follow_deepseeks_formula(engram_cfg, engram_params):
    cfg, params = engram_cfg, engram_params
    rng = np.random.default_rng(2)
    hc, d = cfg.hc_mult, cfg.dim
    x = rng.normal(size=(2, 5, hc, d)).astype(np.float32)
    values = rng.normal(size=(2, 5, cfg.engram_columns, cfg.engram_head_dim)).astype(np.float32)
    live = np.array([[1, 1, 0, 1, 1], [1, 1, 1, 1, 0]], bool)
    got = np.asarray(engram.apply(jnp.asarray(x), params, 1, cfg, jnp.asarray(values), live))
    # numpy: wkv -> hc keys and one value; per copy a normalised dot, signed sqrt, sigmoid
    w = np.asarray(params["layers.1.engram.wkv.weight"], np.float64)
    kv = values.reshape(2, 5, -1).astype(np.float64) @ w.T
    key, value = kv[..., : hc * d].reshape(2, 5, hc, d), kv[..., hc * d :]
    qk = np.asarray(params["layers.1.engram.q_weight"], np.float64) * np.asarray(
        params["layers.1.engram.k_weight"], np.float64
    )
    eps = cfg.norm_eps
    rr = 1 / np.sqrt((x.astype(np.float64) ** 2).mean(-1) + eps)
    rk = 1 / np.sqrt((key**2).mean(-1) + eps)
    dot = (x * qk * key).sum(-1) * rr * rk / np.sqrt(d)
    gate = 1 / (1 + np.exp(-np.sign(dot) * np.sqrt(np.maximum(np.abs(dot), 1e-6))))
    gate = np.where(live[..., None], gate, 0)
    want = x + gate[..., None] * value[:, :, None, :]
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    # shut gates leave the stream exactly as it was
    np.testing.assert_array_equal(got[0, 2], x[0, 2])


def test_engram_changes_the_stream_from_its_first_layer_on(engram_cfg, engram_params):
    """With Engram on layers 1 and 4, zeroing layer 4's table leaves the stream entering layers
    0..4 alone and changes it from layer 5 on; the map of ids past the tokenizer is DEAD."""
    tokens = jnp.asarray(np.random.default_rng(3).integers(3, 259, size=(1, 24)), jnp.int32)
    fwd = jax.jit(reference.forward_streams, static_argnums=(1, 3))
    layers = tuple(range(8))
    _, s = fwd(engram_params, engram_cfg, tokens, layers)
    zeroed = dict(engram_params)
    zeroed["layers.4.engram.embed.weight"] = jnp.zeros_like(zeroed["layers.4.engram.embed.weight"])
    _, z = fwd(zeroed, engram_cfg, tokens, layers)
    for layer in range(4):
        np.testing.assert_array_equal(np.asarray(s[layer]), np.asarray(z[layer]))
    assert not np.allclose(np.asarray(s[4]), np.asarray(z[4]))
    plain = {k: v for k, v in engram_params.items() if "engram" not in k}
    _, p = fwd(plain, tiny_v41(), tokens, layers)
    # without Engram (same backbone params) the streams agree up to layer 0 and differ at 1
    np.testing.assert_array_equal(np.asarray(s[0]), np.asarray(p[0]))
    assert not np.allclose(np.asarray(s[1]), np.asarray(p[1]))


# -- the dense-cache path and generate --------------------------------------------------------


@functools.cache
def _step():
    return jax.jit(model.forward_step, static_argnums=1)


@pytest.fixture(scope="module")
def tokens():
    rng = np.random.default_rng(7)
    t = rng.integers(3, 259, size=(2, SEQ)).astype(np.int32)
    t[0, [5, 30, 31, 50]] = 400  # DEAD tokens inside the sequence
    t[1, 10:14] = t[1, 20:24]  # a repeated 4-gram
    return jnp.asarray(t)


@pytest.fixture(scope="module")
def ref_logits(engram_params, engram_cfg, tokens):
    with jax.default_matmul_precision("highest"):
        return np.asarray(
            jax.jit(reference.forward, static_argnums=1)(engram_params, engram_cfg, tokens)
        )


def _run_chunks(params, cfg, tokens, chunks_per_row):
    b, t = tokens.shape
    cache = model.init_cache(cfg, b, t + 8, fill=np.nan)
    tokens = np.asarray(tokens)
    out = np.full((b, t, cfg.vocab_size), np.nan, np.float32)
    done = [0] * b
    queues = [list(c) for c in chunks_per_row]
    while any(queues):
        chunk = np.full((b, BUCKET), 5, np.int32)  # padding carries junk ids
        start, lengths = np.array(done, np.int32), np.zeros(b, np.int32)
        for r in range(b):
            if queues[r]:
                n = queues[r].pop(0)
                chunk[r, :n] = tokens[r, done[r] : done[r] + n]
                lengths[r] = n
        logits, cache = _step()(params, cfg, cache, jnp.asarray(chunk), start, lengths)
        for r in range(b):
            out[r, done[r] : done[r] + lengths[r]] = np.asarray(logits)[r, : lengths[r]]
            done[r] += int(lengths[r])
    return out


@pytest.mark.parametrize(
    "rows",
    [
        ([16] * 4 + [8], [7, 13, 15, 9, 1, 16, 11]),  # look-backs straddle chunk boundaries
        ([1, 1, 2, 16, 16, 16, 1, 1, 1, 1, 16], [3, 1, 1, 16, 16, 16, 3, 16]),  # decode steps
    ],
)
def test_chunked_prefill_and_decode_match_reference(
    engram_params, engram_cfg, tokens, ref_logits, rows
):
    out = _run_chunks(engram_params, engram_cfg, tokens, rows)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref_logits, atol=TOL, rtol=0)


def test_greedy_generate_with_engram_equals_reference(engram_params, engram_cfg):
    prompts = np.random.default_rng(4).integers(3, 259, size=(2, 12)).astype(np.int32)
    lengths = np.array([12, 5], np.int32)
    out = np.asarray(generate(engram_params, engram_cfg, prompts, 6, prompt_lengths=lengths))
    fwd = jax.jit(reference.forward, static_argnums=1)
    for r in range(2):
        seq = list(prompts[r, : lengths[r]])
        for _ in range(6):
            padded = np.zeros((1, 24), np.int32)
            padded[0, : len(seq)] = seq
            seq.append(
                int(
                    jnp.argmax(fwd(engram_params, engram_cfg, jnp.asarray(padded))[0, len(seq) - 1])
                )
            )
        assert list(out[r]) == seq[lengths[r] :], f"row {r}"


# -- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(engram_layer_ids=(1, 8)), r"engram_layer_ids=\[1, 8\]"),
        (dict(engram_layer_ids=(4, 1)), r"engram_layer_ids=\[4, 1\]"),
        (
            dict(engram_num_embeddings=(462, 631)),
            r"engram_num_embeddings=\[462, 631\].*\[462, 630\]",
        ),
        (dict(engram_num_embeddings=(462,)), r"engram_num_embeddings=\[462\]"),
        (dict(engram_head_dim=48), "engram_head_dim=48"),
        (dict(engram_pad_id=512), "engram_pad_id=512"),
        (dict(engram_vocab_size=1 << 28), "2\\*\\*28"),
    ],
)
def test_bad_engram_configs_are_named(engram_cfg, change, message):
    with pytest.raises(ValueError, match=message):
        engram_cfg.replace(**change)


def test_a_tokenizer_of_another_vocabulary_is_named(engram_cfg):
    with pytest.raises(
        ValueError, match=r"230 distinct Engram ids.*engram_compressed_vocab_size=231"
    ):
        byte_token_map(engram_cfg.replace(engram_compressed_vocab_size=231))


def test_from_dict_reads_the_released_engram_keys():
    cfg = ModelConfig.from_dict(
        {**v41_flash().to_dict(), "engram_num_embeddings": [384006168, 384016682]}
    )
    assert cfg.engram_table_rows == (384006168, 384016682)
    with pytest.raises(ValueError, match=r"unknown config keys.*engram_bogus"):
        ModelConfig.from_dict({**v41_flash().to_dict(), "engram_bogus": 1})


# -- checkpoints ------------------------------------------------------------------------------


def test_released_format_round_trip(engram_cfg, engram_params, tmp_path):
    from safetensors import safe_open

    from dsv4.checkpoint import load_pretrained, quantize_params_like_checkpoint, save_pretrained

    save_pretrained(engram_params, engram_cfg, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
        names = set(f.keys())
        assert engram.TOKEN_MAP not in names  # derived, never stored
        rows = engram_cfg.engram_table_rows[1]
        assert f.get_slice("layers.4.engram.embed.weight").get_shape() == [rows, 32]
        assert f.get_slice("layers.4.engram.embed.scale").get_shape() == [rows, 1]
        assert f.get_slice("layers.4.engram.embed.scale").get_dtype() == "F8_E8M0"
        assert f.get_slice("layers.4.engram.wkv.weight").get_dtype() == "F8_E4M3"
    cfg, loaded = load_pretrained(tmp_path, progress=False)
    assert cfg == engram_cfg
    want = quantize_params_like_checkpoint(engram_params, engram_cfg)
    assert set(loaded) == set(want)
    for name in want:
        np.testing.assert_array_equal(np.asarray(loaded[name]), np.asarray(want[name]), name)


def test_table_rows_dequantise_with_their_row_scales():
    import ml_dtypes

    from dsv4.checkpoint import dequant_fp8_rows, quant_fp8_rows

    values = np.array([[1.0] * 32 + [0.5] * 32, [-2.0] * 64], ml_dtypes.float8_e4m3fn)
    scales = np.array([[128, 126], [127, 120]], np.uint8)  # 2^1, 2^-1, 2^0, 2^-7
    got = dequant_fp8_rows(values.view(np.uint8), scales, 32)
    want = np.array([[2.0] * 32 + [0.25] * 32, [-2.0] * 32 + [-2.0 / 128] * 32], np.float32)
    np.testing.assert_array_equal(got, want)
    q, s = quant_fp8_rows(want, 32)
    np.testing.assert_array_equal(dequant_fp8_rows(q.view(np.uint8), s, 32), want)


def test_token_map_comes_from_the_checkpoints_tokenizer(engram_cfg, engram_params, tmp_path):
    from tokenizers import Tokenizer, models

    from dsv4.checkpoint import CheckpointError, load_pretrained, save_pretrained
    from dsv4.engram_hash import compressed_token_map

    words = ["<pad>", "The", "the", " THE ", "café", "cafe", "Ｃａｆｅ", "a  b", "a b", "x", "y"]
    words += [f"w{i}" for i in range(300)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    want, count = compressed_token_map(tok, 512)
    assert count == len(words) - 5  # The/the/THE, café/cafe/Ｃａｆｅ, a  b/a b collide
    cfg = engram_cfg.replace(engram_compressed_vocab_size=count)
    params = dict(engram_params, **{engram.TOKEN_MAP: jnp.asarray(want, jnp.int32)})
    save_pretrained(params, cfg, tmp_path)
    tok.save(str(tmp_path / "tokenizer.json"))
    _, loaded = load_pretrained(tmp_path, progress=False)
    np.testing.assert_array_equal(np.asarray(loaded[engram.TOKEN_MAP]), want)
    assert (want[len(words) :] == DEAD).all()
    # a config whose compressed vocabulary is not this tokenizer's is refused, naming both
    with pytest.raises(CheckpointError, match=rf"{count} distinct Engram ids.*={count + 1}"):
        load_pretrained(tmp_path, config=cfg.replace(engram_compressed_vocab_size=count + 1))


# -- the paged step ---------------------------------------------------------------------------


def test_paged_step_with_engram_matches_reference(engram_params, engram_cfg):
    """Random schedules through the real scheduler in a pool small enough to preempt: chunks
    cut anywhere, prefix hits of a shared 40-token prefix (the n-gram history before a hit comes
    from the prompt tokens), drafts accepted and rejected; DEAD tokens inside the sequences."""
    from paged_harness import Harness, random_schedule, shared_prefix_seqs

    from dsv4.paged import records as R

    rng = np.random.default_rng(11)
    seqs = shared_prefix_seqs(rng, 4, 40, (48, 65))
    width = 64
    toks = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        toks[i, : len(s.tokens)] = s.tokens
    ref = np.asarray(jax.jit(reference.forward, static_argnums=1)(engram_params, engram_cfg, toks))
    h = Harness(engram_cfg, engram_params, R.CacheFormats.EXACT, num_blocks=32,
                request_buckets=(8,), num_speculative_tokens=2)  # fmt: skip
    random_schedule(h, seqs, rng, spec_k=2, max_running=4)
    worst = 0.0
    for s in seqs:
        computed = sorted(p for sid, p in h.logits if sid == s.sid)
        assert computed[-1] == len(s.tokens) - 1
        for p in computed:
            worst = max(worst, float(np.abs(h.logits[(s.sid, p)] - ref[s.sid, p]).max()))
    assert worst <= TOL, worst
    st = h.stats
    assert st.num_preempted > 0 and max(st.prefix_hits) >= 32, st
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens, st


def test_build_batch_needs_the_tokens_before_the_chunk(engram_cfg):
    from cache.layout import for_model
    from dsv4.paged import records as R
    from dsv4.paged.batch import StepRequest, build_batch, group_infos
    from dsv4.paged.pools import PoolLayout, cache_desc  # noqa: F401

    config = for_model(cache_desc(engram_cfg, R.CacheFormats.EXACT, block_size=16,
                                  swa_block_size=4), num_gpu_blocks_override=40)  # fmt: skip
    ids = [[1] if g.kind == "ring" else [1, 2, 3, 4] for g in group_infos(config)]
    req = StepRequest(token_ids=[5, 6], start=2, block_ids=ids, req_id="a", prev_tokens=[9])
    with pytest.raises(ValueError, match=r"'a'.*position 2.*1 prev_tokens.*the 2 before"):
        build_batch([req], config, max_model_len=64, engram_lookback=3)
    req.prev_tokens = [8, 9]
    batch = build_batch([req], config, max_model_len=64, engram_lookback=3)
    assert batch.engram_prev[0].tolist() == [9, 8, -1]


def test_host_tables_give_the_device_tables_results(engram_cfg, engram_params, tmp_path):
    """engram_tables="host": the tables stay memory-mapped fp8 bytes (`HostTable`), rows are
    fetched per step through the host (`table_rows`, the one place every path reads rows);
    the reference and a save round trip give exactly what device tables give."""
    from dsv4.checkpoint import load_pretrained, save_pretrained

    save_pretrained(engram_params, engram_cfg, tmp_path / "a")
    _, dev = load_pretrained(tmp_path / "a", engram_tables="device", progress=False)
    _, host = load_pretrained(tmp_path / "a", engram_tables="host", progress=False)
    table = host["layers.4.engram.embed.weight"]
    assert isinstance(table, engram.HostTable) and table.shape == (630, 32)
    tokens = jnp.asarray(np.random.default_rng(5).integers(3, 300, size=(2, 20)), jnp.int32)
    fwd = jax.jit(reference.forward, static_argnums=1)
    np.testing.assert_array_equal(
        np.asarray(fwd(host, engram_cfg, tokens)), np.asarray(fwd(dev, engram_cfg, tokens))
    )
    # saving writes a host table's stored bytes back as they are: the same values as saving
    # the device table (whose e4m3 bytes may differ: 1.75 is 224 * 2^-7 or 448 * 2^-8)
    save_pretrained(host, engram_cfg, tmp_path / "b")
    _, back = load_pretrained(tmp_path / "b", engram_tables="device", progress=False)
    for name in dev:
        np.testing.assert_array_equal(np.asarray(back[name]), np.asarray(dev[name]), name)
    with pytest.raises(ValueError, match=r"row ids span \[0, 630\]"):
        table.gather(np.array([0, 630]))


# The released V4.1-Flash inference/config.json (every key, as published).
RELEASED_INFERENCE_CONFIG = {
    "vocab_size": 129280, "dim": 5120, "moe_inter_dim": 2304, "n_layers": 40, "n_mtp_layers": 3,
    "dspark_block_size": 5, "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [37, 38, 39], "dspark_markov_rank": 256,
    "dspark_n_routed_experts": 128, "dspark_n_activated_experts": 3, "n_heads": 64,
    "n_routed_experts": 384, "n_shared_experts": 1, "n_activated_experts": 6,
    "score_func": "sqrtsoftplus", "route_scale": 1.5, "swiglu_limit": 10.0, "q_lora_rank": 1280,
    "head_dim": 512, "rope_head_dim": 64, "norm_eps": 1e-20, "o_groups": 8, "o_lora_rank": 1024,
    "window_size": 128, "kv_source_layers": [2, 8, 14, 20],
    "index_source_layers": [2, 8, 14, 20, 24, 28, 32, 36], "original_seq_len": 65536,
    "rope_theta": 10000, "rope_factor": 16, "beta_fast": 32, "beta_slow": 1,
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "candidate_source_layer": 20,
    "candidate_topk_blocks": 2048, "candidate_block_size": 8, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "hc_eps": 1e-06, "engram_layer_ids": [1, 14],
    "engram_vocab_size": 16000000, "engram_num_embeddings": [384006168, 384016682],
    "engram_max_ngram_size": 4, "engram_pad_id": 2, "engram_compressed_vocab_size": 99092,
    "dtype": "fp8", "expert_dtype": "fp4", "compress_rope_theta": 160000,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
    "vision_n_layers": 32, "vision_dim": 1024, "vision_n_heads": 16, "vision_inter_dim": 2816,
    "vision_patch_size": 14, "vision_downsample_ratio": 3, "vision_max_n_token": 1024,
    "vision_min_pixels": 295936, "vision_max_wh_ratio": None, "image_token_id": 129264,
    "engram_n_heads": 8, "engram_head_dim": 256, "vision_rope_theta": 10000,
}  # fmt: skip


def test_the_released_inference_config_parses_whole():
    cfg = ModelConfig.from_dict(RELEASED_INFERENCE_CONFIG)
    assert cfg == v41_flash()
    assert cfg.engram_table_rows == (384006168, 384016682) and cfg.engram_columns == 24
    assert (cfg.dspark_noise_token_id, cfg.dspark_markov_rank) == (128799, 256)
    with pytest.raises(ValueError, match=r"engram_num_embeddings=\[384006168, 1\]"):
        ModelConfig.from_dict(
            {**RELEASED_INFERENCE_CONFIG, "engram_num_embeddings": [384006168, 1]}
        )


def test_stage_copies_of_the_shared_embedding_and_head_are_skipped(
    engram_cfg, engram_params, tmp_path, caplog
):
    """A checkpoint written from a torch model whose drafter stages alias the shared embedding
    and head may carry them as mtp.{i}.embed.weight / head.weight: skipped (with the log line),
    not an error; any other stray mtp.* tensor still is one."""
    import json
    import logging

    from safetensors.numpy import save_file

    from dsv4.checkpoint import CheckpointError, load_pretrained, save_pretrained

    save_pretrained(engram_params, engram_cfg, tmp_path, max_shard_bytes=1 << 30)
    index_file = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    extra = {"mtp.2.embed.weight": np.zeros((4, 4), np.float32),
             "mtp.2.head.weight": np.zeros((4, 4), np.float32)}  # fmt: skip
    save_file(extra, str(tmp_path / "extra.safetensors"))
    index["weight_map"].update(dict.fromkeys(extra, "extra.safetensors"))
    index_file.write_text(json.dumps(index))
    with caplog.at_level(logging.WARNING, logger="dsv4.checkpoint"):
        _, loaded = load_pretrained(tmp_path, progress=False)
    assert "mtp.2.head.weight" not in loaded
    assert any("mtp_shared: 2" in r.getMessage() for r in caplog.records)
    save_file({"mtp.1.bogus.weight": np.zeros(2, np.float32)}, str(tmp_path / "extra.safetensors"))
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k not in extra}
    index["weight_map"]["mtp.1.bogus.weight"] = "extra.safetensors"
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"(?s)unexpected tensors.*mtp\.1\.bogus\.weight"):
        load_pretrained(tmp_path, progress=False)
