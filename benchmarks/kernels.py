"""Attention-kernel benchmark at the released V4.1-Flash shapes: bytes moved and FLOPs from each
kernel's cost model, and on a real chip the measured time and share of the HBM roofline.

    python -m benchmarks.kernels            # every kernel, every shape; cost model only on CPU
    python -m benchmarks.kernels --quick    # a few shapes
    python -m benchmarks.kernels --kernels window_attention --impl gpu

Prints one JSON line: for each kernel a list of rows (decode: batch 1-128 x contexts 4k-1M; prefill
chunks), each with `bytes`, `flops`, and when timed `time_s`, `bytes_per_s`, `hbm_roofline_pct`,
`tflops`. A kernel plugs in with a function `(Shape, impl, pool_bytes) -> Bench` in `BENCHES`.

On a device the caches are random pools larger than the GPU's L2 (or the TPU's VMEM), with block
tables pointing at random pages, so every read goes to HBM as in serving; values do not matter.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _backend, sparse_attention, window_attention
from pallas_kernels.sparse_attention.cost import sparse_cost
from pallas_kernels.window_attention.cost import window_cost

# V4.1-Flash attention shapes (model_v41.md 1.1, v41_in_vllm.md 3)
HEADS, LATENT, WINDOW, TOPK = 64, 512, 128, 512
SWA_PAGE = 32  # window-cache page, tokens
COMP_BLOCK = 64  # raw tokens per compressed block (E = 64 / ratio entries)
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
    """What a kernel contributes for one shape: its cost and, for timing, inputs and a call."""

    cost: _backend.Cost
    make_args: Callable[[np.random.Generator], tuple[Any, ...]]
    run: Callable[..., Any]


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


def _pool_pages(rows_per_page: int, pool_bytes: float) -> int:
    """Pages of a random pool of about `pool_bytes`."""
    return int(pool_bytes // (rows_per_page * LATENT * jnp.dtype(DTYPE).itemsize)) + 1


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
        pages = jax.random.normal(jax.random.key(0), (num_pages, SWA_PAGE, LATENT), DTYPE)
        tables = rng.integers(1, num_pages, (r, nb), dtype=np.int32)
        q = jax.random.normal(jax.random.key(1), (t, HEADS, LATENT), DTYPE)
        req = np.repeat(np.arange(r, dtype=np.int32), t // r)
        sink = jnp.zeros((HEADS,), jnp.float32)
        return q, pages, jnp.asarray(tables), jnp.asarray(req), jnp.asarray(_positions(shape)), sink

    def run(*args):
        return window_attention(*args, window=WINDOW, scale=LATENT**-0.5, impl=impl)

    return Bench(cost, make_args, run)


def sparse_bench(
    shape: Shape, impl: str | None, pool_bytes: float = POOL_BYTES, ratio: int = 1
) -> Bench:
    """Sparse attention over 512 selected compressed entries, continuing a window state."""
    t, r = shape.tokens, shape.batch
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
        pages = jax.random.normal(jax.random.key(2), (num_pages, per_block, LATENT), DTYPE)
        tables = rng.integers(1, num_pages, (r, nbc), dtype=np.int32)
        q = jax.random.normal(jax.random.key(3), (t, HEADS, LATENT), DTYPE)
        req = np.repeat(np.arange(r, dtype=np.int32), t // r)
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
        args = (q, pages, jnp.asarray(tables), jnp.asarray(req), jnp.asarray(_positions(shape)))
        return (*args, jnp.asarray(topk), sink, state)

    def run(*args):
        *args, state = args
        return sparse_attention(
            *args, entries_per_block=per_block, scale=LATENT**-0.5, state=state, impl=impl
        )

    return Bench(cost, make_args, run)


BENCHES: dict[str, Callable[[Shape, str | None, float], Bench]] = {
    "window_attention": window_bench,
    "sparse_attention": sparse_bench,
}


def _time(fn: Callable[..., Any], args: tuple[Any, ...], repeats: int) -> float:
    """Median seconds of one call (compiled, warmed up, synchronised)."""
    jitted = jax.jit(fn)
    jax.block_until_ready(jitted(*args))
    jax.block_until_ready(jitted(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(jitted(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(bench: Bench, shape: Shape, *, timed: bool, peak: float | None, repeats: int):
    """One JSON row: the cost model, plus time and roofline shares when timed."""
    row: dict[str, Any] = dataclasses.asdict(shape) | bench.cost.as_dict()
    row |= dict(time_s=None, bytes_per_s=None, hbm_roofline_pct=None, tflops=None)
    if not timed:
        return row
    try:
        args = bench.make_args(np.random.default_rng(0))
        seconds = _time(bench.run, args, repeats)
    except Exception as e:  # keep the other shapes; say what failed
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        return row
    row["time_s"] = seconds
    row["bytes_per_s"] = bench.cost.bytes_accessed / seconds
    row["tflops"] = bench.cost.flops / seconds / 1e12
    if peak:
        row["hbm_roofline_pct"] = 100.0 * row["bytes_per_s"] / peak
    return row


def run_benchmark(
    kernels: list[str],
    *,
    quick: bool,
    impl: str | None,
    time_it: bool | None,
    repeats: int,
    pool_bytes: float = POOL_BYTES,
):
    """The JSON-able result of the benchmark."""
    device = jax.devices()[0]
    backend = jax.default_backend()
    timed = backend != "cpu" if time_it is None else time_it
    peak = PEAK_HBM.get(device.device_kind)
    if peak is None and backend == "tpu":
        peak = float(jax.experimental.pallas.tpu.get_tpu_info().mem_bw_bytes_per_second)
    results = {}
    for name in kernels:
        results[name] = [
            measure(
                BENCHES[name](shape, impl, pool_bytes),
                shape,
                timed=timed,
                peak=peak,
                repeats=repeats,
            )
            for shape in shapes(quick)
        ]
    return {
        "benchmark": "kernels",
        "backend": backend,
        "device": device.device_kind,
        "impl": _backend.resolve_impl(impl),
        "dtype": jnp.dtype(DTYPE).name,
        "timed": timed,
        "peak_hbm_bytes_per_s": peak,
        "jax": jax.__version__,
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", default=",".join(BENCHES), help="comma-separated names")
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    parser.add_argument("--impl", default=None, choices=[None, *_backend.IMPLS])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--pool-mb", type=float, default=POOL_BYTES / 1e6, help="cache pool size")
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
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
