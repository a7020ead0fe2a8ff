"""Importing the kernels after something was jitted must not make it compile again (Pallas
registers configuration that enters JAX's cache keys; `dsv4` imports it up front)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp
    import dsv4
    from serving.metrics import compilation_count

    f = jax.jit(lambda x: x * 2 + 1)
    f(jnp.ones(3))
    before = compilation_count()
    import pallas_kernels  # what building an engine or a paged step imports
    import serving.engine  # noqa: F401
    f(jnp.ones(3))
    print("recompiled", compilation_count() - before)
    """
)


def test_jitted_functions_survive_the_kernel_import():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, cwd=root, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert "recompiled 0" in run.stdout, run.stdout
