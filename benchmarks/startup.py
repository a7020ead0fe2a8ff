"""Start-up of `LLM("tiny_v41_trained")` with its defaults: a first run with an empty persistent
compilation cache, then a second run with the cache the first one filled, each a fresh process.

Prints one JSON line: per run, the seconds to a ready `LLM` and to its first output, and where
the time went (imports, warm-up; tracing, lowering and XLA compiles with their count and the
slowest by function). Usage: docs/benchmarks.md#benchmarksstartup.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

_T0 = time.perf_counter()  # the child's clock starts when this module is imported
_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
SLOWEST = 8  # compiles listed by name


class _Recorder:
    """JAX's monitoring events of this process: trace, lowering and compile seconds, and each
    backend compile's function, seconds and whether it was loaded from the persistent cache."""

    def __init__(self) -> None:
        import jax

        self.seconds = {_TRACE: 0.0, _LOWER: 0.0}
        self.compiles: list[tuple[str, float, bool]] = []
        self._hit = False
        jax.monitoring.register_event_duration_secs_listener(self._duration)
        jax.monitoring.register_event_listener(self._event)

    def _event(self, event: str, **_: object) -> None:
        if event == _CACHE_HIT:
            self._hit = True

    def _duration(self, event: str, duration: float, **kw: object) -> None:
        if event == _COMPILE:
            self.compiles.append((str(kw.get("fun_name", "?")), duration, self._hit))
            self._hit = False
        elif event in self.seconds:
            self.seconds[event] += duration

    def summary(self) -> dict:
        built = [c for c in self.compiles if not c[2]]
        loaded = [c for c in self.compiles if c[2]]
        slowest = sorted(self.compiles, key=lambda c: -c[1])[:SLOWEST]
        return {
            "trace_s": round(self.seconds[_TRACE], 2),
            "lower_s": round(self.seconds[_LOWER], 2),
            "compiled": len(built),
            "compile_s": round(sum(c[1] for c in built), 2),
            "loaded_from_cache": len(loaded),
            "load_s": round(sum(c[1] for c in loaded), 2),
            "by_function": _by_function(self.compiles),
            "slowest": [
                [name, round(s, 2), "loaded" if hit else "compiled"] for name, s, hit in slowest
            ],
        }


def _by_function(compiles: list[tuple[str, float, bool]]) -> dict[str, list]:
    """Per function: [compiles or loads, their seconds], the costliest first."""
    out: dict[str, list] = {}
    for name, seconds, _ in compiles:
        count, total = out.get(name, (0, 0.0))
        out[name] = [count + 1, total + seconds]
    ranked = sorted(out.items(), key=lambda kv: -kv[1][1])
    return {name: [n, round(s, 2)] for name, (n, s) in ranked}


def _child(args: argparse.Namespace) -> int:
    """One start, in this process: `LLM(model, **llm_args)`, then one short request."""
    rec = _Recorder()
    from serving import LLM, SamplingParams

    imported = time.perf_counter()
    llm = LLM(args.model, **json.loads(args.llm_args))
    ready = time.perf_counter()
    out = llm.generate(["def main():\n"], SamplingParams(max_tokens=8), use_tqdm=False)
    first = time.perf_counter()
    st = llm.engine.stats
    result = {
        "ready_s": round(ready - _T0, 2),
        "first_output_s": round(first - _T0, 2),
        "import_s": round(imported - _T0, 2),
        "warm_up_s": round(st.warm_up_s, 2),
        "warm_up_programs": st.warm_up_programs,
        "warm_up_compilations": st.warm_up_compilations,
        "warm_up_cache_hits": st.warm_up_cache_hits,
        "compilations_after_warm_up": st.compilations_after_warm_up,
        "output_tokens": len(out[0].outputs[0].token_ids),
        **rec.summary(),
    }
    print(json.dumps(result))
    return 0


def _start(args: argparse.Namespace, cache_home: str) -> dict:
    """One fresh process; its report with ``wall_s``, the seconds it ran from exec to exit."""
    cmd = [sys.executable, "-m", "benchmarks.startup", "--child", "--model", args.model,
           "--llm-args", args.llm_args]  # fmt: skip
    env = {**os.environ, "XDG_CACHE_HOME": cache_home}  # LLM's default cache lives under it
    env.setdefault("JAX_PLATFORMS", "cpu")
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - t0
    if done.returncode:
        raise RuntimeError(f"the start-up process failed:\n{done.stderr}")
    return {"wall_s": round(wall, 2), **json.loads(done.stdout.strip().splitlines()[-1])}


FIRST_GOAL_S, SECOND_GOAL_S = 60, 15  # ready after a first / a second start, 2 cores


def table_row(result: dict) -> str:
    """The README's line for ``result``."""
    first, second = result["first"], result["second"]
    return (
        f'Start-up of `LLM("{result["model"]}")` with its defaults '
        f"(`python -m benchmarks.startup`, {result['cpu_count']} CPU cores): ready after "
        f"**{first['ready_s']} s** on a first start ({first['warm_up_programs']} warm-up programs "
        f"compiled; goal {FIRST_GOAL_S} s) and **{second['ready_s']} s** on the second, which "
        f"loads them ({second['loaded_from_cache']} executables, none compiled; goal "
        f"{SECOND_GOAL_S} s)."
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny_v41_trained")
    parser.add_argument(
        "--llm-args", default="{}", help="LLM's keyword arguments as a JSON object (default: {})"
    )
    parser.add_argument(
        "--cache-home",
        default=None,
        help="XDG_CACHE_HOME of both runs (default: a fresh temporary directory)",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--table", action="store_true", help="the README's line")
    args = parser.parse_args(argv)
    if not isinstance(json.loads(args.llm_args), dict):
        parser.error(f"--llm-args {args.llm_args!r}: must be a JSON object")
    if args.child:
        return _child(args)
    with tempfile.TemporaryDirectory() as tmp:
        home = args.cache_home or tmp
        first, second = _start(args, home), _start(args, home)
    report = {
        "benchmark": "startup",
        "model": args.model,
        "llm_args": json.loads(args.llm_args),
        "cpu_count": os.cpu_count(),
        "first": first,
        "second": second,
        "second_run_compiles_nothing": second["compiled"] == 0,
    }
    print(table_row(report) if args.table else json.dumps(report, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
