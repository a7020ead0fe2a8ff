"""Waiting-queue semantics (vLLM `request_queue.py`): FCFS deque and (priority, arrival) heap."""

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from serving.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    SchedulingPolicy,
    create_request_queue,
)


@dataclass(eq=False)
class Req:
    request_id: str
    priority: int = 0
    arrival_time: float = 0.0


def ids(queue) -> list[str]:
    return [r.request_id for r in queue]


def test_create_request_queue_by_policy():
    assert isinstance(create_request_queue(SchedulingPolicy.FCFS), FCFSRequestQueue)
    assert isinstance(create_request_queue(SchedulingPolicy.PRIORITY), PriorityRequestQueue)
    with pytest.raises(ValueError, match="'lifo'"):
        create_request_queue("lifo")


def test_fcfs_add_pop_peek_prepend():
    queue = FCFSRequestQueue()
    a, b, c, d, e = (Req(x) for x in "abcde")
    for r in (a, b, c):
        queue.add_request(r)
    assert queue.peek_request() is a and len(queue) == 3
    assert queue.pop_request() is a
    queue.prepend_request(d)
    assert ids(queue) == ["d", "b", "c"]
    # extendleft semantics: the iterable ends up reversed at the front.
    queue.prepend_requests([a, e])
    assert ids(queue) == ["e", "a", "d", "b", "c"]
    queue.remove_request(d)
    queue.remove_requests([e, c, Req("absent")])
    assert ids(queue) == ["a", "b"]
    with pytest.raises(ValueError, match="'zz'"):
        queue.remove_request(Req("zz"))


def test_empty_queues_raise_index_error():
    for queue in (FCFSRequestQueue(), PriorityRequestQueue()):
        assert not queue and len(queue) == 0
        with pytest.raises(IndexError):
            queue.peek_request()
        with pytest.raises(IndexError):
            queue.pop_request()


def test_priority_orders_by_priority_then_arrival():
    queue = PriorityRequestQueue()
    reqs = [Req(str(i), p, t) for i, (p, t) in enumerate([(2, 1), (1, 3), (1, 2), (0, 4)])]
    for r in reqs:
        queue.add_request(r)
    assert ids(queue) == ["3", "2", "1", "0"]
    assert len(queue) == 4  # iteration does not consume
    assert queue.peek_request() is reqs[3]
    # "Prepend" is a plain insert: a late low-priority request does not jump the queue.
    queue.prepend_request(Req("late", 5, 0))
    queue.prepend_requests([Req("first", -1, 9)])
    assert ids(queue) == ["first", "3", "2", "1", "0", "late"]
    queue.remove_request(reqs[2])
    queue.remove_requests([reqs[0]])
    assert [queue.pop_request().request_id for _ in range(len(queue))] == [
        "first",
        "3",
        "1",
        "late",
    ]
    with pytest.raises(ValueError, match="'2'"):
        queue.remove_request(reqs[2])


@given(st.lists(st.tuples(st.integers(-3, 3), st.integers(0, 5)), max_size=30))
def test_priority_pop_order_is_sorted_key(keys):
    queue = PriorityRequestQueue()
    reqs = [Req(f"r{i:02d}", p, float(t)) for i, (p, t) in enumerate(keys)]
    for r in reqs:
        queue.add_request(r)
    popped = [queue.pop_request() for _ in range(len(reqs))]
    expected = sorted(reqs, key=lambda r: (r.priority, r.arrival_time, r.request_id))
    assert popped == expected
