"""The scheduler's asynchronous mode (vLLM `AsyncScheduler`) against its synchronous mode.

A fake model makes the token sampled at position p of request r a fixed function of (r, p), so
whatever the engine's timing, the same requests must produce the same tokens and stop for the
same reasons. The asynchronous driver keeps two steps in flight, as the engine does: it plans
step N+1 before it applies step N's tokens.
"""

from __future__ import annotations

import random
import zlib
from collections import deque

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_scheduler import BLOCK_SIZE, make_kv_cache_manager, num_free_blocks, scheduler_over

from serving.request import Request
from serving.scheduler import RequestStatus, Scheduler, StopCriteria

EOS = 1
VOCAB = 40


def token_at(request_id: str, position: int) -> int:
    """The fake model: a deterministic token in [0, VOCAB) (EOS about once in 40)."""
    return zlib.crc32(f"{request_id}:{position}".encode()) % VOCAB


def make(async_scheduling: bool, num_blocks: int, **kwargs) -> Scheduler:
    max_model_len = kwargs.pop("max_model_len", 256)
    return scheduler_over(
        make_kv_cache_manager(num_blocks, max_model_len=max_model_len),
        max_model_len=max_model_len,
        eos_token_id=EOS,
        async_scheduling=async_scheduling,
        **kwargs,
    )


def fake_tokens(scheduler: Scheduler, output) -> dict[str, list[int]]:
    """What the fake model samples in a step: one token per sampling request, at the position
    after its scheduled tokens (known when the step is planned, also asynchronously)."""
    return {
        r: [token_at(r, scheduler.requests[r].num_computed_tokens)] for r in output.sampling_req_ids
    }


def drive(scheduler: Scheduler, *, depth: int, abort_at: dict[int, str] | None = None):
    """Run to completion with `depth` steps in flight; returns (outputs, statuses, steps)."""
    outputs: dict[str, list[int]] = {}
    statuses: dict[str, RequestStatus] = {}
    in_flight: deque = deque()
    steps = 0
    while scheduler.has_unfinished_requests() or in_flight:
        if abort_at and steps in abort_at and abort_at[steps] in scheduler.requests:
            scheduler.finish_requests(abort_at[steps])
            statuses[abort_at[steps]] = RequestStatus.FINISHED_ABORTED
        planned = False
        if scheduler.has_unfinished_requests():
            output = scheduler.schedule()
            if output.total_num_scheduled_tokens:
                in_flight.append((output, fake_tokens(scheduler, output)))
                planned = True
        steps += 1
        if in_flight and (len(in_flight) >= depth or not planned):
            output, tokens = in_flight.popleft()
            result = scheduler.update_from_output(output, tokens)
            for request_id, new in result.new_token_ids.items():
                outputs.setdefault(request_id, []).extend(new)
            statuses.update(result.finished)
        assert steps < 5000, "the workload does not finish"
    return outputs, statuses, steps


def add_all(scheduler: Scheduler, specs) -> None:
    for request_id, prompt_len, max_tokens, stop in specs:
        prompt = [2 + (zlib.crc32(f"{request_id}{i}".encode()) % 30) for i in range(prompt_len)]
        request = Request(
            request_id,
            prompt,
            hash_block_size=scheduler.kv_cache_manager.hash_block_size,
            max_tokens=max_tokens,
        )
        scheduler.add_request(request, stop)


def test_async_plans_the_next_decode_before_the_token_is_known():
    scheduler = make(True, 32, max_num_seqs=4, max_num_batched_tokens=64)
    add_all(scheduler, [("a", 10, 5, None)])
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"a": 10} and first.sampling_req_ids == {"a"}
    assert scheduler.requests["a"].num_output_placeholders == 1
    second = scheduler.schedule()  # step 1's token is still on the device
    assert second.num_scheduled_tokens == {"a": 1} and second.sampling_req_ids == {"a"}
    assert scheduler.requests["a"].num_output_placeholders == 2
    result = scheduler.update_from_output(first, {"a": [7]})
    assert (
        result.new_token_ids == {"a": [7]} and scheduler.requests["a"].num_output_placeholders == 1
    )
    scheduler.update_from_output(second, {"a": [8]})
    assert scheduler.requests["a"].output_token_ids == [7, 8]
    assert scheduler.requests["a"].num_output_placeholders == 0


def test_async_does_not_schedule_past_max_tokens():
    """The in-flight steps already produce max_tokens outputs: no wasted decode row."""
    scheduler = make(True, 32, max_num_seqs=4, max_num_batched_tokens=64)
    add_all(scheduler, [("a", 4, 2, StopCriteria())])
    scheduler.schedule()
    assert scheduler.schedule().num_scheduled_tokens == {"a": 1}
    assert scheduler.schedule().num_scheduled_tokens == {}


def test_request_preempted_with_a_step_in_flight_keeps_its_token():
    """B is preempted while its decode step is in flight; the token that step sampled is kept
    (vLLM would discard and recompute it) and B is re-admitted only after it arrived."""
    scheduler = make(True, 5, max_num_seqs=4, max_num_batched_tokens=64)
    add_all(scheduler, [("A", 32, 40, StopCriteria()), ("B", 31, 40, StopCriteria())])
    step1 = scheduler.schedule()  # A: 32 (2 blocks), B: 31 (2 blocks); the pool is full
    assert step1.sampling_req_ids == {"A", "B"}
    step2 = scheduler.schedule()  # A's decode needs a third block: B (last) is preempted
    assert step2.preempted_req_ids == {"B"} and "B" not in step2.num_scheduled_tokens
    assert scheduler.requests["B"].num_output_placeholders == 1
    step3 = scheduler.schedule()  # B waits: its token is still in flight
    assert not step3.scheduled_new_reqs
    result = scheduler.update_from_output(step1, {"A": [5], "B": [6]})
    assert result.new_token_ids == {"A": [5], "B": [6]}
    b = scheduler.requests["B"]
    assert scheduler.requests["B"].status is RequestStatus.PREEMPTED and b.output_token_ids == [6]
    assert b.num_computed_tokens == 0 and scheduler.requests["B"].num_output_placeholders == 0


def test_preempted_request_that_stops_with_its_in_flight_token_is_freed():
    scheduler = make(True, 5, max_num_seqs=4, max_num_batched_tokens=64)
    add_all(scheduler, [("A", 32, 40, StopCriteria()), ("B", 31, 40, StopCriteria(eos_token_id=9))])
    step1 = scheduler.schedule()
    assert scheduler.schedule().preempted_req_ids == {"B"}
    result = scheduler.update_from_output(step1, {"A": [5], "B": [9]})
    assert result.finished == {"B": RequestStatus.FINISHED_STOPPED}
    assert "B" not in scheduler.requests and not scheduler.waiting


def test_stop_rules_min_tokens_stop_ids_and_reasons():
    scheduler = make(False, 32, max_num_seqs=4, max_num_batched_tokens=64)
    add_all(
        scheduler,
        [
            ("eos", 3, 10, StopCriteria(eos_token_id=9)),
            ("min", 3, 10, StopCriteria(eos_token_id=9, min_tokens=2)),
            ("ids", 3, 10, StopCriteria(stop_token_ids=frozenset({9}))),
            ("ignore", 3, 3, StopCriteria()),
        ],
    )
    output = scheduler.schedule()
    result = scheduler.update_from_output(output, {r: [9] for r in output.sampling_req_ids})
    assert result.finished == {
        "eos": RequestStatus.FINISHED_STOPPED,
        "ids": RequestStatus.FINISHED_STOPPED,
    }
    assert result.stop_reasons == {"ids": 9}
    finished = []
    for _ in range(2):
        output = scheduler.schedule()
        result = scheduler.update_from_output(output, {r: [9] for r in output.sampling_req_ids})
        finished.append(result.finished)
    assert finished == [
        {"min": RequestStatus.FINISHED_STOPPED},  # its second output: min_tokens reached
        {"ignore": RequestStatus.FINISHED_LENGTH_CAPPED},
    ]


def test_min_tokens_never_holds_a_request_past_max_model_len():
    scheduler = make(False, 32, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=8)
    add_all(scheduler, [("a", 6, None, StopCriteria(min_tokens=50))])
    _, statuses, _ = drive(scheduler, depth=1)
    assert statuses == {"a": RequestStatus.FINISHED_LENGTH_CAPPED}


def test_bad_stop_criteria_are_rejected():
    scheduler = make(False, 32, max_num_seqs=4, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="min_tokens"):
        add_all(scheduler, [("a", 3, 4, StopCriteria(min_tokens=-1))])
    with pytest.raises(ValueError, match="-5"):
        add_all(scheduler, [("b", 3, 4, StopCriteria(stop_token_ids=frozenset({-5})))])
    with pytest.raises(ValueError, match="max_tokens=0"):
        add_all(scheduler, [("c", 3, 0, None)])
    assert not scheduler.requests


@settings(max_examples=30, deadline=None)
@example(num_requests=2, extra_blocks=0, max_num_seqs=1, max_num_batched_tokens=4, seed=92)
@given(
    num_requests=st.integers(1, 10),
    extra_blocks=st.integers(0, 12),
    max_num_seqs=st.integers(1, 6),
    max_num_batched_tokens=st.integers(4, 96),
    seed=st.integers(0, 2**16),
)
def test_async_equals_sync_on_random_workloads(
    num_requests, extra_blocks, max_num_seqs, max_num_batched_tokens, seed
):
    """Same tokens and finish reasons with one and with two steps in flight, under chunked
    prefill, preemption (tight pools), EOS, stop ids, min_tokens and max_tokens; every block
    is free at the end. Async wastes at most one step per request stopped by a token."""
    rng = random.Random(seed)
    specs = []
    for i in range(num_requests):
        stop = StopCriteria(
            eos_token_id=None if rng.random() < 0.2 else EOS,
            stop_token_ids=frozenset(rng.sample(range(2, VOCAB), rng.randint(0, 2))),
            min_tokens=rng.randint(0, 3),
        )
        specs.append((f"r{i}", rng.randint(1, 70), rng.choice([None, 1, 5, 20]), stop))
    # The longest a request can grow: max_tokens outputs, or up to max_model_len (100) without
    # them; the pool must hold it alone, else it is preempted forever (seed 92 drew a request
    # without EOS and max_tokens that outgrew a pool sized for 20 outputs). Pressure comes from
    # the requests competing.
    largest = max(min(100, n + (m or 100)) for _, n, m, _ in specs)
    num_blocks = 1 + -(-largest // BLOCK_SIZE) + 1 + extra_blocks
    kw = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    results = []
    for async_scheduling, depth in ((False, 1), (True, 2)):
        scheduler = make(async_scheduling, num_blocks, max_model_len=100, **kw)
        total = num_free_blocks(scheduler)
        add_all(scheduler, specs)
        results.append(drive(scheduler, depth=depth))
        assert num_free_blocks(scheduler) == total
        # (the in-flight counts live on the requests, which the scheduler forgets at finish)
        assert not scheduler.requests
    (sync_out, sync_status, _), (async_out, async_status, _) = results
    assert async_out == sync_out
    assert async_status == sync_status
    assert set(sync_status) == {r for r, *_ in specs}


def test_async_equals_sync_with_aborts():
    """An abort lands between planning and applying a step: the aborted request's in-flight
    tokens are dropped, the others are unaffected."""
    specs = [(f"r{i}", 20 + 7 * i, 30, StopCriteria()) for i in range(5)]
    results = []
    for async_scheduling, depth in ((False, 1), (True, 2)):
        scheduler = make(async_scheduling, 40, max_num_seqs=3, max_num_batched_tokens=32)
        add_all(scheduler, specs)
        results.append(drive(scheduler, depth=depth, abort_at={6: "r1", 9: "r4"}))
        assert num_free_blocks(scheduler) == 39
    (sync_out, sync_status, _), (async_out, async_status, _) = results
    assert sync_status["r1"] is async_status["r1"] is RequestStatus.FINISHED_ABORTED
    for r in ("r0", "r2", "r3"):
        assert async_out[r] == sync_out[r] and async_status[r] is sync_status[r]
