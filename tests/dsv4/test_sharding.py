"""dsv4.sharding: every parameter has a rule, the released model's shapes divide a real mesh,
and on a mesh of 8 host devices the sharded reference forward equals the single-device one, by
XLA's partitioner and, with the mesh passed as ``mesh=``, with the routed experts dispatched
to their devices by all-to-all (`dsv4.expert_parallel`); the dispatch follows that argument,
never JAX's ambient mesh.

The multi-device checks run in a subprocess: the host device count is fixed when JAX starts."""

from __future__ import annotations

import textwrap

import jax
import pytest
from jax.sharding import PartitionSpec

from dsv4 import sharding
from dsv4.config import tiny_v41_full, v41_flash
from tests.multidevice import run_script


def _fake_mesh(**axes):
    """A mesh-shaped stand-in with only the axis sizes (the specs need nothing else)."""

    class FakeMesh:
        def __init__(self) -> None:
            self.shape = {"data": 1, "expert": 1, "model": 1, **axes}

    return FakeMesh()


def test_every_released_parameter_has_a_rule_and_divides_an_8x8_mesh():
    specs = sharding.param_partition_specs(v41_flash(), _fake_mesh(model=8, expert=8))
    assert specs["layers.3.attn.wq_b.weight"] == PartitionSpec("model", None)
    assert specs["layers.3.ffn.experts.w1.weight"] == PartitionSpec("expert", None, None)
    assert specs["layers.3.attn.wkv.weight"] == PartitionSpec()  # the shared latent
    assert specs["embed.weight"] == PartitionSpec("model", None)
    split = [n for n, s in specs.items() if s != PartitionSpec()]
    assert any(n.startswith("mtp.") for n in split)


def test_errors_name_the_tensor_and_the_axis():
    with pytest.raises(ValueError, match=r"'embed.weight' dim 0 \(size 129280\) .* model=3"):
        sharding.param_partition_specs(v41_flash(), _fake_mesh(model=3))
    with pytest.raises(ValueError, match=r"no partition rule for parameter 'layers\.0\.attn\.new'"):
        sharding.partition_spec_for("layers.0.attn.new", (4,), _fake_mesh())
    with pytest.raises(ValueError, match="needs 16 devices"):
        sharding.make_mesh(data=2, model=8, devices=jax.devices())


_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from dsv4 import reference, sharding
    from dsv4.config import tiny_v41_full
    from dsv4.params import init_params

    assert len(jax.devices()) == 8
    cfg = tiny_v41_full()
    params = init_params(cfg, jax.random.PRNGKey(0))
    mesh = sharding.make_mesh(data=2, expert=2, model=2)
    sharded = sharding.shard_params(params, cfg, mesh)
    w = sharded["layers.2.attn.wq_b.weight"]
    assert w.sharding.spec == jax.sharding.PartitionSpec("model", None)
    assert len(w.addressable_shards) == 8 and w.addressable_shards[0].data.shape[0] == w.shape[0] // 2
    # the routed experts sit on the devices as [e, in, out] (what the expert dispatch reads),
    # the same values; everything else in the default layout
    name = next(n for n in sharded if n.endswith("ffn.experts.w1.weight"))
    assert sharded[name].format.layout.major_to_minor == (0, 2, 1), sharded[name].format
    assert np.array_equal(np.asarray(sharded[name]), np.asarray(params[name]))
    assert w.format.layout.major_to_minor == (0, 1), w.format
    from tests.multidevice import check_sharded_forward
    check_sharded_forward(sharded, params, cfg, mesh)
    """
)


def test_sharded_forward_equals_single_device():
    out = run_script(_SCRIPT)
    assert "max_abs_diff" in out and "expert_parallel_max_abs_diff" in out
    assert tiny_v41_full().n_heads % 2 == 0


_ARGUMENT_NOT_AMBIENT = textwrap.dedent(
    """
    import contextlib
    import jax, jax.numpy as jnp
    from dsv4 import reference, sharding
    from dsv4.config import tiny_v41
    from dsv4.paged.batch import empty_batch
    from dsv4.paged.step import paged_step_jit
    from dsv4.paged import records as R
    from dsv4.params import init_params
    from tests.dsv4.paged_harness import Harness

    cfg = tiny_v41()
    params = init_params(cfg, jax.random.PRNGKey(0))
    mesh = sharding.make_mesh(data=1, expert=2, model=2)
    sp = sharding.shard_params(params, cfg, mesh)
    tokens = jnp.zeros((2, 16), jnp.int32)
    fwd = jax.jit(reference.forward, static_argnums=1, static_argnames="mesh")
    h = Harness(cfg, params, R.CacheFormats.EXACT)
    batch = jax.tree.map(jnp.asarray, empty_batch(h.config, max_model_len=h.max_model_len,
                                                  num_tokens=8, num_rows=4))

    def manual(text):  # a shard_map in the lowered program
        return "manual_computation" in text or "SPMDFullToShardShape" in text

    for ambient in (False, True):
        with jax.set_mesh(mesh) if ambient else contextlib.nullcontext():
            for given in (None, mesh):
                f = fwd.lower(sp, cfg, tokens, mesh=given).as_text()
                p = paged_step_jit.lower(sp, h.pools, batch, cfg=cfg, layout=h.layout,
                                         mesh=given).as_text()
                print("ROW", ambient, given is not None, "all_to_all" in f, manual(p), flush=True)
    """
)


def test_the_mesh_argument_decides_the_dispatch_not_the_ambient_mesh():
    """On 4 host devices, under `jax.set_mesh` or not: with ``mesh=None`` the lowered forward has
    no expert all-to-all and the paged step no `shard_map`; with ``mesh=`` both have them."""
    out = run_script(_ARGUMENT_NOT_AMBIENT, num_devices=4)
    rows = [line.split()[1:] for line in out.splitlines() if line.startswith("ROW")]
    assert len(rows) == 4, out
    for ambient, given, all_to_all, manual in rows:
        assert all_to_all == given, (ambient, given, all_to_all)
        assert manual == given, (ambient, given, manual)
