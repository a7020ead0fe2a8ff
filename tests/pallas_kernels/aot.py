"""Lowering and deviceless compilation of kernels for TPU and NVIDIA GPU on a CPU-only machine.

    from aot import compile_for_tpu, compile_for_h100, lower_for_tpu, lower_for_gpu
    compile_for_tpu(fn, *args, topology="v6e:1x1")   # runs libtpu's XLA:TPU + Mosaic compiler
    compile_for_h100(fn, *args)                      # runs XLA:GPU incl. the Triton pipeline
    lower_for_tpu(fn, *args, device_kind="TPU v5 lite")  # StableHLO text, no extra packages

`args` are arrays or `jax.ShapeDtypeStruct`s (pytrees allowed); nothing is allocated, so the
released model's shapes cost nothing. The compile helpers need the `aot` extra
(`pip install -e '.[aot]'`: libtpu and the CUDA plugin, pinned to the jax version); tests using
them skip only when the package is absent (`requires_libtpu`, `requires_cuda_plugin`).
Recipe and caveats: docs/kernels.md#compiling-without-the-chip.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from typing import Any

import jax
import pytest
from jax.sharding import SingleDeviceSharding

from planner.compiled_step import h100_target_config  # one reader of the plugin's spec

TPU_TOPOLOGIES = ("v5e:1x1", "v6e:1x1")
MEGACORE_TOPOLOGY = "v5p:1x1x1"  # one chip, two TensorCores driven as one device
TPU_KINDS = {"v5e": "TPU v5 lite", "v6e": "TPU v6 lite"}
H100_KIND = "NVIDIA H100"

requires_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu not installed (pip install -e '.[aot]')",
)
requires_cuda_plugin = pytest.mark.skipif(
    importlib.util.find_spec("jax_plugins.xla_cuda12") is None,
    reason="jax-cuda12-plugin not installed (pip install -e '.[aot]')",
)


@contextlib.contextmanager
def abstract_device(platform: str, device_kind: str, num_cores: int | None = None):
    """Make Pallas believe the default device is `device_kind` while lowering."""
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

    dev = AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform=platform)
    with use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=dev)):
        yield


def _abstract(args: Any, sharding=None) -> Any:
    def one(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(one, args)


def lower_for_tpu(fn, *args, device_kind: str = "TPU v6 lite") -> str:
    """StableHLO text of `fn(*args)` lowered for TPU (needs no libtpu)."""
    with abstract_device("tpu", device_kind):
        return jax.jit(fn).trace(*_abstract(args)).lower(lowering_platforms=("tpu",)).as_text()


def lower_for_gpu(fn, *args, device_kind: str = H100_KIND) -> str:
    """StableHLO text of `fn(*args)` lowered for CUDA (needs no plugin)."""
    with abstract_device("cuda", device_kind):
        return jax.jit(fn).trace(*_abstract(args)).lower(lowering_platforms=("cuda",)).as_text()


@functools.cache
def tpu_device(topology: str = "v6e:1x1"):
    """The compile-only device of a one-chip TPU topology such as "v5e:1x1" or "v6e:1x1"."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(topology, platform="tpu", chips_per_host_bounds=(1, 1, 1))
    return topo.devices[0]


def compile_for_tpu(fn, *args, topology: str = "v6e:1x1"):
    """Compile `fn(*args)` for a TPU chip without one (libtpu's compile-only topology)."""
    dev = tpu_device(topology)
    with abstract_device("tpu", dev.device_kind, getattr(dev, "num_cores", 1) or 1):
        lowered = jax.jit(fn).trace(*_abstract(args, SingleDeviceSharding(dev))).lower()
    return lowered.compile()


@functools.cache
def h100_device():
    """The compile-only CUDA device of an H100 target config."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(
        "", platform="cuda", target_config=h100_target_config(), topology="1x1x1"
    )
    return topo.devices[0]


def compile_for_h100(fn, *args):
    """Compile `fn(*args)` for an H100 without one (CUDA plugin, XLA:GPU + Triton pipeline).

    H200 is the same sm_90 chip with more memory; what compiles here compiles there.
    """
    dev = h100_device()
    with abstract_device("cuda", H100_KIND, 132):
        lowered = jax.jit(fn).trace(*_abstract(args, SingleDeviceSharding(dev))).lower()
    return lowered.compile()
