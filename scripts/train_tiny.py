"""Train `tiny_v41_trained` on the Python standard library's source (`dsv4.train`, `dsv4.data`).

    .venv/bin/python scripts/train_tiny.py --out runs/tiny_v41_trained --steps 4000

writes orbax checkpoints under ``--out`` (rerunning the same command resumes from the newest one,
bit for bit), one JSON line of metrics per step to ``--out/metrics.jsonl``, and every
``--eval-every`` steps the held-out loss in bits per token (a token is a byte, plus one BOS and
one EOS per file). At the end it prints the held-out bits per byte next to ``xz -9``'s on the
same held-out bytes.

``--measure N`` instead times N jitted sparse steps after the compile, prints tokens/s and the
time ``--steps`` would take, and trains nothing that it keeps.
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import os
import time

import jax
import numpy as np

from dsv4 import data as D
from dsv4 import train as T
from dsv4.config import tiny_v41_trained


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="runs/tiny_v41_trained", help="checkpoints and metrics")
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--dense-steps", type=int, default=50, help="dense warm-up (indexer only)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--indexer-lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=250)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--eval-batches", type=int, default=16, help="held-out batches per eval")
    p.add_argument("--stop-after", type=int, default=None, help="end after this many steps")
    p.add_argument("--measure", type=int, default=0, help="only time this many steps")
    return p.parse_args(argv)


def _heldout_bits(state, cfg, tokens, tcfg, batches: int) -> float:
    nats = T.evaluate(
        state.params, cfg, tokens, seq_len=tcfg.seq_len, batch_size=tcfg.batch_size, batches=batches
    )
    return nats / math.log(2)


def _xz_bits_per_byte(split: D.Split) -> float:
    parts = []
    for rel in split.heldout:
        with open(os.path.join(split.root, rel), "rb") as f:
            parts.append(f.read())
    raw = b"".join(parts)
    return 8 * len(lzma.compress(raw, preset=9 | lzma.PRESET_EXTREME)) / len(raw)


def measure(cfg, tcfg, tokens, n: int) -> dict[str, float]:
    """Time ``n`` sparse steps after one compiling step."""
    state = T.init_state(cfg, tcfg)
    step = T.train_step(cfg, tcfg, dense=False)
    t0 = time.perf_counter()
    state, m = step(state, D.batch_at(tokens, 0, batch_size=tcfg.batch_size,
                                      window=tcfg.seq_len + 1, seed=tcfg.seed))  # fmt: skip
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    times = []
    for i in range(1, n + 1):
        batch = D.batch_at(tokens, i, batch_size=tcfg.batch_size, window=tcfg.seq_len + 1,
                           seed=tcfg.seed)  # fmt: skip
        t0 = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    step_s = float(np.median(times))
    return {
        "compile_s": compile_s,
        "step_s_median": step_s,
        "step_s_min": float(np.min(times)),
        "tokens_per_s": tcfg.tokens_per_step / step_s,
        "projected_s": step_s * tcfg.steps,
        "projected_tokens": tcfg.tokens_per_step * tcfg.steps,
        "lm_loss_last": float(m["lm_loss"]),
    }


def main(argv=None) -> None:
    a = _args(argv)
    cfg = tiny_v41_trained()
    tcfg = T.TrainConfig(
        steps=a.steps,
        batch_size=a.batch_size,
        seq_len=a.seq_len,
        dense_steps=a.dense_steps,
        learning_rate=a.lr,
        indexer_learning_rate=a.indexer_lr,
        warmup_steps=a.warmup,
        seed=a.seed,
    )
    split = D.split_files(D.source_files(), root=D.stdlib_root())
    train_tokens = D.load_split(split, "train")
    heldout = D.load_split(split, "heldout")
    print(
        f"data: {len(split.train)} train files ({len(train_tokens):,} tokens), "
        f"{len(split.heldout)} held-out files ({len(heldout):,} tokens) from {split.root}"
    )
    if a.measure:
        print(json.dumps(measure(cfg, tcfg, train_tokens, a.measure)))
        return
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "metrics.jsonl"), "a", encoding="utf-8") as log_file:

        def log(row):
            log_file.write(json.dumps(row) + "\n")
            log_file.flush()

        state = None
        last = T.latest_checkpoint(a.out)
        if last is not None:
            state = T.restore_state(last, cfg, tcfg)
            print(f"resuming from {last}")
        done = 0 if state is None else int(state.step)
        end = tcfg.steps if a.stop_after is None else min(tcfg.steps, done + a.stop_after)
        while done < end:
            chunk = min(a.eval_every, end - done)
            state, _ = T.train(
                cfg, tcfg, train_tokens, state=state, checkpoint_dir=a.out,
                checkpoint_every=a.checkpoint_every, stop_after=chunk, log=log,
            )  # fmt: skip
            done = int(state.step)
            bits = _heldout_bits(state, cfg, heldout, tcfg, a.eval_batches)
            log({"step": done, "heldout_bits_per_token": bits})
            print(f"step {done}: held-out {bits:.3f} bits per token ({a.eval_batches} batches)")
    if state is not None and int(state.step) == tcfg.steps:
        bits = _heldout_bits(state, cfg, heldout, tcfg, batches=1 << 30)
        print(
            f"held-out, all of it: {bits:.3f} bits per token; xz -9: "
            f"{_xz_bits_per_byte(split):.3f} bits per byte"
        )


if __name__ == "__main__":
    main()
