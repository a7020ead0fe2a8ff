"""`Request`: the allocator's view of one request (tokens, progress, chained block hashes)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence

from cache.hashing import BlockHash, BlockHashes, HashFn, get_request_block_hasher, sha256

_NEVER = sys.maxsize  # a token count no request reaches


class Request:
    """One request as the KV-cache manager sees it, mirroring vLLM's ``Request``.

    Block hashes are computed lazily, each full block once, the first time `block_hashes` is read
    after it completed; they live on the request, so a preempted request reuses them. Arguments:
    docs/allocator_internals.md, section 10.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        hash_block_size: int | None = None,
        block_hasher: Callable[[Request], list[BlockHash]] | None = None,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        mm_features: Iterable[tuple[str, int, int]] = (),
        skip_reading_prefix_cache: bool = False,
        priority: int = 0,
        arrival_time: float = 0.0,
        max_tokens: int | None = None,
        hash_fn: HashFn = sha256,
        hash_seed: int = 0,
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        if not self.prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt must hold at least one token")
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_in_flight_tokens = 0
        # Where a shared prefix ends that some window group had not cached (set on lookup).
        self.shared_prefix_boundary = 0
        self.num_preemptions = 0
        self.spec_token_ids: list[int] = []
        self.cache_salt = cache_salt
        self.lora_name = lora_name
        self.mm_features: list[tuple[str, int, int]] = sorted(mm_features, key=lambda f: f[1])
        self.skip_reading_prefix_cache = skip_reading_prefix_cache
        self.priority = priority
        self.arrival_time = arrival_time
        self.max_tokens = max_tokens
        self.needs_extra_keys = (
            bool(self.mm_features) or lora_name is not None or (cache_salt is not None)
        )
        if block_hasher is None and hash_block_size is not None:
            block_hasher = get_request_block_hasher(hash_block_size, hash_fn, hash_seed)
        self._block_hasher = block_hasher
        self.hash_block_size: int | None = (
            getattr(block_hasher, "hash_block_size", hash_block_size) if block_hasher else None
        )
        self._block_hashes: BlockHashes = BlockHashes()
        # Hashes are computed when first read (`block_hashes`), not here: a request that waits
        # behind thousands of others costs nothing until a lookup or caching reads its hashes.
        # Token count at which the next block completes: the hasher runs only from there
        # (0: unknown granularity, always ask; _NEVER: no hasher, or a hasher is running).
        self._next_hash_boundary = 0 if block_hasher is not None else _NEVER

    @property
    def block_hashes(self) -> BlockHashes:
        """Chained hashes of every full block of ``all_token_ids`` (computed on first read
        and extended as tokens are appended; the values are those of hashing eagerly)."""
        if len(self.all_token_ids) >= self._next_hash_boundary:
            self._next_hash_boundary = _NEVER  # a hasher that reads `block_hashes` gets the list
            try:
                self._block_hashes.extend(self._block_hasher(self))
            finally:
                self._next_hash_boundary = self._hash_boundary()
        return self._block_hashes

    @block_hashes.setter
    def block_hashes(self, hashes: BlockHashes) -> None:
        self._block_hashes = hashes if isinstance(hashes, BlockHashes) else BlockHashes(hashes)
        if self._block_hasher is not None:
            self._next_hash_boundary = self._hash_boundary()

    def _hash_boundary(self) -> int:
        """Token count at which the next block completes (0: unknown granularity, always ask)."""
        if self.hash_block_size is None:
            return 0
        return (len(self._block_hashes) + 1) * self.hash_block_size

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """Appends generated tokens; the blocks they complete are hashed when `block_hashes`
        is next read."""
        if isinstance(token_ids, int):
            self.all_token_ids.append(token_ids)
        else:
            self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens})"
        )
