"""sparse_attention: the reference and the kernels (interpret mode) against a float64 oracle of
one softmax over the window and the selected entries, over NaN-poisoned paged caches.

Tolerances: f32 paths 2e-5 (abs and rel); bf16 pages/queries 1.5e-2.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_cases import Selection, Step, make_selection, make_step, sparse_out

from pallas_kernels import sparse_attention, window_attention

H, D, S, W = 4, 128, 8, 16  # heads, latent, window page size, window
E, K = 8, 16  # entries per compressed block, top-k width
TOL = {np.float32: 2e-5, jnp.bfloat16: 1.5e-2}

# (length after the step, new tokens) per request, and compressed entries per request
SCENARIOS = {
    "decode": ([(1, 1), (W + 1, 1), (3 * W, 1), (2 * W, 1)], [1, 9, 3 * E + 1, 2 * E]),
    "prefill": ([(W + 3, W + 3)], [2 * E + 3]),
    "mixed": ([(5, 1), (W + 2, 4), (3 * W, 1), (2 * W + 1, 3)], [E, 5, 3 * E, 2 * E + 1]),
}


def _case(scenario, dtype=np.float32, seed=0, *, padding=2, shuffle=True, **kw):
    rng = np.random.default_rng(seed)
    np_dtype = np.float32 if dtype == np.float32 else jnp.bfloat16
    requests, entries = SCENARIOS[scenario]
    step = make_step(
        rng, requests, heads=H, dim=D, page_size=S, window=W, dtype=np_dtype,
        padding=padding, shuffle=shuffle,
    )  # fmt: skip
    sel = make_selection(rng, step, entries, k=K, entries_per_block=E, dtype=np_dtype, **kw)
    return step, sel


def _args(step: Step, sel: Selection, dtype):
    args = (
        jnp.asarray(step.q, dtype),
        jnp.asarray(sel.comp.pages, dtype),
        jnp.asarray(sel.comp.tables),
        jnp.asarray(step.token_req),
        jnp.asarray(step.positions),
        jnp.asarray(sel.topk),
        jnp.asarray(step.sink),
    )
    return args, dict(entries_per_block=E, scale=step.scale)


def _window_state(step: Step, dtype):
    return window_attention(
        jnp.asarray(step.q, dtype), jnp.asarray(step.swa.pages, dtype),
        jnp.asarray(step.swa.tables), jnp.asarray(step.token_req), jnp.asarray(step.positions),
        jnp.asarray(step.sink), window=step.window, scale=step.scale, return_state=True,
        impl="reference",
    )  # fmt: skip


def _check(out, step: Step, sel: Selection, dtype, *, with_window: bool):
    assert out.dtype == dtype and out.shape == step.q.shape
    tol = TOL[dtype]
    want = sparse_out(step, sel, with_window=with_window)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=tol, rtol=tol)


# --------------------------------------------------------------------------- reference


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_reference_matches_oracle(scenario, dtype):
    step, sel = _case(scenario, dtype, empty_rows=(0,))
    args, static = _args(step, sel, dtype)
    state = _window_state(step, dtype)
    out = sparse_attention(*args, **static, state=state, impl="reference")
    _check(out, step, sel, dtype, with_window=True)
    out = sparse_attention(*args, **static, impl="reference")
    _check(out, step, sel, dtype, with_window=False)


def test_reference_all_rows_empty_gives_window_only():
    step, sel = _case("mixed", empty_rows=tuple(range(20)))
    assert np.all(sel.topk == -1)
    args, static = _args(step, sel, np.float32)
    out = sparse_attention(*args, **static, state=_window_state(step, np.float32))
    np.testing.assert_allclose(np.asarray(out), step.window_out(), atol=2e-5, rtol=2e-5)
    # nothing at all to attend to: zeros, not NaN
    out = sparse_attention(*args, **static)
    assert np.all(np.asarray(out) == 0)


def test_debug_check_names_the_bad_block():
    step, sel = _case("decode")
    sel.comp.tables[1, 0] = -4
    args, static = _args(step, sel, np.float32)
    with pytest.raises(ValueError, match=r"comp_tables\[1, 0\] = -4 is not a block id"):
        sparse_attention(*args, **static, debug=True)
    fn = jax.jit(functools.partial(sparse_attention, **static, debug=True))
    with pytest.raises(Exception, match=r"comp_tables\[1, 0\]"):
        jax.block_until_ready(fn(*args))


def test_bad_arguments_are_named():
    step, sel = _case("decode")
    args, static = _args(step, sel, np.float32)
    with pytest.raises(ValueError, match=r"comp_pages has shape .* expected \('P', 7, 'D'\)"):
        sparse_attention(*args, entries_per_block=7, scale=1.0)
    with pytest.raises(ValueError, match="state must be"):
        sparse_attention(*args, **static, state=(args[0],))
    with pytest.raises(ValueError, match="topk must be int32"):
        sparse_attention(*args[:5], args[5].astype(jnp.int16), args[6], **static)
