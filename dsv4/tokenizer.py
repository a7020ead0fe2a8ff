"""Text <-> token ids for the demo and the notebooks.

`ByteTokenizer` (no files: BOS 0, EOS 1, padding 2, byte ``b`` is ``b + 3``) and `HFTokenizer` (a
checkpoint's ``tokenizer.json``) share `Tokenizer`'s interface; `load_tokenizer` picks one.
``encode`` adds no special token unless ``add_bos=True``. Details: docs/model.md#dsv4tokenizer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import tokenizers

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "load_tokenizer",
    "pad_batch",
]

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


@runtime_checkable
class Tokenizer(Protocol):
    """What the demo needs from a tokenizer."""

    name: str

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int | None: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


def _ids(ids: Iterable[Any]) -> list[int]:
    """Plain Python ints from a list, a numpy array or a jax array row."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return [int(i) for i in ids]


class ByteTokenizer:
    """Byte-level tokenizer with no files: 0 BOS, 1 EOS, 2 PAD, byte ``b`` -> ``b + 3``.

    ``decode`` skips the three special ids and decodes the bytes as UTF-8 with
    ``errors="replace"``. Ids outside 0..258 (a model whose vocabulary is larger than 259, such
    as ``tiny_v41``'s 512, can produce them) are not bytes: each becomes U+FFFD, the replacement
    character, so that they stay visible instead of vanishing from the text.
    """

    name = "byte-level (built-in)"
    BOS = 0
    EOS = 1
    PAD = 2
    OFFSET = 3
    VOCAB_SIZE = 256 + OFFSET
    # `Tokenizer`'s names for the constants above
    bos_id, eos_id, pad_id, vocab_size = BOS, EOS, PAD, VOCAB_SIZE

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        ids = [b + self.OFFSET for b in text.encode("utf-8")]
        return [self.BOS, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        out = bytearray()
        for i in _ids(ids):
            if i in (self.BOS, self.EOS, self.PAD):
                continue
            if self.OFFSET <= i < self.VOCAB_SIZE:
                out.append(i - self.OFFSET)
            else:
                out += "\ufffd".encode()
        return out.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A checkpoint's ``tokenizer.json`` through the ``tokenizers`` package.

    ``bos_id`` / ``eos_id`` come from the arguments, else from ``tokenizer_config.json`` next to
    the file (its ``bos_token`` / ``eos_token``), else they are None. ``decode`` skips special
    tokens.
    """

    def __init__(self, tokenizer: Any, *, bos_id: int | None, eos_id: int | None, name: str):
        self._tok = tokenizer
        self._bos = bos_id
        self._eos = eos_id
        self.name = name
        size = self.vocab_size
        for what, value in (("bos_id", bos_id), ("eos_id", eos_id)):
            if value is not None and not 0 <= value < size:
                raise ValueError(f"{name}: {what}={value} is outside the vocabulary 0..{size - 1}")

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike[str],
        *,
        bos_id: int | None = None,
        eos_id: int | None = None,
    ) -> HFTokenizer:
        """Load ``path`` (a tokenizer.json, or a directory that holds one)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, TOKENIZER_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no such tokenizer file")
        try:
            tok = tokenizers.Tokenizer.from_file(path)
        except Exception as exc:  # the Rust side raises a plain Exception
            raise ValueError(f"{path}: not a valid tokenizer.json ({exc})") from exc
        if bos_id is None or eos_id is None:
            named = _special_tokens_from_config(os.path.dirname(path))
            if bos_id is None and named.get("bos_token") is not None:
                bos_id = tok.token_to_id(named["bos_token"])
            if eos_id is None and named.get("eos_token") is not None:
                eos_id = tok.token_to_id(named["eos_token"])
        return cls(tok, bos_id=bos_id, eos_id=eos_id, name=f"tokenizer.json ({path})")

    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def eos_id(self) -> int | None:
        return self._eos

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        if add_bos:
            if self._bos is None:
                raise ValueError(f"{self.name}: add_bos=True but the tokenizer has no BOS id")
            ids = [self._bos, *ids]
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(_ids(ids), skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size})"


def _special_tokens_from_config(directory: str) -> dict[str, str | None]:
    """``bos_token`` / ``eos_token`` strings of a tokenizer_config.json, when present."""
    path = os.path.join(directory, TOKENIZER_CONFIG_FILE)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    out: dict[str, str | None] = {}
    for key in ("bos_token", "eos_token"):
        value = raw.get(key)
        if isinstance(value, dict):  # {"content": "<｜begin▁of▁sentence｜>", ...}
            value = value.get("content")
        out[key] = value if isinstance(value, str) else None
    return out


def load_tokenizer(path: str | os.PathLike[str] | None, cfg: Any) -> ByteTokenizer | HFTokenizer:
    """The tokenizer for a model: ``path`` is a checkpoint directory, a tokenizer.json, or None.

    A tokenizer.json (``path`` itself, or ``path/tokenizer.json``) gives an `HFTokenizer` whose
    BOS / EOS are the config's ``bos_token_id`` / ``eos_token_id`` (the ids the model was trained
    with); otherwise the built-in `ByteTokenizer`. Either way every id the tokenizer can produce
    must be a row of the model's embedding (``cfg.vocab_size``), else ValueError.
    """
    vocab = int(cfg.vocab_size)
    file = None
    if path is not None:
        path = os.fspath(path)
        if os.path.isfile(path):
            file = path
        elif os.path.isdir(path):
            candidate = os.path.join(path, TOKENIZER_FILE)
            file = candidate if os.path.isfile(candidate) else None
        else:
            raise FileNotFoundError(f"{path}: no such checkpoint directory or tokenizer file")
    if file is not None:
        tok = HFTokenizer.from_file(
            file,
            bos_id=getattr(cfg, "bos_token_id", None),
            eos_id=getattr(cfg, "eos_token_id", None),
        )
        if tok.vocab_size > vocab:
            raise ValueError(
                f"{file} has {tok.vocab_size} tokens but the model's vocab_size is {vocab}: "
                "its ids would index past the embedding (wrong tokenizer for this checkpoint?)"
            )
        return tok
    byte = ByteTokenizer()
    if vocab < byte.vocab_size:
        raise ValueError(
            f"the built-in byte tokenizer needs vocab_size >= {byte.vocab_size} (3 special ids + "
            f"256 bytes) but the model has vocab_size={vocab}; give a checkpoint directory with "
            "a tokenizer.json, or a config with a larger vocabulary"
        )
    return byte


def pad_batch(rows: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[list[list[int]], list[int]]:
    """Right-pad token rows to one width: ``(padded rows, lengths)`` for ``generate``'s
    ``prompt_tokens`` / ``prompt_lengths`` (the padding is never read, any id will do)."""
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError("every prompt must have at least one token")
    width = max(len(r) for r in rows)
    return [[*r, *([pad_id] * (width - len(r)))] for r in rows], [len(r) for r in rows]
