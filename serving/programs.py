"""The engine's step programs, compiled ahead of time (docs/architecture.md#serving).

`StepPrograms` holds one compiled executable per step function and input shapes (a token bucket
and table widths). Its warm-up lowers and compiles them several at once (XLA compiles outside
the GIL, one program per core), and keeps each one, serialized, in a folder beside JAX's
persistent compilation cache (``<jax_compilation_cache_dir>/dsv4-steps``, written under the
same rule: only when that cache is on and the compile took at least
``jax_persistent_cache_min_compile_time_secs``). A later process with the same configuration
loads them from there without tracing or lowering anything: JAX's own cache still has to trace
and lower a program to find its entry, which is most of a second start.

Only a program XLA compiled just now is written, never one JAX's own caches handed back: XLA:CPU
serializes an executable it deserialized without all of its functions (running the copy fails
with "Function ... not found"). An entry's name is a digest of everything the program depends
on: the step function, its static arguments, every input's tree, shape, dtype and placement, the
JAX, jaxlib and Python versions, the device, JAX's configuration, ``XLA_FLAGS`` and the source
of the packages that trace it. Loading one runs pickled code, as JAX's own cache does: keep the
folder private.

On XLA:CPU a program of at most ``serial_max_tokens`` tokens is compiled as on a machine of one
core (`one_core`): XLA then splits none of its operations over threads. XLA's cost model
charges a gather for its whole operand, so a decode step reading a few pages of a large KV pool
looks large and its reads are split; waking a second thread for each costs more than the reads
(docs/benchmarks.md#benchmarksengine).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import importlib.util
import itertools
import os
import pickle
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jaxlib
import numpy as np
from jax.experimental import serialize_executable

from serving.metrics import count_program_load

__all__ = ["StepPrograms", "one_core", "program_key", "source_digest"]

SUBDIR = "dsv4-steps"
_JAX_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_COMPILE = "/jax/core/compile/backend_compile_duration"
# the packages whose code a step program is traced from
_PACKAGES = ("dsv4", "pallas_kernels", "serving", "cache")


@functools.cache
def source_digest() -> str:
    """SHA-256 of the Python source of the packages a step is traced from (any edit to them
    gives every program a new name)."""
    h = hashlib.sha256()
    for name in _PACKAGES:
        spec = importlib.util.find_spec(name)
        for root in spec.submodule_search_locations or ():
            for path in sorted(Path(root).rglob("*.py")):
                h.update(str(path.relative_to(root)).encode())
                h.update(path.read_bytes())
    return h.hexdigest()


def _leaf(x: Any) -> str:
    placement = getattr(x, "sharding", None)
    weak = getattr(x, "weak_type", False)
    dtype = getattr(x, "dtype", type(x).__name__)
    return f"{np.shape(x)}{dtype}{weak}{placement!r}"


def program_key(step: Callable, args: Sequence[Any], static: dict[str, Any]) -> str | None:
    """The digest naming ``step``'s program for ``args`` and ``static`` (see the module
    docstring), or None when some part has no stable text (an object printed by address)."""
    device = jax.devices()[0]
    parts = [
        f"{step.__module__}.{step.__qualname__}",
        repr(sorted(static.items())),
        str(jax.tree.structure(args)),
        ";".join(_leaf(x) for x in jax.tree.leaves(args)),
        f"{jax.__version__} {jaxlib.__version__} {sys.version_info[:2]}",
        f"{device.platform} {device.device_kind} {device.client.platform_version}",
        repr(sorted(jax.config.values.items())),
        os.environ.get("XLA_FLAGS", ""),
        source_digest(),
    ]
    text = "\n".join(parts)
    if " at 0x" in text:
        return None
    return hashlib.sha256(text.encode()).hexdigest()


class _Compiles(threading.local):
    """What JAX recorded for this thread's last compile (its events are recorded in the
    compiling thread): an XLA compile ran, and whether JAX's persistent cache answered it."""

    compiled = False
    hit = False


_seen = _Compiles()
_listener_lock = threading.Lock()
_listening = False


def _on_event(event: str, **_: object) -> None:
    if event == _JAX_CACHE_HIT:
        _seen.hit = True


def _on_duration(event: str, duration: float, **_: object) -> None:
    if event == _COMPILE:
        _seen.compiled = True


_next_core = itertools.count()


@contextlib.contextmanager
def one_core(on: bool = True):
    """While ``on`` (and the thread may run on several cores), the calling thread runs on one
    core: XLA:CPU, compiling in this thread, counts the cores it may use from the thread's
    affinity (`tsl::port::NumSchedulableCPUs`) and so splits no operation over threads.
    Compiling threads take the cores in turn; the thread's cores come back afterwards."""
    setter = getattr(os, "sched_setaffinity", None)
    cores = sorted(os.sched_getaffinity(0)) if on and setter is not None else []
    if len(cores) < 2:
        yield
        return
    setter(0, {cores[next(_next_core) % len(cores)]})
    try:
        yield
    finally:
        setter(0, cores)


# JAX's persistent cache names a program by its HLO and compile options, not by the compiling
# thread's cores: a one-core program is compiled with an option XLA:CPU ignores (GPU autotuning),
# so that cache never hands back a program compiled with splits in its place, nor the reverse
_ONE_CORE_OPTIONS = {"xla_gpu_autotune_level": 0}


def _compile(lowered, serial: bool):
    """``lowered`` compiled; for one core where ``serial`` (`one_core`)."""
    if not serial:
        return lowered.compile()
    with one_core():
        return lowered.compile(_ONE_CORE_OPTIONS)


def _compile_fresh(step: Callable, args: tuple, static: dict[str, Any], serial: bool = False):
    """``step``'s program for ``args``, and whether XLA compiled it just now: not an executable
    that JAX's persistent cache loaded, nor one its in-memory cache kept (which may be such a
    loaded one)."""
    global _listening
    with _listener_lock:
        if not _listening:
            jax.monitoring.register_event_listener(_on_event)
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _listening = True
    _seen.compiled = _seen.hit = False
    program = _compile(step.lower(*args, **static), serial)
    return program, _seen.compiled and not _seen.hit


class StepPrograms:
    """Compiled step programs by (step function, input shapes), for one runner's state and
    static arguments. Calling it runs the program of ``step`` for the inputs' shapes; one that
    was not built (no warm-up) runs through ``step``'s jit, which compiles it on first use.
    On XLA:CPU a program it builds of at most ``serial_max_tokens`` tokens is compiled for one
    core (`one_core`; 0: none)."""

    def __init__(self, static: dict[str, Any], serial_max_tokens: int = 0) -> None:
        self._static = static
        self._table: dict[tuple, Callable] = {}
        self.serial_max_tokens = serial_max_tokens

    @staticmethod
    def shapes(step: Callable, inputs: Sequence[Any]) -> tuple:
        """What tells a step's programs apart: its function and its inputs' buckets (the token
        ids' shape and each group's table; the rest follows from them)."""
        batch, feed = inputs[0], inputs[1]
        return step, np.shape(feed), tuple(np.shape(t) for t in batch.block_tables)

    def __len__(self) -> int:
        return len(self._table)

    def serial(self, inputs: Sequence[Any]) -> bool:
        """Whether the program for ``inputs`` (a step's or a burst's) is compiled for one core:
        on XLA:CPU, at most ``serial_max_tokens`` tokens a step (its feed's last axis)."""
        tokens = np.shape(inputs[1])[-1]
        return tokens <= self.serial_max_tokens and jax.default_backend() == "cpu"

    def __call__(self, step: Callable, state: tuple, inputs: tuple):
        program = self._table.get(self.shapes(step, inputs))
        if program is None:
            return step(*state, *inputs, **self._static)
        return program(*state, *inputs)

    def build(
        self, step: Callable, state: tuple, jobs: Sequence[tuple], on_done: Callable[[], None]
    ) -> None:
        """Compile or load ``step``'s program for each inputs in ``jobs`` (with the runner's
        ``state`` first), a core's worth at a time; ``on_done`` after each."""

        def build(inputs):
            return self._program(step, (*state, *inputs), self.serial(inputs))

        for inputs, program in _in_threads(build, jobs, on_done):
            self._table[self.shapes(step, inputs)] = program

    def compile_for_jit(
        self, calls: Sequence[tuple[Callable, tuple]], on_done: Callable[[], None]
    ) -> None:
        """Lower and compile each (jitted ``step``, its full ``args``) a core's worth at a time,
        into the jit's own caches: calling ``step`` on the same arguments next runs at once.
        For steps whose state a mesh places as the steps leave it (the table's programs would
        refuse a placement they were not built for). Compiled as the jit would (never for one
        core: the jit's call would not find a program compiled with other options)."""

        def compile_one(call):
            step, args = call
            return step.lower(*args, **self._static).compile()

        for _ in _in_threads(compile_one, calls, on_done):
            pass

    def _program(self, step: Callable, args: tuple, serial: bool) -> Callable:
        folder = _folder()
        key = program_key(step, args, self._static) if folder else None
        path = None if key is None else folder / f"{key}.pkl"
        if path is not None and path.exists():
            try:
                with open(path, "rb") as f:
                    payload, in_tree, out_tree = pickle.load(f)
                program = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
                count_program_load()
                return program
            except Exception:  # a broken entry: removed, the program compiled instead
                path.unlink(missing_ok=True)
        t0 = time.perf_counter()
        program, fresh = _compile_fresh(step, args, self._static, serial)
        if path is not None and fresh and time.perf_counter() - t0 >= _min_compile_s():
            _store(path, program)
        return program


def _in_threads(fn: Callable, items: Sequence[Any], on_done: Callable[[], None]):
    """(item, ``fn(item)``) for each of ``items``, as they finish, a core's worth at a time
    (XLA compiles and loads outside the GIL); ``on_done`` after each."""
    workers = max(1, min(len(items), os.cpu_count() or 1, 8))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = {pool.submit(fn, item): item for item in items}
        for future in concurrent.futures.as_completed(futures):
            result = future.result()
            on_done()
            yield futures[future], result


def _folder() -> Path | None:
    """The programs' folder under JAX's persistent cache, or None when that cache is off."""
    base = jax.config.jax_compilation_cache_dir
    if not base or "://" in base:
        return None
    return Path(base) / SUBDIR


def _min_compile_s() -> float:
    return jax.config.jax_persistent_cache_min_compile_time_secs


def _store(path: Path, program) -> None:
    """Write ``program`` to ``path`` atomically; a program that cannot be serialized (or a
    folder that cannot be written) is simply not kept."""
    try:
        entry = serialize_executable.serialize(program)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    except (OSError, ValueError, NotImplementedError):
        return
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump(entry, f)
        os.replace(tmp, path)
    except (OSError, pickle.PicklingError, TypeError):
        os.unlink(tmp)
