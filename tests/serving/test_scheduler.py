"""Scheduler over the real `cache.KVCacheManager`: reference scenarios 34-36 and the step rules.

Scenario numbers are those of docs/cache.md#allocator-scenarios. Every test uses
one full-attention group with 16-token blocks; a pool of `num_blocks` holds block 0 (null) plus
`num_blocks - 1` usable blocks. Prompts use disjoint token ranges so that no test gets a prefix
hit it did not ask for.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.config import SchedulerConfig
from serving.request import Request
from serving.request_queue import SchedulingPolicy
from serving.scheduler import RequestStatus, Scheduler, SchedulerOutput

BLOCK_SIZE = 16
EOS = 999  # no test samples it by accident


def make_kv_cache_manager(num_blocks: int, *, max_model_len: int):
    """One full-attention group of `num_blocks` blocks of BLOCK_SIZE tokens, caching on."""
    from cache import KVCacheManager
    from cache.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    layer = "layers.0.attn"
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=64, dtype="bfloat16")
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[KVCacheTensor(size=spec.page_size_bytes * num_blocks, shared_by=[layer])],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=[layer], kv_cache_spec=spec)],
    )
    return KVCacheManager(config, max_model_len, max_num_batched_tokens=None)


_CONFIG_FIELDS = {f.name for f in dataclasses.fields(SchedulerConfig)}


def scheduler_over(
    manager, *, policy: SchedulingPolicy = SchedulingPolicy.FCFS, **kwargs
) -> Scheduler:
    """A scheduler over ``manager``: the `SchedulerConfig` fields among ``kwargs`` go to its
    config (synchronous unless they say otherwise), the rest to `Scheduler` itself."""
    config = {k: kwargs.pop(k) for k in list(kwargs) if k in _CONFIG_FIELDS}
    config.setdefault("async_scheduling", False)
    config = SchedulerConfig(scheduling_policy=policy.value, **config)
    return Scheduler(manager, config, **kwargs)


def make_scheduler(
    num_blocks: int = 64,
    *,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 1024,
    max_model_len: int = 1024,
    **kwargs,
) -> Scheduler:
    manager = make_kv_cache_manager(num_blocks, max_model_len=max_model_len)
    return scheduler_over(
        manager,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        eos_token_id=EOS,
        **kwargs,
    )


_token_base = itertools.count(1000, 10_000)


def make_request(
    scheduler: Scheduler,
    request_id: str,
    num_prompt_tokens: int,
    *,
    max_tokens: int | None = 16,
    priority: int = 0,
    arrival_time: float = 0.0,
) -> Request:
    base = next(_token_base)
    return Request(
        request_id,
        list(range(base, base + num_prompt_tokens)),
        hash_block_size=scheduler.kv_cache_manager.hash_block_size,
        priority=priority,
        arrival_time=arrival_time,
        max_tokens=max_tokens,
    )


def add(scheduler: Scheduler, request_id: str, num_prompt_tokens: int, **kwargs) -> Request:
    request = make_request(scheduler, request_id, num_prompt_tokens, **kwargs)
    scheduler.add_request(request)
    return request


def num_free_blocks(scheduler: Scheduler) -> int:
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def fake_sample(scheduler: Scheduler, output: SchedulerOutput, token: int = 7) -> dict:
    """One token for every request whose scheduled chunk reached its last token, like a
    model runner without drafts; nothing for requests in the middle of a prefill."""
    sampled = {}
    for request_id in output.num_scheduled_tokens:
        request = scheduler.requests[request_id]
        if request.num_computed_tokens >= request.num_tokens:
            sampled[request_id] = [token]
    return sampled


def step(scheduler: Scheduler, token: int = 7):
    output = scheduler.schedule()
    return output, scheduler.update_from_output(output, fake_sample(scheduler, output, token))


# ---------------------------------------------------------------- reference scenarios


def test_scenario_34_priority_admission_order():
    """Priorities [2,1,1,0], arrivals [1,3,2,4] -> admission order 3, 2, 1, 0."""
    scheduler = make_scheduler(policy=SchedulingPolicy.PRIORITY)
    for i, (priority, arrival) in enumerate(zip([2, 1, 1, 0], [1, 3, 2, 4], strict=True)):
        add(scheduler, str(i), 16, priority=priority, arrival_time=float(arrival))
    output = scheduler.schedule()
    assert [r.request_id for r in output.scheduled_new_reqs] == ["3", "2", "1", "0"]
    assert [r.request_id for r in scheduler.running] == ["3", "2", "1", "0"]


def test_scenario_34_priority_admission_order_one_slot_at_a_time():
    """Same order when only one request may run: each finish admits the next by priority."""
    scheduler = make_scheduler(policy=SchedulingPolicy.PRIORITY, max_num_seqs=1)
    for i, (priority, arrival) in enumerate(zip([2, 1, 1, 0], [1, 3, 2, 4], strict=True)):
        add(scheduler, str(i), 16, priority=priority, arrival_time=float(arrival), max_tokens=1)
    admitted = []
    while scheduler.has_unfinished_requests():
        output, _ = step(scheduler)
        admitted += [r.request_id for r in output.scheduled_new_reqs]
    assert admitted == ["3", "2", "1", "0"]


@pytest.mark.parametrize(
    ("drafts", "sampled", "expected"),
    [
        # (num_drafts, num_draft_tokens, num_accepted_tokens, accepted per position)
        ([[1, 2, 3]], [[1, 2, 3, 4]], (1, 3, 3, [1, 1, 1])),
        ([[1, 2, 3]], [[1, 5]], (1, 3, 1, [1, 0, 0])),
        ([[1, 2, 3], [4, 5, 6]], [[1, 2, 7], [4, 8]], (2, 6, 3, [2, 1, 0])),
    ],
)
def test_scenario_35_spec_decode_stats(drafts, sampled, expected):
    """1-token prompts; step 1 prefills and samples one token, then drafts arrive; step 2
    schedules 1 + len(drafts) tokens per request; its sampled tokens give the stats."""
    scheduler = make_scheduler(num_spec_tokens=3)
    reqs = [add(scheduler, f"r{i}", 1) for i in range(len(drafts))]
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {r.request_id: 1 for r in reqs}
    result = scheduler.update_from_output(output, {r.request_id: [0] for r in reqs})
    assert result.spec_decoding_stats is None
    scheduler.update_draft_token_ids({r.request_id: d for r, d in zip(reqs, drafts, strict=True)})

    output = scheduler.schedule()
    for request, draft in zip(reqs, drafts, strict=True):
        assert output.num_scheduled_tokens[request.request_id] == 1 + len(draft)
        assert output.scheduled_spec_decode_tokens[request.request_id] == draft
        assert request.num_computed_tokens == 2 + len(draft)  # advanced at schedule time
    result = scheduler.update_from_output(
        output, {r.request_id: s for r, s in zip(reqs, sampled, strict=True)}
    )
    stats = result.spec_decoding_stats
    num_drafts, num_draft_tokens, num_accepted, per_pos = expected
    assert stats.num_drafts == num_drafts
    assert stats.num_draft_tokens == num_draft_tokens
    assert stats.num_accepted_tokens == num_accepted
    assert stats.num_accepted_tokens_per_pos == per_pos
    for request, draft, tokens in zip(reqs, drafts, sampled, strict=True):
        num_rejected = len(draft) - (len(tokens) - 1)
        assert request.num_computed_tokens == 2 + len(draft) - num_rejected
        # Every accepted token is computed; the bonus (last sampled) token is not yet.
        assert request.num_computed_tokens == request.num_tokens - 1
        assert request.output_token_ids == [0, *tokens]


def test_scenario_35_rejection_reduces_computed_by_two():
    scheduler = make_scheduler(num_spec_tokens=3)
    request = add(scheduler, "r", 1)
    scheduler.update_from_output(scheduler.schedule(), {"r": [0]})
    scheduler.update_draft_token_ids({"r": [1, 2, 3]})
    output = scheduler.schedule()
    before = request.num_computed_tokens
    scheduler.update_from_output(output, {"r": [1, 5]})
    assert before - request.num_computed_tokens == 2


def test_scenario_36_fcfs_preempts_last_running_and_admits_nobody():
    """Pool of 4 usable blocks; A and B hold 2 each. A's decode needs a 3rd block, so the
    last running request (B) is preempted: freed, num_computed_tokens=0, prepended to
    waiting, ahead of C. C would now fit but is not admitted in that step."""
    scheduler = make_scheduler(num_blocks=5)
    a = add(scheduler, "A", 32)
    b = add(scheduler, "B", 32)
    c = add(scheduler, "C", 8)
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"A": 32, "B": 32}  # C: no free block
    assert num_free_blocks(scheduler) == 0

    output = scheduler.schedule()
    assert output.preempted_req_ids == {"B"}
    assert output.num_scheduled_tokens == {"A": 1}
    assert output.scheduled_new_reqs == []
    assert scheduler.requests["B"].status is RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert [r.request_id for r in scheduler.running] == ["A"]
    assert [r.request_id for r in scheduler.waiting] == ["B", "C"]
    assert num_free_blocks(scheduler) == 1  # C (one block) would fit, yet was not admitted
    assert a.num_computed_tokens == 33 and c.num_computed_tokens == 0


def test_scenario_36_victim_is_the_requester():
    """A single running request that cannot grow preempts itself and is not scheduled."""
    scheduler = make_scheduler(num_blocks=3)
    a = add(scheduler, "A", 32)
    step(scheduler)
    output = scheduler.schedule()
    assert output.preempted_req_ids == {"A"}
    assert output.num_scheduled_tokens == {}
    assert output.total_num_scheduled_tokens == 0
    assert a.num_computed_tokens == 0
    assert scheduler.running == [] and [r.request_id for r in scheduler.waiting] == ["A"]
    assert num_free_blocks(scheduler) == 2


def test_scenario_36_resumed_request_recomputes_prompt_and_outputs():
    """A preempted request comes back as a new request carrying prompt + outputs; its
    recompute starts from a prefix hit on the full block it had cached before."""
    scheduler = make_scheduler(num_blocks=5)
    add(scheduler, "A", 32, max_tokens=2)
    b = add(scheduler, "B", 30)
    step(scheduler)
    output, result = step(scheduler)  # A grows into a 3rd block: B (last) is preempted
    assert output.preempted_req_ids == {"B"}
    assert result.finished == {"A": RequestStatus.FINISHED_LENGTH_CAPPED}
    output = scheduler.schedule()
    (resumed,) = output.scheduled_new_reqs
    assert resumed.request_id == "B" and resumed.token_ids == tuple(b.all_token_ids)
    assert len(resumed.token_ids) == 31  # 30 prompt + 1 output
    assert resumed.num_computed_tokens == 16  # block 0 of B stayed cached while free
    assert output.num_scheduled_tokens == {"B": 15}
    assert scheduler.requests["B"].status is RequestStatus.RUNNING


def test_priority_preemption_takes_lowest_priority():
    """PRIORITY: the victim is the running request with max (priority, arrival_time)."""
    scheduler = make_scheduler(num_blocks=5, policy=SchedulingPolicy.PRIORITY)
    low = add(scheduler, "low", 31, priority=5)
    high = add(scheduler, "high", 32, priority=0)
    step(scheduler)
    assert [r.request_id for r in scheduler.running] == ["high", "low"]
    assert num_free_blocks(scheduler) == 0
    # high: 33 tokens, needs a 3rd block; low (32 tokens) would still fit its 2.
    output = scheduler.schedule()
    assert output.preempted_req_ids == {"low"}
    assert output.num_scheduled_tokens == {"high": 1}
    assert low.num_computed_tokens == 0 and high.num_computed_tokens == 33


def test_priority_preemption_refunds_a_victim_scheduled_earlier_in_the_step():
    """low runs before high in list order and is scheduled first; when high then needs a
    block, low is the victim: its token and block ids leave the plan."""
    scheduler = make_scheduler(num_blocks=5, policy=SchedulingPolicy.PRIORITY)
    low = add(scheduler, "low", 20, priority=5)
    step(scheduler)
    add(scheduler, "high", 32, priority=0)
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"low": 1, "high": 32}
    assert num_free_blocks(scheduler) == 0
    output = scheduler.schedule()
    assert output.preempted_req_ids == {"low"}
    assert output.num_scheduled_tokens == {"high": 1}
    assert output.total_num_scheduled_tokens == 1
    assert [c.request_id for c in output.scheduled_cached_reqs] == ["high"]
    assert low.num_computed_tokens == 0 and low.num_preemptions == 1


# ---------------------------------------------------------------- budget and limits


def test_chunked_prefill_under_token_budget():
    scheduler = make_scheduler(max_num_batched_tokens=64)
    long = add(scheduler, "long", 100)
    add(scheduler, "short", 30)
    output, result = step(scheduler)
    assert output.num_scheduled_tokens == {"long": 64}
    assert result.new_token_ids == {}  # mid-prefill: nothing sampled
    assert long.num_computed_tokens == 64
    output, result = step(scheduler)
    assert output.num_scheduled_tokens == {"long": 36, "short": 28}
    assert [c.request_id for c in output.scheduled_cached_reqs] == ["long"]
    assert list(result.new_token_ids) == ["long"]
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"long": 1, "short": 2}
    assert output.total_num_scheduled_tokens == 3


def test_chunked_prefill_with_sampled_token_mid_prefill_is_rejected():
    scheduler = make_scheduler(max_num_batched_tokens=64)
    add(scheduler, "long", 100)
    output = scheduler.schedule()
    with pytest.raises(ValueError, match=r"'long'.*mid-prefill"):
        scheduler.update_from_output(output, {"long": [5]})


def test_chunked_prefill_disabled_stops_admission():
    scheduler = make_scheduler(max_num_batched_tokens=64, enable_chunked_prefill=False)
    add(scheduler, "small", 40)
    add(scheduler, "big", 30)  # 30 > 24 left: admission stops here
    add(scheduler, "tiny", 4)
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"small": 40}


def test_long_prefill_token_threshold_caps_each_request():
    scheduler = make_scheduler(long_prefill_token_threshold=20)
    add(scheduler, "a", 50)
    add(scheduler, "b", 10)
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"a": 20, "b": 10}
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"a": 20, "b": 1}


def test_max_num_seqs_limits_running_requests():
    scheduler = make_scheduler(max_num_seqs=2)
    for name in "abc":
        add(scheduler, name, 8, max_tokens=2)
    output, _ = step(scheduler)
    assert set(output.num_scheduled_tokens) == {"a", "b"}
    assert len(scheduler.running) == 2 and len(scheduler.waiting) == 1
    output, result = step(scheduler)
    assert set(result.finished) == {"a", "b"}
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"c": 8}
    assert output.finished_req_ids == {"a", "b"}


def test_lookahead_slots_reserved_from_the_first_allocation():
    # vLLM 0.32: the first allocation reserves lookahead slots too (16 + 4 -> 2 blocks).
    scheduler = make_scheduler(num_spec_tokens=4, num_lookahead_tokens=4)
    request = add(scheduler, "r", 16)
    output = scheduler.schedule()
    assert output.scheduled_new_reqs[0].block_ids == scheduler.kv_cache_manager.get_block_ids("r")
    assert len(scheduler.kv_cache_manager.get_block_ids("r")[0]) == 2
    scheduler.update_from_output(output, {"r": [5]})
    output = scheduler.schedule()  # 17 tokens + 4 lookahead -> still 2 blocks
    assert output.scheduled_cached_reqs[0].new_block_ids is None  # no new block (vLLM's None)
    assert request.num_computed_tokens == 17


def test_max_model_len_caps_length():
    scheduler = make_scheduler(max_model_len=20)
    request = add(scheduler, "r", 16, max_tokens=None)
    results = [step(scheduler)[1] for _ in range(4)]
    assert results[-1].finished == {"r": RequestStatus.FINISHED_LENGTH_CAPPED}
    assert request.num_tokens == 20


def test_eos_stops_and_drops_tokens_after_it():
    scheduler = make_scheduler(num_spec_tokens=2)
    request = add(scheduler, "r", 4)
    scheduler.update_from_output(scheduler.schedule(), {"r": [5]})
    scheduler.update_draft_token_ids({"r": [EOS, 6]})
    output = scheduler.schedule()
    result = scheduler.update_from_output(output, {"r": [EOS, 6, 8]})
    assert result.new_token_ids == {"r": [EOS]}
    assert result.finished == {"r": RequestStatus.FINISHED_STOPPED}
    assert request.output_token_ids == [5, EOS]
    assert not scheduler.has_unfinished_requests()


def test_finish_requests_aborts_running_and_waiting():
    scheduler = make_scheduler(max_num_seqs=1)
    add(scheduler, "run", 20)
    add(scheduler, "wait", 20)
    free_before = num_free_blocks(scheduler)
    step(scheduler)
    finished = scheduler.finish_requests(["run", "wait"])
    assert [r.request_id for r in finished] == ["run", "wait"]
    assert num_free_blocks(scheduler) == free_before
    assert not scheduler.has_unfinished_requests()
    assert scheduler.schedule().finished_req_ids == {"run", "wait"}


def test_bounded_replay_recomputes_the_hits_last_window():
    """V4.1 bounded replay (vLLM 0.32 `_mark_prefix_replay`): a 64-token hit over a 16-token
    window-MLA cache is admitted with 48 computed tokens; the first 16 scheduled tokens
    replay the hit's last window and the full group reuses the 4 hit blocks."""
    from cache import KVCacheManager
    from cache.spec import (
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
    )

    dims = {"block_size": BLOCK_SIZE, "num_kv_heads": 1, "head_size": 64, "dtype": "bfloat16"}
    full = MLAAttentionSpec(**dims)
    window = SlidingWindowMLASpec(**dims, sliding_window=16, bounded_replay=True)
    config = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[KVCacheTensor(size=full.page_size_bytes * 64, shared_by=["f", "w"])],
        kv_cache_groups=[
            KVCacheGroupSpec(layer_names=["f"], kv_cache_spec=full),
            KVCacheGroupSpec(layer_names=["w"], kv_cache_spec=window),
        ],
    )
    manager = KVCacheManager(config, 256)
    scheduler = scheduler_over(
        manager, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256
    )
    prompt = list(range(100, 164))
    first = manager.new_request("first", prompt, max_tokens=1)
    scheduler.add_request(first)
    output = scheduler.schedule()
    (first_blocks, _) = output.scheduled_new_reqs[0].block_ids
    scheduler.update_from_output(output, {"first": [5]})

    scheduler.add_request(manager.new_request("second", [*prompt, *range(500, 516)]))
    output = scheduler.schedule()
    (second,) = output.scheduled_new_reqs
    assert second.num_computed_tokens == 48 and second.num_replay_tokens == 16
    assert output.num_scheduled_tokens == {"second": 32}
    assert second.block_ids[0][:4] == first_blocks[:4]
    scheduler.update_from_output(output, {"second": [5]})
    scheduler.finish_requests("second")
    assert manager.block_pool.get_num_free_blocks() == 63


# ---------------------------------------------------------------- a whole run


def test_all_requests_finish_and_every_block_is_free_again():
    """Mixed prompt lengths, drafts, chunking and a tight pool (preemptions happen); every
    request ends with its max_tokens outputs and the pool is whole again."""
    scheduler = make_scheduler(
        num_blocks=24, max_num_seqs=6, max_num_batched_tokens=96, num_spec_tokens=2
    )
    total_blocks = num_free_blocks(scheduler)
    lengths = [5, 40, 77, 16, 130, 33, 1, 64, 90, 12]
    reqs = {
        f"r{i}": add(scheduler, f"r{i}", n, max_tokens=8 + i % 5) for i, n in enumerate(lengths)
    }
    num_preempted = 0
    for _ in range(500):
        if not scheduler.has_unfinished_requests():
            break
        output = scheduler.schedule()
        num_preempted += len(output.preempted_req_ids)
        assert output.total_num_scheduled_tokens <= 96
        sampled = {}
        for request_id, drafts in output.scheduled_spec_decode_tokens.items():
            sampled[request_id] = [10 + t for t in drafts[:1]] + [11]  # accept the first
        for request_id, tokens in fake_sample(scheduler, output, 12).items():
            sampled.setdefault(request_id, tokens)
        result = scheduler.update_from_output(output, sampled)
        scheduler.update_draft_token_ids({r: [3, 4] for r in result.new_token_ids})
    assert not scheduler.has_unfinished_requests()
    assert num_preempted > 0
    for i, request in enumerate(reqs.values()):
        assert request.num_output_tokens == 8 + i % 5
    assert num_free_blocks(scheduler) == total_blocks
    assert scheduler.kv_cache_manager.usage == 0.0


# ---------------------------------------------------------------- bad input


def test_bad_input_raises_value_error_naming_the_value():
    with pytest.raises(ValueError, match=r"max_num_seqs.*-1"):
        make_scheduler(max_num_seqs=-1)
    with pytest.raises(ValueError, match=r"num_lookahead_tokens.*-2"):
        make_scheduler(num_lookahead_tokens=-2)
    scheduler = make_scheduler(max_model_len=64)
    add(scheduler, "dup", 4)
    with pytest.raises(ValueError, match="'dup'"):
        add(scheduler, "dup", 4)
    with pytest.raises(ValueError, match=r"'long'.*64 prompt tokens"):
        add(scheduler, "long", 64)
    with pytest.raises(ValueError, match="'ghost'"):
        scheduler.finish_requests("ghost")
    with pytest.raises(ValueError, match="'ghost'"):
        scheduler.update_draft_token_ids({"ghost": [1]})
    output = scheduler.schedule()
    with pytest.raises(ValueError, match="'other'"):
        scheduler.update_from_output(output, {"other": [1]})
    with pytest.raises(ValueError, match="-3"):
        scheduler.update_from_output(output, {"dup": [-3]})
    with pytest.raises(ValueError, match="at most 1 \\+ 0 drafts"):
        scheduler.update_from_output(output, {"dup": [1, 2]})


@settings(max_examples=40, deadline=None)
@given(
    prompt_lengths=st.lists(st.integers(1, 150), min_size=1, max_size=12),
    extra_blocks=st.integers(0, 30),
    max_num_seqs=st.integers(1, 8),
    max_num_batched_tokens=st.integers(1, 200),
    num_spec_tokens=st.integers(0, 3),
    policy=st.sampled_from(SchedulingPolicy),
    seed=st.integers(0, 2**16),
)
def test_random_workloads_finish_within_limits(
    prompt_lengths,
    extra_blocks,
    max_num_seqs,
    max_num_batched_tokens,
    num_spec_tokens,
    policy,
    seed,
):
    """Any workload whose largest request fits the pool runs to completion: each step stays
    within the token budget and `max_num_seqs`, drafts are accepted at random, and at the
    end every request has its `max_tokens` outputs and every block is free."""
    rng = random.Random(seed)
    max_tokens = 6
    largest = max(prompt_lengths) + max_tokens + 2 * num_spec_tokens
    num_blocks = 1 + -(-largest // BLOCK_SIZE) + extra_blocks
    scheduler = make_scheduler(
        num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        num_spec_tokens=num_spec_tokens,
        num_lookahead_tokens=num_spec_tokens,
        policy=policy,
    )
    total_blocks = num_free_blocks(scheduler)
    reqs = [
        add(scheduler, f"q{i}", n, max_tokens=max_tokens, priority=rng.randrange(3))
        for i, n in enumerate(prompt_lengths)
    ]
    for _ in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        output = scheduler.schedule()
        assert output.total_num_scheduled_tokens <= max_num_batched_tokens
        assert len(scheduler.running) <= max_num_seqs
        sampled = fake_sample(scheduler, output, 12)
        for request_id, drafts in output.scheduled_spec_decode_tokens.items():
            sampled[request_id] = [13] * rng.randint(0, len(drafts)) + [14]
        result = scheduler.update_from_output(output, sampled)
        drafts = {r: [15] * rng.randint(0, num_spec_tokens) for r in result.new_token_ids}
        scheduler.update_draft_token_ids(drafts)
    assert not scheduler.has_unfinished_requests()
    assert all(r.num_output_tokens == max_tokens for r in reqs)
    assert num_free_blocks(scheduler) == total_blocks


def test_the_scheduler_reads_its_rules_from_its_config():
    manager = make_kv_cache_manager(16, max_model_len=64)
    config = SchedulerConfig(
        max_num_seqs=3,
        max_num_batched_tokens=48,
        async_scheduling=False,
        scheduling_policy="priority",
        long_prefill_token_threshold=7,
        enable_chunked_prefill=False,
        scheduler_reserve_full_isl=False,
    )
    scheduler = Scheduler(manager, config, max_model_len=64)
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == (3, 48)
    assert scheduler.policy is SchedulingPolicy.PRIORITY
    assert scheduler.long_prefill_token_threshold == 7
    assert not scheduler.enable_chunked_prefill and not scheduler.reserve_full_isl
    assert not scheduler.async_scheduling
    with pytest.raises(ValueError, match="SchedulerConfig"):
        Scheduler(manager, {"max_num_seqs": 3}, max_model_len=64)
