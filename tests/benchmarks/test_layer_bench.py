"""The one-layer benchmark (issue 36 point 1d) at tiny widths on the CPU: its JSON, the bytes
counted by hand from the config, the layer's output finite and the same from run to run, the
memory skip and the time budget; the released-width programs traced without allocating."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from benchmarks import layer
from dsv4.params import Storage, param_specs

SHAPE = (2, 64)  # batch, context: past the window (8) and the top-k (16) of tiny_v41
ROW_KEYS = {"batch", "context", "time_s", "roofline_s", "roofline_pct", "bytes", "pool_bytes",
            "output_finite", "output_sum"}  # fmt: skip
BYTE_KEYS = {"weights_routed", "weights_shared", "weights_other", "experts_touched",
             "kv_window", "kv_sparse", "kv_indexer", "total"}  # fmt: skip


@pytest.fixture(scope="module")
def result():
    return layer.run_benchmark(
        ["full_r1"], widths="tiny", batches=(SHAPE[0],), contexts=(SHAPE[1],), records="BF16",
        repeats=2, time_it=True, budget_s=None, impl=None,
    )  # fmt: skip


def test_json_fields(result):
    assert result["benchmark"] == "layer" and result["widths"] == "tiny"
    assert result["timed"] is True and result["records"] == "BF16"
    assert result["peak_hbm_bytes_per_s"] is None  # a CPU: no roofline, no ratio
    assert result["flash_layer_kinds"]["full_r1"] == 1  # V4.1-Flash has one candidate source
    assert sum(result["flash_layer_kinds"].values()) == 40
    (row,) = result["results"]["full_r1"]
    assert set(row) >= ROW_KEYS and set(row["bytes"]) == BYTE_KEYS
    assert (row["batch"], row["context"]) == SHAPE
    assert row["time_s"] > 0 and row["roofline_s"] is None and row["roofline_pct"] is None
    assert "tpu_inference_scaled_s" not in row  # not its shape, and no peak here
    assert row["output_finite"] is True
    json.dumps(result)


def _weight_bytes(shape, storage) -> int:
    """Bytes of one tensor as released, by hand: fp8 e4m3 values and one e8m0 scale per 32 x 32
    tile; FP4 two values a byte and one scale per 32 inputs; bf16 2 bytes, f32 4."""
    n = math.prod(shape)
    *lead, o, i = shape if len(shape) > 1 else (1, shape[0])
    if storage is Storage.FP8:
        return n + math.prod(lead) * math.ceil(o / 32) * math.ceil(i / 32)
    if storage is Storage.FP4:
        return n // 2 + n // 32
    return n * {Storage.BF16: 2, Storage.F32: 4}[storage]


def test_bytes_counted_by_hand(result):
    cfg = layer.layer_config("full_r1", "tiny")
    (row,) = result["results"]["full_r1"]
    b, ctx = SHAPE
    by = row["bytes"]
    # KV, BF16 records: 2 bytes a value. Window: each token's last 8 rows of 64; sparse: the
    # top-16 entries of 64; indexer: every one of the 64 index keys of 32
    assert by["kv_window"] == b * 8 * 64 * 2
    assert by["kv_sparse"] == b * 16 * 64 * 2
    assert by["kv_indexer"] == b * ctx * 32 * 2
    # routed experts: 8 of which 2 a token; 2 tokens touch 8 (1 - (6/8)^2) = 3.5 of them, each
    # three 64 x 64 FP4 matrices
    assert by["experts_touched"] == pytest.approx(3.5)
    assert by["weights_routed"] == pytest.approx(3.5 * 3 * (64 * 64 // 2 + 64 * 64 // 32))
    assert by["weights_shared"] == 3 * (64 * 64 + 2 * 2)  # fp8 64 x 64, 2 x 2 tiles of 32
    specs = {n: s for n, s in param_specs(cfg).items() if n.startswith("layers.0.")}
    other = sum(
        _weight_bytes(s.shape, s.storage) for n, s in specs.items() if ".ffn.experts." not in n
    )
    assert by["weights_other"] == other - by["weights_shared"]
    kv = by["kv_window"] + by["kv_sparse"] + by["kv_indexer"]
    weights = by["weights_routed"] + by["weights_shared"] + by["weights_other"]
    assert by["total"] == pytest.approx(kv + weights)


def test_released_width_bytes_and_program_traced():
    """The device run's shape, traced: SM90 records (584-byte latents, 132-byte index keys),
    released widths (window 128, top-512, 384 experts of which 6)."""
    row = layer.trace("full_r1", (64, 4096))
    assert row["hidden"] == [64, 5120]
    by = row["bytes"]
    assert by["kv_window"] == 64 * 128 * 584
    assert by["kv_sparse"] == 64 * 512 * 584
    assert by["kv_indexer"] == 64 * 4096 * 132
    assert by["experts_touched"] == pytest.approx(384 * (1 - (1 - 6 / 384) ** 64))
    expert = 3 * (2304 * 5120 // 2 + 2304 * 5120 // 32)
    assert by["weights_routed"] == pytest.approx(by["experts_touched"] * expert)
    r2 = layer.trace("full_r2", (64, 65536))["bytes"]
    assert r2["kv_indexer"] == 64 * 32768 * 132  # ratio 2: half the entries


def test_output_is_deterministic(result):
    cfg = layer.layer_config("full_r1", "tiny")
    params = layer.released_params(cfg)
    again = layer.measure(cfg, params, SHAPE, records="BF16", repeats=1, timed=False, peak=None,
                          impl=None, blocks=(16, 4))  # fmt: skip
    (row,) = result["results"]["full_r1"]
    assert again["output_finite"] and again["output_sum"] == row["output_sum"]
    assert np.isfinite(row["output_sum"]) and row["output_sum"] != 0.0


def test_roofline_and_tpu_inference_ratio(monkeypatch):
    """With a known peak: roofline = bytes / peak and, at batch 64 / 4k, 1,345 us scaled by
    v7x's 7.38 TB/s over the peak (the shape skipped as too large: nothing runs)."""
    monkeypatch.setattr(layer, "_free_bytes", lambda: 1000)
    cfg = layer.layer_config("swa", "tiny")
    row = layer.measure(cfg, layer.released_params(cfg), (64, 4096), records="BF16", repeats=1,
                        timed=False, peak=2e12, impl=None, blocks=(16, 4))  # fmt: skip
    assert row["roofline_s"] == pytest.approx(row["bytes"]["total"] / 2e12)
    assert row["tpu_inference_scaled_s"] == pytest.approx(1345e-6 * 7.38e12 / 2e12)


def test_shape_that_does_not_fit_is_skipped(monkeypatch):
    monkeypatch.setattr(layer, "_free_bytes", lambda: 1000)
    out = layer.run_benchmark(["swa"], widths="tiny", batches=(2,), contexts=(64,),
                              records="BF16", repeats=1, time_it=False, budget_s=None,
                              impl=None)  # fmt: skip
    (row,) = out["results"]["swa"]
    assert row["skipped"].startswith("pools of ") and "GiB free" in row["skipped"]
    assert row["time_s"] is None and "output_sum" not in row


def test_budget_and_order():
    assert layer.shape_order((1, 8, 64), (4096, 65536))[:2] == [(64, 4096), (64, 65536)]
    out = layer.run_benchmark(["swa"], widths="tiny", batches=(1, 2), contexts=(64,),
                              records="BF16", repeats=1, time_it=False, budget_s=0.0,
                              impl=None)  # fmt: skip
    assert [r["skipped"] for r in out["results"]["swa"]] == ["time budget"] * 2


def test_bad_input_names_the_value():
    with pytest.raises(ValueError, match=r"kind='c4' is not one of \['full_r1'"):
        layer.layer_config("c4")
    with pytest.raises(ValueError, match="widths='huge'"):
        layer.layer_config("swa", "huge")
    with pytest.raises(SystemExit):
        layer.main(["--kinds", "c4"])
    with pytest.raises(SystemExit, match="--batches '0,8'"):
        layer.main(["--batches", "0,8"])


def test_decode_step_over_the_planned_pools_equals_the_reference():
    """The benchmark's pools and batch hold a real request: its prompt prefilled through the
    same blocks (over the random fill), then the planned decode step's logits equal
    `reference.forward`'s at the last position (f32 weights and records, one-layer model)."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from dsv4 import layers as L
    from dsv4.paged.batch import StepRequest, build_batch
    from dsv4.paged.step import paged_forward
    from dsv4.reference import forward

    cfg = layer.layer_config("full_r1", "tiny")
    params = layer.released_params(cfg, dtype=jnp.float32)
    b, ctx = 2, 40
    plan = layer.plan_pools(cfg, "EXACT", b, ctx, block_size=16, swa_block_size=4)
    tokens = np.random.default_rng(0).integers(3, cfg.vocab_size, (b, ctx)).astype(np.int32)
    prefill = [StepRequest(tokens[i, :-1].tolist(), 0, r.block_ids) for i, r in
               enumerate(plan.requests)]  # fmt: skip
    n = b * (ctx - 1)
    batch = build_batch(prefill, plan.config, max_model_len=ctx, token_buckets=(n,),
                        request_buckets=(b,))  # fmt: skip
    step = jax.jit(lambda p, q, s: paged_forward(p, cfg, plan.layout, q, s))
    _, pools = step(params, layer.random_pools(plan.layout), jax.tree.map(jnp.asarray, batch))
    decode = dataclasses.replace(plan.step, token_ids=jnp.asarray(tokens[:, -1]))
    h, _ = step(params, pools, decode)
    got = np.asarray(L.lm_head(params, h))
    want = np.asarray(jax.jit(lambda p, t: forward(p, cfg, t))(params, jnp.asarray(tokens)))
    np.testing.assert_allclose(got, want[:, -1], rtol=1e-4, atol=1e-4)
