"""serving/programs.py: the step programs' folder. An entry is named by everything its program
depends on, written under JAX's persistent-cache rules, loaded by a later `StepPrograms`
without tracing, and a broken entry is compiled again. (The engine's second start loading
every step program: tests/benchmarks/test_startup_bench.py.)"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.compilation_cache.compilation_cache import reset_cache

from serving import programs as PG
from serving.metrics import compilation_count, persistent_cache_hits


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Batch:
    block_tables: tuple  # one [R, W] table per group, as a StepBatch's


@functools.partial(jax.jit, static_argnames=("scale",), donate_argnums=(0,))
def _step(state, batch, feed, *, scale):
    return feed * scale + batch.block_tables[0].sum(), state + 1


def _inputs(t: int, w: int):
    return _Batch((np.ones((2, w), np.int32),)), np.arange(t, dtype=np.int32)


@pytest.fixture
def cache_dir(tmp_path):
    """JAX's persistent cache pointed at ``tmp_path``, every compile kept (as `LLM` sets it);
    afterwards the test process's own settings again (JAX opens its cache once: reset)."""
    old = {
        name: getattr(jax.config, name)
        for name in ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    }
    reset_cache()
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    yield tmp_path / PG.SUBDIR
    reset_cache()
    for name, value in old.items():
        jax.config.update(name, value)


def test_a_second_table_loads_what_the_first_compiled(cache_dir):
    jobs = [_inputs(4, 8), _inputs(8, 8), _inputs(8, 16)]
    first = PG.StepPrograms({"scale": 3})
    done = []
    first.build(_step, (jnp.zeros(()),), jobs, lambda: done.append(1))
    assert len(first) == len(done) == 3 and len(list(cache_dir.glob("*.pkl"))) == 3
    assert any(p.name != PG.SUBDIR for p in cache_dir.parent.iterdir())  # JAX's own entries
    compiles, loads = compilation_count(), persistent_cache_hits()
    second = PG.StepPrograms({"scale": 3})
    second.build(_step, (jnp.zeros(()),), jobs, lambda: None)
    assert compilation_count() == compiles and persistent_cache_hits() == loads + 3
    for inputs in jobs:  # each program is the jit's, for its own shapes
        got, state = second(_step, (jnp.zeros(()),), inputs)
        want, _ = _step(jnp.zeros(()), *inputs, scale=3)
        np.testing.assert_array_equal(got, want)
        assert float(state) == 1.0
    # another static value or shape is another program; shapes not built run through the jit
    other = PG.StepPrograms({"scale": 5})
    other.build(_step, (jnp.zeros(()),), jobs[:1], lambda: None)
    assert len(list(cache_dir.glob("*.pkl"))) == 4
    got, _ = other(_step, (jnp.zeros(()),), _inputs(2, 8))
    np.testing.assert_array_equal(got, np.arange(2) * 5 + 16)


def test_a_broken_entry_is_removed_and_the_program_compiled(cache_dir):
    jobs = [_inputs(4, 8)]
    PG.StepPrograms({"scale": 2}).build(_step, (jnp.zeros(()),), jobs, lambda: None)
    (entry,) = cache_dir.glob("*.pkl")
    entry.write_bytes(b"not a program")
    table = PG.StepPrograms({"scale": 2})
    table.build(_step, (jnp.zeros(()),), jobs, lambda: None)
    assert not entry.exists()  # not tried again by every later start
    got, _ = table(_step, (jnp.zeros(()),), jobs[0])
    np.testing.assert_array_equal(got, np.arange(4) * 2 + 16)


def test_a_program_jax_s_caches_handed_back_is_not_written(cache_dir, monkeypatch):
    """XLA:CPU writes a deserialized executable without all its functions: a program JAX's
    persistent cache loaded (or its in-memory cache kept) is used but never written."""
    jobs = [_inputs(4, 8)]
    monkeypatch.setattr(PG, "_folder", lambda: None)  # the step folder off: JAX's cache only
    PG.StepPrograms({"scale": 11}).build(_step, (jnp.zeros(()),), jobs, lambda: None)
    monkeypatch.undo()
    # the same function under another jit: its in-memory caches are cold, JAX's file has it
    again = jax.jit(_step.__wrapped__, static_argnames=("scale",), donate_argnums=(0,))
    for _ in range(2):  # a persistent-cache hit, then an in-memory one
        table = PG.StepPrograms({"scale": 11})
        table.build(again, (jnp.zeros(()),), jobs, lambda: None)
        assert len(table) == 1 and not any(cache_dir.glob("*.pkl"))
        got, _ = table(again, (jnp.zeros(()),), jobs[0])
        np.testing.assert_array_equal(got, np.arange(4) * 11 + 16)


def test_nothing_is_written_where_jax_would_not_write(tmp_path):
    """The test process's own rule (tests/conftest.py: nothing compiles long enough to be
    kept): the program is built but no entry is written."""
    assert jax.config.jax_persistent_cache_min_compile_time_secs > 1e6
    folder = PG._folder()
    before = sorted(folder.glob("*.pkl")) if folder else []
    table = PG.StepPrograms({"scale": 7})
    table.build(_step, (jnp.zeros(()),), [_inputs(4, 8)], lambda: None)
    assert len(table) == 1
    assert (sorted(folder.glob("*.pkl")) if folder else []) == before


def test_the_key_names_everything_the_program_depends_on():
    args = (jnp.zeros(()), *_inputs(4, 8))
    key = PG.program_key(_step, args, {"scale": 2})
    assert key == PG.program_key(_step, args, {"scale": 2})
    assert key != PG.program_key(_step, args, {"scale": 3})
    assert key != PG.program_key(_step, (jnp.zeros(()), *_inputs(4, 16)), {"scale": 2})
    wider = (jnp.zeros((), jnp.int32), *_inputs(4, 8))
    assert key != PG.program_key(_step, wider, {"scale": 2})
    assert PG.program_key(_step, args, {"scale": object()}) is None  # printed by address


@functools.partial(jax.jit, static_argnames=("scale",))
def _read_pages(pool, batch, feed, *, scale):
    """A decode step's page read: a few rows of a large pool (XLA:CPU's cost model charges a
    gather for its whole operand, here 4 MiB, and splits it over threads)."""
    rows = pool[batch.block_tables[0].reshape(-1)]
    return rows.astype(jnp.float32) * scale + feed.sum()


def _split_ops(program) -> int:
    """Operations XLA:CPU split over threads in ``program``."""
    return program.as_text().count("outer_dimension_partitions")


@pytest.mark.skipif(
    jax.default_backend() != "cpu" or len(getattr(os, "sched_getaffinity", lambda _: ())(0)) < 2,
    reason="XLA:CPU on a machine of several cores",
)
def test_small_steps_are_compiled_for_one_core():
    """A program of at most ``serial_max_tokens`` tokens splits nothing over threads (the
    bucket of 2 here); a larger one is compiled as before (8); the compiling thread's cores
    come back."""
    cores = os.sched_getaffinity(0)
    values = (np.arange(4096 * 1024) % 251).astype(np.uint8).reshape(4096, 1024)
    pool = jnp.asarray(values)
    table = PG.StepPrograms({"scale": 2}, serial_max_tokens=2)
    rows = _Batch((np.arange(16, dtype=np.int32).reshape(2, 8) * 257 % 4096,))  # scattered
    jobs = [(rows, np.arange(t, dtype=np.int32)) for t in (2, 8)]
    table.build(_read_pages, (pool,), jobs, lambda: None)
    small, large = (table._table[table.shapes(_read_pages, job)] for job in jobs)
    assert _split_ops(small) == 0 and _split_ops(large) > 0
    assert os.sched_getaffinity(0) == cores
    for (batch, feed), program in zip(jobs, (small, large), strict=True):
        want = values[batch.block_tables[0].reshape(-1)] * 2.0 + feed.sum()  # numpy
        np.testing.assert_array_equal(table(_read_pages, (pool,), (batch, feed)), want)
        assert program is table._table[table.shapes(_read_pages, (batch, feed))]
    with PG.one_core():
        assert len(os.sched_getaffinity(0)) == 1
    with PG.one_core(False):
        assert os.sched_getaffinity(0) == cores
    assert os.sched_getaffinity(0) == cores
