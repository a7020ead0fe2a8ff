"""Speculative decoding: the configuration and the proposers (host side).

`SpeculativeConfig` is vLLM's checked ``speculative_config``; `NgramProposer` is vLLM's prompt
lookup on the host, `DSparkProposer` hands on the drafts the device made. `next_drafts` and (for
asynchronous scheduling, one token further under a guess) `next_drafts_ahead` are what the engine
asks. Proposers, guesses and verification: docs/serving.md#servingspec_decode.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "MAX_SPECULATIVE_TOKENS",
    "DSparkProposer",
    "NgramProposer",
    "SpeculativeConfig",
    "next_drafts",
    "next_drafts_ahead",
]

# Most drafts per step: the compressor ring of a ratio-2 layer holds k + 2 rows rounded up to a
# power of two (`cache.layout.ring_capacity`); 15 keeps it at 32 rows.
MAX_SPECULATIVE_TOKENS = 15

_METHODS = ("ngram", "dspark")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    @classmethod
    def from_dict(cls, config: Mapping[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        """Parse and check vLLM's ``speculative_config`` dict.

        Raises:
            ValueError: an unknown key or method, ``num_speculative_tokens`` outside
                1..`MAX_SPECULATIVE_TOKENS`, lookup lengths below 1 or min > max.
        """
        if isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, Mapping):
            raise ValueError(f"speculative_config must be a dict, got {type(config).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown key {unknown[0]!r}; known: {sorted(known)}"
            )
        method = config.get("method")
        if method not in _METHODS:
            raise ValueError(f"speculative_config method={method!r}; allowed: {list(_METHODS)}")
        k = config.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config num_speculative_tokens={k!r}; allowed: an int in "
                f"1..{MAX_SPECULATIVE_TOKENS}"
            )
        lo, hi = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
        if method == "ngram":
            if lo is None and hi is None:
                lo = hi = 5
            lo = hi if lo is None else lo
            hi = lo if hi is None else hi
            for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(f"speculative_config {name}={value!r}; allowed: an int >= 1")
            if lo > hi:
                raise ValueError(
                    f"speculative_config prompt_lookup_min={lo} > prompt_lookup_max={hi}"
                )
        elif lo is not None or hi is not None:
            raise ValueError("prompt_lookup_min / prompt_lookup_max are for method 'ngram' only")
        return cls(method, k, lo, hi)


class NgramProposer:
    """vLLM's n-gram prompt lookup (module docstring); model-free, on the host."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        if config.method != "ngram":
            raise ValueError(f"NgramProposer needs method 'ngram', got {config.method!r}")
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.max_model_len = max_model_len

    def propose(self, token_ids: Sequence[int], num_tokens: int | None = None) -> list[int]:
        """Draft tokens for a sequence (prompt + outputs so far); [] when nothing matches.
        ``num_tokens``: how many to propose at most (default k)."""
        total = len(token_ids)
        k = min(self.k if num_tokens is None else num_tokens, self.max_model_len - total)
        if total < self.min_n or k <= 0:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            # every earlier window of n tokens (ending before the last token) equal to the tail
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[total - n :]).all(axis=1))
            if hits.size:
                start = int(hits[0]) + n  # the earliest occurrence; drafts follow it
                return tokens[start : start + k].tolist()
        return []


class DSparkProposer:
    """The model's DSpark drafter (module docstring): its drafts are made on the device in the
    step and come back in ``StepOutput.draft_token_ids``; `propose_step` passes them on.

    Raises:
        ValueError: the config's method is not "dspark", the model has no drafter, or
            ``num_speculative_tokens`` exceeds the model's ``dspark_block_size``.
    """

    def __init__(self, config: SpeculativeConfig, model_cfg: Any, max_model_len: int) -> None:
        if config.method != "dspark":
            raise ValueError(f"DSparkProposer needs method 'dspark', got {config.method!r}")
        if not (model_cfg.n_mtp_layers and model_cfg.dspark_block_size):
            raise ValueError(
                "speculative_config method='dspark': this model has no DSpark drafter "
                f"(n_mtp_layers={model_cfg.n_mtp_layers}, dspark_block_size="
                f"{model_cfg.dspark_block_size}); use method='ngram'"
            )
        k, block = config.num_speculative_tokens, model_cfg.dspark_block_size
        if k > block:
            raise ValueError(
                f"speculative_config num_speculative_tokens={k}: the DSpark drafter drafts blocks "
                f"of dspark_block_size={block}; allowed: 1..{block}"
            )
        self.k = k
        self.max_model_len = max_model_len

    def propose_step(self, requests: Iterable[Any], step_output: Any) -> dict[str, list[int]]:
        """The drafts the step made for ``requests`` (those that sampled in it), each cut so
        that its positions stay below ``max_model_len``."""
        out = {}
        made = step_output.draft_token_ids
        for request in requests:
            drafts = made.get(request.request_id)
            room = self.max_model_len - request.num_tokens
            if drafts and room > 0:
                out[request.request_id] = list(drafts[: min(self.k, room)])
        return out


def next_drafts(proposer: Any, requests: Iterable[Any], step_output: Any) -> dict[str, list[int]]:
    """The engine's one question to a proposer after a step: drafts for the next step of the
    running ``requests`` (`serving.request.Request`), request id -> tokens (empty ones left out).

    ``propose_step(requests, step_output)`` answers for all at once (`DSparkProposer`); any other
    proposer answers per sequence with ``propose(token_ids) -> list[int]`` (`NgramProposer`).
    """
    propose_step = getattr(proposer, "propose_step", None)
    if propose_step is not None:
        return {
            rid: tokens for rid, tokens in propose_step(requests, step_output).items() if tokens
        }
    drafts = {}
    for request in requests:
        tokens = proposer.propose(request.all_token_ids)
        if tokens:
            drafts[request.request_id] = tokens
    return drafts


def next_drafts_ahead(
    proposer: Any,
    requests: Iterable[Any],
    in_flight: Mapping[str, tuple[Sequence[int], bool]],
    k: int,
) -> dict[str, tuple[tuple[int, int] | None, list[int]]]:
    """A host-side proposer's drafts for the step after the one in flight (module docstring).

    ``in_flight``: the requests that sample in the step in flight -> (the drafts it verifies,
    whether they can be accepted at all); their proposal starts one token further, after a guess.
    The proposer answers ``propose(token_ids, num_tokens)``.

    Returns:
        request id -> (guess, drafts) for every running request; the guess is (the token the step
        in flight samples, the drafts it rejects), None for requests not in flight.
    """
    out = {}
    for request in requests:
        tokens = list(request.all_token_ids)
        flight = in_flight.get(request.request_id)
        if flight is None:
            out[request.request_id] = (None, list(proposer.propose(tokens, k)))
            continue
        drafts, usable = flight
        assumed = list(drafts) if usable else []  # accepted by the step in flight
        ahead = list(proposer.propose(tokens + assumed, k + 1))
        if len(ahead) < 2:
            out[request.request_id] = (None, [])
        else:
            guess = (ahead[0], len(drafts) - len(assumed))
            out[request.request_id] = (guess, ahead[1:])
    return out
