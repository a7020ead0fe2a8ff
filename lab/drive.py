"""The lab's loop: a workload's sessions through the one `Scheduler`, with or without the model.

`drive` feeds a `Workload` to a backend step by step: `ModelFreeBackend` (the Scheduler over a
`cache.KVCacheManager`, outputs predetermined, steps shaped as `Engine.step`'s so both make the
same decisions) or `EngineBackend` (the model). Details: docs/lab.md#labdrive.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from lab.workloads import Session, Turn, Workload
from serving.sampling_params import SamplingParams
from serving.scheduler import Scheduler, SchedulerOutput, SchedulerStats, UpdateResult

__all__ = ["DriveResult", "EngineBackend", "Hooks", "ModelFreeBackend", "drive"]


class Hooks(Protocol):
    """Optional callbacks of a model-free run (every method may be absent)."""

    def before_schedule(self) -> None: ...
    def on_schedule(self, output: SchedulerOutput) -> None: ...
    def before_update(self) -> None: ...
    def on_update(self, output: SchedulerOutput, update: UpdateResult) -> None: ...
    def on_add(self, request_id: str, num_prompt_tokens: int) -> None: ...


def _hook(hooks: Any, name: str) -> Callable[..., None] | None:
    return getattr(hooks, name, None) if hooks is not None else None


@dataclass(slots=True)
class DriveResult:
    """What a run did: decision counts, prefix-cache lookups, finished turns, and the trace
    (the workload with the outputs the backend produced)."""

    scheduler: dict[str, int]  # SchedulerStats.as_dict()
    lookup_queries: int | None  # vLLM's PrefixCacheStats (every lookup); None: not kept
    lookup_hits: int | None
    finished_turns: int
    trace: Workload
    steps: int

    @property
    def prefix_hit_rate(self) -> float:
        """Share of first admissions' prompt tokens found in the prefix cache."""
        queries = self.scheduler["prefix_queries"]
        return self.scheduler["prefix_hits"] / queries if queries else 0.0

    @property
    def lookup_hit_rate(self) -> float | None:
        """vLLM's logged prefix-cache hit rate (every lookup counted)."""
        if self.lookup_queries is None:
            return None
        return self.lookup_hits / self.lookup_queries if self.lookup_queries else 0.0


class ModelFreeBackend:
    """The Scheduler over a KV-cache manager, outputs taken from the workload (module doc).

    Args:
        scheduler: a fresh Scheduler; its manager is ``scheduler.kv_cache_manager``.
        hooks: callbacks around each schedule / update (see `Hooks`).
    """

    def __init__(self, scheduler: Scheduler, hooks: Any = None) -> None:
        self.scheduler = scheduler
        self.manager = scheduler.kv_cache_manager
        self.stats = SchedulerStats()
        self.lookup_queries = 0  # the manager's PrefixCacheStats, summed over steps
        self.lookup_hits = 0
        self._hooks = hooks
        self._in_flight: collections.deque[SchedulerOutput] = collections.deque()
        self._outputs: dict[str, tuple[int, ...]] = {}
        self._requests: dict[str, Any] = {}

    def add(self, request_id: str, prompt: list[int], turn: Turn) -> None:
        request = self.manager.new_request(request_id, prompt, max_tokens=len(turn.output))
        self._outputs[request_id] = turn.output
        self._requests[request_id] = request
        self.scheduler.add_request(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def step(self) -> dict[str, tuple[int, ...]]:
        """One `Engine.step`; returns the turns that finished, with their outputs."""
        scheduler, hooks = self.scheduler, self._hooks
        dispatched = False
        if scheduler.has_unfinished_requests():
            if hook := _hook(hooks, "before_schedule"):
                hook()
            output = scheduler.schedule()
            self.stats.observe(output)
            take = getattr(self.manager, "make_prefix_cache_stats", None)
            prefix = take() if take is not None else None
            if prefix is not None:
                self.lookup_queries += prefix.queries
                self.lookup_hits += prefix.hits
            if hook := _hook(hooks, "on_schedule"):
                hook(output)
            head = scheduler.stalled_request(output, len(self._in_flight))
            if head is not None:
                raise RuntimeError(
                    f"step {self.stats.steps} schedules nothing: {head.request_id} "
                    f"({head.num_tokens} tokens) does not fit into an idle pool; the pool is too "
                    "small"
                )
            if output.total_num_scheduled_tokens:
                self._in_flight.append(output)
                dispatched = True
        depth = 2 if scheduler.async_scheduling else 1
        finished: dict[str, tuple[int, ...]] = {}
        if self._in_flight and (len(self._in_flight) >= depth or not dispatched):
            output = self._in_flight.popleft()
            sampled = {}
            for request_id in output.sampling_req_ids:
                request = scheduler.requests.get(request_id)
                if request is not None:
                    sampled[request_id] = [self._outputs[request_id][request.num_output_tokens]]
            if hook := _hook(hooks, "before_update"):
                hook()
            update = scheduler.update_from_output(output, sampled)
            if hook := _hook(hooks, "on_update"):
                hook(output, update)
            for request_id in update.finished:
                request = self._requests.pop(request_id)
                del self._outputs[request_id]
                finished[request_id] = tuple(request.output_token_ids)
        return finished


class EngineBackend:
    """A `serving.Engine` as the backend: the model produces the outputs (greedy unless
    ``sampling`` says otherwise), ``max_tokens`` = the turn's output length, EOS ignored."""

    def __init__(self, engine: Any, sampling: Any = None) -> None:

        self.engine = engine
        self._base = sampling if sampling is not None else SamplingParams(temperature=0.0)

    @property
    def stats(self) -> SchedulerStats:
        return self.engine.scheduler_stats

    lookup_queries = None  # the engine does not keep the manager's per-lookup stats
    lookup_hits = None

    def add(self, request_id: str, prompt: list[int], turn: Turn) -> None:
        params = dataclasses.replace(self._base, max_tokens=len(turn.output), ignore_eos=True)
        self.engine.add_request(request_id, prompt, params)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> dict[str, tuple[int, ...]]:
        finished = {}
        for out in self.engine.step():
            if out.finished:
                finished[out.request_id] = tuple(out.outputs[0].token_ids)
        return finished


@dataclass(slots=True)
class _Live:
    session: Session
    turn: int
    history: list[int] = field(default_factory=list)  # prompt of the turn in flight
    outputs: list[tuple[int, ...]] = field(default_factory=list)


def drive(
    workload: Workload,
    backend: ModelFreeBackend | EngineBackend,
    *,
    max_steps: int | None = None,
    on_add: Callable[[str, int], None] | None = None,
) -> DriveResult:
    """Run ``workload`` through ``backend`` until every turn has finished (or ``max_steps``).

    Arrivals: at each step, sessions whose ``arrival`` is at most the step index are added
    (in workload order) before the step is planned; when nothing is running the clock jumps to
    the next arrival. ``on_add(request_id, num_prompt_tokens)`` is called for every turn added.

    Raises:
        RuntimeError: the pool cannot hold a request even alone
            (`serving.Scheduler.stalled_request`).
    """
    # Automatic garbage collection is off while a model-free loop runs: a collection traverses
    # every live object it covers, and a large workload keeps hundreds of thousands of token
    # lists alive (measured: 40% of a 100k-request run). The loop and the allocator make few
    # reference cycles (thousands over tens of thousands of steps); a young-generation
    # collection every `_COLLECT_EVERY` steps still frees them. The engine's loop collects as
    # `LLM`'s does (`serving.Engine.serving_loop`: device buffers may hang on cycles).
    if isinstance(backend, EngineBackend):
        with backend.engine.serving_loop():
            return _drive(workload, backend, max_steps, on_add, collect=False)
    if not gc.isenabled():
        return _drive(workload, backend, max_steps, on_add, collect=False)
    gc.disable()
    try:
        return _drive(workload, backend, max_steps, on_add, collect=True)
    finally:
        gc.enable()


_COLLECT_EVERY = 1000


def _drive(
    workload: Workload,
    backend: ModelFreeBackend | EngineBackend,
    max_steps: int | None,
    on_add: Callable[[str, int], None] | None,
    *,
    collect: bool,
) -> DriveResult:
    pending = sorted(workload.sessions, key=lambda s: s.arrival)  # stable: workload order
    live: dict[str, _Live] = {}
    traces: dict[int, list[tuple[int, ...]]] = {s.session_id: [] for s in workload.sessions}
    next_arrival, step, finished_turns, calls = 0, 0, 0, 0

    def add(state: _Live) -> None:
        request_id, prompt_len = _add_turn(workload, backend, state)
        live[request_id] = state
        if on_add is not None:
            on_add(request_id, prompt_len)

    while next_arrival < len(pending) or backend.has_unfinished():
        if max_steps is not None and step >= max_steps:
            break
        if not backend.has_unfinished() and pending[next_arrival].arrival > step:
            step = pending[next_arrival].arrival  # idle until the next session arrives
        while next_arrival < len(pending) and pending[next_arrival].arrival <= step:
            add(_Live(pending[next_arrival], 0))
            next_arrival += 1
        finished = backend.step()
        step += 1
        calls += 1
        if collect and calls % _COLLECT_EVERY == 0:
            gc.collect(1)
        for request_id, output in finished.items():
            state = live.pop(request_id)
            finished_turns += 1
            traces[state.session.session_id].append(output)
            state.history += output
            if state.turn + 1 < len(state.session.turns):
                add(_Live(state.session, state.turn + 1, state.history))
    return DriveResult(
        scheduler=backend.stats.as_dict(),
        lookup_queries=backend.lookup_queries,
        lookup_hits=backend.lookup_hits,
        finished_turns=finished_turns,
        trace=_trace(workload, traces),
        steps=backend.stats.steps,
    )


def _add_turn(workload: Workload, backend, state: _Live) -> tuple[str, int]:
    """Add ``state``'s turn to ``backend``; returns its request id and prompt length."""
    session, k = state.session, state.turn
    request_id = workload.request_id(session, k)
    if k == 0:
        state.history = [] if session.prefix is None else list(workload.prefixes[session.prefix])
    turn = session.turns[k]
    state.history += turn.user
    backend.add(request_id, list(state.history), turn)
    return request_id, len(state.history)


def _trace(workload: Workload, traces: dict[int, list[tuple[int, ...]]]) -> Workload:
    """``workload`` with each turn's output replaced by what the run produced."""
    return Workload(
        kind=workload.kind,
        seed=workload.seed,
        prefixes=workload.prefixes,
        sessions=tuple(
            Session(
                session_id=s.session_id,
                prefix=s.prefix,
                turns=tuple(
                    Turn(user=t.user, output=o) for t, o in zip(s.turns, traces[s.session_id])
                ),
                arrival=s.arrival,
            )
            for s in workload.sessions
        ),
    )
