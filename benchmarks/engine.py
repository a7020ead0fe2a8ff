"""The serving engine against the jitted ``dsv4.generate`` on ``tiny_v41`` (fp32, CPU by default).

Prints one JSON line: tokens/s of both, the engine's overhead, host against device ms per step,
the per-call cost of a program (bursts, loops) and TTFT / TPOT.
Fields: docs/benchmarks.md#benchmarksengine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks import at_least_one, batch_sizes

DEFAULT_BATCHES = (1, 2, 8, 32)


def _percentiles(values: Sequence[float]) -> dict[str, float | None]:
    import numpy as np

    if not values:
        return {"p50": None, "p90": None, "p99": None}
    arr = np.asarray(values) * 1000
    return {f"p{q}": round(float(np.percentile(arr, q)), 3) for q in (50, 90, 99)}


def _best(fn, repeats: int) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        dt = time.perf_counter() - t0
        if dt < best:
            best, out = dt, result
    return best, out


def _off_main(fn) -> Any:
    """``fn()`` run on a worker thread (its result, or its exception raised here). For a
    first call that compiles: XLA's compiler allocates in the calling thread's malloc arena,
    and a compile on the main thread leaves the engine's host loop there slower for the rest
    of the process (docs/benchmarks.md#benchmarksengine); the engine's warm-up compiles on
    worker threads too."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result()


def _generate_rate(params, cfg, prompts, new_tokens: int, repeats: int) -> float:
    import jax
    import jax.numpy as jnp

    from dsv4.generation import generate

    rows = jnp.asarray(prompts, jnp.int32)

    def call():
        return jax.block_until_ready(generate(params, cfg, rows, new_tokens))

    _off_main(call)  # compile
    t, _ = _best(call, repeats)
    return len(prompts) * new_tokens / t


def _generate_prefill_ms(params, cfg, prompts, repeats: int) -> float:
    """`dsv4.generate`'s time to its first token for ``prompts``: the whole call with
    ``max_new_tokens=1`` (the prefill and one sampled token), best of ``repeats``."""
    import jax
    import jax.numpy as jnp

    from dsv4.generation import generate

    rows = jnp.asarray(prompts, jnp.int32)

    def call():
        return jax.block_until_ready(generate(params, cfg, rows, 1))

    _off_main(call)  # compile
    t, _ = _best(call, repeats)
    return 1000 * t


def _engine_run(llm, prompts, sp, repeats: int) -> dict[str, Any]:
    """Best of ``repeats`` runs of llm.generate: tokens/s, per-step host/wait, metrics."""
    from serving.metrics import compilation_count

    engine = llm.engine
    compiled = compilation_count()
    llm.generate(prompts, sp, use_tqdm=False)  # first run: any lazy host setup
    runs = []
    for _ in range(repeats):
        before = engine.stats.as_dict()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        after = engine.stats.as_dict()
        steps = after["num_steps"] - before["num_steps"]
        runs.append(
            {
                "wall": wall,
                "steps": steps,
                "host_ms_per_step": 1000 * (after["host_s"] - before["host_s"]) / steps,
                "ms_per_step": 1000 * wall / steps,
                "outs": outs,
            }
        )
    best = min(runs, key=lambda r: r["wall"])
    tokens = sum(len(o.outputs[0].token_ids) for o in best["outs"])
    return {
        "tokens_per_s": tokens / best["wall"],
        "steps": best["steps"],
        "host_ms_per_step": best["host_ms_per_step"],
        "ms_per_step": best["ms_per_step"],
        "ttft": [o.metrics.ttft for o in best["outs"]],
        "tpot": [o.metrics.tpot for o in best["outs"] if o.metrics.tpot is not None],
        "compilations": compilation_count() - compiled,
    }


def _device_ms_per_step(llm, batch: int, prompt_len: int, repeats: int) -> tuple[float, float]:
    """The engine's jitted step alone on a decode batch of ``batch`` requests of about
    ``prompt_len`` tokens, best of ``10 * repeats`` calls, and the same step's milliseconds
    inside a loop (`_loop_ms_per_step`).

    The batch is planned as the engine plans one:
    docs/benchmarks.md#benchmarksengine_device_ms_per_step.
    """
    import jax
    import numpy as np

    from serving import sampler as S
    from serving.config import SchedulerConfig
    from serving.input_batch import InputBatch
    from serving.sampling_params import SamplingParams
    from serving.scheduler import Scheduler, StopCriteria

    runner = llm.engine.runner
    manager = llm.engine.kv_cache_manager
    sched = SchedulerConfig(max_num_seqs=batch, async_scheduling=False,
                            max_num_batched_tokens=llm.engine.scheduler.max_num_batched_tokens)  # fmt: skip
    scheduler = Scheduler(manager, sched, max_model_len=runner.max_model_len)
    inputs = InputBatch(batch, engram_lookback=llm.cfg.engram_lookback)
    rng = np.random.default_rng(1)  # prompts nobody else sends: no prefix hit on these blocks
    ids = [f"device{i}" for i in range(batch)]
    room = runner.max_model_len - prompt_len  # the requests never end while this plans
    for request_id in ids:
        prompt = rng.integers(3, llm.cfg.vocab_size, prompt_len).tolist()
        request = manager.new_request(request_id, prompt, max_tokens=room)
        scheduler.add_request(request, StopCriteria())
    while True:
        output = scheduler.schedule()
        inputs.update(output)
        for new in output.scheduled_new_reqs:
            inputs.admit(new, prompt_len)
        rows, step_requests = inputs.schedule(output)
        if len(rows) == batch and all(r.num_tokens == 1 and r.start >= prompt_len for r in rows):
            break  # every request decodes one token: time this step
        sampled = {r.request_id: [5] for r in rows if r.samples}
        for request_id, tokens in sampled.items():
            inputs.learn(request_id, tokens)
        scheduler.update_from_output(output, sampled)
    step_batch = runner.step_batch(step_requests, batch)
    t, r = step_batch.token_ids.shape[0], step_batch.seq_lens.shape[0]
    params = SamplingParams(temperature=0.0)
    samples = [S.RowSampling(params, np.zeros(2, np.uint32), prompt_len + 1, i)
               for i in range(batch)]  # fmt: skip
    sampling = S.build_sampling_batch(samples, r, runner.padding_slot)
    none = np.full(t, -1, np.int32)
    args = jax.device_put((step_batch, none, sampling))

    def call():
        return jax.block_until_ready(runner.dispatch(args[0], args[1], args[2], args[1]))

    _off_main(call)
    best, _ = _best(call, 10 * repeats)
    loop = _loop_ms_per_step(runner, args, repeats)
    scheduler.finish_requests(ids)  # their blocks go back to the engine's pool
    return 1000 * best, loop


def _loop_ms_per_step(runner, args, repeats: int, steps: int = 16) -> float:
    """Milliseconds a step of the engine's jitted step costs inside one program that runs it
    ``steps`` times: the runner's burst program (`ModelRunner.dispatch_burst`) on ``steps``
    copies of the step's inputs, run for ``steps`` steps and for 1 (its trip count is an
    argument: one program for both), the runner's pools and slot state carried through."""
    import jax
    import numpy as np

    batch, feed, sampling = args
    stacked = jax.tree.map(
        lambda x: np.stack([np.asarray(x)] * steps), (batch, feed, sampling, feed)
    )

    def call(n):
        jax.block_until_ready(runner.dispatch_burst(*stacked, np.int32(n)))

    _off_main(lambda: call(1))  # compile
    one, _ = _best(lambda: call(1), 3 * repeats)
    many, _ = _best(lambda: call(steps), 3 * repeats)
    return 1000 * max(many - one, 0.0) / (steps - 1)


def measure(
    batches: Sequence[int],
    prompt_len: int,
    new_tokens: int,
    repeats: int,
    max_num_batched_tokens: int,
    num_scheduler_steps: int | None = None,
    token_buckets: tuple[int, ...] | None = None,
    runs: int = 1,
    num_gpu_blocks: int | None = 0,
) -> dict[str, Any]:
    """Every batch's run (`_one_run`) on engines built once for the largest batch, with a pool
    of ``num_gpu_blocks`` blocks (0: 64 per request of the largest batch; None: `LLM`'s own
    memory budget)."""
    import jax
    import numpy as np

    from serving.llm import LLM
    from serving.sampling_params import SamplingParams

    max_seqs = max(batches)
    common = dict(
        dtype="float32",
        max_model_len=prompt_len + new_tokens + 8,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        token_buckets=token_buckets,  # None: the engine's own (what LLM and the CLI use)
        num_gpu_blocks_override=64 * max_seqs if num_gpu_blocks == 0 else num_gpu_blocks,
        compilation_cache_dir=None,
    )
    t0 = time.perf_counter()
    # the engine as LLM runs it (None: its default bursts), one step a program (async), sync
    llms = {"engine": LLM("tiny_v41", num_scheduler_steps=num_scheduler_steps, **common),
            "single": LLM("tiny_v41", num_scheduler_steps=1, **common),
            "sync": LLM("tiny_v41", async_scheduling=False, **common)}  # fmt: skip
    start_up = round(time.perf_counter() - t0, 2)
    params, cfg = llms["engine"].engine.runner.params, llms["engine"].cfg
    rng = np.random.default_rng(0)
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    results = {}
    for b in batches:
        prompts = rng.integers(3, cfg.vocab_size, (b, prompt_len)).tolist()
        rows = [_one_run(llms, params, cfg, b, prompts, sp, prompt_len, repeats)
                for _ in range(runs)]  # fmt: skip
        results[f"batch_{b}"] = _median_run(rows)
    return {
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0]),
        "cpu_count": os.cpu_count(),
        "token_buckets": list(llms["engine"].engine.runner.token_buckets),
        # the pool every batch ran on (on XLA:CPU its size changes the device step: see
        # docs/benchmarks.md#benchmarksengine)
        "num_gpu_blocks": llms["engine"].engine.kv_cache_manager.block_pool.num_gpu_blocks,
        "kv_pool_mib": round(llms["engine"].engine.runner.layout.pool_bytes() / 2**20, 2),
        "num_scheduler_steps": llms["engine"].engine.runner.num_scheduler_steps,
        # both engines built (the second reuses the first one's compiled buckets)
        "start_up_s": start_up,
        "warm_up_s": round(llms["sync"].engine.stats.warm_up_s, 2),
        "warm_up_compilations": llms["sync"].engine.stats.warm_up_compilations,
        "results": results,
    }


def _one_run(llms, params, cfg, b: int, prompts, sp, prompt_len: int, repeats: int) -> dict:
    """One run of batch ``b``: `dsv4.generate` and each engine mode side by side."""
    gen = _generate_rate(params, cfg, prompts, sp.max_tokens, repeats)
    prefill = _generate_prefill_ms(params, cfg, prompts, repeats)
    sync = _engine_run(llms["sync"], prompts, sp, repeats)
    single = _engine_run(llms["single"], prompts, sp, repeats)
    engine = _engine_run(llms["engine"], prompts, sp, repeats)
    device, loop = _device_ms_per_step(llms["sync"], b, prompt_len, repeats)
    return _batch_row(b, gen, prefill, sync, single, engine, device, loop)


def _median_run(rows: list[dict]) -> dict:
    """The run with the median engine-over-generate ratio, and every run's ratios (the spread
    from run to run, which a noisy machine makes wide)."""
    ordered = sorted(rows, key=lambda r: r["engine_over_generate"])
    out = dict(ordered[(len(ordered) - 1) // 2])
    for key in ("engine_over_generate", "single_over_generate", "async_speedup",
                "ttft_over_generate_prefill"):  # fmt: skip
        out[f"{key}_runs"] = [r[key] for r in rows]
    return out


def table(result: dict[str, Any]) -> str:
    """README.md's engine table: per batch, the time per token of the engine (as `LLM` runs it,
    and one step a program) over `dsv4.generate`'s, with the spread over the runs."""
    lines = [
        f"`python -m benchmarks.engine --runs {result['runs']}` ({result['model']}, "
        f"{result['dtype']}, {result['backend']}, {result['cpu_count']} cores; the engine as "
        f"`LLM` runs it: bursts of up to {result['num_scheduler_steps']} decode steps"
        f"{_pool(result)}; time per token over `dsv4.generate`'s, median run [lowest, highest]):",
        "",
        "| batch | generate tokens/s | engine tokens/s | engine / generate | one step a program "
        "/ generate | TTFT / prefill | host ms/step | host ms/step, one step a program "
        "| device ms/step, one step a program |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(result["results"].values(), key=lambda r: r["batch"]):
        ratios, singles = r["engine_over_generate_runs"], r["single_over_generate_runs"]
        lines.append(
            f"| {r['batch']} | {r['generate_tokens_per_s']:.0f} | "
            f"{r['engine_tokens_per_s']:.0f} | {r['engine_over_generate']:.2f} "
            f"[{min(ratios):.2f}, {max(ratios):.2f}] | {r['single_over_generate']:.2f} "
            f"[{min(singles):.2f}, {max(singles):.2f}] | {_ttft(r)} | "
            f"{r['engine_host_ms_per_step']:.2f} | {r['host_ms_per_step']:.2f} | "
            f"{r['device_ms_per_step']:.2f} |"
        )
    return "\n".join(lines)


def _pool(result: dict) -> str:
    """The table's words for the pool the run used ("" in a result from before it was kept)."""
    blocks = result.get("num_gpu_blocks")
    return "" if blocks is None else f", a pool of {blocks} blocks ({result['kv_pool_mib']} MiB)"


def _ttft(row: dict) -> str:
    """The row's TTFT (p50) over `dsv4.generate`'s prefill: the median over the runs with their
    range (one request's first token varies more from run to run than the whole run's rate),
    the median run's alone in a result from before the runs were kept, "-" before that."""
    import statistics

    runs = row.get("ttft_over_generate_prefill_runs")
    if runs:
        return f"{statistics.median(runs):.2f} [{min(runs):.2f}, {max(runs):.2f}]"
    ratio = row.get("ttft_over_generate_prefill")
    return "-" if ratio is None else f"{ratio:.2f}"


def _batch_row(
    b: int, gen: float, prefill: float, sync: dict, single: dict, engine: dict, device, loop
) -> dict:
    """One batch size's row: generate's and each engine mode's rates, per-step times, latencies
    (``engine``: as `LLM` runs it; ``single``: asynchronous, one step a program)."""
    return {
        "batch": b,
        "generate_tokens_per_s": round(gen, 1),
        "engine_tokens_per_s": round(engine["tokens_per_s"], 1),
        "engine_over_generate": round(gen / engine["tokens_per_s"], 3),
        "engine_ms_per_step": round(engine["ms_per_step"], 3),
        "engine_host_ms_per_step": round(engine["host_ms_per_step"], 3),
        "engine_sync_tokens_per_s": round(sync["tokens_per_s"], 1),
        "engine_single_tokens_per_s": round(single["tokens_per_s"], 1),
        "single_over_generate": round(gen / single["tokens_per_s"], 3),
        "async_speedup": round(single["tokens_per_s"] / sync["tokens_per_s"], 3),
        "steps": engine["steps"],
        "host_ms_per_step": round(sync["host_ms_per_step"], 3),
        "device_ms_per_step": round(device, 3),
        "loop_ms_per_step": round(loop, 3),
        "sync_ms_per_step": round(sync["ms_per_step"], 3),
        "single_ms_per_step": round(single["ms_per_step"], 3),
        "ttft_ms": _percentiles(engine["ttft"]),
        "generate_prefill_ms": round(prefill, 3),
        "ttft_over_generate_prefill": round(_percentiles(engine["ttft"])["p50"] / prefill, 3),
        "tpot_ms": _percentiles(engine["tpot"]),
        "engine_compilations": sum(r["compilations"] for r in (sync, single, engine)),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default=",".join(map(str, DEFAULT_BATCHES)))
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--num-scheduler-steps", type=int, help="bursts (default: LLM's)")
    parser.add_argument("--runs", type=int, default=1, help="runs per batch (the spread)")
    parser.add_argument(
        "--num-gpu-blocks",
        default="0",
        help="the engines' pool in blocks; 0 (default): 64 per request of the largest batch; "
        "llm: LLM's own memory budget",
    )
    parser.add_argument("--table", action="store_true", help="print the README's markdown table")
    parser.add_argument(
        "--token-buckets",
        default=None,
        help="step sizes to compile, comma-separated (default: the engine's, as LLM uses)",
    )
    args = parser.parse_args(argv)
    batches = batch_sizes(parser, args.batches)
    buckets = (
        None
        if args.token_buckets is None
        else batch_sizes(parser, args.token_buckets, "--token-buckets")
    )
    at_least_one(
        parser,
        args,
        "prompt_len",
        "new_tokens",
        "repeats",
        "max_num_batched_tokens",
        "num_scheduler_steps",
        "runs",
    )
    num_gpu_blocks = _num_gpu_blocks(parser, args.num_gpu_blocks)
    if args.prompt_len + args.new_tokens + 8 > 512:
        parser.error("--prompt-len + --new-tokens must stay under tiny_v41's 504 tokens")
    t0 = time.perf_counter()
    out = {
        "benchmark": "engine",
        "model": "tiny_v41",
        "dtype": "float32",
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "runs": args.runs,
        "python": platform.python_version(),
    }
    out.update(
        measure(
            batches,
            args.prompt_len,
            args.new_tokens,
            args.repeats,
            args.max_num_batched_tokens,
            args.num_scheduler_steps,
            buckets,
            args.runs,
            num_gpu_blocks,
        )
    )
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(table(out) if args.table else json.dumps(out, sort_keys=True))
    return 0


def _num_gpu_blocks(parser: argparse.ArgumentParser, value: str) -> int | None:
    """``--num-gpu-blocks``: an int >= 0 (0: the default pool), or "llm" (None)."""
    if value == "llm":
        return None
    try:
        blocks = int(value)
    except ValueError:
        blocks = -1
    if blocks < 0:
        parser.error(f"--num-gpu-blocks={value!r}: allowed are an int >= 0 or 'llm'")
    return blocks


if __name__ == "__main__":
    sys.exit(main())
