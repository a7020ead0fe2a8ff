"""window_attention: the reference and the kernels (interpret mode) against a float64 oracle built
from dense per-request rows, over NaN-poisoned paged caches.

Tolerances: f32 paths 2e-5 (abs and rel); bf16 pages/queries 1.5e-2 (the kernels feed bf16
probabilities to the value matmul, as on the chip).
"""

from __future__ import annotations

import functools

import aot
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_cases import Step, checking_tpu_interpreter, cpu_only, kernel_mode
from window_cases import (
    PADDING,
    SCENARIOS,
    H,
    S,
    W,
    check_window_out,
    check_window_state,
    window_args,
    window_entry,
    window_released,
    window_step,
)

from pallas_kernels import window_attention

# jax 0.12 deprecates (but ships) the Pallas Triton backend the GPU kernels use.
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


def _run(step: Step, dtype, **kw):
    args, static = window_args(step, dtype)
    return window_attention(*args, **static, **kw)


# --------------------------------------------------------------------------- reference


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_reference_matches_oracle(scenario, dtype):
    step = window_step(scenario, dtype, padding=2, shuffle=True)
    check_window_out(_run(step, dtype, impl="reference"), step, dtype)
    check_window_state(_run(step, dtype, impl="reference", return_state=True), step, dtype)


def test_reference_replay_start():
    step = window_step("mixed", replay_start=[0, 3, 2 * W + 1, 2 * W - 2, 4])
    check_window_out(_run(step, np.float32, impl="reference"), step, np.float32)


def test_default_impl_under_jit():
    """impl=None: the reference on CPU, the chip's own kernel (compiled) on a chip."""
    step = window_step("decode")
    args, static = window_args(step, np.float32)
    fn = jax.jit(functools.partial(window_attention, **static))
    check_window_out(fn(*args), step, np.float32)


def test_debug_check_names_the_bad_block():
    step = window_step("decode")
    step.swa.tables[2, 0] = step.swa.pages.shape[0] + 3
    with pytest.raises(ValueError, match=r"swa_tables\[2, 0\] = .* not a block id"):
        _run(step, np.float32, impl="reference", debug=True)
    args, static = window_args(step, np.float32)
    fn = jax.jit(functools.partial(window_attention, **static, impl="reference", debug=True))
    with pytest.raises(Exception, match=r"swa_tables\[2, 0\]"):
        jax.block_until_ready(fn(*args))


def test_debug_check_names_positions_past_the_table():
    step = window_step("decode")
    step.positions[3] = step.swa.tables.shape[1] * S  # one past the last covered position
    with pytest.raises(ValueError, match=r"positions\[3\] = .* not a position the table covers"):
        _run(step, np.float32, impl="reference", debug=True)


def test_bad_arguments_are_named():
    step = window_step("decode")
    with pytest.raises(ValueError, match="sink has shape"):
        window_attention(
            jnp.asarray(step.q), jnp.asarray(step.swa.pages), jnp.asarray(step.swa.tables),
            jnp.asarray(step.token_req), jnp.asarray(step.positions), jnp.zeros(H + 1),
            window=W, scale=1.0,
        )  # fmt: skip
    with pytest.raises(ValueError, match="impl='cuda'"):
        _run(step, np.float32, impl="cuda")
    with pytest.raises(ValueError, match="window must be"):
        window_attention(
            jnp.asarray(step.q), jnp.asarray(step.swa.pages), jnp.asarray(step.swa.tables),
            jnp.asarray(step.token_req), jnp.asarray(step.positions), jnp.asarray(step.sink),
            window=0, scale=1.0,
        )  # fmt: skip


# --------------------------------------------------------------------------- kernels (interpret)


KERNELS = ("tpu", "gpu")


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_matches_oracle(kernel, scenario, dtype):
    step = window_step(scenario, dtype, padding=PADDING[scenario], shuffle=scenario == "mixed")
    check_window_out(_run(step, dtype, **kernel_mode(kernel)), step, dtype)


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_state_and_replay_start(kernel):
    step = window_step(
        "mixed", padding=3, shuffle=True, replay_start=[0, 3, 2 * W + 1, 2 * W - 2, 4]
    )
    check_window_out(_run(step, np.float32, **kernel_mode(kernel)), step, np.float32)
    check_window_state(
        _run(step, np.float32, return_state=True, **kernel_mode(kernel)), step, np.float32
    )


def test_tpu_kernel_in_the_fast_interpreter_and_unordered_tiles():
    """interpret=True (HLO), tiles of 8 mixing requests and positions in random order."""
    cpu_only()
    step = window_step("prefill", padding=2, shuffle=True)
    check_window_out(_run(step, np.float32, impl="tpu", interpret=True), step, np.float32)


def test_tpu_kernel_splits_long_batches():
    """Batches past the SMEM budget run as several kernel calls (here: 16 + 16 + 8 tokens)."""
    cpu_only()
    kw = dict(impl="tpu", interpret=True, max_tokens_per_call=16)
    step = window_step("prefill", padding=2)
    check_window_out(_run(step, np.float32, **kw), step, np.float32)
    check_window_state(_run(step, np.float32, **kw, return_state=True), step, np.float32)


def test_tpu_checking_interpreter_raises_on_a_bad_block():
    cpu_only()
    step = window_step("decode", padding=1)
    step.swa.tables[6, -1] = step.swa.pages.shape[0] + 5  # inside request 6's window
    with pytest.raises(Exception, match="Out-of-bounds"):
        jax.block_until_ready(
            _run(step, np.float32, impl="tpu", interpret=checking_tpu_interpreter())
        )
    with pytest.raises(ValueError, match=r"swa_tables\[6, 6\]"):
        _run(step, np.float32, impl="tpu", interpret=True, debug=True)


# --------------------------------------------------------------------------- released shapes
# Lowering (plain jax) and deviceless compilation (the `aot` extra: libtpu, CUDA plugin) at the
# released model's shapes, so a kernel that only works in interpret mode cannot pass.


# (tokens, requests, dtype, return_state): a decode batch and a prefill chunk
RELEASED_CASES = {"decode": (128, 128, jnp.bfloat16, False), "prefill": (512, 2, jnp.float32, True)}


@pytest.mark.parametrize("kind", ["TPU v5 lite", "TPU v6 lite"])
def test_tpu_kernel_lowers(kind):
    t, r, dtype, state = RELEASED_CASES["decode"]
    args = window_released(t, r, dtype)
    assert "tpu_custom_call" in aot.lower_for_tpu(
        window_entry("tpu", state), *args, device_kind=kind
    )


def test_gpu_kernel_lowers_for_h100():
    t, r, dtype, state = RELEASED_CASES["decode"]
    assert "triton" in aot.lower_for_gpu(window_entry("gpu", state), *window_released(t, r, dtype))


@aot.requires_libtpu
@pytest.mark.parametrize("case", list(RELEASED_CASES))
@pytest.mark.parametrize("topology", aot.TPU_TOPOLOGIES)
def test_tpu_kernel_compiles(topology, case):
    t, r, dtype, state = RELEASED_CASES[case]
    aot.compile_for_tpu(
        window_entry("tpu", state), *window_released(t, r, dtype), topology=topology
    )


@aot.requires_cuda_plugin
@pytest.mark.parametrize("case", list(RELEASED_CASES))
def test_gpu_kernel_compiles_for_h100(case):
    t, r, dtype, state = RELEASED_CASES[case]
    aot.compile_for_h100(window_entry("gpu", state), *window_released(t, r, dtype))


# --------------------------------------------------------------------------- benchmark


def test_kernel_benchmark_prints_the_cost_model(capsys):
    """benchmarks/kernels.py on CPU: one JSON line, bytes and FLOPs for every shape, no timing."""
    import json

    from benchmarks import kernels

    assert kernels.main(["--quick", "--no-time"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert not out["timed"] and {"window_attention", "sparse_attention"} <= out["results"].keys()
    for rows in out["results"].values():
        assert {r["phase"] for r in rows} == {"decode", "prefill"}
        assert all(r["bytes"] > 0 and r["flops"] > 0 and r["time_s"] is None for r in rows)
    decode = [r for r in out["results"]["window_attention"] if r["phase"] == "decode"]
    # a decode token moves its q, its output and its window's pages (5 pages of 32 x 512 bf16)
    one = next(r for r in decode if r["batch"] == 1)
    assert one["bytes"] >= 2 * 64 * 512 * 2 + 5 * 32 * 512 * 2
