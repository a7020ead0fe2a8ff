"""Waiting queues for the scheduler: first-come-first-served and priority order.

Mirrors vLLM v1's `vllm/v1/core/sched/request_queue.py`: the same policy enum, queue operations
and factory `create_request_queue`. A queue reads only `request_id`, `priority` and
`arrival_time` from the requests it holds.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Protocol


class QueuedRequest(Protocol):
    """What a queue reads from a request (`cache.Request` satisfies it)."""

    @property
    def request_id(self) -> str: ...

    @property
    def priority(self) -> int: ...

    @property
    def arrival_time(self) -> float: ...


class SchedulingPolicy(enum.Enum):
    """Order in which waiting requests are admitted (vLLM `SchedulingPolicy`)."""

    FCFS = "fcfs"
    PRIORITY = "priority"


class FCFSRequestQueue:
    """Arrival-order queue over a deque (vLLM `FCFSRequestQueue`).

    `add_request` appends at the back; `pop_request` and `peek_request` read the front;
    `prepend_request` puts one request at the front (a preempted request goes there so it
    resumes first); `prepend_requests` pushes each request of the iterable to the front in
    turn, so they end up in reverse order, exactly like `deque.extendleft` in vLLM.
    """

    __slots__ = ("_queue",)

    def __init__(self) -> None:
        self._queue: deque[QueuedRequest] = deque()

    def add_request(self, request: QueuedRequest) -> None:
        """Append `request` at the back."""
        self._queue.append(request)

    def pop_request(self) -> QueuedRequest:
        """Remove and return the front request; IndexError when empty."""
        if not self._queue:
            raise IndexError("pop_request on an empty FCFS queue")
        return self._queue.popleft()

    def peek_request(self) -> QueuedRequest:
        """Return the front request without removing it; IndexError when empty."""
        if not self._queue:
            raise IndexError("peek_request on an empty FCFS queue")
        return self._queue[0]

    def prepend_request(self, request: QueuedRequest) -> None:
        """Put `request` at the front."""
        self._queue.appendleft(request)

    def prepend_requests(self, requests: Iterable[QueuedRequest]) -> None:
        """Push each request to the front in iteration order (so the last one ends first)."""
        self._queue.extendleft(requests)

    def remove_request(self, request: QueuedRequest) -> None:
        """Remove `request`; ValueError naming its id when it is not queued."""
        try:
            self._queue.remove(request)
        except ValueError:
            raise ValueError(f"request {request.request_id!r} is not in the FCFS queue") from None

    def remove_requests(self, requests: Iterable[QueuedRequest]) -> None:
        """Remove every queued request found in `requests` (absent ones are ignored)."""
        doomed = {id(r) for r in requests}
        if doomed:
            self._queue = deque(r for r in self._queue if id(r) not in doomed)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[QueuedRequest]:
        """Iterate front to back (the order `pop_request` would return them)."""
        return iter(self._queue)


class PriorityRequestQueue:
    """Binary heap ordered by `(priority, arrival_time)`, lower first (vLLM's
    `PriorityRequestQueue`).

    Ties go to `request_id`, then to insertion order (deterministic, where vLLM falls back to
    object identity). `prepend_request(s)` insert by key: a preempted request returns to its place.
    """

    __slots__ = ("_counter", "_heap")

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, str, int, QueuedRequest]] = []
        self._counter = itertools.count()

    def add_request(self, request: QueuedRequest) -> None:
        """Insert `request` by `(priority, arrival_time)`."""
        entry = (
            request.priority,
            request.arrival_time,
            request.request_id,
            next(self._counter),
            request,
        )
        heapq.heappush(self._heap, entry)

    def pop_request(self) -> QueuedRequest:
        """Remove and return the smallest `(priority, arrival_time)`; IndexError when empty."""
        if not self._heap:
            raise IndexError("pop_request on an empty priority queue")
        return heapq.heappop(self._heap)[-1]

    def peek_request(self) -> QueuedRequest:
        """Return the request `pop_request` would return, without removing it."""
        if not self._heap:
            raise IndexError("peek_request on an empty priority queue")
        return self._heap[0][-1]

    def prepend_request(self, request: QueuedRequest) -> None:
        """Same as `add_request`: ordering is by key only."""
        self.add_request(request)

    def prepend_requests(self, requests: Iterable[QueuedRequest]) -> None:
        """Same as `add_request` for each request: ordering is by key only."""
        for request in requests:
            self.add_request(request)

    def remove_request(self, request: QueuedRequest) -> None:
        """Remove `request`; ValueError naming its id when it is not queued."""
        index = next((i for i, e in enumerate(self._heap) if e[-1] is request), None)
        if index is None:
            raise ValueError(f"request {request.request_id!r} is not in the priority queue")
        self._heap[index] = self._heap[-1]
        self._heap.pop()
        heapq.heapify(self._heap)

    def remove_requests(self, requests: Iterable[QueuedRequest]) -> None:
        """Remove every queued request found in `requests` (absent ones are ignored)."""
        doomed = {id(r) for r in requests}
        if doomed:
            self._heap = [e for e in self._heap if id(e[-1]) not in doomed]
            heapq.heapify(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[QueuedRequest]:
        """Iterate in pop order without changing the queue."""
        return (entry[-1] for entry in sorted(self._heap))


RequestQueue = FCFSRequestQueue | PriorityRequestQueue


def create_request_queue(policy: SchedulingPolicy) -> RequestQueue:
    """Return an empty queue for `policy` (vLLM `create_request_queue`).

    Raises:
        ValueError: `policy` is not a `SchedulingPolicy`.
    """
    if policy is SchedulingPolicy.FCFS:
        return FCFSRequestQueue()
    if policy is SchedulingPolicy.PRIORITY:
        return PriorityRequestQueue()
    raise ValueError(
        f"unknown scheduling policy {policy!r}; expected one of {list(SchedulingPolicy)}"
    )
