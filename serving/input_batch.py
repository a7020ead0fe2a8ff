"""`InputBatch`: the host side of every running request, and the step's requests built from a
`SchedulerOutput` (vLLM's `InputBatch` / `CachedRequestState`, without the device arrays).

The one place that turns a plan into `ScheduledRow`s (the runner's view of each row) and
`dsv4.paged.batch.StepRequest`s (the model's); docs/serving.md says what it keeps.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Sequence

from dsv4.paged.batch import BlockTables, GroupInfo, StepRequest
from serving.request import Request
from serving.scheduler import NewRequestData, SchedulerOutput

__all__ = ["InputBatch", "RequestState", "ScheduledRow"]


@dataclasses.dataclass(slots=True)
class RequestState:
    """What the runner keeps of one running request between its admission and its preemption
    or finish (docs/serving.md)."""

    request_id: str
    slot: int  # its row of the device's per-slot state
    num_prompt_tokens: int
    tokens: list[int]  # prompt + outputs the host knows
    block_ids: list[list[int]]  # per KV-cache group
    # per sampling step in flight (oldest first): the drafts it verifies; its tokens are only
    # on the device until `learn` (1 + those drafts, counted as if all were accepted)
    pending: collections.deque[int] = dataclasses.field(default_factory=collections.deque)
    # the same steps' drafts when the host proposed them (None: made on the device)
    pending_drafts: collections.deque[tuple[int, ...] | None] = dataclasses.field(
        default_factory=collections.deque
    )
    replay_start: int = 0  # bounded replay: windows start here
    write_from: int = 0  # bounded replay: compressed / index writes from here
    # the drafts the device made in its last sampling step that the host has learned (with
    # device-made drafts: what its next step verified)
    last_drafts: tuple[int, ...] = ()
    # a host proposer's guess of what its step in flight does: (the token it samples, the
    # drafts it rejects); the drafts of its next step follow that outcome
    # (`serving.spec_decode.next_drafts_ahead`); None: no guess
    guess: tuple[int, int] | None = None
    # per sampling step in flight: the guess its drafts were proposed under (None: none)
    pending_guesses: collections.deque[tuple[int, int] | None] = dataclasses.field(
        default_factory=collections.deque
    )
    # what its last learned sampling step did: (the token it sampled last, drafts rejected)
    last_outcome: tuple[int, int] | None = None

    @property
    def in_flight_usable(self) -> bool:
        """Whether the drafts of its oldest step in flight can be accepted at all: the guess
        they were proposed under (if any) is what the step before did."""
        guess = self.pending_guesses[0] if self.pending_guesses else None
        return guess is None or guess == self.last_outcome

    # the request itself, when the owner attaches it (the runner: its sampling parameters and
    # key); None for a harness that drives the batch without an engine
    request: Request | None = None

    @property
    def num_pending(self) -> int:
        """Sampling steps in flight."""
        return len(self.pending)

    @property
    def num_tokens(self) -> int:
        """Every token it has, known or in flight (drafts in flight counted as accepted)."""
        return len(self.tokens) + len(self.pending) + sum(self.pending)

    @property
    def num_shifted(self) -> int:
        """Drafts its step in flight verifies: positions planned past them are optimistic, and
        the device moves them back by the drafts it rejected (at most one step in flight has
        drafts: the engine plans one step ahead)."""
        return self.pending[-1] if self.pending else 0


@dataclasses.dataclass(slots=True)
class ScheduledRow:
    """One request's row of a step (a view of the request for that step); each field's comment
    says what it holds. Not changed once built (not frozen: a frozen dataclass costs every
    step's every row a few microseconds more to build); `dataclasses.replace` makes a variant."""

    request_id: str
    start: int  # its first position (optimistic when ``shifted``: the device may move it back)
    num_tokens: int  # tokens it runs, its drafts included
    samples: bool  # whether it samples a token
    drafts: tuple[int, ...]  # the drafts it verifies (-1 placeholders: made on the device)
    device_slots: tuple[int, ...]  # per token, the slot whose last sampled token it is (-1: host)
    device_drafts: bool = False  # its drafts are the slot's last drafts on the device
    # drafts of its step in flight (`RequestState.num_shifted`): the device moves the row back
    # by those that step rejected
    shifted: int = 0
    # the tokens of the ``shifted`` positions before the Engram look-back (newest first; -1
    # before position 0), which a moved row's look-back reaches
    history: tuple[int, ...] = ()
    num_prompt_tokens: int = 0
    # some of its positions predict prompt tokens whose logprobs it asked for (the runner sets it)
    prompt_logprobs: bool = False
    # it asked for its sampled tokens' logprobs (the runner sets it)
    logprobs: bool = False

    @property
    def num_drafts(self) -> int:
        """Its last ``num_drafts`` tokens are drafts to verify."""
        return len(self.drafts)


class InputBatch:
    """Running requests' host state (docs/serving.md).

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
        # every slot's block ids kept between steps, once the owner asks for them (`keep_tables`)
        self.tables: BlockTables | None = None

    def keep_tables(self, groups: Sequence[GroupInfo], max_model_len: int) -> BlockTables:
        """The slots' block tables (`dsv4.paged.batch.BlockTables`), kept from now on as
        requests enter, grow and leave: `build_batch` gathers a step's rows from them."""
        if self.tables is None:
            self.tables = BlockTables(groups, self.max_num_seqs, max_model_len)
            for state in self.requests.values():
                self.tables.set(state.slot, state.block_ids)
        return self.tables

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
        if self.tables is not None:
            self.tables.set(state.slot, state.block_ids)
        return state

    def update(self, output: SchedulerOutput) -> None:
        """Apply a plan's bookkeeping: finished and preempted requests go, block ids appended
        to running ones. New requests are admitted by the owner (`admit`), which knows their
        prompts."""
        self.release(output.finished_req_ids)
        self.release(output.preempted_req_ids)
        tables = self.tables
        for cached in output.scheduled_cached_reqs:
            if cached.new_block_ids is None:  # no new block
                continue
            state = self.requests[cached.request_id]
            grew = False
            for ids, more in zip(state.block_ids, cached.new_block_ids, strict=True):
                if more:
                    ids.extend(more)
                    grew = True
            if grew and tables is not None:
                tables.append(state.slot, cached.new_block_ids)

    def schedule(self, output: SchedulerOutput) -> tuple[list[ScheduledRow], list[StepRequest]]:
        """The step's rows and `StepRequest`s, in the plan's order. A sampling row's request
        counts one more token in flight afterwards (`learn` takes it back)."""
        starts = {r.request_id: r.num_computed_tokens for r in output.scheduled_new_reqs}
        starts.update((r.request_id, r.num_computed_tokens) for r in output.scheduled_cached_reqs)
        rows, step_requests, states = [], [], []
        requests, sampling = self.requests, output.sampling_req_ids
        spec = output.scheduled_spec_decode_tokens
        plain = not self.engram_lookback  # no look-back to read
        for request_id, n in output.num_scheduled_tokens.items():
            start = starts[request_id]
            state = requests[request_id]
            states.append(state)
            pending = state.pending
            if n == 1 and plain and not (pending and pending[-1]) and request_id not in spec:
                # one token, no drafts, nothing moved, no look-back (a decode step's rows):
                # `_row`'s fields without the branches that cannot apply
                tokens, device = self._inputs(state, start, 1)
                rows.append(ScheduledRow(request_id, start, 1, request_id in sampling, (),
                                         (device[0],), num_prompt_tokens=state.num_prompt_tokens))  # fmt: skip
                step_requests.append(StepRequest(tokens, start, state.block_ids,
                                                 state.replay_start, state.write_from,
                                                 request_id, (), state.slot))  # fmt: skip
                continue
            row, step_request = self._row(output, request_id, start, n)
            rows.append(row)
            step_requests.append(step_request)
        for row, state in zip(rows, states, strict=True):
            if row.samples:  # once every row is built: a bad plan changes nothing
                drafts = row.drafts
                state.pending.append(len(drafts))
                state.pending_drafts.append(None if row.device_drafts else drafts)
                state.pending_guesses.append(None)  # the runner sets it (`note_guess`)
        return rows, step_requests

    def _row(
        self, output: SchedulerOutput, request_id: str, start: int, n: int
    ) -> tuple[ScheduledRow, StepRequest]:
        """One request's row of the step: ``n`` tokens from position ``start`` (the tokens in
        its cache before this step)."""
        state = self.requests[request_id]
        spec = output.scheduled_spec_decode_tokens
        drafts = tuple(spec[request_id]) if spec and request_id in spec else ()
        # -1 drafts are placeholders: the device drafted them (async scheduling)
        device_drafts = bool(drafts) and drafts[0] < 0
        tokens, device = self._inputs(state, start, n - len(drafts))
        shifted = state.pending[-1] if state.pending else 0  # `num_shifted`
        m = self.engram_lookback
        # no look-back, nothing in flight to check against: no tokens to read
        lo, tail = self._look_back(state, start) if m or shifted else (0, [])
        history = ()
        if shifted and m:
            history = tuple(
                tail[p - lo] if p >= 0 else -1
                for p in range(start - m - 1, start - m - 1 - shifted, -1)
            )
        row = ScheduledRow(
            request_id,
            start,
            n,
            request_id in output.sampling_req_ids,
            drafts,
            (*device, *[-1] * len(drafts)) if drafts else tuple(device),
            device_drafts,
            shifted,
            history,
            state.num_prompt_tokens,
        )
        step_request = StepRequest(
            token_ids=tokens + ([0] * len(drafts) if device_drafts else list(drafts)),
            start=start,
            block_ids=state.block_ids,
            replay_start=state.replay_start,
            cache_write_from=state.write_from,
            req_id=request_id,
            # every position before start is known to the host (only the newest token can be
            # in flight, and it is at start or later), or is a draft in flight that the host
            # learned (see ScheduledRow)
            prev_tokens=tail[max(0, start - m) - lo :] if m else (),
            slot=state.slot,
        )
        return row, step_request

    def _look_back(self, state: RequestState, start: int) -> tuple[int, list[int]]:
        """``(lo, tail)``: the tokens of positions lo..start-1 (Engram's look-back and, for a
        moved row, the history before it): host-known tokens, then the drafts in flight if
        any; no tokens without Engram."""
        shifted = state.num_shifted
        m = self.engram_lookback
        lo = max(0, start - m - shifted)
        if not shifted:
            return lo, state.tokens[lo:start] if m else []
        # the positions before start hold the drafts in flight
        in_flight = state.pending_drafts[-1]
        if in_flight is None:  # made on the device: learned with the step before
            in_flight = state.last_drafts[:shifted]
        if len(state.tokens) + len(in_flight) != start:
            raise RuntimeError(
                f"{state.request_id!r}: scheduled from position {start} with {shifted} drafts "
                f"in flight, but the host knows {len(state.tokens)} tokens and "
                f"{len(state.last_drafts)} drafts"
            )
        return lo, [*state.tokens[lo:], *in_flight] if m else []

    def note_guess(self, request_id: str, guess: tuple[int, int] | None) -> None:
        """The guess the request's newest step in flight was given (the runner's SpecBatch)."""
        self.requests[request_id].pending_guesses[-1] = guess

    def _inputs(self, state: RequestState, start: int, n: int) -> tuple[list[int], list[int]]:
        """The tokens of positions start..start+n-1 and, for each, the slot to read it from on
        the device (-1: the host has it). Only the newest token may be unknown to the host: it
        was sampled by a step still in flight (after the drafts that step verifies, which are
        no input: the row starts after them)."""
        end = start + n
        if end <= len(state.tokens):
            return state.tokens[start:end], [-1] * n
        num_tokens = state.num_tokens
        if end > num_tokens:
            raise RuntimeError(
                f"{state.request_id!r}: positions {start}..{end - 1} scheduled, but it has "
                f"{num_tokens} tokens"
            )
        if (
            state.num_pending < 1
            or end != num_tokens
            or end - 1 < len(state.tokens) + (state.num_shifted)
        ):
            raise RuntimeError(
                f"{state.request_id!r}: positions {start}..{end - 1} scheduled; the host knows "
                f"{len(state.tokens)} tokens and only the last of {state.num_tokens} may be on "
                "the device"
            )
        tokens = state.tokens[start : end - 1]
        # the device puts the slot's last sampled token at the end
        return tokens + [0], [-1] * len(tokens) + [state.slot]

    def learn(self, request_id: str, tokens: Sequence[int], drafts: Sequence[int] = ()) -> None:
        """A step's sampled tokens (and, from a device drafter, the drafts it made after them)
        reached the host (ignored for requests no longer here)."""
        state = self.requests.get(request_id)
        if state is not None and state.pending:
            state.tokens.extend(tokens)
            num_drafts = state.pending.popleft()
            state.pending_drafts.popleft()
            state.pending_guesses.popleft()
            state.last_drafts = tuple(drafts)
            state.last_outcome = (tokens[-1], num_drafts + 1 - len(tokens))
