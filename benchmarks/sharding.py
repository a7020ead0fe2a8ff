"""Per-chip bytes of DeepSeek-V4.1-Flash on a slice: the memory planner against XLA's compiled
memory analysis, and the collective bytes of a decode step (no devices).

Prints one JSON line (``--table``: the planner table of docs/planner.md).
Usage and fields: docs/benchmarks.md#benchmarkssharding.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
from typing import Any

from dsv4.config import ModelConfig, v41_flash
from planner import plan as P

TABLE_SLICES = (
    "v5e-64",
    "v5e-256",
    "v6e-16",
    "v6e-64",
    "v5p-16",
    "v5p-64",
    "h200x8",
    "h200x16",
)
TOPOLOGY = "v5p:2x2x2"  # 8 v5p chips
COMPILE_MESH = P.MeshAxes(data=1, expert=4, model=2)  # both weight-splitting axes
STEP = (
    "tpu:v5p:2x2x2/released",
    "tpu:v5p:2x2x2/bf16",
    "h100x8/released",
    "h100x8/bf16",
)
STEP_SIZES = {"max_num_seqs": 16, "max_model_len": 65_536, "num_tokens": 256}


def _target_weights(item: str) -> tuple[str, str]:
    target, sep, weights = item.rpartition("/")
    if not sep or weights not in ("released", "bf16"):
        raise ValueError(f"--step {item!r}: expected TARGET/released or TARGET/bf16")
    return target, weights


def compiled_step(
    target: str, weights: str, mesh: P.MeshAxes = COMPILE_MESH, **sizes: int
) -> dict[str, Any]:
    """`planner.compiled_step.compiled_step_memory` of `reduced_flash_roles` on ``target``, or
    ``{"skipped": why}`` when its compiler package (libtpu, the CUDA plugin) is absent."""
    from planner import compiled_step as C

    package = "jax_plugins.xla_cuda12" if target == C.H100X8 else "libtpu"
    if importlib.util.find_spec(package) is None:
        return {"target": target, "skipped": f"{package} not installed (pip install -e '.[aot]')"}
    return C.compiled_step_memory(
        C.reduced_flash_roles(), mesh, target=target, weights=weights, **(STEP_SIZES | sizes)
    )


def run(
    chips: str = "v5p-16",
    *,
    mesh: P.MeshAxes | None = None,
    max_num_seqs: int = 64,
    max_model_len: int = 131_072,
    compile_: bool = True,
    topology: str = TOPOLOGY,
    compile_mesh: P.MeshAxes = COMPILE_MESH,
    compile_cfg: ModelConfig | None = None,
    reference: bool = True,
    step: tuple[str, ...] = STEP,
    step_mesh: P.MeshAxes = COMPILE_MESH,
    step_sizes: dict[str, int] | None = None,
    cpu_ratio: bool = False,
) -> dict[str, Any]:
    """The JSON line's dict (module docstring)."""
    t0 = time.perf_counter()
    cfg = v41_flash()
    plan = P.plan(
        cfg,
        P.parse_slice(chips),
        mesh=mesh,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
    )
    out: dict[str, Any] = {
        "benchmark": "sharding",
        "model": "v41_flash",
        "planner": plan.as_dict(),
        "collective_bytes_per_decode_step_per_chip": P.collective_bytes_per_decode_step(
            cfg, plan.mesh, num_seqs=max_num_seqs, context=max_model_len
        ),
    }
    if not compile_:
        out["compiled"] = {"skipped": "--no-compile"}
    elif not reference:
        out["compiled"] = {"skipped": "--no-reference"}
    elif importlib.util.find_spec("libtpu") is None:
        out["compiled"] = {"skipped": "libtpu not installed (pip install -e '.[aot]')"}
    else:
        cfg_c = compile_cfg or P.reduced_flash()
        out["compiled"] = P.compiled_memory(cfg_c, compile_mesh, topology=topology)
    if not compile_:
        out["compiled_step"] = {"skipped": "--no-compile"}
    else:
        out["compiled_step"] = [
            compiled_step(*_target_weights(item), step_mesh, **(step_sizes or {})) for item in step
        ]
    out["cpu_step_ratio"] = (
        cpu_step_ratio() if cpu_ratio else {"skipped": "pass --cpu-step-ratio to measure it"}
    )
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    return out


_CPU_RATIO = textwrap.dedent(
    """
    import json, time
    import jax
    import numpy as np
    from dsv4 import sharding
    from serving import LLM, SamplingParams

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, int(n)).tolist() for n in rng.integers(8, 48, 8)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    jax.config.update("jax_default_matmul_precision", "highest")  # fp32: the same tokens
    kw = dict(dtype="float32", kv_cache_dtype="exact", max_model_len=128, max_num_seqs=8,
              max_num_batched_tokens=64,
              token_buckets=(64,), num_gpu_blocks_override=128, compilation_cache_dir=None,
              async_scheduling=False)
    per_step = {}
    for name, mesh in (("one_device", None),
                       ("mesh_2x2x2", sharding.make_mesh(data=2, expert=2, model=2))):
        llm = LLM("tiny_v41", mesh=mesh, **kw)
        llm.generate(prompts, sp, use_tqdm=False)  # warm
        steps0, t0 = llm.engine.stats.num_steps, time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        per_step[name] = (time.perf_counter() - t0) / (llm.engine.stats.num_steps - steps0)
        per_step[name + "_tokens"] = [o.outputs[0].token_ids for o in outs]
    same = per_step.pop("one_device_tokens") == per_step.pop("mesh_2x2x2_tokens")
    print(json.dumps({"s_per_step": per_step, "same_tokens": same,
                      "ratio": per_step["mesh_2x2x2"] / per_step["one_device"]}))
    """
)


def cpu_step_ratio() -> dict[str, Any]:
    """The engine's step time on 8 fake CPU devices over one device (module docstring)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run_ = subprocess.run(
        [sys.executable, "-c", _CPU_RATIO], env=env, cwd=root, capture_output=True, text=True
    )
    if run_.returncode:
        raise RuntimeError(f"the CPU step-ratio run failed:\n{run_.stdout}{run_.stderr}")
    line = next(x for x in run_.stdout.splitlines() if x.startswith("{"))
    return json.loads(line)


def table(slices=TABLE_SLICES, **kwargs: Any) -> str:
    """The markdown table of docs/planner.md: `planner.plan.markdown_table` of v41_flash per slice."""
    cfg = v41_flash()
    return P.markdown_table([P.plan(cfg, P.parse_slice(s), **kwargs) for s in slices])


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chips", default="v5p-16", help="the slice (planner.plan.parse_slice)")
    ap.add_argument("--mesh", default=None, help="data=D,expert=E,model=M (default: planner's)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=131_072)
    ap.add_argument("--no-compile", action="store_true", help="skip XLA's compiled figures")
    ap.add_argument("--topology", default=TOPOLOGY, help="libtpu topology of the compile")
    ap.add_argument("--compile-mesh", default=str(COMPILE_MESH), help="mesh of the compile")
    ap.add_argument(
        "--no-reference", action="store_true", help="skip the reference.forward compile"
    )
    ap.add_argument(
        "--step",
        default=",".join(STEP),
        help="TARGET/WEIGHTS,... of the paged-step compiles ('' for none)",
    )
    ap.add_argument("--step-mesh", default=str(COMPILE_MESH), help="mesh of the step compiles")
    ap.add_argument("--step-seqs", type=int, default=STEP_SIZES["max_num_seqs"])
    ap.add_argument("--step-len", type=int, default=STEP_SIZES["max_model_len"])
    ap.add_argument("--step-tokens", type=int, default=STEP_SIZES["num_tokens"])
    ap.add_argument(
        "--describe",
        action="store_true",
        help="after the JSON line, each paged-step compile in words (planner.compiled_step.describe)",
    )
    ap.add_argument(
        "--cpu-step-ratio",
        action="store_true",
        help="also time the engine's step on 8 fake CPU devices against one (a subprocess)",
    )
    ap.add_argument("--table", action="store_true", help="print docs/planner.md's markdown table")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    try:
        if args.table:
            print(table(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs))
            return 0
        mesh = None if args.mesh is None else P.parse_mesh(args.mesh)
        res = run(
            args.chips,
            mesh=mesh,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            compile_=not args.no_compile,
            topology=args.topology,
            compile_mesh=P.parse_mesh(args.compile_mesh),
            reference=not args.no_reference,
            step=tuple(x for x in args.step.split(",") if x and _target_weights(x)),
            step_mesh=P.parse_mesh(args.step_mesh),
            step_sizes={
                "max_num_seqs": args.step_seqs,
                "max_model_len": args.step_len,
                "num_tokens": args.step_tokens,
            },
            cpu_ratio=args.cpu_step_ratio,
        )
    except ValueError as exc:
        ap.error(str(exc))
    print(json.dumps(res, sort_keys=True))
    if args.describe:
        print(describe_steps(res))
    return 0


def describe_steps(res: dict[str, Any]) -> str:
    """The JSON line's paged-step compiles in words, one block each (skipped ones named)."""
    from planner.compiled_step import describe

    steps = res.get("compiled_step", [])
    if isinstance(steps, dict):
        return f"paged-step compiles skipped: {steps['skipped']}"
    return "\n".join(
        describe(s) if "skipped" not in s else f"{s['target']}: skipped: {s['skipped']}"
        for s in steps
    )


if __name__ == "__main__":
    sys.exit(main())
