"""How a decode step's time grows with the batch: ``dsv4.generate`` and the paged step, ``tiny_v41``.

Prints one JSON line: ms per decode step per batch size for ``generate``, the paged step, the
step's matmuls alone and the step without its matmuls, measured side by side.
Fields: docs/benchmarks.md#benchmarksdecode_scaling.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks import batch_sizes, run_and_print, tiny_v41_header

DEFAULT_BATCHES = (1, 2, 4, 8)
PATHS = ("generate", "paged", "matmuls", "rest")
BLOCK_SIZE, SWA_BLOCK_SIZE = 16, 4  # the paged test harness's blocks (tests/dsv4/paged_harness)


def _seconds(fn: Callable[[], Any]) -> float:
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def _prompts(cfg: Any, batch: int, prompt_len: int, seed: int) -> Any:
    import jax
    import jax.numpy as jnp

    key = jax.random.PRNGKey(seed + batch)
    # ids 3.. (skip the byte tokenizer's specials)
    return jax.random.randint(key, (batch, prompt_len), 3, cfg.vocab_size, jnp.int32)


class GenerateCase:
    """Timed calls of ``dsv4.generation.generate`` for one batch size."""

    def __init__(self, params: Any, cfg: Any, prompt: Any, new_tokens: int) -> None:
        from dsv4 import generation

        self._start(lambda n: generation.generate(params, cfg, prompt, n), new_tokens)

    def _start(self, run: Callable[[int], Any], new_tokens: int) -> None:
        """Time ``run(n)`` (n new tokens) at n = ``new_tokens`` and 1; compiles both."""
        self.run = run
        self.new_tokens = new_tokens
        self.best = {new_tokens: float("inf"), 1: float("inf")}
        for n in self.best:
            _seconds(lambda n=n: self.run(n))  # compile

    def measure(self) -> None:
        for n in self.best:
            self.best[n] = min(self.best[n], _seconds(lambda n=n: self.run(n)))

    def ms_per_step(self) -> float:
        steps = self.new_tokens - 1
        return 1000 * max(self.best[self.new_tokens] - self.best[1], 0.0) / steps


class RestCase(GenerateCase):
    """`GenerateCase` with every matrix product replaced by a stand-in that reads its operands and
    multiplies nothing: what the decode step costs apart from its products.

    The stand-in replaces ``jnp.einsum`` while this case's own jit traces, and the traced program is
    checked to hold no ``dot_general``.
    Details: docs/benchmarks.md#benchmarksdecode_scalingrestcase.
    """

    def __init__(self, params: Any, cfg: Any, prompt: Any, new_tokens: int) -> None:
        import functools

        import jax
        import jax.numpy as jnp

        from dsv4 import generation

        raw = generation._generate.__wrapped__  # a jit of our own: the shared one's cache
        lengths = jnp.full((prompt.shape[0],), prompt.shape[1], jnp.int32)  # stays clean
        args = (params, prompt, lengths, jax.random.PRNGKey(0), jnp.float32(0), jnp.float32(1))
        compiled = {}
        einsum = jnp.einsum

        def stand_in(spec, *operands, **kwargs):
            out = jax.eval_shape(lambda *o: einsum(spec, *o, **kwargs), *operands)
            total = sum(jnp.sum(o, dtype=jnp.float32) for o in operands)
            return jnp.broadcast_to(total.astype(out.dtype), out.shape)

        jnp.einsum = stand_in
        try:
            for n in (new_tokens, 1):
                fn = jax.jit(
                    functools.partial(raw, cfg=cfg, max_new_tokens=n, eos_token_id=None, mesh=None)
                )
                if matmuls_of(jax.make_jaxpr(fn)(*args).jaxpr):
                    raise RuntimeError("a matrix product escaped the stand-in")
                compiled[n] = fn.lower(*args).compile()
        finally:
            jnp.einsum = einsum
        self._start(lambda n: compiled[n](*args), new_tokens)


class PagedCase:
    """Timed decode calls of the paged step for ``batch`` requests whose prompts are cached.

    The host side is the engine's (pools from the allocator's `KVCacheConfig`, `serving.Scheduler`
    plans a prefill then a decode step, `serving.InputBatch` and `build_batch` make the batch); the
    decode batch is then replayed, every timed call writing the same slots.
    """

    def __init__(self, params: Any, cfg: Any, prompt: Any, *, max_model_len: int,
                 num_blocks: int, calls: int, token_bucket: int | None,
                 request_bucket: int | None) -> None:  # fmt: skip
        import jax
        import numpy as np

        from cache import KVCacheManager
        from cache.layout import for_model
        from dsv4.paged import pools as P
        from dsv4.paged import records as R
        from dsv4.paged.batch import rows_needed
        from serving.config import SchedulerConfig
        from serving.input_batch import InputBatch
        from serving.scheduler import Scheduler, StopCriteria

        batch, prompt_len = prompt.shape
        formats = R.CacheFormats.EXACT
        desc = P.cache_desc(cfg, formats, block_size=BLOCK_SIZE, swa_block_size=SWA_BLOCK_SIZE)
        self.config = for_model(desc, num_gpu_blocks_override=num_blocks)
        self.layout = P.PoolLayout.build(cfg, self.config, formats, "aliased")
        self.pools = P.init_pools(self.layout)
        budget = batch * prompt_len
        mgr = KVCacheManager(self.config, max_model_len, enable_caching=False,
                             max_num_batched_tokens=budget)  # fmt: skip
        sched = SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=budget,
                                async_scheduling=False)  # fmt: skip
        scheduler = Scheduler(mgr, sched, max_model_len=max_model_len)
        self.params, self.cfg, self.calls = params, cfg, calls
        self.max_model_len = max_model_len
        self.token_bucket = token_bucket or batch
        # a decode of B requests: B tokens, padding when the token bucket is larger
        self.request_bucket = request_bucket or rows_needed(batch, batch, self.token_bucket)
        rows = np.asarray(jax.device_get(prompt))
        for i in range(batch):
            request = mgr.new_request(f"r{i}", rows[i].tolist(), max_tokens=2)
            scheduler.add_request(request, StopCriteria())
        inputs = InputBatch(batch, engram_lookback=cfg.engram_lookback)

        def plan(num_tokens: int, token_bucket: int, request_bucket: int) -> Any:
            output = scheduler.schedule()
            inputs.update(output)
            for new in output.scheduled_new_reqs:
                inputs.admit(new, prompt_len)
            if output.total_num_scheduled_tokens != num_tokens:
                raise ValueError(f"{num_blocks} blocks cannot hold {batch} requests")
            _, step_requests = inputs.schedule(output)
            return output, self._batch(step_requests, token_bucket, request_bucket)

        output, prefill = plan(budget, budget, batch + 1)
        self._step(prefill)
        # any sampled token will do: the timed step's cost does not depend on it
        sampled = {f"r{i}": [int(rows[i, -1])] for i in range(batch)}
        for request_id, tokens in sampled.items():
            inputs.learn(request_id, tokens)
        scheduler.update_from_output(output, sampled)
        _, self.decode = plan(batch, self.token_bucket, self.request_bucket)
        self._step(self.decode)  # compile
        self.best = float("inf")

    def _batch(self, step_requests, token_bucket: int, request_bucket: int) -> Any:
        import jax
        import jax.numpy as jnp

        from dsv4.paged.batch import build_batch

        batch = build_batch(step_requests, self.config, max_model_len=self.max_model_len,
                            token_buckets=(token_bucket,), request_buckets=(request_bucket,),
                            engram_lookback=self.cfg.engram_lookback)  # fmt: skip
        return jax.tree.map(jnp.asarray, batch)

    def _step(self, batch: Any) -> Any:
        from dsv4.paged import step

        logits, self.pools = step.paged_step_jit(
            self.params, self.pools, batch, cfg=self.cfg, layout=self.layout
        )
        return logits

    def measure(self) -> None:
        import jax

        t0 = time.perf_counter()
        for _ in range(self.calls):
            logits = self._step(self.decode)
        jax.block_until_ready(logits)
        self.best = min(self.best, (time.perf_counter() - t0) / self.calls)

    def ms_per_step(self) -> float:
        return 1000 * self.best


def _step_matmuls(params: Any, cfg: Any, batch: int, max_len: int) -> list[tuple[Any, ...]]:
    """Every ``dot_general`` of one decode step of ``dsv4.model.forward_step`` (one token for
    each of ``batch`` rows, the step `generate` runs in its loop): (lhs aval, rhs aval,
    dimension numbers, preferred element type), found by walking the step's jaxpr and the
    jaxprs nested in it (each counted once: the step has no matmul inside a loop)."""
    import jax
    import jax.numpy as jnp

    from dsv4 import model

    cache = model.init_cache(cfg, batch, max_len)
    start = jnp.full((batch,), max_len - 1, jnp.int32)
    closed = jax.make_jaxpr(
        lambda p, c, t, s: model.forward_step(p, cfg, c, t, s, jnp.ones((batch,), jnp.int32))
    )(params, cache, jnp.zeros((batch, 1), jnp.int32), start)
    return matmuls_of(closed.jaxpr)


def matmuls_of(jaxpr: Any) -> list[tuple[Any, ...]]:
    """The ``dot_general`` equations of a jaxpr and of every jaxpr nested in it (loop bodies and
    cond branches counted once each): (lhs aval, rhs aval, dimension numbers, preferred type)."""
    found: list[tuple[Any, ...]] = []

    def walk(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                lhs, rhs = (v.aval for v in eqn.invars)
                found.append((lhs, rhs, eqn.params["dimension_numbers"],
                              eqn.params["preferred_element_type"]))  # fmt: skip
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jaxpr)
    return found


def matmul_flops(matmuls: Sequence[tuple[Any, ...]]) -> float:
    total = 0.0
    for lhs, rhs, ((_, rc), (_, rb)), _ in matmuls:
        free_rhs = [d for i, d in enumerate(rhs.shape) if i not in rc and i not in rb]
        total += 2.0 * math.prod(lhs.shape) * math.prod(free_rhs)
    return total


class MatmulCase:
    """The matmuls of one decode step alone, timed: the same shapes and dimension numbers on
    seeded random operands, back to back in a jitted loop of ``calls`` steps (each matmul's
    smaller operand is shifted by a value of the previous one, so that nothing is hoisted out
    of the loop or run out of order). What a step at this batch would cost if everything else
    in it were free."""

    def __init__(self, params: Any, cfg: Any, batch: int, max_len: int, calls: int) -> None:
        import jax
        import jax.numpy as jnp

        self.matmuls = _step_matmuls(params, cfg, batch, max_len)
        self.flops = matmul_flops(self.matmuls)
        key = jax.random.PRNGKey(batch)
        operands = []
        for i, (lhs, rhs, _, _) in enumerate(self.matmuls):
            ka, kb = jax.random.split(jax.random.fold_in(key, i))
            operands.append((jax.random.normal(ka, lhs.shape, lhs.dtype),
                             jax.random.normal(kb, rhs.shape, rhs.dtype)))  # fmt: skip
        specs = [(dims, pref) for _, _, dims, pref in self.matmuls]

        def run(operands):
            def one_step(_, carry):
                for (a, b), (dims, pref) in zip(operands, specs):
                    if a.size <= b.size:
                        a = a + carry.astype(a.dtype)
                    else:
                        b = b + carry.astype(b.dtype)
                    y = jax.lax.dot_general(a, b, dims, preferred_element_type=pref)
                    carry = jnp.mean(y.astype(jnp.float32)) * 1e-9
                return carry

            return jax.lax.fori_loop(0, calls, one_step, jnp.float32(0))

        self.run = jax.jit(run)
        self.operands = operands
        self.calls = calls
        jax.block_until_ready(self.run(operands))  # compile
        self.best = float("inf")

    def measure(self) -> None:
        self.best = min(self.best, _seconds(lambda: self.run(self.operands)) / self.calls)

    def ms_per_step(self) -> float:
        return 1000 * self.best


def _ratio(ms: dict[str, float], batches: Sequence[int]) -> dict[str, float]:
    lo, hi = min(batches), max(batches)
    if lo == hi or not ms[str(lo)]:
        return {}
    return {f"ratio_b{hi}_over_b{lo}": round(ms[str(hi)] / ms[str(lo)], 3)}


def _check_args(
    cfg, batches, prompt_len, new_tokens, repeats, paged_calls, token_bucket, request_bucket
) -> None:
    """Refuse sizes the benchmark cannot run, naming the value."""
    from dsv4.paged.batch import rows_needed

    if prompt_len < 1 or new_tokens < 2 or prompt_len + new_tokens > cfg.max_seq_len:
        raise ValueError(
            f"prompt_len={prompt_len} >= 1 and new_tokens={new_tokens} >= 2 must fit "
            f"max_seq_len {cfg.max_seq_len}"
        )
    if repeats < 1 or paged_calls < 1 or not batches or min(batches) < 1:
        raise ValueError(f"repeats={repeats}, paged_calls={paged_calls} and batches must be >= 1")
    if token_bucket is not None and token_bucket < max(batches):
        raise ValueError(f"token_bucket={token_bucket} cannot hold batch {max(batches)}")
    rows = max(rows_needed(b, b, token_bucket or b) for b in batches)
    if request_bucket is not None and request_bucket < rows:
        raise ValueError(
            f"request_bucket={request_bucket} cannot hold {rows} rows (batch {max(batches)}, "
            "and a row for padding tokens when the token bucket is larger)"
        )


def _cases(
    params,
    cfg,
    batches,
    paths,
    prompt_len,
    new_tokens,
    seed,
    *,
    num_blocks,
    paged_calls,
    token_bucket,
    request_bucket,
) -> dict[tuple[str, int], Any]:
    """One case per (path, batch): built (and compiled) once, measured in alternation."""
    max_model_len = prompt_len + new_tokens
    cases: dict[tuple[str, int], Any] = {}
    for b in batches:
        prompt = _prompts(cfg, b, prompt_len, seed)
        if "generate" in paths:
            cases[("generate", b)] = GenerateCase(params, cfg, prompt, new_tokens)
        if "matmuls" in paths:
            cases[("matmuls", b)] = MatmulCase(params, cfg, b, max_model_len, new_tokens)
        if "rest" in paths:
            cases[("rest", b)] = RestCase(params, cfg, prompt, new_tokens)
        if "paged" in paths:
            cases[("paged", b)] = PagedCase(
                params,
                cfg,
                prompt,
                max_model_len=max_model_len,
                num_blocks=num_blocks,
                calls=paged_calls,
                token_bucket=token_bucket,
                request_bucket=request_bucket,
            )
    return cases


def _over_smallest_whole_step(out: dict[str, Any], path: str, batches: Sequence[int]) -> None:
    """``path``'s largest-batch step over generate's smallest-batch whole step (None when the
    latter measured 0: too few --new-tokens to time it). For the matmuls path it is the floor
    argument (the products alone of the largest batch against a 2x budget); for the rest path,
    what the step costs without its products."""
    lo, hi = str(min(batches)), str(max(batches))
    whole = out["generate"]["ms_per_step"][lo]
    part = out[path]["ms_per_step"][hi]
    out[path][f"b{hi}_over_generate_b{lo}"] = round(part / whole, 3) if whole else None


def _summary(out: dict[str, Any], cases, batches, paths, paged: dict[str, Any]) -> None:
    """Add each path's per-step times, ratios and extra figures to ``out`` (``paged``: the
    paged path's settings, reported beside its figures)."""
    for path in paths:
        ms = {str(b): round(cases[(path, b)].ms_per_step(), 4) for b in batches}
        out[path] = {"ms_per_step": ms, **_ratio(ms, batches)}
    compare = "generate" in paths and len(batches) > 1
    if "matmuls" in paths:
        flops = {str(b): cases[("matmuls", b)].flops for b in batches}
        out["matmuls"].update(
            count=len(cases[("matmuls", max(batches))].matmuls),
            mflop_per_step={b: round(f / 1e6, 3) for b, f in flops.items()},
            gflop_per_s={
                b: round(f / 1e6 / max(out["matmuls"]["ms_per_step"][b], 1e-9), 2)
                for b, f in flops.items()
            },
        )
        if compare:
            _over_smallest_whole_step(out, "matmuls", batches)
    if "rest" in paths and compare:
        _over_smallest_whole_step(out, "rest", batches)
    if "paged" in paths:
        out["paged"].update(
            **paged,
            token_bucket={str(b): cases[("paged", b)].token_bucket for b in batches},
            request_bucket={str(b): cases[("paged", b)].request_bucket for b in batches},
        )


def run_benchmark(
    *,
    batches: Sequence[int] = DEFAULT_BATCHES,
    prompt_len: int = 32,
    new_tokens: int = 48,
    repeats: int = 5,
    paged_calls: int = 30,
    token_bucket: int | None = None,
    request_bucket: int | None = None,
    paths: Sequence[str] = PATHS,
    seed: int = 0,
) -> dict[str, Any]:
    """Build seeded ``tiny_v41`` params, measure every batch size on every path side by side:
    the dict ``main`` prints."""
    import jax

    from dsv4.config import tiny_v41
    from dsv4.params import init_params

    t0 = time.perf_counter()
    cfg = tiny_v41()
    max_model_len = prompt_len + new_tokens
    _check_args(cfg, batches, prompt_len, new_tokens, repeats, paged_calls, token_bucket,
                request_bucket)  # fmt: skip
    params = init_params(cfg, jax.random.PRNGKey(seed))
    # one pool size for every batch (the step reads pages by table while the pool is larger):
    # a request needs its compressed and ring blocks plus window blocks for max_model_len
    num_blocks = 1 + max(batches) * (4 + 4 * -(-max_model_len // SWA_BLOCK_SIZE))
    cases = _cases(params, cfg, batches, paths, prompt_len, new_tokens, seed,
                   num_blocks=num_blocks, paged_calls=paged_calls, token_bucket=token_bucket,
                   request_bucket=request_bucket)  # fmt: skip
    for _ in range(repeats):
        for case in cases.values():
            case.measure()
    out: dict[str, Any] = {
        **tiny_v41_header("decode_scaling", cfg),
        "batches": list(batches),
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "sampling": "greedy, no eos",
    }
    paged = {"calls": paged_calls, "num_blocks": num_blocks, "max_model_len": max_model_len}
    _summary(out, cases, batches, paths, paged)
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    return out


# the flags `run_benchmark` takes as they are parsed
_FLAGS_AS_GIVEN = (
    "prompt_len",
    "new_tokens",
    "repeats",
    "paged_calls",
    "token_bucket",
    "request_bucket",
    "seed",
)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default=",".join(map(str, DEFAULT_BATCHES)))
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=48, help="generate: N of the timed call")
    ap.add_argument("--repeats", type=int, default=5, help="rounds over every case; best counts")
    ap.add_argument("--paged-calls", type=int, default=30, help="paged: warm calls per round")
    ap.add_argument("--token-bucket", type=int, default=None, help="paged: fix T for every B")
    ap.add_argument("--request-bucket", type=int, default=None, help="paged: fix R for every B")
    ap.add_argument("--paths", default=",".join(PATHS), help="a comma list of paths")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    batches = batch_sizes(ap, args.batches)
    paths = tuple(p for p in args.paths.split(",") if p)
    if not paths or not set(paths) <= set(PATHS):
        ap.error(f"--paths must be a comma list from {','.join(PATHS)}, got {args.paths!r}")
    return run_and_print(ap, run_benchmark, args, *_FLAGS_AS_GIVEN, batches=batches, paths=paths)


if __name__ == "__main__":
    sys.exit(main())
