"""What `LLM.generate` and `Engine.step` return, shaped as vLLM's `vllm.outputs` and
`vllm.sequence.Logprob`: a `RequestOutput` per request with one `CompletionOutput` per sample
(``n``), logprobs per position as a dict from token id to `Logprob`, and per-request metrics.
"""

from __future__ import annotations

import dataclasses

__all__ = ["CompletionOutput", "Logprob", "RequestMetrics", "RequestOutput"]


@dataclasses.dataclass(slots=True)
class Logprob:
    """One token's log-probability (vLLM `Logprob`): the raw model logprob (before penalties,
    temperature and truncation), its rank among the vocabulary (1 = most likely) and its
    text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob (the chosen token, plus the top-n asked for).
PositionLogprobs = dict[int, Logprob]


@dataclasses.dataclass(slots=True)
class CompletionOutput:
    """One generated sequence (vLLM `CompletionOutput`).

    ``finish_reason``: None while running, then "stop" (EOS, a stop token id or a stop string),
    "length" (max_tokens or max_model_len), "abort", or "error" (the KV-cache pool cannot hold
    the request even alone; it keeps the tokens it had). ``stop_reason``: the stop token id or
    stop string that ended it (None for EOS and length).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(slots=True)
class RequestMetrics:
    """Timestamps (seconds, `time.monotonic`) and counts of one request's life.

    ``first_token_time`` is when the host learned the first output token (with asynchronous
    scheduling, one step after the device sampled it).
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    # speculative decoding: draft tokens verified for it, and of them the accepted ones
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted over verified draft tokens (None without drafts)."""
        if not self.spec_num_draft_tokens:
            return None
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens

    @property
    def time_in_queue(self) -> float | None:
        """Arrival to first scheduling."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the first output token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (None with fewer than two)."""
        if self.num_generation_tokens < 2 or self.last_token_time is None:
            return None
        assert self.first_token_time is not None
        return (self.last_token_time - self.first_token_time) / (self.num_generation_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        """Arrival to finish."""
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclasses.dataclass(slots=True)
class RequestOutput:
    """One request's state as the user sees it (vLLM `RequestOutput`).

    ``prompt_logprobs`` has one entry per prompt token, the first None (nothing predicts it);
    ``num_cached_tokens`` is the prefix-cache hit at admission.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0

    def __repr__(self) -> str:
        outs = ", ".join(
            f"#{o.index}: {o.text!r} ({len(o.token_ids)} tokens, {o.finish_reason})"
            for o in self.outputs
        )
        return f"RequestOutput({self.request_id!r}, finished={self.finished}, [{outs}])"
