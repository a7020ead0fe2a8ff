"""scripts/device_check.sh dry-run on the CPU (issue 36 point 2) and its README table."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import device_check  # noqa: E402

STEPS = ["environment", "kernel_tests", "kernels_benchmark", "engine", "layer", "other_tests"]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("device_check")
    env = dict(os.environ, PLATFORM="cpu", PYTHON=sys.executable, OUT_DIR=str(out))
    env.pop("OUT", None)
    proc = subprocess.run(
        ["bash", "scripts/device_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    return proc, out


def test_dry_run_passes_and_records_every_step(dry_run):
    proc, out = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "steps.json").read_text())
    assert res["backend"] == "cpu"
    assert [s["step"] for s in res["steps"]] == STEPS
    status = {s["step"]: s["status"] for s in res["steps"]}
    assert status["engine"] == "SKIPPED"
    assert status["kernel_tests"] == status["kernels_benchmark"] == status["layer"] == "PASS"
    collected = {s["step"]: s["summary"] for s in res["steps"]}
    for step in ("kernel_tests", "other_tests"):  # the test files still collect
        assert " tests collected" in collected[step] and not collected[step].startswith("0/")


def test_dry_run_benchmark_has_every_kernel(dry_run):
    _, out = dry_run
    bench = json.loads((out / "kernels_bench.json").read_text().splitlines()[-1])
    assert bench["timed"] is False
    assert bench["results"] and all(bench["results"].values())
    rows = sum(len(r) for r in bench["results"].values())
    res = json.loads((out / "steps.json").read_text())
    summary = next(s["summary"] for s in res["steps"] if s["step"] == "kernels_benchmark")
    assert summary.startswith(f"{rows} rows, 0 skipped, 0 errors, timed: False")


def test_dry_run_layer_runs_tiny_and_traces_released_widths(dry_run):
    _, out = dry_run
    bench = json.loads((out / "layer_bench.json").read_text())
    assert bench["widths"] == "tiny" and bench["timed"] is False
    (row,) = bench["results"]["full_r1"]
    assert row["output_finite"] is True and "error" not in row
    traced = bench["traced_released"]
    assert {r["kind"] for r in traced} == {"full_r1", "full_r2", "swa"}
    assert all("error" not in r and r["hidden"] == [64, 5120] for r in traced)
    res = json.loads((out / "steps.json").read_text())
    summary = next(s["summary"] for s in res["steps"] if s["step"] == "layer")
    assert summary == "1 rows, 0 skipped, 0 errors, timed: False; released widths traced: 6/6"


def _layer_json(tmp_path, **row):
    base = dict(batch=64, context=4096, time_s=2e-3, roofline_s=1e-3, roofline_pct=50.0,
                bytes={"total": 3.35e9}, output_finite=True, tpu_inference_scaled_s=4e-3,
                time_over_tpu_inference=0.5)  # fmt: skip
    out = dict(device="NVIDIA H100 80GB HBM3", widths="released", records="SM90", timed=True,
               peak_hbm_bytes_per_s=3.35e12, jax="0", results={"full_r1": [base | row]})  # fmt: skip
    path = tmp_path / "layer.json"
    path.write_text(json.dumps(out))
    return str(path)


def test_layer_summary_and_table(tmp_path, capsys):
    path = _layer_json(tmp_path)
    assert device_check._layer_summary(path) == (
        "1 rows, 0 skipped, 0 errors, timed: True; full_r1 b64 ctx4096 2000 us "
        "(50% roofline, 0.50x tpu-inference scaled)"
    )
    assert device_check.layer_table(path) == 0
    assert "full_r1     64    4096    3350.0    2000.0    1000.0   50.0       4000" in (
        capsys.readouterr().out
    )
    res = device_check.record_step(str(tmp_path / "steps.json"), "layer", 0, 1.0, path)
    assert res["steps"][0]["summary"].startswith("1 rows, 0 skipped, 0 errors")


def test_layer_table_fails_on_a_bad_row(tmp_path):
    assert device_check.layer_table(_layer_json(tmp_path, output_finite=False)) == 1
    assert device_check.layer_table(_layer_json(tmp_path, time_s=None)) == 1
    assert device_check.layer_table(_layer_json(tmp_path, error="XlaRuntimeError: OOM")) == 1
    assert "1 errors" in device_check._layer_summary(_layer_json(tmp_path, error="boom"))


def test_table_from_results(dry_run, tmp_path):
    _, out = dry_run
    assert "none yet" in device_check.table(str(tmp_path))
    (tmp_path / "cpu.json").write_text((out / "steps.json").read_text())
    lines = device_check.table(str(tmp_path)).splitlines()
    assert lines[0].startswith("| device | step |")
    assert [line.split("|")[2].strip() for line in lines[2:]] == STEPS


def test_record_step_names_a_failure(tmp_path):
    path = str(tmp_path / "steps.json")
    device_check.record_step(path, "kernel_tests", 1, 2.0, "1 failed")
    device_check.record_step(path, "engine", 124, 3.0, "cut off")
    res = json.loads((tmp_path / "steps.json").read_text())
    assert [s["status"] for s in res["steps"]] == ["FAIL (exit 1)", "TIMEOUT"]


@pytest.mark.slow
def test_engine_step_on_cpu_gives_the_recorded_tokens(tmp_path):
    out = str(tmp_path / "engine.json")
    rec = device_check.engine_check(out, [1, 2], 4, dry_run=True)
    assert rec["tokens_equal_cpu"], rec["tokens"]
    assert rec["compilations_after_warm_up"] == 0
    assert json.loads((tmp_path / "engine.json").read_text())["ok"] is True


def test_readme_shows_the_generated_table():
    readme = pathlib.Path(ROOT, "README.md").read_text()
    assert device_check.table(device_check.RESULTS_DIR) in readme


@pytest.mark.slow
def test_recorded_tokens_are_generates_greedy_tokens():
    """The reference the GPU run is held to, against ``dsv4.generate`` (no engine)."""
    import numpy as np

    from dsv4.checkpoint import load_pretrained, shipped_checkpoint
    from dsv4.generation import generate

    want = json.loads(pathlib.Path(device_check.TOKENS_FILE).read_text())
    cfg, params = load_pretrained(shipped_checkpoint(want["model"]), progress=False)
    for prompt, tokens in zip(want["prompts"], want["tokens"], strict=True):
        got = generate(params, cfg, np.asarray([prompt], np.int32), want["new_tokens"])
        assert np.asarray(got)[0].tolist() == tokens
