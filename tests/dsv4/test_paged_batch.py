"""`build_batch`'s two ways of filling a step's block tables and slot mappings: token by token
for a step of few tokens (`_fill_few`, the engine's decode steps), vectorised over the step
otherwise (`_fill_group`). Both must give the same arrays and the same errors. A burst's
stacked decode steps (`build_burst`, one pass over all steps) equal its steps built one by one."""

from __future__ import annotations

import dataclasses

import jax
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


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("table_buckets", [None, (2, 4)])
def test_burst_stacks_its_steps_built_one_by_one(config, seed, table_buckets):
    """Every leaf of `build_burst` [k, ...]: step i is `build_batch` of step i's requests in
    the burst's buckets, its tables widened to the widest step's by null columns; zeros past
    the steps. Steps of different sizes (padding rows and tokens), trimmed tables that differ
    in width from step to step, more steps than `_FEW_TOKENS` tokens in all."""
    rng = np.random.default_rng(seed)
    k, t = 6, 8
    r = 8 if seed % 2 else 16  # T requests fill T tokens (R = T) or R > T
    steps = [_requests(config, rng, int(rng.integers(1, t + 1)), 1)
             for _ in range(int(rng.integers(1, k + 1)))]  # fmt: skip
    common = dict(max_model_len=MAX_LEN, table_buckets=table_buckets, debug=True)
    got = B.build_burst(steps, config, num_steps=k, token_bucket=t, request_rows=r, **common)
    one_by_one = [B.build_batch(step, config, token_buckets=(t,), request_buckets=(r,),
                                **common) for step in steps]  # fmt: skip
    widths = [max(w) for w in zip(*(b.table_widths() for b in one_by_one), strict=True)]
    one_by_one = [B.widen_tables(b, widths) for b in one_by_one]
    got_leaves, tree = jax.tree.flatten(got)
    want_tree = jax.tree.structure(one_by_one[0])
    assert tree == want_tree
    for i, (leaf, *wants) in enumerate(zip(got_leaves, *map(jax.tree.leaves, one_by_one))):
        assert leaf.shape == (k, *wants[0].shape) and leaf.dtype == wants[0].dtype
        np.testing.assert_array_equal(leaf[: len(steps)], np.stack(wants), err_msg=f"leaf {i}")
        assert not leaf[len(steps) :].any()


def test_burst_refuses_what_is_not_a_decode_burst(config):
    rng = np.random.default_rng(0)
    one = _requests(config, rng, 3, 1)
    two_tokens = [dataclasses.replace(one[0], token_ids=[5, 6])]
    common = dict(config=config, max_model_len=MAX_LEN, num_steps=2, token_bucket=4,
                  request_rows=4)  # fmt: skip
    with pytest.raises(ValueError, match="'r0' has 2 tokens in a burst step"):
        B.build_burst([one, two_tokens], **common)
    with pytest.raises(ValueError, match=r"a burst of 3 steps; allowed: 1\.\.num_steps=2"):
        B.build_burst([one, one, one], **common)
    with pytest.raises(ValueError, match=r"hold \[3, 0\] requests; allowed: 1\.\.4"):
        B.build_burst([one, []], **common)
    with pytest.raises(ValueError, match=r"hold \[5\] requests"):
        B.build_burst([_requests(config, rng, 5, 1)], **common)


def _kept_burst_steps(config, rng, k: int, t: int):
    """Up to ``k`` decode steps over ``t`` requests in slots 0..t-1 of kept block tables (each
    step a subset of them in slot order, some a position or two earlier), and the tables."""
    base = _requests(config, rng, t, 1)
    tables = B.BlockTables(B.group_infos(config), t, MAX_LEN)
    for slot, request in enumerate(base):
        request.slot = slot
        tables.set(slot, request.block_ids)
    steps = []
    for _ in range(int(rng.integers(1, k + 1))):
        rows = sorted(rng.choice(t, int(rng.integers(1, t + 1)), replace=False))
        back = rng.integers(0, 3, len(rows))
        steps.append([dataclasses.replace(base[j], start=max(0, base[j].start - int(b)))
                      for j, b in zip(rows, back, strict=True)])  # fmt: skip
    return steps, tables


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("table_buckets", [None, (2, 4)])
def test_burst_from_kept_tables_equals_the_generic_path(config, seed, table_buckets):
    """`build_burst` with kept tables (the engine's bursts) takes its vectorised path over the
    whole burst, and its arrays are those of the generic path, which reads each request's
    block ids (and, in debug, the build compares the two itself)."""
    rng = np.random.default_rng(seed)
    k, t = 6, 8
    steps, tables = _kept_burst_steps(config, rng, k, t)
    common = dict(config=config, num_steps=k, token_bucket=t, request_rows=8 if seed % 2 else 16,
                  max_model_len=MAX_LEN, table_buckets=table_buckets)  # fmt: skip
    groups = B.group_infos(config)
    shape = (k, t, common["request_rows"])
    assert B._kept_burst(steps, groups, shape, MAX_LEN, tables=tables,
                         table_buckets=table_buckets) is not None  # fmt: skip
    fast = B.build_burst(steps, tables=tables, **common)
    generic = B.build_burst(steps, **common)
    for i, (a, b) in enumerate(zip(jax.tree.leaves(fast), jax.tree.leaves(generic), strict=True)):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(a, b, err_msg=f"leaf {i}")
    assert (fast.state_slots[(1, 1)] >= 0).any() and (fast.window_slots[0] >= 0).any()
    B.build_burst(steps, tables=tables, debug=True, **common)


def test_burst_from_kept_tables_raises_the_generic_errors(config):
    """What the kept-table path cannot build (a missing block, a position past the model
    length, a slot the tables lack, two tokens) raises the generic path's error."""
    rng = np.random.default_rng(1)
    steps, tables = _kept_burst_steps(config, rng, 1, 4)
    first = steps[0][0]
    common = dict(config=config, num_steps=2, token_bucket=4, request_rows=8,
                  max_model_len=MAX_LEN, tables=tables)  # fmt: skip
    held = int(tables.counts[0][first.slot])  # window blocks (of 4 tokens) its slot holds
    assert held * 4 < MAX_LEN
    cases = [
        (dataclasses.replace(first, start=MAX_LEN), "outside 0..95"),
        (dataclasses.replace(first, slot=9), "has slot 9; the block tables kept have slots 0..3"),
        (dataclasses.replace(first, token_ids=[5, 6]), "has 2 tokens in a burst step"),
        (dataclasses.replace(first, start=held * 4), f"group 0 needs block {held} for its new"),
    ]
    for bad, match in cases:
        assert B._kept_burst([[bad]], B.group_infos(config), (2, 4, 8), MAX_LEN,
                             tables=tables) is None  # fmt: skip
        with pytest.raises(ValueError, match=match):
            B.build_burst([steps[0], [bad]], **common)
