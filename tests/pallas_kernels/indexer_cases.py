"""indexer_topk's released-shape cases (shared by test_indexer.py and test_megacore.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.indexer import indexer_topk


def indexer_released_args(tokens, entries, e, dtype=jnp.bfloat16):
    s = jax.ShapeDtypeStruct
    nb = entries // e
    reqs = tokens
    return (
        s((tokens, 32, 128), dtype),
        s((tokens, 32), jnp.float32),
        s((reqs * nb + 1, e, 128), dtype),
        s((reqs, nb), jnp.int32),
        s((tokens,), jnp.int32),
        s((tokens,), jnp.int32),
        s((tokens,), jnp.int32),
    )


RELEASED_MODES = {
    "plain-r2": dict(e=32, kw=dict(k=512)),
    "source-r1": dict(e=64, kw=dict(k=512, candidate_block_size=8, candidate_topk_blocks=2048)),
    "consumer-r1": dict(e=64, kw=dict(k=512, candidate_block_size=8), candidates=True),
}


def indexer_fn(mode, impl):
    spec = RELEASED_MODES[mode]
    kw = dict(spec["kw"], entries_per_block=spec["e"], impl=impl)
    if spec.get("candidates"):
        return lambda *a: indexer_topk(*a[:7], candidates=a[7], **kw)
    return lambda *a: indexer_topk(*a, **kw)


def indexer_released(mode, tokens=8, entries=128 * 1024):
    spec = RELEASED_MODES[mode]
    args = indexer_released_args(tokens, entries // (2 if spec["e"] == 32 else 1), spec["e"])
    if spec.get("candidates"):
        args += (jax.ShapeDtypeStruct((tokens, 2048), jnp.int32),)
    return args
