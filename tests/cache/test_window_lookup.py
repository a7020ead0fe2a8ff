"""The window-hit lookup against a literal transcription of vLLM 0.32's right-to-left scan."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cache import BlockPool, Request
from cache.single_type_kv_cache_manager import SlidingWindowManager, cdiv
from cache.spec import SlidingWindowSpec


def vllm_scan(hit, max_num_blocks, block_size, window, eagle, alignment, null):
    """vLLM 0.32 ``SlidingWindowManager.find_longest_cache_hit``, written out literally.

    ``hit(i)`` returns the cached block at position i or None.
    """
    need = cdiv(window - 1, block_size) + (1 if eagle else 0)
    computed = [null] * max_num_blocks
    run = 0
    found = False
    for i in range(max_num_blocks - 1, -1, -1):
        cached = hit(i)
        if cached is None:
            run = 0
            continue
        if run == 0 and block_size != alignment:
            post_pop = i if eagle else i + 1
            if (post_pop * block_size) % alignment != 0:
                continue
        computed[i] = cached
        run += 1
        if run >= need:
            del computed[i + run :]
            found = True
            break
    if not found:
        del computed[run:]
        while block_size != alignment and len(computed) * block_size % alignment != 0:
            computed.pop()
    if eagle and computed:
        computed.pop()
        while block_size != alignment and len(computed) * block_size % alignment != 0:
            computed.pop()
    return computed


@settings(max_examples=400, deadline=None, derandomize=True)
@given(
    pattern=st.lists(st.booleans(), min_size=0, max_size=40),
    block_size=st.sampled_from([1, 2, 4]),
    ratio=st.sampled_from([1, 2, 4]),
    window=st.integers(1, 20),
    eagle=st.booleans(),
    num_groups=st.sampled_from([1, 2]),
    cut=st.integers(0, 3),
    plain=st.booleans(),
)
def test_window_lookup_matches_vllm_scan(
    pattern, block_size, ratio, window, eagle, num_groups, cut, plain
):
    n = len(pattern)
    pool = BlockPool(2 * n + 2, enable_caching=True, hash_block_size=block_size)
    req = Request("r", list(range(n * block_size + 1)), hash_block_size=block_size)
    groups = [pool.get_new_blocks(n) for _ in range(num_groups)]
    for i, cached in enumerate(pattern):
        if cached:
            for g, blocks in enumerate(groups):
                pool.cache_full_blocks(req, blocks, i, i + 1, block_size, g)
    spec = SlidingWindowSpec(
        block_size=block_size, num_kv_heads=1, head_size=8, dtype="bfloat16", sliding_window=window
    )
    max_length = max(0, n - cut) * block_size
    alignment = block_size * ratio
    ids = list(range(num_groups))
    # `plain`: hashes as a plain list (no memoised keys), the other lookup path.
    hashes = list(req.block_hashes) if plain else req.block_hashes
    got, length = SlidingWindowManager.find_longest_cache_hit(
        hashes, max_length, ids, pool, spec, eagle, alignment
    )
    for g in ids:
        expected = vllm_scan(
            lambda i, g=g: (
                pool.get_cached_block(req.block_hashes[i], ids)[g]
                if pool.get_cached_block(req.block_hashes[i], ids)
                else None
            ),
            max_length // block_size,
            block_size,
            window,
            eagle,
            alignment,
            pool.null_block,
        )
        assert [b.block_id for b in got[g]] == [b.block_id for b in expected]
    assert length == len(got[0]) * block_size
