"""Checkpoint I/O: the released safetensors format (fp8 tiles, packed fp4 experts, e8m0 scales)
and our orbax format, on tiny_v41 random params.

The expected values are computed here independently of ``dsv4.checkpoint``: raw bytes come from
the ``safetensors`` package's own parser (`safetensors.deserialize`), e4m3 and e2m1 codes are
decoded from their bit fields, and corrupt files are hand-built with a minimal writer below.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import struct

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors

from dsv4 import checkpoint as ck
from dsv4.config import ModelConfig, tiny_v41
from dsv4.params import Storage, checkpoint_tensors, init_params, param_specs

# e2m1 code -> value, written out from the format (bit 3 sign, 2 exponent bits, 1 mantissa bit)
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)
SHARD_BYTES = 400_000  # tiny_v41's checkpoint is ~1.3 MB: 4 shards

# -- independent helpers ---------------------------------------------------------------------


def e4m3_value(b: np.ndarray) -> np.ndarray:
    """e4m3fn bytes -> float64 from the bit fields (bias 7, subnormals at exponent 0)."""
    b = b.astype(np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 0x7
    normal = (1 + man / 8) * np.exp2(exp - 7.0)
    sub = (man / 8) * 2.0**-6
    return sign * np.where(exp == 0, sub, normal)


def e8m0_value(b: np.ndarray) -> np.ndarray:
    return np.exp2(b.astype(np.float64) - 127)


def write_safetensors(path, tensors: dict, header_bytes: bytes | None = None) -> None:
    """Minimal writer: ``tensors`` = name -> (dtype string, shape, raw bytes), in file order."""
    header, blobs, offset = {}, [], 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset]}
        offset += len(data)
        header[name]["data_offsets"].append(offset)
        blobs.append(data)
    if header_bytes is None:
        header_bytes = json.dumps(header).encode()
        header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for blob in blobs:
            f.write(blob)


def read_raw(ckpt_dir) -> dict:
    """Every tensor of a checkpoint directory as name -> (dtype, shape, bytes), via the
    safetensors package's own parser."""
    out = {}
    for fname in sorted(os.listdir(ckpt_dir)):
        if fname.endswith(".safetensors"):
            with open(os.path.join(ckpt_dir, fname), "rb") as f:
                for name, info in safetensors.deserialize(f.read()):
                    out[name] = (info["dtype"], tuple(info["shape"]), bytes(info["data"]))
    return out


def write_checkpoint(path, cfg: ModelConfig, tensors: dict, header_bytes=None) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf_dict(), f)
    write_safetensors(os.path.join(path, "model.safetensors"), tensors, header_bytes)
    return str(path)


def u8(raw: tuple) -> np.ndarray:
    dtype, shape, data = raw
    return np.frombuffer(data, np.uint8).reshape(shape)


def assert_params_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert a[k].shape == b[k].shape, k
        x, y = np.asarray(a[k]), np.asarray(b[k])
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), k  # bit-identical


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cfg():
    return tiny_v41()


@pytest.fixture(scope="module")
def params(cfg):
    return init_params(cfg, 0, jnp.float32)


@pytest.fixture(scope="module")
def sharded(cfg, params, tmp_path_factory):
    path = tmp_path_factory.mktemp("sharded")
    ck.save_pretrained(params, cfg, path, max_shard_bytes=SHARD_BYTES)
    return path


@pytest.fixture(scope="module")
def loaded(sharded):
    return ck.load_pretrained(sharded, progress=False)


@pytest.fixture(scope="module")
def raw(sharded):
    return read_raw(sharded)


def load(path, **kw):
    return ck.load_pretrained(path, progress=False, **kw)


# -- round trips -----------------------------------------------------------------------------


def test_save_load_equals_quantize(cfg, params, sharded, loaded):
    shards = sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors"))
    assert len(shards) >= 3
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert set(index["weight_map"].values()) == set(shards)
    assert index["weight_map"].keys() == {t.name for t in checkpoint_tensors(cfg)}
    cfg2, got = loaded
    assert cfg2 == cfg
    assert_params_equal(got, ck.quantize_params_like_checkpoint(params, cfg))
    specs = param_specs(cfg)
    for k, v in got.items():
        assert v.dtype == jnp.float32, k
        assert v.shape == specs[k].shape, k
    # deterministic: a second load is bit-identical
    assert_params_equal(load(sharded)[1], got)


def test_stored_dtypes_match_checkpoint_tensors(cfg, raw):
    expected = {t.name: (t.dtype, tuple(t.shape)) for t in checkpoint_tensors(cfg)}
    assert {n: v[:2] for n, v in raw.items()} == expected


def test_values_match_independent_dequant(cfg, params, raw, loaded):
    """Decode a few stored tensors from their bytes here, and check the encoder's choices."""
    got = loaded[1]
    blk = cfg.fp8_block_size
    # fp8 tiles: layers.1.attn.wq_a (32 x 64) and the shared expert's w2 (64 x 64)
    for pname in ("layers.1.attn.wq_a.weight", "layers.4.ffn.shared_experts.w2.weight"):
        sname = pname.removesuffix(".weight") + ".scale"
        assert raw[pname][0] == "F8_E4M3" and raw[sname][0] == "F8_E8M0"
        v, s = e4m3_value(u8(raw[pname])), u8(raw[sname])
        x = np.asarray(params[pname], np.float64)
        o, i = v.shape
        assert s.shape == (math.ceil(o / blk), math.ceil(i / blk))
        want = np.empty_like(v)
        for a in range(s.shape[0]):
            for b in range(s.shape[1]):
                tile = np.s_[a * blk : (a + 1) * blk, b * blk : (b + 1) * blk]
                want[tile] = v[tile] * e8m0_value(s[a, b])
                # scale = 2^ceil(log2(amax / 448))
                amax = np.max(np.abs(x[tile]))
                assert int(s[a, b]) - 127 == math.ceil(math.log2(amax / 448)), (pname, a, b)
                # nearest e4m3 (relative step 2^-3 for normals, so error <= 2^-4 relative)
                scale = e8m0_value(s[a, b])
                err = np.abs(want[tile] - x[tile])
                assert np.all(err <= np.maximum(np.abs(x[tile]) * 2**-4, scale * 2**-10))
        np.testing.assert_array_equal(np.asarray(got[pname]), want.astype(np.float32))
    # fp4: expert 3 of layer 2's w2 (64 x 64 -> packed 64 x 32, scales 64 x 2)
    pname, e = "layers.2.ffn.experts.w2.weight", 3
    wname = f"layers.2.ffn.experts.{e}.w2.weight"
    sname = wname.removesuffix(".weight") + ".scale"
    assert raw[wname][0] == "I8" and raw[sname][0] == "F8_E8M0"
    packed, s = u8(raw[wname]), u8(raw[sname])
    o, half = packed.shape
    x = np.asarray(params[pname][e], np.float64)
    want = np.empty((o, 2 * half))
    for r in range(o):
        for c in range(2 * half):
            byte = int(packed[r, c // 2])
            code = byte & 0xF if c % 2 == 0 else byte >> 4
            want[r, c] = E2M1[code] * e8m0_value(s[r, c // 32])
    for r in range(o):
        for g in range(s.shape[1]):
            amax = np.max(np.abs(x[r, g * 32 : (g + 1) * 32]))
            assert int(s[r, g]) - 127 == math.ceil(math.log2(amax / 6))
    # nearest e2m1: the gap between neighbours is at most 2 (4 -> 6) times the scale
    assert np.all(np.abs(want - x) <= np.repeat(e8m0_value(s), 32, axis=1))
    np.testing.assert_array_equal(np.asarray(got[pname][e]), want.astype(np.float32))
    # bf16 and f32 tensors: the bytes are the rounded / exact values
    bf = np.frombuffer(raw["layers.0.attn.q_norm.weight"][2], ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(got["layers.0.attn.q_norm.weight"]), bf)
    np.testing.assert_array_equal(
        bf, np.asarray(params["layers.0.attn.q_norm.weight"]).astype(ml_dtypes.bfloat16)
    )
    f32 = np.frombuffer(raw["layers.0.hc_attn_fn"][2], "<f4").reshape(raw["layers.0.hc_attn_fn"][1])
    np.testing.assert_array_equal(f32, np.asarray(params["layers.0.hc_attn_fn"]))


def test_reload_of_saved_loaded_is_idempotent(cfg, loaded, tmp_path):
    ck.save_pretrained(loaded[1], cfg, tmp_path)  # single file this time
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    assert_params_equal(load(tmp_path)[1], loaded[1])


def test_transformers_storage_dtype_in_config_json(cfg, loaded, sharded, tmp_path):
    """The released config.json, as transformers writes it, carries the torch storage dtype at
    the top level ("dtype": "bfloat16", or "torch_dtype"); it must load as before."""
    shutil.copytree(sharded, tmp_path, dirs_exist_ok=True)
    with open(tmp_path / "config.json") as f:
        hf = json.load(f)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({**hf, "dtype": "bfloat16", "torch_dtype": "bfloat16"}, f)
    cfg2, got = load(tmp_path)
    assert cfg2 == cfg
    assert_params_equal(got, loaded[1])


def test_load_bf16_keeps_f32_tensors(cfg, params, sharded):
    _, got = load(sharded, dtype=jnp.bfloat16)
    want = ck.quantize_params_like_checkpoint(params, cfg)
    for name, spec in param_specs(cfg).items():
        if spec.storage is Storage.F32:
            assert got[name].dtype == jnp.float32, name
            np.testing.assert_array_equal(got[name], want[name])
        else:
            assert got[name].dtype == jnp.bfloat16, name
            # fp8 / fp4 / bf16 values are all exactly representable in bf16
            np.testing.assert_array_equal(got[name], want[name].astype(jnp.bfloat16))


@pytest.mark.parametrize(
    "overrides", [{"dtype": "bf16"}, {"dtype": "bf16", "expert_dtype": None}], ids=str
)
def test_bf16_linears(params, overrides, tmp_path):
    cfg = tiny_v41(**overrides)  # same shapes as tiny_v41: the same params fit
    ck.save_pretrained(params, cfg, tmp_path)
    stored = {name: v[0] for name, v in read_raw(tmp_path).items()}
    assert stored["layers.0.attn.wq_a.weight"] == "BF16"
    assert "layers.0.attn.wq_a.scale" not in stored
    fp4 = overrides.get("expert_dtype", "fp4") == "fp4"
    assert stored["layers.0.ffn.experts.0.w1.weight"] == ("I8" if fp4 else "BF16")
    cfg2, got = load(tmp_path)
    assert cfg2 == cfg
    assert_params_equal(got, ck.quantize_params_like_checkpoint(params, cfg))


def test_save_rejects_mismatched_params(cfg, params, tmp_path):
    bad = dict(params)
    del bad["layers.0.attn.wkv.weight"]
    bad["layers.0.attn.extra"] = bad["norm.weight"]
    bad["norm.weight"] = jnp.zeros(3)
    with pytest.raises(ValueError) as exc:
        ck.save_pretrained(bad, cfg, tmp_path)
    msg = str(exc.value)
    for name in ("layers.0.attn.wkv.weight", "layers.0.attn.extra", "norm.weight"):
        assert name in msg


# -- hand-built bytes ------------------------------------------------------------------------


def test_fp4_nibble_order_and_e8m0_scales():
    # row 0: byte 0x21 -> codes (1, 2) = (0.5, 1.0), scale byte 128 = 2
    # row 1: byte 0xF9 -> codes (9, 15) = (-0.5, -6), scale byte 126 = 1/2
    packed = np.array([[0x21], [0xF9]], np.uint8).view(np.int8)
    scale = np.array([[128], [126]], np.uint8)
    np.testing.assert_array_equal(
        ck.dequant_fp4(packed, scale), np.array([[1.0, 2.0], [-0.25, -3.0]], np.float32)
    )
    np.testing.assert_array_equal(
        ck.e8m0_to_float(np.array([0, 1, 127, 128, 254], np.uint8)),
        np.array([2.0**-127, 2.0**-126, 1, 2, 2.0**127], np.float32),
    )
    # encoding: amax 6 -> scale byte 127; (0.5, 1) -> 0x21, (-6, 0) -> 0x0F; ties to even:
    # 0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4
    x = np.zeros((1, 32), np.float32)
    x[0, :8] = [0.5, 1.0, -6.0, 0.0, 0.25, 0.75, 2.5, 5.0]
    q, s = ck.quant_fp4(x)
    assert s.view(np.uint8).tolist() == [[127]]
    assert q.view(np.uint8)[0, :4].tolist() == [0x21, 0x0F, 0x20, 0x64]
    assert not q.view(np.uint8)[0, 4:].any()
    # power-of-two scale: amax 7 -> 2^ceil(log2(7/6)) = 2, values halved
    q, s = ck.quant_fp4(np.full((1, 32), 7.0))
    assert s.view(np.uint8).tolist() == [[128]]
    assert (q.view(np.uint8) == 0x66).all()  # 3.5 ties to even -> 4 (code 6) in both nibbles


def test_fp8_tile_with_known_scale():
    # 0x38 = e4m3 1.0, 0x40 = 2.0; two 2x2 tiles (block 2) with scale bytes 130 (8) and 127 (1)
    v = np.array([[0x38, 0x38, 0x40, 0xC0], [0x38, 0x00, 0x40, 0x40]], np.uint8)
    s = np.array([[130, 127]], np.uint8)
    np.testing.assert_array_equal(
        ck.dequant_fp8(v, s, 2), np.array([[8, 8, 2, -2], [8, 0, 2, 2]], np.float32)
    )
    # partial tiles: a 3x3 weight with block 2 has 2x2 scales
    v3 = np.full((3, 3), 0x38, np.uint8)
    s3 = np.array([[127, 128], [129, 130]], np.uint8)
    np.testing.assert_array_equal(
        ck.dequant_fp8(v3, s3, 2), np.array([[1, 1, 2], [1, 1, 2], [4, 4, 8]], np.float32)
    )
    # encoding: amax 448 -> scale byte 127, values saturate / round to nearest even
    q, s = ck.quant_fp8(np.array([[448.0, 1.0625], [-1.1875, 0.0]]), 2)
    assert s.view(np.uint8).tolist() == [[127]]
    assert q.astype(np.float32).tolist() == [[448.0, 1.0], [-1.25, 0.0]]
    q, s = ck.quant_fp8(np.zeros((2, 2)), 2)  # an all-zero tile: smallest scale
    assert s.view(np.uint8).tolist() == [[0]]


def test_hand_built_bytes_in_a_checkpoint(cfg, raw, tmp_path):
    t = dict(raw)
    # expert 1 of layer 0, w1 (64 x 64 -> packed 64 x 32): every byte 0x21, scales 128 -> 1, 2
    dtype, shape, _ = t["layers.0.ffn.experts.1.w1.weight"]
    t["layers.0.ffn.experts.1.w1.weight"] = (dtype, shape, bytes([0x21]) * math.prod(shape))
    dtype, shape, _ = t["layers.0.ffn.experts.1.w1.scale"]
    t["layers.0.ffn.experts.1.w1.scale"] = (dtype, shape, bytes([128]) * math.prod(shape))
    # wq_a of layer 0 (32 x 64, tiles 1 x 2): values 1.0 and 2.0, scale bytes 130 and 127
    dtype, shape, _ = t["layers.0.attn.wq_a.weight"]
    vals = np.full(shape, 0x38, np.uint8)
    vals[:, 32:] = 0x40
    t["layers.0.attn.wq_a.weight"] = (dtype, shape, vals.tobytes())
    t["layers.0.attn.wq_a.scale"] = ("F8_E8M0", (1, 2), bytes([130, 127]))
    _, got = load(write_checkpoint(tmp_path, cfg, t))
    w1 = np.asarray(got["layers.0.ffn.experts.w1.weight"][1])
    np.testing.assert_array_equal(w1, np.tile([1.0, 2.0], (64, 32)))
    wq = np.asarray(got["layers.0.attn.wq_a.weight"])
    assert (wq[:, :32] == 8.0).all() and (wq[:, 32:] == 2.0).all()


# -- broken checkpoints ----------------------------------------------------------------------


def error_of(path) -> str:
    with pytest.raises(ValueError) as exc:
        load(path)
    return str(exc.value)


def test_missing_extra_mistyped_misshaped_all_reported(cfg, raw, tmp_path):
    t = dict(raw)
    del t["layers.2.attn.wkv.scale"]
    t["layers.0.attn.bogus.weight"] = ("BF16", (2,), bytes(4))
    t["norm.weight"] = ("BF16", (65,), bytes(130))
    dtype, shape, data = t["layers.0.attn.attn_sink"]
    t["layers.0.attn.attn_sink"] = ("BF16", shape, bytes(2 * math.prod(shape)))
    msg = error_of(write_checkpoint(tmp_path, cfg, t))
    assert "layers.2.attn.wkv.scale" in msg
    assert "layers.0.attn.bogus.weight" in msg
    assert "norm.weight: expected [64], got [65]" in msg
    assert "layers.0.attn.attn_sink: expected F32, got BF16" in msg
    assert "(4 problems)" in msg


@pytest.mark.parametrize("kind", ["missing", "extra", "shape", "dtype", "bytes"])
def test_single_problem(cfg, raw, tmp_path, kind):
    t = dict(raw)
    name = "layers.5.attn.indexer.wq_b.weight"
    dtype, shape, data = t[name]
    if kind == "missing":
        del t[name]
    elif kind == "extra":
        name = "layers.0.ffn.experts.8.w1.weight"  # one expert too many
        t[name] = t["layers.0.ffn.experts.7.w1.weight"]
    elif kind == "shape":
        t[name] = (dtype, (shape[1], shape[0]), data)
    elif kind == "dtype":
        t[name] = ("I8", shape, data)
    else:  # the byte range does not match dtype x shape
        t[name] = (dtype, shape, data[:-3])
    msg = error_of(write_checkpoint(tmp_path, cfg, t))
    assert name in msg and "(1 problem)" in msg, msg


def test_truncated_file(cfg, raw, tmp_path):
    path = write_checkpoint(tmp_path, cfg, raw)
    last = list(raw)[-1]
    f = os.path.join(path, "model.safetensors")
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) - 10)
    msg = error_of(path)
    assert last in msg and "model.safetensors" in msg and "truncated" in msg


def test_bad_headers(cfg, raw, tmp_path):
    path = write_checkpoint(tmp_path / "a", cfg, raw, header_bytes=b"{not json at all}")
    msg = error_of(path)
    assert "model.safetensors" in msg and "JSON" in msg
    path = write_checkpoint(tmp_path / "b", cfg, {})
    with open(os.path.join(path, "model.safetensors"), "r+b") as fh:
        fh.write(struct.pack("<Q", 10**12))
    msg = error_of(path)
    assert "model.safetensors" in msg and "header length" in msg
    path = write_checkpoint(tmp_path / "c", cfg, {})
    with open(os.path.join(path, "model.safetensors"), "wb") as fh:
        fh.write(b"abc")
    assert "too short" in error_of(path)


def test_index_problems(cfg, sharded, tmp_path):
    missing = tmp_path / "missing"
    shutil.copytree(sharded, missing)
    os.remove(missing / "model-00002-of-00004.safetensors")
    msg = error_of(missing)
    assert "model-00002-of-00004.safetensors" in msg and "missing" in msg
    wrong = tmp_path / "wrong"
    shutil.copytree(sharded, wrong)
    with open(wrong / "model.safetensors.index.json") as f:
        index = json.load(f)
    index["weight_map"]["embed.weight"] = "model-00004-of-00004.safetensors"
    with open(wrong / "model.safetensors.index.json", "w") as f:
        json.dump(index, f)
    msg = error_of(wrong)
    assert "embed.weight" in msg and "model-00004-of-00004.safetensors" in msg


def test_nan_scale_and_nan_fp8_rejected(cfg, raw, tmp_path):
    t = dict(raw)
    name = "layers.6.ffn.shared_experts.w1.scale"
    dtype, shape, data = t[name]
    t[name] = (dtype, shape, bytes([255]) + data[1:])
    msg = error_of(write_checkpoint(tmp_path / "a", cfg, t))
    assert name in msg and "255" in msg
    t = dict(raw)
    name = "layers.3.ffn.experts.2.w3.scale"
    dtype, shape, data = t[name]
    t[name] = (dtype, shape, data[:-1] + bytes([255]))
    msg = error_of(write_checkpoint(tmp_path / "b", cfg, t))
    assert name in msg and "255" in msg
    t = dict(raw)
    name = "layers.2.attn.wo_b.weight"
    dtype, shape, data = t[name]
    t[name] = (dtype, shape, bytes([0x7F]) + data[1:])
    assert name in error_of(write_checkpoint(tmp_path / "c", cfg, t))


def test_out_of_scope_tensors_are_skipped(cfg, raw, loaded, tmp_path, caplog):
    t = dict(raw)
    t["layers.1.engram.embed.weight"] = ("F8_E4M3", (10, 32), bytes(320))
    t["layers.1.engram.embed.scale"] = ("F8_E8M0", (10, 1), bytes(10))
    t["mtp.0.attn.wkv.weight"] = ("F8_E4M3", (64, 64), bytes(64 * 64))
    t["layers.3.ffn.gate.bias_vl"] = ("F32", (8,), bytes(32))
    t["vision.blocks.0.attn.qkv.weight"] = ("BF16", (4, 4), bytes(32))
    t["aligner.proj.weight"] = ("BF16", (2,), bytes(4))
    t["image_newline"] = ("BF16", (64,), bytes(128))
    with caplog.at_level(logging.WARNING, logger="dsv4.checkpoint"):
        _, got = load(write_checkpoint(tmp_path, cfg, t))
    assert_params_equal(got, loaded[1])
    summaries = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(summaries) == 1 and "skipped 7 tensors" in summaries[0], summaries


def test_missing_files(cfg, tmp_path):
    assert "not a checkpoint directory" in error_of(tmp_path / "nope")
    os.makedirs(tmp_path / "empty")
    assert "config.json" in error_of(tmp_path / "empty")
    with pytest.raises(ValueError, match=r"no model\.safetensors"):
        load(tmp_path / "empty", config=cfg)


# -- orbax -----------------------------------------------------------------------------------


def test_orbax_round_trip(cfg, params, tmp_path):
    mixed = dict(params)
    mixed["head.weight"] = params["head.weight"].astype(jnp.bfloat16)
    ck.save_params(mixed, tmp_path / "orb")
    assert_params_equal(ck.restore_params(tmp_path / "orb"), mixed)
    assert_params_equal(ck.restore_params(tmp_path / "orb", cfg=cfg), mixed)
    half = ck.restore_params(tmp_path / "orb", cfg=cfg, dtype=jnp.bfloat16)
    assert half["layers.0.hc_attn_fn"].dtype == jnp.float32  # stored F32 in the release
    assert half["layers.0.attn.wq_a.weight"].dtype == jnp.bfloat16
    with pytest.raises(ValueError) as exc:
        ck.restore_params(tmp_path / "orb", cfg=tiny_v41(moe_inter_dim=96, vocab_size=1024))
    msg = str(exc.value)
    assert "layers.0.ffn.experts.w1.weight: config expects [8, 96, 64], saved [8, 64, 64]" in msg
    assert "embed.weight" in msg and "head.weight" in msg
    with pytest.raises(ValueError, match=r"layers\.7\.attn\.indexer\.wq_b\.weight"):
        # layer 7 as an extra index source: its indexer tensors are missing from the save
        ck.restore_params(
            tmp_path / "orb",
            cfg=tiny_v41(
                compress_ratios=(0, 2, 2, 1, 1, 1, 1, 1, 0), index_source_layers=(1, 3, 5, 7)
            ),
        )


def test_model_names_come_from_one_table():
    """`dsv4.config.MODEL_PRESETS` is the one table of model names: the planner's models and
    the shipped checkpoints are its entries, and `load_pretrained` takes a shipped one by name."""
    from dsv4.config import MODEL_PRESETS
    from planner import plan

    assert {n: p.config for n, p in MODEL_PRESETS.items()} == plan.MODELS
    assert tuple(n for n, p in MODEL_PRESETS.items() if p.weights == "shipped") == ck.SHIPPED
    (name,) = ck.SHIPPED
    cfg, params = ck.load_pretrained(name, progress=False)
    want_cfg, want = ck.load_pretrained(ck.shipped_checkpoint(name), progress=False)
    assert cfg == want_cfg and cfg == MODEL_PRESETS[name].config()
    assert params.keys() == want.keys()
    for n in want:
        np.testing.assert_array_equal(np.asarray(params[n]), np.asarray(want[n]))
