"""sparse_attention: the reference and the kernels (interpret mode) against a float64 oracle of
one softmax over the window and the selected entries, over NaN-poisoned paged caches.

Tolerances: f32 paths 2e-5 (abs and rel); bf16 pages/queries 1.5e-2.
"""

from __future__ import annotations

import functools

import aot
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_cases import (
    checking_tpu_interpreter,
    cpu_only,
    kernel_mode,
)
from sparse_cases import (
    SCENARIOS,
    E,
    W,
    check_sparse,
    sparse_args,
    sparse_case,
    sparse_entry,
    sparse_released,
    window_state_of,
)

from pallas_kernels import sparse_attention, window_attention
from pallas_kernels.sparse_attention import tpu

# jax 0.12 deprecates (but ships) the Pallas Triton backend the GPU kernels use.
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


# --------------------------------------------------------------------------- reference


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_reference_matches_oracle(scenario, dtype):
    step, sel = sparse_case(scenario, dtype, empty_rows=(0,))
    args, static = sparse_args(step, sel, dtype)
    state = window_state_of(step, dtype)
    out = sparse_attention(*args, **static, state=state, impl="reference")
    check_sparse(out, step, sel, dtype, with_window=True)
    out = sparse_attention(*args, **static, impl="reference")
    check_sparse(out, step, sel, dtype, with_window=False)


def test_reference_all_rows_empty_gives_window_only():
    step, sel = sparse_case("mixed", empty_rows=tuple(range(20)))
    assert np.all(sel.topk == -1)
    args, static = sparse_args(step, sel, np.float32)
    out = sparse_attention(*args, **static, state=window_state_of(step, np.float32))
    np.testing.assert_allclose(np.asarray(out), step.window_out(), atol=2e-5, rtol=2e-5)
    # nothing at all to attend to: zeros, not NaN
    out = sparse_attention(*args, **static)
    assert np.all(np.asarray(out) == 0)


def test_debug_check_names_the_bad_block():
    step, sel = sparse_case("decode")
    sel.comp.tables[1, 0] = -4
    args, static = sparse_args(step, sel, np.float32)
    with pytest.raises(ValueError, match=r"comp_tables\[1, 0\] = -4 is not a block id"):
        sparse_attention(*args, **static, debug=True)
    fn = jax.jit(functools.partial(sparse_attention, **static, debug=True))
    with pytest.raises(Exception, match=r"comp_tables\[1, 0\]"):
        jax.block_until_ready(fn(*args))


def test_debug_check_names_entries_past_the_table():
    step, sel = sparse_case("decode")
    sel.topk[2, 5] = sel.comp.tables.shape[1] * E
    args, static = sparse_args(step, sel, np.float32)
    with pytest.raises(ValueError, match=r"topk\[2, 5\] = .* not an entry id the table covers"):
        sparse_attention(*args, **static, debug=True)


def test_bad_arguments_are_named():
    step, sel = sparse_case("decode")
    args, static = sparse_args(step, sel, np.float32)
    with pytest.raises(ValueError, match=r"comp_pages has shape .* expected \('P', 7, 'D'\)"):
        sparse_attention(*args, entries_per_block=7, scale=1.0)
    with pytest.raises(ValueError, match="state must be"):
        sparse_attention(*args, **static, state=(args[0],))
    with pytest.raises(ValueError, match="topk must be int32"):
        sparse_attention(*args[:5], args[5].astype(jnp.int16), args[6], **static)


# --------------------------------------------------------------------------- kernels (interpret)


KERNELS = ("tpu", "gpu")


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_matches_oracle(kernel, scenario, dtype):
    step, sel = sparse_case(scenario, dtype, empty_rows=(0,))
    args, static = sparse_args(step, sel, dtype)
    out = sparse_attention(
        *args, **static, state=window_state_of(step, dtype), **kernel_mode(kernel)
    )
    check_sparse(out, step, sel, dtype, with_window=True)


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_without_window_state(kernel):
    step, sel = sparse_case("mixed", empty_rows=(1,))
    args, static = sparse_args(step, sel, np.float32)
    out = sparse_attention(*args, **static, **kernel_mode(kernel))
    check_sparse(out, step, sel, np.float32, with_window=False)


@pytest.mark.parametrize(
    "dtype,interpret",
    [(jnp.bfloat16, "checking"), (np.float32, "hlo"), (jnp.bfloat16, "hlo")],
)
def test_tpu_kernel_shares_rows_between_tokens_of_a_request(dtype, interpret):
    """Tiles of 4 tokens fetch the union of their picks once (mixed requests, shuffled)."""
    cpu_only()
    step, sel = sparse_case("mixed", dtype, padding=3, empty_rows=(2,), shared_fraction=0.6)
    assert len(step.positions) % 4 == 0
    args, static = sparse_args(step, sel, dtype)
    mode = checking_tpu_interpreter() if interpret == "checking" else True
    out = tpu.sparse_attention(
        *args, **static, state=window_state_of(step, dtype), interpret=mode, tokens_per_tile=4
    )
    check_sparse(out, step, sel, dtype, with_window=True)


def test_tpu_kernels_chain_window_state_into_sparse():
    """The window kernel's state feeds the sparse kernel: one softmax over both."""
    cpu_only()
    step, sel = sparse_case("prefill", empty_rows=(3,))
    args, static = sparse_args(step, sel, np.float32)
    state = window_attention(
        *args[:1], jnp.asarray(step.swa.pages), jnp.asarray(step.swa.tables), *args[3:5],
        args[6], window=W, scale=step.scale, return_state=True, impl="tpu", interpret=True,
    )  # fmt: skip
    out = sparse_attention(*args, **static, state=state, impl="tpu", interpret=True)
    check_sparse(out, step, sel, np.float32, with_window=True)


def test_tpu_kernel_splits_long_batches():
    """Batches past the SMEM budget run as several kernel calls (here: 8 + 4 tokens)."""
    cpu_only()
    step, sel = sparse_case("mixed", padding=3)
    args, static = sparse_args(step, sel, np.float32)
    out = sparse_attention(
        *args, **static, state=window_state_of(step, np.float32), impl="tpu", interpret=True,
        max_tokens_per_call=8,
    )  # fmt: skip
    check_sparse(out, step, sel, np.float32, with_window=True)


def test_tpu_checking_interpreter_raises_on_a_bad_block():
    cpu_only()
    step, sel = sparse_case("decode", padding=0, shuffle=False)
    r = 2
    t = int(np.flatnonzero(step.token_req == r)[0])
    picked = sel.topk[t][sel.topk[t] >= 0]
    sel.comp.tables[r, picked[0] // E] = sel.comp.pages.shape[0] + 7
    args, static = sparse_args(step, sel, np.float32)
    with pytest.raises(Exception, match="Out-of-bounds"):
        jax.block_until_ready(
            sparse_attention(*args, **static, impl="tpu", interpret=checking_tpu_interpreter())
        )
    with pytest.raises(ValueError, match=rf"comp_tables\[{r}, "):
        sparse_attention(*args, **static, impl="tpu", interpret=True, debug=True)


def test_tpu_row_lists_fetch_a_requests_union_once():
    """Four tokens of request 1 picking overlapping entries: each entry is fetched once, and every
    token's segment is its request's part of the tile's list."""
    tables = jnp.asarray([[1, 2], [3, 4]], jnp.int32)
    token_req = jnp.asarray([1, 1, 0, 1], jnp.int32)
    positions = jnp.asarray([5, 6, 3, -1], jnp.int32)
    topk = jnp.asarray([[3, 9, -1], [9, 3, 4], [3, -1, -1], [7, 7, 7]], jnp.int32)
    addr, ids, seg = tpu.row_lists(tables, token_req, positions, topk, per_block=8, tq=4)
    # request 1 (first seen at token 0): {3, 4, 9}, then request 0 (token 2): {3}
    assert ids.tolist() == [[3, 4, 9, 3] + [-1] * 8]
    assert addr.tolist() == [[3 * 8 + 3, 3 * 8 + 4, 4 * 8 + 1, 1 * 8 + 3] + [-1] * 8]
    assert seg.tolist() == [[0, 3], [0, 3], [3, 4], [0, 3]]  # the padding token's picks are gone


# --------------------------------------------------------------------------- released shapes
# Lowering (plain jax) and deviceless compilation (the `aot` extra) at the released model's
# shapes: 64 heads, latent 512, top-k 512, compressed pages of 64 raw tokens (E = 64 entries at
# ratio 1, 32 at ratio 2), 1M-token block tables.


# (tokens, requests, dtype, entries per block, with window state)
RELEASED_CASES = {
    "decode-ratio1": (128, 128, jnp.bfloat16, 64, True),
    "decode-ratio2": (64, 64, jnp.float32, 32, False),
}


@pytest.mark.parametrize("kind", ["TPU v5 lite", "TPU v6 lite"])
def test_tpu_kernel_lowers(kind):
    t, r, dtype, e, state = RELEASED_CASES["decode-ratio1"]
    text = aot.lower_for_tpu(
        sparse_entry("tpu", e), *sparse_released(t, r, dtype, e, state), device_kind=kind
    )
    assert "tpu_custom_call" in text


def test_gpu_kernel_lowers_for_h100():
    t, r, dtype, e, state = RELEASED_CASES["decode-ratio1"]
    assert "triton" in aot.lower_for_gpu(
        sparse_entry("gpu", e), *sparse_released(t, r, dtype, e, state)
    )


@aot.requires_libtpu
@pytest.mark.parametrize("case", list(RELEASED_CASES))
@pytest.mark.parametrize("topology", aot.TPU_TOPOLOGIES)
def test_tpu_kernel_compiles(topology, case):
    t, r, dtype, e, state = RELEASED_CASES[case]
    aot.compile_for_tpu(
        sparse_entry("tpu", e), *sparse_released(t, r, dtype, e, state), topology=topology
    )


@aot.requires_libtpu
def test_tpu_kernel_with_row_sharing_compiles():
    """Speculative decode: 32 requests x 4 tokens, tiles of 4 sharing their union."""
    args = sparse_released(128, 32, jnp.bfloat16, 64, True)
    aot.compile_for_tpu(sparse_entry("tpu", 64, tokens_per_tile=4), *args, topology="v5e:1x1")


@aot.requires_cuda_plugin
@pytest.mark.parametrize("case", list(RELEASED_CASES))
def test_gpu_kernel_compiles_for_h100(case):
    t, r, dtype, e, state = RELEASED_CASES[case]
    aot.compile_for_h100(sparse_entry("gpu", e), *sparse_released(t, r, dtype, e, state))


@aot.requires_libtpu
@aot.requires_cuda_plugin
def test_kernels_compile_for_awkward_sizes():
    """Nothing needs powers of two or aligned counts: 100 tokens, top-300, 999 pages, 77-wide
    tables (Triton shapes are padded inside the kernel entry)."""
    sds = jax.ShapeDtypeStruct
    i32, bf16 = jnp.int32, jnp.bfloat16
    args = (
        sds((100, 64, 512), bf16), sds((999, 64, 512), bf16), sds((3, 77), i32),
        sds((100,), i32), sds((100,), i32), sds((100, 300), i32), sds((64,), jnp.float32),
    )  # fmt: skip
    aot.compile_for_h100(sparse_entry("gpu", 64), *args)
    aot.compile_for_tpu(sparse_entry("tpu", 64), *args, topology="v6e:1x1")
