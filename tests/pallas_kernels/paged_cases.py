"""Builders of paged caches for the kernel tests, whose unused pages (and the null block 0) are
NaN, so a kernel that reads what it should not poisons its output.

They start from dense per-request rows (the independent truth) and scatter them into pages through
block tables in random order; the float64 oracles of the tests read the dense rows.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass
class PagedCache:
    """Dense per-request rows scattered into NaN-poisoned pages.

    rows[r]: float64 [n_r, D] (the truth); pages: float32 [P, S, D]; tables: int32 [R, nb].
    """

    rows: list[np.ndarray]
    pages: np.ndarray
    tables: np.ndarray


def build_paged_cache(
    rng: np.random.Generator,
    lengths: list[int],
    *,
    page_size: int,
    dim: int,
    table_width: int | None = None,
    spare_pages: int = 3,
    null_before: list[int] | None = None,
    dtype=np.float32,
) -> PagedCache:
    """Random rows for each request, stored page by page at random physical blocks.

    Rows past a request's length inside its last page, every unused page, the null block 0 and
    the table entries past a request's pages are poison (NaN / block 0). With `null_before[r]`,
    the blocks holding only positions `< null_before[r]` are released to the null block, as
    vLLM does with pages that left the window.
    """
    num_reqs = len(lengths)
    blocks_per_req = [-(-n // page_size) for n in lengths]
    nb = table_width or max(1, max(blocks_per_req))
    num_pages = 1 + sum(blocks_per_req) + spare_pages
    ids = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
    pages = np.full((num_pages, page_size, dim), np.nan, np.float32)
    tables = np.zeros((num_reqs, nb), np.int32)
    rows, used = [], 0
    for r, n in enumerate(lengths):
        x = rng.standard_normal((n, dim)).astype(np.float32).astype(dtype).astype(np.float64)
        rows.append(x)
        for b in range(blocks_per_req[r]):
            blk = ids[used]
            used += 1
            chunk = x[b * page_size : (b + 1) * page_size]
            if null_before is not None and (b + 1) * page_size <= null_before[r]:
                continue  # released: the table keeps the null block, the page stays NaN
            tables[r, b] = blk
            pages[blk, : len(chunk)] = chunk
    return PagedCache(rows, pages, tables)


def softmax_with_sink(q: np.ndarray, keys: np.ndarray, sink: np.ndarray, scale: float):
    """float64 oracle for one token: q [H, D], keys [K, D] (K may be 0), sink [H] -> [H, D]."""
    if len(keys) == 0:
        return np.zeros_like(q)
    z = q @ keys.T * scale  # [H, K]
    m = np.maximum(z.max(axis=1), sink)
    p = np.exp(z - m[:, None])
    return (p @ keys) / (p.sum(axis=1) + np.exp(sink - m))[:, None]


def window_oracle_state(q: np.ndarray, keys: np.ndarray, scale: float):
    """float64 state (m [H], l [H], acc [H, D]) of one token over keys [K, D], no sink."""
    if len(keys) == 0:
        return np.full(q.shape[0], -1e30), np.zeros(q.shape[0]), np.zeros_like(q)
    z = q @ keys.T * scale
    m = z.max(axis=1)
    p = np.exp(z - m[:, None])
    return m, p.sum(axis=1), p @ keys


def finish_state(m, denom, acc, sink):
    """Normalise a float64 state with the sink in the denominator."""
    top = np.maximum(m, sink)
    w = np.exp(m - top)
    return acc * (w / (denom * w + np.exp(sink - top)))[..., None]


@dataclasses.dataclass
class Step:
    """One ragged step: the kernel arguments (numpy) and the truth they were built from."""

    q: np.ndarray  # [T, H, D] float32 (values representable in `dtype`)
    token_req: np.ndarray  # int32 [T]
    positions: np.ndarray  # int32 [T]
    sink: np.ndarray  # float32 [H]
    swa: PagedCache
    replay_start: np.ndarray | None  # int32 [R]
    window: int
    scale: float

    def window_keys(self, t: int) -> np.ndarray:
        """float64 keys [n, D] that token t sees in the window cache."""
        r, p = int(self.token_req[t]), int(self.positions[t])
        if p < 0:
            return np.zeros((0, self.q.shape[2]))
        lo = max(0, p - self.window + 1)
        if self.replay_start is not None:
            lo = max(lo, int(self.replay_start[r]))
        return self.swa.rows[r][lo : p + 1]

    def window_state(self):
        """float64 (m [T, H], l [T, H], acc [T, H, D]) of the window part."""
        parts = [
            window_oracle_state(self.q[t].astype(np.float64), self.window_keys(t), self.scale)
            for t in range(len(self.positions))
        ]
        return tuple(np.stack(x) for x in zip(*parts))

    def window_out(self) -> np.ndarray:
        m, denom, acc = self.window_state()
        out = finish_state(m, denom, acc, self.sink.astype(np.float64)[None, :])
        return np.where(self.positions[:, None, None] >= 0, out, 0.0)


def make_step(
    rng: np.random.Generator,
    requests: list[tuple[int, int]],
    *,
    heads: int,
    dim: int,
    page_size: int,
    window: int,
    dtype=np.float32,
    padding: int = 0,
    shuffle: bool = False,
    replay_start: list[int] | None = None,
    release_old_pages: bool = True,
    table_width: int | None = None,
) -> Step:
    """A step of `requests = [(length_after_step, new_tokens), ...]` in the window cache.

    The new tokens of request r are positions `length - new .. length - 1` (already written, as
    the paged step writes before reading). `padding` tokens with position -1 are appended (their
    q is NaN: a kernel must not use it); `shuffle` permutes the token order. With
    `release_old_pages`, blocks that every new token's window has left become the null block.
    """
    lengths = [n for n, _ in requests]
    null_before = None
    if release_old_pages:
        null_before = [max(0, n - new - window + 1) for n, new in requests]
        if replay_start is not None:
            null_before = [max(a, b) for a, b in zip(null_before, replay_start)]
    swa = build_paged_cache(
        rng,
        lengths,
        page_size=page_size,
        dim=dim,
        null_before=null_before,
        dtype=dtype,
        table_width=table_width,
    )
    token_req = np.concatenate(
        [np.full(new, r) for r, (_, new) in enumerate(requests)] + [np.zeros(padding)]
    ).astype(np.int32)
    positions = np.concatenate(
        [np.arange(n - new, n) for n, new in requests] + [np.full(padding, -1)]
    ).astype(np.int32)
    if shuffle:
        order = rng.permutation(len(positions))
        token_req, positions = token_req[order], positions[order]
    q = rng.standard_normal((len(positions), heads, dim)).astype(np.float32)
    q = q.astype(dtype).astype(np.float32)
    q[positions < 0] = np.nan
    sink = rng.standard_normal(heads).astype(np.float32)
    rs = None if replay_start is None else np.asarray(replay_start, np.int32)
    return Step(q, token_req, positions, sink, swa, rs, window, dim**-0.5)


@dataclasses.dataclass
class Selection:
    """The compressed cache of a step and every token's selected entries."""

    comp: PagedCache
    topk: np.ndarray  # int32 [T, K], -1 = none

    def keys(self, step: Step, t: int) -> np.ndarray:
        """float64 keys [n, D] that token t selected."""
        if step.positions[t] < 0:
            return np.zeros((0, step.q.shape[2]))
        ids = self.topk[t][self.topk[t] >= 0]
        return self.comp.rows[int(step.token_req[t])][ids]


def make_selection(
    rng: np.random.Generator,
    step: Step,
    entries: list[int],
    *,
    k: int,
    entries_per_block: int,
    dtype=np.float32,
    empty_rows: tuple[int, ...] = (),
    shared_fraction: float = 0.0,
) -> Selection:
    """A compressed cache with `entries[r]` entries per request and a top-k row per token.

    Each row selects a random number (up to k) of distinct entries of its request, with its -1s
    scattered through the row; rows in `empty_rows` select nothing. With `shared_fraction`, that
    share of every row is drawn from one pool per request, so tokens of a request overlap (the
    speculative-decode case the kernels share fetches for).
    """
    comp = build_paged_cache(
        rng, entries, page_size=entries_per_block, dim=step.q.shape[2], dtype=dtype
    )
    pools = [rng.permutation(n)[: max(1, k)] for n in entries]
    topk = np.full((len(step.positions), k), -1, np.int32)
    for t, r in enumerate(step.token_req):
        n = entries[int(r)]
        if t in empty_rows or n == 0:
            continue
        count = int(rng.integers(1, min(k, n) + 1))
        shared = round(count * shared_fraction)
        pick = list(rng.permutation(pools[int(r)])[:shared])
        rest = [j for j in rng.permutation(n) if j not in set(pick)]
        pick += rest[: count - len(pick)]
        slots = rng.permutation(k)[: len(pick)]
        topk[t, slots] = pick
    return Selection(comp, topk)


def sparse_out(step: Step, sel: Selection, *, with_window: bool) -> np.ndarray:
    """float64 truth of sparse attention: one softmax over (window +) selection, with the sink."""
    out = np.zeros(step.q.shape)
    for t in range(len(step.positions)):
        if step.positions[t] < 0:
            continue
        keys = sel.keys(step, t)
        if with_window:
            keys = np.concatenate([step.window_keys(t), keys])
        m, denom, acc = window_oracle_state(step.q[t].astype(np.float64), keys, step.scale)
        out[t] = finish_state(m, denom, acc, step.sink.astype(np.float64))
    return out


def checking_tpu_interpreter():
    """The TPU interpreter that simulates memory: NaN for uninitialised VMEM and SMEM, raises on
    races and on out-of-bounds DMAs."""
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")


def kernel_mode(kernel: str) -> dict:
    """`impl=` / `interpret=` for a test of the "tpu" or "gpu" kernel.

    On CPU the kernel is interpreted (the TPU one in the checking interpreter); on its own chip
    (scripts/device_check.sh) it is compiled and run; on the other chip the test is skipped.
    """
    import jax
    import pytest

    backend = jax.default_backend()
    if backend == kernel:
        return dict(impl=kernel, interpret=False)
    if backend != "cpu":
        pytest.skip(f"the {kernel} kernel runs interpreted on CPU and compiled on its own chip")
    if kernel == "tpu":
        return dict(impl="tpu", interpret=checking_tpu_interpreter())
    return dict(impl="gpu", interpret=True)


def cpu_only() -> None:
    """Skip a test that exercises an interpreter (checks the chips cannot make) off CPU."""
    import jax
    import pytest

    if jax.default_backend() != "cpu":
        pytest.skip("interpreter-only check")


def kernel_arrays(step: Step, cache, dtype, *between) -> tuple:
    """A paged kernel's leading arrays: q, the cache's pages and tables, token_req, positions,
    then ``between`` (e.g. the top-k ids), then the sink."""
    return (
        jnp.asarray(step.q, dtype),
        jnp.asarray(cache.pages, dtype),
        jnp.asarray(cache.tables),
        jnp.asarray(step.token_req),
        jnp.asarray(step.positions),
        *between,
        jnp.asarray(step.sink),
    )
