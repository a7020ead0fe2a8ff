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
    assert status["engine"] == status["layer"] == "SKIPPED"
    assert status["kernel_tests"] == status["kernels_benchmark"] == "PASS"
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
