"""Importing the kernels after something was jitted must not make it compile again (Pallas
registers configuration that enters JAX's cache keys; `dsv4` imports it where JAX runs, and every
JAX-using module of the lazy package imports it)."""

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


def _lowest_jax_modules() -> list[str]:
    """The dsv4 modules that import JAX themselves and no other dsv4 module that does."""
    import grimp

    graph = grimp.build_graph("dsv4", include_external_packages=True)
    uses_jax = {
        m
        for m in graph.modules
        # the package itself imports Pallas only where JAX already runs (dsv4/__init__.py)
        if m.startswith("dsv4.") and "jax" in graph.find_upstream_modules(m)
    }
    return sorted(
        m
        for m in uses_jax
        if "jax" in graph.find_modules_directly_imported_by(m)
        and not uses_jax & graph.find_modules_directly_imported_by(m)
    )


def test_every_jax_using_dsv4_module_imports_pallas():
    """The package is lazy (``import dsv4.config`` starts no JAX), so the lowest JAX-using
    modules import Pallas themselves: importing any of them, alone, loads it."""
    leaves = _lowest_jax_modules()
    assert "dsv4.quant" in leaves, leaves
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for module in leaves:
        code = f"import sys, {module}; assert 'jax.experimental.pallas' in sys.modules"
        run = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True
        )
        assert run.returncode == 0, (module, run.stderr[-2000:])
