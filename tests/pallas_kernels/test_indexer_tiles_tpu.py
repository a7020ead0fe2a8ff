"""The TPU indexer's token tiles: the tokens of one request within a tile read the request's
index keys once (a prefill chunk, speculative rows), and every token still gets exactly the
reference's selection, whatever the tile size, however tiles straddle requests, and with
padding tokens (the kernel pads the batch to whole tiles).

Same inputs and checkers as test_indexer.py (NaN pages, random page order, integer data
compared exactly, float data by the oracle scores of the picks)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from aot import compile_for_tpu, requires_libtpu
from indexer_cases import indexer_fn, indexer_released
from test_indexer import (
    FLOAT_TOL,
    KERNEL_BATCH,
    K,
    args_of,
    check_close,
    check_exact,
    checking_interpreter,
    make_case,
    oracle_scores,
)

from pallas_kernels.indexer import indexer_topk
from pallas_kernels.indexer import tpu as tpu_indexer

# one request's prefill chunk (24 tokens seeing 17..40 entries: several chunks of keys) followed
# by a second request's two tokens, which share the last tile with padding
PREFILL_BATCH = ([40, 6], [list(range(17, 41)), [5, 6]])


def _modes(case, cb=3):
    """(kwargs, want) for plain, candidate source and consumer on ``case``."""
    e = case["e"]
    plain = dict(entries_per_block=e, k=K)
    source = dict(entries_per_block=e, k=K, candidate_block_size=4, candidate_topk_blocks=cb)
    want_src = indexer_topk(*args_of(case), **source, impl="reference")
    consumer = dict(entries_per_block=e, k=K, candidate_block_size=4, candidates=want_src[1])
    return [
        ("plain", plain, indexer_topk(*args_of(case), **plain, impl="reference")),
        ("source", source, want_src),
        ("consumer", consumer, indexer_topk(*args_of(case), **consumer, impl="reference")),
    ]


def _check(mode, got, want, cb=3):
    if mode == "source":
        check_exact(got[0], want[0], K)
        check_exact(got[1], want[1], cb)
    else:
        check_exact(got, want, K)


@pytest.mark.parametrize("tq", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_tile_sizes_on_ragged_batch(tq):
    """Tiles of 1 and 3 over the ragged batch (tiles straddle requests; 26 tokens are padded to
    27); the default tile of 8 runs in test_indexer.py."""
    case = make_case(*KERNEL_BATCH, seed=21)
    for mode, kw, want in _modes(case):
        got = indexer_topk(*args_of(case), **kw, tokens_per_tile=tq, impl="tpu", interpret=True)
        _check(mode, got, want)


def test_prefill_tiles_under_the_checking_interpreter():
    """A prefill chunk shares each tile's key stream; simulated DMAs with race detection, NaN
    scratch and out-of-bounds reads raising; pages of 8 entries in random order."""
    case = make_case(*PREFILL_BATCH, e=8, seed=22)
    for mode, kw, want in _modes(case, cb=2):
        if mode == "source":
            kw = dict(kw, candidate_topk_blocks=2)
            want = indexer_topk(*args_of(case), **kw, impl="reference")
        got = indexer_topk(*args_of(case), **kw, impl="tpu", interpret=checking_interpreter())
        _check(mode, got, want, cb=2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_prefill_tiles_float_data(dtype):
    case = make_case(*PREFILL_BATCH, e=8, integer=False, dtype=dtype, seed=23)
    kw = dict(entries_per_block=8, k=K)
    got = indexer_topk(*args_of(case), **kw, tokens_per_tile=4, impl="tpu", interpret=True)
    want = indexer_topk(*args_of(case), **kw, impl="reference")
    scores, _ = oracle_scores(case)
    check_close(got, want, scores, FLOAT_TOL[dtype])


def test_tile_size_respects_the_score_budget():
    mib = 1 << 20
    assert tpu_indexer.tile_size(8, 4 * mib, budget=40 * mib) == 8
    assert tpu_indexer.tile_size(8, 16 * mib, budget=40 * mib) == 2
    assert tpu_indexer.tile_size(8, 64 * mib, budget=40 * mib) == 1  # never below one token


def test_rejects_bad_tile_size():
    case = make_case([8], [[8]], seed=24)
    with pytest.raises(ValueError, match="tokens_per_tile=0"):
        indexer_topk(*args_of(case), entries_per_block=4, k=K, tokens_per_tile=0, impl="tpu")


@requires_libtpu
def test_prefill_tile_compiles_at_released_shapes():
    """64 tokens (8 tiles of 8; the program does not depend on which requests they belong to)
    over 128K-entry tables, v6e."""
    fn = indexer_fn("source-r1", "tpu")
    args = indexer_released("source-r1", tokens=64)
    compile_for_tpu(fn, *args, topology="v6e:1x1")


@pytest.mark.parametrize("integer", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_stacked_matmul_of_whole_request_tiles(integer):
    """16 index heads: tiles that hold one request score all their tokens with one matmul
    (`STACK_HEADS`); the straddling last tile takes the per-token path."""
    assert 16 % tpu_indexer.STACK_HEADS == 0
    dtype = jnp.float32 if integer else jnp.bfloat16
    case = make_case(*PREFILL_BATCH, e=8, ih=16, integer=integer, dtype=dtype, seed=25)
    for mode, kw, want in _modes(case)[:2]:
        got = indexer_topk(*args_of(case), **kw, impl="tpu", interpret=True)
        if integer:
            _check(mode, got, want)
        else:
            scores, _ = oracle_scores(case)
            got, want = (got[0], want[0]) if mode == "source" else (got, want)
            check_close(got, want, scores, FLOAT_TOL[dtype])
