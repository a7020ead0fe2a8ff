"""Speculative decoding with n-gram drafts: the proposer (vLLM's prompt lookup), the config's
errors, and the engine's outputs, which must equal those without speculation token for token
(greedy and sampled: every position is drawn with the key of its position)."""

from __future__ import annotations

import dataclasses
import functools
import random

import numpy as np
import pytest

from serving import SamplingParams
from serving.spec_decode import MAX_SPECULATIVE_TOKENS, NgramProposer, SpeculativeConfig
from tests.serving.engine_testing import Arrival, assert_pool_is_whole, drive, make_engine

# -- the proposer ------------------------------------------------------------------------------


def _proposer(k=4, lo=2, hi=3, max_model_len=1000):
    cfg = SpeculativeConfig.from_dict(
        {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": lo,
            "prompt_lookup_max": hi,
        }
    )
    return NgramProposer(cfg, max_model_len)


def _naive(tokens, k, lo, hi, max_model_len):
    """The definition, spelled out: the longest tail n-gram (lo <= n <= hi) seen before the
    last token, its earliest occurrence, then the tokens after it."""
    total = len(tokens)
    k = min(k, max_model_len - total)
    if total < lo or k <= 0:
        return []
    for n in range(hi, lo - 1, -1):
        if n > total - 1:
            continue
        tail = tokens[total - n :]
        for s in range(0, total - n):
            if tokens[s : s + n] == tail:
                return tokens[s + n : s + n + k]
    return []


def test_ngram_matches_vllms_documented_example():
    # vLLM's docstring: [1,2,3,4,2,3] with n in 2..3 and k=4 proposes [4,2,3]
    assert _proposer(k=4, lo=2, hi=3).propose([1, 2, 3, 4, 2, 3]) == [4, 2, 3]
    assert _proposer(k=2, lo=2, hi=3).propose([1, 2, 3, 4, 2, 3]) == [4, 2]
    assert _proposer().propose([1, 2, 3, 4, 5]) == []  # no earlier occurrence
    assert _proposer(lo=3, hi=3).propose([7, 8]) == []  # shorter than the n-gram
    # the longest n wins over an earlier shorter match, the earliest occurrence among equals
    assert _proposer(k=1, lo=1, hi=3).propose([5, 9, 1, 2, 3, 7, 2, 3, 8, 1, 2, 3]) == [7]
    assert _proposer(k=1, lo=1, hi=1).propose([4, 1, 5, 1, 6, 1]) == [5]
    # never past max_model_len
    assert _proposer(k=4, lo=1, hi=1, max_model_len=7).propose([1, 2, 1, 2, 1, 2]) == [1]


def test_ngram_equals_its_definition_on_random_sequences():
    rng = random.Random(0)
    for _ in range(400):
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 40))]
        k, lo = rng.randint(1, 5), rng.randint(1, 4)
        hi = rng.randint(lo, 6)
        mml = rng.choice([1000, len(tokens) + rng.randint(0, 3)])
        assert _proposer(k, lo, hi, mml).propose(tokens) == _naive(tokens, k, lo, hi, mml)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method='eagle'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
        (
            {"method": "ngram", "num_speculative_tokens": MAX_SPECULATIVE_TOKENS + 1},
            f"num_speculative_tokens={MAX_SPECULATIVE_TOKENS + 1}",
        ),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min=4 > prompt_lookup_max=2",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"},
            "unknown key 'draft_model'",
        ),
    ],
)
def test_bad_speculative_configs(config, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(config)


def test_lookup_defaults_follow_vllm():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    )
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)


def test_llm_refuses_what_it_cannot_run(tiny_params, tiny_cfg):
    from serving import LLM

    with pytest.raises(ValueError, match="num_speculative_tokens=0"):
        LLM("tiny_v41", speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="dspark"):
        make_engine(
            tiny_params,
            tiny_cfg,
            async_scheduling=False,
            speculative_config={"method": "dspark", "num_speculative_tokens": 2},
        )


# -- the engine --------------------------------------------------------------------------------


def _repetitive_workload(cfg, seed: int, num_requests: int = 8, **params_kw):
    """Prompts built from a few repeated phrases (n-gram lookup finds matches), two shared
    prefixes (prefix hits), arrivals spread over steps, ragged lengths (requests drain at
    different steps)."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(3, cfg.vocab_size, int(rng.integers(2, 5))).tolist() for _ in range(4)]

    def phrase_run(n: int) -> list[int]:
        return [t for i in rng.integers(0, 4, n) for t in phrases[int(i)]]

    prefixes = [phrase_run(6) for _ in range(2)]
    out = []
    for i in range(num_requests):
        body = phrase_run(int(rng.integers(2, 8)))
        prompt = (prefixes[i % 2] if i % 3 else []) + body
        kw = dict(temperature=0.0, max_tokens=int(rng.integers(2, 16)), ignore_eos=True)
        kw.update(params_kw)
        out.append(
            Arrival(int(rng.integers(0, 10)), f"req{i}", tuple(prompt[:60]), SamplingParams(**kw))
        )
    return sorted(out, key=lambda a: a.step)


def _tokens(finals):
    return {rid: out.outputs[0].token_ids for rid, out in finals.items()}


def _assert_same(fast, plain, aborted=None):
    """Equal outputs; an aborted request stops after as many steps in both runs, i.e. after
    more tokens with speculation: one output is a prefix of the other."""
    got, want = _tokens(fast), _tokens(plain)
    if aborted is not None:
        a, b = sorted((got.pop(aborted), want.pop(aborted)), key=len)
        assert b[: len(a)] == a
        assert fast[aborted].outputs[0].finish_reason == "abort"
    assert got == want


class _Oracle:
    """A drafter that knows the plain engine's outputs: it proposes the true continuation,
    made wrong at one random position (or none) of each draft, and random tokens past the end
    of a request's output."""

    def __init__(self, arrivals, finals, k: int, vocab_size: int) -> None:
        self.known = [(list(a.prompt), finals[a.request_id].outputs[0].token_ids) for a in arrivals]
        self.known.sort(key=lambda pair: -len(pair[0]))
        self.k, self.vocab = k, vocab_size
        self.rng = random.Random(k)

    def propose(self, tokens, num_tokens=None):
        n = self.k if num_tokens is None else num_tokens  # k + 1 past a step in flight
        for prompt, out in self.known:
            done = len(tokens) - len(prompt)
            if (
                0 <= done <= len(out)
                and tokens[: len(prompt)] == prompt
                and list(tokens[len(prompt) :]) == list(out[:done])
            ):
                draft = list(out[done : done + n])
                draft += [self.rng.randrange(3, self.vocab) for _ in range(n - len(draft))]
                wrong = self.rng.randrange(n + 1)
                if wrong < n:
                    draft[wrong] = (draft[wrong] + 1) % self.vocab
                return draft
        return []


def _run(params, cfg, arrivals, *, spec=None, aborts=None, proposer=None, async_=False, **kw):
    engine = make_engine(params, cfg, async_scheduling=async_, speculative_config=spec, **kw)
    if proposer is not None:
        engine.proposer = proposer
    finals, _ = drive(engine, arrivals, aborts=aborts)
    assert_pool_is_whole(engine)
    return finals, engine


@pytest.mark.parametrize(
    ("k", "pool_layout", "budget", "async_"),
    [
        pytest.param(3, "aliased", 32, False, id="k3-aliased"),
        pytest.param(5, "separate", 32, False, id="k5-separate", marks=pytest.mark.slow),
        pytest.param(1, "aliased", 13, False, id="k1-budget13"),
        pytest.param(3, "aliased", 32, True, id="k3-aliased-async"),
        pytest.param(
            2, "separate", 13, True, id="k2-separate-budget13-async", marks=pytest.mark.slow
        ),
    ],
)
def test_greedy_outputs_equal_plain_decoding(tiny_params, tiny_cfg, k, pool_layout, budget, async_):
    """n-gram and an oracle drafter, synchronous or asynchronous (drafts proposed past the step
    in flight, positions moved back on the device by the drafts it rejected), against the
    synchronous engine without speculation."""
    arrivals = _repetitive_workload(tiny_cfg, seed=k)
    victim = max(arrivals[:4], key=lambda a: a.params.max_tokens)  # still running then
    aborts = {victim.step + 2: victim.request_id}
    run = functools.partial(
        _run, tiny_params, tiny_cfg, arrivals, aborts=aborts, pool_layout=pool_layout,
        max_num_batched_tokens=budget,
    )  # fmt: skip
    plain, base = run()
    spec = {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
    }
    fast, engine = run(spec=spec, async_=async_)
    _assert_same(fast, plain, victim.request_id)
    assert engine.stats.spec_num_draft_tokens > 0, "the repetitive prompts should give drafts"
    # The random model rarely continues a phrase, so drafts are mostly rejected. An oracle
    # drafter that knows the plain outputs, wrong at a random position of every draft,
    # exercises acceptance up to every position (and rejection right after it).
    oracle = _Oracle(arrivals, plain, k, tiny_cfg.vocab_size)
    fast, engine = run(spec=spec, proposer=oracle, async_=async_)
    _assert_same(fast, plain, victim.request_id)
    _assert_oracle_stats(engine.stats, fast, k)
    assert engine.stats.num_preemptions > 0 or base.stats.num_preemptions == 0
    if async_:  # fewer steps than the asynchronous engine without speculation
        _, base = run(async_=True)
    assert engine.stats.num_steps < base.stats.num_steps


def _assert_oracle_stats(st, outputs, k: int) -> None:
    """The oracle drafter's drafts were accepted, at every position when ``k > 1``, and the
    per-position and per-request counts add up to the totals."""
    assert st.spec_num_accepted_tokens > 0, "the oracle's drafts should be accepted"
    assert 0 < st.spec_acceptance_rate < 1 and st.spec_mean_acceptance_length > 1
    if k > 1:  # accepted at every position, and rejected at every position
        assert all(st.spec_accepted_tokens_per_pos), st.spec_accepted_tokens_per_pos
        assert all(
            a < d for a, d in zip(st.spec_accepted_tokens_per_pos, st.spec_draft_tokens_per_pos)
        )
    assert sum(st.spec_draft_tokens_per_pos) == st.spec_num_draft_tokens
    assert sum(st.spec_accepted_tokens_per_pos) == st.spec_num_accepted_tokens
    per_request = sum(o.metrics.spec_num_accepted_tokens for o in outputs.values())
    assert per_request == st.spec_num_accepted_tokens


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_sampled_outputs_equal_plain_decoding(tiny_params, tiny_cfg, async_):
    """Temperature, top-k / top-p, penalties, min_tokens and logprobs: each verified position
    draws with its own key and the penalty counts of the tokens before it, so the tokens (and
    their logprobs) are those of the plain engine (synchronous), with the speculative engine
    synchronous or asynchronous (min_tokens then counted on the device after the move back)."""
    arrivals = _repetitive_workload(
        tiny_cfg,
        seed=11,
        temperature=0.8,
        top_k=20,
        top_p=0.9,
        presence_penalty=0.3,
        repetition_penalty=1.1,
        logprobs=2,
    )
    arrivals = [
        dataclasses.replace(a, params=dataclasses.replace(a.params, min_tokens=3, seed=i))
        for i, a in enumerate(arrivals)
    ]
    plain, _ = _run(tiny_params, tiny_cfg, arrivals)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    oracle = _Oracle(arrivals, plain, 3, tiny_cfg.vocab_size)
    fast, engine = _run(tiny_params, tiny_cfg, arrivals, spec=spec, proposer=oracle, async_=async_)
    _assert_same(fast, plain)
    assert engine.stats.spec_num_accepted_tokens > 0
    for rid, out in fast.items():
        got, want = out.outputs[0].logprobs, plain[rid].outputs[0].logprobs
        assert [sorted(e) for e in got] == [sorted(e) for e in want]
        for g, w in zip(got, want):
            assert [g[t].logprob for t in sorted(g)] == pytest.approx(
                [w[t].logprob for t in sorted(w)], abs=1e-5
            )
