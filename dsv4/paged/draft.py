"""The DSpark drafter over the paged caches: what the serving engine runs after each step.

`dsv4.dspark` drafts from context latents it is handed (from scratch) or keeps in dense rings
(incremental). Here the stages' window caches are the draft layers' SWA caches
(``swa_cache_name(n_layers + i)`` for stage i), KV-cache groups of the paged pools like the
backbone's window layers (draft layers are SWA-only layers of their own:
`docs/serving.md#speculative-decoding-and-the-ring`):

* `seed_drafter` writes, for every token of a step, each stage's context latent
  (`dsv4.dspark.context_latents` of the target layers' hidden states, rotated at the token's
  position) at the token's slot of that stage's group, ``batch.window_slots[g]`` — the slot
  mapping the backbone's window layers write through. Every step seeds: prefill chunks and the
  verification of drafts alike.
* `draft_paged` drafts the block ``[next_token, noise...]`` at positions ``start[r] ..
  start[r] + K - 1`` for each request row of the step. Its context, positions ``start - W ..
  start - 1`` (W the window), is exactly the window of position ``start - 1``: each stage reads
  it through the row's block table of its group with the window attention kernel
  (`pallas_kernels.window_attention`, the pages the step's windows cover,
  `dsv4.paged.pools.read_for_table`), and merges that softmax state with the K block latents
  (every block query sees all of them) before the sink enters the denominator. The stages and
  heads are `dsv4.dspark.run_drafter`'s.

Invariant (overwrite by position, as for the backbone's window caches): a verification step
writes the drafter's latents of every row it runs, rejected drafts included, so after it the
rows at positions >= start (start = the position after the last accepted token) may hold
latents of tokens that are not the request's. The drafter only reads positions < start, and
every later step writes the positions it runs (from its first, ``start``) before anything reads
them, so a rejected row is rewritten by the committed token at its position before it can be
read. Rows below start are the committed tokens' own, whichever step (or, after a prefix hit,
whichever request) wrote them. The tests fill such rows with NaN to check it.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from cache.layout import swa_cache_name
from dsv4 import dspark
from dsv4.config import ModelConfig
from dsv4.paged import pools as P
from dsv4.paged.batch import StepBatch
from dsv4.paged.step import (
    ATTENTION_HEADS,
    core_options,
    data_shards,
    local_kernel,
    records_quantise,
)
from pallas_kernels.window_attention import window_attention
from pallas_kernels.window_attention.reference import finish, merge_states, softmax_state

__all__ = ["draft_cache_names", "draft_paged", "seed_drafter"]


def draft_cache_names(cfg: ModelConfig) -> tuple[str, ...]:
    """The window cache of each drafter stage, in stage order (layers n_layers + i)."""
    return tuple(swa_cache_name(cfg.n_layers + i) for i in range(cfg.n_mtp_layers))


def _check(cfg: ModelConfig, layout) -> None:
    if not (cfg.n_mtp_layers and cfg.dspark_block_size):
        raise ValueError(
            f"config has no DSpark drafter (n_mtp_layers={cfg.n_mtp_layers}, "
            f"dspark_block_size={cfg.dspark_block_size}; both must be > 0)"
        )
    for name in draft_cache_names(cfg):
        if layout.layer(name).kind != "swa":  # layer() names a missing layer itself
            raise ValueError(f"{name!r} is not a window cache in this layout")


def seed_drafter(
    params,
    cfg: ModelConfig,
    layout,
    pools: dict[str, jax.Array],
    batch: StepBatch,
    main_hidden: jax.Array,  # [T, n_t * dim] `dspark.target_hidden` of the step's tokens
) -> dict[str, jax.Array]:
    """Write every stage's context latent of the step's tokens into its window cache, at the
    tokens' window slots (padding: slot -1, nothing written). Returns the updated pools."""
    _check(cfg, layout)
    pos = jnp.where(batch.positions >= 0, batch.positions, 0)
    qdq = cfg.quant_sim and not records_quantise(layout, "swa")
    latents = dspark.context_latents(params, cfg, main_hidden, pos, qdq=qdq)
    for name, kv in zip(draft_cache_names(cfg), latents, strict=True):
        slots = batch.window_slots[layout.group_of(name)]
        pools = P.write_layer(layout, pools, name, slots, kv)
    return pools


def draft_paged(
    params,
    cfg: ModelConfig,
    layout,
    pools: dict[str, jax.Array],
    batch: StepBatch,
    next_token: jax.Array,  # i32[R] the token at position start[r]
    start: jax.Array,  # i32[R] the block's first position; <= 0: the row drafts nothing
    *,
    impl: str | None = None,
    interpret: Any = False,
    shard_axis: bool = False,
    mesh=None,
) -> dspark.DraftBlock:
    """The draft block of every request row of ``batch`` (module docstring) from the caches
    `seed_drafter` wrote: ``start[r] - 1`` must be a position row r ran in this step (rows with
    ``start <= 0`` get a block to be ignored). ``shard_axis``: a leading axis of D data shards
    on the inputs and the block, each stage's window attention per shard (`docs/scale_out.md`).

    Returns `dsv4.dspark.DraftBlock` with ``[R, K, ...]`` fields (K = dspark_block_size)."""
    _check(cfg, layout)
    kern = {"impl": impl} if impl in (None, "reference") else {"impl": impl, "interpret": interpret}
    attend_rows = functools.partial(_attend_rows, cfg, layout, kern, mesh)
    if shard_axis:
        return _draft_shards(params, cfg, attend_rows, pools, batch, next_token, start, mesh)

    def attend(i: int, q: jax.Array, kv: jax.Array, sink: jax.Array) -> jax.Array:
        return attend_rows(i, q, kv, sink, pools, batch, start)

    next_token = jnp.where(start > 0, next_token, 0).astype(jnp.int32)
    return dspark.run_drafter(params, cfg, attend, next_token, jnp.maximum(start, 0), mesh=mesh)


def _attend_rows(cfg: ModelConfig, layout, kern, mesh, i, q, kv, sink, pools, batch, start):
    """Stage i's attention of one shard's rows (q [R, K, H, hd], kv [R, K, hd]): the window of
    position ``start[r] - 1`` read through the stage's cache, merged with the row's block."""
    k = cfg.dspark_block_size
    scale = cfg.head_dim**-0.5
    num_rows, _, h, d = q.shape
    # every block query of row r attends to the window of position start[r] - 1
    ctx_pos = jnp.repeat(jnp.where(start > 0, start - 1, -1), k)  # i32[R * K]
    query_req = jnp.repeat(jnp.arange(num_rows, dtype=jnp.int32), k)
    name = draft_cache_names(cfg)[i]
    pages, table = P.read_for_table(
        layout,
        pools,
        name,
        batch.block_tables[layout.group_of(name)],
        dtype=q.dtype,
        positions=batch.positions,
        token_req=batch.token_req,
        window=cfg.window_size,
    )
    qf = q.reshape(num_rows * k, h, d)
    context = local_kernel(  # on a multi-device mesh: per device, heads over model
        window_attention,
        (qf, pages, table, query_req, ctx_pos, sink),
        dict(window=cfg.window_size, scale=scale, replay_start=batch.replay_start,
             return_state=True, **kern, **core_options(mesh)),
        ATTENTION_HEADS,
        mesh=mesh,
    )  # fmt: skip
    own = jnp.repeat(kv.astype(jnp.float32), k, axis=0)  # [R * K, K, hd]: the row's block
    block = softmax_state(qf, own, jnp.ones(own.shape[:2], bool), scale)
    out = finish(merge_states(context, block), sink, jnp.zeros_like(ctx_pos), jnp.float32)
    return out.reshape(num_rows, k, h, d)


def _draft_shards(params, cfg: ModelConfig, attend_rows, pools, batch, next_token, start, mesh):
    """`draft_paged` with a leading shard axis: ``attend_rows`` (`_attend_rows`) per shard
    under `jax.vmap` (split over ``mesh``'s ``data`` axis), the stages on all D x R rows."""
    shards, num_rows = start.shape
    split = "data" if data_shards(mesh) > 1 else None

    def attend(i: int, q: jax.Array, kv: jax.Array, sink: jax.Array) -> jax.Array:
        per_shard = jax.vmap(
            functools.partial(attend_rows, i),
            in_axes=(0, 0, None, 0, 0, 0),
            spmd_axis_name=split,
        )
        q = q.reshape(shards, num_rows, *q.shape[1:])
        kv = kv.reshape(shards, num_rows, *kv.shape[1:])
        out = per_shard(q, kv, sink, pools, batch, start)
        return out.reshape(shards * num_rows, *out.shape[2:])

    flat = start.reshape(-1)
    next_token = jnp.where(flat > 0, next_token.reshape(-1), 0).astype(jnp.int32)
    block = dspark.run_drafter(params, cfg, attend, next_token, jnp.maximum(flat, 0), mesh=mesh)
    return jax.tree.map(lambda x: x.reshape(shards, num_rows, *x.shape[1:]), block)
