"""`InputBatch`: the host side of every running request, and the step's requests built from a
`SchedulerOutput` (vLLM's `InputBatch` / `CachedRequestState`, without the device arrays).

The scheduler sends a request's whole state only when it (re)enters the batch
(`NewRequestData`: its tokens and every block id); afterwards only the block ids appended per
step (`CachedRequestData`). This class keeps what those messages add up to — each request's
block ids per KV-cache group, the tokens the host knows, how many of its sampled tokens are
still only on the device, its persistent slot and its bounded-replay bounds — and turns one
step's plan into `dsv4.paged.batch.StepRequest`s. It is the one place that does so: the model
runner and the paged-step test harness both use it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from dsv4.paged.batch import StepRequest
from serving.scheduler import NewRequestData, SchedulerOutput

__all__ = ["InputBatch", "RequestState", "ScheduledRow"]


@dataclasses.dataclass(slots=True)
class RequestState:
    """What the host keeps of one running request."""

    request_id: str
    slot: int  # its row of the device's per-slot state
    num_prompt_tokens: int
    tokens: list[int]  # prompt + outputs the host knows
    block_ids: list[list[int]]  # per KV-cache group
    num_pending: int = 0  # sampled tokens still only on the device (in flight)
    replay_start: int = 0  # bounded replay: windows start here
    write_from: int = 0  # bounded replay: compressed / index writes from here
    extra: object = None  # what the owner attaches (the runner: sampling parameters)

    @property
    def num_tokens(self) -> int:
        """Every token it has, known or in flight."""
        return len(self.tokens) + self.num_pending


@dataclasses.dataclass(frozen=True, slots=True)
class ScheduledRow:
    """One request's row of a step: where its tokens start, how many, whether it samples, and
    for each token the slot whose last sampled token it is on the device (-1: host-known)."""

    request_id: str
    start: int
    num_tokens: int
    samples: bool
    num_drafts: int
    device_slots: tuple[int, ...]


class InputBatch:
    """Running requests' host state (see the module docstring).

    Args:
        max_num_seqs: slots 0..max_num_seqs-1 (the scheduler never runs more at once).
        engram_lookback: ``ModelConfig.engram_lookback`` (0: no Engram history).
    """

    def __init__(self, max_num_seqs: int, *, engram_lookback: int = 0) -> None:
        self.max_num_seqs = max_num_seqs
        # Engram: each step request carries this many tokens before its start (its n-gram
        # history, from the tokens the host knows: prompt tokens after a prefix hit or a
        # preemption, never a cache)
        self.engram_lookback = engram_lookback
        self.requests: dict[str, RequestState] = {}
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))  # pop() gives slot 0 first

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget requests (finished, preempted) and free their slots."""
        for request_id in request_ids:
            state = self.requests.pop(request_id, None)
            if state is not None:
                self._free_slots.append(state.slot)

    def admit(self, new: NewRequestData, num_prompt_tokens: int) -> RequestState:
        """A request (re)entering the batch: a slot, its block ids, its known tokens."""
        self.release([new.request_id])  # a resumed request starts from scratch
        if not self._free_slots:
            raise RuntimeError(f"no free slot for {new.request_id!r} (max_num_seqs exceeded)")
        state = RequestState(
            request_id=new.request_id,
            slot=self._free_slots.pop(),
            num_prompt_tokens=num_prompt_tokens,
            tokens=list(new.token_ids),
            block_ids=[list(ids) for ids in new.block_ids],
        )
        if new.num_replay_tokens:  # the hit's last window is recomputed from here
            state.replay_start = new.num_computed_tokens
        state.write_from = new.num_computed_tokens + new.num_replay_tokens
        self.requests[new.request_id] = state
        return state

    def update(self, output: SchedulerOutput) -> None:
        """Apply a plan's bookkeeping: finished and preempted requests go, block ids appended
        to running ones. New requests are admitted by the owner (`admit`), which knows their
        prompts."""
        self.release(output.finished_req_ids)
        self.release(output.preempted_req_ids)
        for cached in output.scheduled_cached_reqs:
            state = self.requests[cached.request_id]
            for ids, more in zip(state.block_ids, cached.new_block_ids, strict=True):
                ids.extend(more)

    def schedule(self, output: SchedulerOutput) -> tuple[list[ScheduledRow], list[StepRequest]]:
        """The step's rows and `StepRequest`s, in the plan's order. A sampling row's request
        counts one more token in flight afterwards (`learn` takes it back)."""
        starts = {r.request_id: r.num_computed_tokens for r in output.scheduled_new_reqs}
        starts.update((r.request_id, r.num_computed_tokens) for r in output.scheduled_cached_reqs)
        rows, step_requests = [], []
        for request_id, n in output.num_scheduled_tokens.items():
            state = self.requests[request_id]
            start = starts[request_id]  # tokens in its cache before this step
            drafts = output.scheduled_spec_decode_tokens.get(request_id, [])
            tokens, device = self._inputs(state, start, n - len(drafts))
            rows.append(
                ScheduledRow(
                    request_id,
                    start,
                    n,
                    request_id in output.sampling_req_ids,
                    len(drafts),
                    (*device, *[-1] * len(drafts)),
                )
            )
            step_requests.append(
                StepRequest(
                    token_ids=tokens + list(drafts),
                    start=start,
                    block_ids=state.block_ids,
                    replay_start=state.replay_start,
                    cache_write_from=state.write_from,
                    req_id=request_id,
                    # every position before start is known to the host (only the newest
                    # token can be in flight, and it is at start or later)
                    prev_tokens=state.tokens[max(0, start - self.engram_lookback) : start]
                    if self.engram_lookback
                    else (),
                )
            )
        for row in rows:
            if row.samples:
                self.requests[row.request_id].num_pending += 1
        return rows, step_requests

    def _inputs(self, state: RequestState, start: int, n: int) -> tuple[list[int], list[int]]:
        """The tokens of positions start..start+n-1 and, for each, the slot to read it from on
        the device (-1: the host has it). Only the newest token may be unknown to the host: it
        was sampled by a step still in flight."""
        if start + n > state.num_tokens:
            raise RuntimeError(
                f"{state.request_id!r}: positions {start}..{start + n - 1} scheduled, but it has "
                f"{state.num_tokens} tokens"
            )
        tokens = state.tokens[start : start + n]
        device = [-1] * len(tokens)
        missing = start + n - len(state.tokens)
        if missing > 0:
            if missing > 1 or state.num_pending < 1:
                raise RuntimeError(
                    f"{state.request_id!r}: {missing} scheduled tokens are neither known nor "
                    "the last sampled one"
                )
            tokens.append(0)  # the device puts the slot's last sampled token here
            device.append(state.slot)
        return tokens, device

    def learn(self, request_id: str, tokens: Sequence[int]) -> None:
        """A step's sampled tokens reached the host (ignored for requests no longer here)."""
        state = self.requests.get(request_id)
        if state is not None and state.num_pending:
            state.tokens.extend(tokens)
            state.num_pending -= 1
