"""`SamplingParams`: what a request asks of the sampler, with vLLM's names, defaults and checks.

Fields, defaults, normalisation and validation follow vLLM's `vllm/sampling_params.py`; checks
that need the model are in `verify`. Every error is a ValueError naming the field, the value and
what is allowed. Normalisation and what is left out: docs/serving.md#servingsampling_params.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import numbers
from dataclasses import InitVar, dataclass

__all__ = [
    "BEST_OF_ADVICE",
    "SAMPLING_EPS",
    "VLLM_ONLY_SAMPLING",
    "SamplingParams",
    "SamplingType",
    "check_keyword",
]

# Below this temperature a request is greedy (vLLM's `_SAMPLING_EPS`).
SAMPLING_EPS = 1e-5

# The seeds torch's generators accept (`torch.Generator.manual_seed`), which vLLM passes through.
_SEED_MIN = -(2**63)
_SEED_END = 2**64


class RequestOutputKind(enum.Enum):
    """What `Engine.step` reports of a running request (vLLM's `RequestOutputKind`):
    everything so far, only what is new since the last report, or only the final output
    (`LLM.generate` asks for that)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingType(enum.IntEnum):
    """How a request's next token is chosen (vLLM `SamplingType`)."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _fail(name: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"{name}={value!r} is not allowed: {allowed}")


# What vLLM V1 advises since it dropped best_of (vLLM issue 13361), in this API's names.
BEST_OF_ADVICE = (
    "ask for n=k samples with logprobs=0 and rank the outputs by cumulative_logprob (vLLM V1 "
    "dropped best_of and advises the same)"
)
# vLLM's SamplingParams keywords this sampler does not take, and what to use instead
# (`SamplingParams` refuses them by this table instead of "unexpected keyword argument").
VLLM_ONLY_SAMPLING = {
    "use_beam_search": "no beam search here; " + BEST_OF_ADVICE,
    "logit_bias": "no per-token bias here; stop_token_ids ends an output at the tokens given",
    "allowed_token_ids": "no vocabulary mask here; stop_token_ids ends an output at the tokens "
    "given",
    "bad_words": "no banned words here; stop (strings) or stop_token_ids end an output there",
    "logits_processors": "the sampler runs inside the compiled step: repetition_penalty, "
    "presence_penalty, frequency_penalty, top_k, top_p, min_p and min_tokens are built in",
    "truncate_prompt_tokens": "cut the prompt yourself: pass prompt_token_ids[-k:]",
    "guided_decoding": "no structured outputs here; stop or stop_token_ids end an output",
    "structured_outputs": "no structured outputs here; stop or stop_token_ids end an output",
}


@dataclass
class SamplingParams:
    """Sampling parameters of one request (vLLM `SamplingParams`, the subset served here, with
    vLLM's defaults); each field's comment says what it does, docs/serving.md the checks."""

    n: int = 1  # outputs per prompt, >= 1
    presence_penalty: float = 0.0  # subtracted once from tokens already generated, in [-2, 2]
    frequency_penalty: float = 0.0  # subtracted per occurrence of a generated token, in [-2, 2]
    # > 0; tokens of the prompt or the outputs have positive logits divided and negative ones
    # multiplied by it (1 = off)
    repetition_penalty: float = 1.0
    temperature: float = 1.0  # >= 0; below 1e-5 the request is greedy
    top_p: float = 1.0  # nucleus mass in (0, 1] (1 = off)
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 = off
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely, in [0, 1]
    seed: int | None = None  # per-request seed (None or -1: the engine draws one)
    # strings that end the output (not included unless include_stop_str_in_output)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # token ids that end the output (included in it)
    ignore_eos: bool = False  # keep generating after the EOS token
    max_tokens: int | None = 16  # output tokens at most (None: up to the model's length)
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many outputs
    logprobs: int | None = None  # top logprobs per output token (plus the sampled one's)
    prompt_logprobs: int | None = None  # top logprobs per prompt token
    # output text options
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # what each step reports
    # vLLM V0's candidates per output, not kept: None or n (vLLM's default) only
    best_of: InitVar[int | None] = None

    def __new__(cls, *args: object, **kwargs: object) -> SamplingParams:
        _check_keywords(kwargs)  # before the dataclass's "unexpected keyword argument"
        return super().__new__(cls)

    def __post_init__(self, best_of: int | None) -> None:
        self._normalise()
        self._verify_args()
        if best_of is not None and (not _is_int(best_of) or best_of != self.n):
            raise ValueError(
                f"best_of={best_of!r} is not supported: None or n={self.n} only (n samples, all "
                f"returned); for the best of k samples, {BEST_OF_ADVICE}"
            )
        self._to_python_numbers()
        if self.temperature < SAMPLING_EPS:
            # Truncation cannot change an argmax; vLLM resets it so greedy rows look alike.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
            if self.n > 1:
                raise _fail("n", self.n, "greedy sampling (temperature < 1e-5) needs n == 1")

    def _normalise(self) -> None:
        if self.seed == -1 and _is_int(self.seed):
            self.seed = None
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise _fail("stop", self.stop, "a string, a list of strings or None")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))
        else:
            raise _fail("stop_token_ids", self.stop_token_ids, "a list of ints or None")

    def _to_python_numbers(self) -> None:
        # numpy scalars pass the checks; store plain Python numbers (hashing, JSON, printing).
        for name in (
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "temperature",
            "top_p",
            "min_p",
        ):
            setattr(self, name, float(getattr(self, name)))
        for name in (
            "n",
            "top_k",
            "min_tokens",
            "max_tokens",
            "logprobs",
            "prompt_logprobs",
            "seed",
        ):
            value = getattr(self, name)
            setattr(self, name, None if value is None else int(value))
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]

    def _verify_args(self) -> None:
        _check_int("n", self.n, minimum=1)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise _fail("output_kind", self.output_kind, "a RequestOutputKind")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                raise _fail(name, value, "a number in [-2, 2]")
        rp = self.repetition_penalty
        if not _is_real(rp) or not math.isfinite(rp) or rp <= 0.0:
            raise _fail("repetition_penalty", rp, "a finite number > 0 (1 = off)")
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t < 0.0:
            raise _fail("temperature", t, "a finite number >= 0 (0 = greedy)")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise _fail("top_p", self.top_p, "a number in (0, 1] (1 = off)")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise _fail("top_k", self.top_k, "an int >= 1, or 0 or -1 (off)")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise _fail("min_p", self.min_p, "a number in [0, 1] (0 = off)")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=1, none_ok=True)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _fail("min_tokens", self.min_tokens, f"at most max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value == -1 and _is_int(value):
                raise _fail(
                    name,
                    value,
                    "None or an int >= 0 (-1, full-vocabulary logprobs, is not supported)",
                )
            if value is not None:
                _check_int(name, value, minimum=0, none_ok=True)
        if self.seed is not None and (
            not _is_int(self.seed) or not _SEED_MIN <= self.seed < _SEED_END
        ):
            raise _fail("seed", self.seed, "None or an int in [-2**63, 2**64)")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise _fail("stop", self.stop, "non-empty strings only")
        if self.stop and not self.detokenize:
            raise _fail("stop", self.stop, "stop strings need detokenize=True")
        for tok in self.stop_token_ids:
            if not _is_int(tok) or tok < 0:
                raise _fail("stop_token_ids", self.stop_token_ids, "ints >= 0 only")
        for name in (
            "ignore_eos",
            "detokenize",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "include_stop_str_in_output",
        ):
            if not isinstance(getattr(self, name), bool):
                raise _fail(name, getattr(self, name), "True or False")

    def verify(self, vocab_size: int, max_logprobs: int) -> None:
        """The checks that need the engine: token ids inside the vocabulary and the logprobs
        counts within the engine's limit (vLLM `SamplingParams.verify`).

        Raises:
            ValueError: naming the field, the value and the allowed range.
        """
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise _fail(
                "stop_token_ids",
                self.stop_token_ids,
                f"ids {bad} are outside the vocabulary [0, {vocab_size})",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > max_logprobs:
                raise _fail(name, value, f"at most max_logprobs={max_logprobs}")

    @property
    def sampling_type(self) -> SamplingType:
        """GREEDY below temperature 1e-5, else RANDOM_SEED with a seed, else RANDOM."""
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def is_greedy(self) -> bool:
        """The next token is the argmax of the (penalised) logits."""
        return self.sampling_type == SamplingType.GREEDY

    @property
    def uses_penalties(self) -> bool:
        """Any of the presence, frequency or repetition penalties is on."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def all_stop_token_ids(self, eos_token_id: int | None) -> list[int]:
        """The token ids that end this request's output: EOS (unless ignore_eos) and
        stop_token_ids, as vLLM's stop check (`v1/core/sched/utils.check_stop`) uses them."""
        eos = [] if self.ignore_eos or eos_token_id is None else [eos_token_id]
        return list(dict.fromkeys(eos + self.stop_token_ids))

    def min_tokens_stop_ids(self, eos_token_id: int | None) -> list[int]:
        """The token ids masked while fewer than min_tokens outputs exist: EOS and
        stop_token_ids. vLLM adds EOS here even with ignore_eos (its ``_all_stop_token_ids``,
        filled by `update_from_generation_config`, which the min-tokens processor reads)."""
        eos = [] if eos_token_id is None else [eos_token_id]
        return list(dict.fromkeys(eos + self.stop_token_ids))


def _check_keywords(kwargs: dict[str, object]) -> None:
    names = [f.name for f in dataclasses.fields(SamplingParams)] + ["best_of"]
    for key, value in kwargs.items():
        check_keyword(key, value, names, VLLM_ONLY_SAMPLING, "sampling parameter")


def check_keyword(
    key: str, value: object, names: list[str], vllm_only: dict[str, str], kind: str
) -> None:
    """Refuse a keyword of vLLM's that is not taken here (``vllm_only``: its name -> what to
    use instead) or one not in ``names`` (naming the closest); ``kind``: "sampling parameter",
    "engine argument".

    Raises:
        TypeError: naming the keyword and what to use instead, or the closest names.
    """
    if key in vllm_only:
        raise TypeError(f"{key}={value!r} (a vLLM {kind}) is not supported here: {vllm_only[key]}")
    if key not in names:
        close = difflib.get_close_matches(key, names, n=3)
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise TypeError(f"unknown {kind} {key!r}{hint}")


def _check_int(name: str, value: object, *, minimum: int, none_ok: bool = False) -> None:
    if not _is_int(value) or value < minimum:
        allowed = f"an int >= {minimum}"
        raise _fail(name, value, f"None or {allowed}" if none_ok else allowed)
