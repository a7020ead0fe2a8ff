"""Speculative decoding under asynchronous scheduling: step N+1 is planned while step N is in
flight, as if step N accepted every draft (optimistic reservation); the device moves each such
row back by the drafts step N rejected (positions, slot mappings, sampler keys, min_tokens, the
Engram look-back) before it runs. DSpark drafts on the device and feeds its drafts to the next
step; a host proposer (n-gram, the oracles here) proposes past the step in flight with a guess
of that step's token. Outputs must be the synchronous engine's without speculation, token for
token (with logprobs), and every block free at the end."""

from __future__ import annotations

import numpy as np
import pytest

from serving.sampling_params import SamplingParams
from tests.serving import engine_testing as E

K = 3
# every (parity of the first rejected position, draft index of the rejection); index K = none
COMBOS = {(parity, a) for parity in (0, 1) for a in range(K + 1)}


def _tokens(finals):
    return {rid: out.outputs[0].token_ids for rid, out in finals.items()}


# -- DSpark on the device ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("k", "pool_layout", "budget", "seed"),
    [
        pytest.param(3, "aliased", 32, 11, id="k3-aliased"),
        pytest.param(1, "separate", 13, 11, id="k1-separate-budget13", marks=pytest.mark.slow),
        pytest.param(3, "separate", 32, 11, id="k3-separate", marks=pytest.mark.slow),
    ],
)
def test_dspark_async_greedy_equals_the_reference(engram_params, engram_cfg, k, pool_layout,
                                                  budget, seed):  # fmt: skip
    """tiny_v41_full (Engram, 3-stage drafter, ratio-2 layers), NaN-filled pools, a workload
    with chunked prefill, prefix hits, preemption and an abort: the asynchronous engine with
    DSpark gives `dsv4.generate`'s greedy tokens. The random drafter's drafts are all
    rejected, so every decode step after a verification is moved back by k on the device."""
    arrivals = E.workload(engram_cfg, seed, num_requests=10)  # seeds chosen to preempt
    victim = max(arrivals[:4], key=lambda a: a.params.max_tokens)
    aborts = {victim.step + 2: victim.request_id}
    # 28 blocks, as tests/serving/test_spec_dspark.py: the same compiled step
    engine = E.make_engine(
        engram_params, engram_cfg, async_scheduling=True, num_gpu_blocks_override=28,
        speculative_config={"method": "dspark", "num_speculative_tokens": k},
        pool_layout=pool_layout, max_num_batched_tokens=budget,
    )  # fmt: skip
    finals, _ = E.drive(engine, arrivals, aborts=aborts)
    E.assert_pool_is_whole(engine)
    want = E.reference_tokens(engram_params, engram_cfg, arrivals)
    got = _tokens(finals)
    cut = got.pop(victim.request_id)
    assert want.pop(victim.request_id)[: len(cut)] == cut
    assert finals[victim.request_id].outputs[0].finish_reason == "abort"
    assert got == want
    st = engine.stats
    assert st.num_preemptions > 0
    assert st.prefix_cache_hits > 0 or budget != 32  # 13-token chunks hit nothing here
    assert st.spec_num_drafts > 20
    assert st.compilations_after_warm_up == 0


# -- host drafts rejected at every offset from a pair boundary ------------------------------------


class _PairOracle:
    """Knows the plain outputs and proposes their true continuation, made wrong from a draft
    index chosen so that the first rejected position takes every parity at every index
    (``seen``: what the verifications did so far, recorded by the test). Past a step in flight
    (``num_tokens`` = k + 1) the first token is the guess of that step's token."""

    def __init__(self, arrivals, finals, k: int, vocab_size: int) -> None:
        self.known = [(list(a.prompt), finals[a.request_id].outputs[0].token_ids) for a in arrivals]
        self.k, self.vocab = k, vocab_size
        self.seen: set[tuple[int, int]] = set()
        self.turn = 0

    def propose(self, tokens, num_tokens=None):
        n = self.k if num_tokens is None else num_tokens
        ahead = n - self.k
        for prompt, out in self.known:
            done = len(tokens) - len(prompt)
            if done < 0 or tokens[: len(prompt)] != prompt:
                continue
            if list(tokens[len(prompt) :]) != list(out[:done]) or done + n > len(out):
                continue
            draft = list(out[done : done + n])
            first = len(tokens) + ahead  # position of the first draft
            todo = [a for a in range(self.k + 1) if ((first + a) % 2, a) not in self.seen]
            self.turn += 1
            a = todo[0] if todo else self.turn % (self.k + 1)
            for j in range(a, self.k):
                draft[ahead + j] = (draft[ahead + j] + 1 + j) % (self.vocab - 3) + 3
            return draft
        return []


def test_host_drafts_rejected_at_every_offset_from_a_pair_boundary(engram_params, engram_cfg):
    """The ratio-2 compressor's pairs under asynchronous verification: a pair whose second half
    was a rejected draft is computed again by the next step, which the device moved back to
    it. Every way a rejection falls relative to a pair boundary (first rejected position even
    or odd, at every draft index, and none) happens, on the Engram model; tokens and logprobs
    equal the synchronous engine without speculation."""
    assert 2 in engram_cfg.compress_ratios
    rng = np.random.default_rng(4)
    arrivals = []
    for i, (n_prompt, n_out) in enumerate([(13, 40), (20, 36), (7, 44)]):
        prompt = tuple(int(t) for t in rng.integers(3, engram_cfg.vocab_size, n_prompt))
        params = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True, logprobs=2)
        arrivals.append(E.Arrival(i, f"r{i}", prompt, params))
    blocks = 28
    plain_engine = E.make_engine(engram_params, engram_cfg, async_scheduling=False,
                                 num_gpu_blocks_override=blocks)  # fmt: skip
    plain, _ = E.drive(plain_engine, arrivals)
    spec = {"method": "ngram", "num_speculative_tokens": K}
    engine = E.make_engine(engram_params, engram_cfg, async_scheduling=True,
                           num_gpu_blocks_override=blocks, speculative_config=spec)  # fmt: skip
    oracle = engine.proposer = _PairOracle(arrivals, plain, K, engram_cfg.vocab_size)
    update = engine.scheduler.update_from_output

    def recording_update(output, sampled):
        for request_id, drafts in output.scheduled_spec_decode_tokens.items():
            request = engine.scheduler.requests.get(request_id)
            got = sampled.get(request_id)
            if request is not None and got and len(drafts) == K:
                a = len(got) - 1
                oracle.seen.add(((request.num_tokens + a) % 2, a))
        return update(output, sampled)

    engine.scheduler.update_from_output = recording_update
    fast, _ = E.drive(engine, arrivals)
    E.assert_pool_is_whole(engine)
    assert oracle.seen == COMBOS, sorted(COMBOS - oracle.seen)
    assert _tokens(fast) == _tokens(plain)
    for rid, out in fast.items():
        got, want = out.outputs[0].logprobs, plain[rid].outputs[0].logprobs
        assert [sorted(e) for e in got] == [sorted(e) for e in want]
        for g, w in zip(got, want, strict=True):
            assert [g[t].logprob for t in sorted(g)] == pytest.approx(
                [w[t].logprob for t in sorted(w)], abs=1e-5
            )
    st = engine.stats
    assert 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens
    assert st.compilations_after_warm_up == 0


class _Always:
    """Proposes ``num_tokens`` copies of one token whatever the sequence (never empty)."""

    def propose(self, tokens, num_tokens=None):
        return [3] * (K if num_tokens is None else num_tokens)


def test_a_runner_that_does_not_plan_ahead_refuses_rows_planned_past_drafts(
    engram_params, engram_cfg
):
    """The synchronous engine's runner compiles its step without the move back
    (``plans_ahead=False``). A row the scheduler planned past drafts in flight must then stop
    the step with an error naming the request, not run at optimistic positions. The asynchronous
    engine (the same compiled step as the test above) is made to feed such rows to a runner
    marked as not planning ahead."""
    prompt = tuple(range(3, 16))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": K}
    engine = E.make_engine(engram_params, engram_cfg, async_scheduling=True,
                           num_gpu_blocks_override=28, speculative_config=spec)  # fmt: skip
    engine.proposer = _Always()
    engine.runner.plans_ahead = False
    with pytest.raises(RuntimeError, match=r"'r0' was planned past \d drafts in flight.*"
                       r"plans_ahead=False"):  # fmt: skip
        E.drive(engine, [E.Arrival(0, "r0", prompt, params)])


# -- the trained drafter: partial acceptance, batches that drain ---------------------------------


def test_trained_dspark_async_drains_and_equals_plain_decoding():
    """`LLM("tiny_v41_trained")` with its DSpark drafter (k = 5), asynchronous: two waves of
    four requests on held-out Python drain to 3, to 1 and to 0 while drafting (vllm#51593),
    greedy and sampled (temperature, top-p, min_tokens, logprobs); the drafter is trained, so
    verifications accept some drafts and reject others. Tokens, logprobs and finish reasons
    equal the synchronous engine without speculation; nothing hangs; every block is free."""
    from benchmarks.speculative import heldout_prefixes
    from serving import LLM

    def build(**kw):
        return LLM(
            "tiny_v41_trained", dtype="float32", max_model_len=256, max_num_seqs=4,
            max_num_batched_tokens=64, token_buckets=(64,), num_gpu_blocks_override=200,
            compilation_cache_dir=None, **kw,
        )  # fmt: skip

    plain_llm = build(async_scheduling=False)
    prefixes = heldout_prefixes(plain_llm.get_tokenizer(), 48, 8)
    arrivals = []
    waves = [(0, (6, 24, 24, 40)), (70, (5, 18, 18, 30))]
    for w, (step, lengths) in enumerate(waves):
        for i, n in enumerate(lengths):
            kw = dict(max_tokens=n, ignore_eos=True, logprobs=1)
            if i % 2:
                kw.update(temperature=0.8, top_p=0.9, seed=10 * w + i, min_tokens=min(n, 4))
            else:
                kw.update(temperature=0.0)
            prompt = tuple(prefixes[4 * w + i])
            arrivals.append(E.Arrival(step, f"w{w}r{i}", prompt, SamplingParams(**kw)))
    plain, _ = E.drive(plain_llm.llm_engine, arrivals)
    llm = build(speculative_config={"method": "dspark", "num_speculative_tokens": 5})
    engine = llm.llm_engine
    assert engine.async_scheduling
    fast, running = E.drive(engine, arrivals, max_steps=300)
    E.assert_pool_is_whole(engine)
    for rid, out in plain.items():
        got, want = fast[rid].outputs[0], out.outputs[0]
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason), rid
        assert [list(e) for e in got.logprobs] == [list(e) for e in want.logprobs]
        flat = [e[t].logprob for e in got.logprobs for t in e]
        assert flat == pytest.approx([e[t].logprob for e in want.logprobs for t in e], abs=1e-4)
    first, second = running[:70], running[70:]
    for wave in (first, second):
        assert {3, 1}.issubset(wave), running
    assert first[-1] == 0 and second[-1] == 0, running
    st = engine.stats
    assert 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens
    assert st.spec_mean_acceptance_length > 1.2
    assert st.compilations_after_warm_up == 0
    per_request = sum(o.metrics.spec_num_accepted_tokens for o in fast.values())
    assert per_request == st.spec_num_accepted_tokens


def test_optimistic_reservation_and_correction_in_the_scheduler():
    """The scheduler's side alone (a device drafter, k = 3, two steps in flight): after a
    sampling step it plans 3 placeholder drafts; the next step is planned 1 + 3 tokens past
    the drafts in flight as if all were accepted (blocks reserved for that); when the output
    says 1 of 3 was accepted, the computed count drops by the 2 rejected, the blocks stay,
    and the following plan again asks 1 + 3 tokens. `_finished_in_flight` counts one token
    per step in flight, never the drafts: a request 2 tokens short of max_tokens with one step
    in flight is still planned."""
    from cache import Request
    from serving.scheduler import StopCriteria
    from tests.serving.test_scheduler import make_kv_cache_manager, scheduler_over

    scheduler = scheduler_over(
        make_kv_cache_manager(64, max_model_len=256), max_model_len=256, max_num_seqs=4,
        max_num_batched_tokens=64, async_scheduling=True, num_spec_tokens=K,
        drafts_on_device=True,
    )  # fmt: skip
    manager = scheduler.kv_cache_manager
    request = Request("a", list(range(3, 23)), hash_block_size=manager.hash_block_size,
                      max_tokens=8)  # fmt: skip
    scheduler.add_request(request, StopCriteria())
    first = scheduler.schedule()  # the whole prompt; it samples
    assert first.num_scheduled_tokens == {"a": 20} and "a" in first.sampling_req_ids
    assert request.spec_token_ids == [-1] * K
    second = scheduler.schedule()  # planned before the first's token is known
    assert second.num_scheduled_tokens == {"a": 1 + K}
    assert second.scheduled_spec_decode_tokens == {"a": [-1] * K}
    assert request.num_computed_tokens == 20 + 1 + K
    held = [len(ids) for ids in scheduler.kv_cache_manager.get_block_ids("a")]
    scheduler.update_from_output(first, {"a": [5]})
    third = scheduler.schedule()  # optimistic: past the 3 drafts of the second step
    assert third.num_scheduled_tokens == {"a": 1 + K}
    assert request.num_computed_tokens == 20 + 2 * (1 + K)
    scheduler.update_from_output(second, {"a": [6, 7]})  # 1 of 3 accepted, then the bonus
    assert request.num_computed_tokens == 20 + 2 * (1 + K) - 2
    assert request.num_output_tokens == 3
    assert all(len(ids) >= n for ids, n in zip(scheduler.kv_cache_manager.get_block_ids("a"), held))
    # 3 outputs, one step in flight (at least 1 more): 4 < max_tokens 8, so it is planned
    fourth = scheduler.schedule()
    assert fourth.num_scheduled_tokens == {"a": 1 + K}
    scheduler.update_from_output(third, {"a": [8, 9, 10, 11]})  # all 3 accepted: 7 outputs
    # 7 outputs and one step in flight reach max_tokens 8 whatever it accepts: not planned
    assert scheduler.schedule().total_num_scheduled_tokens == 0
    result = scheduler.update_from_output(fourth, {"a": [12, 13]})
    assert result.new_token_ids == {"a": [12]} and "a" in result.finished
    assert scheduler.kv_cache_manager.num_free_blocks == 63
