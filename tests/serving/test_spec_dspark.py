"""Speculative decoding with the model's DSpark drafter (`serving.spec_decode.DSparkProposer`,
`dsv4.paged.draft`): the config's errors, the drafts the engine proposes (equal to drafting from
scratch over the same prefix), outputs equal to decoding without speculation, and the shipped
trained model's acceptance through the engine against the offline figure."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4 import dspark, reference
from serving.spec_decode import DSparkProposer, SpeculativeConfig
from tests.serving.engine_testing import (
    MAX_MODEL_LEN,
    assert_pool_is_whole,
    drive,
    make_engine,
    workload,
)

# tiny_v41_full's two window groups (see test_layout_of_three_draft_layers) take more blocks
# per request than tiny_v41's one: 28 blocks still preempt on this workload, and hit
NUM_BLOCKS = 28


def _spec(k: int) -> dict:
    return {"method": "dspark", "num_speculative_tokens": k}


# -- the config ----------------------------------------------------------------------------------


def test_refusals_name_the_value(tiny_params, tiny_cfg, engram_params, engram_cfg):
    with pytest.raises(ValueError, match=r"num_speculative_tokens=4: .*dspark_block_size=3"):
        make_engine(engram_params, engram_cfg, async_scheduling=False, speculative_config=_spec(4))
    with pytest.raises(ValueError, match="no DSpark drafter"):
        make_engine(tiny_params, tiny_cfg, async_scheduling=False, speculative_config=_spec(2))
    with pytest.raises(ValueError, match=r"method='dspark'.*async_scheduling=False"):
        make_engine(engram_params, engram_cfg, async_scheduling=True, speculative_config=_spec(2))
    config = SpeculativeConfig.from_dict(_spec(3))
    with pytest.raises(ValueError, match="needs method 'dspark'"):
        DSparkProposer(dataclasses.replace(config, method="ngram"), engram_cfg, 64)


# -- drafts and outputs --------------------------------------------------------------------------


class _Recorder:
    """The engine's DSpark proposer, recording each proposal: (the request's tokens, drafts)."""

    def __init__(self, inner: DSparkProposer) -> None:
        self.inner = inner
        self.proposals: list[tuple[list[int], list[int]]] = []

    def propose_step(self, requests, step_output):
        out = self.inner.propose_step(requests, step_output)
        for request in requests:
            if request.request_id in out:
                self.proposals.append((list(request.all_token_ids), out[request.request_id]))
        return out


@functools.cache
def _streams_fn(cfg):
    return jax.jit(
        lambda params, tokens: reference.forward_streams(
            params, cfg, tokens, cfg.dspark_target_layer_ids
        )
    )


def _reference(params, cfg, sequences):
    """The reference's logits and drafter input of every sequence (padded to the engine's
    model length: the forward is causal)."""
    toks = np.zeros((len(sequences), MAX_MODEL_LEN), np.int32)
    for i, seq in enumerate(sequences):
        toks[i, : len(seq)] = seq
    logits, streams = _streams_fn(cfg)(params, jnp.asarray(toks))
    return np.asarray(logits), dspark.target_hidden(cfg, streams)


def _check_greedy_and_drafts(params, cfg, arrivals, finals, proposals):
    """Every output token is the reference's greedy pick after the tokens before it, and every
    proposal is `dspark.draft_from_hidden` of its prefix (the reference's target hidden states,
    the token sampled last opening the block)."""
    sequences = [list(a.prompt) + finals[a.request_id].outputs[0].token_ids for a in arrivals]
    logits, hidden = _reference(params, cfg, sequences)
    for i, a in enumerate(arrivals):
        n = len(a.prompt)
        got = sequences[i][n:]
        assert got == logits[i, n - 1 : n - 1 + len(got)].argmax(-1).tolist(), a.request_id
    rows, starts, nexts, drafts = [], [], [], []
    for tokens, d in proposals:
        owner = next(i for i, s in enumerate(sequences) if s[: len(tokens)] == tokens)
        rows.append(owner)
        starts.append(len(tokens) - 1)  # the block opens with the last token, at its position
        nexts.append(tokens[-1])
        drafts.append(d)
    want = jax.jit(dspark.draft_from_hidden, static_argnums=1)(
        params, cfg, hidden[np.asarray(rows)], jnp.asarray(nexts), lengths=jnp.asarray(starts)
    )
    want = np.asarray(want.tokens)
    for j, d in enumerate(drafts):
        assert d == want[j, : len(d)].tolist(), (proposals[j][0], d, want[j])


def _run(params, cfg, arrivals, *, spec=None, aborts=None, record=False, **kw):
    engine = make_engine(
        params,
        cfg,
        async_scheduling=False,
        speculative_config=spec,
        num_gpu_blocks_override=NUM_BLOCKS,
        **kw,
    )
    recorder = None
    if record:
        recorder = engine.proposer = _Recorder(engine.proposer)
    finals, _ = drive(engine, arrivals, aborts=aborts)
    assert_pool_is_whole(engine)
    return finals, engine, recorder


def _tokens(finals):
    return {rid: out.outputs[0].token_ids for rid, out in finals.items()}


@pytest.mark.parametrize(
    ("k", "pool_layout", "budget"),
    [
        pytest.param(3, "aliased", 32, id="k3-aliased"),
        pytest.param(1, "separate", 13, id="k1-separate-budget13", marks=pytest.mark.slow),
        pytest.param(5, "aliased", 32, id="k5-block5", marks=pytest.mark.slow),
    ],
)
def test_greedy_drafts_equal_drafting_from_scratch(engram_params, engram_cfg, k, pool_layout,
                                                   budget):  # fmt: skip
    """tiny_v41_full (Engram, 3-stage drafter) on a workload with chunked prefill, prefix hits,
    preemption and an abort, NaN-filled pools: the engine's greedy outputs are the reference's
    greedy tokens (what the engine without speculation decodes, tests/serving/test_engine.py),
    and every draft it proposed is what `dspark` drafts from scratch after the same prefix.
    k = 5 drafts blocks of 5 (the config's dspark_block_size raised: the params do not depend
    on it)."""
    cfg = engram_cfg.replace(dspark_block_size=max(k, engram_cfg.dspark_block_size))
    arrivals = workload(cfg, 6, num_requests=10)
    victim = max(arrivals[:4], key=lambda a: a.params.max_tokens)
    aborts = {victim.step + 2: victim.request_id}
    finals, engine, recorder = _run(
        engram_params, cfg, arrivals, spec=_spec(k), aborts=aborts, record=True,
        pool_layout=pool_layout, max_num_batched_tokens=budget,
    )  # fmt: skip
    st = engine.stats
    assert st.num_preemptions > 0 and st.prefix_cache_hits > 0
    assert st.spec_num_drafts > 10 and len(recorder.proposals) > 20
    assert finals[victim.request_id].outputs[0].finish_reason == "abort"
    _check_greedy_and_drafts(engram_params, cfg, arrivals, finals, recorder.proposals)
    assert st.compilations_after_warm_up == 0


@pytest.mark.slow
def test_sampled_outputs_equal_plain_decoding(engram_params, engram_cfg):
    """Temperature, top-p and penalties, seeded: each verified position is drawn with the key of
    its position, so the tokens (and logprobs) are those of the engine without speculation."""
    arrivals = workload(
        engram_cfg, 6, num_requests=10, temperature=0.8, top_p=0.9, presence_penalty=0.3,
        logprobs=2,
    )  # fmt: skip
    arrivals = [
        dataclasses.replace(a, params=dataclasses.replace(a.params, seed=i))
        for i, a in enumerate(arrivals)
    ]
    plain, _, _ = _run(engram_params, engram_cfg, arrivals)
    fast, engine, _ = _run(engram_params, engram_cfg, arrivals, spec=_spec(2))
    assert _tokens(fast) == _tokens(plain)
    assert engine.stats.spec_num_drafts > 10
    for rid, out in fast.items():
        got, want = out.outputs[0].logprobs, plain[rid].outputs[0].logprobs
        assert [sorted(e) for e in got] == [sorted(e) for e in want]
