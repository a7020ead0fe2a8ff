"""Training the DSpark drafter over a frozen backbone (`training.dspark`).

A two-layer `tiny_v41` (the config of test_train.py, which compiles quickly) with a one-stage
drafter reading both layers: teacher forcing computes what the drafter computes whenever the
teacher's tokens are the drafts, only ``mtp.*`` tensors learn, the draft loss falls, and the
acceptance figures are consistent."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4 import dspark, reference
from dsv4.config import tiny_v41
from dsv4.params import init_params
from tests.training.train_configs import two_layer_config
from training import data as D
from training import dspark as TD

SEQ = 32


@pytest.fixture(scope="module")
def cfg():
    return two_layer_config(
        dspark_block_size=3,
        dspark_target_layer_ids=(0, 1),
        dspark_markov_rank=8,
        dspark_noise_token_id=2,
    )


@pytest.fixture(scope="module")
def params(cfg):
    with jax.default_matmul_precision("highest"):
        return init_params(cfg, jax.random.PRNGKey(1))


@pytest.fixture(scope="module")
def tokens():
    split = D.source_split()
    return D.load_split(dataclasses.replace(split, train=split.train[:3]), "train")


def test_teacher_forcing_with_the_drafts_is_the_drafter(cfg, params, tokens):
    k = cfg.dspark_block_size
    windows = jnp.asarray(D.consecutive_windows(tokens, SEQ + 1)[:2])
    cut = 20

    @jax.jit
    def both(params, windows):
        _, streams = reference.forward_streams(params, cfg, windows[:, :SEQ], (0, 1))
        hidden = dspark.target_hidden(cfg, streams)
        ref = dspark.draft_from_hidden(params, cfg, hidden[:, :cut], windows[:, cut])
        # the windows with the drafts after the cut: the teacher is the drafter itself
        teacher = windows.at[:, cut + 1 : cut + k].set(ref.tokens[:, : k - 1])
        cuts = jnp.full((2, 1), cut, jnp.int32)
        return ref, teacher, TD._blocks(params, cfg, hidden, teacher, cuts)

    with jax.default_matmul_precision("highest"):
        ref, teacher, (block, targets) = both(params, windows)
    np.testing.assert_allclose(block.logits, ref.logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(block.confidence, ref.confidence, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(block.tokens, ref.tokens)
    np.testing.assert_array_equal(targets, teacher[:, cut + 1 : cut + 1 + k])


def test_only_the_drafter_learns_and_its_loss_falls(cfg, params, tokens):
    dcfg = TD.DraftTrainConfig(steps=6, batch_size=2, seq_len=SEQ, cuts_per_row=8,
                               learning_rate=1e-2, warmup_steps=1, seed=3)  # fmt: skip
    backbone = {k: v for k, v in params.items() if not k.startswith("mtp.")}
    before = {k: np.asarray(v) for k, v in backbone.items()}
    state, history = TD.train_drafter(backbone, cfg, dcfg, tokens, progress=False)
    assert set(state.params) == set(TD.drafter_params(params)) and int(state.step) == 6
    for k, v in backbone.items():
        np.testing.assert_array_equal(np.asarray(v), before[k], err_msg=k)
    losses = [row["draft_loss"] for row in history]
    assert np.isfinite(losses).all()
    # on the first batch (at its cuts) the trained drafter does better than the fresh one
    windows = jnp.asarray(D.batch_at(tokens, 0, batch_size=2, window=SEQ + 1, seed=3))
    cuts = TD._cuts(jax.random.PRNGKey(0), 2, 8, SEQ, cfg.dspark_block_size)
    loss = jax.jit(lambda d: TD.draft_losses(d, backbone, cfg, windows, cuts)[0])
    fresh = TD.init_draft_state(cfg, dcfg, backbone).params
    assert float(loss(state.params)) < float(loss(fresh)) - 0.2
    assert len(history[0]["slot_accuracy"]) == cfg.dspark_block_size
    acc = TD.acceptance({**backbone, **state.params}, cfg, tokens, prefix_len=24,
                        num_prefixes=8, batch_size=4)  # fmt: skip
    per = acc["per_position_acceptance"]
    assert acc["prefixes"] == 8 and len(per) == cfg.dspark_block_size
    assert all(0 <= p <= 1 for p in per) and all(a >= b for a, b in itertools.pairwise(per))
    assert acc["mean_acceptance_length"] == pytest.approx(sum(per))
    assert acc["tokens_per_verification"] == pytest.approx(1 + sum(per))


def test_bad_config():
    with pytest.raises(ValueError, match="cuts_per_row=0"):
        TD.DraftTrainConfig(steps=1, cuts_per_row=0)
    with pytest.raises(ValueError, match="no DSpark drafter"):
        TD.init_draft_state(tiny_v41(), TD.DraftTrainConfig(steps=1), {})
