"""``dsv4 lab``: a model-free lab sweep from the command line.

Writes one results row per layout x value (JSONL and CSV), the plots and the workload, with a
progress bar; every flag, knob and sweep point is checked before anything runs (exit status 2
naming a bad one, nothing written). Flags: docs/lab.md#labcli.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import lab

__all__ = ["add_lab_command"]


def add_lab_command(sub, usage_error: type[Exception]) -> None:
    p = sub.add_parser("lab", help="cache-layout experiments: scheduler + allocator, no model")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--workload", default="chat", help="chat | agentic | rag | long_context")
    src.add_argument("--trace", help="a JSONL workload or trace file (lab.workloads)")
    p.add_argument("--seed", type=int, default=0, help="the workload's seed")
    p.add_argument(
        "--workload-arg",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="generator argument, e.g. num_conversations=50 or turns=1,3 (repeatable)",
    )
    p.add_argument("--layouts", default="v41", help="comma-separated layouts (lab.LAYOUTS)")
    p.add_argument("--sweep", help="knob=lo:hi:step or knob=a,b,c")
    p.add_argument(
        "--set", action="append", default=[], metavar="KNOB=VALUE", help="a knob (repeatable)"
    )
    p.add_argument("--out", required=True, help="directory for the table, plots and workload")
    p.add_argument("--no-plots", action="store_true", help="write the table only")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=lambda args: _lab(args, usage_error), subparser=p)


def _workload_args(items: list[str], usage_error) -> dict:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise usage_error(f"--workload-arg {item!r}: expected NAME=VALUE")
        try:
            parts = [int(v) for v in value.split(",")]
        except ValueError:
            raise usage_error(f"--workload-arg {item!r}: VALUE must be an int or lo,hi") from None
        if len(parts) > 2:
            raise usage_error(f"--workload-arg {item!r}: VALUE must be an int or lo,hi")
        out[name] = parts[0] if len(parts) == 1 else tuple(parts)
    return out


def _lab(args: argparse.Namespace, usage_error) -> int:
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise usage_error(f"--out {args.out!r}: an existing file; give a directory to write into")
    try:
        base, layouts, knob, values = _plan(args)
        workload = _workload(args, usage_error)
        for name in layouts:  # every point checked before anything runs
            for value in values:
                point = {"layout": name} if knob is None else {"layout": name, knob: value}
                lab.check_fits(workload, base.replace(**point))
    except (lab.LabError, lab.WorkloadError) as e:
        raise usage_error(str(e)) from None
    if not args.no_plots:
        try:
            import matplotlib  # noqa: F401  # reason: optional extra, checked before the runs
        except ImportError:
            raise usage_error(
                "plots need matplotlib (pip install 'dsv4-jax[lab]'), or pass --no-plots"
            ) from None
    t0 = time.perf_counter()
    rows = lab.sweep(
        workload, base, layouts=layouts, knob=knob, values=values, progress=not args.no_progress
    )
    written = _write(args, rows, workload, knob)
    _print_rows(rows, knob)
    print(
        json.dumps(
            {"runs": len(rows), "wall_s": round(time.perf_counter() - t0, 2), "files": written}
        )
    )
    return 0


def _plan(args: argparse.Namespace) -> tuple[lab.LabConfig, list[str], str | None, list]:
    """The base config, the layouts and the swept knob with its values, from the flags."""
    knobs = {}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep:
            raise lab.LabError(f"--set {item!r}: expected KNOB=VALUE")
        knobs[name.strip()] = lab.parse_value(name.strip(), value)
    if "layout" in knobs:
        raise lab.LabError("--set layout=...: give layouts with --layouts")
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    if not layouts:
        raise lab.LabError("--layouts: give at least one layout")
    knob, values = (None, [None])
    if args.sweep:
        knob, values = lab.parse_sweep(args.sweep)
        if knob == "layout":
            raise lab.LabError("--sweep layout=...: give layouts with --layouts")
    sizes = ("pool_blocks", "memory_gib")
    if not any(k in knobs for k in sizes) and knob not in sizes:
        knobs["pool_blocks"] = 4000
    if knob in sizes:
        knobs.pop("pool_blocks", None)
        knobs.pop("memory_gib", None)
        knobs[knob] = values[0]
    return lab.LabConfig(layout=layouts[0], **knobs), layouts, knob, values


def _workload(args: argparse.Namespace, usage_error) -> lab.Workload:
    if args.trace:
        return lab.load_jsonl(args.trace)
    return lab.make_workload(
        args.workload, args.seed, **_workload_args(args.workload_arg, usage_error)
    )


def _write(args: argparse.Namespace, rows: list[dict], workload, knob: str | None) -> list[str]:
    """The table, the workload and the plots under ``--out``; returns the paths written."""
    os.makedirs(args.out, exist_ok=True)
    written = lab.write_table(rows, args.out)
    lab.save_jsonl(workload, os.path.join(args.out, "workload.jsonl"))
    written.append(os.path.join(args.out, "workload.jsonl"))
    if not args.no_plots:
        if knob is not None:
            written.append(lab.plot_sweep(rows, knob, args.out))
        written.append(lab.plot_memory(rows, args.out))
    return written


def _print_rows(rows: list[dict], knob: str | None) -> None:
    for row in rows:
        point = f"{row['layout']}" + (f" {knob}={row[knob]}" if knob else "")
        print(
            f"{point:40s} hit rate {row['prefix_hit_rate']:.3f}  recomputed "
            f"{row['recomputed_tokens']:>8}  preemptions {row['preemptions']:>4}  "
            f"peak KV {row['peak_kv_bytes_total'] / 2**30:.2f} GiB"
        )
