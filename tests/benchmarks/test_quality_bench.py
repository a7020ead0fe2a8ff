"""lab.quality and benchmarks.quality: the shipped model's bits per byte per cache layout (small sizes here).

With exact records and no bounded replay a prefix hit must not change a single logprob (the
cached records are what a recompute writes); bounded replay may, and its hit still serves the
prefix from the cache. Token byte counts are the BPE's own."""

from __future__ import annotations

import jax
import pytest

from benchmarks import quality as bench
from dsv4.checkpoint import load_pretrained, shipped_checkpoint
from dsv4.tokenizer import load_tokenizer
from lab import quality as Q


@pytest.fixture(scope="module")
def model():
    path = shipped_checkpoint("tiny_v41_trained")
    cfg, params = load_pretrained(path, progress=False)
    return cfg, params, load_tokenizer(path, cfg)


def test_token_bytes_are_the_text_s(model):
    _, _, tok = model
    nbytes = Q.token_bytes(tok)
    text = "def f(x):\n    return 'é' + x  # ünïcode\n"
    assert sum(nbytes[i] for i in tok.encode(text)) == len(text.encode("utf-8"))
    assert nbytes[tok.bos_id] == nbytes[tok.eos_id] == 0


@pytest.mark.parametrize("replay", [False, True])
def test_a_hit_scores_the_tail(model, replay):
    cfg, params, tok = model
    docs = Q.heldout_pieces(tok, 2, 48)
    with jax.default_matmul_precision("highest"):
        row = Q.score_layout(params, cfg, tok, docs, bounded_replay=replay, index_topk=8, prefix=32)
    assert row["scored_tokens"] == {"cold": 32, "hit": 32}
    assert row["mean_hit_tokens"] > 0
    assert 0 < row["cold_bits_per_byte"] < 16
    if not replay:
        assert row["hit_bits_per_byte"] == row["cold_bits_per_byte"]


def test_bad_flags():
    with pytest.raises(SystemExit):
        bench.main(["--tail", "0"])
    with pytest.raises(SystemExit):
        bench.main(["--topk", "16,0"])


def test_records_that_cannot_store_the_model_are_skipped_by_name(model):
    cfg, _, _ = model
    assert Q.records_fit("exact", cfg) is None and Q.records_fit("released", cfg) is None
    assert "cannot store dim=64" in Q.records_fit("sm90", cfg)
    row = {"records": "exact", "bounded_replay": True, "index_topk": 16, "cold_bits_per_byte": 1.5,
           "hit_bits_per_byte": 1.6, "mean_hit_tokens": 240.0}  # fmt: skip
    text = bench.table(
        {"tail": 8, "prefix": 8, "pieces": 1, "rows": [row], "skipped": {"sm90": "why"}}
    )
    assert "| exact | on | 16 | 1.5000 | 1.6000 | 240 |" in text
    assert "| sm90 | | | not for this model: why | | |" in text
