"""What Engram costs: its share of a decode step, and the bytes and time of fetching its rows.

Usage::

    python -m benchmarks.engram
    python -m benchmarks.engram --batch 8 --repeats 5 --host-rows 1048576

It prints ONE JSON line:

* ``decode``: one decode step of `dsv4.model.forward_step` (dense caches, fp32, ``--batch``
  rows, after a ``--prompt-len``-token prefill) of ``tiny_v41_full`` (Engram on layers 1 and 4)
  and of the same model without Engram (``engram_layer_ids=()``, the same backbone params),
  measured in turn in every repeat (best mean over ``--calls`` calls); ``engram_share`` is
  ``1 - without / with``: the fraction of the step Engram takes (hashing, row lookup, ``wkv``,
  the gate);
* ``released_gather``: at V4.1-Flash's sizes (2 Engram layers, 24 rows of 256 values per token
  and layer), the bytes a token's rows take as stored (e4m3 values + one e8m0 scale per 32) and
  as they reach the model (bf16), per token and per decode step of ``--batch`` rows;
* ``host_gather``: the rows of one decode step of ``--batch`` rows (2 layers x 24 rows each)
  fetched from a `dsv4.formats.HostTable` over a memory-mapped table of ``--host-rows`` random
  rows of 256 values (a file in a temporary directory; random row ids, so mostly cache-missing
  reads from the page cache): ``numpy_us`` the host's part (index, dequantise to bf16) and
  ``jit_us`` the whole fetch inside a jitted function (``jax.pure_callback``: ids to the host,
  rows back), against ``device_take_us``, a ``jnp.take`` from a device table of the same size.
  A released table (~384M rows, 98 GB) is far larger than the page cache of most hosts: on one,
  expect the reads to come from storage.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any


def _best_mean(fn: Callable[[], Any], calls: int) -> float:
    import jax

    jax.block_until_ready(fn())
    t0 = time.perf_counter()
    for _ in range(calls):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / calls


def _decode_cases(batch: int, prompt_len: int) -> dict[str, Callable[[], Any]]:
    """One decode-step closure per model (with / without Engram), caches after the prompt."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dsv4 import model
    from dsv4.config import tiny_v41_full
    from dsv4.params import init_params

    full = tiny_v41_full()
    params = init_params(full, 0)
    plain = full.replace(engram_layer_ids=())
    plain_params = {k: v for k, v in params.items() if "engram" not in k}
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(3, 259, (batch, prompt_len)), jnp.int32)
    step = jax.jit(model.forward_step, static_argnums=1)
    cases = {}
    for name, cfg, p in (("with_engram", full, params), ("without_engram", plain, plain_params)):
        cache = model.init_cache(cfg, batch, prompt_len + 8)
        start = jnp.zeros(batch, jnp.int32)
        lengths = jnp.full(batch, prompt_len, jnp.int32)
        logits, cache = step(p, cfg, cache, prompt, start, lengths)
        token = jnp.argmax(logits[:, -1:], axis=-1).astype(jnp.int32)
        pos = jnp.full(batch, prompt_len, jnp.int32)
        ones = jnp.ones(batch, jnp.int32)

        def run(p=p, cfg=cfg, cache=cache, token=token, pos=pos, ones=ones):
            # the same position every call: the cache is not advanced (the step's cost does
            # not depend on it), only its outputs are waited for
            return step(p, cfg, cache, token, pos, ones)[0]

        cases[name] = run
    return cases


def _released_gather(batch: int) -> dict[str, Any]:
    from dsv4.config import v41_flash

    cfg = v41_flash()
    layers, cols, width = len(cfg.engram_layer_ids), cfg.engram_columns, cfg.engram_head_dim
    stored = layers * cols * (width + width // cfg.fp8_block_size)
    bf16 = layers * cols * width * 2
    return {
        "layers": layers,
        "rows_per_token_and_layer": cols,
        "row_values": width,
        "table_rows": list(cfg.engram_table_rows),
        "stored_bytes_per_token": stored,
        "bf16_bytes_per_token": bf16,
        "stored_bytes_per_step": stored * batch,
        "bf16_bytes_per_step": bf16 * batch,
    }


def _host_gather(batch: int, rows: int, calls: int, repeats: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dsv4.engram import table_rows
    from dsv4.formats import HostTable

    width, block, cols, layers = 256, 32, 24, 2
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        values = np.memmap(os.path.join(tmp, "v"), np.uint8, "w+", shape=(rows, width))
        scales = np.memmap(os.path.join(tmp, "s"), np.uint8, "w+", shape=(rows, width // block))
        chunk = 1 << 16
        for lo in range(0, rows, chunk):
            hi = min(rows, lo + chunk)
            # e4m3 bytes without the NaN codes (0x7F, 0xFF), scales around 2^0
            values[lo:hi] = rng.integers(0, 0x7F, (hi - lo, width), np.uint8) | (
                rng.integers(0, 2, (hi - lo, 1), np.uint8) << 7
            )
            scales[lo:hi] = rng.integers(120, 135, (hi - lo, width // block), np.uint8)
        values.flush()
        scales.flush()
        table = HostTable(
            np.memmap(values.filename, np.uint8, "r", shape=(rows, width)),
            np.memmap(scales.filename, np.uint8, "r", shape=(rows, width // block)),
            block,
        )
        ids = [jnp.asarray(rng.integers(0, rows, (batch, layers, cols)), jnp.int32)
               for _ in range(calls)]  # fmt: skip
        host_ids = [np.asarray(i) for i in ids]
        device_table = jnp.asarray(table.gather(np.arange(rows)))  # bf16 [rows, width]

        # both through engram.table_rows, the one place every path fetches rows
        host_params = {"layers.0.engram.embed.weight": table}
        device_params = {"layers.0.engram.embed.weight": device_table}
        jit_host = jax.jit(lambda i: table_rows(host_params, 0, i))
        jit_take = jax.jit(lambda p, i: table_rows(p, 0, i))
        best = {"numpy_us": float("inf"), "jit_us": float("inf"), "device_take_us": float("inf")}
        for _ in range(repeats):
            jit_host(ids[0]).block_until_ready()
            jit_take(device_params, ids[0]).block_until_ready()
            t0 = time.perf_counter()
            for i in host_ids:
                table.gather(i)
            best["numpy_us"] = min(best["numpy_us"], (time.perf_counter() - t0) / calls * 1e6)
            t0 = time.perf_counter()
            for i in ids:
                jit_host(i).block_until_ready()
            best["jit_us"] = min(best["jit_us"], (time.perf_counter() - t0) / calls * 1e6)
            t0 = time.perf_counter()
            for i in ids:
                jit_take(device_params, i).block_until_ready()
            best["device_take_us"] = min(
                best["device_take_us"], (time.perf_counter() - t0) / calls * 1e6
            )
    out = {k: round(v, 1) for k, v in best.items()}
    out.update(table_rows=rows, table_bytes=rows * (width + width // block),
               rows_per_step=batch * layers * cols)  # fmt: skip
    out["jit_over_device_take"] = round(best["jit_us"] / best["device_take_us"], 2)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import jax

    t0 = time.perf_counter()
    cases = _decode_cases(args.batch, args.prompt_len)
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(args.repeats):
        for name, fn in cases.items():
            best[name] = min(best[name], _best_mean(fn, args.calls))
    decode = {f"{k}_ms": round(v * 1e3, 3) for k, v in best.items()}
    decode["engram_share"] = round(1 - best["without_engram"] / best["with_engram"], 3)
    decode.update(batch=args.batch, prompt_len=args.prompt_len, model="tiny_v41_full")
    return {
        "benchmark": "engram",
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0]),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "decode": decode,
        "released_gather": _released_gather(args.batch),
        "host_gather": _host_gather(args.batch, args.host_rows, args.calls, args.repeats),
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--batch", type=_positive, default=8, help="decode rows (default 8)")
    parser.add_argument("--prompt-len", type=_positive, default=64, help="tokens before decode")
    parser.add_argument("--repeats", type=_positive, default=3, help="rounds; best is kept")
    parser.add_argument("--calls", type=_positive, default=20, help="calls per timing")
    parser.add_argument("--host-rows", type=_positive, default=1 << 20,
                        help="rows of the memory-mapped table (default 2**20: 264 MiB)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.prompt_len + 8 > 512:
        parser.error(f"--prompt-len {args.prompt_len}: at most 504 (tiny_v41's max_seq_len 512)")
    print(json.dumps(run(args), sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
