"""Bad input to the functional API and to checkpoint loading is refused before anything is
computed, with one line naming the value, where it was and what is allowed (issue 34): token ids
outside the vocabulary, non-integer token arrays, empty prompts, sequences past max_seq_len,
params built for another config, a missing or malformed config.json. Under `jax.jit` the values
are abstract: the range checks step aside and the shape checks still hold."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dsv4
from cache.layout import for_model, tiny_v41_desc
from dsv4 import dspark, model, reference
from dsv4.checkpoint import CheckpointError, load_pretrained, shipped_checkpoint
from dsv4.config import MODEL_PRESETS, ModelConfig, model_source, tiny_v41
from dsv4.inputs import check_token_ids
from dsv4.paged.batch import empty_batch
from dsv4.paged.step import paged_step

V = 512  # tiny_v41's vocabulary


def _tokens(*ids):
    return jnp.asarray([list(ids)], jnp.int32)


def test_reference_forward_refuses_bad_tokens(tiny_params, tiny_cfg):
    fwd = lambda t: reference.forward(tiny_params, tiny_cfg, t)  # noqa: E731
    with pytest.raises(ValueError, match=r"reference.forward: tokens\[0, 2\] = 512 .*\[0, 512\)"):
        fwd(_tokens(3, 4, V))
    with pytest.raises(ValueError, match=r"tokens\[0, 0\] = -1 is outside the vocabulary"):
        fwd(_tokens(-1, 4))
    with pytest.raises(TypeError, match="tokens must hold integer token ids, got dtype float32"):
        fwd(jnp.ones((1, 3)))
    with pytest.raises(TypeError, match="dtype bool"):
        fwd(np.ones((1, 3), bool))
    with pytest.raises(ValueError, match=r"tokens must be int32\[B, T\], got shape \[3\]"):
        fwd(jnp.arange(3))
    with pytest.raises(ValueError, match=r"tokens has no tokens \(shape \[1, 0\]\)"):
        fwd(jnp.zeros((1, 0), jnp.int32))
    with pytest.raises(ValueError, match=r"reaches position 512; .*0\.\.511 \(max_seq_len=512\)"):
        fwd(jnp.zeros((1, 513), jnp.int32))


def test_params_built_for_another_config_are_refused(
    tiny_params, tiny_cfg, engram_cfg, engram_params
):
    toks = _tokens(3, 4)
    other_vocab = tiny_cfg.replace(vocab_size=1024)
    with pytest.raises(ValueError, match=r"not built for this config.*embed\.weight \[512, 64\] "
                                         r"\(expected \[1024, 64\]\)"):  # fmt: skip
        reference.forward(tiny_params, other_vocab, _tokens(3, 4))
    with pytest.raises(ValueError, match=r"missing \['layers\.1\.engram\..*more"):
        reference.forward(tiny_params, engram_cfg, toks)
    with pytest.raises(TypeError, match="params must be a dict of tensors"):
        reference.forward([1, 2], tiny_cfg, toks)
    # the backbone's paths never read the drafter: its params are the drafting entry's business
    backbone = {k: v for k, v in engram_params.items() if not k.startswith("mtp.")}
    fwd = lambda t: reference.forward(backbone, engram_cfg, t)  # noqa: E731
    assert jax.eval_shape(fwd, jax.ShapeDtypeStruct((1, 4), jnp.int32)).shape == (1, 4, V)
    with pytest.raises(ValueError, match=r"dspark.draft: .*missing \['mtp\.0\."):
        dspark.draft(backbone, engram_cfg, toks)
    cache = model.init_cache(tiny_cfg, 1, 16)
    with pytest.raises(ValueError, match=r"model.forward_step: params were not built"):
        model.forward_step(tiny_params, other_vocab, cache, toks, 0, 2)
    with pytest.raises(ValueError, match=r"generate: params were not built"):
        dsv4.generate(tiny_params, other_vocab, toks, 2)


def test_forward_step_refuses_positions_the_cache_or_model_cannot_hold(tiny_params, tiny_cfg):
    cache = model.init_cache(tiny_cfg, 1, 32)

    def step(toks, start, lengths, **kw):
        return model.forward_step(tiny_params, tiny_cfg, cache, toks, start, lengths, **kw)

    toks = _tokens(3, 4, 5, 6)
    with pytest.raises(ValueError, match=r"model.forward_step: tokens\[0, 1\] = 600"):
        step(_tokens(3, 600), 0, 2)
    with pytest.raises(ValueError, match=r"row 0 starts at position 2, but its cache ends at "
                                         r"position -1: start must be 0"):  # fmt: skip
        step(toks, 2, 4)
    with pytest.raises(ValueError, match=r"start=\[-1\] must be >= 0"):
        step(toks, -1, 4)
    with pytest.raises(ValueError, match=r"lengths=\[5\] in 0\.\.4"):
        step(toks, 0, 5)
    with pytest.raises(ValueError, match="the cache holds \\(1,\\) sequences, tokens 2"):
        step(jnp.zeros((2, 4), jnp.int32), 0, 4)
    # a bounded replay (write_from) may rewind; it still stays inside the cache and the model
    with pytest.raises(ValueError, match=r"past the cache's 32 positions"):
        step(toks, 30, 4, write_from=jnp.array([30]))
    big = model.init_cache(tiny_cfg, 1, 1024)
    with pytest.raises(ValueError, match=r"the chunk reaches position 512; .*max_seq_len=512"):
        model.forward_step(tiny_params, tiny_cfg, big, toks, 509, 4, write_from=jnp.array([0]))


def test_padding_after_the_real_tokens_is_not_checked():
    """Only a row's first ``lengths[b]`` ids are read, so only they must be in range."""
    toks = np.array([[5, -1, 999], [7, 8, -1]])
    check_token_ids("f", "tokens", toks, V, ndim=2, lengths=np.array([1, 2]))
    with pytest.raises(ValueError, match=r"tokens\[1, 2\] = -1"):
        check_token_ids("f", "tokens", toks, V, ndim=2, lengths=np.array([1, 3]))


def test_under_jit_only_shapes_are_checked(tiny_params, tiny_cfg):
    """Traced ids are abstract: no host sync, no range check; dtypes and shapes still are."""
    fwd = lambda t: reference.forward(tiny_params, tiny_cfg, t)  # noqa: E731
    out = jax.eval_shape(fwd, jax.ShapeDtypeStruct((1, 4), jnp.int32))
    assert out.shape == (1, 4, V)
    with pytest.raises(TypeError, match="integer token ids"):
        jax.eval_shape(fwd, jax.ShapeDtypeStruct((1, 4), jnp.float32))
    with pytest.raises(ValueError, match="max_seq_len=512"):
        jax.eval_shape(fwd, jax.ShapeDtypeStruct((1, 600), jnp.int32))


def test_generate_refuses_bad_input(tiny_params, tiny_cfg):
    gen = lambda toks, n=2, **kw: dsv4.generate(tiny_params, tiny_cfg, toks, n, **kw)  # noqa: E731
    ok = _tokens(3, 4, 5)
    with pytest.raises(ValueError, match=r"generate: prompt_tokens\[0, 1\] = 99999 "):
        gen(_tokens(3, 99999))
    with pytest.raises(ValueError, match=r"prompt_tokens\[0, 0\] = -1"):
        gen(_tokens(-1, 3))
    with pytest.raises(TypeError, match="prompt_tokens must hold integer token ids"):
        gen(np.array([[3.0, 4.5]]))
    with pytest.raises(ValueError, match="has no tokens"):
        gen(np.zeros((1, 0), np.int32))
    with pytest.raises(ValueError, match="max_new_tokens=0 must be an int >= 1"):
        gen(ok, 0)
    with pytest.raises(TypeError, match=r"max_new_tokens=2\.0"):
        gen(ok, 2.0)
    with pytest.raises(ValueError, match="temperature=nan"):
        gen(ok, temperature=float("nan"), key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match=r"eos_token_id=512 is outside the vocabulary"):
        gen(ok, eos_token_id=V)
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        gen(ok, 510)
    with pytest.raises(ValueError, match=r"prompt_lengths \[4\] outside 1\.\.3"):
        gen(ok, prompt_lengths=[4])


def test_draft_refuses_bad_input(engram_params, engram_cfg, tiny_params):
    with pytest.raises(ValueError, match=r"dspark.draft: tokens\[0, 1\] = 512"):
        dspark.draft(engram_params, engram_cfg, _tokens(3, V))
    with pytest.raises(TypeError, match="tokens must hold integer token ids"):
        dspark.draft(engram_params, engram_cfg, jnp.ones((1, 2)))
    with pytest.raises(ValueError, match=r"dspark.draft: params were not built .*\(missing"):
        dspark.draft(tiny_params, engram_cfg, _tokens(3, 4))


def test_paged_step_refuses_bad_batches(tiny_params, tiny_cfg):
    """The public step's own checks come before the layout or the pools are read."""
    config = for_model(tiny_v41_desc(), num_gpu_blocks_override=8)
    batch = empty_batch(config, max_model_len=64, num_tokens=8, num_rows=2)
    bad = dataclasses.replace(batch, token_ids=np.array([3, 4, V, 0, 0, 0, 0, 0], np.int32))
    with pytest.raises(ValueError, match=r"paged_step: batch.token_ids\[2\] = 512"):
        paged_step(tiny_params, tiny_cfg, None, {}, bad)
    floats = dataclasses.replace(batch, token_ids=np.zeros(8, np.float32))
    with pytest.raises(TypeError, match=r"batch.token_ids must hold integer token ids"):
        paged_step(tiny_params, tiny_cfg, None, {}, floats)
    with pytest.raises(ValueError, match=r"paged_step: params were not built"):
        paged_step(tiny_params, tiny_cfg.replace(vocab_size=1024), None, {}, batch)
    with pytest.raises(TypeError, match="batch must be a StepBatch"):
        paged_step(tiny_params, tiny_cfg, None, {}, {"token_ids": batch.token_ids})


# -- config.json and model names -----------------------------------------------------------------


def _checkpoint_dir(tmp_path, text: str):
    (tmp_path / "config.json").write_text(text)
    return tmp_path


def test_a_malformed_config_json_names_the_file_and_the_position(tmp_path):
    good = json.dumps(tiny_v41().to_hf_dict(), indent=1)
    path = _checkpoint_dir(tmp_path, good.replace('"vocab_size": 512,', '"vocab_size": 512', 1))
    file = os.path.join(path, "config.json")
    message = re.escape(file) + r": not valid JSON: Expecting ',' delimiter at line \d+ column \d+"
    for load in (ModelConfig.from_json, lambda p: load_pretrained(p, progress=False)):
        with pytest.raises(ValueError, match=message):
            load(path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds a JSON list, not an object"):
        ModelConfig.from_json(path)


def test_an_empty_or_incomplete_config_lists_the_missing_keys(tmp_path):
    with pytest.raises(ValueError, match=r"config lacks the keys \['vocab_size', 'dim \(hidden_si"):
        ModelConfig.from_json(_checkpoint_dir(tmp_path, "{}"))
    hf = tiny_v41().to_hf_dict()
    del hf["text_config"]["num_attention_heads"], hf["text_config"]["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(
        ValueError, match=r"lacks the keys \['vocab_size', 'n_heads \(num_attention"
    ):
        load_pretrained(tmp_path, progress=False)
    # what the dict gives is enough: an override fills a missing key
    assert ModelConfig.from_dict(hf, vocab_size=512, n_heads=4) == tiny_v41()


def test_missing_folders_and_model_names(tmp_path):
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        load_pretrained(tmp_path / "nope", progress=False)
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        load_pretrained(tmp_path, progress=False)
    with pytest.raises(CheckpointError, match=r"tiny_v41 has random weights.*init_params"):
        load_pretrained("tiny_v41", progress=False)
    with pytest.raises(ValueError, match="'v41_flash' is a config without weights here"):
        load_pretrained("v41_flash", progress=False)
    with pytest.raises(ValueError, match="no such directory"):
        model_source(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match=r"has no config\.json"):
        model_source(str(tmp_path))
    for name, preset in MODEL_PRESETS.items():
        if preset.weights == "random":
            assert model_source(name) == ("random", None)
        elif preset.weights == "shipped":
            assert model_source(name) == ("checkpoint", shipped_checkpoint(name))


# -- the fuzz --------------------------------------------------------------------------------------

_W = 8  # the fuzzed chunk width


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    ids=st.lists(st.integers(-2, V + 1), min_size=_W, max_size=_W),
    dtype=st.sampled_from(["int32", "int64", "float32", "bool"]),
    start=st.integers(-1, 1),
    length=st.integers(-1, _W + 1),
    batch=st.integers(1, 2),
)
def test_fuzz_forward_step(tiny_params, tiny_cfg, ids, dtype, start, length, batch):
    """Random ids, dtypes, starts, lengths and batches into a fresh one-row cache: exactly the
    inputs an independent rule calls bad are refused, each with one clear line (the accepted
    ones' numerics: tests/dsv4/test_incremental.py against the reference, every chunking)."""
    toks = np.asarray([ids] * batch).astype(dtype)
    cache = model.init_cache(tiny_cfg, 1, 2 * _W, fill=np.nan)
    valid = (
        dtype.startswith("int")
        and batch == 1
        and start == 0
        and 0 <= length <= _W
        and all(0 <= i < V for i in ids[:length])
    )
    if valid:  # accepted: the entry's checks pass (running it is the numerics tests' job)
        model._check_step(tiny_params, tiny_cfg, cache, toks, start, length, None)
        return
    with pytest.raises((ValueError, TypeError)) as exc:
        model.forward_step(tiny_params, tiny_cfg, cache, toks, start, length)
    text = str(exc.value)
    assert text.startswith("model.forward_step: ") and "\n" not in text, text
