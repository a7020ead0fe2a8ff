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


# Engram on two layers of the tiny model: layer 1 (a kv source, ratio 2) and layer 4 (a reuse
# layer, ratio 1); small primes (above 63) so that tables are a few hundred rows; the compressed
# vocabulary is the built-in byte tokenizer's (230 ids for 512 token ids, ids past 258 DEAD).
ENGRAM = dict(
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
