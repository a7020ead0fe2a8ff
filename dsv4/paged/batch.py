"""Host-side builders (numpy) of the paged step's batch (`docs/architecture.md`).

`build_batch` turns the requests scheduled for one step — their new tokens, where they start,
and the block ids the allocator (`cache.KVCacheManager.get_block_ids`) holds for them in every
KV-cache group — into a `StepBatch` (a registered dataclass pytree, the step contract,
docs/architecture.md#the-step-contract), padded to bucket sizes so the jitted step compiles a
bounded number of times. Slot mappings say where each token's new state goes (-1 = nothing):

* ``window_slots[g]``: token slots of a sliding-window group g (``table[p // S] * S + p % S``);
* ``state_slots[(g, r)]``: compressed-state slots of ratio r in a full group g (state
  ``j = p // r`` written by the group's last token only: ``table[j // E] * E + j % E`` with
  ``E = B / r``);
* ``ring_slots[g]``: ring rows of a circular-buffer group g (the last ``min(len, C)`` tokens of
  each request's chunk, row ``ring_block * C + p % C``).

Bounded replay (`docs/serving.md#bounded-replay`): a request with ``replay_start > 0``
recomputes tokens whose compressed state and index keys are already cached: rows below
``cache_write_from`` get no compressed/index-key slot, and the window of every row is clipped at
``replay_start``.

With ``debug=True`` every block id is checked against the pool and every slot against its page;
a bad value raises ValueError naming the request, group, position and the allowed range. Nothing
is ever clamped.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Sequence
from typing import Any

import jax
import jax.experimental.pallas  # first, for stable compilation-cache keys (dsv4/__init__.py)
import jax.numpy as jnp
import numpy as np

from cache.spec import (
    CircularBufferSpec,
    KVCacheConfig,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    iter_layer_specs,
)

__all__ = [
    "BlockTables",
    "GroupInfo",
    "StepBatch",
    "StepRequest",
    "bucket",
    "build_batch",
    "build_burst",
    "empty_batch",
    "group_infos",
    "ring_slots_at",
    "rows_needed",
    "state_slots_at",
    "table_width_buckets",
    "widen_tables",
    "window_slots_at",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    """One step's ragged batch of T tokens over R rows (docs/architecture.md#the-step-contract).

    Every field is an int32 array (numpy on the host, jax on device; `jax.tree.map` converts
    them). T and R are bucket sizes: padding tokens have position -1 and request row R - 1,
    which no real request uses; padding rows have empty query ranges and zero block tables.
    """

    token_ids: Any  # i32[T] tokens of this step
    positions: Any  # i32[T] absolute positions, -1 = padding
    token_req: Any  # i32[T] request row of each token (padding: row R - 1)
    query_start_loc: Any  # i32[R + 1] ragged offsets of each row's tokens
    seq_lens: Any  # i32[R] tokens in the cache after this step
    logits_indices: Any  # i32[R] token index sampled for each row (its last token)
    replay_start: Any  # i32[R] bounded replay: first position a row's window may see
    block_tables: tuple[Any, ...]  # per group g: i32[R, W_g] physical block ids, 0 = null
    window_slots: dict[int, Any]  # window group g -> i32[T] token slots, -1 = none
    state_slots: dict[tuple[int, int], Any]  # (full group g, ratio r) -> i32[T] state slots
    ring_slots: dict[int, Any]  # ring group g -> i32[T] ring rows, -1 = none
    # Engram look-back: per row the token ids of positions start-1, start-2, .. start-m (m =
    # engram_max_ngram_size - 1; m = 0 without Engram), -1 for a position before 0
    engram_prev: Any = None  # i32[R, m]

    @property
    def num_tokens(self) -> int:
        """T (the token bucket)."""
        return self.token_ids.shape[0]

    @property
    def num_rows(self) -> int:
        """R (the request bucket)."""
        return self.seq_lens.shape[0]

    def table_widths(self) -> tuple[int, ...]:
        """W_g of every group's block table."""
        return tuple(t.shape[1] for t in self.block_tables)


@dataclasses.dataclass(frozen=True)
class GroupInfo:
    """What the builder needs of a KV-cache group."""

    index: int
    kind: str  # "window" (token per slot), "compressed" (states of ratio r), "ring"
    block_size: int  # tokens per block (window, compressed) or ring capacity
    ratios: tuple[int, ...]  # compressed groups: the tokens_per_state values present


def group_infos(config: KVCacheConfig) -> tuple[GroupInfo, ...]:
    out = []
    for g, group in enumerate(config.kv_cache_groups):
        specs = iter_layer_specs(group.kv_cache_spec)
        first = specs[0]
        if isinstance(first, SlidingWindowMLASpec):
            out.append(GroupInfo(g, "window", first.block_size, (1,)))
        elif isinstance(first, CircularBufferSpec):
            out.append(GroupInfo(g, "ring", first.block_size, ()))
        elif isinstance(first, MLAAttentionSpec):
            ratios = tuple(sorted({s.tokens_per_state for s in specs}))
            out.append(GroupInfo(g, "compressed", first.block_size, ratios))
        else:  # pragma: no cover - a layout this model never builds
            raise ValueError(f"group {g}: unsupported spec {type(first).__name__}")
    return tuple(out)


@dataclasses.dataclass(slots=True)
class StepRequest:
    """One request's share of a step."""

    token_ids: Sequence[int]  # the tokens scheduled now (drafts included)
    start: int  # position of the first of them (tokens already in the cache)
    block_ids: Sequence[Sequence[int]]  # per group, as the allocator holds them
    replay_start: int = 0  # bounded replay: windows start here
    cache_write_from: int = 0  # bounded replay: no compressed/index writes below this position
    req_id: str = ""
    # Engram: the tokens of the positions just before ``start`` (the last ones of the request's
    # history; at least engram_lookback of them unless start is smaller)
    prev_tokens: Sequence[int] = ()
    slot: int = -1  # its row of a `BlockTables` (-1: none; `build_batch`'s ``tables``)


class BlockTables:
    """Every slot's block ids per KV-cache group, kept between steps (vLLM's persistent block
    table): a slot's rows are written when a request takes it (`set`) and appended to as it
    grows (`append`), so a step gathers its requests' rows (`build_batch`'s ``tables``)
    instead of rebuilding them from their ids. A row holds up to the group's full table width
    (ring: 1); ``counts`` the ids the request holds (more than fit: `build_batch` raises)."""

    def __init__(self, groups: Sequence[GroupInfo], num_slots: int, max_model_len: int) -> None:
        widths = [1 if g.kind == "ring" else _cdiv(max_model_len, g.block_size) for g in groups]
        self.rows = tuple(np.zeros((num_slots, w), np.int32) for w in widths)
        self.counts = tuple(np.zeros(num_slots, np.int64) for _ in groups)

    def set(self, slot: int, block_ids: Sequence[Sequence[int]]) -> None:
        """The ids of a request that takes ``slot`` (per group), replacing the slot's rows."""
        for rows, counts in zip(self.rows, self.counts, strict=True):
            rows[slot] = 0
            counts[slot] = 0
        self.append(slot, block_ids)

    def append(self, slot: int, block_ids: Sequence[Sequence[int]]) -> None:
        """Ids appended to the request in ``slot`` (per group, in the allocator's order)."""
        for rows, counts, ids in zip(self.rows, self.counts, block_ids, strict=True):
            if ids:
                row, count = rows[slot], int(counts[slot])
                fit = ids[: max(0, len(row) - count)]
                row[count : count + len(fit)] = fit
                counts[slot] = count + len(ids)


def bucket(n: int, sizes: Sequence[int]) -> int:
    """The smallest bucket size >= n."""
    for s in sorted(sizes):
        if s >= n:
            return s
    raise ValueError(f"{n} exceeds the largest bucket {max(sizes)} (buckets: {sorted(sizes)})")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def rows_needed(num_requests: int, num_tokens: int, token_bucket: int) -> int:
    """Request rows a batch of ``num_requests`` requests and ``num_tokens`` tokens needs in a
    token bucket of ``token_bucket``: one per request, and one more for the padding tokens
    when the requests leave some (so real rows never see them)."""
    return num_requests + (num_tokens < token_bucket)


def build_batch(
    requests: Sequence[StepRequest],
    config: KVCacheConfig,
    *,
    max_model_len: int,
    token_buckets: Sequence[int] = (16, 32, 64, 128, 256, 512, 1024, 2048),
    request_buckets: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256),
    table_buckets: Sequence[int] | None = None,
    debug: bool = False,
    groups: Sequence[GroupInfo] | None = None,
    engram_lookback: int = 0,
    tables: BlockTables | None = None,
) -> StepBatch:
    """The step's arrays for ``requests`` (module docstring), vectorised over the step's tokens
    and block ids, or token by token for a step of few tokens (`_fill_few`: the same values).
    ``table_buckets``: None gives full-width block tables, sizes trim them to the step's need
    (docs/architecture.md#the-step-contract); ``engram_lookback`` fills ``engram_prev``;
    ``tables``: the block ids kept by ``StepRequest.slot`` (`BlockTables`), gathered instead."""
    groups = group_infos(config) if groups is None else groups
    n_req = len(requests)
    lens_list = [len(r.token_ids) for r in requests]
    n_tok = sum(lens_list)
    if not requests or n_tok == 0:
        raise ValueError("a step needs at least one request with at least one token")
    starts_list = [r.start for r in requests]
    _check_requests(requests, lens_list, starts_list, max_model_len, len(groups))
    t_pad = bucket(n_tok, token_buckets)
    r_pad = bucket(rows_needed(n_req, n_tok, t_pad), request_buckets)
    longest = max(s + n for s, n in zip(starts_list, lens_list))
    widths = _table_widths(groups, max_model_len, table_buckets, longest)
    batch = _padding(groups, t_pad, r_pad, widths, engram_lookback)
    starts = np.array(starts_list, np.int64)
    lens = np.array(lens_list, np.int64)
    if n_tok == n_req:  # one token per request (a decode step): no ragged offsets to expand
        ends = np.arange(1, n_req + 1)
        req, pos = ends - 1, starts
        batch.token_ids[:n_tok] = [r.token_ids[0] for r in requests]
    else:
        ends = np.cumsum(lens)
        req = np.repeat(np.arange(n_req), lens)  # request of every token
        pos = np.repeat(starts - (ends - lens), lens) + np.arange(n_tok)  # its position
        batch.token_ids[:n_tok] = np.fromiter(
            itertools.chain.from_iterable(r.token_ids for r in requests), np.int32, n_tok
        )
    batch.positions[:n_tok] = pos
    batch.token_req[:n_tok] = req
    batch.query_start_loc[1 : n_req + 1] = ends
    batch.query_start_loc[n_req + 1 :] = n_tok
    batch.seq_lens[:n_req] = starts + lens
    batch.logits_indices[:n_req] = ends - 1
    batch.replay_start[:n_req] = [r.replay_start for r in requests]
    if engram_lookback:
        _engram_prev(requests, starts, engram_lookback, batch.engram_prev)
    kept = None if tables is None else _kept(requests, tables, debug)
    if n_tok > _FEW_TOKENS or not _fill_few(batch, groups, requests, max_model_len, kept):
        for g in groups:  # also raises what `_fill_few` declined
            _fill_group(batch, g, requests, max_model_len, req, pos, lens, ends, kept)
    if debug:
        check_batch(batch, config)
    return batch


def build_burst(
    steps: Sequence[Sequence[StepRequest]],
    config: KVCacheConfig,
    *,
    num_steps: int,
    token_bucket: int,
    request_rows: int,
    max_model_len: int,
    **options: Any,
) -> StepBatch:
    """Decode steps' batches stacked for a burst, every leaf [``num_steps``, ...]: step i is
    `build_batch` of ``steps[i]`` (one token a request) in T = ``token_bucket``, R =
    ``request_rows``, its tables widened by null columns to the widest step's; zeros past the
    steps. ``options``: `build_batch`'s other keywords. One `build_batch` over every step's
    requests (a request's arrays depend on it alone), then split: one call, not k."""
    _check_burst(steps, num_steps, token_bucket, request_rows)
    groups = options.pop("groups", None) or group_infos(config)
    shape = (num_steps, token_bucket, request_rows)
    fast = _kept_burst(steps, groups, shape, max_model_len, **options)
    if fast is not None and not options.get("debug"):
        return fast
    _check_decode(steps)
    flat = [r for step in steps for r in step]
    n = len(flat)
    whole = build_batch(flat, config, max_model_len=max_model_len, token_buckets=(n,),
                        request_buckets=(n,), groups=groups, **options)  # fmt: skip
    # each step's own table widths (`build_batch`'s, by its longest request): the columns
    # past them null, as a step built alone and widened has them
    table_buckets = options.get("table_buckets")
    widths = _steps_widths(groups, max_model_len, table_buckets,
                           [max(r.start + 1 for r in step) for step in steps])  # fmt: skip
    counts = [len(step) for step in steps]
    burst = _split_burst(whole, counts, widths, shape)
    if fast is not None:  # debug: the fast path must give the same arrays
        _check_same(fast, burst)
    return burst


def _check_same(got: StepBatch, want: StepBatch) -> None:
    """Debug check: `_kept_burst`'s arrays are the generic path's."""
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want),
                            strict=True):  # fmt: skip
        if a.shape != b.shape or a.dtype != b.dtype or not np.array_equal(a, b):
            raise RuntimeError(f"build_burst: the kept-table path differs at {path}")


def _kept_burst(
    steps, groups, shape: tuple[int, int, int], max_model_len: int, *, tables=None,
    table_buckets=None, engram_lookback: int = 0, debug: bool = False,
) -> StepBatch | None:  # fmt: skip
    """`build_burst` from kept tables (`BlockTables`) in one pass over the requests and a few
    vectorised ones over the burst, or None where the generic path must run: no kept tables,
    Engram look-back, or any request the checks would refuse (that path raises the error)."""
    del debug
    if tables is None or engram_lookback:
        return None
    num_steps, token_bucket, request_rows = shape
    flat = [r for step in steps for r in step]
    columns = _burst_columns(flat, len(groups), len(tables.counts[0]), max_model_len)
    if columns is None:
        return None
    token, start, slot, replay, write_from = columns
    m, counts = len(steps), [len(step) for step in steps]
    offsets = np.cumsum([0, *counts[:-1]])
    step = np.repeat(np.arange(m), counts)  # every request's step and row in it
    row = np.arange(len(flat)) - offsets[step]
    widths = _steps_widths(groups, max_model_len, table_buckets,
                           np.maximum.reduceat(start + 1, offsets).tolist())  # fmt: skip
    pad = _padding_template(tuple(groups), token_bucket, request_rows,
                            tuple(widths.max(axis=0)), engram_lookback)  # fmt: skip

    def stacked(template, values=None, fill=None):  # [k, ...]: the steps past m zeros
        out = np.zeros((num_steps, *template.shape), template.dtype)
        out[:m] = template if fill is None else fill
        if values is not None:
            out[step, row] = values
        return out

    qsl = np.minimum(np.arange(request_rows + 1), np.array(counts)[:, None])
    tables_out, slots = [], {"window": {}, "compressed": {}, "ring": {}}
    for g in groups:
        width = pad[7][g.index].shape[1]
        got = _kept_group(g, tables, slot, start, write_from, width, max_model_len)
        if got is None:
            return None
        kept, values = got
        template = {"window": pad[8], "compressed": pad[9], "ring": pad[10]}[g.kind]
        for key, value in values.items():
            slots[g.kind][key] = stacked(template[key], value)
        columns = np.arange(width) < widths[step, g.index][:, None]  # each step's own width
        tables_out.append(stacked(pad[7][g.index], kept * columns))
    return StepBatch(
        token_ids=stacked(pad[0], token),
        positions=stacked(pad[1], start),
        token_req=stacked(pad[2], row),
        query_start_loc=stacked(pad[3], fill=qsl),
        seq_lens=stacked(pad[4], start + 1),
        logits_indices=stacked(pad[5], row),
        replay_start=stacked(pad[6], replay),
        block_tables=tuple(tables_out),
        window_slots=slots["window"],
        state_slots=slots["compressed"],
        ring_slots=slots["ring"],
        engram_prev=stacked(pad[11]),
    )


def _burst_columns(flat, num_groups: int, num_slots: int, max_model_len: int) -> tuple | None:
    """``(token, start, slot, replay_start, cache_write_from)`` of requests of one token each,
    one array per field, or None where the generic path's checks would raise."""
    if {len(r.block_ids) for r in flat} != {num_groups} or {len(r.token_ids) for r in flat} != {1}:
        return None
    start = np.array([r.start for r in flat], np.int64)
    slot = np.array([r.slot for r in flat], np.int64)
    if ((start < 0) | (start >= max_model_len) | (slot < 0) | (slot >= num_slots)).any():
        return None
    return (
        np.array([r.token_ids[0] for r in flat], np.int64),
        start,
        slot,
        np.array([r.replay_start for r in flat], np.int64),
        np.array([r.cache_write_from for r in flat], np.int64),
    )


def _kept_group(g: GroupInfo, tables: BlockTables, slot, start, write_from, width: int,
                max_model_len: int) -> tuple[np.ndarray, dict] | None:  # fmt: skip
    """One group's part of `_kept_burst` for requests of one token each (``slot``, ``start``,
    ``write_from``: per request): their table rows [n, ``width``] and slot mappings by key
    (`_fill_group`'s formulas), or None where the generic path's checks would raise."""
    held = tables.counts[g.index][slot]
    kept = tables.rows[g.index][slot]  # [n, the group's full width]
    every = np.arange(len(slot))
    if g.kind == "ring":
        if (held > 1).any():
            return None
        block = kept[:, 0]
        return kept[:, :width], {
            g.index: np.where(block != 0, block * g.block_size + start % g.block_size, -1)
        }
    if (held > _cdiv(max_model_len, g.block_size)).any():
        return None
    if g.kind == "window":
        blk = start // g.block_size
        if (blk >= held).any():
            return None
        return kept[:, :width], {g.index: kept[every, blk] * g.block_size + start % g.block_size}
    writes, values = start >= write_from, {}
    for r in g.ratios:
        blk, closes = _state_blocks(start, g.block_size, r)
        used = closes & writes
        if (used & (blk >= held)).any():
            return None
        e = g.block_size // r
        at = kept[every, np.minimum(blk, width - 1)]
        values[(g.index, r)] = np.where(used, at * e + start // r % e, -1)
    return kept[:, :width], values


def widen_tables(batch: StepBatch, widths: Sequence[int]) -> StepBatch:
    """``batch`` with each group's block table widened to ``widths`` by null columns (the
    step addresses no column past a row's blocks, so the results do not change)."""
    if batch.table_widths() == tuple(widths):
        return batch
    tables = tuple(
        np.pad(np.asarray(t), ((0, 0), (0, w - t.shape[1])))
        for t, w in zip(batch.block_tables, widths, strict=True)
    )
    return dataclasses.replace(batch, block_tables=tables)


def _check_burst(steps, num_steps: int, token_bucket: int, request_rows: int) -> None:
    """An error naming what makes ``steps`` no burst of decode steps in these buckets."""
    counts = [len(step) for step in steps]
    if not steps or len(steps) > num_steps:
        raise ValueError(f"a burst of {len(steps)} steps; allowed: 1..num_steps={num_steps}")
    # fewer requests than tokens leave padding tokens, which need a row of their own
    most = token_bucket if request_rows >= token_bucket else request_rows - 1
    if not all(counts) or max(counts) > most:
        raise ValueError(
            f"a burst's steps hold {counts} requests; allowed: 1..{most} each (token bucket "
            f"{token_bucket}, {request_rows} rows, one of them for padding tokens if any)"
        )


def _check_decode(steps) -> None:
    """An error naming the first request of ``steps`` that runs more than one token."""
    several = next((r for step in steps for r in step if len(r.token_ids) != 1), None)
    if several is not None:
        raise ValueError(
            f"request {several.req_id!r} has {len(several.token_ids)} tokens in a burst step; "
            "a burst runs decode steps (one token per request)"
        )


def _split_burst(
    whole: StepBatch, counts: list[int], widths: np.ndarray, shape: tuple[int, int, int]
) -> StepBatch:
    """`build_burst`'s steps from ``whole``, the batch of all their requests in order: step i
    holds ``counts[i]`` of them and reads ``widths[i]`` columns per group; ``shape`` = (k, T, R)."""
    num_steps, token_bucket, request_rows = shape
    m = len(counts)
    offsets = np.cumsum([0, *counts[:-1]])[:, None]
    sizes = np.array(counts)[:, None]
    tok = np.arange(token_bucket)  # step i's token j is request j (one token each)
    row = np.arange(request_rows)
    tok_real, row_real = tok < sizes, row < sizes  # [m, T], [m, R]

    def split(x, real, pad):  # x [n, ...] -> [k, T or R, ...], step i from its rows
        out = np.zeros((num_steps, real.shape[1], *x.shape[1:]), x.dtype)
        out[:m] = pad
        out[:m][real] = x[(offsets + np.arange(real.shape[1]))[real]]
        return out

    def table(x, g):  # [k, R, W]: the columns past step i's own width null
        out = split(x, row_real, 0)
        out[:m] *= (np.arange(out.shape[2]) < widths[:, g, None])[:, None, :]
        return out

    def local(values):  # per step [m, ...] -> [k, ...] (the steps past m zeros)
        out = np.zeros((num_steps, *values.shape[1:]), np.int32)
        out[:m] = values
        return out

    return StepBatch(
        token_ids=split(whole.token_ids, tok_real, 0),
        positions=split(whole.positions, tok_real, -1),
        token_req=local(np.where(tok_real, tok, request_rows - 1)),
        query_start_loc=local(np.minimum(np.arange(request_rows + 1), sizes)),
        seq_lens=split(whole.seq_lens, row_real, 0),
        logits_indices=local(np.where(row_real, row, 0)),
        replay_start=split(whole.replay_start, row_real, 0),
        block_tables=tuple(table(x, g) for g, x in enumerate(whole.block_tables)),
        window_slots={g: split(x, tok_real, -1) for g, x in whole.window_slots.items()},
        state_slots={k: split(x, tok_real, -1) for k, x in whole.state_slots.items()},
        ring_slots={g: split(x, tok_real, -1) for g, x in whole.ring_slots.items()},
        engram_prev=split(whole.engram_prev, row_real, -1),
    )


# Up to this many tokens a step's slots are computed token by token in Python (`_fill_few`):
# cheaper than the vectorised path's few dozen numpy calls on arrays this small.
_FEW_TOKENS = 16


def _kept(requests, tables: BlockTables, debug: bool) -> tuple[BlockTables, np.ndarray]:
    """``(tables, the requests' slots)``; an error names the first request without a slot (or,
    in ``debug``, whose slot does not hold its block ids: `_check_kept`)."""
    slots = [r.slot for r in requests]
    num_slots = len(tables.counts[0]) if tables.counts else 0
    for i, slot in enumerate(slots):
        if not 0 <= slot < num_slots:
            raise ValueError(
                f"request {i} ({requests[i].req_id!r}) has slot {slot}; the block tables kept "
                f"have slots 0..{num_slots - 1}"
            )
    kept = tables, np.array(slots)
    if debug:
        _check_kept(requests, *kept)
    return kept


def _check_kept(requests, tables: BlockTables, slots: np.ndarray) -> None:
    """Debug check: every request's slot in ``tables`` holds its block ids."""
    for i, r in enumerate(requests):
        for g, ids in enumerate(r.block_ids):
            row, count = tables.rows[g][slots[i]], int(tables.counts[g][slots[i]])
            fit = min(count, len(row))
            if count != len(ids) or row[:fit].tolist() != list(ids[:fit]) or row[fit:].any():
                raise ValueError(
                    f"request {i} ({r.req_id!r}) holds {len(ids)} blocks in group {g}, but "
                    f"slot {int(slots[i])} of the block tables kept holds {count}: "
                    f"{row[:fit].tolist()}"
                )


def _fill_few(batch: StepBatch, groups, requests, max_model_len: int, kept=None) -> bool:
    """Every group's block table and slots (`_fill_group`'s, the same formulas per token) for
    a step of few tokens; False, with nothing promised written, where some check fails (the
    vectorised path then raises its error)."""
    out: dict[tuple[str, int, int], list[int]] = {}
    for g in groups:
        counts = [len(r.block_ids[g.index]) for r in requests]
        table = batch.block_tables[g.index]
        if g.kind == "ring":
            if max(counts) > 1:
                return False
            table[: len(requests), 0] = [
                r.block_ids[g.index][0] if c else 0 for r, c in zip(requests, counts)
            ]
        elif max(counts) > _cdiv(max_model_len, g.block_size):
            return False
        else:
            _fill_table(table, requests, g.index, counts, kept)
        keys = (
            [("ring", g.index, 0)] if g.kind == "ring" else [(g.kind, g.index, r) for r in g.ratios]
        )
        for key in keys:
            slots = out[key] = []
            for r in requests:
                if not _few_slots(slots, key[0], g.block_size, key[2], r, g.index):
                    return False
    for (kind, g, r), slots in out.items():
        where = {"window": batch.window_slots, "ring": batch.ring_slots}.get(kind)
        target = batch.state_slots[(g, r)] if where is None else where[g]
        target[: len(slots)] = slots
    return True


def _few_slots(slots: list[int], kind: str, size: int, ratio: int, r, g: int) -> bool:
    """Append request ``r``'s slots in group ``g`` of one mapping (window, compressed of
    ``ratio``, ring: the formulas of `window_slots_at`, `state_slots_at`, `ring_slots_at`)
    to ``slots``; False where a token that writes finds no block."""
    ids, start, n = r.block_ids[g], r.start, len(r.token_ids)
    count = len(ids)
    if kind == "ring":
        ring = ids[0] if count else 0
        first = start + max(n - size, 0)  # only the chunk's last C tokens write
        slots += [
            ring * size + p % size if ring and p >= first else -1 for p in range(start, start + n)
        ]
        return True
    if kind == "window":
        for p in range(start, start + n):
            if p // size >= count:
                return False
            slots.append(ids[p // size] * size + p % size)
        return True
    per_block = size // ratio
    for p in range(start, start + n):
        if (p + 1) % ratio or p < r.cache_write_from:
            slots.append(-1)
            continue
        j = p // ratio
        if j // per_block >= count:
            return False
        slots.append(ids[j // per_block] * per_block + j % per_block)
    return True


def _fill_group(
    batch: StepBatch,
    g: GroupInfo,
    requests: Sequence[StepRequest],
    max_model_len: int,
    req: np.ndarray,
    pos: np.ndarray,
    lens: np.ndarray,
    ends: np.ndarray,
    kept=None,
) -> None:
    """One KV-cache group's block table and slots (``req`` / ``pos``: every token's request row
    and position; ``lens`` / ``ends``: each request's token count and end in the step; ``kept``:
    `build_batch`'s tables and the requests' slots, or None). The slots are read from the
    (possibly trimmed) table: it holds every block the step's tokens reach (its width covers
    the longest request)."""
    n_tok = len(pos)
    if kept is None:
        counts_list = [len(r.block_ids[g.index]) for r in requests]
    else:  # the kept tables count the ids (`_check_kept` compares them in debug)
        counts_list = kept[0].counts[g.index][kept[1]].tolist()
    table = batch.block_tables[g.index]
    if g.kind == "ring":
        _ring_slots(
            requests, g, counts_list, table, batch.ring_slots[g.index], req, pos, lens, ends, kept
        )
        return
    full = _cdiv(max_model_len, g.block_size)
    if max(counts_list) > full:
        i = next(i for i, c in enumerate(counts_list) if c > full)
        raise ValueError(
            f"request {i} ({requests[i].req_id!r}): group {g.index} holds {counts_list[i]} "
            f"blocks, more than max_model_len {max_model_len} needs ({full})"
        )
    _fill_table(table, requests, g.index, counts_list, kept)
    counts = np.array(counts_list, np.int64)
    if g.kind == "window":
        blk = pos // g.block_size
        _need_blocks(requests, g, counts, req, blk, None)
        batch.window_slots[g.index][:n_tok] = window_slots_at(table, req, pos, g.block_size)
        return
    write_from = np.array([r.cache_write_from for r in requests], np.int64)
    writes = pos >= write_from[req]
    for r in g.ratios:
        blk, closes = _state_blocks(pos, g.block_size, r)
        _need_blocks(requests, g, counts, req, blk, closes & writes)
        slots = state_slots_at(table, req, pos, g.block_size, r, writes)
        batch.state_slots[(g.index, r)][:n_tok] = slots


# The slot formulas of each group kind, written once for numpy (`build_batch`) and jax (the
# engine's step moves rows planned past drafts in flight back on the device). ``table`` is a
# group's block table [R, W], ``req`` / ``pos`` the request row and position of every token.
# A block column past the table is clipped: the builder checks first that every token that
# writes finds its block (`_need_blocks`), and a moved row only goes back to blocks it holds.


def _xp(x):
    return np if isinstance(x, np.ndarray) else jnp


def window_slots_at(table, req, pos, block_size: int):
    """Token slots of a sliding-window group: ``table[req, p // S] * S + p % S``."""
    xp = _xp(table)
    column = xp.minimum(pos // block_size, table.shape[1] - 1)
    return table[req, column] * block_size + pos % block_size


def _state_blocks(pos, block_size: int, ratio: int):
    """For each position: the block column holding its compressed state of ratio r
    (``(p // r) // (B / r)``), and whether it closes that state (``(p + 1) % r == 0``)."""
    return pos // ratio // (block_size // ratio), (pos + 1) % ratio == 0


def state_slots_at(table, req, pos, block_size: int, ratio: int, writes):
    """Compressed-state slots of ratio r in a full group (E = B / r states per block): state
    ``j = p // r`` goes to ``table[req, j // E] * E + j % E``, written by the token that
    closes it where ``writes`` holds; -1 elsewhere."""
    xp = _xp(table)
    per_block = block_size // ratio
    blk, closes = _state_blocks(pos, block_size, ratio)
    slot = table[req, xp.minimum(blk, table.shape[1] - 1)] * per_block + pos // ratio % per_block
    return xp.where(closes & writes, slot, -1)


def ring_slots_at(table, req, pos, capacity: int, writes):
    """Ring rows of a circular-buffer group (one ring block per request, column 0):
    ``ring * C + p % C`` where ``writes`` holds, -1 elsewhere."""
    return _xp(table).where(writes, table[req, 0] * capacity + pos % capacity, -1)


def _check_requests(requests, lens, starts, max_model_len: int, num_groups: int) -> None:
    """Errors naming the first request without tokens, outside the model length, or with
    block ids for the wrong number of groups (``lens`` / ``starts``: lists, one per request)."""
    if 0 in lens:
        i = lens.index(0)
        raise ValueError(f"request {i} ({requests[i].req_id!r}) has no tokens scheduled")
    for i, (r, n, start) in enumerate(zip(requests, lens, starts, strict=True)):
        if start < 0 or start + n > max_model_len:
            raise ValueError(
                f"request {i} ({r.req_id!r}): positions {start}..{start + n - 1} "
                f"outside 0..{max_model_len - 1}"
            )
    for i, r in enumerate(requests):
        if len(r.block_ids) != num_groups:
            raise ValueError(
                f"request {i} ({r.req_id!r}) has block ids for {len(r.block_ids)} groups, "
                f"the layout has {num_groups}"
            )


def _engram_prev(requests, starts, m: int, out: np.ndarray) -> None:
    """Row i, column j: the token at position start_i - 1 - j (-1 before position 0)."""
    for i, r in enumerate(requests):
        need = min(m, int(starts[i]))
        prev = r.prev_tokens[len(r.prev_tokens) - need :] if need else ()
        if len(prev) != need:
            raise ValueError(
                f"request {i} ({r.req_id!r}) starts at position {starts[i]} but gives "
                f"{len(r.prev_tokens)} prev_tokens; Engram needs the {need} before it"
            )
        out[i, :need] = list(reversed(prev))


def _fill_table(table: np.ndarray, requests, g: int, counts: list[int], kept=None) -> None:
    """Write every request's block ids of group g into the rows of ``table`` (the columns it
    has: a trimmed table keeps what the step reads); entries past a request's ids stay 0.
    With ``kept`` (tables, slots) and more than a few rows: the slots' rows (the same ids)."""
    width = table.shape[1]
    if kept is not None and len(requests) > 4:
        table[: len(requests)] = kept[0].rows[g][kept[1], :width]
        return
    if len(requests) <= 4:  # a few rows: a slice each beats the ragged scatter
        for i, r in enumerate(requests):
            ids = r.block_ids[g]
            if counts[i] > width:
                ids = ids[:width]
            table[i, : len(ids)] = ids
        return
    n = len(requests)
    if max(counts) > width:  # a trimmed table: only the columns the step reads
        counts = [min(c, width) for c in counts]
        rows = (r.block_ids[g][:width] for r in requests)
    else:
        rows = (r.block_ids[g] for r in requests)
    flat = np.fromiter(itertools.chain.from_iterable(rows), np.int64, sum(counts))
    # row-major order of the mask is the order of the rows' ids
    table[:n][np.arange(width) < np.array(counts)[:, None]] = flat


def _ring_slots(
    requests, g: GroupInfo, counts, table, slots, req, pos, lens, ends, kept=None
) -> None:
    """The ring block (at most one per request, from the ``kept`` tables' rows if given) and
    the ring rows of each request's last ``min(len, C)`` tokens (``ring_block * C + p % C``)."""
    if max(counts) > 1:
        i = next(i for i, c in enumerate(counts) if c > 1)
        raise ValueError(
            f"request {i} ({requests[i].req_id!r}): ring group {g.index} holds "
            f"{counts[i]} blocks, expected at most 1"
        )
    if kept is None:
        ring = np.array([r.block_ids[g.index][0] if c else 0 for r, c in zip(requests, counts)])
    else:  # a row past its ids holds 0
        ring = kept[0].rows[g.index][kept[1], 0]
    n_req = len(requests)
    table[:n_req, 0] = ring
    c = g.block_size
    last = ring[req] != 0
    if len(req) > n_req:  # some request runs several tokens: only its last C write
        index = np.arange(len(req)) - (ends - lens)[req]  # token's index inside its chunk
        last &= index >= lens[req] - c
    slots[: len(req)] = ring_slots_at(table[:n_req], req, pos, c, last)


def _need_blocks(requests, g: GroupInfo, counts, req, blk, used) -> None:
    """Every token that writes group g (where ``used`` holds; None: every token) must find its
    block among its request's ids."""
    short = blk >= counts[req]
    if used is not None:
        short &= used
    if short.any():
        t = int(np.argmax(short))
        i = int(req[t])
        raise ValueError(
            f"request {i} ({requests[i].req_id!r}): group {g.index} needs block "
            f"{int(blk[short][req[short] == i].max())} for its new tokens but holds "
            f"{counts[i]} blocks (allocate the slots first)"
        )


def _table_widths(
    groups: Sequence[GroupInfo],
    max_model_len: int,
    table_buckets: Sequence[int] | None,
    longest: int,
) -> tuple[int, ...]:
    """Each group's table width for a step whose longest request reaches ``longest`` tokens."""
    widths = []
    for g in groups:
        width = 1 if g.kind == "ring" else _cdiv(max_model_len, g.block_size)
        if table_buckets is not None and g.kind != "ring":
            need = _cdiv(min(longest, max_model_len), g.block_size)
            width = min(width, bucket(need, [*table_buckets, width]))
        widths.append(width)
    return tuple(widths)


def _steps_widths(groups, max_model_len: int, table_buckets, longest) -> np.ndarray:
    """`_table_widths` of each step of a burst ([steps, groups]; ``longest``: per step)."""
    return np.array([_table_widths(groups, max_model_len, table_buckets, n) for n in longest])


def table_width_buckets(
    config: KVCacheConfig, *, max_model_len: int, table_buckets: Sequence[int] | None
) -> list[tuple[int, ...]]:
    """Every tuple of table widths `build_batch` can produce (one compilation each), in
    ascending order: one tuple of full widths without ``table_buckets``."""
    groups = group_infos(config)
    sizes = sorted({g.block_size for g in groups if g.kind != "ring"})
    # the widths change only where some group's block count does: at block boundaries
    cuts = {max_model_len}
    for size in sizes:
        cuts.update(range(size, max_model_len, size))
    cuts.update(c + 1 for c in list(cuts) if c < max_model_len)
    cuts.add(1)
    found = {_table_widths(groups, max_model_len, table_buckets, n) for n in sorted(cuts)}
    return sorted(found)


def empty_batch(
    config: KVCacheConfig,
    *,
    max_model_len: int,
    num_tokens: int,
    num_rows: int,
    table_widths: Sequence[int] | None = None,
    engram_lookback: int = 0,
) -> StepBatch:
    """A batch of padding only (``num_tokens`` tokens at position -1, ``num_rows`` empty
    rows, null tables of ``table_widths``, default full width): the step reads and writes
    nothing with it, so it compiles (warms up) a bucket without touching any cache."""
    groups = group_infos(config)
    if table_widths is None:
        table_widths = _table_widths(groups, max_model_len, None, max_model_len)
    return _padding(groups, num_tokens, num_rows, table_widths, engram_lookback)


def _padding(
    groups: Sequence[GroupInfo],
    t_pad: int,
    r_pad: int,
    widths: Sequence[int],
    engram_lookback: int = 0,
) -> StepBatch:
    """The arrays of a batch of T = t_pad tokens and R = r_pad rows, all padding (fresh
    copies of one template per shape: the builder writes into them)."""
    template = _padding_template(tuple(groups), t_pad, r_pad, tuple(widths), engram_lookback)
    return StepBatch(
        *[a.copy() for a in template[:7]],
        block_tables=tuple(a.copy() for a in template[7]),
        window_slots={k: a.copy() for k, a in template[8].items()},
        state_slots={k: a.copy() for k, a in template[9].items()},
        ring_slots={k: a.copy() for k, a in template[10].items()},
        engram_prev=template[11].copy(),
    )


@functools.lru_cache(maxsize=256)
def _padding_template(groups, t_pad: int, r_pad: int, widths, engram_lookback: int) -> tuple:
    """`_padding`'s arrays in `StepBatch`'s field order (never written: `_padding` copies)."""
    window_slots: dict[int, np.ndarray] = {}
    state_slots: dict[tuple[int, int], np.ndarray] = {}
    ring_slots: dict[int, np.ndarray] = {}
    for g in groups:
        if g.kind == "window":
            window_slots[g.index] = np.full(t_pad, -1, np.int32)
        elif g.kind == "compressed":
            for r in g.ratios:
                state_slots[(g.index, r)] = np.full(t_pad, -1, np.int32)
        else:
            ring_slots[g.index] = np.full(t_pad, -1, np.int32)
    return (
        np.zeros(t_pad, np.int32),  # token_ids
        np.full(t_pad, -1, np.int32),  # positions
        np.full(t_pad, r_pad - 1, np.int32),  # token_req
        np.zeros(r_pad + 1, np.int32),  # query_start_loc
        np.zeros(r_pad, np.int32),  # seq_lens
        np.zeros(r_pad, np.int32),  # logits_indices
        np.zeros(r_pad, np.int32),  # replay_start
        tuple(np.zeros((r_pad, w), np.int32) for w in widths),
        window_slots,
        state_slots,
        ring_slots,
        np.full((r_pad, engram_lookback), -1, np.int32),
    )


def check_batch(batch: StepBatch, config: KVCacheConfig) -> None:
    """Debug check: every block id in [0, num_blocks), every slot -1 or inside the pool, no
    write into the null block. Raises ValueError naming the first bad value."""
    groups = group_infos(config)
    nb = config.num_blocks
    for g in groups:
        table = np.asarray(batch.block_tables[g.index])
        bad = np.argwhere((table < 0) | (table >= nb))
        if len(bad):
            row, col = bad[0]
            raise ValueError(
                f"block table of group {g.index}: request row {row}, entry {col} holds block id "
                f"{int(table[row, col])}, outside the pool's 0..{nb - 1}"
            )
    mappings = [(f"window_slots[{g}]", g, 1, s) for g, s in batch.window_slots.items()]
    mappings += [(f"state_slots[{k}]", k[0], k[1], s) for k, s in batch.state_slots.items()]
    mappings += [(f"ring_slots[{g}]", g, 1, s) for g, s in batch.ring_slots.items()]
    positions = np.asarray(batch.positions)
    for name, g, ratio, s in mappings:
        s = np.asarray(s)
        per_block = groups[g].block_size // ratio
        limit = nb * per_block
        bad = np.argwhere((s < -1) | (s >= limit))
        if len(bad):
            t = int(bad[0][0])
            raise ValueError(
                f"slot mapping {name}: token {t} (position {int(positions[t])}) has "
                f"slot {int(s[t])}, allowed -1 or 0..{limit - 1}"
            )
        null = np.argwhere((s >= 0) & (s < per_block))
        if len(null):
            t = int(null[0][0])
            raise ValueError(
                f"slot mapping {name}: token {t} (position {int(positions[t])}) would "
                f"write slot {int(s[t])} in the null block 0"
            )
