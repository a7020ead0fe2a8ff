"""dsv4.sharding: every parameter has a rule, the released model's shapes divide a real mesh,
and on a mesh of 8 host devices the sharded reference forward equals the single-device one, by
XLA's partitioner and, under the mesh as JAX's ambient mesh, with the routed experts dispatched
to their devices by all-to-all (`dsv4.expert_parallel`).

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
