"""DSpark drafts from scratch for the tests that check the paged drafter (tests/dsv4 and
tests/serving): the reference forward's streams of whole sequences, then
`dspark.draft_from_hidden` at given prefix lengths. Shapes are fixed (sequences padded to
[16, 128], rows to a multiple of 256) so that both test files share one compilation of each."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsv4 import dspark, reference

MAX_SEQUENCES, WIDTH, ROWS = 16, 128, 256


@functools.cache
def _streams_fn(cfg):
    targets = cfg.dspark_target_layer_ids
    return jax.jit(lambda params, tokens: reference.forward_streams(params, cfg, tokens, targets))


_draft = jax.jit(dspark.draft_from_hidden, static_argnums=1)


def reference_streams(params, cfg, sequences):
    """(logits f32[S, WIDTH, vocab], the drafter's input [S, WIDTH, n_t * dim]) of each token
    sequence, padded after its end (the forward is causal: padding changes nothing before)."""
    if len(sequences) > MAX_SEQUENCES or max(map(len, sequences)) > WIDTH:
        raise ValueError(f"at most {MAX_SEQUENCES} sequences of at most {WIDTH} tokens")
    toks = np.zeros((MAX_SEQUENCES, WIDTH), np.int32)
    for i, seq in enumerate(sequences):
        toks[i, : len(seq)] = seq
    logits, streams = _streams_fn(cfg)(params, jnp.asarray(toks))
    return np.asarray(logits), dspark.target_hidden(cfg, streams)


def scratch_blocks(params, cfg, hidden, rows, starts, next_tokens) -> dspark.DraftBlock:
    """`dspark.draft_from_hidden` of sequence ``rows[j]``'s first ``starts[j]`` positions
    (``hidden`` from `reference_streams`), its block opened by ``next_tokens[j]``: numpy fields
    of len(rows) rows."""
    n = len(rows)
    pad = -(-n // ROWS) * ROWS - n
    rows = np.concatenate([np.asarray(rows, np.int32), np.zeros(pad, np.int32)])
    starts = np.concatenate([np.asarray(starts, np.int32), np.ones(pad, np.int32)])
    nxt = np.concatenate([np.asarray(next_tokens, np.int32), np.zeros(pad, np.int32)])
    block = _draft(params, cfg, hidden[rows], jnp.asarray(nxt), lengths=jnp.asarray(starts))
    return jax.tree.map(lambda x: np.asarray(x)[:n], block)
