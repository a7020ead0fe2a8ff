"""The lab's own speed, and its table of the V4.1 layouts on the default workloads.

Prints one JSON line (``--table``: the layout table of docs/lab.md, then its JSON).
Usage and fields: docs/benchmarks.md#benchmarkslab.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import lab
from lab import experiment as X
from lab.drive import ModelFreeBackend, drive

TABLE_GIB = (16.0, 0.5)  # a roomy pool and one under pressure
_TABLE_FIELDS = (
    ("prefix_hit_rate", "hit rate", "{:.3f}"),
    ("recomputed_tokens", "recomputed", "{:,}"),
    ("preemptions", "preempt.", "{}"),
    ("peak_kv_bytes_total", "peak KV GiB", "{:.2f}"),
    ("max_running", "max running", "{}"),
    ("shortest_hit_prompt", "shortest hit", "{}"),
    ("modelled_output_tokens_per_s", "model tok/s", "{:,.0f}"),
)


def speed(
    requests: int,
    max_steps: int | None,
    sweep_points: int,
    sweep_conversations: int,
    seed: int,
    sweep_workers: int = 1,
) -> dict:
    conversations = max(1, requests // 3)
    wl = lab.make_workload(
        "chat",
        seed,
        num_system_prompts=64,
        num_conversations=conversations,
        system_len=(256, 1024),
        turns=(1, 5),
        user_len=(16, 256),
        output_len=(8, 64),
    )
    cfg = lab.LabConfig(pool_blocks=8000, max_model_len=8192)
    # the Scheduler and the allocator alone (the lab's loop, no metering)
    manager = X.make_manager(lab.build_layout(cfg), cfg)
    t0 = time.perf_counter()
    plain = drive(wl, ModelFreeBackend(X.make_scheduler(manager, cfg)), max_steps=max_steps)
    plain_wall = time.perf_counter() - t0
    # a whole lab run: the same plus KV bytes per group, the cost model and TTFT every step
    t0 = time.perf_counter()
    row = lab.run(wl, cfg, max_steps=max_steps)
    wall = time.perf_counter() - t0
    out = {
        "requests": wl.num_turns,
        "steps": plain.steps,
        "finished_turns": plain.finished_turns,
        "scheduler_allocator_steps_per_s": round(plain.steps / plain_wall, 1),
        "lab_run_steps_per_s": round(row["steps"] / wall, 1),
        "lab_run_wall_s": round(wall, 2),
        "prefix_hit_rate": round(row["prefix_hit_rate"], 4),
    }
    base_wl = lab.make_workload("chat", seed, num_conversations=sweep_conversations)
    pools = [1000 + 500 * i for i in range(sweep_points)]
    t0 = time.perf_counter()
    rows = lab.sweep(
        base_wl,
        lab.LabConfig(pool_blocks=pools[0]),
        knob="pool_blocks",
        values=pools,
        workers=sweep_workers,
    )
    sweep_wall = time.perf_counter() - t0
    out["sweep"] = {
        "workload": base_wl.summary(),
        "points": len(rows),
        "workers": sweep_workers,
        "pool_blocks": pools,
        "wall_s": round(sweep_wall, 2),
        "steps": sum(r["steps"] for r in rows),
        "steps_per_s": round(sum(r["steps"] for r in rows) / sweep_wall, 1),
        "hit_rates": [round(r["prefix_hit_rate"], 4) for r in rows],
    }
    return out


def table(seed: int) -> tuple[list[dict], str]:
    rows = []
    for kind in sorted(lab.WORKLOADS):
        wl = lab.make_workload(kind, seed)
        base = lab.LabConfig(
            memory_gib=TABLE_GIB[0], max_model_len=131072 if kind == "long_context" else 65536
        )
        rows += lab.sweep(wl, base, layouts=list(lab.LAYOUTS), knob="memory_gib", values=TABLE_GIB)
    head = "| workload | KV GiB | layout | " + " | ".join(h for _, h, _ in _TABLE_FIELDS) + " |"
    lines = [head, "|" + "---|" * (3 + len(_TABLE_FIELDS))]
    rows.sort(key=lambda r: (r["workload"], -r["memory_gib"]))
    for r in rows:
        cells = []
        for field, _, fmt in _TABLE_FIELDS:
            v = r[field]
            if field == "peak_kv_bytes_total":
                v = v / 2**30
            cells.append("-" if v is None else fmt.format(v))
        lines.append(
            f"| {r['workload']} | {r['memory_gib']:g} | {r['layout']} | " + " | ".join(cells) + " |"
        )
    return rows, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--max-steps", type=int, default=3000, help="0: replay to the end")
    p.add_argument("--sweep-points", type=int, default=8)
    p.add_argument(
        "--sweep-conversations", type=int, default=200, help="of the sweep's chat workload"
    )
    p.add_argument(
        "--sweep-workers", type=int, default=1, help="processes running the sweep's points"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--table", action="store_true", help="the layout table instead")
    args = p.parse_args(argv)
    for flag, value, low in (
        ("--requests", args.requests, 1),
        ("--max-steps", args.max_steps, 0),
        ("--sweep-points", args.sweep_points, 1),
        ("--sweep-conversations", args.sweep_conversations, 1),
        ("--sweep-workers", args.sweep_workers, 1),
    ):
        if value < low:
            p.error(f"{flag} must be >= {low}, got {value}")
    t0 = time.perf_counter()
    if args.table:
        rows, md = table(args.seed)
        print(md)
        keep = ("workload", "memory_gib", "layout", *(f for f, _, _ in _TABLE_FIELDS))
        result = {"benchmark": "lab_table", "rows": [{k: r[k] for k in keep} for r in rows]}
    else:
        result = {
            "benchmark": "lab",
            **speed(
                args.requests,
                args.max_steps or None,
                args.sweep_points,
                args.sweep_conversations,
                args.seed,
                args.sweep_workers,
            ),
        }
    result["wall_s"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
