"""Speculative decoding with the model's DSpark drafter (`serving.spec_decode.DSparkProposer`,
`dsv4.paged.draft`): the config's errors, the drafts the engine proposes (equal to drafting from
scratch over the same prefix), outputs equal to decoding without speculation, and the shipped
trained model's acceptance through the engine against the offline figure."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from serving.spec_decode import DSparkProposer, SpeculativeConfig
from tests.dspark_scratch import reference_streams, scratch_blocks
from tests.serving.engine_testing import (
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


def _check_greedy_and_drafts(params, cfg, arrivals, finals, proposals):
    """Every output token is the reference's greedy pick after the tokens before it, and every
    proposal is `dspark.draft_from_hidden` of its prefix (the reference's target hidden states,
    the token sampled last opening the block)."""
    sequences = [list(a.prompt) + finals[a.request_id].outputs[0].token_ids for a in arrivals]
    logits, hidden = reference_streams(params, cfg, sequences)
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
    want = scratch_blocks(params, cfg, hidden, rows, starts, nexts).tokens
    for j, d in enumerate(drafts):
        assert d == want[j, : len(d)].tolist(), (proposals[j][0], d, want[j])


def _run(params, cfg, arrivals, *, spec=None, aborts=None, record=False, **kw):
    kw.setdefault("num_gpu_blocks_override", NUM_BLOCKS)
    engine = make_engine(params, cfg, async_scheduling=False, speculative_config=spec, **kw)
    recorder = None
    if record:
        recorder = engine.proposer = _Recorder(engine.proposer)
    finals, _ = drive(engine, arrivals, aborts=aborts)
    assert_pool_is_whole(engine)
    return finals, engine, recorder


def _tokens(finals):
    return {rid: out.outputs[0].token_ids for rid, out in finals.items()}


@pytest.mark.parametrize(
    ("k", "pool_layout", "budget", "seed", "blocks"),
    [
        pytest.param(3, "aliased", 32, 6, NUM_BLOCKS, id="k3-aliased"),
        pytest.param(
            1, "separate", 13, 11, NUM_BLOCKS, id="k1-separate-budget13", marks=pytest.mark.slow
        ),
        pytest.param(5, "aliased", 32, 6, NUM_BLOCKS, id="k5-block5", marks=pytest.mark.slow),
    ],
)
def test_greedy_drafts_equal_drafting_from_scratch(engram_params, engram_cfg, k, pool_layout,
                                                   budget, seed, blocks):  # fmt: skip
    """tiny_v41_full (Engram, 3-stage drafter) on a workload with chunked prefill, prefix hits,
    preemption and an abort, NaN-filled pools: the engine's greedy outputs are the reference's
    greedy tokens (what the engine without speculation decodes, tests/serving/test_engine.py),
    and every draft it proposed is what `dspark` drafts from scratch after the same prefix.
    k = 5 drafts blocks of 5 (the config's dspark_block_size raised: the params do not depend
    on it)."""
    cfg = engram_cfg.replace(dspark_block_size=max(k, engram_cfg.dspark_block_size))
    arrivals = workload(cfg, seed, num_requests=10)  # seeds and pools chosen to preempt
    victim = max(arrivals[:4], key=lambda a: a.params.max_tokens)
    aborts = {victim.step + 2: victim.request_id}
    finals, engine, recorder = _run(
        engram_params, cfg, arrivals, spec=_spec(k), aborts=aborts, record=True,
        pool_layout=pool_layout, max_num_batched_tokens=budget, num_gpu_blocks_override=blocks,
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


# -- the shipped trained drafter -----------------------------------------------------------------


@pytest.mark.slow
def test_trained_drafter_acceptance_equals_the_offline_figure():
    """`LLM("tiny_v41_trained", speculative_config=dspark k=5)`: the drafts the first
    verification after each of 32 held-out prefixes accepts (EngineStats.spec_*), against
    `training.dspark.acceptance` on the same prefixes (reference forward, drafting from
    scratch). Same prefixes, same greedy picks, same drafts: the means agree (up to a rare
    near-tie the paged and reference numerics break differently)."""
    from benchmarks.speculative import first_block_acceptance, heldout_prefixes
    from serving import LLM
    from training import dspark as train_dspark

    llm = LLM(
        "tiny_v41_trained",
        dtype="float32",
        speculative_config=_spec(5),
        max_model_len=160,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        token_buckets=(64,),
        num_gpu_blocks_override=512,
        compilation_cache_dir=None,
    )
    prefixes = heldout_prefixes(llm.get_tokenizer(), 128, 32)
    engine = first_block_acceptance(llm, prefixes)
    stream = np.asarray([t for p in prefixes for t in p])
    offline = train_dspark.acceptance(
        llm.engine.runner.params, llm.cfg, stream, prefix_len=128, num_prefixes=32
    )
    assert engine == pytest.approx(offline["mean_acceptance_length"], abs=0.1)
    assert engine > 0.3  # a trained drafter: docs/trained_model.md's figure is 0.67 of 5


# -- the layout ----------------------------------------------------------------------------------


def test_layout_of_three_draft_layers(engram_cfg):
    """tiny_v41_full's 11 window caches (8 backbone layers + 3 draft layers) form two groups of
    6 and 5, as vLLM's packed grouping makes them: no bucket mixes page sizes in equal counts, so
    nothing sets a repeat count, and the window bucket is split like a state bucket, only as far
    as a block of the widest other group (the full bucket) holds its pages. A request then holds
    window blocks in both groups (about twice tiny_v41's), which is why the engine tests' 24-block
    pool evicts what siblings would hit (its hits come back at 40 blocks)."""
    from cache.layout import for_model, swa_cache_name
    from dsv4.paged import pools as P
    from dsv4.paged import records as R

    desc = P.cache_desc(
        engram_cfg, R.EXACT, block_size=16, swa_block_size=4, num_speculative_tokens=3
    )
    config = for_model(desc, num_gpu_blocks_override=NUM_BLOCKS)
    windows = [g for g in config.kv_cache_groups if g.layer_names[0].endswith("swa_cache")]
    names = [swa_cache_name(i) for i in range(11)]
    assert [list(g.layer_names) for g in windows] == [names[0::2], names[1::2]]
    full = next(g for g in config.kv_cache_groups if "indexer" in " ".join(g.layer_names))
    page = P.PoolLayout.build(engram_cfg, config, R.EXACT).layer(names[0]).page_bytes
    full_bytes = (
        P.PoolLayout.build(engram_cfg, config, R.EXACT)
        .groups[config.kv_cache_groups.index(full)]
        .page_bytes
    )
    assert full_bytes // page == 9 < 11  # a block holds 9 window pages: 11 need two groups
    # the last draft layer's group is the EAGLE group (vLLM's positional rule)
    assert [g.is_eagle_group for g in windows] == [True, False]
