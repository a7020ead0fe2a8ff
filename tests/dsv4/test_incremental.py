"""The dense-cache incremental path and generate() against the whole-sequence reference.

Every chunking of a prompt (one shot, chunks that split ratio-2 pairs, window and candidate-block
boundaries, token-by-token decode, different chunkings per row of one batch) must give the logits
of `reference.forward` at every position, in fp32, within 1e-4. Chunks are padded to one bucket
width so a single compiled step serves every chunk size (padding must read and write nothing).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4 import model, reference
from dsv4.generation import generate, sample_logits

SEQ = 72  # r=2 sources see 36 entries (> top-k 16); r=1 see 72 (> 8 candidate blocks of 4)
BUCKET = 16
TOL = 1e-4


@functools.cache
def _step():
    return jax.jit(model.forward_step, static_argnums=1)


@pytest.fixture(scope="module")
def tokens(tiny_cfg):
    return jax.random.randint(jax.random.PRNGKey(7), (2, SEQ), 3, tiny_cfg.vocab_size)


@pytest.fixture(scope="module")
def ref_logits(tiny_params, tiny_cfg, tokens):
    with jax.default_matmul_precision("highest"):
        return np.asarray(
            jax.jit(reference.forward, static_argnums=1)(tiny_params, tiny_cfg, tokens)
        )


def run_chunks(params, cfg, tokens, chunks_per_row, *, bucket=BUCKET, nan_pad=True):
    """Feed each row its own chunk sizes, padded to ``bucket``; returns logits [B, T, V]."""
    b, t = tokens.shape
    cache = model.init_cache(cfg, b, t + 8, fill=np.nan if nan_pad else 0.0)
    tokens = np.asarray(tokens)
    out = np.full((b, t, cfg.vocab_size), np.nan, np.float32)
    done = [0] * b
    queues = [list(c) for c in chunks_per_row]
    step = _step()
    while any(queues):
        chunk = np.zeros((b, bucket), np.int32)
        start = np.zeros(b, np.int32)
        lengths = np.zeros(b, np.int32)
        for r in range(b):
            start[r] = done[r]
            if queues[r]:
                n = queues[r].pop(0)
                chunk[r, :n] = tokens[r, done[r] : done[r] + n]
                # padding tokens carry junk ids: they must not matter
                chunk[r, n:] = 5 if nan_pad else 0
                lengths[r] = n
        logits, cache = step(params, cfg, cache, jnp.asarray(chunk), start, lengths)
        logits = np.asarray(logits)
        for r in range(b):
            n = lengths[r]
            out[r, done[r] : done[r] + n] = logits[r, :n]
            done[r] += n
    assert done == [t] * b
    return out


def _check(out, ref):
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize(
    "chunks",
    [
        [16] * 4 + [8],  # even chunks
        [7, 13, 15, 9, 1, 16, 11],  # odd starts: ratio-2 pairs straddle chunk boundaries
        [8, 8, 1, 15, 16, 16, 8],  # window-sized chunks, then a pair split at 17
        [1] * 5 + [16, 16, 15, 16] + [1] * 4,  # decode, prefill, then decode
    ],
)
def test_chunked_prefill_matches_reference(tiny_params, tiny_cfg, tokens, ref_logits, chunks):
    assert sum(chunks) == SEQ
    out = run_chunks(tiny_params, tiny_cfg, tokens, [chunks, chunks])
    _check(out, ref_logits)


def test_rows_with_different_chunkings_in_one_batch(tiny_params, tiny_cfg, tokens, ref_logits):
    row0 = [3, 16, 5, 16, 16, 16]
    row1 = [16, 1, 1, 1, 16, 9, 12, 16]
    out = run_chunks(tiny_params, tiny_cfg, tokens, [row0, row1])
    _check(out, ref_logits)


def test_one_shot_prefill_then_decode(tiny_params, tiny_cfg, tokens, ref_logits):
    """The whole prompt in one chunk (no padding), then token-by-token decode."""
    step = _step()
    cache = model.init_cache(tiny_cfg, 2, SEQ, fill=np.nan)
    split = 41
    b = tokens.shape[0]
    lg, cache = step(
        tiny_params, tiny_cfg, cache, tokens[:, :split], jnp.zeros(b, jnp.int32), jnp.full(b, split)
    )
    outs = [np.asarray(lg)]
    for p in range(split, SEQ):
        lg, cache = step(
            tiny_params,
            tiny_cfg,
            cache,
            tokens[:, p : p + 1],
            jnp.full(b, p),
            jnp.ones(b, jnp.int32),
        )
        outs.append(np.asarray(lg))
    _check(np.concatenate(outs, axis=1), ref_logits)


@settings(max_examples=6, deadline=None, derandomize=True)
@given(data=st.data())
def test_random_chunkings(tiny_params, tiny_cfg, tokens, ref_logits, data):
    rows = []
    for _ in range(2):
        left, chunks = SEQ, []
        while left:
            n = data.draw(st.integers(1, min(BUCKET, left)))
            chunks.append(n)
            left -= n
        rows.append(chunks)
    out = run_chunks(tiny_params, tiny_cfg, tokens, rows)
    _check(out, ref_logits)


def test_padding_rows_change_nothing(tiny_params, tiny_cfg, tokens):
    """A row with length 0 in a step keeps its cache exactly (nothing written)."""
    step = _step()
    cache = model.init_cache(tiny_cfg, 2, SEQ)
    chunk = tokens[:, :BUCKET]
    _, c1 = step(
        tiny_params, tiny_cfg, cache, chunk, jnp.zeros(2, jnp.int32), jnp.array([BUCKET, 0])
    )
    for name, arr in c1.items():
        np.testing.assert_array_equal(np.asarray(arr[1]), np.asarray(cache[name][1]), err_msg=name)


# -- generate ---------------------------------------------------------------------------------


def _greedy_reference(params, cfg, prompt, n, width=48):
    """Greedy decoding with the whole-sequence reference. The sequence is padded to a fixed
    width (one compile); the reference is causal, so position len-1 ignores the padding."""
    fwd = jax.jit(reference.forward, static_argnums=1)
    seq = list(prompt)
    assert len(seq) + n <= width
    for _ in range(n):
        padded = np.zeros((1, width), np.int32)
        padded[0, : len(seq)] = seq
        logits = fwd(params, cfg, jnp.asarray(padded))
        seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
    return seq[len(prompt) :]


# every generate() test uses prompts [2, 20] and 8 new tokens: one compile (two with EOS)
GEN_NEW = 8


@pytest.fixture(scope="module")
def gen_prompts(tiny_cfg):
    rng = np.random.default_rng(3)
    return rng.integers(3, tiny_cfg.vocab_size, (2, 20)).astype(np.int32)


def test_greedy_generate_equals_reference_decoding(tiny_params, tiny_cfg, gen_prompts):
    lengths = np.array([20, 7], np.int32)
    out = np.asarray(generate(tiny_params, tiny_cfg, gen_prompts, GEN_NEW, prompt_lengths=lengths))
    assert out.shape == (2, GEN_NEW) and out.dtype == np.int32
    for r in range(2):
        want = _greedy_reference(tiny_params, tiny_cfg, gen_prompts[r, : lengths[r]], GEN_NEW)
        assert list(out[r]) == want, f"row {r}"


def test_generate_rows_are_independent_of_the_batch(tiny_params, tiny_cfg, gen_prompts):
    lengths = np.array([20, 7], np.int32)
    out = np.asarray(generate(tiny_params, tiny_cfg, gen_prompts, GEN_NEW, prompt_lengths=lengths))
    swapped = np.asarray(
        generate(tiny_params, tiny_cfg, gen_prompts[::-1], GEN_NEW, prompt_lengths=lengths[::-1])
    )
    np.testing.assert_array_equal(out, swapped[::-1])


def test_generate_sampling_is_seeded_and_valid(tiny_params, tiny_cfg, gen_prompts):
    key = jax.random.PRNGKey(11)
    kw = dict(temperature=1.0, top_p=0.9, key=key)
    a = np.asarray(generate(tiny_params, tiny_cfg, gen_prompts, GEN_NEW, **kw))
    b = np.asarray(generate(tiny_params, tiny_cfg, gen_prompts, GEN_NEW, **kw))
    np.testing.assert_array_equal(a, b)
    assert ((a >= 0) & (a < tiny_cfg.vocab_size)).all()
    greedy = np.asarray(generate(tiny_params, tiny_cfg, gen_prompts, GEN_NEW))
    assert (a != greedy).any()  # temperature 1 actually samples


def test_generate_stops_at_eos(tiny_params, tiny_cfg, gen_prompts):
    free = np.asarray(generate(tiny_params, tiny_cfg, gen_prompts, GEN_NEW))
    eos = int(free[0, 2])  # pretend the third generated token of row 0 is EOS
    out = np.asarray(generate(tiny_params, tiny_cfg, gen_prompts, GEN_NEW, eos_token_id=eos))
    for r in range(2):
        row = list(free[r])
        first = row.index(eos) if eos in row else GEN_NEW
        assert list(out[r, : first + 1]) == row[: first + 1]
        assert (out[r, first:] == eos).all()


def test_sample_logits_top_p_keeps_the_nucleus():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.PRNGKey(0), 400)
    picks = np.array(
        [int(sample_logits(logits, k, jnp.float32(1.0), jnp.float32(0.7))[0]) for k in keys[:200]]
    )
    assert set(picks) <= {0, 1}  # 0.5 + 0.3 reaches 0.7; 2 and 3 are outside the nucleus
    greedy = sample_logits(logits, keys[0], jnp.float32(0.0), jnp.float32(1.0))
    assert int(greedy[0]) == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=2, prompt_lengths=[0]), "prompt_lengths"),
        (dict(max_new_tokens=2, prompt_lengths=[1, 2]), "shape"),
        (dict(max_new_tokens=2, temperature=0.5), "key"),
        (dict(max_new_tokens=2, top_p=0.0), "top_p"),
        (dict(max_new_tokens=600), "max_seq_len"),
    ],
)
def test_generate_rejects_bad_arguments(tiny_params, tiny_cfg, kwargs, match):
    prompt = np.arange(3, 8, dtype=np.int32)[None]
    with pytest.raises(ValueError, match=match):
        generate(tiny_params, tiny_cfg, prompt, **kwargs)
