"""Jitted ``dsv4.generate`` on ``tiny_v41``: compile time and steady-state decode throughput.

Prints one JSON line. Fields: docs/benchmarks.md#benchmarksgenerate_cpu.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks import batch_sizes, run_and_print, tiny_v41_header

DEFAULT_BATCHES = (1, 8)


def _timed(fn: Callable[[], Any]) -> float:
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def measure_batch(
    params: Any,
    cfg: Any,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    *,
    repeats: int = 3,
    seed: int = 0,
    generate: Callable[..., Any] | None = None,
) -> dict[str, Any]:
    """Timings of ``generate`` for one batch size (see the module docstring for each field).
    ``generate`` defaults to `dsv4.generation.generate` (tests pass a stand-in)."""
    import jax
    import jax.numpy as jnp

    if generate is None:
        from dsv4.generation import generate
    if new_tokens < 2:
        raise ValueError(f"new_tokens={new_tokens} must be >= 2 to time decode steps")
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    key = jax.random.PRNGKey(seed + batch)
    # ids 3.. (skip the byte tokenizer's specials); every row has the full prompt length
    prompt = jax.random.randint(key, (batch, prompt_len), 3, cfg.vocab_size, jnp.int32)

    def run(n: int) -> Any:
        return generate(params, cfg, prompt, n)

    first_s = _timed(lambda: run(new_tokens))
    warm_s = min(_timed(lambda: run(new_tokens)) for _ in range(repeats))
    _timed(lambda: run(1))  # compile the prefill-only variant
    prefill_s = min(_timed(lambda: run(1)) for _ in range(repeats))
    decode_s = warm_s - prefill_s
    steps = new_tokens - 1
    ok = decode_s > 0
    return {
        "batch": batch,
        "compile_s": round(max(first_s - warm_s, 0.0), 3),
        "first_call_s": round(first_s, 3),
        "warm_call_s": round(warm_s, 5),
        "prefill_s": round(prefill_s, 5),
        "decode_s": round(decode_s, 5),
        "decode_tokens_per_s": round(batch * steps / decode_s, 1) if ok else None,
        "ms_per_decode_step": round(1000 * decode_s / steps, 3) if ok else None,
        "end_to_end_tokens_per_s": round(batch * new_tokens / warm_s, 1),
    }


def run_benchmark(
    *,
    batches: Sequence[int] = DEFAULT_BATCHES,
    prompt_len: int = 32,
    new_tokens: int = 64,
    repeats: int = 3,
    seed: int = 0,
    generate: Callable[..., Any] | None = None,
) -> dict[str, Any]:
    """Build seeded ``tiny_v41`` params and measure every batch size: the dict ``main`` prints."""
    import jax

    from dsv4.config import tiny_v41
    from dsv4.params import init_params

    t0 = time.perf_counter()
    cfg = tiny_v41()
    if prompt_len < 1 or prompt_len + new_tokens > cfg.max_seq_len:
        raise ValueError(
            f"prompt_len={prompt_len} + new_tokens={new_tokens} must fit max_seq_len "
            f"{cfg.max_seq_len} (and prompt_len >= 1)"
        )
    params = init_params(cfg, jax.random.PRNGKey(seed))
    results = {
        f"batch_{b}": measure_batch(
            params, cfg, b, prompt_len, new_tokens, repeats=repeats, seed=seed, generate=generate
        )
        for b in batches
    }
    out: dict[str, Any] = {
        **tiny_v41_header("generate_cpu", cfg),
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "sampling": "greedy, no eos",
        "results": results,
    }
    b1, b8 = results.get("batch_1"), results.get("batch_8")
    if b1 and b8 and b1["decode_tokens_per_s"] and b8["decode_tokens_per_s"]:
        ratio = b8["decode_tokens_per_s"] / b1["decode_tokens_per_s"]
        out["decode_tokens_per_s_ratio_b8_over_b1"] = round(ratio, 3)
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default=",".join(map(str, DEFAULT_BATCHES)))
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="warm calls; the best one counts")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    batches = batch_sizes(ap, args.batches)
    flags = ("prompt_len", "new_tokens", "repeats", "seed")  # passed to run_benchmark as parsed
    return run_and_print(ap, run_benchmark, args, *flags, batches=batches)


if __name__ == "__main__":
    sys.exit(main())
