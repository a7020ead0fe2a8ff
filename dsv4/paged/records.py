"""Byte records of the paged caches: one cache state (a window latent, a compressed entry, an
index key) as a fixed number of bytes, with bit-exact encoders and decoders.

Each `RecordFormat` (f32, bf16, mxfp8, nvfp4, fp8_132, mxfp4, v4_584) encodes and decodes in pure
``jnp``, reproducing `dsv4.quant`'s QDQ bit for bit; 0xFF bytes decode to NaN in every format.
`CacheFormats` picks one per cache kind. Formats and rules: docs/cache.md#dsv4pagedrecords.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from dsv4.quant import E2M1_VALUES, FP4_MAX, FP8_MAX, e2m1_round, pow2_scale

__all__ = [
    "BF16",
    "EXACT",
    "NAN_BYTE",
    "PRESETS",
    "RECORDS",
    "RELEASED",
    "RELEASED_FP8",
    "SM90",
    "CacheFormats",
    "RecordFormat",
    "decode",
    "encode",
    "get_record",
    "record_bytes",
    "roundtrip",
]

# A byte that decodes to NaN in every record format (see the module docstring).
NAN_BYTE = 0xFF

_FP8_AMAX_FLOOR = 1e-4
_MXFP4_AMAX_FLOOR = FP4_MAX * 2.0**-126
_NVFP4_AMAX_FLOOR = FP4_MAX * 2.0**-9
_V4_ROPE_DIMS = 64  # raw bf16 tail of the V4 record
_V4_TILE = 64  # fp8 scale tile of the V4 record


# ---------------------------------------------------------------------------------------------
# Bit helpers
# ---------------------------------------------------------------------------------------------


def _to_bytes(x: jax.Array) -> jax.Array:
    """``T[..., n]`` (16/32-bit) -> ``uint8[..., n * itemsize]`` (little-endian, as in memory)."""
    b = jax.lax.bitcast_convert_type(x, jnp.uint8)
    return b.reshape(*x.shape[:-1], -1)


def _from_bytes(b: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """``uint8[..., n * itemsize]`` -> ``dtype[..., n]``."""
    size = jnp.dtype(dtype).itemsize
    return jax.lax.bitcast_convert_type(b.reshape(*b.shape[:-1], -1, size), dtype)


def _e4m3_bytes(q: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(q.astype(jnp.float8_e4m3fn), jnp.uint8)


def _e4m3_values(b: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(b, jnp.float8_e4m3fn).astype(jnp.float32)


def _ue8m0_byte(s: jax.Array) -> jax.Array:
    """The exponent byte of a positive normal power of two (``2^e`` -> ``e + 127``)."""
    bits = jax.lax.bitcast_convert_type(s.astype(jnp.float32), jnp.int32)
    return ((bits >> 23) & 0xFF).astype(jnp.uint8)


def _ue8m0_value(b: jax.Array) -> jax.Array:
    """UE8M0 byte -> ``2^(b - 127)`` as float32, 0xFF NaN. Byte 0 is ``2^-127``, a float32
    subnormal that backends flushing subnormals (XLA CPU) read as 0; no encoder writes it (the
    amax floors keep every scale byte >= 1)."""
    e = b.astype(jnp.int32)
    normal = jax.lax.bitcast_convert_type(e << 23, jnp.float32)
    value = jnp.where(e == 0, jnp.float32(2.0**-127), normal)
    return jnp.where(e == 0xFF, jnp.float32(jnp.nan), value)


_E2M1_MAGS = np.abs(E2M1_VALUES[1:8])  # 0.5 .. 6: magnitude code k has k of these <= it


def _e2m1_codes(q: jax.Array) -> jax.Array:
    """Codes (0..15, bit 3 = sign) of values that are already e2m1 (``e2m1_round`` output)."""
    mag = jnp.sum(jnp.abs(q)[..., None] >= jnp.asarray(_E2M1_MAGS), axis=-1)
    return (mag + 8 * jnp.signbit(q)).astype(jnp.uint8)


def _e2m1_values(codes: jax.Array) -> jax.Array:
    return jnp.asarray(E2M1_VALUES)[codes.astype(jnp.int32)]


def _pack_nibbles(codes: jax.Array) -> jax.Array:
    """``uint8[..., 2n]`` codes -> ``uint8[..., n]``, even index in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack_nibbles(b: jax.Array) -> jax.Array:
    """Inverse of `_pack_nibbles`."""
    return jnp.stack([b & 0xF, b >> 4], axis=-1).reshape(*b.shape[:-1], -1)


def _tiles(x: jax.Array, tile: int) -> jax.Array:
    return x.reshape(*x.shape[:-1], x.shape[-1] // tile, tile)


def _untile(x: jax.Array) -> jax.Array:
    return x.reshape(*x.shape[:-2], -1)


def _amax(xb: jax.Array, floor: float) -> jax.Array:
    return jnp.maximum(jnp.max(jnp.abs(xb), axis=-1, keepdims=True), floor)


# ---------------------------------------------------------------------------------------------
# Record formats
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RecordFormat:
    """One record format (see the module docstring for the table).

    Subclasses define the byte split (`data_bytes`, `scale_bytes`), the dims they accept
    (`_dim_error`) and `_encode` / `_decode`; the public methods check shapes and dims.
    """

    name: ClassVar[str]
    summary: ClassVar[str]

    def data_bytes(self, dim: int) -> int:
        """Bytes of the values part of one record."""
        raise NotImplementedError

    def scale_bytes(self, dim: int) -> int:
        """Bytes of the scales part of one record (stored after all data rows of a page)."""
        return 0

    def record_bytes(self, dim: int) -> int:
        """Bytes of one record of ``dim`` values (data + scales)."""
        self.check_dim(dim)
        return self.data_bytes(dim) + self.scale_bytes(dim)

    def _dim_error(self, dim: int) -> str | None:
        return None

    def check_dim(self, dim: int) -> None:
        """Raise a ValueError if this format cannot store ``dim`` values."""
        if not isinstance(dim, (int, np.integer)) or dim <= 0:
            raise ValueError(f"record {self.name!r}: dim must be a positive int, got {dim!r}")
        problem = self._dim_error(int(dim))
        if problem:
            raise ValueError(f"record {self.name!r} cannot store dim={dim}: {problem}")

    def encode(self, x: jax.Array) -> jax.Array:
        """``x f32[..., dim]`` (any float dtype, cast to f32) -> ``uint8[..., record_bytes]``."""
        x = jnp.asarray(x).astype(jnp.float32)
        if x.ndim == 0:
            raise ValueError(f"record {self.name!r}: encode needs [..., dim], got a scalar")
        self.check_dim(x.shape[-1])
        return _encode_jit(self.name, x)

    def decode(self, b: jax.Array, dim: int) -> jax.Array:
        """``b uint8[..., record_bytes(dim)]`` -> ``f32[..., dim]``."""
        b = jnp.asarray(b)
        nbytes = self.record_bytes(dim)
        if b.dtype != jnp.uint8 or b.ndim == 0 or b.shape[-1] != nbytes:
            raise ValueError(
                f"record {self.name!r}: decode(dim={dim}) needs uint8[..., {nbytes}], got "
                f"{b.dtype}{list(b.shape)}"
            )
        return _decode_jit(self.name, b, int(dim))

    def qdq(self, x: jax.Array) -> jax.Array:
        """``decode(encode(x))``: the values a stored record reads back as (f32)."""
        x = jnp.asarray(x)
        return self.decode(self.encode(x), x.shape[-1])

    def _encode(self, x: jax.Array) -> jax.Array:
        raise NotImplementedError

    def _decode(self, b: jax.Array, dim: int) -> jax.Array:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class _FloatRecord(RecordFormat):
    """Plain floats of one dtype, no scales (f32 exact, bf16 rounded to nearest even)."""

    name: str
    summary: str
    dtype: Any

    def data_bytes(self, dim: int) -> int:
        return jnp.dtype(self.dtype).itemsize * dim

    def _encode(self, x: jax.Array) -> jax.Array:
        return _to_bytes(x.astype(self.dtype))

    def _decode(self, b: jax.Array, dim: int) -> jax.Array:
        return _from_bytes(b, self.dtype).astype(jnp.float32)


_F32 = _FloatRecord("f32", "float32 values (exact)", jnp.float32)
_BF16 = _FloatRecord("bf16", "bfloat16 values (round to nearest even)", jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class _TiledRecord(RecordFormat):
    """A record of ``tile``-wide blocks: e4m3 or packed e2m1 values, then one scale per block.

    The scale is a UE8M0 power of two from the block's floored amax; `_E4M3ScaledRecord`
    overrides the three scale steps with an e4m3 scale.
    """

    name: str
    summary: str
    tile: int
    fp4: bool  # e2m1 pairs (True) or e4m3 values (False)
    amax_floor: float

    def data_bytes(self, dim: int) -> int:
        return dim // 2 if self.fp4 else dim

    def scale_bytes(self, dim: int) -> int:
        return dim // self.tile

    def _dim_error(self, dim: int) -> str | None:
        return None if dim % self.tile == 0 else f"needs a multiple of {self.tile}"

    def _scale(self, xb: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(the f32 scale each block divides by, what `_scale_bytes` stores of it)."""
        s = pow2_scale(_amax(xb, self.amax_floor), FP4_MAX if self.fp4 else FP8_MAX)
        return s, s

    def _scale_bytes(self, stored: jax.Array) -> jax.Array:
        return _ue8m0_byte(stored)[..., 0]

    def _scale_values(self, b: jax.Array) -> jax.Array:
        return _ue8m0_value(b)

    def _encode(self, x: jax.Array) -> jax.Array:
        xb = _tiles(x, self.tile)
        s, stored = self._scale(xb)
        if self.fp4:
            q = e2m1_round(jnp.clip(xb / s, -FP4_MAX, FP4_MAX))
            data = _pack_nibbles(_untile(_e2m1_codes(q)))
        else:
            q = jnp.clip(xb / s, -FP8_MAX, FP8_MAX)
            data = _untile(_e4m3_bytes(q))
        return jnp.concatenate([data, self._scale_bytes(stored)], axis=-1)

    def _decode(self, b: jax.Array, dim: int) -> jax.Array:
        n = self.data_bytes(dim)
        values = _e2m1_values(_unpack_nibbles(b[..., :n])) if self.fp4 else _e4m3_values(b[..., :n])
        q = _tiles(values, self.tile)
        s = self._scale_values(b[..., n:])[..., None]
        return _untile(q * s)


@dataclasses.dataclass(frozen=True)
class _E4M3ScaledRecord(_TiledRecord):
    """A tiled record whose block scale is an e4m3 value (amax / FP4_MAX), not a power of two."""

    def _scale(self, xb: jax.Array) -> tuple[jax.Array, jax.Array]:
        amax = _amax(xb, self.amax_floor)
        s8 = jnp.clip(amax / FP4_MAX, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
        return s8.astype(jnp.float32), s8

    def _scale_bytes(self, stored: jax.Array) -> jax.Array:
        return jax.lax.bitcast_convert_type(stored[..., 0], jnp.uint8)

    def _scale_values(self, b: jax.Array) -> jax.Array:
        return _e4m3_values(b)


# V4.1's SM100 window / compressed record.
_MXFP8 = _TiledRecord(
    "mxfp8", "e4m3 values + UE8M0 scale per 32 (V4.1 528-B record)", 32, False, _FP8_AMAX_FLOOR
)
# V4.1's NVFP4 compressed record (no global scale).
_NVFP4 = _E4M3ScaledRecord(
    "nvfp4", "e2m1 pairs + e4m3 scale per 16 (V4.1 288-B record)", 16, True, _NVFP4_AMAX_FLOOR
)
# V4.1's MXFP4 index-key record.
_MXFP4 = _TiledRecord(
    "mxfp4", "e2m1 pairs + UE8M0 scale per 32 (68-B index key)", 32, True, _MXFP4_AMAX_FLOOR
)


@dataclasses.dataclass(frozen=True)
class FP8x132Record(RecordFormat):
    """V4.1's FP8 index-key record: e4m3 values and one float32 power-of-two scale."""

    name: ClassVar[str] = "fp8_132"
    summary: ClassVar[str] = "e4m3 values + one f32 power-of-two scale (132-B index key)"

    def data_bytes(self, dim: int) -> int:
        return dim

    def scale_bytes(self, dim: int) -> int:
        return 4

    def _encode(self, x: jax.Array) -> jax.Array:
        s = pow2_scale(_amax(x, _FP8_AMAX_FLOOR), FP8_MAX)
        q = jnp.clip(x / s, -FP8_MAX, FP8_MAX)
        return jnp.concatenate([_e4m3_bytes(q), _to_bytes(s)], axis=-1)

    def _decode(self, b: jax.Array, dim: int) -> jax.Array:
        return _e4m3_values(b[..., :dim]) * _from_bytes(b[..., dim:], jnp.float32)


@dataclasses.dataclass(frozen=True)
class V4Record(RecordFormat):
    """DeepSeek-V4's 584-B record (V4.1 on every non-SM100 GPU, `docs/cache.md#record-formats`).

    Data: ``dim - 64`` e4m3 values (one power-of-two scale per 64, amax floored at 1e-4, the
    V4.1 rule with 64-wide tiles), then the last 64 (rope) dims as raw bf16; scales: one UE8M0
    byte per 64 fp8 dims, zero-padded to a multiple of 8 bytes. Reads back as
    ``concat(fp8_qdq(x[..., :-64], 64), bf16(x[..., -64:]))``.
    """

    name: ClassVar[str] = "v4_584"
    summary: ClassVar[str] = "V4 record: e4m3 + UE8M0 per 64, rope dims bf16 (584 B)"

    def data_bytes(self, dim: int) -> int:
        return (dim - _V4_ROPE_DIMS) + 2 * _V4_ROPE_DIMS

    def scale_bytes(self, dim: int) -> int:
        return -(-((dim - _V4_ROPE_DIMS) // _V4_TILE) // 8) * 8

    def _dim_error(self, dim: int) -> str | None:
        nope = dim - _V4_ROPE_DIMS
        if nope <= 0 or nope % _V4_TILE:
            return f"needs {_V4_ROPE_DIMS} rope dims after a positive multiple of {_V4_TILE}"
        return None

    def _encode(self, x: jax.Array) -> jax.Array:
        dim = x.shape[-1]
        nope = dim - _V4_ROPE_DIMS
        xb = _tiles(x[..., :nope], _V4_TILE)
        s = pow2_scale(_amax(xb, _FP8_AMAX_FLOOR), FP8_MAX)
        q = jnp.clip(xb / s, -FP8_MAX, FP8_MAX)
        scales = _ue8m0_byte(s)[..., 0]
        pad = self.scale_bytes(dim) - scales.shape[-1]
        parts = [
            _untile(_e4m3_bytes(q)),
            _to_bytes(x[..., nope:].astype(jnp.bfloat16)),
            scales,
            jnp.zeros((*x.shape[:-1], pad), jnp.uint8),
        ]
        return jnp.concatenate(parts, axis=-1)

    def _decode(self, b: jax.Array, dim: int) -> jax.Array:
        nope = dim - _V4_ROPE_DIMS
        data = self.data_bytes(dim)
        q = _tiles(_e4m3_values(b[..., :nope]), _V4_TILE)
        s = _ue8m0_value(b[..., data : data + nope // _V4_TILE])[..., None]
        rope = _from_bytes(b[..., nope:data], jnp.bfloat16).astype(jnp.float32)
        return jnp.concatenate([_untile(q * s), rope], axis=-1)


# Jitted cores: one fused computation per (format, shape) when called eagerly; inlined when
# called under an outer jit.
@functools.partial(jax.jit, static_argnums=0)
def _encode_jit(name: str, x: jax.Array) -> jax.Array:
    return RECORDS[name]._encode(x)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _decode_jit(name: str, b: jax.Array, dim: int) -> jax.Array:
    return RECORDS[name]._decode(b, dim)


RECORDS: dict[str, RecordFormat] = {
    r.name: r for r in (_F32, _BF16, _MXFP8, _NVFP4, FP8x132Record(), _MXFP4, V4Record())
}


def get_record(name: str) -> RecordFormat:
    """The record format called ``name``; a ValueError lists the known names otherwise."""
    try:
        return RECORDS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown record format {name!r}; known: {sorted(RECORDS)}") from None


def record_bytes(name: str, dim: int) -> int:
    """Bytes of one ``name`` record of ``dim`` values."""
    return get_record(name).record_bytes(dim)


def encode(name: str, x: jax.Array) -> jax.Array:
    """Encode ``x f32[..., dim]`` as ``name`` records."""
    return get_record(name).encode(x)


def decode(name: str, b: jax.Array, dim: int) -> jax.Array:
    """Decode ``name`` records of ``dim`` values to f32."""
    return get_record(name).decode(b, dim)


def roundtrip(name: str, x: jax.Array) -> jax.Array:
    """``decode(encode(x))``: what storing ``x`` as a ``name`` record reads back as."""
    return get_record(name).qdq(x)


# ---------------------------------------------------------------------------------------------
# Per-kind choice
# ---------------------------------------------------------------------------------------------

_KIND_FIELD = {"swa": "window", "compressed": "compressed", "index": "index"}


@dataclasses.dataclass(frozen=True)
class CacheFormats:
    """Which record each cache kind stores (frozen and hashable: part of static jit args).

    The compressor rings always hold raw float32 ``[a | s]`` rows, as in vLLM. Presets:
    ``EXACT`` (f32), ``BF16`` (the serving default), ``RELEASED`` (the reference's quant_sim),
    ``RELEASED_FP8`` and ``SM90`` (H200): docs/cache.md#dsv4pagedrecordscacheformats.
    """

    window: str = "bf16"  # the sliding-window latents (every layer's SWA cache)
    compressed: str = "bf16"  # the compressed KV entries (kv sources)
    index: str = "bf16"  # the index keys (kv sources that are index sources)

    EXACT: ClassVar[CacheFormats]
    BF16: ClassVar[CacheFormats]
    RELEASED: ClassVar[CacheFormats]
    RELEASED_FP8: ClassVar[CacheFormats]
    SM90: ClassVar[CacheFormats]

    def __post_init__(self) -> None:
        for field in ("window", "compressed", "index"):
            get_record(getattr(self, field))

    def record(self, kind: str) -> str:
        """Record name of a cache kind: ``"swa"``, ``"compressed"``, ``"index"`` or ``"ring"``."""
        if kind == "ring":
            return "f32"
        try:
            return getattr(self, _KIND_FIELD[kind])
        except KeyError:
            raise ValueError(
                f"unknown cache kind {kind!r}; known: {[*_KIND_FIELD, 'ring']}"
            ) from None

    def check_dims(self, head_dim: int, index_head_dim: int) -> None:
        """Raise a ValueError naming the kind if a record cannot store its dim."""
        for kind, dim in (("swa", head_dim), ("compressed", head_dim), ("index", index_head_dim)):
            try:
                get_record(self.record(kind)).check_dim(dim)
            except ValueError as e:
                raise ValueError(f"CacheFormats {kind} record: {e}") from None


EXACT = CacheFormats("f32", "f32", "f32")
BF16 = CacheFormats("bf16", "bf16", "bf16")
RELEASED = CacheFormats("mxfp8", "nvfp4", "mxfp4")
RELEASED_FP8 = CacheFormats("mxfp8", "mxfp8", "fp8_132")
SM90 = CacheFormats("v4_584", "v4_584", "fp8_132")
CacheFormats.EXACT = EXACT
CacheFormats.BF16 = BF16
CacheFormats.RELEASED = RELEASED
CacheFormats.RELEASED_FP8 = RELEASED_FP8
CacheFormats.SM90 = SM90

PRESETS: dict[str, CacheFormats] = {
    "EXACT": EXACT,
    "BF16": BF16,
    "RELEASED": RELEASED,
    "RELEASED_FP8": RELEASED_FP8,
    "SM90": SM90,
}
