"""Data-parallel serving (`serving.data_parallel`) on one device: D shards, each with its own
scheduler, allocator, slots and pages, stepping in lockstep through one program, against
`dsv4.generate` and against the one-shard engine.

Workloads as in `test_engine.py`: ragged prompts arriving at random steps, shared prefixes,
chunked prefill under small budgets, a pool too small for a shard's batch (preemption), both
pool layouts, sync and async, sampling of every kind, stops and aborts. NaN-filled pools: a
shard reading another shard's pages (or a padding shard writing any) poisons the logits.
"""

from __future__ import annotations

import pytest
from engine_testing import Arrival, assert_pool_is_whole, drive, make_engine, reference_tokens
from engine_testing import workload as base_workload
from test_engine import _completion, _mixed_workload, _tokens
from test_spec_decode import _Oracle, _repetitive_workload

from serving.data_parallel import DataParallelRunner, DataParallelScheduler
from serving.metrics import compilation_count
from serving.sampling_params import SamplingParams


def workload(cfg, seed, **kw):
    return base_workload(cfg, seed, num_requests=10, **kw)


# per-shard block counts and seeds whose workloads both hit the prefix cache and preempt
@pytest.mark.parametrize(
    ("shards", "async_scheduling", "pool_layout", "budget", "blocks", "seed"),
    [
        (2, True, "aliased", 13, 16, 5),
        (2, False, "separate", 9, 16, 4),
        (3, True, "aliased", 32, 18, 2),
    ],
)
def test_greedy_equals_dsv4_generate(
    tiny_params, tiny_cfg, shards, async_scheduling, pool_layout, budget, blocks, seed
):
    engine = make_engine(
        tiny_params,
        tiny_cfg,
        data_parallel_size=shards,
        async_scheduling=async_scheduling,
        pool_layout=pool_layout,
        max_num_batched_tokens=budget,
        num_gpu_blocks_override=blocks,  # per shard: two long requests do not fit together
    )
    assert isinstance(engine.runner, DataParallelRunner)
    assert isinstance(engine.scheduler, DataParallelScheduler)
    assert engine.data_parallel_size == shards
    arrivals = workload(tiny_cfg, seed)
    before = compilation_count()
    finals, _ = drive(engine, arrivals)
    assert compilation_count() == before, "the engine compiled after warm-up"
    assert _tokens(finals) == reference_tokens(tiny_params, tiny_cfg, arrivals)
    assert sum(o.num_cached_tokens for o in finals.values()) >= 16, "no prefix hit"
    assert engine.stats.num_preemptions > 0, "the pool should be too small"
    assert all(n > 0 for n in engine.scheduler.num_routed), engine.scheduler.num_routed
    assert_pool_is_whole(engine)


def test_trimmed_block_tables_widen_to_the_widest_shard(tiny_params, tiny_cfg):
    """Table widths bucketed by each step's longest request: a shard's tables are widened
    (null-block columns) to the widest shard's, which is itself a compiled width tuple."""
    engine = make_engine(
        tiny_params,
        tiny_cfg,
        data_parallel_size=2,
        table_buckets=(4, 8, 16),
        max_num_batched_tokens=13,
    )
    step_widths: list[set] = []  # per step, the widths the shards' own batches had
    for shard in engine.runner.shards:

        def step_inputs(plan, t, own=shard.step_inputs):
            out = own(plan, t)
            step_widths[-1].add(tuple(table.shape[1] for table in out[0].block_tables))
            return out

        shard.step_inputs = step_inputs
    execute = engine.runner.execute

    def spy(output):
        step_widths.append(set())
        return execute(output)

    engine.runner.execute = spy
    arrivals = workload(tiny_cfg, 4)
    before = compilation_count()
    finals, _ = drive(engine, arrivals)
    assert compilation_count() == before
    assert _tokens(finals) == reference_tokens(tiny_params, tiny_cfg, arrivals)
    assert any(len(w) > 1 for w in step_widths), "no step had shards of different widths"
    assert_pool_is_whole(engine)


def test_equals_one_shard_and_async_equals_sync(tiny_params, tiny_cfg):
    """Sampling of every kind with stop tokens and logprobs: the two-shard engine gives the
    one-shard engine's tokens, finish and stop reasons (logprobs to fp32 rounding: a shard's
    batch differs), and its async run equals its sync run exactly, aborts in flight and
    batches that drain to 0, 1 and 3 included."""
    arrivals = _mixed_workload(tiny_cfg, 0)
    late = [Arrival(60 + i, f"late{i}", arrivals[i].prompt, arrivals[i].params) for i in range(3)]
    early = [a for a in arrivals if a.step <= 6][:2]
    aborts = {a.step + 3 + i: a.request_id for i, a in enumerate(early)}
    results = {}
    for shards, async_scheduling in ((1, False), (2, False), (2, True)):
        engine = make_engine(
            tiny_params,
            tiny_cfg,
            data_parallel_size=shards,
            async_scheduling=async_scheduling,
            max_num_batched_tokens=16,
        )
        before = compilation_count()
        finals, running = drive(engine, arrivals + late, aborts=aborts)
        assert compilation_count() == before
        assert_pool_is_whole(engine)
        assert 0 in running[20:] and 1 in running and 3 in running
        results[shards, async_scheduling] = {r: _completion(o) for r, o in finals.items()}
    one, sync, asyn = results[1, False], results[2, False], results[2, True]
    assert one.keys() == sync.keys() == asyn.keys()
    kept = one.keys() - aborts.values()
    for request_id in kept:
        assert asyn[request_id] == sync[request_id], request_id
        (tokens, reason, stop, cum, _), (d_tokens, d_reason, d_stop, d_cum, _) = (
            one[request_id],
            sync[request_id],
        )
        assert (tokens, reason, stop) == (d_tokens, d_reason, d_stop), request_id
        assert cum is None or abs(cum - d_cum) < 1e-3, request_id
    assert {"stop", "length"} <= {v[1] for v in sync.values()}
    for request_id in aborts.values():
        assert sync[request_id][1] == asyn[request_id][1] == "abort"


def test_requests_go_to_the_least_loaded_shard(tiny_params, tiny_cfg):
    """Routing, and prompt logprobs (a shard's rows of the stacked step's all-token logits)
    equal to the one-shard engine's."""
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2,
                        prompt_logprobs=2)  # fmt: skip
    prompts = [[5 + i, 9, 3 + 2 * i, 7] * (2 + i) for i in range(5)]
    results = []
    for shards in (1, 2):
        engine = make_engine(tiny_params, tiny_cfg, data_parallel_size=shards)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, sp)
        if shards == 2:  # all wait: the score is 4 x waiting, so they alternate
            assert [engine.scheduler.shard_of(f"r{i}") for i in range(5)] == [0, 1, 0, 1, 0]
        finals, _ = drive(engine, [])
        assert_pool_is_whole(engine)
        results.append(finals)
    one, two = results
    for request_id, out in one.items():
        got = two[request_id]
        assert got.outputs[0].token_ids == out.outputs[0].token_ids
        assert len(got.prompt_logprobs) == len(out.prompt_logprobs) == len(got.prompt_token_ids)
        for a, b in zip(out.prompt_logprobs[1:], got.prompt_logprobs[1:], strict=True):
            assert a.keys() == b.keys()
            for token, lp in a.items():
                assert abs(lp.logprob - b[token].logprob) < 1e-4 and lp.rank == b[token].rank


def test_speculation_per_shard(tiny_params, tiny_cfg):
    """Host drafts (n-gram lookup, and an oracle that proposes the true continuation with one
    wrong token) verified per shard give plain greedy decoding's tokens, sync and async."""
    arrivals = _repetitive_workload(tiny_cfg, seed=3)
    plain, _ = drive(make_engine(tiny_params, tiny_cfg, data_parallel_size=2), arrivals)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}  # fmt: skip
    for async_scheduling, oracle in ((False, False), (True, False), (True, True)):
        engine = make_engine(
            tiny_params,
            tiny_cfg,
            data_parallel_size=2,
            async_scheduling=async_scheduling,
            speculative_config=spec,
        )
        if oracle:
            engine.proposer = _Oracle(arrivals, plain, 3, tiny_cfg.vocab_size)
        before = compilation_count()
        finals, _ = drive(engine, arrivals)
        assert compilation_count() == before
        assert _tokens(finals) == _tokens(plain), (async_scheduling, oracle)
        assert engine.stats.spec_num_draft_tokens > 0
        if oracle:
            assert engine.stats.spec_num_accepted_tokens > 0
        assert_pool_is_whole(engine)


def test_kv_events_carry_the_shard(tiny_params, tiny_cfg):
    engine = make_engine(tiny_params, tiny_cfg, data_parallel_size=2, enable_kv_cache_events=True)
    seen = []
    engine.subscribe_kv_events(lambda events, rank: seen.append((rank, len(events))))
    drive(engine, workload(tiny_cfg, 0, spread=2))
    assert {rank for rank, _ in seen} == {0, 1}


def test_dspark_per_shard(engram_params, engram_cfg):
    """tiny_v41_full's DSpark drafter seeded and read per shard: the two-shard engine drafts
    what the one-shard engine drafts for every request and step (sync), and gives
    `dsv4.generate`'s tokens sync and async (prefix hits included)."""
    arrivals = workload(engram_cfg, 4)
    want = reference_tokens(engram_params, engram_cfg, arrivals)
    spec = {"method": "dspark", "num_speculative_tokens": 2}
    drafted = []
    for shards, async_scheduling in ((1, False), (2, False), (2, True)):
        engine = make_engine(
            engram_params,
            engram_cfg,
            data_parallel_size=shards,
            async_scheduling=async_scheduling,
            num_gpu_blocks_override=28,  # as test_spec_dspark.py: the same compiled step
            speculative_config=spec,
        )
        seen: dict[str, list] = {}
        if not async_scheduling:  # the host learns every step's drafts
            update = engine.scheduler.update_draft_token_ids

            def record(drafts, update=update, seen=seen):
                for request_id, tokens in drafts.items():
                    seen.setdefault(request_id, []).append(list(tokens))
                update(drafts)

            engine.scheduler.update_draft_token_ids = record
        before = compilation_count()
        finals, _ = drive(engine, arrivals)
        assert compilation_count() == before
        assert _tokens(finals) == want, (shards, async_scheduling)
        assert engine.stats.spec_num_drafts > 10
        assert_pool_is_whole(engine)
        drafted.append(seen)
    assert drafted[0] and drafted[1] == drafted[0]


def test_bad_data_parallel_sizes():
    from serving import LLM

    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="data_parallel_size"):
            LLM("tiny_v41", data_parallel_size=bad, warm_up=False)
    with pytest.raises(ValueError, match="num_scheduler_steps=2 with data_parallel_size=2"):
        LLM("tiny_v41", data_parallel_size=2, num_scheduler_steps=2, warm_up=False)
