"""Kernel benchmark at the released V4.1-Flash shapes: bytes moved and FLOPs from each kernel's
cost model, and on a real chip the measured time and share of the HBM roofline.

Prints one JSON line; a kernel plugs in with ``(Shape, impl, pool_bytes) -> Bench`` in `BENCHES`.
Usage and fields: docs/benchmarks.md#benchmarkskernels.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import compressor, indexer_topk, sparse_attention, window_attention
from pallas_kernels.backend import IMPLS, Cost, resolve_impl
from pallas_kernels.compressor.common import cost as compressor_cost
from pallas_kernels.indexer.common import cost as indexer_cost
from pallas_kernels.indexer.common import weighted_relu_sum
from pallas_kernels.sparse_attention.cost import sparse_cost
from pallas_kernels.window_attention.cost import window_cost

# V4.1-Flash attention shapes (docs/model.md#released-configuration)
HEADS, LATENT, WINDOW, TOPK = 64, 512, 128, 512
SWA_PAGE = 32  # window-cache page, tokens
COMP_BLOCK = 64  # raw tokens per compressed block (E = 64 / ratio entries)
INDEX_HEADS, INDEX_DIM = 32, 128  # indexer: 32 index heads of 128, top-k TOPK
CAND_BLOCK, CAND_BLOCKS = 8, 2048  # candidate blocks of 8 entries, 2048 of them (ratio 1)
ROPE, RING = 64, 8  # compressor: rotated dims of the latent, ring rows per request (ratio 2)
NORM_EPS = 1e-6
DTYPE = jnp.bfloat16

DECODE_BATCHES = (1, 8, 32, 64, 128)
CONTEXTS = (4096, 32768, 131072, 1 << 20)
PREFILL = ((2048, 8192), (8192, 131072))  # (chunk tokens, context after the chunk)

# HBM bandwidth by device kind (bytes/s): vendor figures for GPUs, `pltpu.get_tpu_info` for TPUs.
PEAK_HBM = {
    "NVIDIA H200": 4.8e12,
    "NVIDIA H100 80GB HBM3": 3.35e12,
    "NVIDIA H100 PCIe": 2.0e12,
    "NVIDIA A100-SXM4-80GB": 2.039e12,
    "TPU v5 lite": 8.2e11,
    "TPU v6 lite": 1.64e12,
}


@dataclasses.dataclass(frozen=True)
class Shape:
    """One benchmark point: `tokens` query tokens from `batch` requests at `context` tokens."""

    phase: str  # "decode" | "prefill"
    batch: int
    tokens: int
    context: int


@dataclasses.dataclass
class Bench:
    """What a kernel contributes for one shape: its cost and, for timing, inputs and a call.

    `donate` maps an argument position to the output position that replaces it: the argument
    is donated (updated in place, as in serving) and the output is fed back for the next call.
    `info` adds fields to the row (mode, dtypes, entries scored)."""

    cost: Cost
    make_args: Callable[[np.random.Generator], tuple[Any, ...]]
    run: Callable[..., Any]
    donate: dict[int, int] = dataclasses.field(default_factory=dict)
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


def shapes(quick: bool) -> list[Shape]:
    """Decode (one token per request) over batches x contexts, then prefill chunks."""
    batches, contexts = ((1, 128), (4096, 1 << 20)) if quick else (DECODE_BATCHES, CONTEXTS)
    out = [Shape("decode", b, b, c) for b in batches for c in contexts]
    prefill = PREFILL[:1] if quick else PREFILL
    return out + [Shape("prefill", 1, t, c) for t, c in prefill]


def _positions(shape: Shape) -> np.ndarray:
    per_req = shape.tokens // shape.batch
    return np.tile(np.arange(shape.context - per_req, shape.context, dtype=np.int32), shape.batch)


POOL_BYTES = 512e6  # random cache pools: larger than any on-chip cache (H200 L2: 50 MB)


def _pool_pages(rows_per_page: int, pool_bytes: float, row_bytes: int | None = None) -> int:
    """Pages of a random pool of about `pool_bytes` (rows of `row_bytes`, default a latent)."""
    row_bytes = LATENT * jnp.dtype(DTYPE).itemsize if row_bytes is None else row_bytes
    return int(pool_bytes // (rows_per_page * row_bytes)) + 1


def _attention_inputs(
    rng: np.random.Generator, key: int, shape: Shape, num_pages: int, page: int, blocks: int
) -> tuple:
    """An attention bench's queries, random page pool, block tables and tokens' requests (the
    pool and queries from PRNG keys ``key`` and ``key + 1``, the tables from ``rng``)."""
    t, r = shape.tokens, shape.batch
    pages = jax.random.normal(jax.random.key(key), (num_pages, page, LATENT), DTYPE)
    tables = rng.integers(1, num_pages, (r, blocks), dtype=np.int32)
    q = jax.random.normal(jax.random.key(key + 1), (t, HEADS, LATENT), DTYPE)
    req = np.repeat(np.arange(r, dtype=np.int32), t // r)
    return q, pages, jnp.asarray(tables), jnp.asarray(req)


def window_bench(shape: Shape, impl: str | None, pool_bytes: float = POOL_BYTES) -> Bench:
    """Window attention of every token over its 128-token window (one layer)."""
    t, r = shape.tokens, shape.batch
    nb = shape.context // SWA_PAGE
    num_pages = _pool_pages(SWA_PAGE, pool_bytes)
    itemsize = jnp.dtype(DTYPE).itemsize
    cost = window_cost(
        num_tokens=t, num_requests=r, heads=HEADS, dim=LATENT, window=WINDOW,
        page_size=SWA_PAGE, q_bytes=itemsize, kv_bytes=itemsize,
    )  # fmt: skip

    def make_args(rng: np.random.Generator):
        inputs = _attention_inputs(rng, 0, shape, num_pages, SWA_PAGE, nb)
        sink = jnp.zeros((HEADS,), jnp.float32)
        return (*inputs, jnp.asarray(_positions(shape)), sink)

    def run(*args):
        return window_attention(*args, window=WINDOW, scale=LATENT**-0.5, impl=impl)

    return Bench(cost, make_args, run)


def sparse_bench(
    shape: Shape, impl: str | None, pool_bytes: float = POOL_BYTES, ratio: int = 1
) -> Bench:
    """Sparse attention over 512 selected compressed entries, continuing a window state."""
    t = shape.tokens
    per_block = COMP_BLOCK // ratio
    entries = shape.context // ratio
    nbc = shape.context // COMP_BLOCK
    num_pages = _pool_pages(per_block, pool_bytes)
    itemsize = jnp.dtype(DTYPE).itemsize
    k = min(TOPK, entries)
    cost = sparse_cost(
        num_tokens=t, heads=HEADS, dim=LATENT, topk=k, q_bytes=itemsize, kv_bytes=itemsize,
        with_state=True,
    )  # fmt: skip

    def make_args(rng: np.random.Generator):
        inputs = _attention_inputs(rng, 2, shape, num_pages, per_block, nbc)
        # distinct entries spread over the context (random start, even stride): random pages
        stride = entries // k
        topk = (rng.integers(0, entries, (t, 1)) + np.arange(k) * stride) % entries
        topk = topk.astype(np.int32)
        sink = jnp.zeros((HEADS,), jnp.float32)
        state = (
            jnp.zeros((t, HEADS), jnp.float32),
            jnp.ones((t, HEADS), jnp.float32),
            jnp.zeros((t, HEADS, LATENT), jnp.float32),
        )
        return (*inputs, jnp.asarray(_positions(shape)), jnp.asarray(topk), sink, state)

    def run(*args):
        *args, state = args
        return sparse_attention(
            *args, entries_per_block=per_block, scale=LATENT**-0.5, state=state, impl=impl
        )

    return Bench(cost, make_args, run)


INDEXER_MODES = ("source", "plain", "consumer")
SCORE_GROUP_BYTES = 2e9  # jnp scoring: tokens per step so the gathered keys and dots fit this


def _spread(rng: np.random.Generator, rows: int, n: int, count: int) -> np.ndarray:
    """i32[rows, count]: `count` distinct ids below `n` per row (random start, even stride)."""
    stride = max(1, n // count)
    return ((rng.integers(0, n, (rows, 1)) + np.arange(count) * stride) % n).astype(np.int32)


def indexer_tile(impl: str | None) -> int:
    """Tokens per program of the indexer kernel that `impl` runs (the TPU kernel's when the
    reference runs: CPU rows print the kernels' cost model)."""
    from pallas_kernels.indexer import gpu as gpu_indexer
    from pallas_kernels.indexer import tpu as tpu_indexer

    if resolve_impl(impl) == "gpu":
        return getattr(gpu_indexer, "TOKENS_PER_TILE", 1)
    return tpu_indexer.TOKENS_PER_TILE


def summed_indexer_cost(
    visible: np.ndarray,
    *,
    k: int,
    per_block: int,
    cand_out: int,
    cap: int | None,
    token_req: np.ndarray | None = None,
    tile: int = 1,
    fp8: bool = False,
):
    """The indexer cost model summed over tokens (each scores its own visible entries, at most
    `cap` for a consumer). Key bytes: with `token_req` and `tile` > 1 (not for a consumer), the
    tokens of one request within a tile of `tile` consecutive tokens read the keys once, up to
    the largest visible count among them (the TPU kernel's segments); otherwise once per token.
    `fp8`: e4m3 keys plus one f32 scale each (the fp8_132 record) instead of bf16 keys."""
    visible = np.asarray(visible)
    reader = np.ones(len(visible), bool)  # the token charged with its segment's key stream
    if token_req is not None and tile > 1 and cap is None:
        reader[:] = False
        for t0 in range(0, len(visible), tile):
            reqs = token_req[t0 : t0 + tile]
            for r in np.unique(reqs):
                idx = t0 + np.flatnonzero(reqs == r)
                reader[idx[np.argmax(visible[idx])]] = True
    flops = bytes_ = 0
    for v in np.unique(visible).tolist():
        at = visible == v
        c = indexer_cost(
            int(at.sum()), INDEX_HEADS, INDEX_DIM, v if cap is None else min(v, cap), k=k,
            key_dtype=jnp.float8_e4m3fn if fp8 else DTYPE, q_dtype=DTYPE,
            candidate_topk_blocks=cand_out, entries_per_block=per_block,
            key_reads=int((at & reader).sum()), key_scale_bytes=4 if fp8 else 0,
        )  # fmt: skip
        flops, bytes_ = flops + c["flops"], bytes_ + c["bytes"]
    return Cost(bytes_accessed=bytes_, flops=flops)


def _indexer_inputs(shape: Shape, ratio: int, pool_bytes: float):
    """(entries per block, table width, pool pages, visible) of an indexer at `shape`."""
    per_block = COMP_BLOCK // ratio
    nb = shape.context // COMP_BLOCK
    num_pages = _pool_pages(per_block, pool_bytes, INDEX_DIM * jnp.dtype(DTYPE).itemsize)
    visible = (_positions(shape) + 1) // ratio
    return per_block, nb, num_pages, visible


def _indexer_make_args(shape: Shape, per_block: int, nb: int, num_pages: int, visible):
    def make_args(rng: np.random.Generator):
        t, r = shape.tokens, shape.batch
        keys = jax.random.normal(jax.random.key(4), (num_pages, per_block, INDEX_DIM), DTYPE)
        tables = rng.integers(1, num_pages, (r, nb), dtype=np.int32)
        qi = jax.random.normal(jax.random.key(5), (t, INDEX_HEADS, INDEX_DIM), DTYPE)
        weights = jax.random.uniform(jax.random.key(6), (t, INDEX_HEADS), jnp.float32)
        req = np.repeat(np.arange(r, dtype=np.int32), t // r)
        pos = _positions(shape)
        return (qi, weights, keys, jnp.asarray(tables), jnp.asarray(req), jnp.asarray(pos),
                jnp.asarray(visible, jnp.int32))  # fmt: skip

    return make_args


def indexer_bench(
    shape: Shape,
    impl: str | None,
    pool_bytes: float = POOL_BYTES,
    ratio: int = 1,
    mode: str = "source",
    fp8: bool = False,
) -> Bench:
    """Indexer top-512 over `context // ratio` paged index keys (one layer); `mode` "source"
    also returns the top 2048 candidate blocks of 8, "consumer" scores only 2048 given blocks.
    `fp8`: the keys are e4m3 rows with an f32 scale each (`key_scales`, the fp8_132 record)."""
    if mode not in INDEXER_MODES:
        raise ValueError(f"mode={mode!r} is not one of {INDEXER_MODES}")
    per_block, nb, num_pages, visible = _indexer_inputs(shape, ratio, pool_bytes)
    entries = shape.context // ratio
    cap = CAND_BLOCKS * CAND_BLOCK if mode == "consumer" else None
    tile = indexer_tile(impl)
    req = np.repeat(np.arange(shape.batch, dtype=np.int32), shape.tokens // shape.batch)
    cost = summed_indexer_cost(
        visible, k=TOPK, per_block=per_block, cand_out=CAND_BLOCKS * (mode == "source"), cap=cap,
        token_req=req, tile=tile, fp8=fp8,
    )  # fmt: skip
    kw: dict[str, Any] = dict(entries_per_block=per_block, k=TOPK)
    if mode != "plain":
        kw |= dict(candidate_block_size=CAND_BLOCK, candidate_topk_blocks=CAND_BLOCKS)
    base = _indexer_make_args(shape, per_block, nb, num_pages, visible)

    def make_args(rng: np.random.Generator):
        args = base(rng)
        if fp8:  # the same keys as e4m3 rows with power-of-two scales
            keys = args[2]
            scales = jnp.exp2(jnp.round(jnp.log2(jnp.max(jnp.abs(keys), -1) / 448.0) + 0.5))
            rows = (keys / scales[..., None].astype(keys.dtype)).astype(jnp.float8_e4m3fn)
            args = (*args[:2], rows, *args[3:], scales.astype(jnp.float32))
        if mode != "consumer":
            return args
        nblocks = -(-entries // CAND_BLOCK)
        cb = min(CAND_BLOCKS, nblocks)
        cand = np.full((shape.tokens, CAND_BLOCKS), -1, np.int32)
        cand[:, :cb] = _spread(rng, shape.tokens, nblocks, cb)
        return (*args, jnp.asarray(cand))

    def run(*args):
        extra = {}
        if mode == "consumer":
            *args, extra["candidates"] = args
        if fp8:
            *args, extra["key_scales"] = args
        return indexer_topk(*args, **extra, **kw, impl=impl)

    scored = entries if cap is None else min(entries, cap)
    info = dict(mode=mode, ratio=ratio, entries_scored=scored, tokens_per_tile=tile,
                keys="fp8_132" if fp8 else "bf16")  # fmt: skip
    return Bench(cost, make_args, run, info=info)


def jnp_scores(qi, weights, ikey_pages, tables, token_req, visible, *, entries_per_block, group):
    """f32[T, N] weighted ReLU scores of every table entry (-inf at j >= visible), plain jnp:
    `group` tokens a step gather their keys through the block table and score them."""
    t = qi.shape[0]
    n = tables.shape[1] * entries_per_block
    pad = -t % group

    def grouped(x):
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(-1, group, *x.shape[1:])

    def step(xs):
        q, w, req, vis = xs
        keys = ikey_pages[tables[req]].reshape(group, n, -1)
        dots = jnp.einsum("ghd,gnd->ghn", q, keys, preferred_element_type=jnp.float32)
        if q.dtype == jnp.float32:
            s = jnp.einsum("ghn,gh->gn", jax.nn.relu(dots), w)
        else:  # bf16 queries: the indexer's bf16 roundings (its kernels' same function)
            s = weighted_relu_sum(dots, w.astype(jnp.float32)[..., None], 1, bf16=True)
        return jnp.where(jnp.arange(n)[None, :] < vis[:, None], s, -jnp.inf)

    xs = tuple(grouped(x) for x in (qi, weights, token_req, visible))
    return jax.lax.map(step, xs).reshape(-1, n)[:t]


def indexer_scoring_bench(
    shape: Shape, impl: str | None, pool_bytes: float = POOL_BYTES, ratio: int = 1
) -> Bench:
    """Not a kernel: the indexer's scoring pass approximated in plain jnp (no selection), at the
    inputs of `indexer_bench(shape, ratio=ratio)`. Bytes / FLOPs: the indexer's cost model
    without outputs (what any scoring pass must read), so `hbm_roofline_pct` compares with it."""
    del impl  # plain jnp on every platform
    per_block, nb, num_pages, visible = _indexer_inputs(shape, ratio, pool_bytes)
    cost = summed_indexer_cost(visible, k=0, per_block=per_block, cand_out=0, cap=None)
    base = _indexer_make_args(shape, per_block, nb, num_pages, visible)
    per_token = nb * per_block * (INDEX_DIM * jnp.dtype(DTYPE).itemsize + INDEX_HEADS * 4 + 4)
    steps = -(-shape.tokens // max(1, int(SCORE_GROUP_BYTES // per_token)))
    group = -(-shape.tokens // steps)  # tokens per step, as even as the budget allows

    def make_args(rng: np.random.Generator):
        qi, weights, keys, tables, req, _pos, vis = base(rng)
        return qi, weights, keys, tables, req, vis

    run = functools.partial(jnp_scores, entries_per_block=per_block, group=group)
    info = dict(
        mode="scoring_jnp", ratio=ratio, entries_scored=shape.context // ratio, group=group,
        note="approximation of the indexer's scoring pass: plain jnp (gather + einsum + ReLU-"
        "weighted sum, no selection); it writes gathered keys and f32 dots to HBM",
    )  # fmt: skip
    return Bench(cost, make_args, run, info=info)


def compressor_bench(
    shape: Shape, impl: str | None, pool_bytes: float = POOL_BYTES, ratio: int = 1
) -> Bench:
    """Compressor of one kv source (latent 512, rope 64) at `ratio`: every token's row in, a
    record per closed group out at random pages (pages and ring donated, updated in place).

    f32 records on TPU (its compressor writes 32-bit records only), bf16 elsewhere; at ratio 2
    half the decode requests close a group from their ring row each step.
    """
    t, r = shape.tokens, shape.batch
    per_req = t // r
    per_block = COMP_BLOCK // ratio
    fdtype = jnp.float32 if resolve_impl(impl) == "tpu" else DTYPE
    fbytes = jnp.dtype(fdtype).itemsize
    num_pages = _pool_pages(per_block, pool_bytes, LATENT * fbytes)
    pos = _positions(shape)
    if ratio == 2 and shape.phase == "decode":
        pos = pos - np.arange(t) % 2
    req = np.repeat(np.arange(r, dtype=np.int32), per_req)
    closes = (pos + 1) % ratio == 0
    first = np.arange(t) % per_req == 0
    ring_reads = int(np.sum(closes & first)) if ratio == 2 else 0
    ring_writes = r * min(per_req, RING) if ratio == 2 else 0
    c = compressor_cost(t, LATENT, ratio=ratio, record_dtype=fdtype, ring_rows=0)
    ring_bytes = (ring_reads + ring_writes) * 2 * LATENT * 4
    cost = Cost(bytes_accessed=c["bytes"] + ring_bytes, flops=c["flops"])

    def make_args(rng: np.random.Generator):
        # each (request, page) that receives records gets its own random page
        entry = pos // ratio
        key = req.astype(np.int64) * (1 << 32) + entry // per_block
        uniq, inv = np.unique(key, return_inverse=True)
        pages = rng.choice(np.arange(1, num_pages), len(uniq), replace=len(uniq) >= num_pages)
        slot = np.where(closes, pages[inv] * per_block + entry % per_block, -1).astype(np.int32)
        width = LATENT * ratio
        kv = jax.random.normal(jax.random.key(7), (t, width), fdtype if ratio == 1 else jnp.float32)
        comp_pages = jax.random.normal(jax.random.key(8), (num_pages, per_block, LATENT), fdtype)
        qsl = np.arange(r + 1, dtype=np.int32) * per_req
        half = ROPE // 2
        inv_freq = jnp.asarray(1.0 / 160000.0 ** (np.arange(half) / half), jnp.float32)
        ring_block = ring = None
        if ratio == 2:
            ring_block = jnp.arange(1, r + 1, dtype=jnp.int32)
            ring = jax.random.normal(jax.random.key(9), (r + 1, RING, width), jnp.float32)
        return (kv, jnp.asarray(req), jnp.asarray(pos), jnp.asarray(qsl),
                jnp.ones((LATENT,), fdtype), inv_freq, jnp.asarray(slot), ring_block,
                comp_pages, ring)  # fmt: skip

    def run(*args):
        return compressor(*args, ratio=ratio, eps=NORM_EPS, impl=impl)

    donate = {8: 1, 9: 2} if ratio == 2 else {8: 1}
    info = dict(ratio=ratio, record_dtype=jnp.dtype(fdtype).name, records=int(closes.sum()))
    return Bench(cost, make_args, run, donate=donate, info=info)


BENCHES: dict[str, Callable[[Shape, str | None, float], Bench]] = {
    "window_attention": window_bench,
    "sparse_attention": sparse_bench,
    "indexer_r1": functools.partial(indexer_bench, ratio=1, mode="source"),
    "indexer_r2": functools.partial(indexer_bench, ratio=2, mode="plain"),
    "indexer_r1_consumer": functools.partial(indexer_bench, ratio=1, mode="consumer"),
    "indexer_r1_fp8": functools.partial(indexer_bench, ratio=1, mode="source", fp8=True),
    "indexer_r1_scoring_jnp": functools.partial(indexer_scoring_bench, ratio=1),
    "compressor_r1": functools.partial(compressor_bench, ratio=1),
    "compressor_r2": functools.partial(compressor_bench, ratio=2),
}
# scoring-only rows -> the indexer whose time they are compared with (same shapes and inputs)
SCORING_OF = {"indexer_r1_scoring_jnp": "indexer_r1"}


def _time(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    repeats: int,
    donate: dict[int, int] | None = None,
) -> float:
    """Median seconds of one call (compiled, warmed up, synchronised). Donated arguments are
    replaced by their outputs after each call."""
    donate = donate or {}
    jitted = jax.jit(fn, donate_argnums=tuple(donate))
    args_ = list(args)

    def call():
        out = jax.block_until_ready(jitted(*args_))
        for a, o in donate.items():
            args_[a] = out[o]

    call()
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(bench: Bench, shape: Shape, *, timed: bool, peak: float | None, repeats: int):
    """One JSON row: the cost model, plus time and roofline shares when timed."""
    row: dict[str, Any] = dataclasses.asdict(shape) | bench.cost.as_dict() | bench.info
    row |= dict(time_s=None, bytes_per_s=None, hbm_roofline_pct=None, tflops=None)
    if not timed:
        return row
    try:
        args = bench.make_args(np.random.default_rng(0))
        seconds = _time(bench.run, args, repeats, bench.donate)
    except Exception as e:  # keep the other shapes; say what failed
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        return row
    row["time_s"] = seconds
    row["bytes_per_s"] = bench.cost.bytes_accessed / seconds
    row["tflops"] = bench.cost.flops / seconds / 1e12
    if peak:
        row["hbm_roofline_pct"] = 100.0 * row["bytes_per_s"] / peak
    return row


def timing_order(shape_list: list[Shape]) -> list[int]:
    """The order rows are timed in, most telling first (what a time budget keeps): decode at
    the largest batch, then prefill, then the smaller batches, larger first."""
    big = max((s.batch for s in shape_list if s.phase == "decode"), default=0)

    def key(i: int):
        s = shape_list[i]
        rank = 0 if s.phase == "decode" and s.batch == big else 1 if s.phase == "prefill" else 2
        return rank, -s.batch, s.context

    return sorted(range(len(shape_list)), key=key)


def _compare_scoring(results: dict[str, list[dict[str, Any]]]) -> None:
    """Scoring-only rows: the indexer's time at the same shape and indexer / scoring."""
    for name, of in SCORING_OF.items():
        others = results.get(of)
        for k, row in enumerate(results.get(name, [])):
            ours = row["time_s"]
            theirs = others[k]["time_s"] if others else None
            row["indexer"] = of
            row["indexer_time_s"] = theirs
            row["indexer_over_scoring"] = theirs / ours if ours and theirs else None


def run_benchmark(
    kernels: list[str],
    *,
    quick: bool,
    impl: str | None,
    time_it: bool | None,
    repeats: int,
    pool_bytes: float = POOL_BYTES,
    budget_s: float | None = None,
    shape_list: list[Shape] | None = None,
):
    """The JSON-able result of the benchmark. With `budget_s`, each kernel may time rows for an
    equal share of what is left of it (unused time passes on); rows past that are reported
    untimed with `skipped`, as are scoring-only rows whose indexer row ran untimed."""
    device = jax.devices()[0]
    backend = jax.default_backend()
    timed = backend != "cpu" if time_it is None else time_it
    peak = PEAK_HBM.get(device.device_kind)
    if peak is None and backend == "tpu":
        peak = float(jax.experimental.pallas.tpu.get_tpu_info().mem_bw_bytes_per_second)
    shape_list = shapes(quick) if shape_list is None else shape_list
    deadline = None if budget_s is None else time.monotonic() + budget_s
    results = {}
    for i, name in enumerate(kernels):
        share_end = None
        if deadline is not None:
            now = time.monotonic()
            share_end = now + max(0.0, deadline - now) / (len(kernels) - i)
        partner = SCORING_OF.get(name)
        rows: list[dict[str, Any]] = [{}] * len(shape_list)
        for j in timing_order(shape_list):
            shape = shape_list[j]
            skip = None
            if timed and share_end is not None and time.monotonic() > share_end:
                skip = "time budget"
            elif timed and partner in results and results[partner][j]["time_s"] is None:
                skip = f"{partner} not timed"  # nothing to compare with
            bench = BENCHES[name](shape, impl, pool_bytes)
            rows[j] = measure(bench, shape, timed=timed and not skip, peak=peak, repeats=repeats)
            if skip:
                rows[j]["skipped"] = skip
        results[name] = rows
    _compare_scoring(results)
    return {
        "benchmark": "kernels",
        "backend": backend,
        "device": device.device_kind,
        "impl": resolve_impl(impl),
        "dtype": jnp.dtype(DTYPE).name,
        "timed": timed,
        "peak_hbm_bytes_per_s": peak,
        "budget_s": budget_s,
        "jax": jax.__version__,
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", default=",".join(BENCHES), help="comma-separated names")
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    parser.add_argument("--impl", default=None, choices=[None, *IMPLS])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--pool-mb", type=float, default=POOL_BYTES / 1e6, help="cache pool size")
    parser.add_argument(
        "--budget-s", type=float, default=None, help="stop timing rows after this (shared)"
    )
    timing = parser.add_mutually_exclusive_group()
    timing.add_argument("--time", dest="time_it", action="store_true", default=None)
    timing.add_argument("--no-time", dest="time_it", action="store_false")
    args = parser.parse_args(argv)
    kernels = [k for k in args.kernels.split(",") if k]
    unknown = sorted(set(kernels) - set(BENCHES))
    if unknown:
        parser.error(f"unknown kernels {unknown}; known: {sorted(BENCHES)}")
    result = run_benchmark(
        kernels,
        quick=args.quick,
        impl=args.impl,
        time_it=args.time_it,
        repeats=args.repeats,
        pool_bytes=args.pool_mb * 1e6,
        budget_s=args.budget_s,
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
