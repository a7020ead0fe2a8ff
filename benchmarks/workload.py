"""Deterministic multi-turn chat workload, replayed through `serving.scheduler.Scheduler`.

`run_loop` is the lab's model-free loop with the benchmark's instruments around it (`TimedManager`
times the manager's calls and records the decision log); every scheduling rule is the
Scheduler's. Details: docs/benchmarks.md#benchmarksworkload.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from time import perf_counter_ns
from typing import Any

from lab.drive import ModelFreeBackend, drive
from lab.workloads import Session, Turn, Workload, make_chat_workload
from serving.config import SchedulerConfig
from serving.scheduler import Scheduler

__all__ = [
    "ChatWorkload",
    "Conversation",
    "LoopConfig",
    "LoopResult",
    "TimedManager",
    "Turn",
    "first_difference",
    "make_chat_workload",
    "run_loop",
]


ChatWorkload = Workload
Conversation = Session


# --------------------------------------------------------------------------------------------
# Loop
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LoopConfig:
    """The Scheduler's arguments for one replay (vLLM's names where they differ).

    Attributes:
        max_num_batched_tokens, max_num_seqs, max_model_len, num_lookahead_tokens: the
            Scheduler's arguments of the same names.
        full_sequence_must_fit: the Scheduler's ``reserve_full_isl`` (vLLM 0.32's
            ``scheduler_reserve_full_isl``, default on).
        max_steps: stop after this many steps (None: run until every turn has finished).
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 16384
    num_lookahead_tokens: int = 0
    full_sequence_must_fit: bool = True
    max_steps: int | None = None


@dataclass(slots=True)
class LoopResult:
    """Counts and times of one replay; ``log`` is the decision log when it was recorded."""

    adapter: str  # the manager's name
    steps: int = 0
    wall_ns: int = 0
    n_alloc: int = 0
    t_alloc_ns: int = 0
    n_alloc_fail: int = 0
    n_get: int = 0
    t_get_ns: int = 0
    n_free: int = 0
    t_free_ns: int = 0
    n_hashed_tokens: int = 0
    t_hash_ns: int = 0
    n_preemptions: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    finished_turns: int = 0
    log: list[tuple] | None = field(default=None)
    # (request_id, hit tokens as returned by get_computed_blocks), when logging.
    raw_hits: list[tuple[str, int]] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        def per(t: int, n: int) -> float:
            return round(t / n / 1e3, 4) if n else 0.0

        return {
            "us_per_allocate_slots": per(self.t_alloc_ns, self.n_alloc),
            "us_per_get_computed_blocks": per(self.t_get_ns, self.n_get),
            "us_per_free": per(self.t_free_ns, self.n_free),
            "us_per_hashed_token": per(self.t_hash_ns, self.n_hashed_tokens),
            "steps_per_s": round(self.steps / (self.wall_ns / 1e9), 2) if self.wall_ns else 0.0,
            "prefix_hit_rate": round(self.hit_tokens / self.query_tokens, 6)
            if self.query_tokens
            else 0.0,
        }

    def counts(self) -> dict[str, int]:
        return {
            "steps": self.steps,
            "allocate_slots_calls": self.n_alloc,
            "allocate_slots_none": self.n_alloc_fail,
            "get_computed_blocks_calls": self.n_get,
            "free_calls": self.n_free,
            "hashed_tokens": self.n_hashed_tokens,
            "preemptions": self.n_preemptions,
            "finished_turns": self.finished_turns,
        }


def _block_ids(blocks: Any) -> tuple[tuple[int, ...], ...]:
    """Block ids per group of a ``KVCacheBlocks`` (ours or vLLM's: both keep ``.blocks``)."""
    return tuple(tuple(b.block_id for b in group) for group in blocks.blocks)


class TimedManager:
    """The KV-cache manager interface the Scheduler calls, forwarded to ``manager``; times
    ``get_computed_blocks``, ``allocate_slots``, ``free`` and request hashing (creation and
    output appends) into ``result``, and appends the decision log to ``log`` when given.

    The log's entries: docs/benchmarks.md#benchmarksworkloadtimedmanager.
    """

    def __init__(self, manager: Any, result: LoopResult, log: list[tuple] | None) -> None:
        self.manager = manager
        self.num_kv_cache_groups = manager.num_kv_cache_groups
        self.hash_block_size = manager.hash_block_size
        self.free_reason = "preempt"
        self._result = result
        self._log = log
        self._get = manager.get_computed_blocks
        self._allocate = manager.allocate_slots
        self._free = manager.free

    @property
    def usage(self) -> float:
        return self.manager.usage

    def new_request(self, request_id: str, prompt_token_ids: list[int], **kwargs: Any) -> Any:
        """The manager's request, hashed (timed: our requests hash lazily, so the hashes are
        read here, where vLLM computes them); its output appends are timed too, with the
        hashing of the blocks they complete."""
        result = self._result
        t0 = perf_counter_ns()
        request = self.manager.new_request(request_id, prompt_token_ids, **kwargs)
        request.block_hashes  # noqa: B018 (our requests hash on first read; vLLM's on creation)
        result.t_hash_ns += perf_counter_ns() - t0
        result.n_hashed_tokens += len(prompt_token_ids)
        # The Scheduler appends sampled tokens itself; time them on the request.
        request.append_output_token_ids = self._timed_append(
            request, request.append_output_token_ids
        )
        return request

    def _timed_append(self, request: Any, append: Callable[[Any], None]) -> Callable[[Any], None]:
        result = self._result

        def timed_append(token_ids: int | Iterable[int]) -> None:
            if not isinstance(token_ids, int):
                token_ids = list(token_ids)
            t0 = perf_counter_ns()
            append(token_ids)
            request.block_hashes  # noqa: B018 (hashes the blocks completed, as vLLM's append)
            result.t_hash_ns += perf_counter_ns() - t0
            result.n_hashed_tokens += 1 if isinstance(token_ids, int) else len(token_ids)

        return timed_append

    def get_computed_blocks(self, request: Any) -> tuple[Any, int]:
        result = self._result
        t0 = perf_counter_ns()
        blocks, num_hits = self._get(request)
        result.t_get_ns += perf_counter_ns() - t0
        result.n_get += 1
        if self._log is not None:
            request_id = request.request_id
            self._log.append(("get", request_id, _block_ids(blocks), num_hits))
            raw = getattr(self.manager, "raw_num_hit_tokens", num_hits)
            result.raw_hits.append((request_id, raw))
        return blocks, num_hits

    def num_replay_tokens(self, num_hit_tokens: int) -> int:
        return self.manager.num_replay_tokens(num_hit_tokens)

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
        num_lookahead_tokens: int = 0,
        **kwargs: Any,
    ) -> Any:
        result = self._result
        t0 = perf_counter_ns()
        blocks = self._allocate(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            **kwargs,
        )
        result.t_alloc_ns += perf_counter_ns() - t0
        result.n_alloc += 1
        if blocks is None:
            result.n_alloc_fail += 1
        if self._log is not None:
            ids = None if blocks is None else _block_ids(blocks)
            self._log.append(
                ("alloc", request.request_id, num_new_tokens, num_new_computed_tokens, ids)
            )
        return blocks

    def free(self, request: Any) -> None:
        result = self._result
        t0 = perf_counter_ns()
        self._free(request)
        result.t_free_ns += perf_counter_ns() - t0
        result.n_free += 1
        if self._log is not None:
            self._log.append(("free", request.request_id, self.free_reason))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.manager.get_block_ids(request_id)

    def get_num_common_prefix_blocks(self, request_id: str) -> list[int]:
        return self.manager.get_num_common_prefix_blocks(request_id)


class _LoopHooks:
    """`ModelFreeBackend` hooks: the free reasons of the decision log, the checks that the
    Scheduler freed only whom it reported, and the loop's counts."""

    def __init__(self, result: LoopResult, timed: TimedManager) -> None:
        self.result = result
        self.timed = timed
        self._num_frees = 0

    def before_schedule(self) -> None:
        self.timed.free_reason = "preempt"
        self._num_frees = self.result.n_free

    def on_schedule(self, output: Any) -> None:
        result = self.result
        result.steps += 1
        _check_frees(result.n_free - self._num_frees, output.preempted_req_ids, "schedule()")
        result.n_preemptions += len(output.preempted_req_ids)
        for new in output.scheduled_new_reqs:
            result.query_tokens += len(new.token_ids)
            result.hit_tokens += new.num_computed_tokens + new.num_replay_tokens

    def before_update(self) -> None:
        self.timed.free_reason = "finish"
        self._num_frees = self.result.n_free

    def on_update(self, output: Any, update: Any) -> None:
        _check_frees(self.result.n_free - self._num_frees, update.finished, "update_from_output()")
        self.result.finished_turns += len(update.finished)


def run_loop(
    workload: Workload,
    manager: Any,
    cfg: LoopConfig,
    *,
    name: str = "ours",
    record_log: bool = False,
) -> LoopResult:
    """Replay ``workload`` (a turn's prompt: its conversation so far) through a `Scheduler` over
    ``manager`` to the end; RuntimeError if a step schedules nothing or frees an unknown request.

    Args:
        manager: a fresh manager with `cache.KVCacheManager`'s interface (or vLLM's, adapted).
        cfg: the Scheduler's arguments and the step limit.
        name: the manager's name in the result and in errors.
        record_log: keep the decision log (see `TimedManager`) in ``LoopResult.log``.
    """
    result = LoopResult(adapter=name)
    log: list[tuple] | None = [] if record_log else None
    result.log = log
    timed = TimedManager(manager, result, log)
    scheduler = Scheduler(
        timed,
        SchedulerConfig(
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            async_scheduling=False,
            scheduler_reserve_full_isl=cfg.full_sequence_must_fit,
        ),
        max_model_len=cfg.max_model_len,
        num_lookahead_tokens=cfg.num_lookahead_tokens,
    )
    backend = ModelFreeBackend(scheduler, hooks=_LoopHooks(result, timed))
    t_start = perf_counter_ns()
    try:
        drive(workload, backend, max_steps=cfg.max_steps)
    except RuntimeError as e:
        raise RuntimeError(f"{name}: {e}") from None
    result.wall_ns = perf_counter_ns() - t_start
    return result


def _check_frees(num_frees: int, expected: Iterable[str], where: str) -> None:
    expected = list(expected)
    if num_frees != len(expected):
        raise RuntimeError(
            f"Scheduler.{where} freed {num_frees} requests, expected {len(expected)} "
            f"({sorted(expected)}); the decision log's free reasons would be wrong"
        )


def first_difference(a: list[tuple], b: list[tuple]) -> dict[str, Any] | None:
    """Index and entries of the first differing decision-log entry (None if identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return {"index": i, "a": repr(x)[:600], "b": repr(y)[:600]}
    if len(a) != len(b):
        i = min(len(a), len(b))
        return {
            "index": i,
            "a": repr(a[i])[:600] if i < len(a) else "<end>",
            "b": repr(b[i])[:600] if i < len(b) else "<end>",
        }
    return None
