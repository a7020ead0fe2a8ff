"""Planner tests run with full-precision matmuls, as the model tests do (tests/dsv4/conftest.py)."""

from tests.dsv4.conftest import _highest_precision  # noqa: F401  (an autouse fixture)
