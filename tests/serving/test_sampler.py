"""The on-device sampler against an independent float64 numpy reference of vLLM v1's rules.

Random rows are checked two ways: exactly, by reproducing the row's Gumbel noise (the key is
part of the contract: ``fold_in(wrap_key_data(key_data), counter)``) and taking the argmax of
the reference's processed logits plus that noise; and statistically, by a chi-square test of
many keys against the reference distribution (fixed keys, so it cannot flake).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from serving.sampler import (
    RowSampling,
    SamplerState,
    SlotSampling,
    build_sampling_batch,
    init_state,
    key_data_for_seed,
    logprobs_of,
    sample,
    slot_rows,
    write_slots,
)
from serving.sampling_params import SamplingParams

SAMPLE = jax.jit(sample, static_argnames="num_logprobs")
NUM_SLOTS = 5  # 4 real slots + the padding slot
PAD = NUM_SLOTS - 1


# ------------------------------------------------------------------------- numpy reference


def ref_softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - np.max(x))
    return e / e.sum()


def ref_penalised(logits, p: SamplingParams, counts, prompt, stop, suppress):
    """min_tokens then vLLM's penalties, float64, one row."""
    x = np.asarray(logits, np.float64).copy()
    if suppress:
        x[stop] = -np.inf
    seen = counts > 0
    rp = p.repetition_penalty
    rep = np.where(x > 0, x / rp, x * rp)
    x = np.where(prompt | seen, rep, x)
    return x - p.frequency_penalty * counts - p.presence_penalty * seen


def ref_filtered(x, p: SamplingParams):
    """Temperature, min_p, top-k, top-p (vLLM's literal sorted-position rule), float64."""
    x = np.asarray(x, np.float64) / p.temperature
    v = x.shape[0]
    probs = ref_softmax(x)
    if p.min_p > 0:
        x[probs < p.min_p * probs.max()] = -np.inf
    if 0 < p.top_k < v:
        kth = np.sort(x)[::-1][p.top_k - 1]
        x[x < kth] = -np.inf
    if p.top_p < 1:
        order = np.argsort(x, kind="stable")
        cum = np.cumsum(ref_softmax(x[order]))
        drop = cum <= 1 - p.top_p
        drop[-1] = False
        x[order[drop]] = -np.inf
    return x


def ref_margin(x, p: SamplingParams):
    """How far the row is from any float decision boundary of the reference (min_p, top-k,
    top-p): exact comparisons are only asserted when this is comfortably positive."""
    x = np.asarray(x, np.float64) / p.temperature
    margins = [np.inf]
    probs = ref_softmax(x)
    if p.min_p > 0:
        margins.append(np.min(np.abs(probs - p.min_p * probs.max())) / probs.max())
        x = np.where(probs < p.min_p * probs.max(), -np.inf, x)
    finite = np.sort(x[np.isfinite(x)])[::-1]
    if 0 < p.top_k < finite.size:
        margins.append(finite[p.top_k - 1] - finite[p.top_k])
    if 0 < p.top_k < x.shape[0]:
        x = np.where(x < np.sort(x)[::-1][p.top_k - 1], -np.inf, x)
    if p.top_p < 1:
        cum = np.cumsum(ref_softmax(np.sort(x)))
        margins.append(np.min(np.abs(cum[:-1] - (1 - p.top_p))) if cum.size > 1 else np.inf)
    return min(margins)


def gumbel_noise(key_data, counter, vocab):
    key = jax.random.fold_in(jax.random.wrap_key_data(jnp.asarray(key_data, jnp.uint32)), counter)
    return np.asarray(jax.random.gumbel(key, (vocab,), jnp.float32), np.float64)


def ref_token(logits, row: RowSampling, counts, prompt, stop):
    x = ref_penalised(logits, row.params, counts, prompt, stop, row.suppress_stop)
    if row.params.temperature < 1e-5:
        return int(np.argmax(x))
    y = ref_filtered(x, row.params) + gumbel_noise(row.key_data, row.counter, x.shape[0])
    return int(np.argmax(y))


# ------------------------------------------------------------------------------- helpers


def row(params=None, seed=0, counter=0, slot=0, suppress_stop=False, samples=True, **kw):
    params = params or SamplingParams(**kw)
    return RowSampling(params, key_data_for_seed(seed), counter, slot, suppress_stop, samples)


def state_with(vocab, slot_data):
    """SamplerState with {slot: (counts, prompt, stop)} written."""
    state = init_state(NUM_SLOTS, vocab)
    if slot_data:
        slots = sorted(slot_data)
        state = write_slots(
            state,
            jnp.array(slots, jnp.int32),
            jnp.array(np.stack([slot_data[s][0] for s in slots])),
            jnp.array(np.stack([slot_data[s][1] for s in slots])),
            jnp.array(np.stack([slot_data[s][2] for s in slots])),
        )
    return state


def run(logits, rows, state, num_rows=None, num_logprobs=0):
    """Sample ``rows`` padded to ``num_rows``; by default to 16 rows (few shapes, few compiles)
    with the padding rows' outputs cut off."""
    trim = len(rows) if num_rows is None else None
    num_rows = num_rows or max(16, len(rows))
    logits = np.asarray(logits, np.float32)
    if logits.shape[0] < num_rows:  # padding rows hold NaN: nothing may read them
        pad = np.full((num_rows - logits.shape[0], logits.shape[1]), np.nan, np.float32)
        logits = np.concatenate([logits, pad])
    batch = build_sampling_batch(rows, num_rows, PAD)
    out, new_state = SAMPLE(jnp.asarray(logits), batch, state, num_logprobs=num_logprobs)
    return jax.tree.map(lambda x: np.asarray(x)[:trim], out), new_state


def empty_slot(vocab):
    return np.zeros(vocab, np.int32), np.zeros(vocab, bool), np.zeros(vocab, bool)


# ---------------------------------------------------------------------------------- greedy


def test_greedy_is_argmax_and_ties_take_the_first():
    v = 16
    logits = np.random.default_rng(0).normal(size=(3, v)).astype(np.float32)
    logits[2, [3, 9]] = 10.0
    rows = [row(temperature=0.0, slot=i, seed=i) for i in range(3)]
    out, _ = run(logits, rows, init_state(NUM_SLOTS, v))
    np.testing.assert_array_equal(out.token_ids, [*np.argmax(logits[:2], -1), 3])


def test_greedy_ignores_the_key():
    v = 16
    logits = np.random.default_rng(1).normal(size=(1, v))
    toks = {
        int(run(logits, [row(temperature=0, seed=s)], init_state(NUM_SLOTS, v))[0].token_ids[0])
        for s in range(5)
    }
    assert toks == {int(np.argmax(logits))}


# ------------------------------------------------------------- random rows, exact per key


V_EXACT = 24
R_EXACT = 4

params_strategy = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.3, 0.7, 1.0, 1.6]),
    top_k=st.sampled_from([-1, 0, 1, 2, 5, 23, 24, 40]),
    top_p=st.sampled_from([1.0, 0.95, 0.8, 0.5, 0.1, 1e-6]),
    min_p=st.sampled_from([0.0, 0.0, 0.05, 0.3]),
    presence_penalty=st.sampled_from([0.0, 0.5, -1.0]),
    frequency_penalty=st.sampled_from([0.0, 0.3, -0.4]),
    repetition_penalty=st.sampled_from([1.0, 1.3, 0.8]),
)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    params=st.lists(params_strategy, min_size=R_EXACT, max_size=R_EXACT),
    data_seed=st.integers(0, 2**32 - 1),
    suppress=st.lists(st.booleans(), min_size=R_EXACT, max_size=R_EXACT),
)
def test_every_rule_matches_reference(params, data_seed, suppress):
    rng = np.random.default_rng(data_seed)
    logits = (rng.normal(size=(R_EXACT, V_EXACT)) * 3).astype(np.float32)
    slot_data = {}
    for s in range(R_EXACT):
        counts = rng.integers(0, 3, V_EXACT) * (rng.random(V_EXACT) < 0.3)
        prompt = rng.random(V_EXACT) < 0.2
        stop = rng.random(V_EXACT) < 0.1
        slot_data[s] = (counts.astype(np.int32), prompt, stop)
    rows = [
        row(
            p,
            seed=int(rng.integers(0, 2**63)),
            counter=int(rng.integers(0, 1000)),
            slot=i,
            suppress_stop=suppress[i],
        )
        for i, p in enumerate(params)
    ]
    for r in rows:  # decisions within float noise of a boundary are not asserted
        x = ref_penalised(logits[r.slot], r.params, *slot_data[r.slot], r.suppress_stop)
        if not r.params.is_greedy:
            assume(ref_margin(x, r.params) > 1e-4)
            y = ref_filtered(x, r.params) + gumbel_noise(r.key_data, r.counter, V_EXACT)
            assume(np.sort(y)[-1] - np.sort(y)[-2] > 1e-4)
        else:
            assume(np.sort(x)[-1] - np.sort(x)[-2] > 1e-4)
    out, _ = run(logits, rows, state_with(V_EXACT, slot_data))
    expected = [ref_token(logits[i], r, *slot_data[i]) for i, r in enumerate(rows)]
    np.testing.assert_array_equal(out.token_ids, expected)


def test_temperature_only_rows_are_exact_gumbel_max():
    v = 64
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(4, v)).astype(np.float32)
    rows = [
        row(temperature=t, seed=100 + i, counter=7, slot=i)
        for i, t in enumerate([0.25, 0.5, 1.0, 2.0])
    ]
    out, _ = run(logits, rows, init_state(NUM_SLOTS, v))
    for i, r in enumerate(rows):
        g = gumbel_noise(r.key_data, r.counter, v).astype(np.float32)
        assert out.token_ids[i] == np.argmax(logits[i] / np.float32(r.params.temperature) + g)


def test_key_is_prngkey_of_the_seed():
    v = 64
    logits = np.zeros((1, v), np.float32)
    out, _ = run(logits, [row(seed=1234, counter=5)], init_state(NUM_SLOTS, v))
    key = jax.random.fold_in(jax.random.PRNGKey(1234), 5)
    assert out.token_ids[0] == np.argmax(np.asarray(jax.random.gumbel(key, (v,))))


# ---------------------------------------------------------- supports and distributions

V_DIST = 6
N_DIST = 4096


def draw_many(logits_row, params, slot=(None, None, None), suppress=False):
    """Tokens of N_DIST rows that differ only in their key."""
    v = logits_row.shape[0]
    logits = np.tile(np.asarray(logits_row, np.float32), (N_DIST, 1))
    rows = [RowSampling(params, key_data_for_seed(s), 0, 0, suppress) for s in range(N_DIST)]
    counts, prompt, stop = (x if x is not None else e for x, e in zip(slot, empty_slot(v)))
    state = state_with(v, {0: (counts, prompt, stop)})
    batch = build_sampling_batch(rows, N_DIST, PAD)
    out, _ = SAMPLE(jnp.asarray(logits), batch, state, num_logprobs=0)
    return np.asarray(out.token_ids)


def chi_square(tokens, probs):
    """Pearson statistic over the tokens of non-zero probability, and its degrees of freedom."""
    keep = probs > 0
    observed = np.bincount(tokens, minlength=probs.size)[keep]
    expected = probs[keep] * tokens.size
    return float(np.sum((observed - expected) ** 2 / expected)), int(keep.sum()) - 1


# chi-square critical values at p = 1e-4 (df 1..5): a correct sampler fails < 1 in 10^4.
CHI2_CRIT = {0: 0.0, 1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74}


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=1.5, top_k=3),
        SamplingParams(top_p=0.8),
        SamplingParams(min_p=0.2),
        SamplingParams(temperature=0.7, top_k=4, top_p=0.9, min_p=0.05),
    ],
    ids=["plain", "t0.5", "t1.5-k3", "p0.8", "minp0.2", "all"],
)
def test_distribution_matches_reference(params):
    logits = np.array([1.2, 0.4, -0.3, 0.9, -1.5, 0.0])
    expected = ref_softmax(ref_filtered(logits, params))
    tokens = draw_many(logits, params)
    assert set(np.unique(tokens)) <= set(np.flatnonzero(expected > 0))
    stat, df = chi_square(tokens, expected)
    assert stat < CHI2_CRIT[df], (stat, df, np.bincount(tokens, minlength=V_DIST), expected)


def test_top_k_keeps_ties_with_the_kth_value():
    logits = np.array([3.0, 2.0, 2.0, 2.0, 1.0, 0.0])
    tokens = draw_many(logits, SamplingParams(top_k=2))
    assert set(np.unique(tokens)) == {0, 1, 2, 3}
    assert set(np.unique(draw_many(logits, SamplingParams(top_k=1)))) == {0}


@pytest.mark.parametrize("top_k", [0, -1, V_DIST, V_DIST + 10])
def test_top_k_off_values(top_k):
    logits = np.array([0.5, 0.4, 0.3, 0.2, 0.1, 0.0])
    assert set(np.unique(draw_many(logits, SamplingParams(top_k=top_k)))) == set(range(V_DIST))


def test_top_p_one_keeps_everything_tiny_p_keeps_the_top():
    logits = np.array([0.5, 0.4, 0.3, 0.2, 0.1, -3.0])
    assert set(np.unique(draw_many(logits, SamplingParams(top_p=1.0)))) == set(range(V_DIST))
    assert set(np.unique(draw_many(logits, SamplingParams(top_p=1e-6)))) == {0}


def test_top_p_boundary_is_vllms_rule():
    # probs 0.5, 0.25, 0.15, 0.1 (+ two ~0): cumulative from the smallest ~0, ~0, 0.1, 0.25,
    # 0.5, 1; vLLM drops the tokens whose cumulative is <= 1 - top_p.
    logits = np.log(np.array([0.5, 0.25, 0.15, 0.1, 1e-30, 1e-30]))
    assert set(np.unique(draw_many(logits, SamplingParams(top_p=0.74)))) == {0, 1}
    assert set(np.unique(draw_many(logits, SamplingParams(top_p=0.76)))) == {0, 1, 2}
    assert set(np.unique(draw_many(logits, SamplingParams(top_p=0.95)))) == {0, 1, 2, 3}


def test_top_p_keeps_every_token_tied_with_the_last_kept():
    # The documented deviation: vLLM's sort order would keep one of the two 0.125s at
    # top_p = 0.76 (1 - p = 0.24 falls between their cumulatives 0.125 and 0.25); both stay.
    logits = np.log(np.array([0.5, 0.25, 0.125, 0.125, 1e-30, 1e-30]))
    assert set(np.unique(draw_many(logits, SamplingParams(top_p=0.76)))) == {0, 1, 2, 3}
    assert set(np.unique(draw_many(logits, SamplingParams(top_p=0.75)))) == {0, 1}


def test_top_p_applies_to_the_top_k_survivors():
    # top_k=3 renormalises (0.5, 0.3, 0.2) of the survivors; top_p=0.7 then keeps 0.5 + 0.3.
    logits = np.log(np.array([0.4, 0.24, 0.16, 0.1, 0.06, 0.04]))
    p = SamplingParams(top_k=3, top_p=0.7)
    assert set(np.flatnonzero(np.isfinite(ref_filtered(logits, p)))) == {0, 1}
    assert set(np.unique(draw_many(logits, p))) == {0, 1}


def test_min_p_threshold_is_relative_to_the_max_after_temperature():
    probs = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = np.log(probs)
    # min_p 0.3: keep probs >= 0.12 -> tokens 0, 1, 2
    assert set(np.unique(draw_many(logits, SamplingParams(min_p=0.3)))) == {0, 1, 2}
    # with temperature 0.5 the probabilities sharpen (p^2): keep p^2 >= 0.3 * 0.16
    p = SamplingParams(min_p=0.3, temperature=0.5)
    assert set(np.unique(draw_many(logits, p))) == {0, 1}
    assert set(np.flatnonzero(np.isfinite(ref_filtered(logits, p)))) == {0, 1}


# -------------------------------------------------------------------------------- penalties


def penalty_case():
    v = 8
    logits = np.array([2.0, -1.0, 0.5, -0.5, 1.5, 0.0, 1.0, -2.0], np.float32)
    counts = np.array([0, 2, 1, 0, 3, 0, 0, 1], np.int32)
    prompt = np.array([1, 0, 0, 1, 0, 0, 1, 0], bool)
    return v, logits, counts, prompt, np.zeros(v, bool)


@pytest.mark.parametrize(
    "kw",
    [
        dict(repetition_penalty=1.7),
        dict(repetition_penalty=0.6),
        dict(frequency_penalty=0.8),
        dict(frequency_penalty=-0.5),
        dict(presence_penalty=1.2),
        dict(presence_penalty=-2.0),
        dict(repetition_penalty=1.4, frequency_penalty=0.4, presence_penalty=0.9),
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_penalties_match_reference(kw):
    v, logits, counts, prompt, stop = penalty_case()
    # Greedy shows the argmax; 64 random keys at temperature 1 pin the penalised logits down.
    greedy = SamplingParams(temperature=0.0, **kw)
    random = SamplingParams(**kw)
    state = state_with(v, {0: (counts, prompt, stop)})
    out, _ = run(logits[None], [row(greedy)], state)
    assert out.token_ids[0] == np.argmax(ref_penalised(logits, greedy, counts, prompt, stop, 0))
    rows = [row(random, seed=s) for s in range(64)]
    out, _ = run(np.tile(logits, (64, 1)), rows, state)
    expected = [ref_token(logits, r, counts, prompt, stop) for r in rows]
    np.testing.assert_array_equal(out.token_ids, expected)


def test_penalties_change_the_values_as_vllm_does():
    # The sign rule of repetition penalty, read off exact greedy choices.
    v = 4
    counts = np.array([0, 1, 0, 0], np.int32)
    prompt = np.array([1, 0, 0, 0], bool)
    state = state_with(v, {0: (counts, prompt, np.zeros(v, bool))})
    p = SamplingParams(temperature=0, repetition_penalty=2.0)
    # token 0 (prompt, logit 3 -> 1.5) loses to token 2 (logit 2, unpenalised)
    out, _ = run(np.array([[3.0, -9.0, 2.0, -9.0]]), [row(p)], state)
    assert out.token_ids[0] == 2
    # negative logits are multiplied: token 1 (output, -1 -> -2) loses to token 3 (-1.5)
    out, _ = run(np.array([[-9.0, -1.0, -9.0, -1.5]]), [row(p)], state)
    assert out.token_ids[0] == 3


# ------------------------------------------------------------------------------- min_tokens


def test_min_tokens_masks_stop_tokens_greedy_and_random():
    v = 8
    logits = np.array([[0.0, 0.0, 9.0, 0.0, 8.0, 0.0, 0.0, 0.0]] * 2, np.float32)
    stop = np.zeros(v, bool)
    stop[[2, 5]] = True
    slots = {0: (np.zeros(v, np.int32), np.zeros(v, bool), stop), 1: empty_slot(v)}
    slots[1] = (np.zeros(v, np.int32), np.zeros(v, bool), stop)
    state = state_with(v, slots)
    g = SamplingParams(temperature=0.0)
    out, _ = run(logits, [row(g, slot=0, suppress_stop=True), row(g, slot=1)], state)
    np.testing.assert_array_equal(out.token_ids, [4, 2])
    toks = draw_many(
        np.array([1.0, 1.0, 3.0, 0.0, 0.0, 3.0]),
        SamplingParams(),
        slot=(None, None, stop[:6]),
        suppress=True,
    )
    assert not np.isin(toks, [2, 5]).any()
    toks = draw_many(
        np.array([1.0, 1.0, 3.0, 0.0, 0.0, 3.0]),
        SamplingParams(),
        slot=(None, None, stop[:6]),
        suppress=False,
    )
    assert np.isin(toks, [2, 5]).any()


def test_ignore_eos_still_masked_by_min_tokens_but_not_a_stop():
    v = 6
    params = SamplingParams(ignore_eos=True, stop_token_ids=[4], min_tokens=2)
    counts, prompt, stop = slot_rows(v, params, [1, 2], [], eos_token_id=3)
    np.testing.assert_array_equal(np.flatnonzero(stop), [3, 4])
    assert params.all_stop_token_ids(3) == [4]
    _, _, stop = slot_rows(v, SamplingParams(stop_token_ids=[4]), [1], [], eos_token_id=None)
    np.testing.assert_array_equal(np.flatnonzero(stop), [4])


# ---------------------------------------------------------------------------------- logprobs


def ref_logprobs(logits, targets, num):
    x = np.asarray(logits, np.float64)
    lp = x - x.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    target = lp[np.arange(len(targets)), targets]
    rank = (lp >= target[:, None]).sum(-1)
    order = np.argsort(-lp, axis=-1, kind="stable")[:, :num]
    return target, rank, order, np.take_along_axis(lp, order, -1)


@pytest.mark.parametrize("num", [0, 1, 5])
def test_logprobs_of_matches_numpy(num):
    rng = np.random.default_rng(3)
    logits = (rng.normal(size=(7, 50)) * 4).astype(np.float32)
    targets = rng.integers(0, 50, 7).astype(np.int32)
    targets[0] = np.argmax(logits[0])
    got = logprobs_of(jnp.asarray(logits), jnp.asarray(targets), num)
    want = ref_logprobs(logits, targets, num)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[1], want[1])
    assert got[1][0] == 1
    assert got[2].shape == (7, num) and got[3].shape == (7, num)
    np.testing.assert_array_equal(got[2], want[2])
    np.testing.assert_allclose(got[3], want[3], rtol=1e-5, atol=1e-5)


def test_rank_counts_ties():
    logits = jnp.array([[1.0, 2.0, 2.0, 0.0]])
    _, rank, _, _ = logprobs_of(logits, jnp.array([2]), 0)
    assert int(rank[0]) == 2  # vLLM: tokens with logprob >= the target's, itself included


def test_sample_returns_raw_logprobs_not_processed_ones():
    v = 8
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(2, v)).astype(np.float32)
    counts = np.zeros(v, np.int32)
    counts[np.argmax(logits[0])] = 3
    state = state_with(v, {0: (counts, np.zeros(v, bool), np.zeros(v, bool))})
    rows = [
        row(temperature=0.0, frequency_penalty=2.0, repetition_penalty=1.5, slot=0, logprobs=3),
        row(temperature=0.3, top_k=2, seed=9, slot=1, logprobs=3),
    ]
    out, _ = run(logits, rows, state, num_logprobs=3)
    want = ref_logprobs(logits, out.token_ids, 3)
    np.testing.assert_allclose(out.logprob, want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out.rank, want[1])
    np.testing.assert_array_equal(out.top_ids, want[2])
    np.testing.assert_allclose(out.top_logprobs, want[3], rtol=1e-5, atol=1e-6)
    assert out.rank[0] > 1  # the penalty moved the choice off the raw argmax


def test_logprobs_only_when_a_sampling_row_asks():
    """A step whose sampling rows ask for no logprobs skips them (every logprob field 0) and
    samples the same tokens; one row asking gives every row its logprobs; a row asking that
    does not sample this step does not count."""
    v = 8
    logits = np.random.default_rng(6).normal(size=(3, v)).astype(np.float32)
    plain = [row(temperature=0.0, slot=0), row(temperature=0.7, seed=3, slot=1),
             row(temperature=0.0, slot=2, presence_penalty=0.5)]  # fmt: skip
    state = init_state(NUM_SLOTS, v)
    out, _ = run(logits, plain, state, num_logprobs=2)
    for name in ("logprob", "rank", "top_ids", "top_logprobs"):
        assert not np.any(getattr(out, name)), name
    asked = [plain[0], dataclasses.replace(plain[1], params=SamplingParams(
        temperature=0.7, logprobs=2)), plain[2]]  # fmt: skip
    out2, _ = run(logits, asked, state, num_logprobs=2)
    np.testing.assert_array_equal(out2.token_ids, out.token_ids)
    want = ref_logprobs(logits, out2.token_ids, 2)
    np.testing.assert_allclose(out2.logprob, want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out2.rank, want[1])
    np.testing.assert_array_equal(out2.top_ids, want[2])
    idle = [plain[0], dataclasses.replace(asked[1], samples=False), plain[2]]
    out3, _ = run(logits, idle, state, num_logprobs=2)
    for name in ("logprob", "rank", "top_ids", "top_logprobs"):
        assert not np.any(getattr(out3, name)), name


# ------------------------------------------------------------------- padding and the state


def test_padding_rows_nan_logits_and_duplicate_padding_slots():
    v = 16
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(2, v)).astype(np.float32)
    rows = [row(seed=1, slot=0, presence_penalty=0.5), row(temperature=0, slot=2)]
    state = init_state(NUM_SLOTS, v)
    out, new = run(logits, rows, state, num_rows=16)  # 14 padding rows: NaN logits, slot PAD
    out1, _ = run(logits[:1], rows[:1], state)
    assert out.token_ids[0] == out1.token_ids[0]
    assert out.token_ids[1] == np.argmax(logits[1])
    np.testing.assert_array_equal(out.token_ids[2:], 0)
    counts = np.asarray(new.output_counts)
    assert counts[PAD].sum() == 0 and counts[1].sum() == 0 and counts[3].sum() == 0
    assert counts[0, out.token_ids[0]] == 1 and counts[2, out.token_ids[1]] == 1
    np.testing.assert_array_equal(new.prompt_mask, state.prompt_mask)
    np.testing.assert_array_equal(new.stop_mask, state.stop_mask)


def test_counts_accumulate_and_non_sampling_rows_leave_state_alone():
    v = 8
    rng = np.random.default_rng(6)
    state = init_state(NUM_SLOTS, v)
    expected = np.zeros((NUM_SLOTS, v), np.int64)
    for step in range(6):
        logits = rng.normal(size=(3, v)).astype(np.float32)
        rows = [
            row(seed=11, counter=step, slot=0, frequency_penalty=0.5),
            row(temperature=0, slot=1),
            row(seed=12, counter=step, slot=3, samples=step % 2 == 0),  # chunked prefill
        ]
        out, state = run(logits, rows, state)
        for r, tok in zip(rows, out.token_ids):
            if r.samples:
                expected[r.slot, tok] += 1
            else:
                assert tok == 0
    np.testing.assert_array_equal(state.output_counts, expected)


def test_write_slots_replaces_only_those_rows():
    v = 7
    state = init_state(NUM_SLOTS, v)
    params = SamplingParams(stop_token_ids=[6])
    a = slot_rows(v, params, [1, 1, 2], [3, 3, 5], eos_token_id=0)
    b = slot_rows(v, SamplingParams(), [4], [], eos_token_id=None)
    state = write_slots(state, jnp.array([3, 1]), *(jnp.array(np.stack(x)) for x in zip(a, b)))
    counts = np.asarray(state.output_counts)
    np.testing.assert_array_equal(counts[3], [0, 0, 0, 2, 0, 1, 0])
    np.testing.assert_array_equal(np.flatnonzero(state.prompt_mask[3]), [1, 2])
    np.testing.assert_array_equal(np.flatnonzero(state.stop_mask[3]), [0, 6])
    np.testing.assert_array_equal(np.flatnonzero(state.prompt_mask[1]), [4])
    assert not np.asarray(state.stop_mask[1]).any()
    for s in (0, 2, 4):
        assert counts[s].sum() == 0 and not np.asarray(state.prompt_mask[s]).any()


def test_slot_rows_rejects_ids_outside_the_vocabulary():
    with pytest.raises(ValueError, match=r"prompt_token_ids.*\[9\].*\[0, 8\)"):
        slot_rows(8, SamplingParams(), [1, 9], [], eos_token_id=0)
    with pytest.raises(ValueError, match=r"output_token_ids.*\[-1\]"):
        slot_rows(8, SamplingParams(), [1], [-1], eos_token_id=0)
    with pytest.raises(ValueError, match=r"stop tokens.*\[8\]"):
        slot_rows(8, SamplingParams(stop_token_ids=[8]), [1], [], eos_token_id=0)


def test_build_sampling_batch_pads_with_neutral_rows():
    rows = [
        row(
            SamplingParams(top_k=-1, temperature=0.5, top_p=0.9),
            seed=3,
            counter=4,
            slot=2,
            suppress_stop=True,
        )
    ]
    b = build_sampling_batch(rows, 3, PAD)
    assert b.num_rows == 3
    np.testing.assert_array_equal(b.top_k, [0, 0, 0])
    np.testing.assert_allclose(b.temperature, [0.5, 0, 0])
    np.testing.assert_allclose(b.top_p, [0.9, 1, 1])
    np.testing.assert_array_equal(b.slot, [2, PAD, PAD])
    np.testing.assert_array_equal(b.samples, [True, False, False])
    np.testing.assert_array_equal(b.suppress_stop, [True, False, False])
    np.testing.assert_array_equal(b.key_data[0], key_data_for_seed(3))
    np.testing.assert_array_equal(b.counter, [4, 0, 0])
    assert b.key_data.dtype == np.uint32 and b.slot.dtype == np.int32
    with pytest.raises(ValueError, match="2 rows do not fit num_rows_padded=1"):
        build_sampling_batch(rows * 2, 1, PAD)


def test_slot_sampling_batch_equals_build_sampling_batch():
    """The per-slot table (written once per admission, gathered per step) gives the very
    arrays `build_sampling_batch` builds from the same rows, padding included; a slot
    rewritten by a new request reads the new request's parameters."""
    rng = np.random.default_rng(0)
    table = SlotSampling(NUM_SLOTS)

    def params():
        return SamplingParams(
            temperature=float(rng.choice([0.0, 0.7, 1.3])),
            top_k=int(rng.choice([-1, 0, 5])),
            top_p=float(rng.choice([1.0, 0.8])),
            min_p=float(rng.choice([0.0, 0.1])),
            presence_penalty=float(rng.choice([0.0, 0.5])),
            frequency_penalty=float(rng.choice([0.0, -0.25])),
            repetition_penalty=float(rng.choice([1.0, 1.2])),
            logprobs=[None, 0, 3][int(rng.integers(3))],
        )

    for trial in range(6):
        rows = []
        for slot in rng.permutation(PAD)[: rng.integers(0, PAD + 1)].tolist():
            r = row(params(), seed=int(rng.integers(2**40)), counter=int(rng.integers(99)),
                    slot=slot, suppress_stop=bool(rng.integers(2)), samples=bool(rng.integers(2)))  # fmt: skip
            table.write(slot, r.params, r.key_data)
            rows.append(r)
        r_pad = len(rows) + trial % 3
        want = build_sampling_batch(rows, r_pad, PAD)
        got = table.batch(
            [r.slot for r in rows] + [PAD] * (r_pad - len(rows)),
            [r.counter for r in rows],
            [(r.suppress_stop, r.samples) for r in rows],
        )
        for field in dataclasses.fields(want):
            a, b = getattr(got, field.name), getattr(want, field.name)
            assert a.dtype == b.dtype and a.shape == b.shape, field.name
            np.testing.assert_array_equal(a, b, err_msg=field.name)


# ----------------------------------------------------------------- seeds and invariance


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.integers(-(2**63), 2**63 - 1))
def test_key_data_for_seed_is_jax_prngkey_with_x64(seed):
    with jax.enable_x64(True):
        want = np.asarray(jax.random.key_data(jax.random.PRNGKey(seed)))
    np.testing.assert_array_equal(key_data_for_seed(seed), want)


@settings(max_examples=50, deadline=None, derandomize=True)
@given(st.integers(2**63, 2**64 - 1))
def test_key_data_for_uint64_seeds_is_their_bit_pattern(seed):
    with jax.enable_x64(True):
        want = np.asarray(jax.random.key_data(jax.random.PRNGKey(seed - 2**64)))
    np.testing.assert_array_equal(key_data_for_seed(seed), want)


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**31 - 1, 2**31, 2**32 - 1])
def test_key_data_for_seed_equals_default_jax_for_32_bit_seeds(seed):
    want = np.asarray(jax.random.key_data(jax.random.PRNGKey(seed)))
    np.testing.assert_array_equal(key_data_for_seed(seed), want)


def test_key_data_for_seed_rejects_non_ints():
    for bad in (1.5, True, 2**64, -(2**63) - 1):
        with pytest.raises(ValueError, match="seed="):
            key_data_for_seed(bad)


V_INV = 64
TARGET = row(SamplingParams(temperature=0.9, top_p=0.95), seed=2**45 + 17, counter=33, slot=0)
COMPANIONS = [
    SamplingParams(temperature=1.2, top_k=5),  # the sort branch
    SamplingParams(temperature=0.6, min_p=0.1),  # the min_p branch
    SamplingParams(repetition_penalty=1.5, presence_penalty=0.4),  # the penalty gathers
    SamplingParams(temperature=0.0),  # greedy
    SamplingParams(),  # plain random
]


def invariance_logits():
    rng = np.random.default_rng(7)
    return rng.normal(size=(16, V_INV)).astype(np.float32)


@pytest.mark.parametrize("num_rows", [1, 4, 16])
@pytest.mark.parametrize("companions", [(), (0,), (1,), (2,), (3,), (4,), (0, 1, 2, 3, 4)])
def test_same_row_same_token_whatever_the_batch(num_rows, companions):
    logits = invariance_logits()
    target_logits = logits[0]
    alone, _ = run(target_logits[None], [TARGET], init_state(NUM_SLOTS, V_INV), num_rows=1)
    others = [
        row(COMPANIONS[c], seed=50 + i, counter=i, slot=1 + i % 3, suppress_stop=i % 2 == 1)
        for i, c in enumerate(companions)
    ][: num_rows - 1]
    state = state_with(
        V_INV,
        {
            s: (
                np.arange(V_INV, dtype=np.int32) % 3,
                np.arange(V_INV) % 5 == 0,
                np.arange(V_INV) % 7 == 0,
            )
            for s in (1, 2, 3)
        },
    )
    for position in sorted({0, len(others)}):  # first and last
        rows = others[:position] + [TARGET] + others[position:]
        lg = np.concatenate(
            [logits[1 : 1 + position], target_logits[None], logits[1 + position : 1 + len(others)]]
        )
        out, _ = run(lg, rows, state, num_rows=num_rows)
        assert out.token_ids[position] == alone.token_ids[0]


def test_same_row_same_token_when_batch_order_is_shuffled():
    logits = invariance_logits()[:8]
    rows = [row(COMPANIONS[i % 5], seed=200 + i, counter=3 * i, slot=i % 4) for i in range(8)]
    state = init_state(NUM_SLOTS, V_INV)
    out, _ = run(logits, rows, state)
    perm = np.random.default_rng(8).permutation(8)
    out_p, _ = run(logits[perm], [rows[i] for i in perm], state)
    np.testing.assert_array_equal(out_p.token_ids, out.token_ids[perm])


def test_counters_and_seeds_give_different_streams():
    logits = np.zeros((32, V_INV), np.float32)  # uniform: every draw is informative
    state = init_state(NUM_SLOTS, V_INV)
    stream_a = run(logits, [dataclasses.replace(TARGET, counter=c) for c in range(32)], state)[
        0
    ].token_ids
    stream_b = run(logits, [row(seed=2**45 + 18, counter=c) for c in range(32)], state)[0].token_ids
    assert len(set(stream_a.tolist())) > 16
    assert (stream_a != stream_b).sum() > 24
    again = run(logits, [dataclasses.replace(TARGET, counter=c) for c in range(32)], state)[
        0
    ].token_ids
    np.testing.assert_array_equal(again, stream_a)


# ----------------------------------------------------------------------- compile discipline


def test_compiles_once_per_shape():
    def step(logits, batch, state, num_logprobs):  # a fresh function: its own jit cache
        return sample(logits, batch, state, num_logprobs=num_logprobs)

    f = jax.jit(step, static_argnames="num_logprobs")
    v = 16
    rng = np.random.default_rng(9)
    state = init_state(NUM_SLOTS, v)
    variants = [
        [row(temperature=0)],  # all greedy: every cond false
        [row(top_k=3, top_p=0.5, min_p=0.1, seed=1)],
        [row(repetition_penalty=1.2, suppress_stop=True, seed=2)],
        [row(seed=3), row(temperature=0, slot=1), row(samples=False, slot=2)],
    ]
    for rows in variants:
        batch = build_sampling_batch(rows, 4, PAD)
        out, state = f(
            jnp.asarray(rng.normal(size=(4, v)), jnp.float32), batch, state, num_logprobs=2
        )
    assert f._cache_size() == 1
    batch = build_sampling_batch(variants[0], 8, PAD)
    f(jnp.zeros((8, v), jnp.float32), batch, state, num_logprobs=2)
    assert f._cache_size() == 2


def test_expensive_work_sits_behind_conds():
    v = 16
    batch = jax.tree.map(jnp.asarray, build_sampling_batch([row()], 2, PAD))
    jaxpr = jax.make_jaxpr(lambda lg, b, s: sample(lg, b, s, num_logprobs=1))(
        jnp.zeros((2, v)), batch, init_state(NUM_SLOTS, v)
    )
    text = str(jaxpr)
    # min_tokens, penalties, random path, and inside it min_p and the sort
    assert text.count("cond[") >= 5
    assert isinstance(init_state(2, 3), SamplerState)


def test_state_can_be_donated():
    v = 16
    step = jax.jit(lambda lg, b, s: sample(lg, b, s, num_logprobs=0), donate_argnums=(2,))
    write = jax.jit(write_slots, donate_argnums=(0,))
    state = write(
        init_state(NUM_SLOTS, v),
        jnp.array([0]),
        jnp.ones((1, v), jnp.int32),
        jnp.zeros((1, v), bool),
        jnp.zeros((1, v), bool),
    )
    batch = build_sampling_batch([row(temperature=0)], 2, PAD)
    out, state = step(jnp.eye(2, v, 3, jnp.float32), batch, state)
    assert int(out.token_ids[0]) == 3
    assert int(state.output_counts[0, 3]) == 2 and int(state.output_counts[0].sum()) == v + 1
