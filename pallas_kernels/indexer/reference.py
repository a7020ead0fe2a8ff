"""Pure-jnp indexer top-k over paged index keys: the oracle of the kernels and the CPU path.

Design notes: pallas_kernels/README.md, "pallas_kernels/indexer/reference.py".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.indexer.common import check_indexer_args, weighted_relu_sum

__all__ = ["dense_keys", "index_scores", "indexer_topk"]


def dense_keys(ikey_pages, comp_tables, token_req):
    """Each token's request keys, densely: [T, nb * E, Di] (pages gathered in table order)."""
    pages = ikey_pages[comp_tables]  # [R, nb, E, Di]
    r, nb, e, di = pages.shape
    return pages.reshape(r, nb * e, di)[token_req]


def index_scores(qi, weights, keys, visible):
    """Weighted ReLU scores [T, N] with -inf at j >= visible and -0.0 canonicalised."""
    dots = jnp.einsum("thd,tnd->thn", qi, keys.astype(qi.dtype), preferred_element_type=jnp.float32)
    if qi.dtype == jnp.float32:
        s = jnp.einsum("thn,th->tn", jax.nn.relu(dots), weights.astype(jnp.float32))
    else:  # bf16 queries: DeepSeek's bf16 tensors (the kernels' same function)
        s = weighted_relu_sum(dots, weights.astype(jnp.float32)[..., None], 1, bf16=True)
    s = jnp.where(s == 0, 0.0, s)
    n = keys.shape[1]
    return jnp.where(jnp.arange(n)[None, :] < visible[:, None], s, -jnp.inf)


def _top(values, width, kk):
    """Top ``kk`` ids of each row (-1 where the value is -inf), padded with -1 to ``width``."""
    vals, ids = jax.lax.top_k(values, kk)
    ids = jnp.where(vals > -jnp.inf, ids, -1).astype(jnp.int32)
    return jnp.pad(ids, ((0, 0), (0, width - kk)), constant_values=-1)


def _candidate_blocks(scores, visible, block_size, topk_blocks):
    n = scores.shape[1]
    nblocks = -(-n // block_size)
    padded = jnp.pad(scores, ((0, 0), (0, nblocks * block_size - n)), constant_values=-jnp.inf)
    blocks = jnp.max(padded.reshape(-1, nblocks, block_size), axis=-1)
    newest = jnp.where(visible > 0, (visible - 1) // block_size, -1)
    blocks = jnp.where(jnp.arange(nblocks)[None, :] == newest[:, None], jnp.inf, blocks)
    return _top(blocks, topk_blocks, min(topk_blocks, nblocks))


def _candidate_mask(candidates, n, block_size):
    """Entries [T, n] whose block is listed in ``candidates`` [T, CB] (-1 and ids past the
    last block list nothing)."""
    nblocks = -(-n // block_size)
    ids = jnp.where((candidates >= 0) & (candidates < nblocks), candidates, nblocks)
    keep = jnp.zeros((candidates.shape[0], nblocks + 1), bool)
    keep = keep.at[jnp.arange(candidates.shape[0])[:, None], ids].set(True)
    return jnp.repeat(keep[:, :nblocks], block_size, axis=1)[:, :n]


def indexer_topk(
    qi, weights, ikey_pages, comp_tables, token_req, positions, visible, *,
    entries_per_block: int, k: int, candidate_block_size: int = 0, candidate_topk_blocks: int = 0,
    candidates=None, key_scales=None,
):  # fmt: skip
    """Top-k index entries per token over paged index keys (reference); the arguments of
    `pallas_kernels.indexer_topk`.

    Returns:
      ``topk`` i32[T, k] of request-local entry ids (-1 = none); for a candidate source
      ``(topk, blocks)`` with ``blocks`` i32[T, candidate_topk_blocks] (-1 = none).
    """
    mode = check_indexer_args(
        qi, weights, ikey_pages, comp_tables, token_req, positions, visible,
        entries_per_block=entries_per_block, k=k, candidate_block_size=candidate_block_size,
        candidate_topk_blocks=candidate_topk_blocks, candidates=candidates, key_scales=key_scales,
    )  # fmt: skip
    n = comp_tables.shape[1] * entries_per_block
    if key_scales is not None:  # the keys the records stand for: values x scale
        ikey_pages = ikey_pages.astype(jnp.float32) * key_scales[..., None]
    vis = jnp.where(positions >= 0, jnp.clip(visible, 0, n), 0)
    keys = dense_keys(ikey_pages, comp_tables, token_req)
    scores = index_scores(qi, weights, keys, vis)
    blocks = None
    if mode == "source":
        blocks = _candidate_blocks(scores, vis, candidate_block_size, candidate_topk_blocks)
    elif mode == "consumer":
        scores = jnp.where(_candidate_mask(candidates, n, candidate_block_size), scores, -jnp.inf)
    topk = _top(scores, k, min(k, n))
    return topk if blocks is None else (topk, blocks)
