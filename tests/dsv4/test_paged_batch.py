"""`build_batch`'s two ways of filling a step's block tables and slot mappings: token by token
for a step of few tokens (`_fill_few`, the engine's decode steps), vectorised over the step
otherwise (`_fill_group`). Both must give the same arrays and the same errors."""

from __future__ import annotations

import numpy as np
import pytest

from cache.layout import for_model
from dsv4.paged import batch as B
from dsv4.paged import pools as P
from dsv4.paged import records as R

MAX_LEN = 96


@pytest.fixture(scope="module")
def config(tiny_cfg):
    desc = P.cache_desc(tiny_cfg, R.PRESETS["EXACT"], block_size=16, swa_block_size=4)
    return for_model(desc, num_gpu_blocks_override=200)


def _requests(config, rng, num_requests, max_tokens):
    """Random requests holding every block their positions need (scattered ids, some spare
    blocks, a sliding window's early blocks null), some in bounded replay."""
    groups = B.group_infos(config)
    out = []
    for i in range(num_requests):
        n = int(rng.integers(1, max_tokens + 1))
        start = int(rng.integers(0, MAX_LEN - n + 1))
        end = start + n
        block_ids = []
        for g in groups:
            if g.kind == "ring":
                block_ids.append([] if rng.random() < 0.2 else [int(rng.integers(1, 200))])
                continue
            need = -(-end // g.block_size) + int(rng.integers(0, 2))
            need = min(need, -(-MAX_LEN // g.block_size))
            ids = rng.integers(1, 200, need)
            if g.kind == "window":
                ids[: max(0, need - 4)] = 0  # blocks that left the window
            block_ids.append(ids.tolist())
        write_from = int(rng.integers(0, end + 1)) if rng.random() < 0.3 else 0
        out.append(
            B.StepRequest(
                token_ids=rng.integers(3, 100, n).tolist(),
                start=start,
                block_ids=block_ids,
                replay_start=min(write_from, start),
                cache_write_from=write_from,
                req_id=f"r{i}",
            )
        )
    return out


def _both(monkeypatch, *args, **kwargs):
    few = B.build_batch(*args, **kwargs)
    with monkeypatch.context() as m:
        m.setattr(B, "_FEW_TOKENS", 0)  # every step vectorised
        vectorised = B.build_batch(*args, **kwargs)
    return few, vectorised


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("table_buckets", [None, (2, 4)])
def test_few_tokens_fill_as_the_vectorised_path(config, monkeypatch, seed, table_buckets):
    rng = np.random.default_rng(seed)
    for num_requests, max_tokens in ((1, 1), (3, 1), (5, 3), (2, 8), (7, 2), (16, 1)):
        requests = _requests(config, rng, num_requests, max_tokens)
        n = sum(len(r.token_ids) for r in requests)
        assert n <= B._FEW_TOKENS  # the token-by-token path runs
        few, vectorised = _both(
            monkeypatch,
            requests,
            config,
            max_model_len=MAX_LEN,
            token_buckets=(16, 32),
            request_buckets=(8, 16),
            table_buckets=table_buckets,
            debug=True,
        )
        for name in ("token_ids", "positions", "token_req", "seq_lens", "replay_start"):
            np.testing.assert_array_equal(getattr(few, name), getattr(vectorised, name))
        for g, (a, b) in enumerate(zip(few.block_tables, vectorised.block_tables, strict=True)):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)
            want = np.zeros_like(a)  # each row: its ids, as many as the (trimmed) table holds
            for i, r in enumerate(requests):
                ids = r.block_ids[g][: a.shape[1]]
                want[i, : len(ids)] = ids
            np.testing.assert_array_equal(a, want, err_msg=f"block table {g}")
        for field in ("window_slots", "state_slots", "ring_slots"):
            got, want = getattr(few, field), getattr(vectorised, field)
            assert got.keys() == want.keys()
            for key in want:
                assert got[key].dtype == want[key].dtype
                np.testing.assert_array_equal(got[key], want[key], err_msg=f"{field}[{key}]")
        assert (few.state_slots[(1, 1)] >= 0).any()  # the draws write compressed states


@pytest.mark.parametrize(
    "group, ids, match",
    [
        (0, [7], "group 0 needs block 1 for its new tokens but holds 1 blocks"),
        (1, [], "group 1 needs block 0 for its new tokens but holds 0 blocks"),
        (2, [3, 4], "ring group 2 holds 2 blocks, expected at most 1"),
        (1, list(range(1, 9)), "group 1 holds 8 blocks, more than max_model_len 96 needs"),
    ],
)
def test_few_tokens_raise_the_vectorised_errors(config, monkeypatch, group, ids, match):
    block_ids = [[5, 6], [9], [11]]
    block_ids[group] = ids
    request = B.StepRequest(token_ids=[4, 5, 6], start=4, block_ids=block_ids, req_id="a")
    for few in (B._FEW_TOKENS, 0):
        monkeypatch.setattr(B, "_FEW_TOKENS", few)
        with pytest.raises(ValueError, match=match):
            B.build_batch([request], config, max_model_len=MAX_LEN, token_buckets=(8,))
