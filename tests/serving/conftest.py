"""Fixtures of the engine tests: the tiny config and its seeded params (the same ones
`LLM(model="tiny_v41", seed=0, dtype="float32")` builds), full-precision matmuls."""

from __future__ import annotations

import jax
import pytest

from dsv4.config import tiny_v41
from dsv4.params import init_params


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(scope="session")
def tiny_cfg():
    return tiny_v41()


@pytest.fixture(scope="session")
def tiny_params(tiny_cfg):
    return init_params(tiny_cfg, jax.random.PRNGKey(0))
