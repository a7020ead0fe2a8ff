"""The engine end to end against `dsv4.generate` (greedy, fp32, exact records), and the
asynchronous engine against the synchronous one.

Workloads: ragged prompts arriving at random steps, shared prefixes (real prefix-cache hits),
chunked prefill under small token budgets, a pool too small for the batch (preemption and
recompute), both pool layouts. Every test also checks that the pool is whole at the end and
that nothing compiled after warm-up.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from engine_testing import (
    Arrival,
    assert_pool_is_whole,
    drive,
    make_engine,
    reference_tokens,
    workload,
)

from serving.metrics import compilation_count
from serving.sampling_params import SamplingParams


def _tokens(finals):
    return {r: o.outputs[0].token_ids for r, o in finals.items()}


# (budget, seed) pairs whose workloads both hit the prefix cache and preempt in the 24-block
# pool (the 4-token budget never runs two long requests at once: no preemption there)
@pytest.mark.parametrize(
    ("async_scheduling", "pool_layout", "budget", "seed"),
    [
        (True, "aliased", 32, 2),
        (False, "aliased", 13, 4),
        (True, "aliased", 9, 1),
        (True, "aliased", 4, 1),
        (False, "separate", 13, 4),
        (4, "aliased", 32, 2),  # bursts of up to 4 decode steps (num_scheduler_steps=4)
    ],
)
def test_greedy_equals_dsv4_generate(
    tiny_params, tiny_cfg, async_scheduling, pool_layout, budget, seed
):
    engine = make_engine(
        tiny_params,
        tiny_cfg,
        async_scheduling=bool(async_scheduling),
        pool_layout=pool_layout,
        max_num_batched_tokens=budget,
        num_scheduler_steps=async_scheduling if async_scheduling > 1 else 1,
    )
    arrivals = workload(tiny_cfg, seed)
    before = compilation_count()
    finals, _ = drive(engine, arrivals)
    assert compilation_count() == before, "the engine compiled after warm-up"
    want = reference_tokens(tiny_params, tiny_cfg, arrivals)
    assert _tokens(finals) == want
    for out in finals.values():
        assert out.outputs[0].finish_reason == "length"
    hits = sum(o.num_cached_tokens for o in finals.values())
    assert hits >= 16, "the workload should hit the prefix cache"
    assert engine.stats.num_preemptions > 0 or budget == 4, "the pool should be too small"
    assert_pool_is_whole(engine)


def _mixed_workload(cfg, seed: int):
    """Sampling of every kind, stop tokens, logprobs: async must equal sync exactly."""
    rng = np.random.default_rng(seed)
    arrivals = workload(cfg, seed, num_requests=9, spread=20)
    out = []
    for i, a in enumerate(arrivals):
        kw = dict(
            temperature=float(rng.choice([0.0, 0.7, 1.3])),
            top_p=float(rng.choice([1.0, 0.8])),
            top_k=int(rng.choice([0, 20])),
            min_p=float(rng.choice([0.0, 0.05])),
            presence_penalty=float(rng.choice([0.0, 0.5])),
            repetition_penalty=float(rng.choice([1.0, 1.2])),
            max_tokens=a.params.max_tokens + 4,
            stop_token_ids=rng.integers(3, cfg.vocab_size, 40).tolist(),
            min_tokens=int(rng.integers(0, 3)),
            logprobs=int(rng.integers(0, 4)),
            seed=int(rng.integers(0, 2**31)) if i % 3 else None,
            ignore_eos=True,
        )
        out.append(Arrival(a.step, a.request_id, a.prompt, SamplingParams(**kw)))
    return out


def _completion(out):
    c = out.outputs[0]
    return (c.token_ids, c.finish_reason, c.stop_reason, c.cumulative_logprob, repr(c.logprobs))


def _run(params, cfg, arrivals, aborts, async_scheduling, num_scheduler_steps=1):
    """Each request's completion (`_completion`) and the running counts after each step, of
    an engine with a 16-token budget; checks that nothing compiled and the pool is whole."""
    engine = make_engine(
        params,
        cfg,
        async_scheduling=async_scheduling,
        max_num_batched_tokens=16,
        num_scheduler_steps=num_scheduler_steps,
    )
    assert engine.runner.num_scheduler_steps == num_scheduler_steps
    before = compilation_count()
    finals, running = drive(engine, arrivals, aborts=aborts)
    assert compilation_count() == before
    assert_pool_is_whole(engine)
    return {r: _completion(o) for r, o in finals.items()}, running


def _workload_with_aborts(cfg, seed: int, late_step: int):
    """The mixed workload, three requests again from ``late_step`` (after it drained), and
    two early requests aborted a few steps after they arrive: (arrivals, {step: request id})."""
    arrivals = _mixed_workload(cfg, seed)
    late = [
        Arrival(late_step, "late0", arrivals[0].prompt, arrivals[0].params),
        Arrival(late_step + 1, "late1", arrivals[1].prompt, arrivals[1].params),
        Arrival(late_step + 1, "late2", arrivals[2].prompt, arrivals[2].params),
    ]
    early = [a for a in arrivals if a.step <= 6][:2]
    return arrivals + late, {a.step + 3 + i: a.request_id for i, a in enumerate(early)}


def _assert_same_outputs(first, second, aborts, slack: int) -> None:
    """The same completions for every request but the aborted ones, which agree up to where
    each engine saw the abort (at most ``slack`` tokens apart); both runs had stops and
    length cuts."""
    assert first.keys() == second.keys()
    for request_id in first.keys() - aborts.values():
        assert second[request_id] == first[request_id], request_id
    for request_id in aborts.values():
        (a_tokens, a_reason, *_), (b_tokens, b_reason, *_) = first[request_id], second[request_id]
        assert a_reason == b_reason == "abort"
        short, long = sorted((a_tokens, b_tokens), key=len)
        assert long[: len(short)] == short and len(long) - len(short) <= slack
    assert {"stop", "length"} <= {v[1] for v in first.values()}


@pytest.mark.parametrize("seed", [0, 1])
def test_async_equals_sync_sampling_stops_aborts(tiny_params, tiny_cfg, seed):
    """Tokens, logprobs (bit for bit), finish and stop reasons; an abort lands while the
    aborted request has a step in flight; the batch drains to 0, 1 and 3 requests."""
    arrivals, aborts = _workload_with_aborts(tiny_cfg, seed, 60)
    sync, sync_running = _run(tiny_params, tiny_cfg, arrivals, aborts, False)
    asyn, async_running = _run(tiny_params, tiny_cfg, arrivals, aborts, True)
    _assert_same_outputs(sync, asyn, aborts, slack=1)
    for request_id in aborts.values():
        # an abort cuts a request where the host has seen it: asynchronously one step less
        assert len(asyn[request_id][0]) <= len(sync[request_id][0])
    for running in (sync_running, async_running):
        assert 0 in running[20:] and 1 in running and 3 in running


def test_bursts_equal_one_step_at_a_time(tiny_params, tiny_cfg, monkeypatch):
    """num_scheduler_steps=4 against the asynchronous engine that runs one step a program:
    the same workload as above (every sampling kind, stop tokens, logprobs, aborts in flight,
    the batch draining to 0, 1 and 3) gives the same tokens, logprobs (bit for bit), finish
    and stop reasons; bursts ran, none planned while a prefill was in flight; the pool is
    whole and nothing compiled after warm-up."""
    from serving.engine import Engine
    from serving.runner import ModelRunner

    k = 4
    bursts = []
    execute_burst = ModelRunner.execute_burst

    def counted(self, outputs):
        bursts.append(len(outputs))
        return execute_burst(self, outputs)

    def in_flight_all_decode(engine):
        """No burst is planned while a step in flight is not pure decode (a prefill's first
        token comes out before k steps are planned)."""
        return all(engine.runner.burst_bucket(h.scheduler_output) for h in engine._in_flight)

    monkeypatch.setattr(ModelRunner, "execute_burst", counted)
    plan_burst = Engine._plan_burst
    planned_with_prefill_in_flight = []

    def checked(self, first):
        burst, rest = plan_burst(self, first)
        if len(burst) > 1 and not in_flight_all_decode(self):
            planned_with_prefill_in_flight.append(len(burst))
        return burst, rest

    monkeypatch.setattr(Engine, "_plan_burst", checked)
    arrivals, aborts = _workload_with_aborts(tiny_cfg, 0, 40)
    # alone in an idle engine: its last burst is cut short by its max_tokens
    lone = SamplingParams(max_tokens=7, ignore_eos=True)
    arrivals.append(Arrival(150, "lone", arrivals[3].prompt, lone))
    one, _ = _run(tiny_params, tiny_cfg, arrivals, aborts, True)
    burst, burst_running = _run(tiny_params, tiny_cfg, arrivals, aborts, True, k)
    assert bursts.count(k) > 5 and all(2 <= n <= k for n in bursts) and min(bursts) < k, bursts
    assert not planned_with_prefill_in_flight
    # an abort cuts a request where the host has seen it: up to a burst earlier or later
    _assert_same_outputs(one, burst, aborts, slack=k)
    assert 0 in burst_running[10:] and 1 in burst_running and 3 in burst_running


def test_bursts_mask_stop_tokens_below_min_tokens(tiny_params, tiny_cfg):
    """min_tokens inside bursts: a burst's later steps are planned (in flight) before its
    first ones run, yet each step's rows count only the outputs before them, so stop tokens
    stay masked exactly as long as one step a program masks them. Half the vocabulary stops
    a request: any step that unmasked them early would likely stop it early."""
    stops = list(range(0, tiny_cfg.vocab_size, 2))
    masked = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                            stop_token_ids=stops, min_tokens=11)  # fmt: skip
    arrivals = [Arrival(0, str(i), tuple(range(5 + i, 17 + 2 * i)), masked) for i in range(4)]
    one, _ = _run(tiny_params, tiny_cfg, arrivals, {}, True)
    burst, _ = _run(tiny_params, tiny_cfg, arrivals, {}, True, 4)
    assert burst == one
    for tokens, reason, *_ in one.values():
        assert reason == "stop" and len(tokens) >= 11  # the first 10 are all odd
        assert all(t % 2 for t in tokens[:10]) and tokens[-1] % 2 == 0


def test_seeded_request_gives_the_same_tokens_whatever_else_runs(tiny_params, tiny_cfg):
    engine = make_engine(tiny_params, tiny_cfg)
    prompt = list(range(10, 40))
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone, _ = drive(engine, [Arrival(0, "alone", tuple(prompt), sp)])
    crowd = [Arrival(0, "seeded", tuple(prompt), sp)] + workload(tiny_cfg, 5, spread=3)
    crowd = [
        Arrival(a.step, a.request_id, a.prompt, SamplingParams(temperature=1.0, max_tokens=8))
        if a.request_id != "seeded"
        else a
        for a in crowd
    ]
    together, _ = drive(engine, crowd)
    assert together["seeded"].outputs[0].token_ids == alone["alone"].outputs[0].token_ids
    again, _ = drive(engine, [Arrival(0, "again", tuple(prompt), sp)])
    assert again["again"].outputs[0].token_ids == alone["alone"].outputs[0].token_ids
    assert_pool_is_whole(engine)


@pytest.mark.parametrize("steps", [1, 4])
def test_trimmed_block_tables(tiny_params, tiny_cfg, steps, monkeypatch):
    """Table widths bucketed by the step's longest request (what long max_model_len uses by
    default): the warm-up compiles every width pair, the tokens stay dsv4.generate's. In
    bursts (``steps`` 4) a burst's inputs, built in one pass (`ModelRunner.burst_inputs`),
    equal its steps' `step_inputs` stacked, a step whose tables are narrower than another
    step's of the same burst widened by null columns (some burst has one)."""
    from dsv4.paged.batch import widen_tables
    from serving.runner import ModelRunner

    widened = []
    burst_inputs = ModelRunner.burst_inputs

    def check(runner, plans, t):
        got = burst_inputs(runner, plans, t)
        steps = [runner.step_inputs(plan, t) for plan in plans]
        widths = [max(w) for w in zip(*(s[0].table_widths() for s in steps), strict=True)]
        widened.append(any(s[0].table_widths() != tuple(widths) for s in steps))
        steps = [(widen_tables(batch, widths), *rest) for batch, *rest in steps]
        got_leaves, tree = jax.tree.flatten(got)
        assert tree == jax.tree.structure(steps[0])
        for leaf, *want in zip(got_leaves, *map(jax.tree.leaves, steps), strict=True):
            assert leaf.shape == (runner.num_scheduler_steps, *np.shape(want[0]))
            np.testing.assert_array_equal(leaf[: len(steps)], np.stack(want))
            assert not leaf[len(steps) :].any()
        return got

    monkeypatch.setattr(ModelRunner, "burst_inputs", check)
    engine = make_engine(
        tiny_params,
        tiny_cfg,
        table_buckets=(4,),
        max_num_batched_tokens=13,
        num_scheduler_steps=steps,
    )
    assert engine.runner.table_buckets == (4,)
    # last, alone: a request that decodes past 64 tokens (4 blocks of 16) inside a burst
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    lone = Arrival(150, "lone", tuple(range(3, 60)), greedy)
    arrivals = [*workload(tiny_cfg, 4), lone]
    before = compilation_count()
    finals, _ = drive(engine, arrivals)
    assert compilation_count() == before
    assert _tokens(finals) == reference_tokens(tiny_params, tiny_cfg, arrivals)
    assert_pool_is_whole(engine)
    assert bool(widened) == (steps > 1)
    assert any(widened) == (steps > 1)


def test_engram_model_greedy_equals_dsv4_generate(engram_params, engram_cfg):
    """Engram on layers 1 and 4: the engine carries each request's n-gram history (from its
    tokens: across chunks, after prefix hits, after preemption; async scheduling) and gives
    `dsv4.generate`'s greedy tokens. The drafter is not part of this test: the model keeps
    `tiny_v41`'s one (uncomputed) draft layer, so its cache layout, and with it which prompts
    hit the prefix cache, is the other engine tests'."""
    from dsv4.config import tiny_v41

    base = tiny_v41()
    cfg = engram_cfg.replace(n_mtp_layers=base.n_mtp_layers, compress_ratios=base.compress_ratios,
                             dspark_block_size=0, dspark_target_layer_ids=())  # fmt: skip
    params = {k: v for k, v in engram_params.items() if not k.startswith("mtp.")}
    engine = make_engine(params, cfg, async_scheduling=True, max_num_batched_tokens=9)
    arrivals = workload(cfg, 1)
    before = compilation_count()
    finals, _ = drive(engine, arrivals)
    assert compilation_count() == before, "the engine compiled after warm-up"
    assert _tokens(finals) == reference_tokens(params, cfg, arrivals)
    assert sum(o.num_cached_tokens for o in finals.values()) >= 16
    assert engine.stats.num_preemptions > 0
    assert_pool_is_whole(engine)


def test_rows_for_holds_every_batch_its_bucket_can_take():
    """Every batch of at most ``max_num_seqs`` requests and at most T tokens needs its requests'
    rows plus a padding row when its tokens fall short of T: at most ``min(T, S + 1)`` rows.
    `rows_for` gives that many, rounded up to a power of two, and no more."""
    from serving.runner import rows_for

    for s in range(1, 41):
        for t in range(1, 70):
            need = max(n + (tokens < t) for n in range(1, min(s, t) + 1) for tokens in (n, t))
            r = rows_for(t, s)
            assert need <= r < 2 * need and r & (r - 1) == 0, (t, s, r, need)
    assert (rows_for(8, 32), rows_for(32, 32), rows_for(256, 32)) == (8, 32, 64)
