"""What keeping the released fp8 / FP4 weights on device saves, and what dequantising costs.

Prints one JSON line (``--time`` adds decode speed on tiny_v41).
Fields: docs/benchmarks.md#benchmarksqweights.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsv4 import qweights
from dsv4.config import ModelConfig, tiny_v41, v41_flash
from dsv4.params import Storage, param_specs


def byte_report(cfg: ModelConfig) -> dict[str, Any]:
    """Bytes on device of ``cfg``'s params (Engram tables apart), released and dequantised."""
    specs = param_specs(cfg)
    tables = [n for n, s in specs.items() if s.storage is Storage.FP8_ROWS]
    on_device = [n for n in specs if n not in tables]
    abstract = qweights.abstract_released_params(cfg, jnp.bfloat16)
    released = qweights.param_bytes({n: abstract[n] for n in on_device})
    wide = (Storage.F32, Storage.DERIVED)  # stay 4-byte (the token map is int32)
    floats = sum(
        math.prod(specs[n].shape) * (4 if specs[n].storage in wide else 2) for n in on_device
    )
    ckpt = qweights.checkpoint_bytes(cfg, on_device)
    return {
        "checkpoint": ckpt,
        "released": released,
        "dequantised_bf16": floats,
        "released_over_checkpoint": round(released / ckpt, 6),
        "dequantised_over_checkpoint": round(floats / ckpt, 3),
        "host_tables_checkpoint": qweights.checkpoint_bytes(cfg, tables),
    }


def decode_timing(batch: int, prompt_len: int, new: int, repeats: int) -> dict[str, Any]:
    from dsv4 import generate
    from dsv4.params import init_params

    cfg = tiny_v41()
    released = qweights.quantise_params(init_params(cfg, jax.random.PRNGKey(0)), cfg)
    forms = {"dequantised": qweights.dequantise_params(released), "released": released}
    prompt = jnp.asarray(np.random.default_rng(0).integers(3, 260, (batch, prompt_len)), jnp.int32)
    best = dict.fromkeys(forms, math.inf)
    tokens = {}
    for name, params in forms.items():  # compile
        tokens[name] = np.asarray(generate(params, cfg, prompt, new))
    for _ in range(repeats):
        for name, params in forms.items():
            start = time.perf_counter()
            jax.block_until_ready(generate(params, cfg, prompt, new))
            best[name] = min(best[name], time.perf_counter() - start)
    ms = {n: round(1e3 * t / new, 3) for n, t in best.items()}
    return {
        "config": "tiny_v41",
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new,
        "ms_per_token": ms,
        "released_over_dequantised": round(best["released"] / best["dequantised"], 3),
        "same_tokens": bool(np.array_equal(tokens["released"], tokens["dequantised"])),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--time", action="store_true", help="also time decoding on tiny_v41")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    out: dict[str, Any] = {
        "bytes": {"v41_flash": byte_report(v41_flash()), "tiny_v41": byte_report(tiny_v41())},
        "backend": jax.default_backend(),
        "machine": platform.machine(),
    }
    if args.time:
        out["decode"] = decode_timing(args.batch, args.prompt_len, args.new, args.repeats)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
