"""`dsv4 plan`: per-chip weights, KV pages per group, activations and the largest batch per
slice, as text, JSON lines or docs/planner.md's markdown; bad slices, meshes and sizes exit 2 with a
message naming the value."""

from __future__ import annotations

import argparse
import importlib.util
import json

import pytest

from dsv4.config import v41_flash
from planner import plan as P
from serving.cli import main


def test_plan_prints_the_figures_of_each_slice(capsys):
    assert main(["plan", "--chips", "v5p-16", "h200x8", "--max-num-seqs", "32"]) == 0
    out = capsys.readouterr().out
    assert "v41_flash on v5p-16: 8 x TPU v5p (95.0 GiB HBM each)" in out
    assert "v41_flash on h200x8: 8 x H200" in out and "KV records SM90" in out
    assert "KV g8:MLAAttentionSpec[8]" in out and "activations" in out
    assert out.count("most requests that fit, by context length: 8K tokens:") == 2


def test_plan_json_equals_the_planner(capsys):
    argv = ["plan", "--chips", "v6e-64", "--mesh", "data=2,expert=32", "--json"]
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    want = P.plan(v41_flash(), P.parse_slice("v6e-64"), mesh=P.MeshAxes(data=2, expert=32))
    assert got == {"model": "v41_flash", **want.as_dict()}
    assert got["mesh"] == {"data": 2, "expert": 32, "model": 1}


def test_plan_markdown_is_one_row_per_slice(capsys):
    assert main(["plan", "--chips", "v5p-16", "h200x8", "--markdown"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4 and lines[0].startswith("| slice | chips |")


def test_plan_compiled_says_why_a_gpu_slice_has_no_compile(capsys):
    assert main(["plan", "--chips", "h200x8", "--compiled"]) == 0
    out = capsys.readouterr().out
    assert "compiled      skipped: h200x8: no deviceless compile (libtpu compiles TPU" in out


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed")
def test_plan_compiled_on_a_tpu_slice_matches_the_planner(capsys):
    assert main(["plan", "--chips", "v5p-16", "--compiled", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["compiled"]
    assert got["topology"] == "v5p:2x2x2" and got["mesh"] == {"data": 1, "expert": 8, "model": 1}
    assert abs(got["weights_ratio"] - 1) < 0.1, got


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--chips", "v5p-15"], "--chips 'v5p-15': the count must be >= 1 TensorCores"),
        (["--chips", "tpu9"], "--chips 'tpu9': not a slice; expected v5e-N"),
        (["--mesh", "model=16"], "--mesh data=1,expert=1,model=16 needs 16 chips"),
        (["--chips", "v5e-32", "--mesh", "model=32"], "mesh model=32 does not divide o_groups=8"),
        (["--chips", "h200x5", "--mesh", "expert=5"], "(size 384) is not divisible by mesh axis"),
        (["--mesh", "models=8"], "'models=8' is not AXIS=SIZE"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1, got 0"),
        (["--headroom", "1.5"], "--headroom must be in [0, 1), got 1.5"),
        (["--records", "fp2"], "--records 'fp2': not a preset"),
        (["--model", "v5_pro"], "invalid choice: 'v5_pro'"),
        (["--max-model-len", "2000000"], "max_model_len=2000000 exceeds the model's max_seq_len"),
        (["--compiled", "--markdown"], "--compiled adds to the text or --json output"),
    ],
)
def test_bad_plan_arguments_exit_2_naming_the_value(usage_error, argv, message):
    _, err = usage_error(["plan", *argv])
    assert "dsv4 plan: error:" in err and message in err, err


def test_plan_models_are_the_planners():
    from serving.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    (model,) = [a for a in sub.choices["plan"]._actions if a.dest == "model"]
    assert set(model.choices) == set(P.MODELS)
