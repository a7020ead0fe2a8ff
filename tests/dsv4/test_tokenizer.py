"""The demo's tokenizers: the built-in byte tokenizer, tokenizer.json through `tokenizers`, and
`load_tokenizer`'s choice between them (no JAX involved, so this file runs in a second)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dsv4.config import tiny_v41
from dsv4.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
    pad_batch,
)

TEXTS = ["", "hello", "héllo wörld ✓ 🙂", "\x00\n\t control", "日本語のテキスト"]


def write_hf_tokenizer(directory, *, merges: bool = True, config: bool = True) -> str:
    """A small byte-level BPE tokenizer.json (specials <bos>=0, <eos>=1, <pad>=2). Without
    ``merges`` every byte is one token, like the byte tokenizer (but with other ids)."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300 if merges else 259,
        special_tokens=["<bos>", "<eos>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["hello world, hello there, the model"] * 20, trainer)
    path = str(directory / "tokenizer.json")
    tok.save(path)
    if config:
        (directory / "tokenizer_config.json").write_text(
            json.dumps({"bos_token": {"content": "<bos>"}, "eos_token": "<eos>"})
        )
    return path


# -- ByteTokenizer ------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_byte_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == [b + 3 for b in text.encode("utf-8")]
    assert all(3 <= i < 259 for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode(text, add_bos=True) == [0, *ids]


def test_byte_specials_and_interface():
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (0, 1, 2, 259)
    ids = tok.encode("ab")
    assert tok.decode([0, *ids, 2, 1, 1]) == "ab"  # specials are skipped
    assert tok.decode(np.array([0, *ids], np.int32)) == "ab"  # arrays are fine


def test_byte_decode_is_total():
    tok = ByteTokenizer()
    # ids past the byte range (a larger model vocabulary) stay visible as U+FFFD
    assert tok.decode([*tok.encode("a"), 300, 511, *tok.encode("b")]) == "a\ufffd\ufffdb"
    # a cut multi-byte character decodes with a replacement instead of raising
    cut = tok.encode("✓")[:2]
    assert tok.decode(cut) == "\ufffd"
    with pytest.raises(TypeError, match="str"):
        tok.encode(b"bytes")


# -- HFTokenizer --------------------------------------------------------------------------------


def test_hf_tokenizer_round_trip(tmp_path):
    path = write_hf_tokenizer(tmp_path)
    tok = HFTokenizer.from_file(tmp_path)
    assert isinstance(tok, Tokenizer)
    assert (tok.bos_id, tok.eos_id) == (0, 1)  # from tokenizer_config.json
    assert 259 < tok.vocab_size <= 300  # bytes + specials + the merges the corpus allows
    assert "tokenizer.json" in tok.name and path in tok.name
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.encode(text, add_bos=True) == [0, *ids]
    assert len(tok.encode("hello world")) < len(b"hello world")  # merges apply
    assert tok.decode([0, *tok.encode("hi"), 1]) == "hi"  # specials skipped


def test_hf_tokenizer_explicit_ids_and_errors(tmp_path):
    write_hf_tokenizer(tmp_path, config=False)
    tok = HFTokenizer.from_file(tmp_path / "tokenizer.json")
    assert (tok.bos_id, tok.eos_id) == (None, None)
    with pytest.raises(ValueError, match="no BOS id"):
        tok.encode("x", add_bos=True)
    assert HFTokenizer.from_file(tmp_path, bos_id=1, eos_id=0).bos_id == 1
    with pytest.raises(ValueError, match="eos_id=5000 is outside the vocabulary"):
        HFTokenizer.from_file(tmp_path, eos_id=5000)
    with pytest.raises(FileNotFoundError, match="no such tokenizer file"):
        HFTokenizer.from_file(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"not a valid tokenizer\.json"):
        HFTokenizer.from_file(bad)


# -- load_tokenizer -----------------------------------------------------------------------------


def test_load_tokenizer_picks_byte_without_tokenizer_json(tmp_path):
    cfg = tiny_v41()
    assert isinstance(load_tokenizer(None, cfg), ByteTokenizer)
    assert isinstance(load_tokenizer(tmp_path, cfg), ByteTokenizer)  # a dir without one
    with pytest.raises(FileNotFoundError, match="no such checkpoint directory"):
        load_tokenizer(tmp_path / "nope", cfg)


def test_load_tokenizer_picks_hf_with_config_ids(tmp_path):
    write_hf_tokenizer(tmp_path, config=False)
    cfg = tiny_v41(bos_token_id=0, eos_token_id=1)
    for where in (tmp_path, tmp_path / "tokenizer.json"):
        tok = load_tokenizer(where, cfg)
        assert isinstance(tok, HFTokenizer)
        assert (tok.bos_id, tok.eos_id) == (0, 1)


def test_load_tokenizer_refuses_what_the_model_cannot_embed(tmp_path):
    with pytest.raises(ValueError, match=r"needs vocab_size >= 259.*vocab_size=200"):
        load_tokenizer(None, tiny_v41(vocab_size=200))
    write_hf_tokenizer(tmp_path)
    n = HFTokenizer.from_file(tmp_path).vocab_size
    assert isinstance(load_tokenizer(tmp_path, tiny_v41(vocab_size=n)), HFTokenizer)
    with pytest.raises(ValueError, match=f"has {n} tokens but the model's vocab_size is {n - 1}"):
        load_tokenizer(tmp_path, tiny_v41(vocab_size=n - 1))


def test_pad_batch():
    rows, lengths = pad_batch([[5, 6, 7], [8]], pad_id=2)
    assert rows == [[5, 6, 7], [8, 2, 2]] and lengths == [3, 1]
    with pytest.raises(ValueError, match="at least one token"):
        pad_batch([[1], []])
    with pytest.raises(ValueError, match="at least one token"):
        pad_batch([])
