"""`cache` is pure Python: importing all of it pulls in neither jax nor numpy.

The layers this keeps: docs/architecture.md#layers.
"""

from __future__ import annotations

import subprocess
import sys


def test_cache_imports_no_jax_or_numpy():
    code = (
        "import sys, cache, cache.layout, cache.spec, cache.coordinator, cache.managers;"
        "bad = sorted(m for m in ('jax', 'numpy', 'torch') if m in sys.modules);"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
