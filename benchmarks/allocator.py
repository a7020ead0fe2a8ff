"""Host-side allocator benchmark: replay a multi-turn chat workload through
``serving.scheduler.Scheduler`` over ``cache.KVCacheManager`` (``--vllm``: vLLM 0.32's manager too,
side by side). Prints one JSON line: microseconds per allocator call, steps/s and hit rate.

Usage, fields, layouts and the vLLM environment's recipe: docs/benchmarks.md#benchmarksallocator.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks.adapters import make_manager, vllm_available
from benchmarks.workload import (
    ChatWorkload,
    LoopConfig,
    LoopResult,
    first_difference,
    make_chat_workload,
    run_loop,
)

MAX_MODEL_LEN = 16384
MAX_NUM_BATCHED_TOKENS = 2048
MAX_NUM_SEQS = 64
LOOKAHEAD = 3
DEFAULT_LAYOUTS = ("full", "swa_full", "v41")
ALL_LAYOUTS = (*DEFAULT_LAYOUTS, "v41_replay")
METRICS = (
    "us_per_allocate_slots",
    "us_per_get_computed_blocks",
    "us_per_free",
    "us_per_hashed_token",
    "steps_per_s",
    "prefix_hit_rate",
)


def make_layout(name: str, *, scale: float = 1.0) -> Any:
    """Our ``KVCacheConfig`` for a named layout; ``scale`` shrinks the pool with the workload."""
    from cache import layout as L
    from cache import spec as S

    def blocks(n: int) -> int:
        return max(64, int(n * scale))

    def full(bs: int) -> Any:
        return S.FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=64, dtype="bfloat16")

    if name == "full":
        return S.KVCacheConfig(
            num_blocks=blocks(12000),
            kv_cache_tensors=[],
            kv_cache_groups=[S.KVCacheGroupSpec(["layers.0"], full(16))],
        )
    if name == "swa_full":
        swa = S.SlidingWindowSpec(
            block_size=16, num_kv_heads=1, head_size=64, dtype="bfloat16", sliding_window=1024
        )
        return S.KVCacheConfig(
            num_blocks=blocks(12000),
            kv_cache_tensors=[],
            kv_cache_groups=[
                S.KVCacheGroupSpec(["layers.0"], full(16)),
                S.KVCacheGroupSpec(["layers.1"], swa),
            ],
        )
    if name in ("v41", "v41_replay"):
        desc = L.v41_flash_desc(swa_bounded_replay=name == "v41_replay")
        return L.for_model(desc, num_gpu_blocks_override=max(800, int(4000 * scale)))
    raise ValueError(f"unknown layout {name!r}; choose from {ALL_LAYOUTS}")


def make_workload(quick: bool, seed: int) -> tuple[ChatWorkload, float]:
    """The chat workload and the pool scale that goes with it."""
    if quick:
        wl = make_chat_workload(
            seed,
            num_system_prompts=3,
            num_conversations=12,
            system_len=(256, 768),
            turns=(1, 3),
            user_len=(16, 256),
            output_len=(8, 64),
        )
        return wl, 0.03
    return make_chat_workload(seed), 1.0


ManagerFactory = Callable[[], Any]


def _factory(kind: str, kv_cache_config: Any) -> ManagerFactory:
    return lambda: make_manager(
        kind, kv_cache_config, MAX_MODEL_LEN, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS
    )


def _loop_config(lookahead: int) -> LoopConfig:
    return LoopConfig(
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_num_seqs=MAX_NUM_SEQS,
        max_model_len=MAX_MODEL_LEN,
        num_lookahead_tokens=lookahead,
    )


def _best(results: list[LoopResult]) -> dict[str, float]:
    """Per metric the best run (min time, max rate); hit rate is deterministic."""
    ms = [r.metrics() for r in results]
    out = {}
    for k in METRICS:
        vals = [m[k] for m in ms]
        out[k] = max(vals) if k == "steps_per_s" else min(vals)
    out["prefix_hit_rate"] = ms[0]["prefix_hit_rate"]
    return out


def run_benchmark(
    *,
    quick: bool = False,
    layouts: tuple[str, ...] = DEFAULT_LAYOUTS,
    lookaheads: tuple[int, ...] = (0, LOOKAHEAD),
    with_vllm: bool = False,
    repeats: int = 1,
    seed: int = 0,
    keep_logs: bool = False,
) -> dict[str, Any]:
    """Run the benchmark and return the result dict (what ``main`` prints as JSON)."""
    t0 = time.perf_counter()
    wl, scale = make_workload(quick, seed)
    out = _header(wl, quick, seed, with_vllm)
    for layout in layouts:
        kv_cfg = make_layout(layout, scale=scale)
        for la in lookaheads:
            out["results"][f"{layout}/lookahead{la}"] = _measure(
                wl, kv_cfg, la, with_vllm=with_vllm, repeats=repeats, keep_logs=keep_logs
            )
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    return out


def _header(wl: ChatWorkload, quick: bool, seed: int, with_vllm: bool) -> dict[str, Any]:
    """The result dict before any run: the workload, the loop's limits, the versions."""
    out: dict[str, Any] = {
        "benchmark": "allocator",
        "quick": quick,
        "seed": seed,
        "workload": wl.summary(),
        "loop": {
            "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
            "max_num_seqs": MAX_NUM_SEQS,
            "max_model_len": MAX_MODEL_LEN,
            "full_sequence_must_fit": True,
            "first_alloc_lookahead": True,
        },
        "python": platform.python_version(),
        "results": {},
    }
    if with_vllm:
        import vllm  # reason: optional, only with --with-vllm

        out["vllm_version"] = getattr(vllm, "__version__", "?")
        out["pythonhashseed"] = os.environ.get("PYTHONHASHSEED")
    return out


def _measure(
    wl: ChatWorkload, kv_cfg, lookahead: int, *, with_vllm: bool, repeats: int, keep_logs: bool
) -> dict[str, Any]:
    """One layout and lookahead: best timings and counts of ours (and vLLM's), compared."""
    cfg = _loop_config(lookahead)
    entry: dict[str, Any] = {"num_blocks": kv_cfg.num_blocks}
    kinds = ("ours", "vllm") if with_vllm else ("ours",)
    factories = {k: _factory(k, kv_cfg) for k in kinds}
    # Logged runs (decision equality) are kept out of the timings.
    logged = (
        {k: run_loop(wl, factories[k](), cfg, name=k, record_log=True) for k in kinds}
        if with_vllm or keep_logs
        else {}
    )
    timed: dict[str, list[LoopResult]] = {k: [] for k in kinds}
    for _ in range(repeats):
        for k in kinds:  # alternate ours / vLLM
            timed[k].append(run_loop(wl, factories[k](), cfg, name=k))
    for k in kinds:
        entry[k] = _best(timed[k])
        entry[k + "_counts"] = (logged.get(k) or timed[k][0]).counts()
    if with_vllm:
        _compare(entry, logged["ours"], logged["vllm"])
    if keep_logs:
        entry["_logs"] = {k: logged[k].log for k in kinds}
    return entry


def _compare(entry: dict[str, Any], ours_log: LoopResult, vllm_log: LoopResult) -> None:
    """Add vLLM-over-ours ratios and where the two runs' decisions first differ to ``entry``."""
    ours, theirs = entry["ours"], entry["vllm"]
    entry["ratio_vllm_over_ours"] = {
        m: round(theirs[m] / ours[m], 3) if ours[m] else None for m in METRICS
    }
    # steps/s is a rate: invert so that > 1 still means "ours is faster".
    if ours["steps_per_s"] and theirs["steps_per_s"]:
        entry["ratio_vllm_over_ours"]["steps_per_s"] = round(
            ours["steps_per_s"] / theirs["steps_per_s"], 3
        )
    diff = first_difference(ours_log.log, vllm_log.log)
    entry["decisions_identical"] = diff is None
    raw = [(a, b) for a, b in zip(ours_log.raw_hits, vllm_log.raw_hits, strict=False) if a != b]
    # Raw get_computed_blocks hit lengths that differ before the scheduler-side
    # bounded-replay drop (ours drops hits <= window inside the call).
    entry["raw_hit_differences"] = len(raw)
    if raw:
        entry["first_raw_hit_difference"] = {"ours": raw[0][0], "vllm": raw[0][1]}
    entry["log_entries"] = len(ours_log.log)
    if diff is not None:
        entry["first_difference"] = {"index": diff["index"], "ours": diff["a"], "vllm": diff["b"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small workload (for tests)")
    ap.add_argument("--vllm", action="store_true", help="also run vLLM 0.32's manager")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per manager")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--layouts", default=",".join(DEFAULT_LAYOUTS), help=f"comma list of {ALL_LAYOUTS}"
    )
    ap.add_argument("--lookaheads", default=f"0,{LOOKAHEAD}")
    args = ap.parse_args(argv)
    if args.vllm and not vllm_available():
        print(json.dumps({"error": "vllm is not importable in this interpreter"}))
        return 2
    repeats = args.repeats if args.repeats is not None else 2
    res = run_benchmark(
        quick=args.quick,
        layouts=tuple(s for s in args.layouts.split(",") if s),
        lookaheads=tuple(int(x) for x in args.lookaheads.split(",") if x),
        with_vllm=args.vllm,
        repeats=repeats,
        seed=args.seed,
    )
    print(json.dumps(res, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
