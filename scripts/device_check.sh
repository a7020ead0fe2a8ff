#!/usr/bin/env bash
# The attention kernels on a real NVIDIA GPU (made for an H200), in one go, in under 8 minutes:
#
#   1. environment  .venv with '.[test,gpu]' (made if missing). Offline machine: WHEELHOUSE=<dir of
#                   wheels> installs from there; failing that, a python3 that already has jax on the
#                   GPU is used, with a loud note that it is not the pinned jax.
#   2. kernel tests window/sparse attention tests with the GPU kernels compiled and run on the
#                   chip (the TPU-interpreter and deviceless-compile tests skip themselves).
#   3. benchmark    benchmarks/kernels.py timed on the chip, every kernel (window, sparse, indexer
#                   r1 / r2 / consumer, compressor r1 / r2, and the jnp scoring-only comparison of
#                   the indexer): JSON + a table of time, bytes and % of the HBM roofline per shape.
#                   Rows are timed most telling first (decode batch 128, prefill, smaller batches)
#                   within a time budget shared by the kernels; rows past it print as SKIPPED.
#   4. engine       the shipped trained model end to end (scripts/device_check.py engine): greedy
#                   tokens against the CPU's (scripts/cpu_greedy_tokens.json), output tokens/s at
#                   batch 1, 8, 64, compilations after warm-up.
#   5. layer        one decoder layer of V4.1-Flash at its released widths (benchmarks/layer.py):
#                   each attention kind at decode batch 64 / 4k first, then larger batches and
#                   contexts, time per layer against its bytes-moved HBM roofline and
#                   tpu-inference's per-layer figure scaled by bandwidth, within its time budget.
#   6. other tests  the rest of tests/pallas_kernels, in whatever time is left.
# Each step appends its outcome to $OUT_DIR/steps.json as it ends (a cut-off run keeps what it
# did); commit that file as benchmarks/results/<device>.json (the README table reads it).
# PLATFORM=cpu is a dry run (tests/scripts/test_device_check.py): tests are only collected, the
# benchmark is untimed and quick, the engine step is skipped unless DRY_RUN_ENGINE=1, the layer
# runs one tiny-width kind untimed.
#
# Usage: scripts/device_check.sh
#   OUT_DIR (or $OUT)  where the JSON and logs go (default /tmp/device_check)
#   PYTHON             use this interpreter as is (skips step 1's install)
#   PLATFORM           JAX_PLATFORMS for steps 2-6 (default cuda; "cpu" dry-runs the script)
# Exit status: 0 when every step passed, 1 when a step failed, 2 when no GPU Python was found.
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

START=$(date +%s)
BUDGET=${BUDGET_S:-450}  # 7.5 min: the device call leaves time for one rerun
OUT_DIR=${OUT_DIR:-${OUT:-/tmp/device_check}}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
declare -A RESULT

section() { printf '\n==================== %s ====================\n' "$*"; }
remaining() { echo $((BUDGET - ($(date +%s) - START))); }
# cap SECONDS [RESERVE]: at most SECONDS, and leave RESERVE seconds of the budget to the steps
# after this one (each step is sure of a share even when those before it run to their caps)
cap() {
    local r; r=$(($(remaining) - ${2:-0}))
    [ "$r" -lt 10 ] && r=10
    if [ "$r" -lt "$1" ]; then echo "$r"; else echo "$1"; fi
}
DRY=0
[ "${PLATFORM:-cuda}" = cpu ] && DRY=1
STEPS_JSON="$OUT_DIR/steps.json"
rm -f "$STEPS_JSON"
STEP_T0=$(date +%s)
# record STEP CODE NOTE: append the step's outcome to steps.json, restart the step clock
record() {
    "$PY" scripts/device_check.py record-step --out "$STEPS_JSON" --step "$1" --code "$2" \
        --seconds $(($(date +%s) - STEP_T0)) --note "$3" || echo "(could not record step $1)"
    STEP_T0=$(date +%s)
}
on_gpu() { "$1" -c 'import jax, sys; sys.exit(0 if jax.default_backend() == "gpu" else 1)' >/dev/null 2>&1; }

section "1/6 environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "(nvidia-smi failed)"
PY=""
if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
elif [ "$DRY" = 1 ]; then
    PY=python3
elif [ -x .venv/bin/python ] && on_gpu .venv/bin/python; then
    PY=.venv/bin/python
elif [ -z "${WHEELHOUSE:-}" ] && on_gpu python3 && python3 -c 'import pytest, numpy' >/dev/null 2>&1; then
    # the device image's own Python (offline: pip would only spend the budget failing)
    PY=python3
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    echo "!!! using the image's $PY with its own jax, NOT the pinned jax==0.12.0.1 !!!"
else
    P312=""
    for p in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12 python3; do
        if "$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then P312=$p; break; fi
    done
    if [ -n "$P312" ]; then
        [ -x .venv/bin/python ] || "$P312" -m venv .venv
        PIP=(.venv/bin/python -m pip install -q --retries 0 --timeout 10)
        [ -n "${WHEELHOUSE:-}" ] && PIP+=(--no-index --find-links "$WHEELHOUSE")
        echo "installing .[test,gpu] into .venv ($(cap 240) s at most)"
        if timeout "$(cap 240)" "${PIP[@]}" -e '.[test,gpu]' && on_gpu .venv/bin/python; then
            PY=.venv/bin/python
        else
            echo "could not install .[test,gpu] into .venv (offline? set WHEELHOUSE)"
        fi
    fi
    if [ -z "$PY" ]; then
        for p in python3 /opt/torch/.venv/bin/python3; do
            if on_gpu "$p" && "$p" -c 'import pytest, numpy' >/dev/null 2>&1; then PY=$p; break; fi
        done
        if [ -n "$PY" ]; then
            export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
            echo "!!! FALLBACK: using $PY with its own jax, NOT the pinned jax==0.12.0.1 !!!"
        fi
    fi
fi
if [ -z "$PY" ]; then
    echo "FATAL: no Python with jax on a GPU (jax.default_backend() != 'gpu')"
    exit 2
fi
"$PY" -c 'import jax, sys; print("python", sys.version.split()[0], "| jax", jax.__version__, "|", jax.devices())'
export JAX_PLATFORMS=${PLATFORM:-cuda}
record environment 0 "$("$PY" -c 'import jax, sys; print("python", sys.version.split()[0], "jax", jax.__version__)')"
COLLECT=()
[ "$DRY" = 1 ] && COLLECT=(--collect-only)
STEP_T0=$(date +%s)

section "2/6 window + sparse attention kernels, compiled on the GPU"
timeout "$(cap 150 290)" "$PY" -m pytest -o addopts="" -q -p no:cacheprovider -rs \
    tests/pallas_kernels/test_window_attention.py tests/pallas_kernels/test_sparse_attention.py \
    -k "not compiles and not lowers" "${COLLECT[@]}" 2>&1 | tee "$OUT_DIR/kernel_tests.log"
RESULT[tests]=$?
record kernel_tests "${RESULT[tests]}" "$(tail -n 1 "$OUT_DIR/kernel_tests.log")"

section "3/6 kernel benchmark (every kernel), timed on the GPU"
BENCH_CAP=$(cap 130 170)
# the benchmark stops timing rows after BENCH_BUDGET s (compiles dominate), so its JSON comes out
# before the hard timeout; the headroom covers the imports and the row in flight
BENCH_BUDGET=$((BENCH_CAP > 120 ? BENCH_CAP - 60 : BENCH_CAP / 2))
BENCH_ARGS=(--repeats 20 --budget-s "$BENCH_BUDGET")
[ "$DRY" = 1 ] && BENCH_ARGS=(--quick --no-time)
timeout "$BENCH_CAP" "$PY" -m benchmarks.kernels "${BENCH_ARGS[@]}" \
    >"$OUT_DIR/kernels_bench.json" 2>"$OUT_DIR/kernels_bench.err"
RESULT[benchmark]=$?
tail -n 5 "$OUT_DIR/kernels_bench.err"
"$PY" - "$OUT_DIR/kernels_bench.json" <<'EOF' || RESULT[benchmark]=1
import json, sys

text = open(sys.argv[1]).read().strip()
if not text:
    sys.exit("no benchmark output")
out = json.loads(text.splitlines()[-1])
print(f"device {out['device']} | impl {out['impl']} | {out['dtype']} | jax {out['jax']} | "
      f"peak HBM {out['peak_hbm_bytes_per_s']} B/s")
head = f"{'kernel':22} {'phase':7} {'batch':>5} {'context':>8} {'tokens':>6} {'MB':>9} {'us':>10} {'GB/s':>8} {'%HBM':>6} {'TFLOP/s':>8}"
print(head)
bad = skipped = 0
for name, rows in out["results"].items():
    for r in rows:
        where = f"{name:22} {r['phase']:7} {r['batch']:>5} {r['context']:>8} {r['tokens']:>6}"
        if r.get("skipped"):
            skipped += 1
            print(f"{where} {r['bytes'] / 1e6:>9.2f} SKIPPED ({r['skipped']})")
            continue
        if r.get("error") or (out["timed"] and r["time_s"] is None):
            bad += 1
            print(f"{where} ERROR {r.get('error')}")
            continue
        if not out["timed"]:
            print(f"{where} {r['bytes'] / 1e6:>9.2f} (untimed: cost model only)")
            continue
        pct = r["hbm_roofline_pct"]
        print(f"{where} {r['bytes'] / 1e6:>9.2f} {r['time_s'] * 1e6:>10.1f} {r['bytes_per_s'] / 1e9:>8.1f} "
              f"{'-' if pct is None else f'{pct:.1f}':>6} {r['tflops']:>8.2f}")
if skipped:
    print(f"{skipped} rows SKIPPED (time budget; run python -m benchmarks.kernels for every row)")
for name, rows in out["results"].items() if out["timed"] else ():
    for r in rows:
        if "indexer_over_scoring" not in r:
            continue
        if r["indexer_over_scoring"] is None:
            print(f"{name} {r['phase']} b{r['batch']} ctx{r['context']}: not both timed")
            continue
        print(f"{r['indexer']} vs {name} (jnp approximation of the scoring pass) {r['phase']} "
              f"b{r['batch']} ctx{r['context']}: indexer {r['indexer_time_s'] * 1e6:.1f} us, "
              f"scoring {r['time_s'] * 1e6:.1f} us, indexer / scoring {r['indexer_over_scoring']:.2f}")
sys.exit(1 if bad else 0)
EOF

record kernels_benchmark "${RESULT[benchmark]}" "$OUT_DIR/kernels_bench.json"

section "4/6 the engine end to end with the shipped trained model"
ENGINE_ARGS=()
[ "$DRY" = 1 ] && ENGINE_ARGS=(--dry-run --batches 1,2 --new-tokens 4)
if [ "$DRY" = 1 ] && [ -z "${DRY_RUN_ENGINE:-}" ]; then
    echo "(skipped: building the engine takes minutes on a CPU; DRY_RUN_ENGINE=1 runs it)"
    RESULT[engine]=0
    record engine 0 "skipped in the CPU dry run (DRY_RUN_ENGINE=1 runs it)"
elif [ "$(remaining)" -lt 30 ]; then
    echo "(skipped: out of time)"
    RESULT[engine]=124
    record engine 124 "skipped: out of time"
else
    timeout "$(cap 150 70)" "$PY" scripts/device_check.py engine --out "$OUT_DIR/engine.json" \
        "${ENGINE_ARGS[@]}" 2>"$OUT_DIR/engine.err"
    RESULT[engine]=$?
    tail -n 5 "$OUT_DIR/engine.err"
    record engine "${RESULT[engine]}" "$OUT_DIR/engine.json"
fi

section "5/6 one decoder layer at V4.1-Flash widths (benchmarks/layer.py), timed on the GPU"
LAYER_CAP=$(cap 120)
# rows stop starting after LAYER_BUDGET s; the headroom covers the imports, the weights and the
# row in flight (its JSON is rewritten after each row, so a cut-off run keeps the rows done)
LAYER_BUDGET=$((LAYER_CAP > 90 ? LAYER_CAP - 50 : LAYER_CAP / 2))
LAYER_ARGS=(--repeats 10 --budget-s "$LAYER_BUDGET")
[ "$DRY" = 1 ] && LAYER_ARGS=(--dry-run --kinds full_r1)
if [ "$(remaining)" -lt 30 ]; then
    echo "(skipped: out of time)"
    RESULT[layer]=124
    record layer 124 "skipped: out of time"
else
    rm -f "$OUT_DIR/layer_bench.json"
    timeout "$LAYER_CAP" "$PY" -m benchmarks.layer "${LAYER_ARGS[@]}" \
        --out "$OUT_DIR/layer_bench.json" >/dev/null 2>"$OUT_DIR/layer_bench.err"
    RESULT[layer]=$?
    tail -n 5 "$OUT_DIR/layer_bench.err"
    "$PY" scripts/device_check.py layer-table "$OUT_DIR/layer_bench.json" || RESULT[layer]=1
    record layer "${RESULT[layer]}" "$OUT_DIR/layer_bench.json"
fi

section "6/6 the other kernel tests in tests/pallas_kernels"
mapfile -t OTHERS < <(ls tests/pallas_kernels/test_*.py | grep -v -e test_window_attention -e test_sparse_attention)
if [ "${#OTHERS[@]}" -eq 0 ]; then
    echo "(none)"
    RESULT[other_tests]=0
elif [ "$(remaining)" -lt 30 ]; then
    echo "(skipped: out of time)"
    RESULT[other_tests]=124
else
    timeout "$(cap 600)" "$PY" -m pytest -o addopts="" -q -p no:cacheprovider -rs "${OTHERS[@]}" \
        -k "not compiles and not lowers" "${COLLECT[@]}" 2>&1 | tee "$OUT_DIR/other_tests.log"
    RESULT[other_tests]=$?
fi
record other_tests "${RESULT[other_tests]}" "$(tail -n 1 "$OUT_DIR/other_tests.log" 2>/dev/null)"

section "summary ($(($(date +%s) - START)) s)"
status=0
for step in tests benchmark engine layer other_tests; do
    code=${RESULT[$step]:-1}
    case $code in
        0) word=PASS ;;
        124) word="TIMEOUT (the time box ran out)" ;;
        *) word="FAIL (exit $code)" ;;
    esac
    printf '%-12s %s\n' "$step" "$word"
    [ "$code" -eq 0 ] || status=1
done
echo "logs and JSON: $OUT_DIR"
exit $status
