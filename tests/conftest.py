"""Test-wide settings: run on the CPU unless the caller chose a platform (the device check
script sets JAX_PLATFORMS itself). Deviceless TPU/GPU compiles do not need a device backend.

The tiny model's config and seeded params are session fixtures shared by every directory (they
are the params `LLM(model="tiny_v41", seed=0, dtype="float32")` builds); JAX is imported only
when a test asks for them."""

import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# `make test` runs the suite in two pytest-xdist workers. libtpu's deviceless client takes a
# machine-wide lockfile by default, so a second process compiling for TPU at the same moment
# failed ("Internal error when accessing libtpu multi-process lockfile"); compile-only clients
# share no chip, so each process may load its own.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def _preset_fixtures(preset: str, name: str):
    """Session fixtures ``{name}_cfg`` (the `dsv4.config` preset) and ``{name}_params`` (its
    params from seed 0, what `LLM(model=..., seed=0, dtype="float32")` builds)."""

    def cfg():
        from dsv4 import config

        return getattr(config, preset)()

    def params(request):
        import jax

        from dsv4.params import init_params

        return init_params(request.getfixturevalue(f"{name}_cfg"), jax.random.PRNGKey(0))

    return (
        pytest.fixture(cfg, scope="session", name=f"{name}_cfg"),
        pytest.fixture(params, scope="session", name=f"{name}_params"),
    )


tiny_cfg, tiny_params = _preset_fixtures("tiny_v41", "tiny")
# The tiny model with the rest of V4.1 (`dsv4.config.tiny_v41_full`): Engram on layers 1 and 4
# (a kv source and a reuse layer), a 3-stage DSpark drafter reading layers 5-7.
engram_cfg, engram_params = _preset_fixtures("tiny_v41_full", "engram")


# `LLM("tiny_v41_trained", **SHIPPED_LLM_ARGS)`: the shipped model on a small exact engine (8
# sequences, one 64-token step bucket), shared by the server's tests and tests/dsv4/test_shipped.py;
# one step a program, as `dsv4 serve` runs it
SHIPPED_LLM_ARGS = dict(
    num_scheduler_steps=1,
    dtype="float32",
    max_model_len=128,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    token_buckets=(64,),
    num_gpu_blocks_override=400,
    max_logprobs=5,
    compilation_cache_dir=None,
)


@pytest.fixture(scope="session")
def shipped_llm_args() -> dict:
    """`SHIPPED_LLM_ARGS` (a copy): for another `LLM` of the same sizes, e.g. with more keywords."""
    return dict(SHIPPED_LLM_ARGS)


@pytest.fixture(scope="session")
def shipped_llm():
    """One `LLM("tiny_v41_trained", **SHIPPED_LLM_ARGS)` for the session: built and warmed up
    once, with full-precision matmuls as tests/dsv4 and tests/serving run every test (another
    precision is another compilation). A test that drives it from another thread (the server's)
    gives it back idle."""
    import jax

    from serving import LLM

    with jax.default_matmul_precision("highest"):
        return LLM("tiny_v41_trained", **SHIPPED_LLM_ARGS)


def _num_mappings() -> int | None:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: no per-process mapping limit to watch
        return None


def _max_mappings() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530  # the kernel's default


@pytest.fixture(scope="module", autouse=True)
def _drop_compiled_executables():
    """After a test module, drop every compiled executable JAX still caches once the process
    holds a third of the kernel's memory-mapping limit. XLA:CPU maps memory for each executable
    it loads, and one process running the whole suite kept them all: near 87 % of a full run
    it reached `vm.max_map_count` (65,530) and the next compile died with SIGSEGV. Cleared,
    the count falls back under a thousand; below the threshold later modules reuse what
    earlier ones compiled. The heap an engine's warm-up froze (`freeze_gc_heap`) is handed back
    to the collector first, so what a module leaves is collected as a user's process would."""
    yield
    import gc
    import sys

    gc.unfreeze()

    count = _num_mappings()
    if count is None or count < _max_mappings() // 3 or "jax" not in sys.modules:
        return
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
