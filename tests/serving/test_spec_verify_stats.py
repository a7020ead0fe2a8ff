"""Speculative verification as a sampler: the distribution of what it emits, and batches that
drain while drafting.

`serving.runner._verify` draws every verified position with the sampler (the key of its
position) and accepts drafts while they equal the drawn token. For deterministic drafts (n-gram
lookup, a greedy drafter) that is the speculative-sampling rule: a draft x is accepted with
probability p(x), and after a rejection the emitted token follows p without x. The tests below
check the emitted distribution against the target's probabilities written out in numpy, and
against the plain sampler run on other seeds (chi-square, seeded, so the outcome is fixed), for
a drafter that agrees often and one that never agrees.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.stats import chi2

from serving import SamplingParams
from serving import sampler as S
from serving.runner import SpecBatch, _verify
from tests.serving.engine_testing import Arrival, assert_pool_is_whole, drive, make_engine

ALPHA = 1e-3  # significance of every chi-square test here
V = 6  # the tiny vocabulary
K = 2  # drafts per row
N = 20_000  # rows (independent draws) per run

# the target's logits at the row's 1 + K positions (position j: after the drafts before it)
LOGITS = np.log(
    np.array(
        [
            [0.05, 0.50, 0.20, 0.10, 0.10, 0.05],
            [0.30, 0.05, 0.40, 0.05, 0.15, 0.05],
            [0.10, 0.10, 0.10, 0.30, 0.20, 0.20],
        ]
    )
)


def _processed_probs(logits: np.ndarray, temperature: float, top_k: int) -> np.ndarray:
    """The distribution a row samples from (temperature, then top-k), in float64 numpy."""
    x = logits / temperature
    if 0 < top_k < x.shape[-1]:
        kth = np.sort(x, axis=-1)[..., -top_k][..., None]
        x = np.where(x < kth, -np.inf, x)
    p = np.exp(x - x.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True)


def _outcomes(drafts: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every token sequence a verification can emit: drafts accepted up to some position, then
    one drawn token that differs from the next draft (or any token past the last draft)."""
    out = []
    for a in range(K + 1):
        for t in range(V):
            if a < K and t == drafts[a]:
                continue
            out.append((*drafts[:a], t))
    return out


def _expected(p: np.ndarray, drafts: tuple[int, ...]) -> np.ndarray:
    """P(outcome) of the plain sampler, token by token: p[j] is the distribution of position j
    given that the tokens before it are the drafts (the only case in which it is emitted)."""
    probs = []
    for seq in _outcomes(drafts):
        probs.append(np.prod([p[j, t] for j, t in enumerate(seq)]))
    return np.array(probs)


def _sampling(seeds: np.ndarray, temperature: float, top_k: int) -> S.SamplingBatch:
    params = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=K + 1)
    rows = [
        S.RowSampling(params, S.key_data_for_seed(int(s)), counter=7, slot=i)
        for i, s in enumerate(seeds)
    ]
    return S.build_sampling_batch(rows, len(rows), padding_slot=len(rows))


@jax.jit
def _spec_run(h, drafts, logits_indices, sampling, spec, state):
    params = {"head.weight": jnp.eye(V, dtype=jnp.float32)}  # logits = hidden states
    n = logits_indices.shape[0]
    # the step's tokens: row r's drafts follow its first verified position
    token_ids = jnp.tile(jnp.concatenate([jnp.zeros((1,), jnp.int32), drafts]), n)
    no = jnp.zeros((n,), jnp.int32)
    outs, accepted, _ = _verify(
        params, h, token_ids, logits_indices, sampling, spec, no, no == 0, state,
        num_spec=K, num_logprobs=0,
    )  # fmt: skip
    return outs.token_ids, accepted


def _speculative(drafts, seeds, temperature, top_k) -> list[tuple[int, ...]]:
    """What `_verify` emits for N rows that all draft ``drafts`` (row r: its own seed)."""
    n = len(seeds)
    h = jnp.asarray(np.tile(LOGITS, (n, 1)), jnp.float32)  # row r's 1 + K rows, in order
    logits_indices = jnp.arange(n, dtype=jnp.int32) * (K + 1) + K
    spec = SpecBatch(
        num_drafts=jnp.full((n,), K, jnp.int32),
        min_tokens_left=jnp.zeros((n,), jnp.int32),
        shifted=jnp.zeros((n,), bool),
        engram_history=jnp.full((n, K), -1, jnp.int32),
        guess=jnp.full((n,), -1, jnp.int32),
        guess_rejected=jnp.zeros((n,), jnp.int32),
    )
    sampling = jax.tree.map(jnp.asarray, _sampling(seeds, temperature, top_k))
    state = S.init_state(n + 1, V)
    drafts = jnp.asarray(drafts, jnp.int32)
    tokens, accepted = _spec_run(h, drafts, logits_indices, sampling, spec, state)
    tokens, accepted = np.asarray(tokens), np.asarray(accepted)
    return [tuple(tokens[r, : accepted[r] + 1]) for r in range(n)]


@jax.jit
def _plain_position(logits, sampling, state):
    out, _ = S.sample(logits, sampling, state, num_logprobs=0)
    return out.token_ids


def _plain(drafts, seeds, temperature, top_k) -> list[tuple[int, ...]]:
    """Plain decoding, one position per step (counter + j), stopped at the first token that is
    not the draft: the same random variable as the speculative emission."""
    n = len(seeds)
    base = _sampling(seeds, temperature, top_k)
    state = S.init_state(n + 1, V)
    drawn = []
    for j in range(K + 1):
        sampling = dataclasses.replace(base, counter=base.counter + j)
        sampling = jax.tree.map(jnp.asarray, sampling)
        logits = jnp.asarray(np.tile(LOGITS[j], (n, 1)), jnp.float32)
        drawn.append(np.asarray(_plain_position(logits, sampling, state)))
    out = []
    for r in range(n):
        seq = []
        for j in range(K + 1):
            seq.append(int(drawn[j][r]))
            if j == K or seq[-1] != drafts[j]:
                break
        out.append(tuple(seq))
    return out


def _counts(samples, outcomes) -> np.ndarray:
    index = {o: i for i, o in enumerate(outcomes)}
    counts = np.zeros(len(outcomes))
    for s in samples:
        counts[index[s]] += 1  # a KeyError: an outcome verification must never emit
    return counts


def _goodness_of_fit(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of Pearson's chi-square of counts against probs (zero-probability outcomes
    must have zero counts; they carry no degree of freedom)."""
    assert np.all(counts[probs == 0] == 0), "an outcome of probability 0 was emitted"
    keep = probs > 0
    expected = probs[keep] * counts.sum()
    stat = float(np.sum((counts[keep] - expected) ** 2 / expected))
    return float(chi2.sf(stat, keep.sum() - 1))


def _homogeneity(a: np.ndarray, b: np.ndarray) -> float:
    """p-value of the two-sample chi-square test that a and b come from one distribution."""
    keep = (a + b) > 0
    table = np.stack([a[keep], b[keep]])
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    stat = float(np.sum((table - expected) ** 2 / expected))
    return float(chi2.sf(stat, keep.sum() - 1))


# temperature 0.9 and top-k 4: tokens 0 and 5 can never be drawn at position 0
DRAFTERS = {
    "agrees_often": (1, 2),  # the most likely token at both positions
    "never_agrees": (0, 2),  # outside position 0's top-k: always rejected
}


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_speculative_emission_has_the_target_distribution(drafter):
    drafts = DRAFTERS[drafter]
    temperature, top_k = 0.9, 4
    p = _processed_probs(LOGITS, temperature, top_k)
    outcomes = _outcomes(drafts)
    expected = _expected(p, drafts)
    assert expected.sum() == pytest.approx(1.0)

    rng = np.random.default_rng(0)
    seeds = rng.integers(0, 2**31, 2 * N)
    spec = _counts(_speculative(drafts, seeds[:N], temperature, top_k), outcomes)
    plain = _counts(_plain(drafts, seeds[N:], temperature, top_k), outcomes)

    assert _goodness_of_fit(spec, expected) > ALPHA
    assert _goodness_of_fit(plain, expected) > ALPHA
    assert _homogeneity(spec, plain) > ALPHA
    accepted = spec[[len(o) > 1 for o in outcomes]].sum() / N
    if drafter == "agrees_often":  # P(accept draft 0) = p[0, 1]
        assert accepted == pytest.approx(p[0, 1], abs=0.02) and accepted > 0.5
    else:
        assert accepted == 0.0


def test_same_seeds_give_the_plain_samplers_tokens():
    """Not only the same distribution: with the same keys verification emits exactly the
    tokens plain decoding draws, row by row."""
    seeds = np.arange(2000)
    for drafts in DRAFTERS.values():
        assert _speculative(drafts, seeds, 0.9, 4) == _plain(drafts, seeds, 0.9, 4)


def test_the_chi_square_tests_can_fail():
    """The statistics reject what they must: a sampler that ignores top-k, and counts from
    another distribution."""
    drafts = DRAFTERS["agrees_often"]
    p = _processed_probs(LOGITS, 0.9, 4)
    seeds = np.random.default_rng(1).integers(0, 2**31, N)
    wrong = _counts(_speculative(drafts, seeds, 0.9, 0), _outcomes(drafts))
    with pytest.raises(AssertionError, match="probability 0"):
        _goodness_of_fit(wrong, _expected(p, drafts))
    hotter = _counts(_speculative(drafts, seeds, 1.3, 4), _outcomes(drafts))
    assert _goodness_of_fit(hotter, _expected(p, drafts)) < ALPHA
    right = _counts(_speculative(drafts, seeds, 0.9, 4), _outcomes(drafts))
    assert _homogeneity(right, hotter) < ALPHA


# -- batches that drain while drafting (vllm#51593) ----------------------------------------------


class _Continuation:
    """A drafter that knows each prompt's plain continuation and proposes its next k tokens,
    with the last one wrong on every third proposal (so rejections happen too)."""

    def __init__(self, arrivals, finals, k):
        self.known = {a.prompt: finals[a.request_id].outputs[0].token_ids for a in arrivals}
        self.k, self.calls = k, itertools.count()

    def propose(self, tokens):
        for prompt, out in self.known.items():
            if tuple(tokens[: len(prompt)]) == prompt and len(tokens) - len(prompt) <= len(out):
                done = len(tokens) - len(prompt)
                draft = list(out[done : done + self.k]) or [3]
                if next(self.calls) % 3 == 0:
                    draft[-1] = (draft[-1] + 1) % 50 + 3
                return draft
        return []


def test_batches_draining_to_three_one_and_zero_while_drafting(tiny_params, tiny_cfg):
    """Four requests drain to 3, to 1 and to 0 while every running request drafts; steps run on
    an empty engine; then a second wave arrives and drains the same way. Outputs equal plain
    decoding, nothing hangs, every block is free at the end."""
    rng = random.Random(5)
    arrivals = []
    waves = [(0, (6, 24, 24, 40)), (70, (5, 18, 18, 30))]
    for w, (step, lengths) in enumerate(waves):
        for i, n in enumerate(lengths):
            prompt = tuple(rng.randrange(3, tiny_cfg.vocab_size) for _ in range(5 + 3 * i))
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            arrivals.append(Arrival(step, f"w{w}r{i}", prompt, params))
    plain_engine = make_engine(tiny_params, tiny_cfg, async_scheduling=False)
    plain, _ = drive(plain_engine, arrivals)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    engine = make_engine(tiny_params, tiny_cfg, async_scheduling=False, speculative_config=spec)
    engine.proposer = _Continuation(arrivals, plain, 3)
    fast, running = drive(engine, arrivals, max_steps=200)
    assert {rid: o.outputs[0].token_ids for rid, o in fast.items()} == {
        rid: o.outputs[0].token_ids for rid, o in plain.items()
    }
    assert all(
        len(fast[a.request_id].outputs[0].token_ids) == a.params.max_tokens for a in arrivals
    )
    # the run did drain through 3 and 1 to 0, and idled empty before the second wave
    first, second = running[:70], running[70:]
    for wave in (first, second):
        assert {3, 1}.issubset(wave), running
    assert first[-1] == 0 and second[-1] == 0, running
    st = engine.stats
    assert (
        st.spec_num_accepted_tokens > 0 and st.spec_num_accepted_tokens < st.spec_num_draft_tokens
    )
    assert_pool_is_whole(engine)
