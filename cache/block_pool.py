"""Blocks, the free queue, the prefix index and the block pool (vLLM v1's ``block_pool.py``).

Block 0 is the null block; a non-null block is in the free queue iff unreferenced; freeing keeps
a block's index entry until the block is reused (lazy eviction). The invariants the tests check,
the free ordering and prompt-tail entries: docs/allocator_internals.md, section 3.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from cache.hashing import (
    generate_block_hash_extra_keys,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
    resolve_block_hashes,
)
from cache.request import Request


class KVCacheBlock:
    """Metadata of one physical block id (the memory itself lives on the device)."""

    __slots__ = (
        "_block_hash",
        "block_hash_num_tokens",
        "block_id",
        "is_null",
        "next_free_block",
        "prev_free_block",
        "ref_cnt",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self._block_hash: bytes | None = None
        # Prefix tokens the primary hash covers (a block boundary, or a prompt-tail boundary).
        self.block_hash_num_tokens: int | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    @property
    def block_hash(self) -> bytes | None:
        """The index key (hash + group id) while the block is cached, else None."""
        return self._block_hash

    def set_block_hash(self, key: bytes, num_tokens: int | None = None) -> None:
        if self._block_hash is not None:
            raise RuntimeError(f"block {self.block_id} already has a hash; hashes are set once")
        self._block_hash = key
        self.block_hash_num_tokens = num_tokens

    def reset_hash(self) -> None:
        self._block_hash = None
        self.block_hash_num_tokens = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, hashed={self._block_hash is not None})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks threaded through the blocks themselves.

    Two sentinels bracket the list so every real node has both neighbours; all operations are
    O(1) per block and allocate nothing. ``remove`` unlinks from the middle, which is what a
    prefix hit on a free (cached) block needs.
    """

    __slots__ = ("fake_free_list_head", "fake_free_list_tail", "num_free_blocks")

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        head = KVCacheBlock(-1)
        tail = KVCacheBlock(-1)
        self.fake_free_list_head = head
        self.fake_free_list_tail = tail
        head.next_free_block = tail
        tail.prev_free_block = head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        """Removes and returns the head block."""
        block = self.fake_free_list_head.next_free_block
        if block is self.fake_free_list_tail or block is None:
            raise ValueError("no free blocks available")
        nxt = block.next_free_block
        self.fake_free_list_head.next_free_block = nxt
        nxt.prev_free_block = self.fake_free_list_head  # type: ignore[union-attr]
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Removes and returns the first ``n`` blocks, relinking the head once."""
        if n == 0:
            return []
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks from a queue of {self.num_free_blocks}")
        out: list[KVCacheBlock] = []
        append = out.append
        block = self.fake_free_list_head.next_free_block
        for _ in range(n):
            append(block)  # type: ignore[arg-type]
            nxt = block.next_free_block  # type: ignore[union-attr]
            block.prev_free_block = block.next_free_block = None  # type: ignore[union-attr]
            block = nxt
        self.fake_free_list_head.next_free_block = block
        block.prev_free_block = self.fake_free_list_head  # type: ignore[union-attr]
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Unlinks ``block`` from wherever it is in the queue."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"remove() of {block!r}, which is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Puts ``block`` at the tail (reused last)."""
        self.append_n((block,))

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Puts ``blocks`` at the tail in the given order, relinking the tail once."""
        if blocks:
            tail = self.fake_free_list_tail
            self._link(tail.prev_free_block, blocks, tail)  # type: ignore[arg-type]

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Puts ``blocks`` at the head in the given order (the first is reused first)."""
        if blocks:
            head = self.fake_free_list_head
            self._link(head, blocks, head.next_free_block)  # type: ignore[arg-type]

    def _link(self, prev: KVCacheBlock, blocks: Sequence[KVCacheBlock], nxt: KVCacheBlock) -> None:
        """Links ``blocks`` as a chain between the adjacent nodes ``prev`` and ``nxt``."""
        for block in blocks:
            block.prev_free_block = prev
            prev.next_free_block = block
            prev = block
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks, head to tail (for tests and debugging; O(n))."""
        out = []
        block = self.fake_free_list_head.next_free_block
        while block is not self.fake_free_list_tail:
            out.append(block)
            block = block.next_free_block  # type: ignore[union-attr]
        return out


class BlockHashToBlockMap:
    """Prefix index: key (hash + group id) -> one block, or ``{block_id: block}`` on duplicates.

    Duplicates exist because block tables are append-only: a request that recomputed a prefix
    (it skipped the cache read) keeps its own blocks, with the same hashes. The dict is created
    only when a second block arrives under one key, which keeps the common case cheap.
    """

    __slots__ = ("_cache", "raw_get")

    def __init__(self) -> None:
        self._cache: dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]] = {}
        # The raw entry (a block, or a dict of duplicates): lets hot loops skip a call.
        self.raw_get = self._cache.get

    def get_one_block(self, key: bytes) -> KVCacheBlock | None:
        """A block cached under ``key`` (the first inserted one on duplicates), or None."""
        blocks = self._cache.get(key)
        if blocks is None or isinstance(blocks, KVCacheBlock):
            return blocks
        return next(iter(blocks.values()))

    def contain(self, key: bytes, block_id: int) -> bool:
        blocks = self._cache.get(key)
        if blocks is None:
            return False
        if isinstance(blocks, KVCacheBlock):
            return blocks.block_id == block_id
        return block_id in blocks

    def insert(self, key: bytes, block: KVCacheBlock) -> None:
        blocks = self._cache.get(key)
        if blocks is None:
            self._cache[key] = block
        elif isinstance(blocks, KVCacheBlock):
            self._cache[key] = {blocks.block_id: blocks, block.block_id: block}
        else:
            blocks[block.block_id] = block

    def pop(self, key: bytes, block_id: int) -> KVCacheBlock | None:
        """Removes block ``block_id`` under ``key``; returns it, or None if it was not there."""
        blocks = self._cache.pop(key, None)
        if blocks is None:
            return None
        if isinstance(blocks, KVCacheBlock):
            if blocks.block_id == block_id:
                return blocks
            self._cache[key] = blocks
            return None
        block = blocks.pop(block_id, None)
        if blocks:
            self._cache[key] = blocks
        return block

    def items(self) -> Iterable[tuple[bytes, list[KVCacheBlock]]]:
        """(key, blocks) pairs, for tests."""
        for key, blocks in self._cache.items():
            yield key, [blocks] if isinstance(blocks, KVCacheBlock) else list(blocks.values())

    def __len__(self) -> int:
        return len(self._cache)


class BlockPool:
    """All blocks of the KV cache: one block-id space shared by every KV-cache group.

    Args:
        num_gpu_blocks: number of blocks including the null block (usable: one fewer).
        enable_caching: keep a prefix index.
        hash_block_size: granularity of the requests' block hashes.
        enable_kv_cache_events: record `BlockStored` / `BlockRemoved` / `AllBlocksCleared`.
        unhashed_blocks_to_front: vLLM 0.32's free order; docs/allocator_internals.md, section 3.
        group_metadata: per group ``(spec kind, sliding window)`` for `BlockStored` events.
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool,
        hash_block_size: int,
        enable_kv_cache_events: bool = False,
        unhashed_blocks_to_front: bool = True,
        group_metadata: Sequence[tuple[str, int | None]] = (),
    ) -> None:
        if not isinstance(num_gpu_blocks, int) or num_gpu_blocks < 1:
            raise ValueError(
                f"num_gpu_blocks must be an int >= 1 (block 0 is the null block), got {num_gpu_blocks!r}"
            )
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        # Keys of a block beyond its primary hash (prompt-tail partial entries).
        self.cached_block_hashes_by_block: dict[int, set[bytes]] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.enable_kv_cache_events = enable_kv_cache_events
        self.unhashed_blocks_to_front = unhashed_blocks_to_front
        self.group_metadata = tuple(group_metadata)
        self.kv_event_queue: list[KVCacheEvent] = []

    # -- lookup -------------------------------------------------------------------------------

    def get_cached_block(
        self, block_hash: bytes, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        """One cached block per group for ``block_hash``, or None if any group misses."""
        index = self.cached_block_hash_to_block
        raw = index.raw_get
        out = []
        for group_id in kv_cache_group_ids:
            key = block_hash + group_id.to_bytes(4, "big")
            block = raw(key)
            if block is None:
                return None
            if block.__class__ is dict:  # duplicates under one key: the first one
                block = next(iter(block.values()))
            out.append(block)
        return out

    # -- caching ------------------------------------------------------------------------------

    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Sequence[bool] | None = None,
    ) -> None:
        """Hashes and indexes ``blocks[num_cached_blocks:num_full_blocks]``.

        Null blocks and blocks masked out by ``block_mask`` (aligned with that slice) are
        skipped. A block that already carries a key got it as a prompt-tail partial entry;
        becoming full replaces it (vLLM's partial-to-full promotion). Emits one `BlockStored`.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        block_hashes = resolve_block_hashes(request.block_hashes, self.hash_block_size, block_size)
        if len(block_hashes) < num_full_blocks:
            raise RuntimeError(
                f"request {request.request_id!r} has {len(block_hashes)} hashed blocks of "
                f"{block_size} tokens but {num_full_blocks} full blocks are being cached"
            )
        index = self.cached_block_hash_to_block
        suffix = kv_cache_group_id.to_bytes(4, "big")
        stored: list[int] | None = [] if self.enable_kv_cache_events else None
        for i in range(num_cached_blocks, num_full_blocks):
            blk = blocks[i]
            if blk.is_null or (block_mask is not None and not block_mask[i - num_cached_blocks]):
                continue
            key = block_hashes[i] + suffix
            if blk._block_hash is None:
                blk._block_hash = key
                blk.block_hash_num_tokens = (i + 1) * block_size
                index.insert(key, blk)
            else:  # a prompt-tail partial entry becomes a full one
                self._emit_removed(self._remove_cached_block_hashes(blk), blk.block_id)
                self._insert_block_hash(key, blk, (i + 1) * block_size)
            if stored is not None:
                stored.append(i)
        if stored is not None:
            self.kv_event_queue.append(
                self._stored_event(
                    request,
                    [block_hashes[i] for i in stored],
                    block_hashes[num_cached_blocks - 1] if num_cached_blocks else None,
                    num_cached_blocks * block_size,
                    num_full_blocks * block_size,
                    block_size,
                    kv_cache_group_id,
                    [(i * block_size, (i + 1) * block_size) for i in stored],
                    [blocks[i].block_id for i in stored],
                )
            )

    def cache_partial_block(
        self, request: Request, block: KVCacheBlock, num_tokens: int, kv_cache_group_id: int
    ) -> None:
        """Makes ``block`` reachable from the prefix boundary ``num_tokens`` inside it.

        The key is the fine hash at that boundary: the block's primary hash if it has none,
        else an extra key. Idempotent. See docs/allocator_internals.md, section 3.
        """
        if block.is_null:
            return
        hash_block = self.hash_block_size
        num_hash_blocks = num_tokens // hash_block
        block_hash = request.block_hashes[num_hash_blocks - 1]
        key = block_hash + kv_cache_group_id.to_bytes(4, "big")
        index = self.cached_block_hash_to_block
        if block._block_hash == key or index.contain(key, block.block_id):
            return
        if (
            block._block_hash is not None
            and block.block_hash_num_tokens is not None
            and block.block_hash_num_tokens < num_hash_blocks * hash_block
        ):
            self._emit_removed(self._remove_cached_block_hashes(block), block.block_id)
        self._insert_block_hash(key, block, num_hash_blocks * hash_block)
        if self.enable_kv_cache_events:
            start = (num_hash_blocks - 1) * hash_block
            self.kv_event_queue.append(
                self._stored_event(
                    request,
                    [block_hash],
                    request.block_hashes[num_hash_blocks - 2] if num_hash_blocks > 1 else None,
                    start,
                    num_tokens,
                    num_tokens - start,
                    kv_cache_group_id,
                    [(start, num_tokens)],
                    [block.block_id],
                )
            )

    def _stored_event(
        self,
        request: Request,
        block_hashes: list[bytes],
        parent_block_hash: bytes | None,
        start_token: int,
        end_token: int,
        block_size: int,
        group_id: int,
        block_ranges: list[tuple[int, int]],
        block_ids: list[int],
    ) -> BlockStored:
        """The event of storing blocks whose token ranges are ``block_ranges``."""
        kind, window = (
            self.group_metadata[group_id] if group_id < len(self.group_metadata) else ("", None)
        )
        extra_keys = [
            generate_block_hash_extra_keys(request, start, end)
            if request.needs_extra_keys
            else None
            for start, end in block_ranges
        ]
        return BlockStored(
            block_hashes=block_hashes,
            parent_block_hash=parent_block_hash,
            token_ids=request.all_token_ids[start_token:end_token],
            block_size=block_size,
            lora_name=request.lora_name,
            extra_keys=extra_keys,
            group_idx=group_id,
            block_ids=block_ids,
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=window,
        )

    def _insert_block_hash(self, key: bytes, block: KVCacheBlock, num_tokens: int) -> None:
        if block._block_hash == key or self.cached_block_hash_to_block.contain(key, block.block_id):
            return
        if block._block_hash is None:
            block._block_hash = key
            block.block_hash_num_tokens = num_tokens
        else:
            self.cached_block_hashes_by_block.setdefault(block.block_id, set()).add(key)
        self.cached_block_hash_to_block.insert(key, block)

    def _remove_cached_block_hashes(self, block: KVCacheBlock) -> list[bytes]:
        """Drops every index entry of ``block`` and clears its hash; returns the removed keys."""
        keys = []
        if block._block_hash is not None:
            keys.append(block._block_hash)
        if self.cached_block_hashes_by_block:
            keys.extend(self.cached_block_hashes_by_block.pop(block.block_id, ()))
        if not keys:
            return keys
        pop = self.cached_block_hash_to_block.pop
        removed = [key for key in keys if pop(key, block.block_id) is not None]
        block._block_hash = None
        block.block_hash_num_tokens = None
        return removed

    def _emit_removed(self, keys: list[bytes], block_id: int) -> None:
        if self.enable_kv_cache_events:
            for key in keys:
                self.kv_event_queue.append(
                    BlockRemoved(
                        block_hashes=[get_block_hash(key)],
                        group_idx=get_group_id(key),
                        block_ids=[block_id],
                    )
                )

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Drops ``block``'s index entries and hash; emits a `BlockRemoved` per key."""
        removed = self._remove_cached_block_hashes(block)
        if not removed:
            return False
        self._emit_removed(removed, block.block_id)
        return True

    # -- allocation ---------------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Takes ``num_blocks`` blocks from the head of the free queue (evicting cached ones)."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(
                f"cannot get {num_blocks} free blocks from the pool ({self.free_block_queue.num_free_blocks} free)"
            )
        ret = self.free_block_queue.popleft_n(num_blocks)
        if self.enable_caching:
            evict = self._maybe_evict_cached_block
            for block in ret:
                if block._block_hash is not None:  # (extra keys exist only beside a primary)
                    evict(block)
                block.ref_cnt = 1
        else:
            for block in ret:
                block.ref_cnt = 1
        return ret

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Adds a reference to each hit block, taking free ones out of the free queue."""
        remove = self.free_block_queue.remove
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference from each block; blocks reaching 0 return to the free queue.

        ``ordered_blocks`` is in eviction order (first = evicted first); callers pass a
        request's blocks tail first. See ``unhashed_blocks_to_front`` for where they go.
        """
        # Blocks reaching 0 are split in two runs (in the given order): never-cached ones go to
        # the head (reused first), cached ones to the tail (LRU); each run is linked as a chain.
        to_front: list[KVCacheBlock] = []
        to_back: list[KVCacheBlock] = []
        front = to_front if self.unhashed_blocks_to_front else to_back
        if not self.enable_caching:
            to_back = front
        for block in ordered_blocks:
            if block.is_null:
                continue
            ref_cnt = block.ref_cnt - 1
            block.ref_cnt = ref_cnt
            if ref_cnt:
                if ref_cnt < 0:
                    raise RuntimeError(f"{block!r} freed more often than it was referenced")
                continue
            if block._block_hash is None:
                front.append(block)
            else:
                to_back.append(block)
        queue = self.free_block_queue
        if to_front:
            queue.prepend_n(to_front)
        if to_back and to_back is not to_front:
            queue.append_n(to_back)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drops the index entries of the given blocks without freeing them."""
        for block_id in block_ids:
            if not 0 <= block_id < self.num_gpu_blocks:
                raise ValueError(f"block id {block_id} out of range [0, {self.num_gpu_blocks})")
            self._maybe_evict_cached_block(self.blocks[block_id])

    def reset_prefix_cache(self) -> bool:
        """Clears the prefix index if no block is in use; returns whether it did."""
        if self.num_gpu_blocks - self.free_block_queue.num_free_blocks != 1:
            return False
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.cached_block_hashes_by_block.clear()  # (lookups re-read the new map's raw_get)
        for block in self.blocks:
            block.reset_hash()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    # -- accounting ---------------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable (non-null) blocks in use."""
        usable = self.num_gpu_blocks - 1
        if not usable:
            return 0.0
        return 1.0 - self.free_block_queue.num_free_blocks / usable

    def take_events(self) -> list[KVCacheEvent]:
        """Returns and clears the pending events (always empty when events are off)."""
        events, self.kv_event_queue = self.kv_event_queue, []
        return events


__all__ = [
    "BlockHashToBlockMap",
    "BlockPool",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "make_block_hash_with_group_id",
]
