"""The Python steps of scripts/device_check.sh (issue 36) and the README table of its results.

``engine``: the shipped trained model end to end (greedy tokens against the CPU's, recorded in
scripts/cpu_greedy_tokens.json by ``record-tokens``; output tokens/s per batch; compilations
after warm-up). ``layer-table`` prints benchmarks/layer.py's JSON as a table (step 5, issue 36
point 1d). ``--table`` prints the README table from benchmarks/results/<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENS_FILE = os.path.join(ROOT, "scripts", "cpu_greedy_tokens.json")
RESULTS_DIR = os.path.join(ROOT, "benchmarks", "results")
PROMPTS = ([3, 4, 5, 6, 7, 8, 9, 10], [20, 31, 42, 53], [100, 7, 100, 7, 100, 7])
NEW_TOKENS = 12


def _write(path: str | None, record: dict[str, Any]) -> None:
    """Write ``record`` as JSON now (a run cut off later still leaves what it did)."""
    if path:
        with open(path, "w") as f:
            json.dump(record, f, indent=1)


def _llm(max_seqs: int, dry_run: bool):
    from serving import LLM

    kwargs: dict[str, Any] = {"max_num_seqs": max_seqs, "compilation_cache_dir": None}
    if dry_run:  # the fewest compiled step sizes: the CPU dry run only checks the wiring
        kwargs.update(max_num_batched_tokens=16, token_buckets=(4, 16))
    return LLM("tiny_v41_trained", **kwargs)


def greedy_tokens(llm, prompts=PROMPTS, new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """The greedy output tokens of ``llm`` for ``prompts``, one list per prompt."""
    from serving import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate([list(p) for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def tokens_per_s(llm, batch: int, new_tokens: int) -> dict[str, Any]:
    """Output tokens/s of one ``generate`` of ``batch`` prompts (after one untimed run)."""
    prompts = [[3 + (7 * i + j) % 200 for j in range(8)] for i in range(batch)]
    greedy_tokens(llm, prompts, new_tokens)  # first use of this batch's tables
    t0 = time.perf_counter()
    out = greedy_tokens(llm, prompts, new_tokens)
    dt = time.perf_counter() - t0
    n = sum(len(t) for t in out)
    return {"batch": batch, "new_tokens": new_tokens, "seconds": dt, "tokens_per_s": n / dt}


def engine_check(out: str | None, batches: list[int], new_tokens: int, dry_run: bool) -> dict:
    """Step c of issue 36; writes ``out`` after each part. ``ok``: tokens equal and 0
    compilations after warm-up."""
    import jax

    with open(TOKENS_FILE) as f:
        want = json.load(f)
    rec: dict[str, Any] = {"step": "engine", "backend": jax.default_backend(), "dry_run": dry_run}
    llm = _llm(max(batches), dry_run)
    rec["warm_up_compilations"] = llm.engine.stats.warm_up_compilations
    got = greedy_tokens(llm, want["prompts"], want["new_tokens"])
    rec["tokens_equal_cpu"] = got == want["tokens"]
    rec["tokens"] = got
    _write(out, rec)
    rec["throughput"] = []
    for b in batches:
        rec["throughput"].append(tokens_per_s(llm, b, new_tokens))
        _write(out, rec)
    rec["compilations_after_warm_up"] = llm.engine.stats.compilations_after_warm_up
    rec["ok"] = rec["tokens_equal_cpu"] and rec["compilations_after_warm_up"] == 0
    _write(out, rec)
    return rec


def record_tokens() -> dict[str, Any]:
    """Record the CPU's greedy tokens (the reference the GPU run is held to)."""
    import jax

    if jax.default_backend() != "cpu":
        raise SystemExit(f"record-tokens runs on the CPU, not {jax.default_backend()!r}")
    llm = _llm(len(PROMPTS), dry_run=True)  # greedy tokens do not depend on the buckets
    rec = {
        "model": "tiny_v41_trained",
        "prompts": [list(p) for p in PROMPTS],
        "new_tokens": NEW_TOKENS,
        "tokens": greedy_tokens(llm),
    }
    _write(TOKENS_FILE, rec)
    return rec


def _engine_summary(rec: dict[str, Any]) -> str:
    rates = ", ".join(f"b{r['batch']} {r['tokens_per_s']:.0f}" for r in rec.get("throughput", []))
    return (
        f"tokens equal CPU: {rec.get('tokens_equal_cpu')}; output tok/s {rates or '-'}; "
        f"compilations after warm-up: {rec.get('compilations_after_warm_up', '-')}"
    )


def _bench_summary(path: str) -> str:
    with open(path) as f:
        lines = f.read().strip().splitlines()
    if not lines:
        return f"{path}: no output"
    out = json.loads(lines[-1])
    rows = [r for rows in out["results"].values() for r in rows]
    pct = [r["hbm_roofline_pct"] for r in rows if r.get("hbm_roofline_pct") is not None]
    span = f"; %HBM {min(pct):.1f}-{max(pct):.1f}" if pct else ""
    return (
        f"{len(rows)} rows, {sum(bool(r.get('skipped')) for r in rows)} skipped, "
        f"{sum(bool(r.get('error')) for r in rows)} errors, timed: {out['timed']}{span}"
    )


def _layer_rows(out: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(kind, r) for kind, rows in out["results"].items() for r in rows]


def _layer_bad(out: dict[str, Any], row: dict[str, Any]) -> bool:
    """A row that failed: an error, a timed run without a time, or a non-finite output."""
    if row.get("skipped"):
        return False
    missing = out["timed"] and row.get("time_s") is None
    return bool(row.get("error")) or missing or row.get("output_finite") is False


def _layer_summary(path: str) -> str:
    """record-step's line for benchmarks/layer.py's JSON: counts, then per kind at the
    tpu-inference shape its time, % of the roofline and ratio to the scaled figure."""
    with open(path) as f:
        text = f.read().strip()
    if not text:
        return f"{path}: no output"
    out = json.loads(text)
    rows = _layer_rows(out)
    parts = [
        f"{len(rows)} rows, {sum(bool(r.get('skipped')) for _, r in rows)} skipped, "
        f"{sum(_layer_bad(out, r) for _, r in rows)} errors, timed: {out['timed']}"
    ]
    traced = out.get("traced_released")
    if traced is not None:
        failed = [f"{r['kind']} b{r['batch']} ctx{r['context']}" for r in traced if "error" in r]
        parts.append(f"released widths traced: {len(traced) - len(failed)}/{len(traced)}")
    for kind, r in rows:
        if r.get("time_s") is not None and "tpu_inference_scaled_s" in r:
            pct = r.get("roofline_pct")
            parts.append(
                f"{kind} b{r['batch']} ctx{r['context']} {r['time_s'] * 1e6:.0f} us "
                f"({'-' if pct is None else f'{pct:.0f}'}% roofline, "
                f"{r['time_over_tpu_inference']:.2f}x tpu-inference scaled)"
            )
    return "; ".join(parts)


def layer_table(path: str) -> int:
    """Print benchmarks/layer.py's JSON as a table; 1 when a row failed or there is none."""
    with open(path) as f:
        text = f.read().strip()
    if not text:
        print(f"{path}: no output")
        return 1
    out = json.loads(text)
    print(f"device {out['device']} | {out['widths']} widths | records {out['records']} | "
          f"peak HBM {out['peak_hbm_bytes_per_s']} B/s | jax {out['jax']}")  # fmt: skip
    print(f"{'kind':8} {'batch':>5} {'context':>7} {'MB':>9} {'us':>9} {'roof us':>9} "
          f"{'%roof':>6} {'tpu-inf us':>10}")  # fmt: skip
    bad = 0
    for kind, r in _layer_rows(out):
        where = f"{kind:8} {r['batch']:>5} {r['context']:>7}"
        if r.get("skipped") or r.get("error"):
            print(f"{where} {'SKIPPED' if r.get('skipped') else 'ERROR'} "
                  f"({r.get('skipped') or r.get('error')})")  # fmt: skip
            bad += bool(r.get("error"))
            continue
        bad += _layer_bad(out, r)
        t, roof, pct = r.get("time_s"), r.get("roofline_s"), r.get("roofline_pct")
        tpu = r.get("tpu_inference_scaled_s")
        print(f"{where} {r['bytes']['total'] / 1e6:>9.1f} "
              f"{'-' if t is None else f'{t * 1e6:.1f}':>9} "
              f"{'-' if roof is None else f'{roof * 1e6:.1f}':>9} "
              f"{'-' if pct is None else f'{pct:.1f}':>6} "
              f"{'-' if tpu is None else f'{tpu * 1e6:.0f}':>10}"
              f"{'' if r.get('output_finite', True) else '  NON-FINITE OUTPUT'}")  # fmt: skip
    for r in out.get("traced_released", ()):
        print(f"traced at released widths: {r['kind']} b{r['batch']} ctx{r['context']}: "
              f"{r.get('error') or 'ok, %.1f MB moved' % (r['bytes']['total'] / 1e6)}")  # fmt: skip
        bad += "error" in r
    return 1 if bad or not _layer_rows(out) else 0


def record_step(steps_file: str, step: str, code: int, seconds: float, note: str) -> dict:
    """Append one step's outcome to ``steps_file`` (the results/<device>.json format)."""
    import jax

    res = {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "steps": []}
    if os.path.isfile(steps_file):
        with open(steps_file) as f:
            res = json.load(f)
    status = {0: "PASS", 124: "TIMEOUT"}.get(code, f"FAIL (exit {code})")
    summary = note
    if step == "engine" and os.path.isfile(note):
        with open(note) as f:
            summary = _engine_summary(json.load(f))
    if step == "kernels_benchmark" and os.path.isfile(note):
        summary = _bench_summary(note)
    if step == "layer" and os.path.isfile(note):
        summary = _layer_summary(note)
    if note.startswith("skipped"):
        status = "SKIPPED"
    res["steps"].append({"step": step, "status": status, "seconds": seconds, "summary": summary})
    _write(steps_file, res)
    return res


def table(results_dir: str = RESULTS_DIR) -> str:
    """The README table, one row per step of each committed results/<device>.json."""
    files = sorted(f for f in os.listdir(results_dir) if f.endswith(".json"))
    if not files:
        return "(none yet: no device run committed under benchmarks/results/)"
    lines = ["| device | step | result | figures |", "| --- | --- | --- | --- |"]
    for name in files:
        with open(os.path.join(results_dir, name)) as f:
            res = json.load(f)
        for step in res["steps"]:
            lines.append(
                f"| {res['device']} | {step['step']} | {step.get('status', '?')} | "
                f"{step.get('summary', '')} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", action="store_true", help="print the README table")
    parser.add_argument("--results", default=RESULTS_DIR, help="the results/<device>.json dir")
    parser.add_argument(
        "command", nargs="?", choices=["engine", "record-tokens", "record-step", "layer-table"]
    )
    parser.add_argument("path", nargs="?", help="layer-table: benchmarks/layer.py's JSON")
    parser.add_argument("--step", default=None, help="record-step: the step's name")
    parser.add_argument("--code", type=int, default=0, help="record-step: its exit status")
    parser.add_argument("--seconds", type=float, default=0.0, help="record-step: its time")
    parser.add_argument("--note", default="", help="record-step: a summary (or engine JSON)")
    parser.add_argument("--out", default=None, help="JSON file written as the step goes")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes (CPU)")
    args = parser.parse_args(argv)
    if args.table:
        print(table(args.results))
        return 0
    if args.command == "record-tokens":
        print(json.dumps(record_tokens()))
        return 0
    if args.command == "layer-table":
        if not args.path:
            parser.error("layer-table needs the JSON file benchmarks/layer.py --out wrote")
        return layer_table(args.path)
    if args.command == "record-step":
        if not args.out or not args.step:
            parser.error("record-step needs --out (the steps file) and --step")
        record_step(args.out, args.step, args.code, args.seconds, args.note)
        return 0
    if args.command != "engine":
        parser.error("give a command (engine, record-tokens, record-step, layer-table) or --table")
    batches = [int(b) for b in args.batches.split(",") if b]
    if not batches or min(batches) < 1:
        parser.error(f"--batches {args.batches!r}: comma-separated integers >= 1")
    rec = engine_check(args.out, batches, args.new_tokens, args.dry_run)
    print(json.dumps({k: v for k, v in rec.items() if k != "tokens"}))
    return 0 if rec["ok"] else 1


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())
