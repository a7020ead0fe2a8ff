"""compressor: the reference against a straightforward per-request NumPy formula, the kernels
against the reference.

Each request owns a raw history of ``[a | s]`` rows (ratio 2) or kv rows (ratio 1); a step
holds one chunk per request. The oracle walks the chunk token by token in float64: it pools a
closing pair from the history, norms, rotates at the group's first position, and writes the
record at the token's slot; the ring afterwards holds the chunk's last raw rows. Pages and ring
rows that the step must not touch are NaN, so a stray read or write shows.
"""

from __future__ import annotations

import aot
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.compressor import compressor

EPS = 1e-6
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}  # absolute, values are O(1) after the norm


def make_step(
    chunks,  # per request: (first position p0, chunk length L, has a ring block)
    *,
    ratio,
    d=256,
    rope=64,
    e=4,
    cap=8,
    pad_tokens=2,
    dtype=jnp.float32,
    seed=0,
):
    """One ragged step plus each request's raw history (for the oracle)."""
    rng = np.random.default_rng(seed)
    width = 2 * d if ratio == 2 else d
    hist = [rng.standard_normal((p0 + n, width)).astype(np.float32) for p0, n, _ in chunks]
    if ratio == 2:
        for h in hist:
            h[:, d:] *= 2.0  # gate logits with some spread
    rows, token_req, positions, qsl = _ragged_rows(hist, chunks, pad_tokens)
    comp_pages, comp_slot = _compressed_slots(rng, chunks, token_req, positions, ratio, e, d)
    ring_block, ring_pages = _ring(rng, hist, chunks, cap, d) if ratio == 2 else (None, None)
    half = rope // 2
    inv_freq = (1.0 / (10000.0 ** (np.arange(half) / half))).astype(np.float32)
    norm_weight = (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    args = dict(
        kv=jnp.asarray(rows, dtype if ratio == 1 else jnp.float32),
        token_req=jnp.asarray(token_req, jnp.int32),
        positions=jnp.asarray(positions, jnp.int32),
        query_start_loc=jnp.asarray(qsl, jnp.int32),
        norm_weight=jnp.asarray(norm_weight, dtype),
        inv_freq=jnp.asarray(inv_freq),
        comp_slot=jnp.asarray(comp_slot),
        ring_block=None if ring_block is None else jnp.asarray(ring_block),
        comp_pages=jnp.asarray(comp_pages, dtype),
        ring_pages=None if ring_pages is None else jnp.asarray(ring_pages),
    )
    return args, hist


def _ragged_rows(hist, chunks, pad_tokens):
    """The step's raw rows (each chunk's, then ``pad_tokens`` NaN padding rows), their
    requests, positions (-1: padding) and ``query_start_loc``."""
    rows, token_req, positions, qsl = [], [], [], [0]
    for i, (p0, n, _) in enumerate(chunks):
        rows.append(hist[i][p0 : p0 + n])
        token_req += [i] * n
        positions += list(range(p0, p0 + n))
        qsl.append(qsl[-1] + n)
    rows.append(np.full((pad_tokens, hist[0].shape[1]), np.nan, np.float32))
    token_req += [0] * pad_tokens
    positions += [-1] * pad_tokens
    return np.concatenate(rows), token_req, positions, qsl


def _compressed_slots(rng, chunks, token_req, positions, ratio, e, d):
    """NaN compressed pages of ``e`` entries behind shuffled block tables, and the slot each
    token closing a group of ``ratio`` writes (-1: none)."""
    r = len(chunks)
    max_entries = max((p0 + n) // ratio for p0, n, _ in chunks) + 1
    nb = -(-max_entries // e)
    num_pages = 1 + r * nb + 2
    perm = rng.permutation(np.arange(1, num_pages))
    tables = perm[: r * nb].reshape(r, nb).astype(np.int32)
    comp_pages = np.full((num_pages, e, d), np.nan, np.float32)
    comp_slot = np.full(len(positions), -1, np.int32)
    for i, p in enumerate(positions):
        if p >= 0 and (p + 1) % ratio == 0:
            j = p // ratio
            comp_slot[i] = tables[token_req[i], j // e] * e + j % e
    return comp_pages, comp_slot


def _ring(rng, hist, chunks, cap, d):
    """Ratio 2's ring of ``cap`` raw rows per request (NaN but for what earlier steps left in
    the rings of the requests that have one) and each request's ring block."""
    r = len(chunks)
    ring_pages = np.full((r + 3, cap, 2 * d), np.nan, np.float32)
    ring_block = np.zeros(r, np.int32)
    ring_ids = rng.permutation(np.arange(1, r + 3))
    for i, (p0, _n, has_ring) in enumerate(chunks):
        if not has_ring:
            continue
        ring_block[i] = ring_ids[i]
        for p in range(max(0, p0 - cap), p0):  # what earlier steps left in the ring
            ring_pages[ring_block[i], p % cap] = hist[i][p]
    return ring_block, ring_pages


def oracle(args, hist, chunks, *, ratio):
    """Expected (latent, comp_pages, ring_pages) in float64, per request and token."""
    d = args["comp_pages"].shape[2]
    latent = np.zeros((args["positions"].shape[0], d))
    pages = np.array(args["comp_pages"], np.float64)
    ring = None if args["ring_pages"] is None else np.array(args["ring_pages"], np.float64)
    w = np.asarray(args["norm_weight"], np.float64)
    inv = np.asarray(args["inv_freq"], np.float64)
    e = pages.shape[1]
    qsl = np.asarray(args["query_start_loc"])
    slots = np.asarray(args["comp_slot"])
    for i, (p0, n, has_ring) in enumerate(chunks):
        h = hist[i].astype(np.float64)
        for t in range(qsl[i], qsl[i] + n):
            p = p0 + t - qsl[i]
            if (p + 1) % ratio:
                continue
            if ratio == 1:
                x = h[p]
            else:
                if p == p0 and not has_ring:
                    continue  # the pair's first half is gone: no latent, no record
                a, s = h[p - 1 : p + 1, :d], h[p - 1 : p + 1, d:]
                g = np.exp(s - s.max(0))
                x = (a * g / g.sum(0)).sum(0)
            z = w * x / np.sqrt(np.mean(x * x) + EPS)
            latent[t] = z
            ang = (ratio * (p // ratio)) * inv
            c, sn = np.cos(ang), np.sin(ang)
            rot = z.copy()
            x0, x1 = z[d - 2 * len(inv) :: 2], z[d - 2 * len(inv) + 1 :: 2]
            rot[d - 2 * len(inv) :: 2] = x0 * c - x1 * sn
            rot[d - 2 * len(inv) + 1 :: 2] = x0 * sn + x1 * c
            pages[slots[t] // e, slots[t] % e] = rot
        if ratio == 2 and has_ring:
            rb = int(args["ring_block"][i])
            cap = ring.shape[1]
            for p in range(max(p0, p0 + n - cap), p0 + n):
                ring[rb, p % cap] = h[p]
    return latent, pages, ring


def assert_close_nan(got, want, tol, what):
    got = np.asarray(got, np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{what}: NaN pattern")
    np.testing.assert_allclose(np.nan_to_num(got), np.nan_to_num(want), atol=tol, err_msg=what)


def run_and_check(chunks, *, ratio, impl="reference", interpret=False, dtype=jnp.float32, **kw):
    args, hist = make_step(chunks, ratio=ratio, dtype=dtype, **kw)
    latent, pages, ring = compressor(**args, ratio=ratio, eps=EPS, impl=impl, interpret=interpret)
    want = oracle(args, hist, chunks, ratio=ratio)
    tol = TOL[dtype]
    assert latent.dtype == (dtype if ratio == 1 else args["comp_pages"].dtype)
    assert_close_nan(latent, want[0], tol, "latent")
    assert_close_nan(pages, want[1], tol, "comp_pages")
    if ratio == 2:
        assert_close_nan(ring, want[2], 0.0, "ring_pages")
    else:
        assert ring is None
    return args


# -- scenarios: (p0, chunk length, has ring) per request -----------------------------------------

SCENARIOS = {
    "decode": [(0, 1, True), (1, 1, True), (6, 1, True), (9, 1, True), (14, 1, False)],
    "prefill": [(0, 13, True), (0, 2, True), (0, 1, True)],
    "mixed": [(5, 6, True), (0, 9, True), (12, 1, True), (3, 1, False), (7, 12, True)],
}


@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_reference_matches_oracle(name, ratio):
    run_and_check(SCENARIOS[name], ratio=ratio, seed=sorted(SCENARIOS).index(name))


def test_reference_bf16():
    run_and_check(SCENARIOS["mixed"], ratio=2, dtype=jnp.bfloat16)
    run_and_check(SCENARIOS["mixed"], ratio=1, dtype=jnp.bfloat16)


def test_reference_rejects_bad_arguments():
    args, _ = make_step([(0, 4, True)], ratio=2)
    with pytest.raises(ValueError, match="ratio must be 1 or 2"):
        compressor(**args, ratio=4, eps=EPS, impl="reference")
    bad = dict(args, ring_pages=None)
    with pytest.raises(ValueError, match="ring_pages"):
        compressor(**bad, ratio=2, eps=EPS, impl="reference")


# -- kernels against the reference, in the interpreters -----------------------------------------

CHECKING = dict(detect_races=True, uninitialized_memory="nan", out_of_bounds_reads="raise")


def checking_interpreter():
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams(**CHECKING)


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_kernel_matches_oracle(name, ratio, impl):
    run_and_check(SCENARIOS[name], ratio=ratio, impl=impl, interpret=True, seed=7)


def test_gpu_kernel_bf16():
    run_and_check(SCENARIOS["mixed"], ratio=2, impl="gpu", interpret=True, dtype=jnp.bfloat16)
    run_and_check(SCENARIOS["decode"], ratio=1, impl="gpu", interpret=True, dtype=jnp.bfloat16)


def test_tpu_kernel_refuses_16_bit_records():
    """A 16-bit record row is half of a packed row pair in HBM: no single-row DMA reaches it."""
    with pytest.raises(NotImplementedError, match="32-bit records"):
        run_and_check(SCENARIOS["decode"], ratio=1, impl="tpu", interpret=True, dtype=jnp.bfloat16)


@pytest.mark.parametrize("ratio", [1, 2])
def test_tpu_kernel_checking_interpreter(ratio):
    """Simulated DMAs and semaphores, NaN-filled scratch, race detection."""
    run_and_check(SCENARIOS["mixed"], ratio=ratio, impl="tpu", interpret=checking_interpreter())


def test_tpu_kernel_long_chunk_rereads_ring_before_overwriting_it():
    """A chunk of more than C tokens from an odd position overwrites the ring row its first
    token pools from: the read must come first."""
    run_and_check([(9, 11, True), (3, 1, True)], ratio=2, impl="tpu", interpret=True)
    run_and_check([(9, 11, True), (3, 1, True)], ratio=2, impl="gpu", interpret=True)


def _bad_block(what: str, ring_past: int) -> dict:
    """A ratio-2 step whose compressed slots (``what="slot"``) point past the pages, or whose
    ring blocks (``"ring"``) point ``ring_past`` rows past the ring's last block."""
    args, _ = make_step([(3, 4, True)], ratio=2)
    if what == "slot":
        p, e, _ = args["comp_pages"].shape
        args["comp_slot"] = jnp.where(args["comp_slot"] >= 0, p * e + 1, -1)
    else:
        ring_block = args["ring_pages"].shape[0] + ring_past
        args["ring_block"] = jnp.full_like(args["ring_block"], ring_block)
    return args


@pytest.mark.parametrize("what", ["slot", "ring"])
def test_tpu_checking_interpreter_raises_on_bad_block(what):
    args = _bad_block(what, ring_past=2)
    with pytest.raises(Exception, match=r"[Oo]ut.of.bounds"):
        latent, pages, ring = compressor(
            **args, ratio=2, eps=EPS, impl="tpu", interpret=checking_interpreter()
        )
        pages.block_until_ready()


@pytest.fixture(autouse=True)
def _reset_tpu_interpreter():
    yield
    from jax.experimental.pallas import tpu as pltpu

    pltpu.reset_tpu_interpret_mode_state()  # required after an exception in the interpreter


# -- deviceless compiles at the released shapes ------------------------------------------------
# latent 512, rope 64, pages of 64 tokens (64 entries at ratio 1, 32 at ratio 2), ring of 8;
# a 256-token ragged step of 8 requests.


def _released(ratio, record=jnp.float32, tokens=256, reqs=8):
    import jax

    s = jax.ShapeDtypeStruct
    i32 = jnp.int32
    d, e = 512, 64 // ratio
    return dict(
        kv=s((tokens, d), record) if ratio == 1 else s((tokens, 2 * d), jnp.float32),
        token_req=s((tokens,), i32),
        positions=s((tokens,), i32),
        query_start_loc=s((reqs + 1,), i32),
        norm_weight=s((d,), record),
        inv_freq=s((32,), jnp.float32),
        comp_slot=s((tokens,), i32),
        ring_block=s((reqs,), i32) if ratio == 2 else None,
        comp_pages=s((512, e, d), record),
        ring_pages=s((reqs + 1, 8, 2 * d), jnp.float32) if ratio == 2 else None,
    )


def _released_fn(ratio, impl):
    return lambda a: compressor(**a, ratio=ratio, eps=EPS, impl=impl)


@aot.requires_libtpu
@pytest.mark.parametrize("topology", ["v5e:1x1", "v6e:1x1"])
@pytest.mark.parametrize("ratio", [1, 2])
def test_tpu_compiles_at_released_shapes(ratio, topology):
    aot.compile_for_tpu(_released_fn(ratio, "tpu"), _released(ratio), topology=topology)


@aot.requires_cuda_plugin
@pytest.mark.parametrize("record", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("ratio", [1, 2])
def test_h100_compiles_at_released_shapes(ratio, record):
    aot.compile_for_h100(_released_fn(ratio, "gpu"), _released(ratio, record))


@pytest.mark.parametrize("ratio", [1, 2])
def test_lowers_at_released_shapes(ratio):
    assert "tpu_custom_call" in aot.lower_for_tpu(_released_fn(ratio, "tpu"), _released(ratio))
    assert "triton" in aot.lower_for_gpu(_released_fn(ratio, "gpu"), _released(ratio, jnp.bfloat16))


@pytest.mark.parametrize("what", ["slot", "ring"])
def test_debug_check_raises_on_bad_block(what):
    args = _bad_block(what, ring_past=0)
    with pytest.raises(Exception, match="comp_slot" if what == "slot" else "ring_block"):
        compressor(**args, ratio=2, eps=EPS, impl="reference", debug=True)


# -- latents only (no records: the paged step writes them through its pools) ---------------------


@pytest.mark.parametrize("impl", ["reference", "tpu", "gpu"])
@pytest.mark.parametrize("ratio", [1, 2])
def test_latents_only_without_pages(ratio, impl):
    """comp_slot = comp_pages = None: the same latents and ring as with records, no pages back;
    bf16 latents on every backend (the TPU kernel's 32-bit-record limit does not apply)."""
    dtype = jnp.bfloat16
    args, hist = make_step(SCENARIOS["mixed"], ratio=ratio, dtype=dtype, seed=9)
    want = oracle(args, hist, SCENARIOS["mixed"], ratio=ratio)
    args = dict(args, comp_slot=None, comp_pages=None)
    interpret = impl != "reference"
    latent, pages, ring = compressor(
        **args, ratio=ratio, eps=EPS, latent_dtype=dtype, impl=impl, interpret=interpret
    )
    assert pages is None and latent.dtype == dtype
    assert_close_nan(latent, want[0], TOL[dtype], "latent")
    if ratio == 2:
        assert_close_nan(ring, want[2], 0.0, "ring_pages")


def test_latents_only_argument_errors():
    args, _ = make_step(SCENARIOS["decode"], ratio=2)
    with pytest.raises(ValueError, match="comp_slot and comp_pages go together"):
        compressor(**dict(args, comp_pages=None), ratio=2, eps=EPS, impl="reference")
    with pytest.raises(ValueError, match="needs latent_dtype"):
        compressor(**dict(args, comp_slot=None, comp_pages=None), ratio=2, eps=EPS,
                   impl="reference")  # fmt: skip
