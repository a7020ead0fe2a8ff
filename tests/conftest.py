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


# The tiny model with the rest of V4.1 (`dsv4.config.tiny_v41_full`): Engram on layers 1 and 4
# (a kv source and a reuse layer), a 3-stage DSpark drafter reading layers 5-7.
@pytest.fixture(scope="session")
def engram_cfg():
    from dsv4.config import tiny_v41_full

    return tiny_v41_full()


@pytest.fixture(scope="session")
def engram_params(engram_cfg):
    import jax

    from dsv4.params import init_params

    return init_params(engram_cfg, jax.random.PRNGKey(0))
