"""Megacore (v4 / v5p: two TensorCores driven as one device): the window and sparse TPU kernels
split their sequential tile loop into one contiguous run per core, each with its own prefetch
pipeline (grid (core, tile), "parallel" x "arbitrary"); the indexer's grid is "parallel" already.

The interpreters run the cores one after the other, which checks that each core's run starts
its own pipeline and that tiles padded to whole runs read nothing; the deviceless compile for
v5p checks that Mosaic accepts the split with the device's two cores."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import window_cases
from aot import MEGACORE_TOPOLOGY, compile_for_tpu, requires_libtpu, tpu_device
from indexer_cases import indexer_fn, indexer_released
from paged_cases import checking_tpu_interpreter, cpu_only
from sparse_cases import check_sparse as sparse_check
from sparse_cases import sparse_args, sparse_case, sparse_entry, sparse_released, window_state_of

from pallas_kernels import backend
from pallas_kernels.sparse_attention import tpu as sparse_tpu
from pallas_kernels.window_attention import tpu as window_tpu


def test_core_split():
    assert backend.core_split(7, 2) == (2, 4)  # 8 tile slots: the last one is padding
    assert backend.core_split(8, 2) == (2, 4)
    assert backend.core_split(1, 2) == (1, 1)  # never more cores than tiles
    assert backend.core_split(5, 1) == (1, 5)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="num_cores"):
            backend.core_split(4, bad)


def test_cpu_has_one_core():
    assert backend.tpu_num_cores() == 1


@pytest.mark.parametrize("tq", [1, 8])
def test_window_kernel_on_two_cores(tq):
    """27 tokens ("mixed", tiles of 1: 27 tiles, one padded) and 40 tokens ("prefill", tiles of
    8: 5 tiles, one padded), out and state, fast interpreter."""
    cpu_only()
    step = window_cases.window_step("mixed" if tq == 1 else "prefill", padding=2, shuffle=True)
    args, static = window_cases.window_args(step, np.float32)
    run = functools.partial(
        window_tpu.window_attention, *args, **static, interpret=True, tokens_per_tile=tq,
        num_cores=2,
    )  # fmt: skip
    window_cases.check_window_out(run(), step, np.float32)
    window_cases.check_window_state(run(return_state=True), step, np.float32)


def test_window_kernel_on_two_cores_checking_interpreter():
    cpu_only()
    step = window_cases.window_step("decode", padding=1, shuffle=True)
    args, static = window_cases.window_args(step, np.float32)
    out = window_tpu.window_attention(
        *args, **static, interpret=checking_tpu_interpreter(), tokens_per_tile=2, num_cores=2
    )
    window_cases.check_window_out(out, step, np.float32)


@pytest.mark.parametrize("tq,interpret", [(1, "hlo"), (4, "hlo"), (4, "checking")])
def test_sparse_kernel_on_two_cores(tq, interpret):
    cpu_only()
    step, sel = sparse_case("mixed", padding=3, empty_rows=(2,), shared_fraction=0.6)
    args, static = sparse_args(step, sel, np.float32)
    mode = checking_tpu_interpreter() if interpret == "checking" else True
    out = sparse_tpu.sparse_attention(
        *args, **static, state=window_state_of(step, np.float32), interpret=mode,
        tokens_per_tile=tq, num_cores=2,
    )  # fmt: skip
    sparse_check(out, step, sel, np.float32, with_window=True)


@requires_libtpu
def test_v5p_device_has_two_cores():
    assert tpu_device(MEGACORE_TOPOLOGY).num_cores == 2


@requires_libtpu
def test_kernels_compile_for_megacore_at_released_shapes():
    """Decode batches at the released shapes for v5p: the window and sparse kernels take the
    device's two cores (their default), the indexer its parallel grid."""
    topo = MEGACORE_TOPOLOGY
    compile_for_tpu(window_cases.window_entry("tpu", False), *window_cases.window_released(128, 128, jnp.bfloat16),
                    topology=topo)  # fmt: skip
    compile_for_tpu(sparse_entry("tpu", 64), *sparse_released(128, 128, jnp.bfloat16, 64, True),
                    topology=topo)  # fmt: skip
    compile_for_tpu(indexer_fn("source-r1", "tpu"), *indexer_released("source-r1"), topology=topo)


@requires_libtpu
def test_compile_sees_two_cores():
    """Compiling for v5p, the kernels see the device's two cores (so the grid is split)."""
    seen = []

    def probe(*args):
        seen.append(backend.tpu_num_cores())
        return window_cases.window_entry("tpu", False)(*args)

    compile_for_tpu(
        probe, *window_cases.window_released(16, 16, jnp.bfloat16), topology=MEGACORE_TOPOLOGY
    )
    assert seen == [2]


@requires_libtpu
def test_the_step_reads_the_cores_from_its_mesh():
    """The paged step passes the kernels the TensorCores of the mesh it is given (the v5p chip's
    two), with no ambient mesh set; a CPU mesh gives one, no mesh leaves the kernels' default."""
    from jax.sharding import Mesh

    from dsv4.paged.step import core_options

    v5p = Mesh(np.array([tpu_device(MEGACORE_TOPOLOGY)]), ("data",))
    assert core_options(v5p) == {"num_cores": 2}
    assert core_options(v5p.abstract_mesh) == {"num_cores": 2}
    assert core_options(Mesh(np.array(jax.devices()[:1]), ("data",))) == {"num_cores": 1}
    assert core_options(None) == {}
