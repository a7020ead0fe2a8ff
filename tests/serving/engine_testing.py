"""Shared pieces of the engine tests: one engine configuration (so that every test reuses the
same compiled step), seeded workloads, a driver that adds requests at given steps and aborts
others, and the reference tokens of `dsv4.generate`."""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

import dsv4
from serving.config import EngineConfig
from serving.engine import Engine
from serving.outputs import RequestOutput
from serving.sampling_params import SamplingParams

MAX_MODEL_LEN = 128
TOKEN_BUCKET = 32  # the only step size: every test shares one compilation per pool layout
MAX_NUM_SEQS = 4
NUM_BLOCKS = 24  # tight: two long requests do not fit together, so the scheduler preempts


# `LLM`'s keywords for the same engine sizes (the tests of `LLM` share its compiled step)
LLM_ARGS = dict(
    dtype="float32",
    max_model_len=MAX_MODEL_LEN,
    max_num_seqs=MAX_NUM_SEQS,
    max_num_batched_tokens=TOKEN_BUCKET,
    num_gpu_blocks_override=NUM_BLOCKS,
    token_buckets=(TOKEN_BUCKET,),
    max_logprobs=5,
    compilation_cache_dir=None,
)


def make_engine(params, cfg, **kw) -> Engine:
    """The tests' engine: fp32 exact records, NaN-filled pools (a wrong read poisons the
    logits), a 32-token bucket, 4 requests at most, 24 blocks of 16 / 4 tokens; ``kw`` are
    `EngineConfig.from_kwargs`'s."""
    args = dict(
        LLM_ARGS,
        kv_cache_dtype="exact",
        block_size=16,
        swa_block_size=4,
        fill="nan",
        debug=True,
    )
    args.update(kw)
    engine = Engine.build(params, cfg, EngineConfig.from_kwargs(**args))
    engine.warm_up(progress=False)
    return engine


@dataclasses.dataclass(frozen=True)
class Arrival:
    step: int  # engine steps taken before it is added
    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams


def workload(cfg, seed: int, num_requests: int = 8, *, spread: int = 12, **params_kw):
    """Ragged prompts arriving at random steps, greedy unless ``params_kw`` says otherwise:
    a quarter behind each of two shared prefixes (siblings: from the third on they hit the
    window state the second one keeps at the junction), and a quarter that resend an earlier
    request's prompt with a new tail (a later chat turn: it hits at the old prompt's end)."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(3, cfg.vocab_size, int(n)).tolist() for n in (24, 37)]
    arrivals: list[Arrival] = []
    for i in range(num_requests):
        tail = rng.integers(3, cfg.vocab_size, int(rng.integers(1, 20))).tolist()
        step = int(rng.integers(0, spread))
        if i % 4 < 2:
            prompt = prefixes[i % 2] + tail
        elif i % 4 == 2 and i >= 4:
            earlier = arrivals[i - 4]
            prompt, step = list(earlier.prompt)[:44] + tail, earlier.step + spread
        else:
            prompt = tail + rng.integers(3, cfg.vocab_size, 20).tolist()
        kw = dict(temperature=0.0, max_tokens=int(rng.integers(1, 14)), ignore_eos=True)
        kw.update(params_kw)
        arrivals.append(Arrival(step, f"req{i}", tuple(prompt), SamplingParams(**kw)))
    return sorted(arrivals, key=lambda a: a.step)


def drive(engine: Engine, arrivals, *, aborts: dict[int, str] | None = None, max_steps: int = 2000):
    """Step the engine until every arrival has come and gone; returns the final output of
    every request and the number of running requests after each step."""
    pending = list(arrivals)
    finals: dict[str, RequestOutput] = {}
    running = []
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            engine.add_request(a.request_id, list(a.prompt), a.params)
        if aborts and step in aborts:
            engine.abort_request(aborts[step])
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finals, f"{out.request_id} finished twice"
                finals[out.request_id] = out
        running.append(len(engine.scheduler.running))
        step += 1
        assert step < max_steps, "the workload does not finish"
    return finals, running


def assert_pool_is_whole(engine: Engine) -> None:
    """Every block back in the free queue (of every data shard), no request left anywhere."""
    for manager in engine.kv_cache_managers:
        assert manager.num_free_blocks == manager.kv_cache_config.num_blocks - 1
        assert manager.usage == 0.0
    assert not engine.scheduler.requests and not engine.runner.requests
    assert engine.runner.num_free_slots == engine.runner.max_num_seqs * engine.data_parallel_size


REF_WIDTH, REF_NEW = 64, 16  # fixed shapes: `dsv4.generate` compiles once per batch size


@functools.cache
def _generate(params_id, cfg, prompts):
    params = _PARAMS[params_id]
    rows = np.zeros((len(prompts), REF_WIDTH), np.int32)
    for i, p in enumerate(prompts):
        rows[i, : len(p)] = p
    out = dsv4.generate(
        params, cfg, jnp.asarray(rows), REF_NEW, prompt_lengths=[len(p) for p in prompts]
    )
    return np.asarray(out)


_PARAMS: dict[int, object] = {}


def reference_tokens(params, cfg, arrivals) -> dict[str, list[int]]:
    """Greedy `dsv4.generate` of every arrival's prompt (one batch), cut to its max_tokens."""
    _PARAMS[id(params)] = params
    prompts = tuple(a.prompt for a in arrivals)
    assert max(a.params.max_tokens for a in arrivals) <= REF_NEW
    out = _generate(id(params), cfg, prompts)
    return {a.request_id: out[i, : a.params.max_tokens].tolist() for i, a in enumerate(arrivals)}
