"""Randomised decision-equality search: the same ``serving.scheduler.Scheduler`` over ours and over
vLLM 0.32's manager, on small random chat workloads, pools, budgets and Scheduler arguments.
Prints one line per differing case (layout, pool scale, workload seed, loop config, first
differing decision-log entry) and a final count.

    PYTHONHASHSEED=0 /tmp/vllm-venv/bin/python -m benchmarks.compare_vllm --seed 1 --seconds 300
"""

from __future__ import annotations

import argparse
import random
import time

from benchmarks import allocator
from benchmarks.adapters import MANAGER_KINDS, make_manager
from benchmarks.workload import LoopConfig, first_difference, make_chat_workload, run_loop


def _layout(name: str, scale: float):
    from cache import layout as L

    if name.startswith("tiny"):
        desc = L.tiny_v41_desc(swa_bounded_replay=name == "tiny_replay")
        return L.for_model(desc, num_gpu_blocks_override=max(64, int(20000 * scale)))
    return allocator.make_layout(name, scale=scale)


LAYOUTS = (*allocator.ALL_LAYOUTS, "tiny", "tiny_replay")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=300)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    t_end = time.time() + args.seconds
    runs = diffs = 0
    while time.time() < t_end:
        seed, name = rng.randrange(10**6), rng.choice(LAYOUTS)
        scale = rng.choice([0.02, 0.03, 0.05, 0.1, 0.2])
        wl = make_chat_workload(
            seed,
            num_system_prompts=rng.randint(1, 4),
            num_conversations=rng.randint(4, 30),
            system_len=(64, 1024),
            turns=(1, 4),
            user_len=(1, 300),
            output_len=(1, 80),
        )
        cfg = LoopConfig(
            max_num_batched_tokens=rng.choice([64, 256, 2048]),
            max_num_seqs=rng.choice([4, 16, 64]),
            num_lookahead_tokens=rng.choice([0, 3]),
            full_sequence_must_fit=rng.random() < 0.7,
        )
        kv = _layout(name, scale)
        logs = []
        try:
            for kind in MANAGER_KINDS:
                manager = make_manager(
                    kind, kv, cfg.max_model_len, max_num_batched_tokens=cfg.max_num_batched_tokens
                )
                logs.append(run_loop(wl, manager, cfg, name=kind, record_log=True).log)
        except RuntimeError as e:
            if "too small" in str(e):
                continue
            raise
        runs += 1
        d = first_difference(*logs)
        if d is not None:
            diffs += 1
            print("DIFF", name, scale, seed, cfg, d, flush=True)
    print(f"runs {runs} differing {diffs}")
    return 1 if diffs else 0


if __name__ == "__main__":
    raise SystemExit(main())
