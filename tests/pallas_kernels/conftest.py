"""Shared settings of the kernel tests: the CPU platform and the TPU-interpreter reset.
Builders of NaN-poisoned paged caches live in `paged_cases.py`, each kernel's shared cases in
`window_cases.py`, `sparse_cases.py` and `indexer_cases.py`, deviceless compile helpers in
`aot.py` (all importable by name from this folder)."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# This folder is named like the package it tests; when pytest runs without the repository root
# on sys.path (`.venv/bin/pytest`), `tests/` would make `pallas_kernels` a namespace package
# of test files. Put the root first so the real package wins.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if sys.path[0] != _ROOT:
    sys.path.insert(0, _ROOT)

import pytest  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402


@pytest.fixture(autouse=True)
def _reset_tpu_interpreter():
    """The checking TPU interpreter keeps global state that an exception leaves dirty."""
    yield
    pltpu.reset_tpu_interpret_mode_state()
