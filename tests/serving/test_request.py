"""`serving.request.Request`: the one object that carries a sequence's state through the
scheduler (status, stop rules, in-flight counts) and the engine (logprobs, DELTA outputs)."""

from __future__ import annotations

from test_scheduler import make_scheduler

import cache
from serving.outputs import RequestMetrics
from serving.request import ParentRequest, Request, RequestStatus, StopCriteria
from serving.sampling_params import RequestOutputKind, SamplingParams


def test_stop_criteria_of_sampling_params():
    params = SamplingParams(stop_token_ids=[5, 6, 5], min_tokens=2)
    assert StopCriteria.of(params, 9) == StopCriteria(
        eos_token_id=9, stop_token_ids=frozenset({5, 6}), min_tokens=2
    )
    assert StopCriteria.of(SamplingParams(ignore_eos=True), 9).eos_token_id is None


def test_the_scheduler_keeps_its_state_on_the_request():
    """Status, stop rules and prefill progress live on the request the scheduler was given,
    from WAITING to the finish status it leaves with."""
    scheduler = make_scheduler(max_num_batched_tokens=8)
    request = Request(
        "a",
        list(range(10, 22)),
        stop=StopCriteria(min_tokens=1),
        hash_block_size=scheduler.kv_cache_manager.hash_block_size,
        max_tokens=2,
    )
    assert isinstance(request, cache.Request)
    scheduler.add_request(request)
    assert request.status is RequestStatus.WAITING and request.stop.min_tokens == 1
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"a": 8}
    assert request.status is RequestStatus.RUNNING and request.is_prefill_chunk
    scheduler.update_from_output(first, {})
    second = scheduler.schedule()
    assert second.sampling_req_ids == {"a"} and not request.is_prefill_chunk
    scheduler.update_from_output(second, {"a": [3]})
    result = scheduler.update_from_output(scheduler.schedule(), {"a": [4]})
    assert result.finished == {"a": RequestStatus.FINISHED_LENGTH_CAPPED}
    assert request.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert request.output_token_ids == [3, 4] and "a" not in scheduler.requests


def test_a_bare_cache_request_is_given_the_scheduling_fields():
    """The lab and the allocator benchmarks queue requests their manager made."""
    scheduler = make_scheduler()
    request = scheduler.kv_cache_manager.new_request("bare", [1, 2, 3], max_tokens=1)
    scheduler.add_request(request)
    assert request.status is RequestStatus.WAITING and request.num_output_placeholders == 0
    assert request.stop == StopCriteria(eos_token_id=scheduler.eos_token_id)


def test_logprobs_and_delta_completions():
    params = SamplingParams(logprobs=1, output_kind=RequestOutputKind.DELTA)
    parent = ParentRequest("p", None, [1, 2], params, RequestMetrics(arrival_time=0.0))
    request = Request("p", [1, 2], params, parent=parent, index=0)
    request.append_output_token_ids([7, 8])
    entries = [(-0.5, 1, [7], [-0.5]), (-1.25, 2, [3], [-0.25])]
    request.append_logprobs([7, 8], entries, decode=lambda token_id: None)
    assert request.cumulative_logprob == -1.75
    assert [sorted(d) for d in request.logprobs] == [[7], [3, 8]]
    first = request.completion(tokenizer=None)
    assert first.token_ids == [7, 8] and len(first.logprobs) == 2
    request.append_output_token_ids(9)
    request.append_logprobs([9], [(-2.0, 1, [9], [-2.0])], decode=lambda token_id: None)
    second = request.completion(tokenizer=None)
    assert second.token_ids == [9] and len(second.logprobs) == 1
    assert second.cumulative_logprob == -3.75
