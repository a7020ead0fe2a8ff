"""benchmarks/sharding.py: one JSON line with the planner's per-chip bytes, the collective bytes
of a decode step, and XLA's compiled memory of a deviceless compile (libtpu's compile-only TPU
topology) whose argument bytes equal the planner's weight bytes within 10%. The default run
compiles a 2-layer, 16-expert model at the released widths on a v5e 2x4 topology with every
mesh axis 2 (about 15 s); the 6-layer, 384-expert model of the JSON line on v5p 2x2x2 (3-5 min
on two shared cores) is the slow variant."""

from __future__ import annotations

import importlib.util
import json

import pytest

from benchmarks import sharding
from planner import plan as P

requires_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu not installed (pip install -e '.[aot]')",
)


def test_json_line_has_planner_and_collective_figures(capsys):
    assert sharding.main(["--chips", "v5p-16", "--no-compile"]) == 0
    out = json.loads(capsys.readouterr().out.strip())
    planner = out["planner"]
    assert planner["num_chips"] == 8 and planner["fits"] is True
    assert planner["weights_bytes"] < planner["weights_bf16_bytes"] < planner["hbm_bytes"] * 2
    assert (
        planner["kv_bytes"]
        == sum(planner["kv_group_bytes"].values()) + planner["kv_null_block_bytes"]
    )
    coll = out["collective_bytes_per_decode_step_per_chip"]
    assert coll["total"] == sum(v for k, v in coll.items() if k != "total") > 0
    assert out["compiled"] == out["compiled_step"] == {"skipped": "--no-compile"}


def test_table_rows_are_the_planners(capsys):
    assert sharding.main(["--table"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 + len(sharding.TABLE_SLICES)
    assert [line.split(" | ")[0].strip("| ") for line in lines[2:]] == list(sharding.TABLE_SLICES)


def test_bad_mesh_exits_2_naming_the_value(capsys):
    with pytest.raises(SystemExit) as exc:
        sharding.main(["--chips", "h200x8", "--mesh", "model=16", "--no-compile"])
    assert exc.value.code == 2
    assert "--mesh data=1,expert=1,model=16 needs 16 chips" in capsys.readouterr().err


@requires_libtpu
def test_compiled_weights_match_the_planner_fast():
    cfg = P.reduced_flash(
        n_layers=2,
        compress_ratios=(0, 1),
        kv_source_layers=(1,),
        index_source_layers=(1,),
        candidate_source_layer=1,
        n_routed_experts=16,
        vocab_size=4096,
    )
    got = P.compiled_memory(cfg, P.MeshAxes(2, 2, 2), topology="v5e:2x4")
    assert got["device_kind"] == "TPU v5 lite"
    assert abs(got["weights_ratio"] - 1) < 0.1, got
    assert got["planner_weights_bf16_bytes"] > 1e9  # released widths: real matrices


@requires_libtpu
@pytest.mark.slow
def test_compiled_weights_match_the_planner_reduced_flash(capsys):
    assert sharding.main(["--chips", "v5p-16", "--step", ""]) == 0
    out = json.loads(capsys.readouterr().out.strip())
    compiled = out["compiled"]
    assert compiled["mesh"] == {"data": 1, "expert": 4, "model": 2}
    assert abs(compiled["weights_ratio"] - 1) < 0.1, compiled


def test_bad_step_exits_2_naming_the_value(capsys):
    with pytest.raises(SystemExit) as exc:
        sharding.main(["--chips", "v5p-16", "--step", "h100x8/fp16"])
    assert exc.value.code == 2
    assert "--step 'h100x8/fp16': expected TARGET/released or TARGET/bf16" in (
        capsys.readouterr().err
    )


def test_describe_names_skipped_step_compiles(capsys):
    assert sharding.main(["--chips", "v5p-16", "--no-compile", "--describe"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert json.loads(lines[0])["compiled_step"] == {"skipped": "--no-compile"}
    assert lines[1:] == ["paged-step compiles skipped: --no-compile"]


@pytest.mark.slow  # about a minute: two engines, one on 8 fake CPU devices
def test_cpu_step_ratio_runs_the_engine_on_a_mesh_and_on_one_device():
    res = sharding.cpu_step_ratio()
    assert res["same_tokens"], res
    steps = res["s_per_step"]
    assert steps["one_device"] > 0 and steps["mesh_2x2x2"] > 0
    assert res["ratio"] == pytest.approx(steps["mesh_2x2x2"] / steps["one_device"])


def test_cpu_step_ratio_is_opt_in(capsys):
    assert sharding.main(["--no-compile"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[0])
    assert "skipped" in line["cpu_step_ratio"]
