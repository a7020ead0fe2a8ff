"""Rejected drafts against the ratio-2 compressor's pairs.

A verify step writes every cache kind for its draft rows, also for the drafts it then rejects;
the next step overwrites them by position. For a ratio-2 KV source the delicate case is a pair
(positions 2i, 2i + 1) cut by the rejection: its first half is committed and sits in the
compressor's ring, its second half was a rejected draft and is computed again next step. Here
every way a rejection can fall relative to a pair boundary happens (the first rejected position
even or odd, at every draft index, and all drafts accepted), on several requests at once, and
every computed position's logits must equal `reference.forward` (fp32 records, NaN-filled
pools, both pool layouts).
"""

from __future__ import annotations

import numpy as np
import pytest
from paged_harness import Harness, Seq, plan_step, verify
from test_paged_step import compare, reference_logits

from dsv4.paged import records as R
from serving.input_batch import InputBatch
from serving.scheduler import StopCriteria

K = 3  # drafts per verify step
# every (parity of the first rejected position, draft index of the rejection); index K = none
COMBOS = {(parity, a) for parity in (0, 1) for a in range(K + 1)}


def _drafts(seq: Seq, num_tokens: int, a: int) -> list[int]:
    """K drafts for positions num_tokens..: the true tokens, wrong from index ``a`` on."""
    true = [seq.token(num_tokens + i) for i in range(K)]
    return [t if i < a else (t + 1 + i) % 250 + 3 for i, t in enumerate(true)]


def _schedule(h: Harness, seqs: list[Seq]) -> dict[int, set[tuple[int, int]]]:
    """Teacher-force the sequences through the scheduler; each verify step rejects where the
    request has not been rejected yet (by the first rejected position's parity and the draft
    index), cycling once all are covered. Returns what each sequence saw."""
    scheduler = h.scheduler(max_num_seqs=len(seqs), spec_k=K)
    inputs = InputBatch(len(seqs), engram_lookback=h.cfg.engram_lookback)
    by_id = {s.request_id: s for s in seqs}
    seen: dict[int, set[tuple[int, int]]] = {s.sid: set() for s in seqs}
    plan: dict[str, int] = {}  # request -> draft index its pending drafts go wrong at
    for s in seqs:
        request = h.mgr.new_request(s.request_id, s.tokens[: s.prompt_len].tolist(),
                                    max_tokens=len(s.tokens) - s.prompt_len + 1)  # fmt: skip
        scheduler.add_request(request, StopCriteria())
    while scheduler.has_unfinished_requests():
        output, rows, step_requests = plan_step(scheduler, inputs)
        assert step_requests, "nothing scheduled"
        logits = h.run(step_requests)
        sampled, t = {}, 0
        for row in rows:
            seq = by_id[row.request_id]
            num_real = row.num_tokens - row.num_drafts
            if row.samples:
                drafts = output.scheduled_spec_decode_tokens.get(row.request_id, [])
                got = verify(seq, row.start + num_real, drafts)
                sampled[row.request_id] = got
                inputs.learn(row.request_id, got)
                if len(drafts) == K:  # a full verify: record where it was rejected
                    a = len(got) - 1
                    first_rejected = row.start + num_real + a
                    seen[seq.sid].add((first_rejected % 2, a))
                num_real += len(got) - 1
            for i in range(num_real):
                h.logits[(seq.sid, row.start + i)] = logits[t + i]
            t += row.num_tokens
        result = scheduler.update_from_output(output, sampled)
        proposals = {}
        for request_id in result.new_token_ids:
            if request_id in result.finished:
                continue
            seq, n = by_id[request_id], scheduler.requests[request_id].num_tokens
            if n + K > len(seq.tokens):
                continue
            parity_of = {a: (n + a) % 2 for a in range(K + 1)}
            todo = [a for a in range(K + 1) if (parity_of[a], a) not in seen[seq.sid]]
            plan[request_id] = todo[0] if todo else (plan.get(request_id, 0) + 1) % (K + 1)
            proposals[request_id] = _drafts(seq, n, plan[request_id])
        scheduler.update_draft_token_ids(proposals)
    assert h.mgr.num_free_blocks == h.num_blocks - 1
    return seen


@pytest.mark.parametrize(
    "layout_kind", ["aliased", pytest.param("separate", marks=pytest.mark.slow)]
)
def test_rejections_at_every_offset_from_a_pair_boundary(tiny_params, tiny_cfg, layout_kind):
    rng = np.random.default_rng(3)
    seqs = []
    for sid, (length, prompt) in enumerate([(64, 13), (60, 20), (58, 7)]):
        tokens = rng.integers(3, tiny_cfg.vocab_size, length).astype(np.int32)
        seqs.append(Seq(sid, tokens, prompt))
    assert any(r == 2 for r in tiny_cfg.compress_ratios), "the tiny model needs a ratio-2 layer"
    ref = reference_logits(tiny_params, tiny_cfg, seqs)
    h = Harness(tiny_cfg, tiny_params, R.CacheFormats.EXACT, layout_kind, num_speculative_tokens=K)
    seen = _schedule(h, seqs)
    for sid, combos in seen.items():
        assert combos == COMBOS, (sid, sorted(COMBOS - combos))
    compare(h, ref, seqs, 1e-4)
