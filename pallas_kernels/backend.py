"""Shared plumbing of the kernel entries: which implementation runs, how it is interpreted,
what it costs, and the debug check of block tables.

Design notes: pallas_kernels/README.md, "pallas_kernels/backend.py".
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

IMPLS = ("reference", "tpu", "gpu")

# Finite stand-in for -inf in running maxima: exp(-1e30 - x) underflows to 0 without producing
# inf - inf = NaN. The window kernel's state floors `m` here (pallas_kernels/README.md).
MASK_VALUE = -1e30


def resolve_impl(impl: str | None) -> str:
    """The implementation to run: `impl` itself, or the one for `jax.default_backend()`."""
    if impl is None:
        backend = jax.default_backend()
        if backend == "tpu":
            return "tpu"
        if backend in ("gpu", "cuda"):
            return "gpu"
        return "reference"
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {(None, *IMPLS)}")
    return impl


def dispatch(
    package: str,
    name: str,
    impl: str | None,
    interpret: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    kernel_options: dict[str, Any] | None = None,
    tpu_options: dict[str, Any] | None = None,
) -> Any:
    """Call ``name`` of ``package``'s implementation module picked by ``impl`` (see
    `resolve_impl`): ``reference`` with ``args, kwargs``; a kernel (imported only when it runs)
    also with the options that are not None and ``interpret`` checked for its platform."""
    impl = resolve_impl(impl)
    fn = getattr(importlib.import_module(f"{package}.{impl}"), name)
    if impl == "reference":
        return fn(*args, **kwargs)
    options = dict(kernel_options or {}, **(tpu_options or {} if impl == "tpu" else {}))
    options = {k: v for k, v in options.items() if v is not None}
    interpret = tpu_interpret(interpret) if impl == "tpu" else gpu_interpret(interpret)
    return fn(*args, **kwargs, **options, interpret=interpret)


def tpu_interpret(interpret: Any) -> Any:
    """`interpret=` for a TPU `pallas_call`: False, True (HLO interpreter) or InterpretParams."""
    if interpret is None:
        return False
    return interpret


def gpu_interpret(interpret: Any) -> bool:
    """`interpret=` for a Triton `pallas_call`: only the HLO interpreter exists for it."""
    if interpret is None or interpret is False:
        return False
    if interpret is True:
        return True
    raise ValueError(
        f"interpret={interpret!r} is not valid for impl='gpu': the Triton kernels run in the "
        "HLO interpreter only (interpret=True); InterpretParams is for impl='tpu'"
    )


def mxu_precision(dtype: Any) -> Any:
    """`precision=` for a kernel matmul with operands of ``dtype``: DEFAULT for 16-bit operands
    (their products are exact in the f32 accumulator, and Mosaic rejects an fp32 contract
    precision on them, which `jax.default_matmul_precision("highest")` would otherwise ask
    for); None (the configured precision) for f32 operands."""
    return jax.lax.Precision.DEFAULT if np.dtype(dtype).itemsize < 4 else None


def tpu_num_cores(mesh: Any = None) -> int:
    """TensorCores one TPU device drives (2 on megacore chips: v4, v5p; 1 on v5e / v6e), read
    from ``mesh``'s device (a `Mesh` or `AbstractMesh`, what the model's steps pass); without a
    mesh, from the abstract mesh's device when lowering deviceless, else the default device. 1
    when the device does not say (CPU, interpret mode)."""
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
        device = getattr(mesh, "abstract_device", None) or jax.devices()[0]
    elif isinstance(mesh, jax.sharding.Mesh):
        device = mesh.devices.flat[0]
    else:
        device = mesh.abstract_device or jax.devices()[0]
    if getattr(device, "platform", "tpu") != "tpu":
        return 1
    return max(1, int(getattr(device, "num_cores", 1) or 1))


def core_split(num_tiles: int, num_cores: int | None) -> tuple[int, int]:
    """(cores, tiles per core) for a sequential tile loop split over ``num_cores`` TensorCores
    (None: `tpu_num_cores()`); ``cores * tiles_per_core >= num_tiles`` (the caller pads)."""
    cores = tpu_num_cores() if num_cores is None else num_cores
    if not isinstance(cores, int) or isinstance(cores, bool) or cores < 1:
        raise ValueError(f"num_cores={num_cores!r} must be a positive int or None")
    cores = max(1, min(cores, num_tiles))
    return cores, cdiv(num_tiles, cores)


def _pad_rows(x: jax.Array, pad: int, value: Any) -> jax.Array:
    return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=value)


def token_tiles(
    run: Any,
    tokens: tuple[Any, ...],
    fills: tuple[Any, ...],
    *,
    tokens_per_tile: int,
    num_cores: int | None,
    max_tokens_per_call: int,
) -> Any:
    """Run a TPU kernel over whole tiles of tokens split over TensorCores (window, sparse): calls
    ``run(tokens, tq, cores, per_core)`` on at most ``max_tokens_per_call`` tokens at a time,
    padded to whole tiles per core (pallas_kernels/README.md, "pallas_kernels/backend.py").

    Args:
      tokens: per-token pytrees with a leading T axis (None entries allowed).
      fills: one pad value per entry of ``tokens``.
    """
    num_tokens = jax.tree.leaves(tokens)[0].shape[0]
    again = functools.partial(
        token_tiles, run, fills=fills, max_tokens_per_call=max_tokens_per_call
    )
    if num_tokens > max_tokens_per_call:  # one kernel call per slice of tokens
        parts = [
            again(
                jax.tree.map(lambda x, i=i: x[i : i + max_tokens_per_call], tokens),
                tokens_per_tile=tokens_per_tile,
                num_cores=num_cores,
            )
            for i in range(0, num_tokens, max_tokens_per_call)
        ]
        return jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)
    tq = pow2_divisor(num_tokens, tokens_per_tile)
    cores, per_core = core_split(num_tokens // tq, num_cores)
    pad = cores * per_core * tq - num_tokens
    if pad:  # whole tiles per core
        padded = tuple(
            jax.tree.map(lambda x, v=v: _pad_rows(x, pad, v), entry)
            for entry, v in zip(tokens, fills)
        )
        out = again(padded, tokens_per_tile=tq, num_cores=cores)
        return jax.tree.map(lambda x: x[:num_tokens], out)
    return run(tokens, tq, cores, per_core)


def double_buffered(i: Any, n: Any, for_copies: Any) -> Any:
    """One step of a double-buffered DMA loop inside a TPU kernel: start item ``i + 1``'s
    copies into the other buffer, wait for item ``i``'s; returns ``i``'s buffer slot.
    ``for_copies(item, slot, fn)`` applies ``fn`` (start or wait) to each copy of ``item``."""
    slot = i % 2

    @pl.when(i + 1 < n)
    def _next():
        for_copies(i + 1, 1 - slot, lambda cp: cp.start())

    for_copies(i, slot, lambda cp: cp.wait())
    return slot


def cost_estimate(flops: float, bytes_accessed: float, transcendentals: float = 0) -> Any:
    """A `pl.CostEstimate` from a kernel's cost model (rounded to ints, as XLA wants)."""
    return pl.CostEstimate(
        flops=int(flops), transcendentals=int(transcendentals), bytes_accessed=int(bytes_accessed)
    )


def itemsize(dtype: Any) -> int:
    """Bytes per element of `dtype`."""
    return np.dtype(dtype).itemsize


def call_sizes(q: Any, pages: Any) -> dict[str, int]:
    """The sizes an attention cost model takes from ``q`` [T, H, D] and the cache pages."""
    num_tokens, heads, dim = q.shape
    return dict(
        num_tokens=num_tokens,
        heads=heads,
        dim=dim,
        q_bytes=itemsize(q.dtype),
        kv_bytes=itemsize(pages.dtype),
    )


def pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two that divides `n` and is at most `cap` (1 when n is odd)."""
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


def cdiv(a: int, b: int) -> int:
    """Ceiling division of ints."""
    return -(-a // b)


def window_pages(window: int, page_size: int) -> int:
    """Most pages a window of `window` consecutive positions can touch."""
    return cdiv(window - 1, page_size) + 1


def _raise_out_of_range(values: np.ndarray, lo: int, hi: int, name: str, what: str) -> None:
    values = np.asarray(values)
    bad = np.argwhere((values < lo) | (values >= hi))
    if bad.size:
        where = tuple(int(i) for i in bad[0])
        raise ValueError(
            f"{name}{list(where)} = {int(values[where])} is not {what} in [{lo}, {hi}) "
            f"({len(bad)} bad entries; nothing is clamped)"
        )


def check_range(values: jax.Array, lo: int, hi: int, name: str, what: str) -> None:
    """Raise (at run time, also under `jit`) if an entry of `values` is outside [lo, hi).

    Under `jit` the error surfaces as a `JaxRuntimeError` carrying the message, which names the
    first bad entry and its value.
    """
    if isinstance(values, jax.core.Tracer):
        jax.debug.callback(_raise_out_of_range, values, lo, hi, name, what)
    else:
        _raise_out_of_range(np.asarray(values), lo, hi, name, what)


def check_block_tables(tables: jax.Array, num_pages: int, name: str) -> None:
    """Raise at run time if a block id of `tables` is outside [0, num_pages).

    The kernels never clamp a block id: the TPU checking interpreter raises on the bad DMA, and
    this check raises on every implementation (block 0 is the null block).
    """
    check_range(tables, 0, num_pages, name, "a block id")


def check_paged_indices(
    tables: jax.Array, num_pages: int, per_block: int, token_req: jax.Array, index: jax.Array,
    names: tuple[str, str, str],
) -> None:  # fmt: skip
    """The ``debug=True`` checks of a paged entry, at run time: block ids of ``tables``, ``index``
    in [-1, what the table covers), ``token_req`` in [0, rows).

    Args:
      names: the table's name, the index's name and what an index entry is (for the message).
    """
    table_name, index_name, what = names
    check_block_tables(tables, num_pages, table_name)
    check_range(index, -1, tables.shape[1] * per_block, index_name, what)
    check_range(token_req, 0, tables.shape[0], "token_req", "a request row")


def check_shapes(**arrays: tuple[jax.Array, tuple[Any, ...]]) -> None:
    """Check ranks and named sizes: `check_shapes(q=(q, ("T", "H", "D")), ...)`.

    Each dimension is an int (must match) or a name (must agree everywhere it appears).
    Raises ValueError naming the argument, its shape and the expected pattern.
    """
    sizes: dict[str, int] = {}
    for arg, (x, pattern) in arrays.items():
        shape = tuple(x.shape)
        if len(shape) != len(pattern):
            raise ValueError(f"{arg} has shape {shape}; expected {pattern}")
        for got, want in zip(shape, pattern):
            if isinstance(want, int):
                if got != want:
                    raise ValueError(f"{arg} has shape {shape}; expected {pattern}")
            elif sizes.setdefault(want, got) != got:
                raise ValueError(
                    f"{arg} has shape {shape}; expected {pattern} with {want}={sizes[want]}"
                )


def check_int32(**arrays: jax.Array) -> None:
    """Index arrays must be int32 (the kernels address SMEM with them)."""
    for name, x in arrays.items():
        if x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {x.dtype}")


def roofline_fraction(bytes_moved: float, seconds: float, peak_bytes_per_second: float) -> float:
    """Achieved share of a memory-bandwidth roofline."""
    if seconds <= 0 or not math.isfinite(seconds):
        return float("nan")
    return bytes_moved / seconds / peak_bytes_per_second


class Cost:
    """What one kernel call moves and computes (the cost model behind `pl.CostEstimate` and
    benchmarks/kernels.py): HBM bytes read + written, FLOPs, transcendentals."""

    __slots__ = ("bytes_accessed", "flops", "transcendentals")

    def __init__(self, bytes_accessed: float, flops: float, transcendentals: float = 0):
        self.bytes_accessed = int(bytes_accessed)
        self.flops = int(flops)
        self.transcendentals = int(transcendentals)

    def as_estimate(self) -> dict[str, int]:
        """Keyword arguments of `cost_estimate`."""
        return dict(
            flops=self.flops,
            bytes_accessed=self.bytes_accessed,
            transcendentals=self.transcendentals,
        )

    def as_dict(self) -> dict[str, int]:
        return dict(
            bytes=self.bytes_accessed, flops=self.flops, transcendentals=self.transcendentals
        )

    def __repr__(self) -> str:
        return f"Cost(bytes={self.bytes_accessed}, flops={self.flops})"
