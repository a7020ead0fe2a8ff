"""Engram's n-gram hash ids (`docs/model.md#engram`), on the host, in numpy int64.

DeepSeek's arithmetic needs 64-bit integers, so this transcription runs on the host; the model
computes the same ids on device from 32-bit halves (`dsv4.engram`). The multipliers, the blocking
and the primes, rule by rule: docs/model.md#dsv4engram_hash.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
from tokenizers import Regex, normalizers

__all__ = [
    "DEAD",
    "EngramHashing",
    "byte_token_map",
    "compressed_token_map",
    "is_prime",
    "next_prime",
]

DEAD = -1  # a position that takes part in no n-gram (image tokens)
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # deterministic below 3.3e24


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 3.3e24 (every table size a config can ask for)."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = pow(x, 2, n)
            if x == n - 1:
                break
        else:
            return False
    return True


def next_prime(after: int, taken: set[int]) -> int:
    """The smallest prime above ``after`` that is not in ``taken``."""
    n = after + 1
    while n in taken or not is_prime(n):
        n += 1
    return n


@dataclasses.dataclass(frozen=True, eq=False)
class EngramHashing:
    """Row ids of every Engram layer's table for the positions of a sequence.

    ``primes`` int64[layers, max_ngram_size - 1, heads]; ``offsets`` int64[layers, columns]
    with columns = (max_ngram_size - 1) * heads in (n, head) order; ``multipliers``
    int64[layers, max_ngram_size]; ``pad_id`` the pad token's compressed id."""

    layer_ids: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    primes: np.ndarray
    offsets: np.ndarray
    multipliers: np.ndarray
    pad_id: int
    compressed_vocab_size: int

    @classmethod
    def build(
        cls,
        *,
        layer_ids: Sequence[int],
        max_ngram_size: int,
        n_heads: int,
        engram_vocab_size: int,
        compressed_vocab_size: int,
        pad_id: int,
    ) -> EngramHashing:
        """``pad_id`` is already compressed (the compressed id of the config's pad token)."""
        layer_ids = tuple(int(v) for v in layer_ids)
        checks = {
            "max_ngram_size": (max_ngram_size, 2),
            "n_heads": (n_heads, 1),
            "engram_vocab_size": (engram_vocab_size, 2),
            "compressed_vocab_size": (compressed_vocab_size, 1),
        }
        for name, (value, least) in checks.items():
            if not isinstance(value, int) or value < least:
                raise ValueError(f"{name}={value!r} must be an int >= {least}")
        if not layer_ids or min(layer_ids) < 0 or len(set(layer_ids)) != len(layer_ids):
            raise ValueError(f"layer_ids={layer_ids} must be distinct layer indices >= 0")
        if not 0 <= pad_id < compressed_vocab_size:
            raise ValueError(f"pad_id={pad_id} outside the compressed vocabulary [0, "
                             f"{compressed_vocab_size})")  # fmt: skip
        taken: set[int] = set()
        primes = np.zeros((len(layer_ids), max_ngram_size - 1, n_heads), np.int64)
        for li in range(len(layer_ids)):
            for ni in range(max_ngram_size - 1):
                current = engram_vocab_size - 1
                for h in range(n_heads):
                    current = next_prime(current, taken)
                    taken.add(current)
                    primes[li, ni, h] = current
        flat = primes.reshape(len(layer_ids), -1)
        offsets = np.concatenate(
            [np.zeros((len(layer_ids), 1), np.int64), np.cumsum(flat, axis=1)[:, :-1]], axis=1
        )
        bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
        multipliers = np.stack(
            [
                np.random.default_rng(10007 * layer).integers(
                    0, bound, size=(max_ngram_size,), dtype=np.int64
                )
                * 2
                + 1
                for layer in layer_ids
            ]
        )
        return cls(layer_ids, max_ngram_size, n_heads, primes, offsets, multipliers,
                   int(pad_id), compressed_vocab_size)  # fmt: skip

    @property
    def num_columns(self) -> int:
        """Row ids per token and layer: (max_ngram_size - 1) * n_heads."""
        return (self.max_ngram_size - 1) * self.n_heads

    def table_rows(self) -> tuple[int, ...]:
        """Rows each layer's table needs (the sum of its primes)."""
        return tuple(int(v) for v in self.primes.reshape(len(self.layer_ids), -1).sum(axis=1))

    def hash_ids(self, history: Any, start: int = 0, end: int | None = None) -> np.ndarray:
        """int64[end - start, layers, columns]: the row ids of positions ``start .. end - 1``.

        ``history`` holds the compressed ids of positions 0 .. end - 1 of one sequence (a 1-D
        int array; `DEAD` marks positions that take part in no n-gram). Positions before
        ``start`` are only read as look-back: a chunk of a longer sequence hashes exactly as it
        would inside the whole."""
        hist = np.asarray(history, np.int64)
        end = len(hist) if end is None else end
        if hist.ndim != 1 or not 0 <= start <= end <= len(hist):
            raise ValueError(f"need a 1-D history and 0 <= start={start} <= end={end} <= "
                             f"{len(hist) if hist.ndim == 1 else hist.shape}")  # fmt: skip
        bad = (hist[:end] != DEAD) & ((hist[:end] < 0) | (hist[:end] >= self.compressed_vocab_size))
        if bad.any():
            raise ValueError(f"compressed ids {sorted(set(hist[:end][bad].tolist()))[:5]} outside "
                             f"[0, {self.compressed_vocab_size}) (and not DEAD={DEAD})")  # fmt: skip
        pos = np.arange(start, end)
        blocked = np.zeros(pos.shape, bool)
        looked = []
        for k in range(self.max_ngram_size):
            src = hist[np.maximum(pos - k, 0)] if len(pos) else np.zeros(0, np.int64)
            blocked = blocked | (pos < k) | (src == DEAD)
            looked.append(np.where(blocked, self.pad_id, src))
        tokens = np.stack(looked, axis=-1)  # [P, max_ngram_size]
        products = tokens[:, None, :] * self.multipliers[None]  # [P, layers, max_ngram_size]
        rolling = products[..., 0]
        columns = []
        for i in range(1, self.max_ngram_size):
            rolling = rolling ^ products[..., i]
            columns.append(rolling[..., None] % self.primes[None, :, i - 1, :])
        return np.concatenate(columns, axis=-1) + self.offsets[None]


def _normaliser():
    keep_space = "\ue000"  # private use: survives Strip
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), keep_space),
            normalizers.Strip(),
            normalizers.Replace(keep_space, " "),
        ]
    )


def _build_map(keys: Sequence[str], vocab_size: int | None) -> tuple[np.ndarray, int]:
    size = len(keys) if vocab_size is None else vocab_size
    if size < len(keys):
        raise ValueError(f"the tokenizer has {len(keys)} tokens, more than the model's "
                         f"vocab_size={size}")  # fmt: skip
    ids: dict[str, int] = {}
    out = np.full(size, DEAD, np.int64)
    for token_id, key in enumerate(keys):
        out[token_id] = ids.setdefault(key, len(ids))
    return out, len(ids)


def compressed_token_map(tokenizer: Any, vocab_size: int | None = None) -> tuple[np.ndarray, int]:
    """(int64[vocab] compressed id of every token id, number of compressed ids) for a
    ``tokenizers.Tokenizer`` (a checkpoint's tokenizer.json, added tokens included).

    A token's key is its decoded text normalised (NFKC, NFD, accents stripped, lower case,
    whitespace collapsed), with exceptions for a lone space, empty and partial-UTF-8 tokens; ids go
    out in token-id order of first appearance (docs/model.md#dsv4engram_hashcompressed_token_map).

    Args:
        vocab_size: the model's (at least the tokenizer's); ids the tokenizer lacks map to `DEAD`.
    """
    norm = _normaliser()
    keys = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            keys.append(tokenizer.id_to_token(token_id))
        else:
            keys.append(norm.normalize_str(text) or text)
    return _build_map(keys, vocab_size)


def byte_token_map(vocab_size: int) -> tuple[np.ndarray, int]:
    """The compressed map of `dsv4.tokenizer.ByteTokenizer` for a model of ``vocab_size`` ids:
    BOS, EOS and PAD keyed by their names, byte b (id b + 3) by its character normalised as in
    `compressed_token_map` (a byte that is not a whole UTF-8 character by its hex form); ids
    past the 259 of the tokenizer map to `DEAD`."""
    norm = _normaliser()
    keys = ["<bos>", "<eos>", "<pad>"]
    for b in range(256):
        text = bytes([b]).decode("utf-8", errors="replace")
        keys.append(f"<0x{b:02X}>" if "\ufffd" in text else (norm.normalize_str(text) or text))
    return _build_map(keys[:vocab_size], vocab_size)
