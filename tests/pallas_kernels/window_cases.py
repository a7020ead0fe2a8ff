"""window_attention test cases: the tiny kernel steps, their checks and the released shapes
(shared by test_window_attention.py and test_megacore.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from paged_cases import Step, kernel_arrays, make_step

from pallas_kernels import window_attention

H, D, S, W = 16, 128, 8, 16  # heads, latent, page size, window (kernel tests: tiny on purpose)
TOL = {np.float32: 2e-5, jnp.bfloat16: 1.5e-2}


# (length after the step, new tokens) per request: lengths 1, window +- 1, page boundaries.
SCENARIOS = {
    "decode": [(1, 1), (W, 1), (W + 1, 1), (W - 1, 1), (S, 1), (S + 1, 1), (3 * W + 5, 1)],
    "prefill": [(W + 3, W + 3), (2 * W + S, W), (S - 1, S - 1)],
    "mixed": [(5, 1), (W + 2, W + 2), (3 * W, 1), (2 * W + 1, 3), (S, 1)],
}


# padding tokens per scenario: T = 8, 40 (tiles of 8 tokens on the TPU kernel) and 27 (odd)
PADDING = {"decode": 1, "prefill": 2, "mixed": 2}


def window_args(step: Step, dtype):
    """The positional arguments and the static keywords of a step."""
    args = kernel_arrays(step, step.swa, dtype)
    rs = None if step.replay_start is None else jnp.asarray(step.replay_start)
    return args, dict(window=step.window, scale=step.scale, replay_start=rs)


def check_window_out(out, step: Step, dtype):
    assert out.dtype == dtype and out.shape == step.q.shape
    tol = TOL[dtype]
    np.testing.assert_allclose(np.asarray(out, np.float64), step.window_out(), atol=tol, rtol=tol)


def check_window_state(state, step: Step, dtype):
    m, denom, acc = (np.asarray(x, np.float64) for x in state)
    want_m, want_l, want_acc = step.window_state()
    tol = TOL[dtype]
    np.testing.assert_allclose(m, want_m, atol=tol, rtol=tol)
    np.testing.assert_allclose(denom, want_l, atol=tol, rtol=tol)
    np.testing.assert_allclose(acc, want_acc, atol=tol * 4, rtol=tol)
    pad = step.positions < 0
    assert np.all(m[pad] == np.float32(-1e30)) and np.all(denom[pad] == 0) and np.all(acc[pad] == 0)


def window_step(scenario, dtype=np.float32, seed=0, **kw):
    rng = np.random.default_rng(seed)
    np_dtype = np.float32 if dtype == np.float32 else jnp.bfloat16
    return make_step(
        rng, SCENARIOS[scenario], heads=H, dim=D, page_size=S, window=W, dtype=np_dtype, **kw
    )


WINDOW_REL = dict(heads=64, dim=512, page=32, window=128, pages=4096, table=32768)  # 1M tokens / 32


def window_released(num_tokens, num_requests, dtype):
    sds = jax.ShapeDtypeStruct
    i32 = jnp.int32
    return (
        sds((num_tokens, WINDOW_REL["heads"], WINDOW_REL["dim"]), dtype),
        sds((WINDOW_REL["pages"], WINDOW_REL["page"], WINDOW_REL["dim"]), dtype),
        sds((num_requests, WINDOW_REL["table"]), i32),
        sds((num_tokens,), i32),
        sds((num_tokens,), i32),
        sds((WINDOW_REL["heads"],), jnp.float32),
    )


def window_entry(impl, return_state):
    return functools.partial(
        window_attention,
        window=WINDOW_REL["window"],
        scale=WINDOW_REL["dim"] ** -0.5,
        return_state=return_state,
        impl=impl,
    )
