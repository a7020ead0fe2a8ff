"""Sharded paths equal the single-device ones on a mesh of 8 host devices (issue: scale-out).

Each case runs in a subprocess (the host device count is fixed when JAX starts): params placed
by `dsv4.sharding.shard_params`, the prompts split over ``data``, the mesh passed as
``mesh=`` (so an ``expert`` axis > 1 dispatches tokens to their experts' devices,
`dsv4.expert_parallel`); `reference.forward`'s logits within 1e-5 of one device's and
`dsv4.generate`'s greedy tokens identical: expert parallelism together with data and tensor
parallelism, the meshes of the issue (data x model 2x4, 4x2, 8x1, and 1x8 for a config with 8
heads and 8 experts) and more expert splits. All are long variants (`make test-slow`); the
default run covers the same paths in tests/dsv4/test_sharding.py, test_multihost.py and
tests/serving/test_engine_mesh.py.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.multidevice import run_script

_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import dsv4
    from dsv4 import reference, sharding
    from dsv4.config import tiny_v41, tiny_v41_full
    from dsv4.params import init_params

    case = json.loads(sys.argv[1])
    assert len(jax.devices()) == 8
    cfg = {"tiny_v41": tiny_v41, "tiny_v41_full": tiny_v41_full}[case["model"]](
        **case.get("overrides", {})
    )
    params = init_params(cfg, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (8, 40)), jnp.int32)
    lengths = [int(v) for v in rng.integers(20, 41, 8)]
    fwd = jax.jit(reference.forward, static_argnums=1)
    with jax.default_matmul_precision("highest"):
        want = np.asarray(fwd(params, cfg, tokens))
        want_gen = np.asarray(dsv4.generate(params, cfg, tokens, 6, prompt_lengths=lengths))
        for axes in case["meshes"]:
            mesh = sharding.make_mesh(**axes)
            sp = sharding.shard_params(params, cfg, mesh)
            toks = jax.device_put(tokens, NamedSharding(mesh, P("data")))
            f = jax.jit(reference.forward, static_argnums=1, static_argnames="mesh")
            got = np.asarray(f(sp, cfg, toks, mesh=mesh))
            hlo = f.lower(sp, cfg, toks, mesh=mesh).as_text()
            gen = np.asarray(dsv4.generate(sp, cfg, toks, 6, prompt_lengths=lengths, mesh=mesh))
            err = float(np.max(np.abs(got - want)))
            print(json.dumps({"mesh": axes, "max_abs_diff": err,
                              "all_to_all": "all_to_all" in hlo,
                              "tokens_equal": bool((gen == want_gen).all())}), flush=True)
    """
)


def _run(case: dict) -> list[dict]:
    out = run_script(_SCRIPT, json.dumps(case))
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(rows) == len(case["meshes"]), out
    return rows


def _check(rows):
    for row in rows:
        assert row["max_abs_diff"] < 1e-5, row
        assert row["tokens_equal"], row
        assert row["all_to_all"] == (row["mesh"].get("expert", 1) > 1), row


# fast representatives: test_sharding (the forward, also expert-parallel under the mesh),
# test_multihost (generate on this mesh across two processes), test_engine_mesh (the engine)
@pytest.mark.slow
def test_expert_data_and_tensor_parallel_equal_one_device():
    _check(_run({"model": "tiny_v41", "meshes": [{"data": 2, "expert": 2, "model": 2}]}))


CASES = {
    "data_x_model": {"model": "tiny_v41", "meshes": [
        {"data": 2, "model": 4}, {"data": 4, "model": 2}, {"data": 8}]},
    "1x8_eight_heads_eight_experts": {
        "model": "tiny_v41",
        "overrides": {"n_heads": 8, "index_n_heads": 8, "o_groups": 8, "n_routed_experts": 8},
        "meshes": [{"model": 8}, {"expert": 8}],
    },
    "expert_splits": {"model": "tiny_v41", "meshes": [
        {"expert": 8}, {"data": 2, "expert": 4}, {"expert": 4, "model": 2}]},
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_meshes_of_the_issue(name):
    _check(_run(CASES[name]))
