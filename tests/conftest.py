"""Test-wide settings: run on the CPU unless the caller chose a platform (the device check
script sets JAX_PLATFORMS itself). Deviceless TPU/GPU compiles do not need a device backend.

The tiny model's config and seeded params are session fixtures shared by every directory (they
are the params `LLM(model="tiny_v41", seed=0, dtype="float32")` builds); JAX is imported only
when a test asks for them."""

import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture(scope="session")
def tiny_cfg():
    from dsv4.config import tiny_v41

    return tiny_v41()


@pytest.fixture(scope="session")
def tiny_params(tiny_cfg):
    import jax

    from dsv4.params import init_params

    return init_params(tiny_cfg, jax.random.PRNGKey(0))


# The tiny model with the rest of V4.1: Engram on two layers, layer 1 (a kv source, ratio 2)
# and layer 4 (a reuse layer, ratio 1), with small primes (above 63) so that tables are a few
# hundred rows and the compressed vocabulary of the built-in byte tokenizer (230 ids for 512
# token ids, ids past 258 DEAD); and a 3-stage DSpark drafter (block of 3) reading layers 5-7.
ENGRAM = dict(
    n_mtp_layers=3,
    compress_ratios=(0, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
    dspark_block_size=3,
    dspark_target_layer_ids=(5, 6, 7),
    dspark_markov_rank=16,
    dspark_noise_token_id=500,
    dspark_n_routed_experts=8,
    dspark_n_activated_experts=2,
    engram_layer_ids=(1, 4),
    engram_vocab_size=64,
    engram_num_embeddings=(),
    engram_max_ngram_size=4,
    engram_n_heads=2,
    engram_head_dim=32,
    engram_compressed_vocab_size=230,
    engram_pad_id=2,
)


@pytest.fixture(scope="session")
def engram_cfg():
    from dsv4.config import tiny_v41

    return tiny_v41(**ENGRAM)


@pytest.fixture(scope="session")
def engram_params(engram_cfg):
    import jax

    from dsv4.params import init_params

    return init_params(engram_cfg, jax.random.PRNGKey(0))
