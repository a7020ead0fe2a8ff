"""The kernel benchmark: `--quick` cost model on CPU for every kernel, the timed path with the
references at tiny shapes, the time budget, and the benchmark's inputs lowering for the TPU and
GPU kernels (no device needed)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import time

import numpy as np
import pytest

from benchmarks import kernels

KERNELS = {
    "window_attention",
    "sparse_attention",
    "indexer_r1",
    "indexer_r2",
    "indexer_r1_consumer",
    "indexer_r1_fp8",
    "indexer_r1_scoring_jnp",
    "compressor_r1",
    "compressor_r2",
}
TINY = [kernels.Shape("decode", 2, 2, 1024), kernels.Shape("prefill", 1, 16, 256)]


def test_quick_cost_model_covers_every_kernel(capsys):
    start = time.perf_counter()
    assert kernels.main(["--quick"]) == 0
    assert time.perf_counter() - start < 20
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out["backend"] == "cpu" and out["timed"] is False
    assert set(out["results"]) == KERNELS == set(kernels.BENCHES)
    n = len(kernels.shapes(quick=True))
    for name, rows in out["results"].items():
        assert len(rows) == n, name
        for row in rows:
            assert row["bytes"] > 0 and row["flops"] > 0, (name, row)
            assert row["time_s"] is None and "error" not in row, (name, row)


def test_released_decode_costs():
    """Decode batch 128 at 128k: what each kernel must read at least."""
    shape = kernels.Shape("decode", 128, 128, 131072)
    key_row = 128 * 2  # a bf16 index key
    for name, entries in (
        ("indexer_r1", 131072),
        ("indexer_r2", 65536),
        ("indexer_r1_consumer", 2048 * 8),
        ("indexer_r1_scoring_jnp", 131072),
    ):
        bench = kernels.BENCHES[name](shape, None, kernels.POOL_BYTES)
        assert bench.info["entries_scored"] == entries
        keys = 128 * entries * key_row
        assert keys <= bench.cost.bytes_accessed < 1.05 * keys, name
    fp8 = kernels.BENCHES["indexer_r1_fp8"](shape, None, kernels.POOL_BYTES)
    keys = 128 * 131072 * (128 + 4)  # e4m3 rows + f32 scales
    assert keys <= fp8.cost.bytes_accessed < 1.05 * keys
    r1 = kernels.BENCHES["compressor_r1"](shape, None, kernels.POOL_BYTES)
    r2 = kernels.BENCHES["compressor_r2"](shape, None, kernels.POOL_BYTES)
    assert r1.info["records"] == 128 and r2.info["records"] == 64  # half the pairs close
    assert r2.cost.bytes_accessed > 128 * 1024 * 4  # f32 [a | s] rows in


@pytest.mark.parametrize(("impl", "dtype"), [("tpu", "float32"), ("gpu", "bfloat16")])
def test_compressor_records_per_platform(impl, dtype):
    bench = kernels.BENCHES["compressor_r2"](TINY[0], impl, 1e6)
    assert bench.info["record_dtype"] == dtype


def test_timed_with_references_at_tiny_shapes():
    out = kernels.run_benchmark(
        sorted(KERNELS),
        quick=True,
        impl="reference",
        time_it=True,
        repeats=1,
        pool_bytes=1e6,
        shape_list=TINY[:1],
    )
    assert out["timed"] is True
    for name, rows in out["results"].items():
        for row in rows:
            assert "error" not in row, (name, row)
            assert row["time_s"] > 0 and row["bytes_per_s"] > 0, name
    (row,) = out["results"]["indexer_r1_scoring_jnp"]
    assert row["indexer"] == "indexer_r1"
    assert row["indexer_time_s"] == out["results"]["indexer_r1"][0]["time_s"]
    assert row["indexer_over_scoring"] == pytest.approx(row["indexer_time_s"] / row["time_s"])


def test_jnp_scores_match_the_reference_scores():
    """The scoring-only approximation computes the indexer's scores (grouped, padded)."""
    from pallas_kernels.indexer import reference

    shape = kernels.Shape("prefill", 1, 5, 256)
    bench = kernels.BENCHES["indexer_r1"](shape, "reference", 1e6)
    qi, w, keys, tables, req, pos, vis = bench.make_args(np.random.default_rng(1))
    got = kernels.jnp_scores(qi, w, keys, tables, req, vis, entries_per_block=64, group=2)
    dense = reference.dense_keys(keys, tables, req)
    want = reference.index_scores(qi, w, dense, vis)
    assert np.isinf(np.asarray(want)).any()  # the visible mask is exercised
    # bf16 scores (the indexer's bf16 roundings): the dots summed in another order may land one
    # bf16 ulp apart (2**-7 relative at most)
    assert str(qi.dtype) == "bfloat16"
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2**-7, atol=1e-4)


def test_budget_skips_timing():
    out = kernels.run_benchmark(
        ["indexer_r2", "compressor_r1"],
        quick=True,
        impl="reference",
        time_it=True,
        repeats=1,
        pool_bytes=1e6,
        budget_s=0.0,
        shape_list=TINY,
    )
    for rows in out["results"].values():
        for row in rows:
            assert row["skipped"] == "time budget" and row["time_s"] is None
            assert row["bytes"] > 0


def test_timing_order_puts_largest_decode_batch_first():
    shape_list = kernels.shapes(quick=False)
    first = shape_list[kernels.timing_order(shape_list)[0]]
    assert first.phase == "decode" and first.batch == max(kernels.DECODE_BATCHES)


def _aot():
    path = pathlib.Path(__file__).parents[1] / "pallas_kernels" / "aot.py"
    spec = importlib.util.spec_from_file_location("_kernels_bench_aot", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(KERNELS - {"indexer_r1_scoring_jnp"}))
def test_inputs_lower_for_tpu_and_gpu_kernels(name):
    """The benchmark's arguments are valid for the TPU (Mosaic) and GPU (Triton) kernels."""
    aot = _aot()
    shape = kernels.Shape("decode", 8, 8, 4096)
    for impl, lower, marker in (
        ("tpu", aot.lower_for_tpu, "tpu_custom_call"),
        ("gpu", aot.lower_for_gpu, "triton"),
    ):
        bench = kernels.BENCHES[name](shape, impl, 1e6)
        args = bench.make_args(np.random.default_rng(0))
        assert marker in lower(bench.run, *args), (name, impl)


def test_indexer_cost_counts_shared_key_streams():
    """Tokens of one request in a tile read the keys once (up to the tile's largest visible
    count); a decode batch (one token per request) reads them once per token."""
    vis = np.arange(1000, 1064)
    one_req = np.zeros(64, np.int32)
    kw = dict(k=512, per_block=64, cand_out=0, cap=None)
    alone = kernels.summed_indexer_cost(vis, **kw, token_req=one_req, tile=1).bytes_accessed
    shared = kernels.summed_indexer_cost(vis, **kw, token_req=one_req, tile=8).bytes_accessed
    key_row = kernels.INDEX_DIM * 2  # bf16 keys
    assert alone - shared == pytest.approx((vis.sum() - vis[7::8].sum()) * key_row, rel=0.01)
    decode = np.arange(64, dtype=np.int32)
    assert kernels.summed_indexer_cost(vis, **kw, token_req=decode, tile=8).bytes_accessed == alone
