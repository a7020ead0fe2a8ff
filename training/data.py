"""Training text: the Python standard library's own source, as byte-level tokens.

The running interpreter's standard-library ``*.py`` files (PSF License), split by file, framed
``BOS ids.. EOS`` and concatenated; `batch_at` is a pure function of its position, so a restarted
run draws the same batches. Details: docs/trained_model.md#trainingdata.
"""

from __future__ import annotations

import dataclasses
import os
import sysconfig

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dsv4.tokenizer import ByteTokenizer

__all__ = [
    "BPE_SPECIAL_TOKENS",
    "Split",
    "batch_at",
    "batches_per_epoch",
    "check_tokens",
    "consecutive_windows",
    "encode_bytes",
    "load_split",
    "read_split",
    "source_files",
    "source_split",
    "split_bytes",
    "split_files",
    "stdlib_root",
    "train_bpe",
]

# ids 0, 1, 2 of a BPE from `train_bpe`: the byte tokenizer's BOS, EOS and padding
BPE_SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>")

_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> str:
    """The running interpreter's standard library directory."""
    return sysconfig.get_paths()["stdlib"]


def source_files(root: str | os.PathLike[str] | None = None) -> tuple[str, ...]:
    """Sorted paths, relative to ``root`` (default `stdlib_root`), of its ``*.py`` files outside
    ``site-packages``, ``dist-packages`` and ``__pycache__``."""
    root = os.fspath(stdlib_root() if root is None else root)
    if not os.path.isdir(root):
        raise ValueError(f"source root {root!r} is not a directory")
    out = []
    for here, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _EXCLUDED_DIRS]
        rel = os.path.relpath(here, root)
        for name in files:
            if name.endswith(".py"):
                out.append(os.path.normpath(os.path.join(rel, name)))
    return tuple(sorted(out))


@dataclasses.dataclass(frozen=True)
class Split:
    """A by-file split of a source list (paths relative to ``root``)."""

    root: str
    train: tuple[str, ...]
    heldout: tuple[str, ...]


def split_files(files: tuple[str, ...], *, heldout_every: int = 20, root: str = "") -> Split:
    """Hold out file i when ``i % heldout_every == heldout_every - 1``; train on the rest."""
    if not isinstance(heldout_every, int) or heldout_every < 2:
        raise ValueError(f"heldout_every={heldout_every!r} must be an int >= 2")
    train = tuple(f for i, f in enumerate(files) if i % heldout_every != heldout_every - 1)
    heldout = tuple(f for i, f in enumerate(files) if i % heldout_every == heldout_every - 1)
    return Split(root=root, train=train, heldout=heldout)


def source_split(root: str | os.PathLike[str] | None = None) -> Split:
    """The train / held-out split of ``root``'s source files (default: this interpreter's
    standard library, `stdlib_root`): `split_files` of `source_files`."""
    root = os.fspath(stdlib_root() if root is None else root)
    return split_files(source_files(root), root=root)


def encode_bytes(raw: bytes) -> np.ndarray:
    """uint16 ids of ``BOS raw.. EOS`` under `ByteTokenizer` (byte b -> b + 3): for UTF-8 text
    the ids of ``ByteTokenizer().encode(text, add_bos=True) + [EOS]``."""
    tok = ByteTokenizer
    body = np.frombuffer(raw, np.uint8).astype(np.uint16) + tok.OFFSET
    return np.concatenate([[tok.BOS], body, [tok.EOS]]).astype(np.uint16)


def read_split(split: Split, which: str, utf8_only: bool = False) -> list[bytes]:
    """The raw bytes of each ``which`` file of ``split``, in list order; with ``utf8_only`` only
    the files that decode as UTF-8 (those a BPE stream holds)."""
    if which not in ("train", "heldout"):
        raise ValueError(f"which={which!r} must be 'train' or 'heldout'")
    files = getattr(split, which)
    if not files:
        raise ValueError(f"the {which} split of {split.root!r} has no files")
    out = []
    for rel in files:
        with open(os.path.join(split.root, rel), "rb") as f:
            raw = f.read()
        if utf8_only:
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                continue
        out.append(raw)
    return out


def load_split(split: Split, which: str, tokenizer=None) -> np.ndarray:
    """The token stream uint16[N] of the ``which`` ("train" or "heldout") files of ``split``:
    byte tokens when ``tokenizer`` is None, else ``tokenizer.encode`` of each UTF-8 file (a
    `dsv4.tokenizer.HFTokenizer` over a `train_bpe` file, say) between its BOS and EOS ids."""
    if tokenizer is None:
        return np.concatenate([encode_bytes(raw) for raw in read_split(split, which, False)])
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    if bos is None or eos is None or tokenizer.vocab_size > 1 << 16:
        raise ValueError(f"{tokenizer!r}: needs BOS and EOS ids and at most 65536 ids")
    parts = [
        np.asarray([bos, *tokenizer.encode(raw.decode("utf-8")), eos], np.uint16)
        for raw in read_split(split, which, True)
    ]
    return np.concatenate(parts)


def split_bytes(split: Split, which: str, tokenizer=None) -> int:
    """How many bytes of text `load_split` with the same arguments encodes."""
    return sum(len(raw) for raw in read_split(split, which, tokenizer is not None))


def train_bpe(split: Split, vocab_size: int, path: str | os.PathLike[str]) -> None:
    """Train a byte-level BPE of ``vocab_size`` ids (`BPE_SPECIAL_TOKENS` first) on the UTF-8
    train files of ``split`` with the ``tokenizers`` package and write it to ``path`` (a
    tokenizer.json). Its pre-tokenizer and decoder are the byte-level ones, so any text
    round-trips; it has no post-processor (`dsv4.tokenizer` adds BOS itself)."""
    if not isinstance(vocab_size, int) or not 256 + len(BPE_SPECIAL_TOKENS) < vocab_size <= 1 << 16:
        raise ValueError(f"vocab_size={vocab_size!r} must be an int in 260..65536")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(BPE_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(
        (raw.decode("utf-8") for raw in read_split(split, "train", True)), trainer
    )
    tok.save(os.fspath(path))


def check_tokens(tokens: np.ndarray, window: int, batch_size: int, vocab_size: int) -> None:
    """Raise ValueError unless ``tokens`` is a 1-d integer stream of ids below ``vocab_size``
    long enough for one batch of ``batch_size`` windows of ``window`` tokens."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must be a 1-d integer array, got {tokens.dtype}{tokens.shape}")
    if batch_size <= 0 or window <= 1:
        raise ValueError(f"batch_size={batch_size} must be > 0 and window={window} > 1")
    if batches_per_epoch(len(tokens), window, batch_size) == 0:
        raise ValueError(
            f"{len(tokens)} tokens hold no batch of {batch_size} windows of {window} tokens "
            "(at a random offset below the window length)"
        )
    if len(tokens) and int(tokens.max()) >= vocab_size:
        raise ValueError(f"token id {int(tokens.max())} >= vocab_size={vocab_size}")


def _windows_per_epoch(n_tokens: int, window: int) -> int:
    # any offset below `window` leaves this many whole windows
    return max(n_tokens - window, 0) // window


def batches_per_epoch(n_tokens: int, window: int, batch_size: int) -> int:
    """Batches of ``batch_size`` windows of ``window`` tokens in one epoch of a stream."""
    return _windows_per_epoch(n_tokens, window) // batch_size


def batch_at(
    tokens: np.ndarray, position: int, *, batch_size: int, window: int, seed: int
) -> np.ndarray:
    """The ``position``-th batch int32[batch_size, window] of the stream ``tokens`` (module
    docstring: per-epoch offset and permutation from ``[seed, epoch]``)."""
    if not isinstance(position, int | np.integer) or position < 0:
        raise ValueError(f"position={position!r} must be an int >= 0")
    per_epoch = batches_per_epoch(len(tokens), window, batch_size)
    if per_epoch == 0:
        raise ValueError(
            f"{len(tokens)} tokens hold no batch of {batch_size} windows of {window} tokens"
        )
    epoch, index = divmod(int(position), per_epoch)
    rng = np.random.default_rng([seed, epoch])
    offset = int(rng.integers(window))
    order = rng.permutation(_windows_per_epoch(len(tokens), window))
    starts = offset + window * order[index * batch_size : (index + 1) * batch_size]
    return np.stack([tokens[s : s + window] for s in starts]).astype(np.int32)


def consecutive_windows(tokens: np.ndarray, window: int) -> np.ndarray:
    """int32[len // window, window]: the stream cut into consecutive windows from its start
    (for evaluation; the remainder is dropped)."""
    n = len(tokens) // window
    return np.asarray(tokens[: n * window], np.int32).reshape(n, window)
