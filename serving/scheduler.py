"""Host-side scheduler: decides, each step, which requests run and how many tokens each gets.

vLLM v1's `Scheduler` and, with ``async_scheduling``, its `AsyncScheduler`, over our
`cache.KVCacheManager`: one class, one state machine, so the synchronous and the asynchronous
engines plan by the same rules. docs/serving.md gives the rules, the stop rules, the
deviations from vLLM and the invariants kept here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from serving.config import SchedulerConfig
from serving.request import Request, RequestStatus, StopCriteria, init_scheduling
from serving.request_queue import SchedulingPolicy, create_request_queue

if TYPE_CHECKING:  # the scheduler only calls into it; it never constructs one
    from cache import KVCacheManager

__all__ = [
    "CachedRequestData",
    "NewRequestData",
    "RequestStatus",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerStats",
    "SpecDecodingStats",
    "StopCriteria",
    "UpdateResult",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class NewRequestData:
    """A request that (re)enters the batch this step: the runner sets up its state from scratch.

    Resumed (previously preempted) requests are sent this way too, with their outputs in
    `token_ids`, as vLLM's V2 model runner receives them; the runner must drop any old state
    it kept for the same id.
    """

    request_id: str
    token_ids: tuple[int, ...]  # prompt + outputs so far, [num_tokens]
    block_ids: tuple[list[int], ...]  # every block the request holds, one list per KV group
    num_computed_tokens: int  # tokens already in the cache before this step (prefix hits)
    # Bounded replay (V4.1 window caches, `KVCacheManager(swa_bounded_replay=True)`): the first
    # `num_replay_tokens` scheduled tokens are prefix-hit tokens whose window KV is rebuilt;
    # their cached (full-attention) KV is already there and must be left alone.
    num_replay_tokens: int = 0


@dataclass(slots=True, kw_only=True)
class CachedRequestData:
    """A request that was running in the previous step and runs again in this one (not changed
    once built; not frozen: a frozen dataclass costs every running request a microsecond more
    to build, every step)."""

    request_id: str
    # blocks appended this step, one list per KV group; None: none (vLLM's allow_none form)
    new_block_ids: tuple[list[int], ...] | None
    num_computed_tokens: int  # tokens in the cache before this step


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerOutput:
    """The plan of one step (vLLM `SchedulerOutput`, synchronous subset).

    `finished_req_ids` are the requests that finished since the previous `schedule()` call
    (stopped or aborted), so the runner can drop their state; `preempted_req_ids` are the
    requests preempted while planning this step.
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # request id -> tokens scheduled this step
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]]  # request id -> draft tokens to verify
    num_common_prefix_blocks: list[int]  # per KV group, for cascade attention
    preempted_req_ids: set[str]
    finished_req_ids: set[str]
    # Requests whose scheduled tokens reach the end of their sequence (known tokens plus those
    # in flight): each samples 1 + accepted drafts tokens; the others are mid-prefill.
    sampling_req_ids: frozenset[str] = frozenset()


@dataclass(slots=True, kw_only=True)
class SpecDecodingStats:
    """Draft acceptance counts of one step (vLLM `SpecDecodingStats`).

    `num_drafts` counts requests that verified drafts; position `i` of
    `num_accepted_tokens_per_pos` counts drafts whose token `i` was accepted.
    """

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_draft_tokens_per_pos: list[int] = field(default_factory=list)

    @classmethod
    def new(cls, num_spec_tokens: int) -> SpecDecodingStats:
        return cls(
            num_spec_tokens=num_spec_tokens,
            num_accepted_tokens_per_pos=[0] * num_spec_tokens,
            num_draft_tokens_per_pos=[0] * num_spec_tokens,
        )

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Add one request's verification: `num_accepted_tokens` of `num_draft_tokens`."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for pos in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[pos] += 1
        for pos in range(num_draft_tokens):
            self.num_draft_tokens_per_pos[pos] += 1


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateResult:
    """What `update_from_output` did with one step's sampled tokens."""

    new_token_ids: dict[str, list[int]]  # tokens appended per request (cut at a stop)
    finished: dict[str, RequestStatus]  # requests that finished in this update, with why
    stop_reasons: dict[str, int]  # finished by a stop token id: which one (vLLM stop_reason)
    spec_decoding_stats: SpecDecodingStats | None  # None when no draft was verified
    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float


@dataclass(slots=True)
class SchedulerStats:
    """Counts of the scheduler's decisions, read off its `SchedulerOutput`s (`observe`). The
    engine and the lab both keep one, so a lab run and an engine run of the same workload
    report the same figures from the same plans; each field's comment says what it counts."""

    steps: int = 0  # `observe` calls (steps that were planned)
    scheduled_tokens: int = 0  # tokens handed out, summed over steps
    max_scheduled_requests: int = 0  # most requests scheduled in one step
    admissions: int = 0  # requests that entered the batch from the waiting queue (resumed too)
    preemptions: int = 0
    replay_tokens: int = 0  # bounded replay: prefix-hit tokens whose window KV is rebuilt
    # scheduled tokens below the request's high-water mark (positions it had computed before a
    # preemption), replay tokens excluded
    preemption_recomputed_tokens: int = 0
    # prompt tokens of first admissions (resumed requests excluded) and, of them, the prefix-cache
    # hit tokens they were admitted with, replay tokens included (docs/serving.md compares this
    # with vLLM's `PrefixCacheStats`)
    prefix_queries: int = 0
    prefix_hits: int = 0
    # request id -> most tokens it has had computed (forgotten when it finishes)
    _high_water: dict[str, int] = field(default_factory=dict, repr=False)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    @property
    def recomputed_tokens(self) -> int:
        """Tokens computed again although their KV had been computed once: replay plus
        recompute after preemption."""
        return self.replay_tokens + self.preemption_recomputed_tokens

    def observe(self, output: SchedulerOutput) -> None:
        """Add one step's plan."""
        high = self._high_water
        for request_id in output.finished_req_ids:
            high.pop(request_id, None)
        scheduled = output.num_scheduled_tokens
        self.steps += 1
        self.scheduled_tokens += output.total_num_scheduled_tokens
        self.max_scheduled_requests = max(self.max_scheduled_requests, len(scheduled))
        self.preemptions += len(output.preempted_req_ids)
        recomputed = 0  # scheduled tokens below a request's high-water mark, replay excluded
        for new in output.scheduled_new_reqs:
            request_id, start, replay = (
                new.request_id,
                new.num_computed_tokens,
                new.num_replay_tokens,
            )
            self.admissions += 1
            self.replay_tokens += replay
            if request_id not in high:  # first admission
                self.prefix_queries += len(new.token_ids)
                self.prefix_hits += start + replay
            end = start + scheduled[request_id]
            mark = high.get(request_id, 0)
            recomputed += max(0, min(mark, end) - (start + replay))
            if end > mark:
                high[request_id] = end
        for cached in output.scheduled_cached_reqs:  # the hot loop: one per running request
            request_id, start = cached.request_id, cached.num_computed_tokens
            end = start + scheduled[request_id]
            mark = high.get(request_id, 0)
            if start < mark:  # back over positions computed before a preemption
                recomputed += min(mark, end) - start
            if end > mark:
                high[request_id] = end
        self.preemption_recomputed_tokens += recomputed

    def as_dict(self) -> dict[str, int]:
        """Every count by name, `recomputed_tokens` after the two it sums."""
        out = {}
        for f in fields(self):
            if f.repr:  # not the high-water bookkeeping
                out[f.name] = getattr(self, f.name)
            if f.name == "preemption_recomputed_tokens":
                out["recomputed_tokens"] = self.recomputed_tokens
        return out


@dataclass(slots=True)
class _StepPlan:
    """Mutable bookkeeping of one `schedule()` call."""

    token_budget: int
    new_reqs: list[Request] = field(default_factory=list)
    running_reqs: list[Request] = field(default_factory=list)
    new_block_ids: dict[str, tuple[list[int], ...] | None] = field(default_factory=dict)
    num_replay_tokens: dict[str, int] = field(default_factory=dict)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    held_back: bool = False  # a running request waits for its step in flight (no admission)


def _check_count(name: str, value: int, minimum: int = 0) -> None:
    if not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


class Scheduler:
    """Plans steps over a `KVCacheManager` (vLLM v1 `Scheduler`, host only); docs/serving.md
    explains its rules (budget, chunked prefill, preemption, asynchronous placeholders).

    Args:
        kv_cache_manager: the allocator; the scheduler is its only caller.
        scheduler_config: limits and rules (`serving.config.SchedulerConfig` holds the defaults).
        max_model_len, eos_token_id: most tokens a request holds; the token that stops one.
        num_spec_tokens, num_lookahead_tokens: drafts per request and step; KV slots kept for them.
        drafts_on_device: asynchronous drafts are planned as k placeholders (-1) at once.
    """

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        scheduler_config: SchedulerConfig,
        *,
        max_model_len: int,
        eos_token_id: int | None = None,
        num_spec_tokens: int = 0,
        num_lookahead_tokens: int = 0,
        drafts_on_device: bool = False,
    ) -> None:
        if not isinstance(scheduler_config, SchedulerConfig):
            raise ValueError(
                f"scheduler_config must be a SchedulerConfig, got {scheduler_config!r}"
            )
        _check_count("max_model_len", max_model_len, 1)
        _check_count("num_spec_tokens", num_spec_tokens)
        _check_count("num_lookahead_tokens", num_lookahead_tokens)
        self.kv_cache_manager = kv_cache_manager
        self.scheduler_config = scheduler_config
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.policy = SchedulingPolicy(scheduler_config.scheduling_policy)
        self.long_prefill_token_threshold = scheduler_config.long_prefill_token_threshold
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.reserve_full_isl = scheduler_config.scheduler_reserve_full_isl
        self.async_scheduling = scheduler_config.async_scheduling
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.num_spec_tokens = num_spec_tokens
        self.num_lookahead_tokens = num_lookahead_tokens
        self.drafts_on_device = drafts_on_device

        # Every unfinished request, by id; each carries its status, stop rules and in-flight
        # counts (`serving.request.Request`).
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []  # admission order; FCFS preempts from the back
        # Finished since the last schedule(): reported once in the next SchedulerOutput.
        self.finished_req_ids: set[str] = set()

    # ---------------------------------------------------------------- requests in and out

    def add_request(self, request: Request, stop: StopCriteria | None = None) -> None:
        """Queue a new request as WAITING (vLLM `add_request`).

        Args:
            request: the request (a bare `cache.Request` gets the scheduler's fields here).
            stop: its stop rules; None: ``request.stop``, else the scheduler's ``eos_token_id``.

        Raises:
            ValueError: a known id, a prompt empty or not shorter than `max_model_len`, max_tokens
                below 1, tokens already computed, or an invalid stop rule.
        """
        request_id = request.request_id
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        if not 0 < request.num_prompt_tokens < self.max_model_len:
            # Room for at least one output: a running request never computes position
            # max_model_len - 1, so a prompt that long could never finish its prefill.
            raise ValueError(
                f"request {request_id!r} has {request.num_prompt_tokens} prompt tokens; "
                f"allowed 1..{self.max_model_len - 1} (max_model_len - 1)"
            )
        if request.max_tokens is not None and request.max_tokens < 1:
            raise ValueError(
                f"request {request_id!r} has max_tokens={request.max_tokens}; allowed: >= 1 or None"
            )
        if request.num_computed_tokens != 0:
            raise ValueError(
                f"request {request_id!r} arrives with num_computed_tokens="
                f"{request.num_computed_tokens}; a new request must have 0"
            )
        if stop is None:
            stop = getattr(request, "stop", None) or StopCriteria(eos_token_id=self.eos_token_id)
        _check_count("min_tokens", stop.min_tokens)
        _check_token_ids(request_id, stop.stop_token_ids)
        if stop.eos_token_id is not None:
            _check_token_ids(request_id, [stop.eos_token_id])
        init_scheduling(request, stop)
        self.requests[request_id] = request
        self.waiting.add_request(request)

    def finish_requests(
        self,
        request_ids: str | Iterable[str],
        finished_status: RequestStatus = RequestStatus.FINISHED_ABORTED,
    ) -> list[Request]:
        """Finish requests from outside (e.g. client abort) and free their blocks (vLLM
        `finish_requests`); ids finished since the last `schedule()` are ignored (an abort can race
        with a stop).

        Returns:
            the requests finished by this call.

        Raises:
            ValueError: `finished_status` is not a finished status, or an id is unknown.
        """
        if not finished_status.is_finished:
            raise ValueError(f"finished_status must be a FINISHED_* status, got {finished_status}")
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        unknown = [i for i in ids if i not in self.requests and i not in self.finished_req_ids]
        if unknown:
            raise ValueError(f"unknown request ids {unknown!r}")
        doomed = [self.requests[i] for i in dict.fromkeys(ids) if i in self.requests]
        running = {id(r) for r in doomed if r.status is RequestStatus.RUNNING}
        if running:
            self.running = [r for r in self.running if id(r) not in running]
        self.waiting.remove_requests(r for r in doomed if r.status is not RequestStatus.RUNNING)
        for request in doomed:
            self._free_request(request, finished_status)
        return doomed

    def update_draft_token_ids(self, draft_token_ids: Mapping[str, list[int]]) -> None:
        """Attach the drafter's proposals to requests for the next step (vLLM
        `update_draft_token_ids`); drafts for a request in prefill or not running are dropped, and
        ids finished since the last `schedule()` are ignored.

        Raises:
            ValueError: an unknown id, more than `num_spec_tokens` drafts, or a negative token id.
        """
        for request_id, spec_token_ids in draft_token_ids.items():
            if request_id in self.finished_req_ids:
                continue
            request = self._get_request(request_id)
            if len(spec_token_ids) > self.num_spec_tokens:
                raise ValueError(
                    f"request {request_id!r} got {len(spec_token_ids)} draft tokens; "
                    f"at most num_spec_tokens={self.num_spec_tokens}"
                )
            _check_token_ids(request_id, spec_token_ids)
            runs_decode = request.status is RequestStatus.RUNNING and not request.is_prefill_chunk
            request.spec_token_ids = list(spec_token_ids) if runs_decode else []

    def stalled_request(self, output: SchedulerOutput, steps_in_flight: int) -> Request | None:
        """The head of ``waiting`` if ``output`` (the last `schedule()`) shows that it can never be
        admitted, else None: nothing was scheduled, runs, was preempted or is in flight, so it did
        not fit a pool whose every block is free or evictable (docs/serving.md says when that
        happens). The caller decides what to do with it (the engine finishes it with "error", the
        lab raises).
        """
        if output.total_num_scheduled_tokens or self.running or not self.waiting:
            return None
        if output.preempted_req_ids or steps_in_flight:
            return None
        return self.waiting.peek_request()

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running (vLLM `has_unfinished_requests`)."""
        return bool(self.running) or bool(self.waiting)

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    # ---------------------------------------------------------------- one step

    def schedule(self) -> SchedulerOutput:
        """Plan one step (vLLM `Scheduler.schedule`): running requests first, in list order,
        preempting on a failed allocation; then, if nobody was preempted, waiting requests while
        budget, `max_num_seqs` and the pool allow; then every scheduled request's
        `num_computed_tokens` advances by its tokens (docs/serving.md gives the rules).
        """
        plan = _StepPlan(token_budget=self.max_num_batched_tokens)
        self._schedule_running(plan)
        if not plan.preempted and not plan.held_back:
            self._schedule_waiting(plan)
        output = self._make_output(plan)
        self._update_after_schedule(output)
        return output

    def _schedule_running(self, plan: _StepPlan) -> None:
        """vLLM's first loop of `schedule()`: running requests in list order, preempting on a
        failed `allocate_slots` (with `num_lookahead_tokens` reserved for the next drafts)."""
        index = 0
        manager, lookahead = self.kv_cache_manager, self.num_lookahead_tokens
        none = getattr(manager, "empty_kv_cache_blocks", None)  # no new block in any group
        while index < len(self.running) and plan.token_budget > 0:
            request = self.running[index]
            num_new_tokens = self._num_new_tokens_running(request, plan.token_budget)
            if num_new_tokens == 0:
                # vLLM continues rather than breaks here, so later requests may still run.
                index += 1
                continue
            new_blocks = manager.allocate_slots(
                request, num_new_tokens, num_lookahead_tokens=lookahead
            )
            while new_blocks is None:
                if request.num_in_flight_tokens and len(self.running) == 1:
                    # Deviation from vLLM: it would preempt the request itself, the only one
                    # running, but its step in flight holds blocks for it (a window it has
                    # left, vLLM 0.32's in-flight rule) that the step's output releases.
                    # Recomputing would put that step back in flight and fail the same way
                    # forever (a lone long prompt in a tight pool, asynchronous scheduling).
                    # It waits one step instead, and so does admission.
                    plan.held_back = True
                    return
                victim, index = self._preempt_for(plan, index)
                if victim is request:
                    break
                new_blocks = manager.allocate_slots(
                    request, num_new_tokens, num_lookahead_tokens=lookahead
                )
            if new_blocks is None:
                return
            ids = None if new_blocks is none else new_blocks.get_block_ids(allow_none=True)
            self._record_running(plan, request, num_new_tokens, ids)
            index += 1

    def _num_new_tokens_running(self, request: Request, token_budget: int) -> int:
        """Tokens to close the gap to `num_tokens_with_spec` (+ output placeholders), capped
        as vLLM caps them; 0 for a request its in-flight steps will certainly finish."""
        placeholders = request.num_output_placeholders
        if placeholders and self._finished_in_flight(request, placeholders):
            return 0
        num_new_tokens = (
            request.num_tokens_with_spec
            + placeholders
            + request.num_draft_placeholders
            - request.num_computed_tokens
        )
        if 0 < self.long_prefill_token_threshold < num_new_tokens:
            num_new_tokens = self.long_prefill_token_threshold
        num_new_tokens = min(num_new_tokens, token_budget)
        # Keep the input positions (and so the drafts' positions) inside the model length.
        room = self.max_model_len - 1 - request.num_computed_tokens
        return max(0, min(num_new_tokens, room))

    def _finished_in_flight(self, request: Request, placeholders: int) -> bool:
        """vLLM AsyncScheduler: the in-flight steps will reach max_tokens or max_model_len
        (whatever they sample, and even if every draft they verify is rejected: each step
        counts one token), so scheduling the request again would be wasted."""
        max_tokens = request.max_tokens
        if request.num_tokens + placeholders >= self.max_model_len:
            return True
        return max_tokens is not None and request.num_output_tokens + placeholders >= max_tokens

    def _preempt_for(self, plan: _StepPlan, index: int) -> tuple[Request, int]:
        """Preempt one running request to make room; return it and the adjusted index.

        FCFS takes the last running request (vLLM `self.running.pop()`). PRIORITY takes the
        running request with the largest `(priority, arrival_time)`; if it was already
        scheduled in this step its tokens and draft tokens go back to the budget, and the
        index steps back when the victim sat before the request being scheduled.
        """
        if self.policy is SchedulingPolicy.PRIORITY:
            victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
            victim_index = next(i for i, r in enumerate(self.running) if r is victim)
            del self.running[victim_index]
            if victim_index < index:
                index -= 1
            victim_id = victim.request_id
            if victim_id in plan.num_scheduled_tokens:
                plan.running_reqs = [r for r in plan.running_reqs if r is not victim]
                plan.token_budget += plan.num_scheduled_tokens.pop(victim_id)
                plan.new_block_ids.pop(victim_id)
                plan.spec_decode_tokens.pop(victim_id, None)
        else:
            victim = self.running.pop()
        self._preempt(victim)
        plan.preempted.append(victim)
        return victim, index

    def _preempt(self, request: Request) -> None:
        """Free a running request and put it at the head of `waiting` (vLLM
        `_preempt_request`): recompute, not swap, so its computed tokens drop to 0."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        request.is_prefill_chunk = False
        self.waiting.prepend_request(request)

    def _record_running(
        self,
        plan: _StepPlan,
        request: Request,
        num_new_tokens: int,
        new_block_ids: tuple[list[int], ...] | None,
    ) -> None:
        request_id = request.request_id
        plan.running_reqs.append(request)
        plan.new_block_ids[request_id] = new_block_ids
        plan.num_scheduled_tokens[request_id] = num_new_tokens
        plan.token_budget -= num_new_tokens
        if request.spec_token_ids:
            # Tokens past the request's last one (in flight included) are drafts; the budget
            # cap may have cut some off.
            num_spec = num_new_tokens + request.num_computed_tokens - self._frontier(request)
            if num_spec > 0:
                plan.spec_decode_tokens[request_id] = list(request.spec_token_ids[:num_spec])
            # vLLM clears drafts once scheduled; the drafter proposes fresh ones next step.
            request.spec_token_ids = []

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        """vLLM's second loop of `schedule()`: admit from the head of `waiting` with its
        prefix hit (`get_computed_blocks`) until the budget, `max_num_seqs` or the pool runs
        out; the first request that does not fit stops admission (no head-of-line skipping)."""
        while plan.token_budget > 0 and self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek_request()
            if request.num_output_placeholders:
                # Preempted with a step in flight: its token arrives with that step's output.
                return
            if request.num_computed_tokens == 0:
                hit_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            else:
                hit_blocks, num_hit_tokens = None, 0
            # Bounded replay (vLLM 0.32 `_mark_prefix_replay`): the hit's last window is
            # recomputed, so the computed count rewinds by it; its slots come with the hit.
            num_replay_tokens = self.kv_cache_manager.num_replay_tokens(num_hit_tokens)
            num_computed_tokens = request.num_computed_tokens + num_hit_tokens - num_replay_tokens
            # num_tokens, not num_prompt_tokens: a resumed request recomputes its outputs too.
            num_new_tokens = request.num_tokens - num_computed_tokens
            if 0 < self.long_prefill_token_threshold < num_new_tokens:
                num_new_tokens = self.long_prefill_token_threshold
            if not self.enable_chunked_prefill and num_new_tokens > plan.token_budget:
                return
            num_new_tokens = min(num_new_tokens, plan.token_budget)
            # vLLM 0.32 reserves lookahead slots on the first allocation too (it drops them only
            # for asynchronous KV loads, which we do not have); earlier vLLM used 0 here.
            lookahead = self.num_lookahead_tokens
            new_blocks = self.kv_cache_manager.allocate_slots(
                request,
                max(num_new_tokens - num_replay_tokens, 0),
                num_new_computed_tokens=num_hit_tokens,
                new_computed_blocks=hit_blocks,
                num_lookahead_tokens=lookahead,
                full_sequence_must_fit=self.reserve_full_isl,
                has_scheduled_reqs=bool(self.running),  # vLLM 0.32's argument
            )
            if new_blocks is None:
                return
            self.waiting.pop_request()
            self.running.append(request)
            request_id = request.request_id
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed_tokens
            plan.new_reqs.append(request)
            plan.num_replay_tokens[request_id] = num_replay_tokens
            plan.new_block_ids[request_id] = self.kv_cache_manager.get_block_ids(request_id)
            plan.num_scheduled_tokens[request_id] = num_new_tokens
            plan.token_budget -= num_new_tokens

    def _make_output(self, plan: _StepPlan) -> SchedulerOutput:
        new_reqs = [
            NewRequestData(
                request_id=r.request_id,
                token_ids=tuple(r.all_token_ids),
                block_ids=plan.new_block_ids[r.request_id],
                num_computed_tokens=r.num_computed_tokens,
                num_replay_tokens=plan.num_replay_tokens[r.request_id],
            )
            for r in plan.new_reqs
        ]
        cached_reqs = [
            CachedRequestData(
                request_id=r.request_id,
                new_block_ids=plan.new_block_ids[r.request_id],
                num_computed_tokens=r.num_computed_tokens,
            )
            for r in plan.running_reqs
        ]
        num_common_prefix_blocks = (
            self.kv_cache_manager.get_num_common_prefix_blocks(self.running[0].request_id)
            if self.running
            else [0] * self.kv_cache_manager.num_kv_cache_groups
        )
        total = sum(plan.num_scheduled_tokens.values())
        if total > self.max_num_batched_tokens or len(self.running) > self.max_num_seqs:
            raise RuntimeError(
                f"scheduler bug: {total} tokens for {len(self.running)} running requests "
                f"exceeds max_num_batched_tokens={self.max_num_batched_tokens} or "
                f"max_num_seqs={self.max_num_seqs}"
            )
        requests = self.requests
        sampling = frozenset(  # reaching the frontier (`_frontier`, inline: every request)
            request_id
            for request_id, n in plan.num_scheduled_tokens.items()
            if (r := requests[request_id]).num_computed_tokens + n
            >= r.num_tokens + r.num_output_placeholders + r.num_draft_placeholders
        )
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=plan.num_scheduled_tokens,
            total_num_scheduled_tokens=total,
            scheduled_spec_decode_tokens=plan.spec_decode_tokens,
            num_common_prefix_blocks=list(num_common_prefix_blocks),
            preempted_req_ids={r.request_id for r in plan.preempted},
            finished_req_ids=self.finished_req_ids,
            sampling_req_ids=sampling,
        )
        # A fresh set: the output keeps the old one (vLLM `_update_after_schedule`).
        self.finished_req_ids = set()
        return output

    def _frontier(self, request: Request) -> int:
        """Tokens the request has, counting those its in-flight steps will sample as if every
        draft they verify were accepted (the optimistic frontier; its known tokens when
        synchronous)."""
        return request.num_tokens + request.num_output_placeholders + request.num_draft_placeholders

    def _update_after_schedule(self, output: SchedulerOutput) -> None:
        """vLLM `_update_after_schedule`: advance `num_computed_tokens` and the in-flight count by
        the scheduled tokens and note who is mid-prefill; asynchronously, a sampling request gets
        its output placeholders (its token and the drafts it verifies, all counted as accepted) and,
        with drafts made on the device, k placeholder drafts (-1) for the next step.
        """
        for request_id, num_tokens in output.num_scheduled_tokens.items():
            request = self.requests[request_id]
            request.num_computed_tokens += num_tokens
            # The manager keeps blocks an in-flight step may still write (vLLM 0.32).
            request.num_in_flight_tokens += num_tokens
            request.is_prefill_chunk = request_id not in output.sampling_req_ids
            if self.async_scheduling and not request.is_prefill_chunk:
                request.num_output_placeholders += 1
                drafts = output.scheduled_spec_decode_tokens.get(request_id, ())
                request.num_draft_placeholders += len(drafts)
                if self.drafts_on_device:
                    request.spec_token_ids = [-1] * self.num_spec_tokens

    # ---------------------------------------------------------------- outputs

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        sampled_token_ids: Mapping[str, list[int]],
    ) -> UpdateResult:
        """Apply one step's sampled tokens (vLLM `Scheduler.update_from_output`): take rejected
        drafts back, append tokens up to a stop, free finished requests (docs/serving.md).

        Args:
            scheduler_output: the plan this output belongs to.
            sampled_token_ids: request id -> 1 + accepted drafts tokens (none mid-prefill).

        Raises:
            ValueError: tokens for an id not scheduled or mid-prefill, too many, or negative.
        """
        work = self._checked_outputs(scheduler_output, sampled_token_ids)
        self._release_in_flight(scheduler_output)
        applied = self._apply_tokens(work)
        self._remove_finished(applied["finished"])
        return UpdateResult(
            **applied,
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
        )

    def _checked_outputs(
        self, output: SchedulerOutput, sampled_token_ids: Mapping[str, list[int]]
    ) -> list[tuple[Request, list[int], list[int]]]:
        """(request, sampled, drafts) of every scheduled request still known, all validated
        before any request is touched, so bad input changes nothing."""
        scheduled = output.num_scheduled_tokens
        stray = [i for i in sampled_token_ids if i not in scheduled]
        if stray:
            raise ValueError(
                f"sampled tokens for request ids not scheduled in this step: {stray!r}"
            )
        work = []
        requests, spec = self.requests, output.scheduled_spec_decode_tokens
        for request_id in scheduled:
            request = requests.get(request_id)
            if request is None:
                continue  # finished (stopped or aborted) since it was scheduled
            sampled = list(sampled_token_ids.get(request_id, ()))
            drafts = spec.get(request_id, []) if spec else []
            if (
                len(sampled) != 1
                or drafts
                or type(sampled[0]) is not int
                or sampled[0] < 0
                or request_id not in output.sampling_req_ids
            ):  # anything but one valid token of a sampling request: every check
                self._check_sampled(output, request, sampled, drafts)
            work.append((request, sampled, drafts))
        return work

    def _release_in_flight(self, output: SchedulerOutput) -> None:
        """The step has landed: its tokens are no longer in flight, and (asynchronously) its
        output and draft placeholders are consumed."""
        for request_id, num_tokens in output.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is not None:
                request.num_in_flight_tokens -= num_tokens
                if self.async_scheduling and request_id in output.sampling_req_ids:
                    request.num_output_placeholders -= 1
                    drafts = output.scheduled_spec_decode_tokens.get(request_id, ())
                    request.num_draft_placeholders -= len(drafts)

    def _apply_tokens(self, work: list[tuple[Request, list[int], list[int]]]) -> dict[str, Any]:
        """Take each request's rejected drafts back and append its tokens up to a stop; returns
        `UpdateResult`'s token fields (new tokens, finished, stop reasons, draft statistics)."""
        new_token_ids: dict[str, list[int]] = {}
        finished: dict[str, RequestStatus] = {}
        stop_reasons: dict[str, int] = {}
        spec_stats: SpecDecodingStats | None = None
        for request, sampled, drafts in work:
            request_id = request.request_id
            running = request.status is RequestStatus.RUNNING
            if not running and not self.async_scheduling:
                continue  # cannot happen synchronously; vLLM drops such outputs
            if drafts and sampled and running:
                num_accepted = len(sampled) - 1
                request.num_computed_tokens -= len(drafts) - num_accepted
                if spec_stats is None:
                    spec_stats = SpecDecodingStats.new(self.num_spec_tokens)
                spec_stats.observe_draft(len(drafts), num_accepted)
            if not sampled:
                continue
            appended, stop_status, reason = self._append_and_check_stop(request, sampled)
            new_token_ids[request_id] = appended
            if stop_status is not None:
                finished[request_id] = stop_status
                if reason is not None:
                    stop_reasons[request_id] = reason
        return {
            "new_token_ids": new_token_ids,
            "finished": finished,
            "stop_reasons": stop_reasons,
            "spec_decoding_stats": spec_stats,
        }

    def _remove_finished(self, finished: Mapping[str, RequestStatus]) -> None:
        """Take the requests that stopped out of `running` (or `waiting`: preempted while their
        step was in flight) and free them."""
        if not finished:
            return
        self.running = [r for r in self.running if r.request_id not in finished]
        self.waiting.remove_requests(
            self.requests[i]
            for i in finished
            if self.requests[i].status is not RequestStatus.RUNNING  # preempted, step in flight
        )
        for request_id, stop_status in finished.items():
            self._free_request(self.requests[request_id], stop_status)

    def _check_sampled(
        self, output: SchedulerOutput, request: Request, sampled: list[int], drafts: list[int]
    ) -> None:
        request_id = request.request_id
        if sampled and request_id not in output.sampling_req_ids:
            raise ValueError(
                f"request {request_id!r} was mid-prefill in this step but got sampled tokens "
                f"{sampled!r}"
            )
        if len(sampled) > 1 + len(drafts):
            raise ValueError(
                f"request {request_id!r} got {len(sampled)} sampled tokens; at most "
                f"1 + {len(drafts)} drafts"
            )
        _check_token_ids(request_id, sampled)

    def _append_and_check_stop(
        self, request: Request, sampled: list[int]
    ) -> tuple[list[int], RequestStatus | None, int | None]:
        for count, token_id in enumerate(sampled, 1):
            request.append_output_token_ids(token_id)
            stop_status, reason = self._check_stop(request)
            if stop_status is not None:
                return sampled[:count], stop_status, reason
        return sampled, None, None

    def _check_stop(self, request: Request) -> tuple[RequestStatus | None, int | None]:
        """vLLM `check_stop` order: nothing stops a request below ``min_tokens`` outputs
        (except ``max_model_len``: it could not run further); then EOS, a stop token id
        (returned as the stop reason), and the length caps."""
        stop = request.stop
        if request.num_output_tokens < stop.min_tokens:
            if request.num_tokens >= self.max_model_len:
                return RequestStatus.FINISHED_LENGTH_CAPPED, None
            return None, None
        last = request.all_token_ids[-1]
        if stop.eos_token_id is not None and last == stop.eos_token_id:
            return RequestStatus.FINISHED_STOPPED, None
        if last in stop.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, last
        max_tokens = request.max_tokens
        if request.num_tokens >= self.max_model_len or (
            max_tokens is not None and request.num_output_tokens >= max_tokens
        ):
            return RequestStatus.FINISHED_LENGTH_CAPPED, None
        return None, None

    def _free_request(self, request: Request, status: RequestStatus) -> None:
        """Free a finished request's blocks and forget it (vLLM `_free_request`); the caller
        has already taken it out of `running` / `waiting`."""
        request_id = request.request_id
        self.kv_cache_manager.free(request)
        del self.requests[request_id]
        request.status = status
        request.is_prefill_chunk = False
        request.spec_token_ids = []
        self.finished_req_ids.add(request_id)

    def _get_request(self, request_id: str) -> Request:
        try:
            return self.requests[request_id]
        except KeyError:
            raise ValueError(f"unknown request id {request_id!r}") from None


def _check_token_ids(request_id: str, token_ids: Iterable[int]) -> None:
    bad = [t for t in token_ids if not isinstance(t, int) or t < 0]
    if bad:
        raise ValueError(f"request {request_id!r}: token ids must be ints >= 0, got {bad!r}")
