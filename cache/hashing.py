"""Chained block hashes, as vLLM v1 computes them for prefix caching.

A block's hash names the whole prefix that ends with it; the prefix index keys it together with
a 4-byte group id. Unlike vLLM, ``NONE_HASH`` comes from an explicit seed, so runs are
reproducible. See docs/allocator_internals.md, section 2.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NewType, Protocol

from cache.util import lookup

BlockHash = NewType("BlockHash", bytes)
BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)
HashFn = Callable[[Any], bytes]

_GROUP_ID_BYTES = 4
_sha256 = hashlib.sha256
_dumps = pickle.dumps
_PROTO = pickle.HIGHEST_PROTOCOL


class HashedRequest(Protocol):
    """What hashing reads from a request (`cache.request.Request` is the one implementation)."""

    all_token_ids: list[int]
    lora_name: str | None
    mm_features: list[tuple[str, int, int]]
    cache_salt: str | None
    needs_extra_keys: bool

    @property
    def block_hashes(self) -> BlockHashes: ...


def sha256(obj: Any) -> bytes:
    """vLLM's default ``sha256`` hash: SHA-256 of the object's highest-protocol pickle."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def blake2b_256(obj: Any) -> bytes:
    """A faster cryptographic alternative to `sha256` (same input encoding, 32-byte digest)."""
    return hashlib.blake2b(
        pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), digest_size=32
    ).digest()


HASH_FUNCTIONS: dict[str, HashFn] = {"sha256": sha256, "blake2b": blake2b_256}


def get_hash_fn_by_name(name: str) -> HashFn:
    """Returns the hash function called ``name`` (one of `HASH_FUNCTIONS`)."""
    return lookup(HASH_FUNCTIONS, name, f"unknown prefix-caching hash algorithm {name!r}")


def none_hash(hash_fn: HashFn = sha256, seed: int = 0) -> BlockHash:
    """The parent hash of a sequence's first block, derived from an explicit ``seed``."""
    return BlockHash(hash_fn(("dsv4-jax none hash", seed)))


def hash_block_tokens(
    hash_fn: HashFn,
    parent_block_hash: bytes,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """Hash of one full block given its parent's hash, its token ids and its extra keys."""
    return BlockHash(hash_fn((parent_block_hash, tuple(curr_block_token_ids), extra_keys)))


def make_block_hash_with_group_id(block_hash: bytes, group_id: int) -> BlockHashWithGroupId:
    """Index key of ``block_hash`` in KV-cache group ``group_id`` (hash bytes + 4-byte id)."""
    return BlockHashWithGroupId(block_hash + group_id.to_bytes(_GROUP_ID_BYTES, "big"))


def get_block_hash(key: bytes) -> BlockHash:
    """The hash bytes of an index key."""
    return BlockHash(key[:-_GROUP_ID_BYTES])


def get_group_id(key: bytes) -> int:
    """The KV-cache group id of an index key."""
    return int.from_bytes(key[-_GROUP_ID_BYTES:], "big")


def generate_block_hash_extra_keys(
    request: HashedRequest, start_token_idx: int, end_token_idx: int
) -> tuple[Any, ...] | None:
    """Extra keys of the block ``[start_token_idx, end_token_idx)``, in vLLM's order.

    1. the LoRA adapter name, 2. the identifiers of multimodal items overlapping the block with
    their start offset relative to the block start, 3. the cache salt (first block only).
    Returns None when there are none.
    """
    keys: list[Any] = []
    if request.lora_name is not None:
        keys.append(request.lora_name)
    for identifier, offset, length in request.mm_features:
        if offset < end_token_idx and offset + length > start_token_idx:
            keys.append((identifier, offset - start_token_idx))
    if start_token_idx == 0 and request.cache_salt is not None:
        keys.append(request.cache_salt)
    return tuple(keys) if keys else None


def get_request_block_hasher(
    hash_block_size: int, hash_fn: HashFn = sha256, seed: int = 0
) -> Callable[[HashedRequest], list[BlockHash]]:
    """A function computing the hashes of a request's *new* full blocks.

    It starts after the request's existing ``block_hashes`` and stops before a partial block,
    so calling it after every append hashes each block exactly once.
    """
    if hash_block_size <= 0:
        raise ValueError(
            f"hash_block_size must be a positive number of tokens, got {hash_block_size}"
        )
    root = none_hash(hash_fn, seed)

    def request_block_hasher(request: HashedRequest) -> list[BlockHash]:
        hashes = request.block_hashes
        start = len(hashes) * hash_block_size
        tokens = request.all_token_ids
        num_tokens = len(tokens)
        parent = hashes[-1] if hashes else root
        needs_extra = request.needs_extra_keys
        new_hashes: list[BlockHash] = []
        if hash_fn is sha256 and not needs_extra:
            # The common case, with `sha256` and `hash_block_tokens` written out (same bytes).
            while start + hash_block_size <= num_tokens:
                end = start + hash_block_size
                parent = _sha256(_dumps((parent, tuple(tokens[start:end]), None), _PROTO)).digest()
                new_hashes.append(parent)
                start = end
            return new_hashes
        while start + hash_block_size <= num_tokens:
            end = start + hash_block_size
            extra = generate_block_hash_extra_keys(request, start, end) if needs_extra else None
            parent = hash_block_tokens(hash_fn, parent, tokens[start:end], extra)
            new_hashes.append(parent)
            start = end
        return new_hashes

    request_block_hasher.hash_block_size = hash_block_size  # type: ignore[attr-defined]
    return request_block_hasher


class BlockHashListWithBlockSize(Sequence[bytes]):
    """Read-only, lazy view of fine hashes as hashes of coarser blocks.

    Element ``i`` is the concatenation of the ``target // hash_block_size`` fine hashes covering
    coarse block ``i``; the length counts only complete coarse blocks. Nothing is materialised
    for the whole request.
    """

    __slots__ = ("_factor", "_hashes")

    def __init__(self, hashes: Sequence[bytes], hash_block_size: int, target_block_size: int):
        if target_block_size % hash_block_size:
            raise ValueError(
                f"block size {target_block_size} is not a multiple of the hash block size "
                f"{hash_block_size}"
            )
        self._hashes = hashes
        self._factor = target_block_size // hash_block_size

    def __len__(self) -> int:
        return len(self._hashes) // self._factor

    def __getitem__(self, idx):  # type: ignore[override]
        if isinstance(idx, slice):
            return [self[i] for i in range(*idx.indices(len(self)))]
        n = len(self)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"coarse block index {idx} out of range [0, {n})")
        f = self._factor
        return b"".join(self._hashes[idx * f : (idx + 1) * f])

    def __iter__(self):
        f = self._factor
        hashes = self._hashes
        for i in range(len(self)):
            yield b"".join(hashes[i * f : (i + 1) * f])


class BlockHashes(list):
    """A request's fine block hashes (append-only), with memoised coarser views.

    ``coarse(n)[i]`` is the concatenation of fine hashes ``i*n .. i*n+n-1`` (equal to
    `BlockHashListWithBlockSize`'s element); each coarse list is kept and only extended, since
    a waiting request is looked up again every step.
    """

    __slots__ = ("_coarse", "_keys")

    def __init__(self, hashes: Iterable[bytes] = ()) -> None:
        super().__init__(hashes)
        self._coarse: dict[int, list[bytes]] = {}
        self._keys: dict[tuple[int, int], list[bytes]] = {}

    def key_memo(self, factor: int, group_id: int) -> list[bytes]:
        """The memo of prefix-index keys of coarse blocks in group ``group_id``.

        Entry i is ``coarse(factor)[i] + group id``; callers extend it in order (lazily, up to
        what a lookup needs).
        """
        memo = self._keys.get((factor, group_id))
        if memo is None:
            memo = self._keys[factor, group_id] = []
        return memo

    def coarse(self, factor: int) -> list[bytes]:
        out = self._coarse.get(factor)
        if out is None:
            out = self._coarse[factor] = []
        n = len(self) // factor
        if len(out) < n:
            if factor == 2:
                out.extend([self[2 * i] + self[2 * i + 1] for i in range(len(out), n)])
            else:
                join = b"".join
                out.extend([join(self[i * factor : (i + 1) * factor]) for i in range(len(out), n)])
        return out


def resolve_block_hashes(
    hashes: Sequence[bytes], hash_block_size: int, block_size: int
) -> Sequence[bytes]:
    """The request's hashes at ``block_size`` granularity (the list itself when equal)."""
    if block_size == hash_block_size:
        return hashes
    if isinstance(hashes, BlockHashes):
        if block_size % hash_block_size:
            raise ValueError(
                f"block size {block_size} is not a multiple of the hash block size "
                f"{hash_block_size}"
            )
        return hashes.coarse(block_size // hash_block_size)
    return BlockHashListWithBlockSize(hashes, hash_block_size, block_size)
