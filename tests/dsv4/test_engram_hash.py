"""`dsv4.engram_hash` against its definition (`docs/model.md#engram`), written out again below
with Python integers (no numpy arithmetic, no vectorisation)."""

from __future__ import annotations

import numpy as np
import pytest

from dsv4.engram_hash import DEAD, EngramHashing, compressed_token_map, is_prime, next_prime

SMALL = dict(
    layer_ids=(1, 14),
    max_ngram_size=4,
    n_heads=2,
    engram_vocab_size=100,
    compressed_vocab_size=50,
    pad_id=2,
)


def _trial_division(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, int(n**0.5) + 1))


def test_is_prime_against_trial_division():
    assert [n for n in range(3000) if is_prime(n)] == [n for n in range(3000) if _trial_division(n)]
    near = range(16_000_000 - 200, 16_000_000 + 200)
    assert [n for n in near if is_prime(n)] == [n for n in near if _trial_division(n)]
    assert is_prime(2**61 - 1) and not is_prime(2**61 + 1)
    assert next_prime(13, set()) == 17 and next_prime(13, {17}) == 19


def test_primes_offsets_multipliers():
    h = EngramHashing.build(**SMALL)
    # successive primes above 99 in (layer, n, head) order, none reused
    want = [101, 103, 107, 109, 113, 127, 131, 137, 139, 149, 151, 157]
    assert h.primes.reshape(-1).tolist() == want
    assert h.primes.shape == (2, 3, 2) and h.num_columns == 6
    for layer in range(2):
        flat = h.primes[layer].reshape(-1).tolist()
        assert h.offsets[layer].tolist() == [sum(flat[:c]) for c in range(6)]
        assert h.table_rows()[layer] == sum(flat)
    bound = (np.iinfo(np.int64).max // 50) // 2
    for row, layer in zip(h.multipliers, SMALL["layer_ids"]):
        draw = np.random.default_rng(10007 * layer).integers(0, bound, size=4, dtype=np.int64)
        assert row.tolist() == (draw * 2 + 1).tolist()
        assert all(int(m) % 2 == 1 and int(m) * 49 < 2**63 for m in row)


def test_released_table_sizes():
    """V4.1-Flash's config: engram_num_embeddings [384006168, 384016682] for layers 1 and 14
    (8 heads, n-grams up to 4, engram_vocab_size 16M): the sums of the primes drawn here."""
    released = dict(n_heads=8, engram_vocab_size=16_000_000, compressed_vocab_size=99092)
    h = EngramHashing.build(**(SMALL | released))
    assert h.table_rows() == (384006168, 384016682)
    assert h.num_columns == 24


def _row_ids(h: EngramHashing, hist: list[int], p: int) -> list[list[int]]:
    """One position's ids, from the definition, in Python ints."""
    tokens, blocked = [], False
    for k in range(h.max_ngram_size):
        blocked = blocked or p - k < 0 or hist[p - k] == DEAD
        tokens.append(h.pad_id if blocked else hist[p - k])
    out = []
    for li in range(len(h.layer_ids)):
        mult = [int(m) for m in h.multipliers[li]]
        ids, x = [], tokens[0] * mult[0]
        for n in range(2, h.max_ngram_size + 1):
            x ^= tokens[n - 1] * mult[n - 1]
            for head in range(h.n_heads):
                col = (n - 2) * h.n_heads + head
                ids.append(x % int(h.primes[li, n - 2, head]) + int(h.offsets[li, col]))
        out.append(ids)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_hash_ids_follow_the_definition(seed):
    h = EngramHashing.build(**SMALL)
    rng = np.random.default_rng(seed)
    hist = rng.integers(0, 50, size=40).tolist()
    for p in rng.choice(40, size=6, replace=False).tolist():
        hist[p] = DEAD
    got = h.hash_ids(hist)
    assert got.shape == (40, 2, 6) and got.dtype == np.int64
    assert got.tolist() == [_row_ids(h, hist, p) for p in range(40)]
    # every id in its (n, head) range
    lo = h.offsets[None]
    hi = lo + h.primes.reshape(2, -1)[None]
    assert np.all((got >= lo) & (got < hi))
    # a chunk hashes as it does inside the whole sequence (look-back reads the history)
    for s, e in [(0, 1), (3, 17), (17, 40), (39, 40), (5, 5)]:
        np.testing.assert_array_equal(h.hash_ids(hist[:e], s), got[s:e])
        np.testing.assert_array_equal(h.hash_ids(hist, s, e), got[s:e])


def test_blocking_is_cumulative():
    h = EngramHashing.build(**SMALL)
    pad = h.pad_id
    hist = [7, 8, DEAD, 9, 10, 11, 12]
    ids = h.hash_ids(hist)
    # position 0: every look-back is the pad, so it equals a sequence of pads ending in 7
    np.testing.assert_array_equal(ids[0], h.hash_ids([pad, pad, pad, 7], 3)[0])
    # position 4 looks back to 9 and then hits DEAD: that and every longer look-back is the pad
    np.testing.assert_array_equal(ids[4], h.hash_ids([pad, pad, 9, 10], 3)[0])
    # the DEAD position itself hashes only pads
    np.testing.assert_array_equal(ids[2], h.hash_ids([pad] * 4, 3)[0])


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(max_ngram_size=1), "max_ngram_size=1"),
        (dict(n_heads=0), "n_heads=0"),
        (dict(layer_ids=()), "layer_ids"),
        (dict(layer_ids=(1, 1)), "layer_ids"),
        (dict(pad_id=50), "pad_id=50"),
    ],
)
def test_build_rejects_bad_arguments(change, message):
    with pytest.raises(ValueError, match=message):
        EngramHashing.build(**{**SMALL, **change})


def test_hash_ids_reject_bad_input():
    h = EngramHashing.build(**SMALL)
    with pytest.raises(ValueError, match=r"compressed ids \[50\]"):
        h.hash_ids([1, 50, 3])
    with pytest.raises(ValueError, match=r"compressed ids \[-2\]"):
        h.hash_ids([1, -2])
    with pytest.raises(ValueError, match="start=3"):
        h.hash_ids([1, 2], 3)
    with pytest.raises(ValueError, match="1-D"):
        h.hash_ids([[1, 2]])


def test_compressed_token_map():
    from tokenizers import Tokenizer, models

    vocab = ["<pad>", "The", "the", " THE ", "café", "cafe", " ", "\n", "\t\t", "x", "ﬁ", "fi"]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<pad>"))
    ids, size = compressed_token_map(tok)
    assert ids.tolist() == [0, 1, 1, 1, 2, 2, 3, 3, 3, 4, 5, 5]
    assert size == 6
    # ids are handed out in token order of first appearance
    assert ids[0] == 0 and sorted(set(ids.tolist())) == list(range(size))


@pytest.mark.parametrize(
    "same, different",
    [
        (["Hello", "hello", "HELLO", " hello "], ["hellos", "help"]),  # case, outer spaces
        (["naïve", "naive", "NAÏVE"], ["nave"]),  # accents stripped
        (["Ｈｅｌｌｏ", "hello"], ["ｈ"]),  # full-width forms (NFKC)
        (["a  b", "a b", "a\t\nb"], ["ab", "a-b"]),  # whitespace runs collapse, not vanish
        (["\u00c5", "A\u030a", "a"], ["b"]),  # composed / decomposed Å, accent stripped
        ([" ", "  ", "\n"], ["", "x"]),  # one space stays a token of its own
    ],
)
def test_normalisation_collides_exactly_what_it_should(same, different):
    from tokenizers import Tokenizer, models

    vocab = ["<unk>", *same, *different]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    ids, _ = compressed_token_map(tok)
    group = {int(ids[vocab.index(t)]) for t in same}
    assert len(group) == 1, (same, ids.tolist())
    for t in different:
        assert int(ids[vocab.index(t)]) not in group, (t, ids.tolist())
