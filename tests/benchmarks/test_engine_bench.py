"""benchmarks/engine.py on a small run: the engine for real (one 8-token bucket, batches 1 and
2), `dsv4.generate` replaced by a stand-in of known cost (its compile would dominate), so the
JSON line's shape and the ratios are checked in seconds; `python -m benchmarks.engine` is the
real thing."""

from __future__ import annotations

import json
import time

import jax.numpy as jnp
import pytest

from benchmarks import engine as bench

STEP_S = 0.05  # large next to the real cost of the stand-in call (a few ms on a loaded CI machine)
# The JSON's ratios are rounded to 3 decimals, and with the stand-in's slow tokens the engine's
# come out near 0.03: the checks allow that rounding (abs=1e-3) beside 1 %.


def test_json_line(monkeypatch, capsys):
    """The stand-in costs STEP_S a token on the benchmark's clock (real time plus a virtual
    offset it advances instead of sleeping: sleeps overshoot on a loaded machine)."""
    import types

    import dsv4.generation

    virtual = [0.0]

    def fake_generate(params, cfg, prompt, max_new_tokens):
        virtual[0] += STEP_S * max_new_tokens
        return jnp.zeros((prompt.shape[0], max_new_tokens), jnp.int32)

    monkeypatch.setattr(dsv4.generation, "generate", fake_generate)
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(
        perf_counter=lambda: time.perf_counter() + virtual[0]))  # fmt: skip
    argv = ["--batches", "1,2", "--prompt-len", "8", "--new-tokens", "4", "--repeats", "1",
            "--max-num-batched-tokens", "8", "--num-scheduler-steps", "2", "--token-buckets", "8", "--runs", "2"]  # fmt: skip
    assert bench.main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["benchmark"] == "engine" and out["token_buckets"] == [8]
    assert out["num_scheduler_steps"] == 2
    assert out["num_gpu_blocks"] == 64 * 2 and out["kv_pool_mib"] > 0  # 64 a request of batch 2
    for b in (1, 2):
        r = out["results"][f"batch_{b}"]
        gen = b * 4 / (STEP_S * 4)
        assert r["generate_tokens_per_s"] == pytest.approx(gen, rel=0.2)
        for key in ("engine_sync_tokens_per_s", "engine_tokens_per_s",
                    "engine_single_tokens_per_s", "engine_ms_per_step", "engine_host_ms_per_step",
                    "host_ms_per_step", "device_ms_per_step", "single_ms_per_step"):  # fmt: skip
            assert r[key] > 0, key
        assert r["loop_ms_per_step"] > 0
        assert r["engine_over_generate"] == pytest.approx(
            r["generate_tokens_per_s"] / r["engine_tokens_per_s"], rel=1e-2, abs=1e-3
        )
        assert r["single_over_generate"] == pytest.approx(
            r["generate_tokens_per_s"] / r["engine_single_tokens_per_s"], rel=1e-2, abs=1e-3
        )
        assert r["async_speedup"] == pytest.approx(
            r["engine_single_tokens_per_s"] / r["engine_sync_tokens_per_s"], rel=1e-2, abs=1e-3
        )
        assert set(r["ttft_ms"]) == {"p50", "p90", "p99"}
        assert r["generate_prefill_ms"] > 0
        assert r["ttft_over_generate_prefill"] == pytest.approx(
            r["ttft_ms"]["p50"] / r["generate_prefill_ms"], rel=0.01, abs=1e-3
        )
        assert r["engine_compilations"] == 0
        assert len(r["engine_over_generate_runs"]) == 2
        assert r["engine_over_generate"] in r["engine_over_generate_runs"]
        assert len(r["ttft_over_generate_prefill_runs"]) == 2
        assert r["ttft_over_generate_prefill"] in r["ttft_over_generate_prefill_runs"]
    # the README's table: one row per batch, the median ratio with the runs' range
    lines = bench.table(out).splitlines()
    assert len(lines) == 4 + 2 and lines[3].startswith("|---")
    assert f"a pool of 128 blocks ({out['kv_pool_mib']} MiB)" in lines[0]
    r = out["results"]["batch_2"]
    low, high = min(r["engine_over_generate_runs"]), max(r["engine_over_generate_runs"])
    assert f"| 2 | {r['generate_tokens_per_s']:.0f} |" in lines[5]
    assert f"{r['engine_over_generate']:.2f} [{low:.2f}, {high:.2f}]" in lines[5]
    ttft = r["ttft_over_generate_prefill_runs"]
    assert f"| {sum(ttft) / 2:.2f} [{min(ttft):.2f}, {max(ttft):.2f}] |" in lines[5]


@pytest.mark.parametrize(
    "argv",
    [
        ["--batches", "0"],
        ["--batches", "x"],
        ["--repeats", "0"],
        ["--new-tokens", "600"],
        ["--num-scheduler-steps", "0"],
        ["--num-gpu-blocks", "-1"],
        ["--num-gpu-blocks", "default"],
    ],
)
def test_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2


def test_readme_shows_the_committed_engine_table():
    """README.md's engine table is `table` of the committed run (benchmarks/results/engine/)."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    (committed,) = sorted((root / "benchmarks" / "results" / "engine").glob("*.json"))
    result = json.loads(committed.read_text())
    assert bench.table(result) in (root / "README.md").read_text()
