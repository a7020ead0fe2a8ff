"""Benchmarks (allocator replay against vLLM 0.32, the engine, decode scaling, kernels...), each
``python -m benchmarks.NAME`` printing one JSON line. Not installed with the package."""

from __future__ import annotations

import argparse


def batch_sizes(parser: argparse.ArgumentParser, text: str) -> tuple[int, ...]:
    """``--batches`` as ints >= 1 (``"1,8,32"``); a bad value ends in ``parser.error``."""
    try:
        batches = tuple(int(b) for b in text.split(",") if b)
    except ValueError:
        parser.error(f"--batches must be a comma list of ints, got {text!r}")
    if not batches or min(batches) < 1:
        parser.error(f"--batches must name batch sizes >= 1, got {text!r}")
    return batches
