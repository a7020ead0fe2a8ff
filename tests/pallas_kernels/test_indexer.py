"""indexer_topk: the reference against the dense model math (dsv4.reference), the kernels
against the reference.

Pages are laid out in random order, every unused page (and the null block 0, and the unused
tail of a request's last page) is NaN, so a read outside the visible entries poisons a score.
Integer-valued queries, keys and weights make every score exact in f32, so tie-breaking (ties
to the lower index) is compared exactly; float data is compared by the oracle scores of the
picks (tolerance stated at the checker).
"""

from __future__ import annotations

import aot
import jax.numpy as jnp
import numpy as np
import pytest
from indexer_cases import (
    RELEASED_MODES,
    indexer_fn,
    indexer_released,
)

from dsv4 import reference as dense
from pallas_kernels.indexer import indexer_topk

FLOAT_TOL = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2}  # relative, on the picked scores


# -- inputs ------------------------------------------------------------------------------------


def make_case(
    entries,  # per request: number of written index entries
    token_visible,  # per request: list of visible counts of its tokens (-1 = padding token)
    *,
    e=4,
    ih=4,
    di=16,
    nb=None,
    integer=True,
    dtype=jnp.float32,
    seed=0,
):
    """A ragged batch over paged index keys plus the dense per-request keys it encodes."""
    rng = np.random.default_rng(seed)
    r = len(entries)
    nb = nb or max(1, max(-(-n // e) for n in entries))
    num_pages = 1 + r * nb + 3
    perm = rng.permutation(np.arange(1, num_pages))
    tables = np.zeros((r, nb), np.int32)
    pages = np.full((num_pages, e, di), np.nan, np.float32)
    dense_keys = np.full((r, nb * e, di), np.nan, np.float32)
    for i, n in enumerate(entries):
        used = -(-n // e)
        tables[i, :used] = perm[i * nb : i * nb + used]
        if integer:
            keys = rng.integers(-2, 3, size=(n, di)).astype(np.float32)
        else:
            keys = rng.standard_normal((n, di)).astype(np.float32)
        dense_keys[i, :n] = keys
        for j in range(n):
            pages[tables[i, j // e], j % e] = keys[j]
    token_req, visible, positions = [], [], []
    for i, vis in enumerate(token_visible):
        for v in vis:
            token_req.append(i)
            visible.append(max(v, 0))
            positions.append(-1 if v < 0 else 10 * v)
    t = len(token_req)
    if integer:
        qi = rng.integers(-2, 3, size=(t, ih, di)).astype(np.float32)
        w = rng.choice(np.array([-1.0, 1.0, 2.0], np.float32), size=(t, ih))
    else:
        qi = rng.standard_normal((t, ih, di)).astype(np.float32)
        w = rng.standard_normal((t, ih)).astype(np.float32)
    return dict(
        qi=jnp.asarray(qi, dtype),
        weights=jnp.asarray(w, dtype),
        ikey_pages=jnp.asarray(pages, dtype),
        comp_tables=jnp.asarray(tables),
        token_req=jnp.asarray(token_req, jnp.int32),
        positions=jnp.asarray(positions, jnp.int32),
        visible=jnp.asarray(visible, jnp.int32),
        dense_keys=jnp.asarray(dense_keys, dtype),
        e=e,
    )


def args_of(case):
    return tuple(
        case[n]
        for n in ("qi", "weights", "ikey_pages", "comp_tables", "token_req", "positions", "visible")
    )


# -- the dense oracle (the model's whole-sequence math, one token at a time) ---------------------


def oracle_scores(case):
    """[T, N] scores from dsv4.reference.index_scores on each token's dense request keys."""
    keys = case["dense_keys"]
    vis = jnp.where(case["positions"] >= 0, case["visible"], 0)
    rows = []
    for t in range(case["qi"].shape[0]):
        r = int(case["token_req"][t])
        keys_t = jnp.nan_to_num(keys[r], nan=0.0)  # the dense oracle never sees the NaN tail
        s = dense.index_scores(
            case["qi"][t][None, None], case["weights"][t][None, None], keys_t[None], vis[t][None]
        )
        rows.append(s[0, 0])
    return jnp.stack(rows), vis


def as_sets(ids):
    return [set(int(x) for x in row if x >= 0) for row in np.asarray(ids)]


def check_exact(got, want, width):
    got = np.asarray(got)
    assert got.shape[1] == width
    for row in got:
        valid = row[row >= 0]
        assert len(valid) == len(set(valid.tolist())), f"duplicate picks {row}"
    assert as_sets(got) == as_sets(want)


def check_close(got, want, scores, tol):
    """Same number of picks per row, picks distinct and finite, and the sorted oracle scores of
    the picks equal those of the wanted picks within ``tol`` (relative to the row's scale)."""
    scores = np.asarray(scores, np.float64)
    for g, w, s in zip(np.asarray(got), np.asarray(want), scores):
        g, w = g[g >= 0], w[w >= 0]
        assert len(g) == len(w) and len(set(g.tolist())) == len(g)
        sg, sw = np.sort(s[g]), np.sort(s[w])
        assert np.all(np.isfinite(sg))
        scale = max(1.0, float(np.max(np.abs(sw)))) if len(sw) else 1.0
        np.testing.assert_allclose(sg, sw, atol=tol * scale)


def blocks_to_mask(blocks, n, bs):
    mask = np.zeros((blocks.shape[0], -(-n // bs) * bs), bool)
    for t, row in enumerate(np.asarray(blocks)):
        for b in row[row >= 0]:
            mask[t, b * bs : (b + 1) * bs] = True
    return mask[:, :n]


# -- scenarios ---------------------------------------------------------------------------------

K = 8
SCENARIOS = {
    # decode rows: one token per request, contexts around k and block boundaries
    "decode": ([1, 7, 8, 9, 33, 64], [[1], [7], [8], [9], [33], [64]]),
    # prefill chunks: the visible count grows token by token
    "prefill": ([13, 24], [list(range(1, 14)), list(range(17, 25))]),
    # mixed ragged batch with padding tokens (-1) and an empty row
    "mixed": ([30, 5, 0, 12], [[30], [3, 4, 5], [-1], [9, 10, 11, 12, -1]]),
}


def _reference(case, **kw):
    """The reference top-k of a case at its own page size."""
    return indexer_topk(*args_of(case), entries_per_block=case["e"], k=K, impl="reference", **kw)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_reference_topk_matches_dense_model(name):
    entries, vis = SCENARIOS[name]
    case = make_case(entries, vis, seed=1)
    got = _reference(case)
    scores, v = oracle_scores(case)
    want = dense.topk_indices(scores, v, K)
    check_exact(got, want, K)


def test_reference_float_scores_match_dense_model():
    case = make_case([40, 17], [[40, 39], [5, 17]], integer=False, seed=2)
    got = _reference(case)
    scores, v = oracle_scores(case)
    check_close(got, dense.topk_indices(scores, v, K), scores, 1e-5)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_reference_candidate_source_and_consumer(name):
    entries, vis = SCENARIOS[name]
    bs, cb = 4, 3
    src = make_case(entries, vis, seed=3)
    topk, blocks = _reference(src, candidate_block_size=bs, candidate_topk_blocks=cb)
    scores, v = oracle_scores(src)
    n = scores.shape[1]
    check_exact(topk, dense.topk_indices(scores, v, K), K)  # the source's own top-k is unmasked
    assert blocks.shape == (len(v), cb)
    want_mask = np.asarray(dense.select_candidate_blocks(scores, v, cb, bs))
    np.testing.assert_array_equal(blocks_to_mask(blocks, n, bs), want_mask)

    # a consumer with its own queries against the same keys, masked to the source's blocks
    con = dict(src)
    con.update(
        {
            key: val
            for key, val in make_case(entries, vis, seed=4).items()
            if key in ("qi", "weights")
        }
    )
    got = _reference(con, candidate_block_size=bs, candidates=blocks)
    cscores, _ = oracle_scores(con)
    masked = jnp.where(jnp.asarray(want_mask), cscores, -jnp.inf)
    check_exact(got, dense.topk_indices(masked, v, K), K)


def test_reference_all_invalid_rows_are_minus_one():
    case = make_case([6, 0], [[0, -1], [0]], seed=5)
    topk, blocks = _reference(case, candidate_block_size=4, candidate_topk_blocks=2)
    assert np.all(np.asarray(topk) == -1) and np.all(np.asarray(blocks) == -1)


def test_reference_rejects_bad_arguments():
    case = make_case([8], [[8]])
    with pytest.raises(ValueError, match="entries_per_block=3"):
        indexer_topk(*args_of(case), entries_per_block=3, k=K, impl="reference")
    with pytest.raises(ValueError, match="candidate_block_size"):
        _reference(case, candidate_topk_blocks=2)
    with pytest.raises(ValueError, match="impl="):
        indexer_topk(*args_of(case), entries_per_block=case["e"], k=K, impl="cuda")


# -- kernels against the reference, in the interpreters -----------------------------------------
# One ragged batch covers decode rows, prefill chunks, padding tokens, empty and length-1 rows,
# contexts at k and at candidate-block boundaries; each mode compiles once (interpret-mode
# compiles, not runs, dominate the time here).

KERNEL_BATCH = (
    [1, 7, 8, 9, 33, 64, 13, 0, 30],
    [[1], [7], [8], [9], [33], [64], list(range(1, 14)), [-1, 0], [3, 4, 29, 30, -1]],
)
KERNEL_IMPLS = ["tpu", "gpu"]


def checking_interpreter():
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams(
        detect_races=True, uninitialized_memory="nan", out_of_bounds_reads="raise"
    )


@pytest.fixture(autouse=True)
def _reset_tpu_interpreter():
    yield
    from jax.experimental.pallas import tpu as pltpu

    pltpu.reset_tpu_interpret_mode_state()  # required after an exception in the interpreter


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
def test_kernel_plain_topk(impl):
    case = make_case(*KERNEL_BATCH, seed=11)
    kw = dict(entries_per_block=case["e"], k=K)
    got = indexer_topk(*args_of(case), **kw, impl=impl, interpret=True)
    check_exact(got, indexer_topk(*args_of(case), **kw, impl="reference"), K)


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
def test_kernel_candidate_source_and_consumer(impl):
    case = make_case(*KERNEL_BATCH, seed=12)
    kw = dict(entries_per_block=case["e"], k=K, candidate_block_size=4)
    got = indexer_topk(*args_of(case), **kw, candidate_topk_blocks=3, impl=impl, interpret=True)
    want = indexer_topk(*args_of(case), **kw, candidate_topk_blocks=3, impl="reference")
    check_exact(got[0], want[0], K)
    check_exact(got[1], want[1], 3)
    # a consumer of those blocks (given in the reference's order, which is not index order)
    got = indexer_topk(*args_of(case), **kw, candidates=want[1], impl=impl, interpret=True)
    check_exact(got, indexer_topk(*args_of(case), **kw, candidates=want[1], impl="reference"), K)


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_float_data(impl, dtype):
    case = make_case(*KERNEL_BATCH, integer=False, dtype=dtype, seed=13)
    kw = dict(entries_per_block=case["e"], k=K)
    got = indexer_topk(*args_of(case), **kw, impl=impl, interpret=True)
    want = indexer_topk(*args_of(case), **kw, impl="reference")
    scores, _ = oracle_scores(case)
    check_close(got, want, scores, FLOAT_TOL[dtype])


def test_tpu_kernel_checking_interpreter():
    """Simulated DMAs, NaN-filled scratch, race detection; pages of 8 entries, random order."""
    case = make_case([20, 3], [[20, 19], [3]], e=8, seed=14)
    kw = dict(entries_per_block=8, k=K, candidate_block_size=4, candidate_topk_blocks=2)
    got = indexer_topk(*args_of(case), **kw, impl="tpu", interpret=checking_interpreter())
    want = indexer_topk(*args_of(case), **kw, impl="reference")
    check_exact(got[0], want[0], K)
    check_exact(got[1], want[1], 2)
    # the consumer's per-block DMAs too
    kw = dict(entries_per_block=8, k=K, candidate_block_size=4, candidates=want[1])
    got = indexer_topk(*args_of(case), **kw, impl="tpu", interpret=checking_interpreter())
    check_exact(got, indexer_topk(*args_of(case), **kw, impl="reference"), K)


def test_tpu_checking_interpreter_raises_on_bad_block():
    case = make_case([20], [[20]], e=8, seed=15)
    num_pages = case["ikey_pages"].shape[0]
    case["comp_tables"] = case["comp_tables"].at[0, 1].set(num_pages + 3)
    with pytest.raises(Exception, match=r"[Oo]ut.of.bounds"):
        indexer_topk(
            *args_of(case),
            entries_per_block=8,
            k=K,
            impl="tpu",
            interpret=checking_interpreter(),
        ).block_until_ready()


# -- deviceless compiles at the released shapes ------------------------------------------------
# 32 index heads of 128, top-k 512, 2048 candidate blocks of 8; pages of 64 tokens hold 64
# (ratio 1) or 32 (ratio 2) entries; 8 decode tokens over a 128K-token context, and one at 1M.


@aot.requires_libtpu
@pytest.mark.parametrize("topology", ["v5e:1x1", "v6e:1x1"])
@pytest.mark.parametrize("mode", sorted(RELEASED_MODES))
def test_tpu_compiles_at_released_shapes(mode, topology):
    aot.compile_for_tpu(indexer_fn(mode, "tpu"), *indexer_released(mode), topology=topology)


@aot.requires_libtpu
@pytest.mark.parametrize("topology", ["v5e:1x1", "v6e:1x1"])
def test_tpu_compiles_at_1m_context(topology):
    """16 decode tokens of 16 requests over 1M-entry contexts (4 GiB of keys; v5e has 16): 4 MiB
    of scores per token in VMEM, one 16384-page table row in SMEM."""
    aot.compile_for_tpu(
        indexer_fn("source-r1", "tpu"),
        *indexer_released("source-r1", 16, 1024 * 1024),
        topology=topology,
    )


@pytest.mark.parametrize("mode", sorted(RELEASED_MODES))
def test_tpu_lowers_at_released_shapes(mode):
    assert "tpu_custom_call" in aot.lower_for_tpu(
        indexer_fn(mode, "tpu"), *indexer_released(mode), device_kind="TPU v5 lite"
    )


@aot.requires_cuda_plugin
@pytest.mark.parametrize("mode", sorted(RELEASED_MODES))
def test_h100_compiles_at_released_shapes(mode):
    aot.compile_for_h100(indexer_fn(mode, "gpu"), *indexer_released(mode))


@pytest.mark.parametrize("mode", sorted(RELEASED_MODES))
def test_gpu_lowers_at_released_shapes(mode):
    assert "triton" in aot.lower_for_gpu(indexer_fn(mode, "gpu"), *indexer_released(mode))


def test_debug_check_raises_on_bad_block():
    case = make_case([20], [[20]], e=8, seed=15)
    case["comp_tables"] = case["comp_tables"].at[0, 1].set(case["ikey_pages"].shape[0])
    with pytest.raises(Exception, match=r"comp_tables\[0, 1\]"):
        indexer_topk(*args_of(case), entries_per_block=8, k=K, impl="reference", debug=True)
