"""Argument checks and the cost model shared by the indexer's reference and kernels."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

__all__ = ["check_indexer_args", "cost", "weighted_relu_sum"]


def weighted_relu_sum(dots, w, axis: int, *, bf16: bool, keepdims: bool = False):
    """``sum_h w_h relu(dots_h)`` over ``axis`` in f32. With ``bf16`` (bf16 queries) the dots,
    each weighted term and the sum are rounded to bf16 on the way, as DeepSeek's indexer
    computes them (its bf16 tensors); the kernels and the reference share this function."""
    if not bf16:
        return jnp.sum(jnp.maximum(dots, 0.0) * w, axis=axis, keepdims=keepdims)

    def rnd(x):
        return x.astype(jnp.bfloat16).astype(jnp.float32)

    terms = rnd(jnp.maximum(rnd(dots), 0.0) * w)
    return rnd(jnp.sum(terms, axis=axis, keepdims=keepdims))


def _fail(msg: str):
    raise ValueError(f"indexer_topk: {msg}")


# over 60 lines: one check per argument, in signature order
def check_indexer_args(
    qi,
    weights,
    ikey_pages,
    comp_tables,
    token_req,
    positions,
    visible,
    *,
    entries_per_block,
    k,
    candidate_block_size,
    candidate_topk_blocks,
    candidates,
    key_scales=None,
) -> str:
    """Static (shape / dtype / option) checks; returns the mode: "plain", "source" or
    "consumer". Values (block ids, positions) are not inspected: shapes only."""
    if qi.ndim != 3:
        _fail(f"qi must be [T, IH, Di], got shape {qi.shape}")
    t, ih, di = qi.shape
    if weights.shape != (t, ih):
        _fail(f"weights must be [T, IH] = {(t, ih)}, got {weights.shape}")
    if ikey_pages.ndim != 3 or ikey_pages.shape[2] != di:
        _fail(f"ikey_pages must be [P, E, Di={di}], got {ikey_pages.shape}")
    if ikey_pages.shape[1] != entries_per_block:
        _fail(
            f"entries_per_block={entries_per_block} differs from ikey_pages.shape[1]="
            f"{ikey_pages.shape[1]}"
        )
    if comp_tables.ndim != 2 or comp_tables.dtype != jnp.int32:
        _fail(f"comp_tables must be i32[R, nb], got {comp_tables.dtype}{list(comp_tables.shape)}")
    for name, a in (("token_req", token_req), ("positions", positions), ("visible", visible)):
        if a.shape != (t,) or a.dtype != jnp.int32:
            _fail(f"{name} must be i32[T={t}], got {a.dtype}{list(a.shape)}")
    if key_scales is not None and (
        key_scales.shape != ikey_pages.shape[:2] or key_scales.dtype != jnp.float32
    ):
        _fail(
            f"key_scales must be f32[P, E] = f32{list(ikey_pages.shape[:2])}, got "
            f"{key_scales.dtype}{list(key_scales.shape)}"
        )
    if k <= 0:
        _fail(f"k must be positive, got {k}")
    if candidate_topk_blocks < 0 or candidate_block_size < 0:
        _fail(
            f"candidate_topk_blocks={candidate_topk_blocks} and candidate_block_size="
            f"{candidate_block_size} must be >= 0"
        )
    if candidates is not None:
        if candidate_block_size <= 0:
            _fail(f"candidates need candidate_block_size > 0, got {candidate_block_size}")
        if candidates.ndim != 2 or candidates.shape[0] != t or candidates.dtype != jnp.int32:
            _fail(f"candidates must be i32[T={t}, CB], got {candidates.dtype}{candidates.shape}")
        return "consumer"
    if candidate_topk_blocks > 0:
        if candidate_block_size <= 0:
            _fail(
                f"candidate_topk_blocks={candidate_topk_blocks} needs candidate_block_size > 0, "
                f"got {candidate_block_size}"
            )
        return "source"
    return "plain"


def cost(
    num_tokens: int,
    index_heads: int,
    index_head_dim: int,
    entries: int,
    *,
    k: int,
    key_dtype=jnp.bfloat16,
    q_dtype=jnp.bfloat16,
    candidate_topk_blocks: int = 0,
    entries_per_block: int = 64,
    key_reads: int | None = None,
    key_scale_bytes: int = 0,
) -> dict[str, int]:
    """Bytes moved and FLOPs of one indexer call in which each of ``num_tokens`` tokens scores
    ``entries`` visible index keys (what is counted: pallas_kernels/README.md, "pallas_kernels/indexer/__init__.py").

    Args:
      key_reads: times the key stream is read from HBM (default ``num_tokens``).
      key_scale_bytes: bytes of each key's scale (4 for fp8 keys with an f32 scale).
    Returns:
      ``{"flops": ..., "bytes": ...}``.
    """
    kb = np.dtype(key_dtype).itemsize
    qb = np.dtype(q_dtype).itemsize
    pages = math.ceil(entries / entries_per_block)
    reads = num_tokens if key_reads is None else key_reads
    if not 0 <= reads <= num_tokens:
        raise ValueError(f"key_reads={key_reads} must be in [0, num_tokens={num_tokens}]")
    flops = num_tokens * entries * (2 * index_heads * index_head_dim + 3 * index_heads)
    bytes_ = (
        reads * entries * (index_head_dim * kb + key_scale_bytes)
        + num_tokens * index_heads * (index_head_dim * qb + 4)
        + reads * pages * 4
        + num_tokens * (k + candidate_topk_blocks) * 4
        + num_tokens * 12
    )
    return {"flops": int(flops), "bytes": int(bytes_)}
