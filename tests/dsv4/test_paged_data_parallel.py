"""Data-parallel attention (`dsv4.paged.step.paged_step_data_parallel`): D data shards, each with
its own allocator, scheduler, pools and requests, run as one program.

Every shard teacher-forces its own sequences under random schedules in lockstep
(`paged_harness.data_parallel_schedules`: chunked prefill, prefix hits, drafts accepted and
rejected; a shard that has finished runs padding). Each shard's logits must equal
`reference.forward` of its sequences (the independent reference), its pools must equal the ones
`paged_step` gives that shard alone, and on a mesh of 8 host devices the shard axis splits over
``data``: each device holds only its shards' pages and the logits equal one device's.
"""

from __future__ import annotations

import json
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_harness import Harness, ScheduleRun, data_parallel_schedules
from test_paged_step import compare, make_seqs, reference_logits

from dsv4 import sharding
from dsv4.paged import pools as P
from dsv4.paged import records as R
from dsv4.paged.batch import empty_batch
from dsv4.paged.step import (
    paged_step_data_parallel,
    paged_step_data_parallel_jit,
    paged_step_jit,
    stack_shards,
)
from tests.multidevice import run_script


def _shards(cfg, params, rng, d, n=3, **kw):
    hs = [Harness(cfg, params, R.CacheFormats.EXACT, num_speculative_tokens=2, **kw)
          for _ in range(d)]  # fmt: skip
    # shards of unequal work: one finishes early and runs padding while the others go on
    seqs = [make_seqs(cfg, rng, n + i, shared_prefix=24) for i in range(d)]
    return hs, seqs


def test_every_shard_equals_the_reference(tiny_params, tiny_cfg):
    rng = np.random.default_rng(0)
    hs, seqs = _shards(tiny_cfg, tiny_params, rng, 3)
    # two running at once: the later requests of a shard hit its earlier ones' prefix
    steps = data_parallel_schedules(hs, seqs, rng, spec_k=2, max_running=2)
    for h, s in zip(hs, seqs):
        compare(h, reference_logits(tiny_params, tiny_cfg, s), s, 1e-4)
        assert max(h.stats.prefix_hits) >= 16, h.stats
        assert 0 < h.stats.num_accepted_tokens < h.stats.num_draft_tokens, h.stats
    # some shard finished first and ran padding while another went on
    assert min(h.steps for h in hs) < steps == max(h.steps for h in hs)


def test_a_shard_is_its_own_paged_step(tiny_params, tiny_cfg):
    """Shard i's logits and pools after a data-parallel step are those of `paged_step` on shard
    i's pools and batch alone (the vmapped matmuls may round differently: 1e-5), and a padding
    shard's pools do not change at all."""
    rng = np.random.default_rng(1)
    hs, seqs = _shards(tiny_cfg, tiny_params, rng, 2, n=2)
    data_parallel_schedules(hs, seqs, rng)  # fills both shards' pools...
    h = hs[0]
    pools = stack_shards([hs[0].pools, hs[1].pools])  # ...as the schedule left them
    # one more step: shard 0 runs a prefill of fresh tokens, shard 1 runs padding
    fresh = make_seqs(tiny_cfg, rng, 1)
    run = ScheduleRun(h, fresh, rng)
    batch0 = h.batch(run.plan())
    idle = empty_batch(h.config, max_model_len=h.max_model_len, num_tokens=h.token_buckets[-1],
                       num_rows=h.request_buckets[-1])  # fmt: skip
    batch = jax.tree.map(jnp.asarray, stack_shards([batch0, idle]))
    want, want_pools = paged_step_jit(
        tiny_params, jax.tree.map(lambda x: x[0], pools), jax.tree.map(jnp.asarray, batch0),
        cfg=tiny_cfg, layout=h.layout, all_logits=True,
    )  # fmt: skip
    before = jax.tree.map(lambda x: np.asarray(x[1]), pools)
    got, got_pools = paged_step_data_parallel_jit(
        tiny_params, pools, batch, cfg=tiny_cfg, layout=h.layout, all_logits=True
    )
    real = np.asarray(batch0.positions) >= 0
    np.testing.assert_allclose(np.asarray(got[0])[real], np.asarray(want)[real], atol=1e-5)

    def decoded(pools):  # every layer's records, decoded (rings as they are stored)
        out = {}
        for name in h.layout.names():
            read = P.read_ring if h.layout.layer(name).kind == "ring" else P.read_layer
            out[name] = np.asarray(read(h.layout, pools, name))
        return out

    mine, alone = decoded(jax.tree.map(lambda x: x[0], got_pools)), decoded(want_pools)
    for name in mine:
        np.testing.assert_allclose(mine[name], alone[name], atol=1e-5, err_msg=name)
    for key in got_pools:  # the padding shard's bytes did not move
        assert np.asarray(got_pools[key][1]).tobytes() == before[key].tobytes(), key


def test_bad_shapes_are_refused(tiny_params, tiny_cfg):
    h = Harness(tiny_cfg, tiny_params, R.CacheFormats.EXACT)
    idle = empty_batch(h.config, max_model_len=h.max_model_len, num_tokens=8, num_rows=4)
    wider = empty_batch(h.config, max_model_len=h.max_model_len, num_tokens=16, num_rows=4)
    with pytest.raises(ValueError, match=r"shard 1 has a leaf of shape \(16,\) where shard 0"):
        stack_shards([idle, wider])
    with pytest.raises(ValueError, match="no shards"):
        stack_shards([])
    batch = jax.tree.map(jnp.asarray, stack_shards([idle, idle]))
    with pytest.raises(ValueError, match="expected a leading shard axis of 2"):
        paged_step_data_parallel(tiny_params, tiny_cfg, h.layout, h.pools, batch)
    with pytest.raises(ValueError, match=r"batch.token_ids must be \[D, T\]"):
        paged_step_data_parallel(
            tiny_params, tiny_cfg, h.layout, h.pools, jax.tree.map(jnp.asarray, idle)
        )


_SCRIPT = textwrap.dedent(
    r"""
    import json, re, sys
    import jax, jax.numpy as jnp, numpy as np
    sys.path.insert(0, "tests/dsv4")
    from paged_harness import Harness, data_parallel_schedules
    from test_paged_step import make_seqs
    from dsv4 import sharding
    from dsv4.config import tiny_v41
    from dsv4.params import init_params
    from dsv4.paged import records as R
    from dsv4.paged.batch import empty_batch
    from dsv4.paged.step import paged_step_data_parallel_jit, stack_shards

    assert len(jax.devices()) == 8
    cfg = tiny_v41()
    params = init_params(cfg, jax.random.PRNGKey(0))

    def gathered(hlo):  # the all-gathers' results: dtype, bytes
        out = []
        for line in hlo.splitlines():
            m = re.search(r"= (\w+)\[([\d,]*)\]\S* all-gather(-start)?\(", line)
            if m:
                n = int(np.prod([int(x) for x in m[2].split(",") if x]))
                size = {"pred": 1, "u8": 1, "s8": 1, "bf16": 2, "f16": 2, "f64": 8}.get(m[1], 4)
                out.append((m[1], n * size))
        return out

    def run(d, mesh):
        rng = np.random.default_rng(d)
        hs = [Harness(cfg, params, R.CacheFormats.EXACT, num_speculative_tokens=2)
              for _ in range(d)]
        seqs = [make_seqs(cfg, rng, 2 + i % 2, shared_prefix=24) for i in range(d)]
        with jax.default_matmul_precision("highest"):
            data_parallel_schedules(hs, seqs, rng, spec_k=2, mesh=mesh)
        return {(i, k): v for i, h in enumerate(hs) for k, v in h.logits.items()}

    for axes in json.loads(sys.argv[1]):
        mesh = sharding.make_mesh(**axes)
        d = 2 * axes["data"]
        want, got = run(d, None), run(d, mesh)
        assert want.keys() == got.keys()
        err = max(float(np.abs(want[k] - got[k]).max()) for k in want)
        # where a shard's pages live: each device holds d / data shards of every pool
        h = Harness(cfg, params, R.CacheFormats.EXACT)
        pools = stack_shards([h.pools] * d)
        pools = jax.device_put(pools, sharding.data_parallel_sharding(pools, mesh))
        idle = empty_batch(h.config, max_model_len=h.max_model_len, num_tokens=32, num_rows=8)
        batch = jax.tree.map(jnp.asarray, stack_shards([idle] * d))
        batch = jax.device_put(batch, sharding.data_parallel_sharding(batch, mesh))
        sp = sharding.shard_params(params, cfg, mesh)
        lowered = paged_step_data_parallel_jit.lower(sp, pools, batch, cfg=cfg, layout=h.layout,
                                                     mesh=mesh)
        _, out = paged_step_data_parallel_jit(sp, pools, batch, cfg=cfg, layout=h.layout,
                                              mesh=mesh)
        compiled = lowered.compile()
        local = {k: v.addressable_shards[0].data.shape[0] for k, v in out.items()}
        hlo = compiled.as_text()
        print(json.dumps({"mesh": axes, "shards": d, "max_abs_diff": err,
                          "local_shards": sorted(set(local.values())),
                          "pool_spec": sorted({str(v.sharding.spec) for v in out.values()}),
                          "gathered": gathered(hlo),
                          "pool_bytes": sum(v.addressable_shards[0].data.nbytes
                                            for v in out.values()),
                          "all_to_all": "all-to-all" in hlo}), flush=True)
    """
)


def _mesh_rows(meshes):
    out = run_script(_SCRIPT, json.dumps(meshes))
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(rows) == len(meshes), out
    for row in rows:
        assert row["max_abs_diff"] < 1e-5, row
        assert row["local_shards"] == [row["shards"] // row["mesh"]["data"]], row
        assert row["pool_spec"] == ["P('data',)"], row
        # no device gathers pool bytes (u8), and all the gathers together stay under half a
        # device's pools (they are activations, the router's scores and, at these tiny
        # widths, weights XLA prefers to gather). Without the step's sharding constraints XLA
        # gathered each shard's whole pools within its data group.
        assert not [g for g in row["gathered"] if g[0] == "u8"], row
        assert sum(b for _, b in row["gathered"]) < row["pool_bytes"] / 2, row
        assert row["all_to_all"] == (row["mesh"].get("expert", 1) > 1), row
    return rows


def test_data_expert_and_model_axes_together():
    _mesh_rows([{"data": 2, "expert": 2, "model": 2}])


@pytest.mark.slow  # fast representative: test_data_expert_and_model_axes_together
def test_meshes_of_the_issue():
    _mesh_rows([{"data": 2, "model": 4}, {"data": 4, "model": 2}, {"data": 8}])


def test_sharding_refuses_an_indivisible_shard_axis():
    mesh = jax.sharding.AbstractMesh((2, 1, 1), sharding.AXES)
    with pytest.raises(ValueError, match=r"\['a'\] of shape \[3, 4\].*multiple of the mesh's data"):
        sharding.data_parallel_sharding({"a": np.zeros((3, 4))}, mesh)
