"""Quantised weights on device: the released fp8 / FP4 formats kept as stored, dequantised where
a matmul reads them.

A `QuantisedWeight` stands where the float array would be in the params:

* ``fp8``: e4m3 values ``[..., out, in]`` (``float8_e4m3fn``) and one e8m0 scale byte per
  ``block x block`` tile ``[..., ceil(out/B), ceil(in/B)]`` (uint8);
* ``fp4``: packed e2m1 codes ``[..., out, in/2]`` (uint8, the even input in the low nibble) and
  one e8m0 scale byte per 32 inputs ``[..., out, in/32]``;
* ``fp8_rows`` (an Engram table kept on device): e4m3 values ``[rows, width]`` and one e8m0 scale
  byte per ``block`` values of a row ``[rows, width/B]``.

Routed experts keep our stacked layout (a leading expert axis on both arrays). The model reads
weights through three operations the arrays have too, so its code is the same for both kinds:
``w.shape`` / ``w.dtype`` (logical: the dequantised shape and the float dtype the weight stands
for), ``w.astype(dt)`` (dequantise: the exact value ``code · 2^(scale - 127)``, computed in
bf16 or float32 directly, through float32 for other types; the numpy decoders' values bit for
bit whenever they are normal float32 numbers, see `_e8m0`), and ``w[ids]`` on the leading
(expert or row) axes, which gathers codes and scales first so that only the selected experts /
rows are dequantised. A weight therefore lives in its stored bytes between steps and is
dequantised inside the jitted step, one projection at a time, where XLA can fuse the decode
into its consumer.

The two arrays are the pytree's leaves and the format, logical shape, dtype and block size its
static metadata, so quantised params pass through `jax.jit` (as arguments, donated or not) and
`dsv4.sharding.shard_params` places codes and scales like the weight they encode.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dsv4.formats.codecs import E8M0_BIAS, FP4_GROUP

__all__ = ["FORMATS", "QuantisedWeight", "stored_shapes", "unpack_e2m1"]

FORMATS = ("fp8", "fp4", "fp8_rows")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def stored_shapes(
    fmt: str, shape: tuple[int, ...], block: int
) -> tuple[tuple[int, ...], np.dtype, tuple[int, ...]]:
    """(values shape, values dtype, scales shape) of a weight of logical ``shape`` in ``fmt``."""
    if fmt == "fp8":
        *lead, o, i = shape
        return (
            tuple(shape),
            np.dtype(ml_dtypes.float8_e4m3fn),
            (
                *lead,
                _ceil_div(o, block),
                _ceil_div(i, block),
            ),
        )
    *lead, w = shape
    if fmt == "fp4":
        return (*lead, w // 2), np.dtype(np.uint8), (*lead, w // FP4_GROUP)
    if fmt == "fp8_rows":
        return tuple(shape), np.dtype(ml_dtypes.float8_e4m3fn), (*lead, _ceil_div(w, block))
    raise ValueError(f"format={fmt!r} is not allowed: one of {', '.join(FORMATS)}")


@jax.tree_util.register_pytree_node_class
class QuantisedWeight:
    """A weight in its released storage format (see the module docstring).

    Leaves: ``values`` (e4m3 ``[..., out, in]``, or fp4 packed uint8 ``[..., out, in/2]``) and
    ``scales`` (uint8 e8m0, one per tile / group). Static: ``format`` ("fp8", "fp4",
    "fp8_rows"), the float weight's ``shape`` and ``dtype``, and ``block`` (the fp8 tile side or
    the values per scale of an fp8_rows row; fp4 groups are always 32 inputs)."""

    __slots__ = ("block", "dtype", "format", "scales", "shape", "values")

    def __init__(
        self,
        values: Any,
        scales: Any,
        *,
        format: str,
        shape: tuple[int, ...],
        dtype: Any,
        block: int,
    ) -> None:
        shape = tuple(int(d) for d in shape)
        want_values, want_dtype, want_scales = stored_shapes(format, shape, block)
        if tuple(values.shape) != want_values or tuple(scales.shape) != want_scales:
            raise ValueError(
                f"{format} weight of shape {list(shape)} (block {block}) stores values "
                f"{list(want_values)} and scales {list(want_scales)}; got values "
                f"{list(values.shape)} and scales {list(scales.shape)}"
            )
        if np.dtype(values.dtype) != want_dtype or np.dtype(scales.dtype) != np.uint8:
            raise ValueError(
                f"{format} weight stores {want_dtype} values and uint8 scales; got "
                f"{values.dtype} and {scales.dtype}"
            )
        self.values, self.scales = values, scales
        self.format, self.shape, self.dtype, self.block = format, shape, jnp.dtype(dtype), block

    # -- pytree: the leaves are plain arrays (jit, donation, sharding see codes and scales) --

    def tree_flatten(self):
        return (self.values, self.scales), (self.format, self.shape, self.dtype, self.block)

    @classmethod
    def tree_unflatten(cls, aux, children):
        # no checks: JAX rebuilds nodes around placeholders (specs, tracers, None)
        w = object.__new__(cls)
        w.values, w.scales = children
        w.format, w.shape, w.dtype, w.block = aux
        return w

    # -- what the model reads --------------------------------------------------------------

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes stored (values and scales)."""
        return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in self.tree_flatten()[0])

    @property
    def _tail(self) -> int:
        """Trailing axes a scale spans: the tile's two for fp8, one (a row's groups) else."""
        return 2 if self.format == "fp8" else 1

    def astype(self, dtype: Any) -> jax.Array:
        """The dequantised weight, ``shape`` in ``dtype``: exact ``code · 2^(scale - 127)``,
        what the numpy decoders of `dsv4.formats.codecs` compute in float32, then cast. bfloat16
        and float32 are computed in ``dtype`` itself, exactly (no float32 copy of a bfloat16
        weight); other types go through float32 (docs/model.md#dsv4formats)."""
        dtype = jnp.dtype(dtype)
        work = dtype if dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)) else jnp.float32
        if self.format == "fp8":
            w = _dequant_tiles(self.values.astype(work), self.scales, self.block)
        elif self.format == "fp4":
            w = _dequant_groups(unpack_e2m1(self.values).astype(work), self.scales, FP4_GROUP)
        else:
            w = _dequant_groups(self.values.astype(work), self.scales, self.block)
        return w.astype(dtype)

    def __getitem__(self, index) -> QuantisedWeight:
        """Index the leading (expert / row) axes: codes and scales are gathered, nothing is
        dequantised. ``w[ids]`` with ids int[...] gives a weight of shape ``ids.shape +
        shape[1:]``; a tuple may index several leading axes, never the tile / group axes."""
        lead = self.ndim - self._tail
        parts = index if isinstance(index, tuple) else (index,)
        if any(p is Ellipsis or p is None for p in parts) or len(parts) > lead:
            raise IndexError(
                f"a {self.format} weight of shape {list(self.shape)} can be indexed on its "
                f"{lead} leading axes only (the last {self._tail} hold its scale blocks); got "
                f"{index!r}"
            )
        values, scales = self.values[index], self.scales[index]
        tail = self.shape[-self._tail :]
        shape = (*values.shape[: values.ndim - self._tail], *tail)
        return QuantisedWeight.tree_unflatten(
            (self.format, shape, self.dtype, self.block), (values, scales)
        )

    def take(self, ids: jax.Array, *, mode: str | None = None) -> QuantisedWeight:
        """`jnp.take` of rows ``ids`` on axis 0 (``mode`` as jnp.take's), codes and scales."""
        if self.ndim - self._tail < 1:
            raise IndexError(f"a {self.format} weight of shape {list(self.shape)} has no row axis")
        values = jnp.take(self.values, ids, axis=0, mode=mode)
        scales = jnp.take(self.scales, ids, axis=0, mode=mode)
        shape = (*jnp.shape(ids), *self.shape[1:])
        return QuantisedWeight.tree_unflatten(
            (self.format, shape, self.dtype, self.block), (values, scales)
        )

    def __repr__(self) -> str:
        return (
            f"QuantisedWeight({self.format}, shape={list(self.shape)}, dtype={self.dtype.name}, "
            f"block={self.block})"
        )


# -- decoding inside jit ------------------------------------------------------------------------


def _pow2(e: jax.Array) -> jax.Array:
    """float32 ``2^e`` for int32 e in [-126, 127], from the exponent bits (exact)."""
    return jax.lax.bitcast_convert_type((e + E8M0_BIAS).astype(jnp.uint32) << 23, jnp.float32)


def _e8m0(scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    """uint8 e8m0 bytes -> two float32 powers of two whose product is ``2^(byte - 127)``:
    byte 0 (2^-127) is a subnormal XLA flushes to zero, the two normal factors are not, and
    scaling by both in turn matches the numpy decoders bit for bit (docs/model.md#dsv4formats).
    """
    e = scales.astype(jnp.int32) - E8M0_BIAS  # [-127, 127]
    half = jnp.floor_divide(e, 2)  # [-64, 63]
    return _pow2(half), _pow2(e - half)


def _dequant_tiles(v: jax.Array, scales: jax.Array, block: int) -> jax.Array:
    """Values [..., o, i] times the e8m0 scale of their ``block x block`` tile, in v's dtype
    (float32 or bfloat16: the two powers of two are exact in either)."""
    *lead, o, i = v.shape
    factors = [f.astype(v.dtype) for f in _e8m0(scales)]
    if o % block == 0 and i % block == 0:
        tiles = v.reshape(*lead, o // block, block, i // block, block)
        for s in factors:
            tiles = tiles * s[..., :, None, :, None]
        return tiles.reshape(v.shape)
    for s in factors:
        v = v * jnp.repeat(jnp.repeat(s, block, axis=-2), block, axis=-1)[..., :o, :i]
    return v


def _dequant_groups(v: jax.Array, scales: jax.Array, group: int) -> jax.Array:
    """Values [..., w] times the e8m0 scale of their ``group`` consecutive values, in v's
    dtype (float32 or bfloat16)."""
    *lead, w = v.shape
    factors = [f.astype(v.dtype) for f in _e8m0(scales)]
    if w % group == 0:
        groups = v.reshape(*lead, w // group, group)
        for s in factors:
            groups = groups * s[..., None]
        return groups.reshape(v.shape)
    for s in factors:
        v = v * jnp.repeat(s, group, axis=-1)[..., :w]
    return v


def unpack_e2m1(packed: jax.Array) -> jax.Array:
    """uint8 [..., w/2] (two e2m1 codes a byte, the even index low) -> float32 [..., w].

    Each code's float32 bits are built from its own bits (`dsv4.quant.E2M1_VALUES` exactly, -0
    included), not looked up in a table: elementwise work XLA fuses into the scaling, where a
    gather needs int32 indices (docs/model.md#dsv4formats).
    """
    codes = jnp.stack([packed & 0x0F, packed >> 4], axis=-1)
    c = codes.reshape(*packed.shape[:-1], 2 * packed.shape[-1]).astype(jnp.uint32)
    exp, mant = (c >> 1) & 3, c & 1
    # e >= 1: 2^(e - 1) (1 + m / 2), float32 exponent e + 126 and top mantissa bit m;
    # e == 0: m / 2, exponent 126 with a zero mantissa (0.5) or all zero bits (0)
    mag = jnp.where(exp > 0, ((exp + 126) << 23) | (mant << 22), mant * (126 << 23))
    return jax.lax.bitcast_convert_type(((c >> 3) << 31) | mag, jnp.float32)
