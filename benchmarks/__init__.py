"""Benchmarks (allocator replay against vLLM 0.32, the engine, decode scaling, kernels...), each
``python -m benchmarks.NAME`` printing one JSON line. Not installed with the package."""

from __future__ import annotations

import argparse
import json
import os
import platform
from collections.abc import Callable
from typing import Any


def batch_sizes(
    parser: argparse.ArgumentParser, text: str, flag: str = "--batches"
) -> tuple[int, ...]:
    """``flag``'s sizes as ints >= 1 (``"1,8,32"``); a bad value ends in ``parser.error``."""
    try:
        batches = tuple(int(b) for b in text.split(",") if b)
    except ValueError:
        parser.error(f"{flag} must be a comma list of ints, got {text!r}")
    if not batches or min(batches) < 1:
        parser.error(f"{flag} must name batch sizes >= 1, got {text!r}")
    return batches


def at_least_one(parser: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    """End in ``parser.error`` naming the first of the flags ``names`` (their ``dest``) below 1
    (one left unset, None, is not checked)."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} {value}: must be >= 1")


def run_and_print(
    parser: argparse.ArgumentParser,
    run: Callable[..., dict],
    args: argparse.Namespace,
    *names: str,
    **kwargs: Any,
) -> int:
    """Print ``run(**kwargs, name=args.name for each of names)`` as one sorted JSON line.

    A ``ValueError`` from ``run`` (a bad combination of flags) ends in ``parser.error``.
    """
    try:
        result = run(**kwargs, **{name: getattr(args, name) for name in names})
    except ValueError as exc:
        parser.error(str(exc))
    print(json.dumps(result, sort_keys=True))
    return 0


def tiny_v41_header(benchmark: str, cfg: Any) -> dict[str, Any]:
    """The first fields of an fp32 ``tiny_v41`` benchmark's line: what ran, and on what."""
    import jax  # reason: the package's helpers load without JAX (`--help`, the allocator)

    from dsv4.params import count_params

    return {
        "benchmark": benchmark,
        "model": "tiny_v41",
        "params": count_params(cfg),
        "dtype": "float32",
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0]),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }
