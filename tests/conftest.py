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


@pytest.fixture(scope="module", autouse=True)
def _drop_compiled_executables():
    """After each test module, drop every compiled executable JAX still caches. XLA:CPU maps
    memory for each executable it loads, and one process running the whole suite kept them
    all: by about 87 % of a full run the process held some 65,000 mappings, the kernel's
    `vm.max_map_count`, and the next compile died with SIGSEGV. Cleared per module, the
    count falls back to under a thousand at every module boundary."""
    yield
    import gc
    import sys

    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    gc.collect()


@pytest.fixture(scope="session", autouse=True)
def _persistent_cache_read_only():
    """The test process reads JAX's persistent compilation cache (the directory `LLM` uses by
    default) but never writes it, so a test run leaves no entries behind for `LLM` to find
    (the crash once seen while writing an entry was the mapping limit described above, not
    the cache). Subprocesses (the start-up benchmark's second start, the multi-device
    scripts) keep their own settings."""
    import jax

    from serving.llm import default_compilation_cache_dir

    path = default_compilation_cache_dir()
    if path is not None and not jax.config.jax_compilation_cache_dir:
        os.makedirs(path, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", path)
    # nothing compiles for longer than this: no entry is ever written
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
    yield
