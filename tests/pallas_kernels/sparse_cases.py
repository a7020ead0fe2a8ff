"""sparse_attention test cases: the tiny kernel steps with their selections, their checks and the
released shapes (shared by test_sparse_attention.py and test_megacore.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from paged_cases import (
    Selection,
    Step,
    kernel_arrays,
    make_selection,
    make_step,
    sparse_out,
)

from pallas_kernels import sparse_attention, window_attention

H, D, S, W = 16, 128, 8, 16  # heads, latent, window page size, window
E, K = 8, 16  # entries per compressed block, top-k width
TOL = {np.float32: 2e-5, jnp.bfloat16: 1.5e-2}


# (length after the step, new tokens) per request, and compressed entries per request
SCENARIOS = {
    "decode": ([(1, 1), (W + 1, 1), (3 * W, 1), (2 * W, 1)], [1, 9, 3 * E + 1, 2 * E]),
    "prefill": ([(W + 3, W + 3)], [2 * E + 3]),
    "mixed": ([(5, 1), (W + 2, 4), (3 * W, 1), (2 * W + 1, 3)], [E, 5, 3 * E, 2 * E + 1]),
}


def sparse_case(scenario, dtype=np.float32, seed=0, *, padding=2, shuffle=True, **kw):
    rng = np.random.default_rng(seed)
    np_dtype = np.float32 if dtype == np.float32 else jnp.bfloat16
    requests, entries = SCENARIOS[scenario]
    step = make_step(
        rng, requests, heads=H, dim=D, page_size=S, window=W, dtype=np_dtype,
        padding=padding, shuffle=shuffle,
    )  # fmt: skip
    sel = make_selection(rng, step, entries, k=K, entries_per_block=E, dtype=np_dtype, **kw)
    return step, sel


def sparse_args(step: Step, sel: Selection, dtype):
    args = kernel_arrays(step, sel.comp, dtype, jnp.asarray(sel.topk))
    return args, dict(entries_per_block=E, scale=step.scale)


def window_state_of(step: Step, dtype):
    return window_attention(
        *kernel_arrays(step, step.swa, dtype), window=step.window, scale=step.scale,
        return_state=True, impl="reference",
    )  # fmt: skip


def check_sparse(out, step: Step, sel: Selection, dtype, *, with_window: bool):
    assert out.dtype == dtype and out.shape == step.q.shape
    tol = TOL[dtype]
    want = sparse_out(step, sel, with_window=with_window)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=tol, rtol=tol)


SPARSE_REL = dict(heads=64, dim=512, topk=512, pages=8192, tokens=1 << 20)


def sparse_released(num_tokens, num_requests, dtype, per_block, with_state):
    sds = jax.ShapeDtypeStruct
    i32, f32 = jnp.int32, jnp.float32
    h, d = SPARSE_REL["heads"], SPARSE_REL["dim"]
    args = (
        sds((num_tokens, h, d), dtype),
        sds((SPARSE_REL["pages"], per_block, d), dtype),
        sds((num_requests, SPARSE_REL["tokens"] // 64), i32),
        sds((num_tokens,), i32),
        sds((num_tokens,), i32),
        sds((num_tokens, SPARSE_REL["topk"]), i32),
        sds((h,), f32),
    )
    state = (sds((num_tokens, h), f32), sds((num_tokens, h), f32), sds((num_tokens, h, d), f32))
    return args + (state,) if with_state else args


def sparse_entry(impl, per_block, **kw):
    def run(*args):
        state = args[7] if len(args) > 7 else None
        return sparse_attention(
            *args[:7], entries_per_block=per_block, scale=SPARSE_REL["dim"] ** -0.5, state=state,
            impl=impl, **kw,
        )  # fmt: skip

    return run
