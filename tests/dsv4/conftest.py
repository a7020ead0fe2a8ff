"""Model tests run with full-precision matmuls (fp32 comparisons at 1e-4 need them on
accelerators; on CPU they are the default). `tiny_cfg` / `tiny_params` come from tests/."""

from __future__ import annotations

import jax
import pytest


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield
