"""The DSpark drafter over the paged pools (`dsv4.paged.draft`) against drafting from scratch.

The paged step harness teacher-forces sequences of the tiny model with Engram and the 3-stage
drafter through the real scheduler (chunked prefill, decodes mixed with prefills, prefix hits,
preemption, random drafts of which the wrong ones are rejected), over NaN-filled pools. After
every step each row seeds the drafter's caches (the draft layers' window groups) and drafts the
block after its last true token: at ``start`` = the first position whose token is not the
sequence's (a rejected draft) or the end of the row. Before drafting, the drafter's rows at
positions >= start are overwritten with NaN (the rows a verification writes for rejected drafts
and the ones after them): the drafter must never read them, now or in any later step, and every
block must equal `dspark.draft_from_hidden` over the reference's target hidden states of the
prefix (logits and confidence within 1e-4, the same tokens).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_harness import Harness, Seq, random_schedule

from dsv4 import dspark
from dsv4 import layers as L
from dsv4.paged import pools as P
from dsv4.paged import records as R
from dsv4.paged.draft import draft_cache_names, draft_paged, seed_drafter
from dsv4.paged.step import paged_forward_streams
from tests.dspark_scratch import reference_streams, scratch_blocks

TOL = 1e-4
WIDTH = 64  # every test sequence is at most this long


@functools.partial(jax.jit, static_argnames=("cfg", "layout"), donate_argnames=("pools",))
def _forward_and_seed(params, pools, batch, *, cfg, layout):
    h, pools, streams = paged_forward_streams(
        params, cfg, layout, pools, batch, cfg.dspark_target_layer_ids
    )
    pools = seed_drafter(params, cfg, layout, pools, batch, dspark.target_hidden(cfg, streams))
    return L.lm_head(params, h), pools


@functools.partial(jax.jit, static_argnames=("cfg", "layout"), donate_argnames=("pools",))
def _poison(pools, slots, *, cfg, layout):
    """NaN at ``slots[i]`` of draft cache i (-1: nothing)."""
    for i, name in enumerate(draft_cache_names(cfg)):
        nan = jnp.full((slots.shape[1], cfg.head_dim), jnp.nan, jnp.float32)
        pools = P.write_layer(layout, pools, name, slots[i], nan)
    return pools


_draft = jax.jit(draft_paged, static_argnames=("cfg", "layout"))


class DraftHarness(Harness):
    """The harness whose step also seeds and drafts (module docstring); ``blocks`` collects
    (sequence id, start, next token, DraftBlock row) of every drafted row."""

    def __init__(self, cfg, params, seqs, **kw) -> None:
        super().__init__(cfg, params, R.CacheFormats.EXACT, **kw)
        self.by_id = {s.request_id: s for s in seqs}
        self.blocks: list[tuple[int, int, int, tuple[np.ndarray, ...]]] = []
        self.num_poisoned = 0

    def run(self, step_requests):
        cfg, layout = self.cfg, self.layout
        batch = self.batch(step_requests)
        rows = batch.seq_lens.shape[0]
        start = np.zeros(rows, np.int32)
        nxt = np.zeros(rows, np.int32)
        for r, req in enumerate(step_requests):
            seq = self.by_id[req.req_id]
            own = [t == seq.token(req.start + i) for i, t in enumerate(req.token_ids)]
            first_wrong = own.index(False) if False in own else len(own)
            if req.start + first_wrong < len(seq.tokens):
                start[r] = req.start + first_wrong
                nxt[r] = seq.token(start[r])
        # the drafter's rows of this step at positions >= its row's start become NaN
        names = draft_cache_names(cfg)
        pos, req_of = batch.positions, batch.token_req
        doomed = (pos >= 0) & (start[req_of] > 0) & (pos >= start[req_of])
        slots = np.stack(
            [np.where(doomed, batch.window_slots[layout.group_of(n)], -1) for n in names]
        ).astype(np.int32)
        self.num_poisoned += int(doomed.sum())
        batch = jax.tree.map(jnp.asarray, batch)
        logits, self.pools = _forward_and_seed(
            self.params, self.pools, batch, cfg=cfg, layout=layout
        )
        self.pools = _poison(self.pools, jnp.asarray(slots), cfg=cfg, layout=layout)
        block = _draft(self.params, cfg, layout, self.pools, batch, nxt, start)
        block = jax.tree.map(np.asarray, block)
        for r, req in enumerate(step_requests):
            if start[r]:
                sid = self.by_id[req.req_id].sid
                self.blocks.append((sid, int(start[r]), int(nxt[r]), tuple(x[r] for x in block)))
        self.stats.num_steps += 1
        return np.asarray(logits)


def _from_scratch(params, cfg, seqs, blocks):
    """`dspark.draft_from_hidden` of every recorded row, over the reference's streams."""
    _, hidden = reference_streams(params, cfg, [s.tokens for s in seqs])
    rows, starts, nexts = ([b[j] for b in blocks] for j in range(3))
    return scratch_blocks(params, cfg, hidden, rows, starts, nexts)


@pytest.mark.parametrize(
    "layout_kind", ["aliased", pytest.param("separate", marks=pytest.mark.slow)]
)
def test_paged_drafter_equals_drafting_from_scratch(engram_params, engram_cfg, layout_kind):
    cfg, params = engram_cfg, engram_params
    rng = np.random.default_rng(2)
    prefix = rng.integers(3, 300, 24)  # ids past 258 are DEAD for Engram: both kinds occur
    seqs = []
    for i in range(6):
        length = int(rng.integers(28, WIDTH + 1))
        tail = rng.integers(3, 300, length)
        shares = i % 3 > 0  # behind the shared prefix, prompts past it (prefix hits)
        tokens = np.concatenate([prefix, tail])[:length] if shares else tail
        prompt = int(rng.integers(len(prefix) + 2 if shares else 2, length))
        seqs.append(Seq(i, tokens.astype(np.int32), prompt))
    h = DraftHarness(cfg, params, seqs, layout_kind=layout_kind, num_blocks=32,
                     num_speculative_tokens=3)  # fmt: skip
    random_schedule(h, seqs, rng, spec_k=3, max_running=3)
    assert h.stats.num_draft_tokens > h.stats.num_accepted_tokens > 0
    assert any(h.stats.prefix_hits) and h.stats.num_preempted > 0
    assert h.num_poisoned > 0
    want = _from_scratch(params, cfg, seqs, h.blocks)
    got = [np.stack([b[3][j] for b in h.blocks]) for j in range(3)]
    np.testing.assert_allclose(got[0], want.logits, atol=TOL)
    np.testing.assert_array_equal(got[1], want.tokens)
    np.testing.assert_allclose(got[2], want.confidence, atol=TOL)
