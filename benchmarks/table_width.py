"""What a wider block table costs a step: the engine's step program at the narrowest and the
widest table widths it compiles with ``table_buckets=(64,)``, for the same token bucket, on
``tiny_v41_trained`` (`LLM`'s defaults otherwise).

Prints one JSON line: per token bucket, ms per step at each width (the median of ``--repeats``
steps run back to back on the runner's own state, as the engine runs them) and wide over narrow.
It is the measurement behind `serving.runner.FULL_WIDTH_BLOCKS`.
Fields: docs/benchmarks.md#benchmarkstable_width.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Sequence

from benchmarks import at_least_one


def run(model: str, tokens: Sequence[int], narrow: int, repeats: int, **llm_args) -> dict:
    """Step times of ``model``'s engine at the widths of ``table_buckets=(narrow,)``."""
    import jax
    import numpy as np

    from dsv4.paged.batch import table_width_buckets
    from serving import LLM
    from serving.runner import _engine_step, run_step

    llm = LLM(model, table_buckets=(narrow,), **llm_args)
    runner = llm.engine.runner
    widths = table_width_buckets(
        runner.kv_cache_config, max_model_len=runner.max_model_len, table_buckets=(narrow,)
    )
    pair = {"narrow": widths[0], "wide": widths[-1]}
    results = {}
    for t in tokens:
        inputs = {name: runner.padding_inputs(t, w) for name, w in pair.items()}
        times: dict[str, list[float]] = {name: [] for name in pair}
        for _ in range(repeats + 3):  # interleaved, the first three not counted
            for name, x in inputs.items():
                t0 = time.perf_counter()
                jax.block_until_ready(run_step(_engine_step, runner, *x))
                times[name].append(time.perf_counter() - t0)
        ms = {name: round(1000 * float(np.median(v[3:])), 3) for name, v in times.items()}
        results[f"tokens_{t}"] = {**ms, "wide_over_narrow": round(ms["wide"] / ms["narrow"], 3)}
    return {
        "benchmark": "table_width",
        "model": model,
        "widths": {name: list(w) for name, w in pair.items()},
        "repeats": repeats,
        "results": results,
        "python": platform.python_version(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.table_width", description=__doc__)
    parser.add_argument("--model", default="tiny_v41_trained")
    parser.add_argument("--tokens", default="1,16", help="token buckets to time (1,16)")
    parser.add_argument("--narrow", type=int, default=64, help="the narrow width, blocks (64)")
    parser.add_argument("--repeats", type=int, default=50, help="timed steps per width (50)")
    args = parser.parse_args(argv)
    at_least_one(parser, args, "narrow", "repeats")
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        parser.error(f"--tokens {args.tokens!r}: comma-separated token buckets, e.g. 1,16")
    if not tokens or min(tokens) < 1:
        parser.error(f"--tokens {args.tokens!r}: each at least 1")
    print(json.dumps(run(args.model, tokens, args.narrow, args.repeats), sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
