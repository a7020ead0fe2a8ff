"""`serving.detokenizer.IncrementalText` against decoding every token again: after every growth
of the list, for the built-in byte tokenizer, the shipped model's tokenizer.json, a tokenizer
that strips the text's leading space (as SentencePiece's decoder does) and one whose text is
not a concatenation at all (no JAX involved)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.tokenizer import ByteTokenizer, HFTokenizer
from serving.detokenizer import IncrementalText

SHIPPED = Path(__file__).resolve().parents[2] / "dsv4" / "weights" / "tiny_v41_trained"


def _grow(decode, ids: list[int], cuts: list[int], appends: bool = True) -> None:
    """Feed ``ids`` in pieces of the sizes ``cuts``; every call equals the whole decode, and
    (for a tokenizer whose text grows at its end) the settled characters never change."""
    inc = IncrementalText(decode)
    n, settled = 0, ""
    for size in [*cuts, len(ids)]:
        n = min(len(ids), n + size)
        text = inc.text(ids[:n])
        assert text == decode(ids[:n]), (ids[:n], text)
        assert text.startswith(settled) or not appends
        settled = text[: inc.num_kept_chars]
        if n == len(ids):
            break


# multi-byte characters split across tokens, stray continuation bytes, specials, unknown ids
_byte_ids = st.lists(
    st.one_of(
        st.integers(0, 262),
        st.sampled_from([0xC3 + 3, 0xA9 + 3, 0xE2 + 3, 0x82 + 3, 0xAC + 3, 0xF0 + 3, 0x9F + 3]),
    ),
    max_size=40,
)
_cuts = st.lists(st.integers(1, 5), max_size=40)


@settings(max_examples=200, deadline=None)
@given(ids=_byte_ids, cuts=_cuts)
def test_byte_tokenizer_text_equals_decoding_everything(ids, cuts):
    _grow(ByteTokenizer().decode, ids, cuts)


@pytest.fixture(scope="module")
def shipped():
    return HFTokenizer.from_file(SHIPPED)


@settings(max_examples=100, deadline=None)
@given(data=st.data(), cuts=_cuts)
def test_shipped_tokenizer_text_equals_decoding_everything(shipped, data, cuts):
    vocab = shipped.vocab_size
    ids = data.draw(st.lists(st.integers(0, vocab - 1), max_size=40))
    _grow(shipped.decode, ids, cuts)


def test_shipped_tokenizer_on_real_text_and_emoji(shipped):
    ids = shipped.encode("Déjà vu: the café's 🚀 rocket — ünïcödé text, split anywhere.")
    for step in (1, 2, 3):
        _grow(shipped.decode, ids, [step] * len(ids))


_WORDS = ["▁the", "▁cat", "s", "▁sat", "▁", "on", "▁mat", "."]


def _strip_leading_space(ids) -> str:
    return "".join(_WORDS[i] for i in ids).replace("▁", " ").removeprefix(" ")


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(0, len(_WORDS) - 1), max_size=30), cuts=_cuts)
def test_leading_space_tokenizer_text_equals_decoding_everything(ids, cuts):
    _grow(_strip_leading_space, ids, cuts)


def test_a_tokenizer_that_does_not_append_is_decoded_whole():
    def backwards(ids) -> str:  # later tokens go in front: the window never starts with its context
        return "".join(chr(ord("a") + i) for i in ids)[::-1]

    _grow(backwards, list(range(12)), [1, 2, 1, 3, 1, 4], appends=False)


def test_each_call_decodes_only_the_last_tokens():
    seen = []

    def decode(ids):
        seen.append(len(ids))
        return ByteTokenizer().decode(ids)

    inc = IncrementalText(decode)
    ids = ByteTokenizer().encode("a steady stream of ascii text " * 20)
    for n in range(1, len(ids) + 1):
        inc.text(ids[:n])
    assert max(seen) <= 2  # never the whole list


def _first_stop(text: str, stops: list[str]) -> str | None:
    """The naive rule: the first stop string, in the order given, found anywhere."""
    return next((s for s in stops if s in text), None)


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet="ab é€", max_size=30),
    stops=st.lists(st.text(alphabet="ab é€", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=_cuts,
    include=st.booleans(),
)
def test_stop_strings_found_on_new_text_as_on_the_whole(text, stops, cuts, include):
    """`Engine._check_stop_strings` looks only where a new stop string can be; each step it
    finds what a search of the whole text finds, and cuts the text at the same place."""
    from types import SimpleNamespace

    from serving.engine import Engine
    from serving.request import Request
    from serving.sampling_params import SamplingParams

    tok = ByteTokenizer()
    ids = tok.encode(text)
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    request = Request("r", [0], params)
    engine = SimpleNamespace(tokenizer=tok)
    n = 0
    for size in [*cuts, len(ids)]:
        size = min(size, len(ids) - n)
        request.append_output_token_ids(ids[n : n + size])
        n += size
        whole = tok.decode(ids[:n])
        want = _first_stop(whole, stops)
        got = Engine._check_stop_strings(engine, request)
        assert got == want
        if want is not None:
            end = whole.find(want) + (len(want) if include else 0)
            assert request.text == whole[:end]
            return
        if n == len(ids):
            return
