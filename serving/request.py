"""`Request`: one sampled sequence's whole state, from arrival to finish (vLLM v1's `Request`).

It extends the allocator's `cache.Request` (prompt, outputs, progress, block hashes: what
`cache.KVCacheManager` reads) with what the rest of `serving` keeps of it: the scheduler's
status, stop rules and in-flight counts, the sampling parameters and key, the metrics, and the
engine's logprobs, text and finish reason. The scheduler, engine, runner and data-parallel
runner hand this one object around; the scheduler's `SchedulerOutput` carries typed views of it
to the runner (`NewRequestData`, `CachedRequestData`), and the runner keeps its device-side
bookkeeping in `serving.input_batch.RequestState`. A user's request with ``n`` samples is a
`ParentRequest` over ``n`` `Request`s.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Sequence
from typing import Any

from cache import Request as CacheRequest
from serving.detokenizer import IncrementalText
from serving.outputs import CompletionOutput, Logprob, RequestMetrics
from serving.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["ParentRequest", "Request", "RequestStatus", "StopCriteria", "init_scheduling"]


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request in the scheduler (vLLM `RequestStatus`, the subset we use).

    As in vLLM, every status after PREEMPTED is a finished one.
    """

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    # vLLM's FINISHED_ERROR; here: a request an idle pool cannot admit (`stalled_request`)
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StopCriteria:
    """When a request stops by its tokens (vLLM's `check_stop` inputs, from its SamplingParams).

    ``eos_token_id`` is None when there is none or it is ignored (``ignore_eos``).
    """

    eos_token_id: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    min_tokens: int = 0

    @classmethod
    def of(cls, params: SamplingParams, eos_token_id: int | None) -> StopCriteria:
        """The stop rules of ``params`` with the tokenizer's EOS (unless ``ignore_eos``)."""
        return cls(
            eos_token_id=None if params.ignore_eos else eos_token_id,
            stop_token_ids=frozenset(params.stop_token_ids or ()),
            min_tokens=params.min_tokens,
        )


def init_scheduling(request: CacheRequest, stop: StopCriteria | None = None) -> None:
    """Give ``request`` the scheduler's fields as they are at arrival (WAITING, nothing in
    flight). `Request` is born with them; `serving.scheduler.Scheduler.add_request` calls this
    so that any `cache.Request` a manager made (the lab's, the vLLM adapter's) can be queued."""
    request.status = RequestStatus.WAITING
    request.stop = stop
    # sampling steps in flight (vLLM num_output_placeholders; asynchronous scheduling only)
    request.num_output_placeholders = 0
    # drafts those steps verify, counted as accepted until the step's output says how many were
    request.num_draft_placeholders = 0
    # its last scheduled chunk did not reach the end of its tokens (vLLM is_prefill_chunk)
    request.is_prefill_chunk = False


class Request(CacheRequest):
    """One sampled sequence from arrival to finish (see the module docstring).

    Args:
        request_id, prompt_token_ids: as `cache.Request`'s, and so are its other keywords.
        sampling_params: how it samples; None when driven without the engine (tests, the lab).
        stop: its stop rules; None: the scheduler's ``eos_token_id`` only.
        key_data: its sampler key (`serving.sampler.key_data_for_seed`).
        parent: the user's request it is one sample of; ``index`` its place there.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        stop: StopCriteria | None = None,
        key_data: Any = None,
        parent: ParentRequest | None = None,
        index: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(request_id, prompt_token_ids, **kwargs)
        init_scheduling(self, stop)
        self.sampling_params = sampling_params
        self.key_data = key_data
        self.parent = parent
        self.index = index
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        wants_logprobs = sampling_params is not None and sampling_params.logprobs is not None
        # per output token: token id -> Logprob (the sampled token, then the top-n asked for)
        self.logprobs: list[dict[int, Logprob]] | None = [] if wants_logprobs else None
        self.cumulative_logprob: float | None = 0.0 if wants_logprobs else None
        # prompt position -> its Logprob dict (position 0 has none)
        self.prompt_logprobs: dict[int, dict[int, Logprob]] = {}
        self.text: str | None = None  # set when a stop string cut it; else decoded on demand
        self._detokenizer: IncrementalText | None = None  # its output's text, step by step
        self.num_stop_checked_chars = 0  # text before this had no stop string (last check)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # DELTA outputs: what was reported already
        self.num_reported_tokens = 0
        self.num_reported_chars = 0

    @property
    def is_finished(self) -> bool:
        """Whether it has a finish reason (the engine sets one when it stops or is aborted)."""
        return self.finish_reason is not None

    def append_logprobs(self, token_ids: Iterable[int], entries, decode) -> None:
        """Record the logprobs of its newly sampled ``token_ids`` (one entry per token, from
        `serving.runner.StepOutput.logprobs`); nothing when it asked for none."""
        if self.logprobs is None or entries is None:
            return
        n = self.sampling_params.logprobs
        for token_id, entry in zip(token_ids, entries):
            self.logprobs.append(logprob_dict(entry, token_id, n, decode))
            self.cumulative_logprob += entry[0]

    def output_text(self, tokenizer) -> str:
        """``tokenizer.decode`` of its output tokens, decoding only what the last step added
        (`serving.detokenizer.IncrementalText`)."""
        if self._detokenizer is None:
            self._detokenizer = IncrementalText(tokenizer.decode)
        return self._detokenizer.text(self.output_token_ids)

    @property
    def num_settled_chars(self) -> int:
        """Characters at the start of `output_text` that no later token can change."""
        return 0 if self._detokenizer is None else self._detokenizer.num_kept_chars

    def decoded(self, tokenizer) -> str:
        """Its output text (the cut text after a stop string)."""
        if self.text is not None:
            return self.text
        if tokenizer is None or not self.sampling_params.detokenize:
            return ""
        return self.output_text(tokenizer)

    def completion(self, tokenizer) -> CompletionOutput:
        """Its `CompletionOutput` now (with DELTA outputs: what is new since the last one)."""
        text = self.decoded(tokenizer)
        tokens, logprobs = self.output_token_ids, self.logprobs
        if self.sampling_params.output_kind is RequestOutputKind.DELTA:
            start, chars = self.num_reported_tokens, self.num_reported_chars
            self.num_reported_tokens, self.num_reported_chars = len(tokens), len(text)
            tokens, text = tokens[start:], text[chars:]
            logprobs = None if logprobs is None else logprobs[start:]
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=list(tokens),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if logprobs is None else list(logprobs),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


@dataclasses.dataclass(slots=True, eq=False)
class ParentRequest:
    """A user's request: its prompt and its ``n`` sampled sequences (vLLM's ParentRequest;
    here also for n == 1, so that outputs are built one way). Its metrics are the group's:
    first scheduled / first token of any child, finished when the last one is."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # as the user gave them (``n`` included)
    metrics: RequestMetrics
    children: list[Request] = dataclasses.field(default_factory=list)
    num_unfinished: int = 0

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0


def logprob_dict(entry, token_id: int, n: int, decode) -> dict[int, Logprob]:
    """vLLM's per-position dict: the chosen (or prompt) token first, then the top ``n``.
    ``entry`` is (logprob, rank, top ids, top logprobs); ``decode`` maps a token id to its
    text (or None)."""
    lp, rank, top_ids, top_lps = entry
    out = {token_id: Logprob(lp, rank, decode(token_id))}
    for i, (tid, tlp) in enumerate(zip(top_ids[:n], top_lps[:n], strict=True)):
        out.setdefault(tid, Logprob(tlp, i + 1, decode(tid)))
    return out
