"""The on-device sampler: one token per request row, with per-request parameters (vLLM v1).

`sample` follows vLLM v1's `Sampler.forward` in its order (raw logprobs, min_tokens, penalties,
greedy or temperature / min-p / top-k / top-p and a Gumbel-max draw); it is a pure function, and
each row's key makes its token independent of the rest of the batch; per-request counts and masks
live on device in `SamplerState`. Steps, state, one deviation: docs/serving.md#servingsampler.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from serving.sampling_params import SAMPLING_EPS, SamplingParams

__all__ = [
    "RowSampling",
    "SamplerOutput",
    "SamplerState",
    "SamplingBatch",
    "SlotSampling",
    "build_sampling_batch",
    "init_state",
    "key_data_for_seed",
    "logprobs_of",
    "no_logprobs",
    "sample",
    "slot_rows",
    "write_slots",
]

_PRNG_IMPL = "threefry2x32"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters of one step (numpy on the host, jax on device).

    R is the padded request count; padding rows have ``samples`` False and the padding slot.
    """

    temperature: Any  # f32[R] < 1e-5 = greedy
    top_k: Any  # i32[R] <= 0 (or >= V) = off
    top_p: Any  # f32[R] 1.0 = off
    min_p: Any  # f32[R] 0.0 = off
    presence_penalty: Any  # f32[R]
    frequency_penalty: Any  # f32[R]
    repetition_penalty: Any  # f32[R] 1.0 = off
    key_data: Any  # u32[R, 2] the row's threefry key data (`key_data_for_seed`)
    counter: Any  # i32[R] folded into the row's key (the position of the sampled token)
    slot: Any  # i32[R] row -> persistent slot of SamplerState (padding: the last slot)
    suppress_stop: Any  # bool[R] min_tokens not reached: the slot's stop tokens get -inf
    samples: Any  # bool[R] the row produces a token this step
    # bool[R] the row returns its sampled tokens' logprobs (its params ask for them): when no
    # sampling row does, `sample` skips the log-softmax, rank and top-k (their outputs are 0)
    logprobs: Any

    @property
    def num_rows(self) -> int:
        """R (the request bucket)."""
        return self.temperature.shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerState:
    """Per-slot sampler state kept on device across steps; S = max_num_seqs + 1, the last slot
    being the padding slot (never written by a real request, never read by a sampling row)."""

    output_counts: Any  # i32[S, V] times each token was sampled so far (presence, frequency)
    prompt_mask: Any  # bool[S, V] tokens of the prompt (repetition covers prompt + outputs)
    stop_mask: Any  # bool[S, V] EOS + stop_token_ids, masked until min_tokens outputs exist


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    """What `sample` returns for every row (rows that do not sample: token 0, ignored). The
    logprob fields are 0 in a step where no sampling row asks for logprobs."""

    token_ids: Any  # i32[R] sampled tokens
    logprob: Any  # f32[R] raw logprob of the sampled token
    rank: Any  # i32[R] tokens whose raw logprob >= the sampled one's (1 = most likely)
    top_ids: Any  # i32[R, L] the L most likely tokens by raw logprob
    top_logprobs: Any  # f32[R, L] their raw logprobs


@dataclasses.dataclass(frozen=True, slots=True)
class RowSampling:
    """One request row of a step, as the engine describes it to `build_sampling_batch`.

    ``counter`` is what makes successive draws of a request differ (the engine passes the
    position of the token sampled); ``suppress_stop`` is ``num_output_tokens < min_tokens``.
    """

    params: SamplingParams
    key_data: np.ndarray  # u32[2] from `key_data_for_seed`
    counter: int
    slot: int
    suppress_stop: bool = False
    samples: bool = True


# ---------------------------------------------------------------------------------- host side


def key_data_for_seed(seed: int) -> np.ndarray:
    """u32[2] threefry key data of ``jax.random.PRNGKey(seed)`` with 64-bit seeds.

    The key is the seed's 64 bits (two's complement; seeds in [2**63, 2**64) are taken as
    their uint64 bit pattern), high word first: what JAX computes with ``jax_enable_x64``. With
    x64 off JAX keeps only the low 32 bits, so the two agree for seeds in [0, 2**32).
    """
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise ValueError(f"seed={seed!r} is not allowed: an int")
    seed = int(seed)
    if not -(2**63) <= seed < 2**64:
        raise ValueError(f"seed={seed} is not allowed: an int in [-2**63, 2**64)")
    bits = seed % 2**64
    return np.array([bits >> 32, bits & 0xFFFFFFFF], np.uint32)


def slot_rows(
    vocab_size: int,
    params: SamplingParams,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
    eos_token_id: int | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A request's rows of `SamplerState` for `write_slots` when it (re)enters a slot: output
    counts i32[V], prompt mask and stop mask bool[V] (EOS, even with ignore_eos as vLLM's
    min_tokens, and stop_token_ids). A token id outside [0, V) raises ValueError naming it.

    Args:
        vocab_size, params: V, and the request's sampling parameters.
        prompt_token_ids, output_token_ids: its prompt, and what it has generated so far.
        eos_token_id: the tokenizer's EOS, or None.
    """
    prompt = _token_array("prompt_token_ids", prompt_token_ids, vocab_size)
    outputs = _token_array("output_token_ids", output_token_ids, vocab_size)
    stops = _token_array("stop tokens", params.min_tokens_stop_ids(eos_token_id), vocab_size)
    counts = np.bincount(outputs, minlength=vocab_size).astype(np.int32)
    prompt_mask = np.zeros(vocab_size, bool)
    prompt_mask[prompt] = True
    stop_mask = np.zeros(vocab_size, bool)
    stop_mask[stops] = True
    return counts, prompt_mask, stop_mask


def _token_array(name: str, ids: Sequence[int], vocab_size: int) -> np.ndarray:
    arr = np.asarray(ids, np.int64).reshape(-1)
    bad = arr[(arr < 0) | (arr >= vocab_size)]
    if bad.size:
        raise ValueError(f"{name}: token ids {bad[:8].tolist()} outside [0, {vocab_size})")
    return arr


def build_sampling_batch(
    rows: Sequence[RowSampling], num_rows_padded: int, padding_slot: int
) -> SamplingBatch:
    """The step's `SamplingBatch` (numpy), rows in order, padded to ``num_rows_padded`` with
    rows that do not sample (greedy, no penalties, the padding slot). One pass over the rows:
    each dtype's columns are the rows of one array."""
    if len(rows) > num_rows_padded:
        raise ValueError(f"{len(rows)} rows do not fit num_rows_padded={num_rows_padded}")
    n, r = len(rows), num_rows_padded
    floats = np.empty((6, r), np.float32)
    floats[:, n:] = _FLOAT_PADDING
    ints = np.empty((3, r), np.int32)
    ints[:, n:] = [[0], [0], [padding_slot]]
    flags = np.zeros((3, r), bool)
    key_data = np.zeros((r, 2), np.uint32)
    if n:
        params = [row.params for row in rows]
        floats[:, :n] = np.array(
            [
                (p.temperature, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty,
                 p.repetition_penalty)
                for p in params
            ],
            np.float32,
        ).T  # fmt: skip
        ints[:, :n] = np.array(
            [(max(p.top_k, 0), row.counter, row.slot) for p, row in zip(params, rows)], np.int32
        ).T
        flags[:, :n] = np.array(
            [
                (row.suppress_stop, row.samples, p.logprobs is not None)
                for p, row in zip(params, rows)
            ],
            bool,
        ).T
        key_data[:n] = [row.key_data for row in rows]
    return SamplingBatch(
        temperature=floats[0],
        top_k=ints[0],
        top_p=floats[1],
        min_p=floats[2],
        presence_penalty=floats[3],
        frequency_penalty=floats[4],
        repetition_penalty=floats[5],
        key_data=key_data,
        counter=ints[1],
        slot=ints[2],
        suppress_stop=flags[0],
        samples=flags[1],
        logprobs=flags[2],
    )


# padding rows: greedy, no top-p / min-p, no penalties (repetition 1.0)
_FLOAT_PADDING = np.array([[0.0], [1.0], [0.0], [0.0], [0.0], [1.0]], np.float32)


class SlotSampling:
    """Each slot's sampling parameters on the host, written when a request enters its slot
    (vLLM's persistent batch): a step's `SamplingBatch` gathers its rows' slots in one index
    per array instead of reading every row's parameters (`build_sampling_batch`'s values).
    Slots never written hold a padding row's (greedy, no penalties, zero key)."""

    def __init__(self, num_slots: int) -> None:
        self._floats = np.repeat(_FLOAT_PADDING, num_slots, axis=1)  # [6, S] build's order
        self._top_k = np.zeros(num_slots, np.int32)
        self._key_data = np.zeros((num_slots, 2), np.uint32)
        self._logprobs = np.zeros(num_slots, bool)

    def write(self, slot: int, params: SamplingParams, key_data: np.ndarray) -> None:
        """``slot``'s parameters from now on: ``params`` and its key (u32[2])."""
        p = params
        self._floats[:, slot] = (p.temperature, p.top_p, p.min_p, p.presence_penalty,
                                 p.frequency_penalty, p.repetition_penalty)  # fmt: skip
        self._top_k[slot] = max(p.top_k, 0)
        self._key_data[slot] = key_data
        self._logprobs[slot] = p.logprobs is not None

    def batch(self, slots: Sequence[int], counters: Sequence[int], flags) -> SamplingBatch:
        """The `SamplingBatch` of rows reading ``slots`` (one per row; the caller gives each
        padding row, after the real ones, the padding slot, never written), with the real
        rows' ``counters`` and ``flags`` (per row ``(suppress_stop, samples)``; padding rows:
        0, and False for both)."""
        r, n = len(slots), len(counters)
        index = np.array(slots, np.int32)
        floats = np.take(self._floats, index, axis=1)
        counter = np.zeros(r, np.int32)
        counter[:n] = counters
        flag_rows = np.zeros((2, r), bool)
        if n:
            flag_rows[:, :n] = np.array(flags, bool).T
        return SamplingBatch(
            temperature=floats[0],
            top_k=np.take(self._top_k, index),
            top_p=floats[1],
            min_p=floats[2],
            presence_penalty=floats[3],
            frequency_penalty=floats[4],
            repetition_penalty=floats[5],
            key_data=np.take(self._key_data, index, axis=0),
            counter=counter,
            slot=index,
            suppress_stop=flag_rows[0],
            samples=flag_rows[1],
            logprobs=np.take(self._logprobs, index),
        )


# -------------------------------------------------------------------------------- device side


def init_state(num_slots: int, vocab_size: int) -> SamplerState:
    """An empty `SamplerState` of S = num_slots rows (zero counts, empty masks)."""
    return SamplerState(
        output_counts=jnp.zeros((num_slots, vocab_size), jnp.int32),
        prompt_mask=jnp.zeros((num_slots, vocab_size), bool),
        stop_mask=jnp.zeros((num_slots, vocab_size), bool),
    )


def write_slots(
    state: SamplerState,
    slots: jax.Array,  # i32[K] distinct slots
    output_counts: jax.Array,  # i32[K, V]
    prompt_mask: jax.Array,  # bool[K, V]
    stop_mask: jax.Array,  # bool[K, V]
) -> SamplerState:
    """``state`` with rows ``slots`` replaced (jittable; donate ``state`` to update in place)."""
    return SamplerState(
        output_counts=state.output_counts.at[slots].set(output_counts.astype(jnp.int32)),
        prompt_mask=state.prompt_mask.at[slots].set(prompt_mask.astype(bool)),
        stop_mask=state.stop_mask.at[slots].set(stop_mask.astype(bool)),
    )


def logprobs_of(
    logits: jax.Array,  # f32[N, V]
    target_ids: jax.Array,  # i32[N]
    num_logprobs: int,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Raw logprobs (log_softmax) of ``target_ids`` and the top ``num_logprobs`` tokens, for
    sampled tokens and prompt tokens alike (vLLM `Sampler.gather_logprobs`).

    Returns:
        logprob f32[N] of each target; rank i32[N], the number of tokens whose logprob is >=
        the target's (vLLM's `batched_count_greater_than`: 1 = most likely); top_ids i32[N, L]
        and top_logprobs f32[N, L], the L = num_logprobs most likely tokens (L may be 0).
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    target = jnp.take_along_axis(logp, target_ids[:, None].astype(jnp.int32), axis=-1)
    rank = jnp.sum(logp >= target, axis=-1, dtype=jnp.int32)
    if num_logprobs > 0:
        top_logprobs, top_ids = jax.lax.top_k(logp, num_logprobs)
    else:
        top_logprobs = jnp.zeros((logp.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((logp.shape[0], 0), jnp.int32)
    return target[:, 0], rank, top_ids.astype(jnp.int32), top_logprobs


def no_logprobs(n: int, num_logprobs: int) -> tuple[jax.Array, ...]:
    """`logprobs_of`'s outputs for ``n`` rows, all 0: what a step returns when nobody reads
    them."""
    return (
        jnp.zeros((n,), jnp.float32),
        jnp.zeros((n,), jnp.int32),
        jnp.zeros((n, num_logprobs), jnp.int32),
        jnp.zeros((n, num_logprobs), jnp.float32),
    )


def sample(
    logits: jax.Array,  # f32[R, V] (any float dtype)
    batch: SamplingBatch,
    state: SamplerState,
    *,
    num_logprobs: int,
) -> tuple[SamplerOutput, SamplerState]:
    """One token per row of ``logits`` under each row's parameters, in vLLM v1's order
    (docs/serving.md); returns (SamplerOutput, the new SamplerState, each token counted in its
    slot).

    Args:
        logits: the model's logits of the rows' last tokens.
        batch: per-row parameters (rows with ``samples`` False: token 0, state untouched).
        state: the per-slot state (donate it: only ``output_counts`` changes).
        num_logprobs: L, static: top logprobs returned per row (0 = only the sampled token's).
    """
    raw = logits.astype(jnp.float32)
    samples = batch.samples.astype(bool)
    greedy = batch.temperature < SAMPLING_EPS
    processed = _apply_penalties(
        _mask_stop_tokens(raw, batch, state, samples), batch, state, samples
    )
    tokens = jnp.argmax(processed, axis=-1).astype(jnp.int32)
    tokens = jax.lax.cond(
        jnp.any(samples & ~greedy),
        lambda: jnp.where(greedy, tokens, _sample_random(processed, batch, samples & ~greedy)),
        lambda: tokens,
    )
    tokens = jnp.where(samples, tokens, 0)
    logprob, rank, top_ids, top_logprobs = jax.lax.cond(
        jnp.any(samples & batch.logprobs.astype(bool)),
        lambda: logprobs_of(raw, tokens, num_logprobs),
        lambda: no_logprobs(tokens.shape[0], num_logprobs),
    )
    counts = state.output_counts.at[batch.slot, tokens].add(samples.astype(jnp.int32))
    out = SamplerOutput(tokens, logprob, rank, top_ids, top_logprobs)
    return out, dataclasses.replace(state, output_counts=counts)


def _mask_stop_tokens(
    logits: jax.Array, batch: SamplingBatch, state: SamplerState, samples: jax.Array
) -> jax.Array:
    """min_tokens: -inf on the stop tokens of rows below their min_tokens (f32[R, V])."""
    rows = samples & batch.suppress_stop

    def masked():
        return jnp.where(state.stop_mask[batch.slot] & rows[:, None], -jnp.inf, logits)

    return jax.lax.cond(jnp.any(rows), masked, lambda: logits)


def _apply_penalties(
    logits: jax.Array, batch: SamplingBatch, state: SamplerState, samples: jax.Array
) -> jax.Array:
    """Repetition, frequency and presence penalties, vLLM's `apply_penalties` (f32[R, V])."""
    rep = batch.repetition_penalty[:, None]
    freq = batch.frequency_penalty[:, None]
    pres = batch.presence_penalty[:, None]
    rows = samples & ((rep[:, 0] != 1.0) | (freq[:, 0] != 0.0) | (pres[:, 0] != 0.0))

    def penalised():
        counts = state.output_counts[batch.slot]  # i32[R, V]
        seen = counts > 0
        repeated = state.prompt_mask[batch.slot] | seen
        x = jnp.where(repeated, jnp.where(logits > 0, logits / rep, logits * rep), logits)
        x = x - freq * counts.astype(jnp.float32)
        return x - pres * seen.astype(jnp.float32)

    # Neutral rows pass through unchanged bit for bit (x / 1, x * 1, x - 0), so the branch a
    # batch takes never changes another row's token.
    return jax.lax.cond(jnp.any(rows), penalised, lambda: logits)


def _sample_random(logits: jax.Array, batch: SamplingBatch, rows: jax.Array) -> jax.Array:
    """Temperature, min_p, top-k / top-p and a Gumbel-max draw per row (i32[R]); ``rows``
    (bool[R]) are the random rows that sample, the only ones whose needs trigger work."""
    vocab = logits.shape[-1]
    temperature = jnp.where(batch.temperature < SAMPLING_EPS, 1.0, batch.temperature)
    x = logits / temperature[:, None]
    min_p = batch.min_p[:, None]
    x = jax.lax.cond(jnp.any(rows & (batch.min_p > 0.0)), lambda: _min_p(x, min_p), lambda: x)
    top_k_on = (batch.top_k > 0) & (batch.top_k < vocab)
    x = jax.lax.cond(
        jnp.any(rows & (top_k_on | (batch.top_p < 1.0))),
        lambda: _top_k_top_p(x, jnp.where(top_k_on, batch.top_k, vocab), batch.top_p),
        lambda: x,
    )
    noise = jax.vmap(_gumbel, in_axes=(0, 0, None))(batch.key_data, batch.counter, vocab)
    return jnp.argmax(x + noise, axis=-1).astype(jnp.int32)


def _gumbel(key_data: jax.Array, counter: jax.Array, vocab: int) -> jax.Array:
    """f32[V] standard Gumbel noise of one row's key folded with its counter."""
    key = jax.random.fold_in(jax.random.wrap_key_data(key_data, impl=_PRNG_IMPL), counter)
    return jax.random.gumbel(key, (vocab,), jnp.float32)


def _min_p(x: jax.Array, min_p: jax.Array) -> jax.Array:
    """Drop tokens whose probability is below min_p times the row's largest (vLLM
    `MinPLogitsProcessor`); ``x`` f32[R, V] after temperature, ``min_p`` f32[R, 1]."""
    probs = jax.nn.softmax(x, axis=-1)
    return jnp.where(probs < min_p * jnp.max(probs, axis=-1, keepdims=True), -jnp.inf, x)


def _top_k_top_p(x: jax.Array, k: jax.Array, p: jax.Array) -> jax.Array:
    """vLLM's `apply_top_k_top_p` as value thresholds (f32[R, V]; ``k`` i32[R] in [1, V],
    V = off; ``p`` f32[R], 1 = off).

    Top-k keeps values >= the k-th largest (ties kept); top-p then drops the survivors whose
    cumulative probability from the smallest is <= 1 - p (never the most likely). Each kept set is
    "values >= a threshold", so nothing sorted is scattered back.
    """
    vocab = x.shape[-1]
    ascending = jnp.sort(x, axis=-1)
    kth = jnp.take_along_axis(ascending, (vocab - k)[:, None], axis=-1)  # f32[R, 1]
    ascending = jnp.where(ascending < kth, -jnp.inf, ascending)
    cumulative = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1)
    drop = (cumulative <= 1.0 - p[:, None]) & (p < 1.0)[:, None]
    drop = drop.at[:, -1].set(False)
    first_kept = jnp.argmin(drop, axis=-1)  # drop is a prefix: the first False
    cutoff = jnp.take_along_axis(ascending, first_kept[:, None], axis=-1)
    return jnp.where(x < jnp.maximum(kth, cutoff), -jnp.inf, x)
