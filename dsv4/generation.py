"""`generate()`: prefill and a decode loop, jitted end to end, caches on device.

The prompt batch is prefilled in one chunk (rows may have different prompt lengths; a row's
padding reads and writes nothing), then a `lax.while_loop` decodes one token per row per
iteration with the dense caches of `dsv4.model`. No host code runs inside the loop.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from dsv4.config import ModelConfig
from dsv4.inputs import check_model_params, check_token_ids
from dsv4.model import forward_step, init_cache

__all__ = ["generate", "sample_logits"]


def sample_logits(
    logits: jax.Array, key: jax.Array, temperature: jax.Array, top_p: jax.Array
) -> jax.Array:
    """One token per row of ``logits`` [B, V]: argmax when temperature == 0, else a sample from
    softmax(logits / temperature) restricted to the smallest set of tokens whose probability
    reaches ``top_p`` (nucleus; the most likely token is always kept). ``temperature`` and
    ``top_p`` are f32 scalars (traced under jit); only the chosen branch runs."""
    # greedy decoding does not pay for the nucleus's sort of every row's vocabulary (on CPU
    # that sort costs more than the rest of a tiny model's decode step at batch 8)
    return jax.lax.cond(temperature > 0, _nucleus_sample, _greedy, logits, key, temperature, top_p)


def _greedy(logits, key, temperature, top_p):
    del key, temperature, top_p
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _nucleus_sample(logits, key, temperature, top_p):
    """A nucleus sample per row of logits [B, V] at temperature > 0: i32[B]."""
    scaled = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-5)
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly more likely tokens
    keep = before < top_p
    keep = keep.at[:, 0].set(True)
    masked = jnp.where(keep, sorted_logits, -jnp.inf)
    pick = jax.random.categorical(key, masked, axis=-1)
    return jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "eos_token_id", "mesh"))
def _generate(
    params, prompt, lengths, key, temperature, top_p, *, cfg, max_new_tokens, eos_token_id, mesh
):
    b, t = prompt.shape
    dtype = params["embed.weight"].dtype
    cache = init_cache(cfg, b, t + max_new_tokens, dtype)
    zeros = jnp.zeros((b,), jnp.int32)
    logits, cache = forward_step(params, cfg, cache, prompt, zeros, lengths, mesh=mesh)
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    key, sub = jax.random.split(key)
    tok = sample_logits(last, sub, temperature, top_p)
    out = jnp.zeros((b, max_new_tokens), jnp.int32).at[:, 0].set(tok)
    done = tok == eos_token_id if eos_token_id is not None else jnp.zeros((b,), bool)

    def cond(carry):
        i, _, _, _, done, _ = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        i, cache, out, tok, done, key = carry
        logits, cache = forward_step(
            params, cfg, cache, tok[:, None], lengths + i - 1, jnp.ones((b,), jnp.int32), mesh=mesh
        )
        key, sub = jax.random.split(key)
        nxt = sample_logits(logits[:, 0], sub, temperature, top_p)
        if eos_token_id is not None:
            nxt = jnp.where(done, eos_token_id, nxt)
            done = done | (nxt == eos_token_id)
        out = out.at[:, i].set(nxt)
        return i + 1, cache, out, nxt, done, key

    carry = (jnp.int32(1), cache, out, tok, done, key)
    _, _, out, _, done, _ = jax.lax.while_loop(cond, body, carry)
    if eos_token_id is not None:
        # rows that finished early: the loop may stop before writing their tail
        idx = jnp.arange(max_new_tokens)[None, :]
        first_eos = jnp.argmax(out == eos_token_id, axis=1)
        has = jnp.any(out == eos_token_id, axis=1)
        out = jnp.where(has[:, None] & (idx > first_eos[:, None]), eos_token_id, out)
    return out


def _prompt_lengths(prompt_lengths, b: int, t: int) -> jax.Array:
    """i32[b] of `generate`'s ``prompt_lengths`` (all ``t`` when None), each in 1..t."""
    if prompt_lengths is None:
        return jnp.full((b,), t, jnp.int32)
    lengths = jnp.asarray(prompt_lengths, jnp.int32)
    if lengths.shape != (b,):
        raise ValueError(f"prompt_lengths must have shape ({b},), got {lengths.shape}")
    bad = [int(v) for v in jax.device_get(lengths) if not 1 <= int(v) <= t]
    if bad:
        raise ValueError(f"prompt_lengths {bad} outside 1..{t} (the prompt width)")
    return lengths


def _check_options(cfg: ModelConfig, t: int, max_new_tokens, temperature, top_p, key, eos) -> None:
    """`generate`'s scalar arguments, for a prompt width ``t``."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise TypeError(f"generate: max_new_tokens={max_new_tokens!r} must be an int >= 1")
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens={max_new_tokens!r} must be an int >= 1")
    if t + max_new_tokens > cfg.max_seq_len:
        raise ValueError(
            f"generate: prompt width {t} + max_new_tokens {max_new_tokens} exceeds max_seq_len "
            f"{cfg.max_seq_len}"
        )
    if not 0 <= temperature < math.inf or not 0 < top_p <= 1:
        raise ValueError(
            f"generate: temperature={temperature} must be finite and >= 0 and top_p={top_p} "
            "must be in (0, 1]"
        )
    if eos is not None and not 0 <= eos < cfg.vocab_size:
        raise ValueError(
            f"generate: eos_token_id={eos!r} is outside the vocabulary [0, {cfg.vocab_size})"
        )
    if temperature > 0 and key is None:
        raise ValueError("generate: sampling (temperature > 0) needs a PRNG key: pass key=")


def generate(
    params,
    cfg: ModelConfig,
    prompt_tokens,
    max_new_tokens: int,
    *,
    prompt_lengths=None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    key: jax.Array | None = None,
    eos_token_id: int | None = None,
    mesh=None,
) -> jax.Array:
    """Generate ``max_new_tokens`` tokens after each prompt: int32[B, max_new_tokens].

    ``prompt_tokens`` int32[B, T]; row b's prompt is its first ``prompt_lengths[b]`` tokens (all
    T when None). Greedy when ``temperature`` is 0, else nucleus sampling with ``key``. With
    ``eos_token_id`` a row stops at its first EOS (the rest of its row is EOS). ``mesh``: the
    experts dispatch over its ``expert`` axis. Compiles once per config, shape and static arg.
    """
    shape = np.shape(prompt_tokens)
    lengths = _prompt_lengths(prompt_lengths, *shape) if len(shape) == 2 else None
    # the padding after a row's prompt is never read: only the prompts' ids are checked
    check_token_ids(
        "generate", "prompt_tokens", prompt_tokens, cfg.vocab_size, ndim=2, lengths=lengths
    )
    check_model_params("generate", params, cfg)
    prompt = jnp.asarray(prompt_tokens, jnp.int32)
    t = prompt.shape[1]
    _check_options(cfg, t, max_new_tokens, temperature, top_p, key, eos_token_id)
    if key is None:
        key = jax.random.PRNGKey(0)
    return _generate(
        params,
        prompt,
        lengths,
        key,
        jnp.float32(temperature),
        jnp.float32(top_p),
        cfg=cfg,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        mesh=mesh,
    )
