"""Tables and plots of lab rows (matplotlib: the ``lab`` extra).

Every figure is drawn from the rows it is given, i.e. from the data the same run computed.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Sequence
from typing import Any

__all__ = ["SWEEP_METRICS", "plot_memory", "plot_sweep", "write_table"]

# (row field, axis label) of the sweep figure's panels
SWEEP_METRICS = (
    ("prefix_hit_rate", "prefix hit rate"),
    ("recomputed_tokens", "recomputed tokens"),
    ("preemptions", "preemptions"),
    ("peak_kv_bytes_total", "peak KV bytes held"),
    ("modelled_output_tokens_per_s", "modelled output tokens/s"),
    ("ttft_p50_s", "modelled TTFT p50 (s)"),
)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("lab plots need matplotlib: pip install 'dsv4-jax[lab]'") from None
    return plt


def _cell(value: Any) -> Any:
    return json.dumps(value) if isinstance(value, list | tuple | dict) else value


def write_table(rows: Sequence[dict[str, Any]], out_dir: str | os.PathLike) -> list[str]:
    """``results.jsonl`` (one row per line) and ``results.csv`` in ``out_dir``; the paths."""
    os.makedirs(out_dir, exist_ok=True)
    jsonl = os.path.join(out_dir, "results.jsonl")
    with open(jsonl, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    path_csv = os.path.join(out_dir, "results.csv")
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with open(path_csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _cell(row.get(k)) for k in fields})
    return [jsonl, path_csv]


def plot_sweep(
    rows: Sequence[dict[str, Any]],
    knob: str,
    out_dir: str | os.PathLike,
    *,
    metrics: Sequence[tuple[str, str]] = SWEEP_METRICS,
    name: str | None = None,
) -> str:
    """One panel per metric, the metric against ``knob``, one line per layout; returns the
    PNG's path."""
    plt = _pyplot()
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    cols = 3 if len(metrics) > 2 else len(metrics)
    nrows = -(-len(metrics) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
    values = list(dict.fromkeys(_key(r[knob]) for r in rows))
    numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
    position = {v: (v if numeric else i) for i, v in enumerate(values)}
    for ax, (field, label) in zip(axes.flat, metrics):
        for layout in layouts:
            pts = [(position[_key(r[knob])], r[field]) for r in rows if r["layout"] == layout]
            pts = [(x, y) for x, y in pts if y is not None]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", label=layout)
        if not numeric:  # None, names, layer lists: one tick per value, in sweep order
            ax.set_xticks(range(len(values)), [str(v) for v in values], rotation=20)
        ax.set_xlabel(knob)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(metrics) :]:
        ax.axis("off")
    axes.flat[0].legend()
    workload = rows[0]["workload"] if rows else ""
    fig.suptitle(f"{workload}: sweep over {knob}")
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name or f"sweep_{knob}.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _key(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def plot_memory(rows: Sequence[dict[str, Any]], out_dir: str | os.PathLike) -> str:
    """KV memory per group of each layout (one row per layout is read): bytes per token of
    context of the full-attention groups, and fixed bytes per request of the window and ring
    groups, stacked by group kind; and the mean bytes each group held in the run."""
    plt = _pyplot()
    seen: dict[str, dict[str, Any]] = {}
    for r in rows:
        seen.setdefault(r["layout"], r)
    names = list(seen)
    fig, (left, mid, right) = plt.subplots(1, 3, figsize=(14, 3.8))
    left.bar(names, [seen[n]["bytes_per_token"] for n in names])
    left.set_ylabel("KV bytes per token of context")
    right_kinds = sorted({k for n in names for k in seen[n]["group_kinds"]})
    bottom = [0.0] * len(names)
    for kind in right_kinds:
        heights = []
        for n in names:
            r = seen[n]
            heights.append(
                sum(m for m, k in zip(r["mean_kv_bytes"], r["group_kinds"]) if k == kind) / 2**20
            )
        right.bar(names, heights, bottom=bottom, label=kind.removesuffix("Spec"))
        bottom = [b + h for b, h in zip(bottom, heights)]
    right.set_ylabel("mean MiB held in the run")
    right.legend(fontsize=7)
    mid.bar(names, [seen[n]["fixed_bytes_per_request"] / 2**20 for n in names])
    mid.set_ylabel("fixed MiB per request (windows, rings)")
    for ax in (left, mid, right):
        ax.tick_params(axis="x", rotation=20)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "memory_per_layout.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
