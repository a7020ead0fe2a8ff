"""The Triton indexer's token tiles (`gpu.indexer_topk(tokens_per_tile=...)`) against the
reference, in the HLO interpreter, plus deviceless lowering / compiles at the released shapes.

Tiles of 2, 4 and 8 tokens score a one-request tile in one stacked matmul and a tile that
straddles requests token by token; tiles of 1 and 3 always go token by token. The ragged
KERNEL_BATCH has tiles straddling requests, padding tokens inside the batch and (for most tile
sizes) padding tokens added to fill the last tile; the prefill case has tiles whose tokens see
different numbers of 128-entry chunks. The entry point is called directly (its `tokens_per_tile`
is not passed through the dispatcher here).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from aot import compile_for_h100, lower_for_gpu, requires_cuda_plugin
from indexer_cases import RELEASED_MODES, indexer_released
from test_indexer import (
    FLOAT_TOL,
    KERNEL_BATCH,
    K,
    args_of,
    check_close,
    check_exact,
    make_case,
    oracle_scores,
)

from pallas_kernels.indexer import gpu, reference

# 1 and 3 run token by token (3 pads the last tile), 8 stacks a tile in one matmul; 2 and 4 take
# the stacked path too and run as long variants
TILES = [1, pytest.param(2, marks=pytest.mark.slow), 3, pytest.param(4, marks=pytest.mark.slow), 8]
# One request, 24 consecutive prefill tokens; token i (1..24) sees i * 11 entries, so the tiles
# cross the 128-entry chunk boundaries; pages of 8 entries in random order, NaN unused pages.
RATIO = 11
PREFILL = ([24 * RATIO], [[RATIO * i for i in range(1, 25)]])


def _both(case, tq, **kw):
    kw = dict(entries_per_block=case["e"], k=K, **kw)
    got = gpu.indexer_topk(*args_of(case), **kw, tokens_per_tile=tq, interpret=True)
    return got, reference.indexer_topk(*args_of(case), **kw)


@pytest.mark.parametrize("tq", TILES)
def test_gpu_tiles_plain_ragged_batch(tq):
    case = make_case(*KERNEL_BATCH, seed=21)
    got, want = _both(case, tq)
    check_exact(got, want, K)


@pytest.mark.parametrize("tq", TILES)
def test_gpu_tiles_candidate_source_and_consumer(tq):
    case = make_case(*KERNEL_BATCH, seed=22)
    got, want = _both(case, tq, candidate_block_size=4, candidate_topk_blocks=3)
    check_exact(got[0], want[0], K)
    check_exact(got[1], want[1], 3)
    # a consumer does not run the tiled kernel; tokens_per_tile must still be accepted
    got, want = _both(case, tq, candidate_block_size=4, candidates=want[1])
    check_exact(got, want, K)


@pytest.mark.parametrize("tq", TILES)
def test_gpu_tiles_prefill_chunk(tq):
    case = make_case(*PREFILL, e=8, seed=23)
    got, want = _both(case, tq)
    check_exact(got, want, K)


@pytest.mark.parametrize("tq", [3, 8])
def test_gpu_tiles_prefill_candidate_source(tq):
    case = make_case(*PREFILL, e=8, seed=24)
    got, want = _both(case, tq, candidate_block_size=8, candidate_topk_blocks=4)
    check_exact(got[0], want[0], K)
    check_exact(got[1], want[1], 4)


@pytest.mark.parametrize("tq", [3, 4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_tiles_float_data(dtype, tq):
    case = make_case(*PREFILL, e=8, integer=False, dtype=dtype, seed=25)
    got, want = _both(case, tq)
    scores, _ = oracle_scores(case)
    check_close(got, want, scores, FLOAT_TOL[dtype])


@pytest.mark.parametrize("bad", [0, -2, 2.0, True])
def test_gpu_tiles_rejects_bad_tile(bad):
    case = make_case([8], [[8]])
    with pytest.raises(ValueError, match=rf"tokens_per_tile={bad!r} must be an int >= 1"):
        gpu.indexer_topk(
            *args_of(case), entries_per_block=case["e"], k=K, tokens_per_tile=bad, interpret=True
        )


# -- deviceless lowering / compiles at the released shapes (test_indexer.py's) -----------------


def _released_gpu_fn(mode, tq):
    spec = RELEASED_MODES[mode]
    kw = dict(spec["kw"], entries_per_block=spec["e"], tokens_per_tile=tq)
    if spec.get("candidates"):
        return lambda *a: gpu.indexer_topk(*a[:7], candidates=a[7], **kw)
    return lambda *a: gpu.indexer_topk(*a, **kw)


# the consumer never runs the tiled kernel; with 10 tokens the last tile has padding tokens
@requires_cuda_plugin
@pytest.mark.parametrize("mode, tq", [("plain-r2", 4), ("source-r1", 4), ("plain-r2", 3)])
def test_gpu_tiles_h100_compiles_at_released_shapes(mode, tq):
    compile_for_h100(_released_gpu_fn(mode, tq), *indexer_released(mode, tokens=10))


@pytest.mark.parametrize("tq", [3, 4])
def test_gpu_tiles_lower_at_released_shapes(tq):
    assert "triton" in lower_for_gpu(
        _released_gpu_fn("plain-r2", tq), *indexer_released("plain-r2")
    )


def test_gpu_tiles_grid_is_one_program_per_tile():
    """The blocks kernel runs ceil(T / tokens_per_tile) programs over T padded to whole tiles
    (13 tokens, tiles of 4); selection and rescoring stay one program per token."""
    case = make_case([13], [list(range(1, 14))])
    jaxpr = jax.make_jaxpr(
        lambda *a: gpu.indexer_topk(*a, entries_per_block=case["e"], k=K, tokens_per_tile=4)
    )(*args_of(case))
    calls = [
        (eqn.params["grid_mapping"].grid, eqn.params["out_avals"][0].shape[0])
        for eqn in jaxpr.jaxpr.eqns
        if eqn.primitive.name == "pallas_call"
    ]
    assert calls == [((4,), 16), ((13,), 13), ((13,), 13), ((13,), 13)]
