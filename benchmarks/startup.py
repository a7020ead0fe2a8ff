"""Start-up of `LLM("tiny_v41")`: a cold start and a second start of the same configuration,
each in a fresh process sharing one JAX persistent compilation cache directory.

Prints one JSON line: per start, seconds to a ready engine, warm-up seconds, compilations and
executables loaded from the cache. Usage: docs/benchmarks.md#benchmarksstartup.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence


def _child(args: argparse.Namespace) -> int:
    """One start, in this process: build the engine and report its warm-up."""
    t0 = time.perf_counter()
    from serving.llm import LLM

    buckets = tuple(int(b) for b in args.token_buckets.split(","))
    llm = LLM(
        "tiny_v41",
        dtype="float32",
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        token_buckets=buckets,
        num_gpu_blocks_override=256,
        compilation_cache_dir=args.cache_dir,
    )
    st = llm.engine.stats
    print(
        json.dumps(
            {
                "ready_s": round(time.perf_counter() - t0, 2),
                "warm_up_s": round(st.warm_up_s, 2),
                "warm_up_compilations": st.warm_up_compilations,
                "warm_up_cache_hits": st.warm_up_cache_hits,
            }
        )
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--token-buckets", default="16,64")
    parser.add_argument("--max-num-batched-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--cache-dir", default=None, help="default: a fresh temporary directory")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args)
    with tempfile.TemporaryDirectory() as tmp:
        cache_dir = args.cache_dir or tmp
        cmd = [sys.executable, "-m", "benchmarks.startup", "--child", "--cache-dir", cache_dir,
               "--token-buckets", args.token_buckets, "--max-num-seqs", str(args.max_num_seqs),
               "--max-num-batched-tokens", str(args.max_num_batched_tokens)]  # fmt: skip
        env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
        starts = []
        for _ in range(2):
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            if done.returncode:
                sys.stderr.write(done.stderr)
                return done.returncode
            starts.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(
        json.dumps(
            {
                "benchmark": "startup",
                "model": "tiny_v41",
                "token_buckets": args.token_buckets,
                "cold": starts[0],
                "second": starts[1],
                "second_start_compiles_nothing": starts[1]["warm_up_compilations"] == 0,
            },
            sort_keys=True,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
