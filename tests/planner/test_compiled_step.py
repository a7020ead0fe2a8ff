"""The sharded paged step compiles without devices for 8 TPU chips (libtpu's compile-only
topology, Pallas TPU kernels) and for 8 H100s (the CUDA plugin's compile-only ``1x1x8``
topology, Pallas GPU kernels), on a ``data=1, expert=4, model=2`` mesh under ``jax.set_mesh``
(expert dispatch by all-to-all), params sharded by the rule table, pools replicated; XLA's
per-device memory is set beside the planner's (`planner.compiled_step`).

Default run: the tiny V4.1 (every layer role) on a v5e 2x4 topology (about 30 s). Slow: the
sharded step's logits equal one device's on 8 host devices; the
12-layer V4.1-Flash at its released widths with 384 experts (`reduced_flash_roles`), bf16 and
released weights, on v5p 2x2x2 and on eight H100s (several minutes each on a CPU); their
weights and KV match the planner within 10 %. Two processes may compile for TPU at once:
tests/conftest.py sets ALLOW_MULTIPLE_LIBTPU_LOAD (libtpu otherwise holds a machine-wide
lockfile); a released-shape compile takes several GiB of host memory, so `make test-slow` on a
small machine may want TEST_WORKERS=1."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from dsv4.config import tiny_v41
from planner import compiled_step as C
from planner import plan as P
from tests.pallas_kernels.aot import requires_cuda_plugin, requires_libtpu

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

MESH = P.MeshAxes(data=1, expert=4, model=2)


def _check(got, layers):
    assert got["num_devices"] == 8
    # expert parallelism: a dispatch and a combine all-to-all per layer
    assert got["hlo"]["all_to_all"] >= 2 * layers, got["hlo"]
    assert got["hlo"]["kernel_calls"] >= layers, got["hlo"]  # real kernels, not references
    x = got["xla"]
    assert (
        x["weights_bytes"] + x["kv_pool_bytes"] + x["batch_bytes"] <= (x["argument_size_in_bytes"])
    )
    assert x["alias_size_in_bytes"] >= x["kv_pool_bytes"]  # donated pools updated in place


@requires_libtpu
def test_tiny_sharded_step_compiles_for_tpu():
    cfg = tiny_v41()
    got = C.compiled_step_memory(
        cfg, MESH, target="tpu:v5e:2x4", max_num_seqs=4, max_model_len=256, num_tokens=32
    )
    assert got["device_kind"] == "TPU v5 lite"
    _check(got, cfg.n_layers)
    assert got["ratios"]["weights"] == got["ratios"]["kv"] == 1.0


@requires_libtpu
def test_routed_experts_are_read_without_a_copy_on_tpu():
    """The expert dispatch multiplies by each local expert as [in, out]; with the checkpoint's
    [e, out, in] row-major layout XLA:TPU copies every local expert's weights at each step (a
    temporary of their whole size), with `dsv4.sharding.param_formats`' layout it reads them
    in place. Compiled for 8 v5p chips (expert=4, model=2), without devices."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental.layout import Format
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from dsv4 import sharding
    from dsv4.expert_parallel import routed_experts

    devices = C.target_devices("tpu:v5p:2x2x2")[0]  # v5e reads [out, in] in place
    mesh = Mesh(np.asarray(devices, dtype=object).reshape(1, 4, 2), sharding.AXES)
    cfg = dataclasses.replace(tiny_v41(), n_routed_experts=8, moe_inter_dim=2048, dim=5120)
    n, k, e, inter, dim = 64, 2, 8, 2048, 5120  # V4.1-Flash's widths, 2 experts a device
    shapes = {"w1": (e, inter, dim), "w2": (e, dim, inter), "w3": (e, inter, dim)}
    names = {w: f"layers.0.ffn.experts.{w}.weight" for w in shapes}
    abstract = {names[w]: jax.ShapeDtypeStruct(s, jnp.bfloat16) for w, s in shapes.items()}
    formats = sharding.param_formats(abstract, cfg, mesh)
    tokens = NamedSharding(mesh, PartitionSpec())

    def temp_bytes(shardings):
        ws = [jax.ShapeDtypeStruct(shapes[w], jnp.bfloat16, sharding=shardings[names[w]])
              for w in ("w1", "w2", "w3")]  # fmt: skip
        args = (
            jax.ShapeDtypeStruct((n, dim), jnp.bfloat16, sharding=tokens),
            jax.ShapeDtypeStruct((n, k), jnp.float32, sharding=tokens),
            jax.ShapeDtypeStruct((n, k), jnp.int32, sharding=tokens),
            *ws,
        )

        def f(x, weights, ids, w1, w2, w3):
            return routed_experts(x, weights, ids, w1, w2, w3, cfg, mesh, quant=False)

        # serving precision: XLA:TPU's ragged dot refuses bf16 at fp32 contract precision
        with jax.set_mesh(mesh), jax.default_matmul_precision("default"):
            compiled = jax.jit(f).trace(*args).lower().compile()
        layouts = [fmt.layout.major_to_minor for fmt in compiled.input_formats[0][3:]]
        return compiled.memory_analysis().temp_size_in_bytes, layouts

    local = (e // 4) * inter * dim * 2  # one projection of a device's experts, bf16
    assert all(isinstance(formats[names[w]], Format) for w in shapes)
    plain = {name: f.sharding for name, f in formats.items()}
    copied, layouts = temp_bytes(plain)
    assert layouts == [(0, 1, 2)] * 3
    in_place, layouts = temp_bytes(formats)
    assert layouts == [(0, 2, 1)] * 3
    assert copied >= in_place + 0.9 * local, (copied, in_place, local)
    assert in_place < local // 4, (in_place, local)


@requires_libtpu
def test_tiny_data_parallel_step_compiles_for_tpu():
    """data = 2: each device holds its data shard's pools only (half the replicated ones), as
    the planner counts them, and the real kernels run under the step's vmap."""
    cfg = tiny_v41()
    kw = dict(target="tpu:v5e:2x4", max_num_seqs=4, max_model_len=256, num_tokens=32)
    got = C.compiled_step_memory(cfg, P.MeshAxes(data=2, expert=2, model=2), **kw)
    one = C.compiled_step_memory(cfg, P.MeshAxes(data=1, expert=4, model=2), **kw)
    _check(got, cfg.n_layers)
    assert got["pools"] == "split over data" and one["pools"] == "replicated"
    assert got["ratios"]["weights"] == got["ratios"]["kv"] == 1.0
    # 2 of the 4 requests per data shard: half the pages (plus a null block per shard)
    kv, kv1 = got["xla"]["kv_pool_bytes"], one["xla"]["kv_pool_bytes"]
    assert kv < 0.6 * kv1, (kv, kv1)


def test_refuses_a_foreign_mesh():
    with pytest.raises(ValueError, match="needs 4 devices; h100x8 has 8"):
        C.compiled_step_memory(tiny_v41(), P.MeshAxes(2, 2, 1), target="h100x8")
    with pytest.raises(ValueError, match="target 'gpu:8'"):
        C.target_devices("gpu:8")


_SAME_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec
    from tests.dsv4.paged_harness import Harness, plan_step
    from dsv4 import sharding
    from dsv4.config import tiny_v41
    from dsv4.paged import records as R
    from dsv4.params import init_params
    from serving.input_batch import InputBatch
    from serving.scheduler import StopCriteria

    assert len(jax.devices()) == 8
    cfg = tiny_v41()
    params = init_params(cfg, jax.random.PRNGKey(0))

    def prefill(params, mesh=None):
        h = Harness(cfg, params, R.CacheFormats.EXACT)
        if mesh is not None:
            h.pools = jax.device_put(h.pools, NamedSharding(mesh, PartitionSpec()))
        scheduler = h.scheduler(max_num_seqs=2)
        for i, n in enumerate((20, 9)):
            request = h.mgr.new_request(f"r{i}", list(range(3, 3 + n)), max_tokens=1)
            scheduler.add_request(request, StopCriteria())
        _, _, reqs = plan_step(scheduler, InputBatch(2, engram_lookback=cfg.engram_lookback))
        return h.run(reqs)[:29]

    want = prefill(params)
    mesh = sharding.make_mesh(data=1, expert=4, model=2)
    with jax.set_mesh(mesh):
        got = prefill(sharding.shard_params(params, cfg, mesh), mesh)
    print("MAXDIFF", float(np.max(np.abs(got - want))))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    print("SAME")
    """
)


@pytest.mark.slow
def test_sharded_step_equals_one_device():
    """The paged step under ``jax.set_mesh`` on 8 host devices (``expert=4, model=2``: the
    kernels in `shard_map` with heads split over ``model``, the experts dispatched), params
    sharded, pools replicated: one prefill step's logits equal one device's within 1e-5 (jnp
    kernels, f32 records; with bf16 records the sharded sums' other order rounds a few cached
    latents the other way: 5e-4). About 3.5 min on two shared cores."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    env["PYTHONPATH"] = str(pathlib.Path(__file__).resolve().parents[2])  # tests.dsv4
    run = subprocess.run(
        [sys.executable, "-c", _SAME_SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0 and "SAME" in run.stdout, run.stdout + run.stderr[-3000:]


CASES = [
    pytest.param("tpu:v5p:2x2x2", w, marks=[pytest.mark.slow, requires_libtpu], id=f"v5p-{w}")
    for w in ("released", "bf16")
] + [
    pytest.param("h100x8", w, marks=[pytest.mark.slow, requires_cuda_plugin], id=f"h100x8-{w}")
    for w in ("released", "bf16")
]


@pytest.mark.parametrize(("target", "weights"), CASES)
def test_released_shapes_match_the_planner(target, weights, capsys):
    """Through `benchmarks.sharding` (its JSON line's ``compiled_step``), printed."""
    from benchmarks import sharding

    argv = ["--chips", "v5p-16", "--no-reference", "--step", f"{target}/{weights}"]
    assert sharding.main(argv) == 0
    line = capsys.readouterr().out.strip()
    (got,) = json.loads(line)["compiled_step"]
    with capsys.disabled():
        print(f"\n{C.describe(got)}\nJSON {line}")
    _check(got, C.reduced_flash_roles().n_layers)
    r = got["ratios"]
    assert abs(r["arguments"] - 1) < 0.1, r
    assert abs(r["weights"] - 1) < 0.1 and abs(r["kv"] - 1) < 0.1, r
