"""Train `tiny_v41_trained` on the Python standard library's source (`training.train`, `training.data`).

    python scripts/train_tiny.py --out runs/tiny_v41_trained --export dsv4/weights/tiny_v41_trained

with the defaults is the run that made the shipped checkpoint (``--cpu-hour``: the narrower CPU
version; ``--measure N``: time N steps). What it writes, resumes and exports:
docs/trained_model.md#scriptstrain_tinypy.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import jax
import numpy as np

from dsv4.config import tiny_v41_trained
from dsv4.tokenizer import HFTokenizer
from lab.quality import heldout_score
from training import data as D
from training import dspark as TD
from training import train as T

# --cpu-hour: the widths of the first tiny_v41_trained, and the run that trained it on two CPU
# cores in 61 minutes (with its drafter, 72)
CPU_HOUR_WIDTHS = {"dim": 64, "moe_inter_dim": 64, "q_lora_rank": 32, "o_lora_rank": 32}
_RUNS = {  # flag defaults: the shipped run, and --cpu-hour's
    False: {"steps": 1900, "batch_size": 64, "seq_len": 1024, "warmup": 200, "eval_every": 380,
            "drafter_steps": 1500},
    True: {"steps": 3200, "batch_size": 8, "seq_len": 256, "warmup": 100, "eval_every": 500,
           "drafter_steps": 600},
}  # fmt: skip


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="runs/tiny_v41_trained", help="checkpoints and metrics")
    p.add_argument(
        "--cpu-hour", action="store_true", help="the narrower model that trains in an hour on a CPU"
    )
    p.add_argument("--steps", type=int, default=None, help="default 1900 (--cpu-hour: 3200)")
    p.add_argument("--batch-size", type=int, default=None, help="default 64 (--cpu-hour: 8)")
    p.add_argument("--seq-len", type=int, default=None, help="default 1024 (--cpu-hour: 256)")
    p.add_argument("--dense-steps", type=int, default=50, help="dense warm-up (indexer only)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--indexer-lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=None, help="default 200 (--cpu-hour: 100)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=250)
    p.add_argument("--eval-every", type=int, default=None, help="default 380 (--cpu-hour: 500)")
    p.add_argument("--eval-batches", type=int, default=16, help="held-out batches per eval")
    p.add_argument("--stop-after", type=int, default=None, help="end after this many steps")
    p.add_argument("--measure", type=int, default=0, help="only time this many steps")
    p.add_argument(
        "--data-root", default=None, help="the source tree (default: this interpreter's stdlib)"
    )
    p.add_argument("--export", default=None, help="write the released-format checkpoint here")
    p.add_argument(
        "--drafter-steps",
        type=int,
        default=None,
        help="then train the DSpark drafter this long over the frozen backbone (0: none; "
        "default 1500, --cpu-hour: 600)",
    )
    a = p.parse_args(argv)
    for name, value in _RUNS[a.cpu_hour].items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    return a


def _heldout_bits(state, cfg, tokens, tcfg, batches: int) -> float:
    nats = T.evaluate(
        state.params, cfg, tokens, seq_len=tcfg.seq_len, batch_size=tcfg.batch_size, batches=batches
    )
    return nats / math.log(2)


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


def tokenizer_for(out: str, split: D.Split, vocab_size: int) -> HFTokenizer:
    """``out/tokenizer.json``, trained by `training.data.train_bpe` when it is not there yet."""
    path = os.path.join(out, "tokenizer.json")
    if not os.path.isfile(path):
        os.makedirs(out, exist_ok=True)
        D.train_bpe(split, vocab_size, path)
    return HFTokenizer.from_file(path, bos_id=0, eos_id=1)


def export(params, cfg, out: str, tokenizer_json: str) -> None:
    """The released format (`dsv4.save_pretrained`: fp8 tiles, packed FP4 experts, config.json)
    plus the tokenizer.json and a tokenizer_config.json naming its BOS / EOS."""
    import shutil

    from dsv4.checkpoint import save_pretrained

    save_pretrained(params, cfg, out)
    shutil.copyfile(tokenizer_json, os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        names = D.BPE_SPECIAL_TOKENS
        json.dump({"bos_token": names[0], "eos_token": names[1], "pad_token": names[2]}, f)
        f.write("\n")


def main(argv=None) -> None:
    a = _args(argv)
    widths = CPU_HOUR_WIDTHS if a.cpu_hour else {}
    cfg = tiny_v41_trained(drafter=False, **widths)  # the drafter trains afterwards, over this
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
    split = D.source_split(a.data_root)
    tok = tokenizer_for(a.out, split, cfg.vocab_size)
    train_tokens = D.load_split(split, "train", tok)
    heldout = D.load_split(split, "heldout", tok)
    heldout_bytes = D.split_bytes(split, "heldout", tok)
    per_byte = len(heldout) / heldout_bytes  # tokens per byte: bits/token -> bits/byte
    print(
        f"data: {len(split.train)} train files ({len(train_tokens):,} tokens), "
        f"{len(split.heldout)} held-out files ({len(heldout):,} tokens, {heldout_bytes:,} bytes) "
        f"from {split.root}"
    )
    if a.measure:
        print(json.dumps(measure(cfg, tcfg, train_tokens, a.measure)))
        return
    state = _train_backbone(a, cfg, tcfg, train_tokens, heldout, per_byte)
    if state is None or int(state.step) != tcfg.steps:
        return
    final_path = os.path.join(a.out, "final.json")
    if os.path.isfile(final_path):  # a rerun after the backbone finished: scored already
        with open(final_path, encoding="utf-8") as f:
            row = json.load(f)
    else:  # every held-out window at the trained length and at the longest, xz alike
        row = {"step": tcfg.steps, **heldout_score(state.params, cfg, tok, root=a.data_root)}
    params, out_cfg = state.params, cfg
    if a.drafter_steps:
        params, out_cfg = _train_drafter(a, params, widths, train_tokens, heldout, row)
    with open(final_path, "w", encoding="utf-8") as f:
        json.dump(row, f)
    print(json.dumps(row))
    if a.export:
        export(params, out_cfg, a.export, os.path.join(a.out, "tokenizer.json"))
        print(f"wrote {a.export}")


def _train_backbone(a, cfg, tcfg, train_tokens, heldout, per_byte):
    """Train (or resume) the backbone in chunks of ``--eval-every`` steps, logging held-out
    bits after each; returns the last train state (None when there was nothing to do)."""
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
            log(
                {
                    "step": done,
                    "heldout_bits_per_token": bits,
                    "heldout_bits_per_byte": bits * per_byte,
                }
            )
            print(f"step {done}: held-out {bits:.3f} bits per token, {bits * per_byte:.3f} per byte "
                  f"({a.eval_batches} batches)")  # fmt: skip
    return state


def _train_drafter(a, params, widths, train_tokens, heldout, row):
    """Train the DSpark drafter over the frozen backbone ``params``, its held-out acceptance
    before and after into ``row``; returns the parameters with the drafter and their config."""
    full = tiny_v41_trained(**widths)
    dcfg = TD.DraftTrainConfig(steps=a.drafter_steps, seed=a.seed)
    before = TD.init_draft_state(full, dcfg, params).params
    row["drafter_untrained"] = TD.acceptance({**params, **before}, full, heldout)
    drafter_log = os.path.join(a.out, "drafter_metrics.jsonl")
    with open(drafter_log, "w", encoding="utf-8") as f:  # a fresh run each time
        dstate, _ = TD.train_drafter(
            params, full, dcfg, train_tokens, log=lambda r: f.write(json.dumps(r) + "\n")
        )
    params = {**params, **dstate.params}
    row["drafter_steps"] = a.drafter_steps
    row["drafter"] = TD.acceptance(params, full, heldout)
    return params, full


if __name__ == "__main__":
    main()
