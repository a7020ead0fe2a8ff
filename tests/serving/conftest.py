"""Engine tests run with full-precision matmuls, as the model tests do (their fp32 outputs are
compared with the reference). `tiny_cfg` / `tiny_params` come from tests/."""

from __future__ import annotations

import jax
import pytest


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield
