"""Host-side scheduler: decides, each step, which requests run and how many tokens each gets.

Mirrors vLLM v1's `Scheduler` (`vllm/v1/core/sched/scheduler.py`) and, with
``async_scheduling=True``, its `AsyncScheduler` (`async_scheduler.py`), over our
`cache.KVCacheManager`: one class, one state machine, so the synchronous and the asynchronous
engines plan by the same rules. The algorithm is token-centric, as in vLLM: every request
has `num_computed_tokens` and wants to reach `num_tokens_with_spec` (prompt + outputs +
draft tokens); a step hands out at most `max_num_batched_tokens` tokens, first to the
running requests in list order, then (only when nobody was preempted) to waiting requests
in queue order while fewer than `max_num_seqs` run. Chunked prefill, prefix-cache hits,
preemption by recompute and speculative-decoding reservation all fall out of that rule.

Asynchronous scheduling: the engine plans step N+1 before step N's tokens reach the host. A
request whose step will sample gets an *output placeholder* at schedule time (vLLM
``num_output_placeholders``), so the next plan already gives it its next decode token (whose id
stays on the device); the placeholder is consumed when the token arrives. With speculative
decoding the drafts a step verifies are placeholders too, counted as accepted (the optimistic
frontier of vLLM's AsyncScheduler): the next step is planned 1 + k tokens past them, its slots
reserved there, and when the output arrives the rejected ones are taken back from
`num_computed_tokens` (the device has already moved that next step back by them; the blocks
stay with the request). A request that is certain to be finished by its in-flight steps
(``max_tokens``, ``max_model_len``; each step counted as one token, whatever it accepts) is not
scheduled again. A lone running request whose next chunk does not fit while its own step is in
flight waits for that step instead of preempting itself (a deviation: vLLM would recompute it
and fail the same way again). Deviation from vLLM, on purpose: a request preempted while one of its steps is
in flight keeps the token that step samples (vLLM discards it, `discard_latest_async_tokens`,
and samples it again after the recompute); the token was computed from intact state, and keeping
it makes the asynchronous engine's tokens those of the synchronous one. A preempted request is
re-admitted only once it has no token in flight.

Stop rules per request (`StopCriteria`, vLLM `check_stop`): below ``min_tokens`` outputs
nothing stops a request but ``max_model_len``; then EOS (unless ignored), a stop token id
(its id becomes the stop reason), ``max_tokens`` / ``max_model_len``. Stop *strings* need the
text: the engine checks them and calls `finish_requests(..., FINISHED_STOPPED)`.

Left out, compared with vLLM: KV connectors, encoder inputs, LoRA, structured output, pooling,
streaming sessions, pause states.

Invariants kept here:
* a request id is in exactly one of `running`, `waiting`, or neither (finished and freed);
* every running request holds KV blocks and every waiting one holds none
  (preemption frees everything: recompute, not swap);
* `num_computed_tokens` is advanced at schedule time (so the next step can plan the next
  chunk before outputs arrive) and pulled back by the rejected draft tokens when outputs
  arrive;
* a request's output placeholders count its sampling steps in flight (always 0 when
  synchronous); a waiting request is admitted only with none.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

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


@dataclass(frozen=True, slots=True, kw_only=True)
class CachedRequestData:
    """A request that was running in the previous step and runs again in this one."""

    request_id: str
    new_block_ids: tuple[list[int], ...]  # blocks appended this step, one list per KV group
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
    """Counts of the scheduler's decisions, read off its `SchedulerOutput`s (`observe`).

    The engine and `lab` both keep one, so a model-free lab run and an engine run of
    the same workload report the same figures by construction of the same plans, not by two
    bookkeepings that could drift apart.

    Fields:
        steps: `observe` calls (steps that were planned).
        scheduled_tokens: tokens handed out, summed over steps.
        max_scheduled_requests: most requests scheduled in one step.
        admissions: requests that entered the batch from the waiting queue (resumed included).
        preemptions: requests preempted.
        replay_tokens: bounded-replay tokens: prefix-hit tokens whose window KV is rebuilt.
        preemption_recomputed_tokens: scheduled tokens below the request's high-water mark
            (positions it had computed before a preemption), replay tokens excluded.
        prefix_queries / prefix_hits: prompt tokens of first admissions (resumed requests
            excluded) and, of them, the prefix-cache hit tokens they were admitted with
            (replay tokens included: their full-attention KV was found). This is the share of
            prompt tokens served from the cache; vLLM's `PrefixCacheStats` instead counts
            every lookup, including those of a request that waits and looks up again.
    """

    steps: int = 0
    scheduled_tokens: int = 0
    max_scheduled_requests: int = 0
    admissions: int = 0
    preemptions: int = 0
    replay_tokens: int = 0
    preemption_recomputed_tokens: int = 0
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
        starts = {}
        for new in output.scheduled_new_reqs:
            self.admissions += 1
            self.replay_tokens += new.num_replay_tokens
            if new.request_id not in high:  # first admission
                self.prefix_queries += len(new.token_ids)
                self.prefix_hits += new.num_computed_tokens + new.num_replay_tokens
            starts[new.request_id] = (new.num_computed_tokens, new.num_replay_tokens)
        for cached in output.scheduled_cached_reqs:
            starts[cached.request_id] = (cached.num_computed_tokens, 0)
        for request_id, num_tokens in scheduled.items():
            start, replay = starts[request_id]
            end = start + num_tokens
            mark = high.get(request_id, 0)
            self.preemption_recomputed_tokens += max(0, min(mark, end) - (start + replay))
            if end > mark:
                high[request_id] = end

    def as_dict(self) -> dict[str, int]:
        return {
            "steps": self.steps,
            "scheduled_tokens": self.scheduled_tokens,
            "max_scheduled_requests": self.max_scheduled_requests,
            "admissions": self.admissions,
            "preemptions": self.preemptions,
            "replay_tokens": self.replay_tokens,
            "preemption_recomputed_tokens": self.preemption_recomputed_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "prefix_queries": self.prefix_queries,
            "prefix_hits": self.prefix_hits,
        }


@dataclass(slots=True)
class _StepPlan:
    """Mutable bookkeeping of one `schedule()` call."""

    token_budget: int
    new_reqs: list[Request] = field(default_factory=list)
    running_reqs: list[Request] = field(default_factory=list)
    new_block_ids: dict[str, tuple[list[int], ...]] = field(default_factory=dict)
    num_replay_tokens: dict[str, int] = field(default_factory=dict)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    held_back: bool = False  # a running request waits for its step in flight (no admission)


def _check_count(name: str, value: int, minimum: int = 0) -> None:
    if not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


class Scheduler:
    """Plans steps over a `KVCacheManager` (vLLM v1 `Scheduler`, synchronous, host only).

    Args:
        kv_cache_manager: the allocator; the scheduler is its only caller.
        max_num_seqs: most requests running at once (vLLM `max_num_seqs`).
        max_num_batched_tokens: token budget of one step.
        max_model_len: most tokens a request may hold (prompt + outputs).
        policy: FCFS or PRIORITY admission and preemption order.
        num_spec_tokens: draft tokens proposed per request per step (0: no spec decoding).
        num_lookahead_tokens: extra KV slots reserved after the scheduled tokens for the
            next round of drafts (EAGLE/MTP proposers write KV for them; n-gram uses 0).
        long_prefill_token_threshold: if > 0, most tokens one request gets in a step.
        enable_chunked_prefill: if False, a waiting request whose remaining prompt does not
            fit in the budget stops admission for this step instead of being chunked.
        eos_token_id: token that stops a request (FINISHED_STOPPED) unless `add_request`
            gives it its own `StopCriteria`; None: never.
        reserve_full_isl: admit a waiting request only if its whole remaining sequence fits
            (vLLM 0.32's `scheduler_reserve_full_isl`, default on); False checks one chunk.
        async_scheduling: plan the next step before this one's tokens are known (output
            placeholders, see the module docstring).
        drafts_on_device: (asynchronous speculative decoding) the drafter runs on the device
            in every step: a sampling request's next drafts are planned as k placeholders
            (-1) at once (vLLM's AsyncScheduler with EAGLE / MTP); else the engine attaches
            drafts with `update_draft_token_ids`.

    Raises:
        ValueError: a count is negative or zero where at least one is needed.
    """

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        policy: SchedulingPolicy = SchedulingPolicy.FCFS,
        num_spec_tokens: int = 0,
        num_lookahead_tokens: int = 0,
        long_prefill_token_threshold: int = 0,
        enable_chunked_prefill: bool = True,
        eos_token_id: int | None = None,
        reserve_full_isl: bool = True,
        async_scheduling: bool = False,
        drafts_on_device: bool = False,
    ) -> None:
        _check_count("max_num_seqs", max_num_seqs, 1)
        _check_count("max_num_batched_tokens", max_num_batched_tokens, 1)
        _check_count("max_model_len", max_model_len, 1)
        _check_count("num_spec_tokens", num_spec_tokens)
        _check_count("num_lookahead_tokens", num_lookahead_tokens)
        _check_count("long_prefill_token_threshold", long_prefill_token_threshold)
        if not isinstance(policy, SchedulingPolicy):
            raise ValueError(f"policy must be a SchedulingPolicy, got {policy!r}")
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        self.num_spec_tokens = num_spec_tokens
        self.num_lookahead_tokens = num_lookahead_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.enable_chunked_prefill = enable_chunked_prefill
        self.eos_token_id = eos_token_id
        # vLLM 0.32's `scheduler_reserve_full_isl`: admit a request only if its whole prompt
        # fits (window kinds at their admission cap), not just the first chunk.
        self.reserve_full_isl = reserve_full_isl
        self.async_scheduling = async_scheduling
        self.drafts_on_device = drafts_on_device

        # Every unfinished request, by id; each carries its status, stop rules and in-flight
        # counts (`serving.request.Request`).
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(policy)
        self.running: list[Request] = []  # admission order; FCFS preempts from the back
        # Finished since the last schedule(): reported once in the next SchedulerOutput.
        self.finished_req_ids: set[str] = set()

    # ---------------------------------------------------------------- requests in and out

    def add_request(self, request: Request, stop: StopCriteria | None = None) -> None:
        """Queue a new request as WAITING (vLLM `add_request`).

        Args:
            request: the request (`serving.request.Request`; a bare `cache.Request`, as the
                lab and the allocator benchmarks make them, is given the scheduler's fields
                here, `init_scheduling`).
            stop: its stop rules; None: the request's own (``request.stop``), else the
                scheduler's ``eos_token_id`` only.

        Raises:
            ValueError: the id is already known, the prompt is empty or not shorter than
                `max_model_len`, max_tokens is below 1, the request already has computed
                tokens, or a stop rule is invalid.
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
        """Finish requests from outside (e.g. client abort) and free their blocks
        (vLLM `finish_requests`).

        Ids that finished since the last `schedule()` are ignored, as vLLM ignores
        already-finished requests (an abort can race with a stop).

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
        """Attach the drafter's proposals to requests for the next step
        (vLLM `update_draft_token_ids`).

        Drafts for a request still in prefill are dropped, as in vLLM, and so are drafts for
        a request that is not running (preempted); ids that finished since the last
        `schedule()` are ignored.

        Raises:
            ValueError: an id is unknown, a draft is longer than `num_spec_tokens`, or a
                token id is negative.
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
        """The request at the head of ``waiting`` if ``output`` (the last `schedule()`) shows
        that it can never be admitted, else None.

        That is the case when the step scheduled nothing, nothing runs, nothing was preempted
        (so admission was tried) and no step is in flight (so no block is held for one): the
        head did not fit a pool in which every block is free or evictable, and no later step
        can do better; it would wait forever, and everyone behind it too. vLLM refuses at
        start-up a pool that cannot hold one ``max_model_len`` request, so its scheduler never
        meets this; a tighter pool (tests, the lab, a small ``num_gpu_blocks_override``) can,
        with a long prompt, or with a request that outgrew the pool: alone, it preempts itself,
        and each readmission recomputes it and samples one token more, until its recompute no
        longer fits. Decisions are unchanged: the caller decides (the engine finishes it with
        "error", the lab raises).
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
        """Plan one step (vLLM `Scheduler.schedule`, synchronous).

        1. Running requests in list order get `num_tokens_with_spec - num_computed_tokens`
           tokens, capped by `long_prefill_token_threshold`, the remaining budget and
           `max_model_len - 1 - num_computed_tokens`; when `allocate_slots` fails, a victim
           is preempted (see `_preempt_for`) until it fits or the request itself is the
           victim; in that case scheduling of running requests stops.
        2. Waiting requests are admitted only if nobody was preempted in step 1, while budget
           is left and fewer than `max_num_seqs` run; a failed allocation stops admission
           (waiting requests never preempt).
        3. `num_computed_tokens` of every scheduled request advances by its tokens now.
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
        while index < len(self.running) and plan.token_budget > 0:
            request = self.running[index]
            num_new_tokens = self._num_new_tokens_running(request, plan.token_budget)
            if num_new_tokens == 0:
                # vLLM continues rather than breaks here, so later requests may still run.
                index += 1
                continue
            new_blocks = None
            while new_blocks is None:
                new_blocks = self.kv_cache_manager.allocate_slots(
                    request, num_new_tokens, num_lookahead_tokens=self.num_lookahead_tokens
                )
                if new_blocks is not None:
                    break
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
            if new_blocks is None:
                return
            self._record_running(plan, request, num_new_tokens, new_blocks.get_block_ids())
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
        new_block_ids: tuple[list[int], ...],
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
        sampling = frozenset(
            request_id
            for request_id, n in plan.num_scheduled_tokens.items()
            if self.requests[request_id].num_computed_tokens + n
            >= self._frontier(self.requests[request_id])
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
        """vLLM `_update_after_schedule`: advance `num_computed_tokens` (and the in-flight
        count) by the scheduled tokens, and note who is still mid-prefill. Asynchronously, a
        sampling request gets its output placeholders (one token, plus the drafts it verifies,
        optimistically all accepted) and, with speculative decoding, k placeholder drafts
        (-1): the device drafts them in this step and feeds them to the next one (vLLM's
        AsyncScheduler with EAGLE / MTP)."""
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
        """Apply one step's sampled tokens (vLLM `Scheduler.update_from_output`).

        For a request that verified drafts, `len(sampled) - 1` drafts were accepted; the
        rejected ones are taken back from `num_computed_tokens` (their KV slots stay
        allocated and are overwritten next step). Each sampled token is appended and the
        stop rules checked after each one (`StopCriteria`, vLLM `check_stop`); tokens after
        the stop are dropped. A finished request's blocks are freed at once. Under async
        scheduling the step's output placeholders are consumed; a request preempted while
        this step was in flight keeps its tokens (see the module docstring); requests that
        finished since the step was planned are skipped.

        Args:
            scheduler_output: the plan this output belongs to.
            sampled_token_ids: request id -> tokens sampled this step: 1 + accepted drafts
                for a request in ``scheduler_output.sampling_req_ids``, none (or absent) for a
                request in the middle of a prefill.

        Raises:
            ValueError: an id was not scheduled in `scheduler_output`, a request in the
                middle of a prefill got tokens, more than 1 + drafts tokens came back, or a
                token id is negative.
        """
        scheduled = scheduler_output.num_scheduled_tokens
        stray = [i for i in sampled_token_ids if i not in scheduled]
        if stray:
            raise ValueError(
                f"sampled tokens for request ids not scheduled in this step: {stray!r}"
            )
        # Validate everything before touching any request, so bad input changes nothing.
        work = []
        for request_id in scheduled:
            request = self.requests.get(request_id)
            if request is None:
                continue  # finished (stopped or aborted) since it was scheduled
            sampled = list(sampled_token_ids.get(request_id, ()))
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(request_id, [])
            self._check_sampled(scheduler_output, request, sampled, drafts)
            work.append((request, sampled, drafts))
        for request_id, num_tokens in scheduled.items():
            request = self.requests.get(request_id)
            if request is not None:
                request.num_in_flight_tokens -= num_tokens
                if self.async_scheduling and request_id in scheduler_output.sampling_req_ids:
                    request.num_output_placeholders -= 1
                    drafts = scheduler_output.scheduled_spec_decode_tokens.get(request_id, ())
                    request.num_draft_placeholders -= len(drafts)
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
        if finished:
            self.running = [r for r in self.running if r.request_id not in finished]
            self.waiting.remove_requests(
                self.requests[i]
                for i in finished
                if self.requests[i].status is not RequestStatus.RUNNING  # preempted, step in flight
            )
            for request_id, stop_status in finished.items():
                self._free_request(self.requests[request_id], stop_status)
        return UpdateResult(
            new_token_ids=new_token_ids,
            finished=finished,
            stop_reasons=stop_reasons,
            spec_decoding_stats=spec_stats,
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
        )

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
