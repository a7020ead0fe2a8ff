"""The released checkpoint's number formats on the host: fp8 / FP4 / Engram-table codecs in numpy.

Linear weights are e4m3 with one e8m0 (power-of-two) scale per ``block x block`` tile, routed
experts packed e2m1 (two codes a byte, the even input in the low nibble) with one e8m0 scale per
32 inputs, Engram tables e4m3 rows with one e8m0 scale per ``block`` values of a row. The
decoders are exact; the encoders round to nearest even and saturate, as the reference does.
"""

from __future__ import annotations

import functools
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dsv4.quant import E2M1_MIDS, E2M1_TIE_UP, E2M1_VALUES, FP4_MAX, FP8_MAX

__all__ = [
    "DTYPE_BYTES",
    "E8M0_BIAS",
    "FP4_GROUP",
    "FP4_MAX",
    "FP8_MAX",
    "MAX_LISTED",
    "CheckpointError",
    "check_e4m3",
    "check_e8m0",
    "dequant_fp4",
    "dequant_fp8",
    "dequant_fp8_rows",
    "e8m0_to_float",
    "format_problems",
    "quant_fp4",
    "quant_fp8",
    "quant_fp8_rows",
]

FP4_GROUP = 32  # inputs per e8m0 scale of a packed fp4 weight
E8M0_BIAS = 127
# problems listed per category in one error message; the count of the rest is still given
MAX_LISTED = 100

# Bytes per element of every safetensors dtype string (others in a header are "unknown"): the
# one such table of the model (`cache.spec.DTYPE_SIZE_BYTES` keys numpy names, for the cache).
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, or does not match the config / the params."""


def format_problems(title: str, groups: list[tuple[str, list[str]]]) -> str:
    """One error message: ``title`` with the problem count, then each non-empty group's items
    (at most `MAX_LISTED` of each, and how many more)."""
    total = sum(len(items) for _, items in groups)
    lines = [f"{title} ({total} problem{'' if total == 1 else 's'})"]
    for label, items in groups:
        if not items:
            continue
        lines.append(f"{label} ({len(items)}):")
        lines.extend(f"  {item}" for item in items[:MAX_LISTED])
        if len(items) > MAX_LISTED:
            lines.append(f"  ... and {len(items) - MAX_LISTED} more")
    return "\n".join(lines)


# e2m1 code -> value (bit 3 = sign): 0, .5, 1, 1.5, 2, 3, 4, 6, -0, ..., -6
_E2M1 = np.asarray(E2M1_VALUES, np.float32)


def _as_bytes(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype.itemsize != 1:
        raise TypeError(f"expected a 1-byte dtype (raw bytes), got {a.dtype}")
    return a.view(np.uint8)


def check_e8m0(b: np.ndarray, name: str) -> None:
    """e8m0 bytes must not hold its NaN code (255)."""
    if b.size and int(b.max()) == 255:
        where = tuple(int(i) for i in np.argwhere(b == 255)[0])
        raise CheckpointError(
            f"{name}: F8_E8M0 scale byte 255 (NaN) at index {where}; scale bytes must be 0..254"
        )


def e8m0_to_float(scale: np.ndarray, name: str = "scale") -> np.ndarray:
    """E8M0 scale bytes -> float32 ``2^(byte - 127)``. Byte 255 is e8m0's NaN: rejected, since a
    NaN scale would silently poison a whole tile of weights."""
    b = _as_bytes(scale)
    check_e8m0(b, name)
    return np.ldexp(np.float32(1.0), b.astype(np.int32) - E8M0_BIAS).astype(np.float32)


def _expand_tiles(scale: np.ndarray, shape: tuple[int, ...], block: int) -> np.ndarray:
    """Per-tile scales ``[..., ceil(o/B), ceil(i/B)]`` -> per-element ``[..., o, i]``."""
    o, i = shape[-2:]
    full = np.repeat(np.repeat(scale, block, axis=-2), block, axis=-1)
    return full[..., :o, :i]


def check_e4m3(b: np.ndarray, name: str) -> None:
    """e4m3 bytes must not hold its NaN codes (0x7F, 0xFF)."""
    if b.size and bool(np.any((b & 0x7F) == 0x7F)):
        where = tuple(int(k) for k in np.argwhere((b & 0x7F) == 0x7F)[0])
        raise CheckpointError(f"{name}: F8_E4M3 NaN byte (0x7F/0xFF) at index {where}")


def dequant_fp8(
    values: np.ndarray,
    scale: np.ndarray,
    block: int,
    name: str = "weight",
    scale_name: str | None = None,
    *,
    rows: bool = False,
) -> np.ndarray:
    """FP8 weight bytes ``[..., o, i]`` (e4m3) and e8m0 tile scales ``[..., ceil(o/B),
    ceil(i/B)]`` -> float32 ``e4m3 · 2^(scale - 127)`` per ``block x block`` tile (exact). With
    ``rows`` (`dequant_fp8_rows`), an Engram table ``[rows, width]`` with one scale per B values
    of a row (``[rows, width / B]``). ``name`` / ``scale_name`` only label errors."""
    b = _as_bytes(values)
    if rows:
        n, width = b.shape
        if width % block or tuple(scale.shape) != (n, width // block):
            raise CheckpointError(
                f"{name}: scale shape {tuple(scale.shape)} does not match table {b.shape} with "
                f"one scale per {block} values of a row (expected {(n, width // block)})"
            )
    o, i = b.shape[-2:]
    want = (*b.shape[:-2], -(-o // block), -(-i // block))
    if not rows and tuple(scale.shape) != want:
        raise CheckpointError(
            f"{name}: scale shape {tuple(scale.shape)} does not tile weight {b.shape} in "
            f"{block}x{block} blocks (expected {want})"
        )
    check_e4m3(b, name)
    s = e8m0_to_float(scale, scale_name or f"scale of {name}")
    v = b.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    if rows:
        return (v.reshape(o, i // block, block) * s[..., None]).reshape(o, i)
    if o % block == 0 and i % block == 0:
        lead = v.shape[:-2]
        tiles = v.reshape(*lead, o // block, block, i // block, block)
        return (tiles * s[..., :, None, :, None]).reshape(v.shape)
    return v * _expand_tiles(s, v.shape, block)


# An Engram table: e4m3 ``[rows, width]``, one e8m0 scale per ``block`` values of a row.
dequant_fp8_rows = functools.partial(dequant_fp8, rows=True)


def dequant_fp4(
    packed: np.ndarray,
    scale: np.ndarray,
    name: str = "weight",
    scale_name: str | None = None,
) -> np.ndarray:
    """Packed fp4 bytes ``[..., o, i/2]`` (low nibble = even input index, high nibble = odd) and
    e8m0 scales ``[..., o, ceil(i/32)]`` -> float32 ``e2m1 · 2^(scale - 127)`` ``[..., o, i]``.
    ``name`` / ``scale_name`` only label errors."""
    b = _as_bytes(packed)
    half = b.shape[-1]
    i = 2 * half
    want = (*b.shape[:-1], -(-i // FP4_GROUP))
    if tuple(scale.shape) != want:
        raise CheckpointError(
            f"{name}: scale shape {tuple(scale.shape)} does not match packed fp4 weight "
            f"{b.shape} (one scale per {FP4_GROUP} inputs: expected {want})"
        )
    s = e8m0_to_float(scale, scale_name or f"scale of {name}")
    codes = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(*b.shape[:-1], i)
    v = _E2M1[codes]
    s_full = np.repeat(s, FP4_GROUP, axis=-1)[..., :i]
    return v * s_full


def _pow2_exponent(amax: np.ndarray, max_value: float) -> np.ndarray:
    """``ceil(log2(amax / max_value))`` exactly (float64 frexp, no log rounding), clamped to the
    e8m0 range [-127, 127]. An all-zero block gets the smallest scale, 2^-127: this is the
    "amax floored at a tiny positive number" of the reference's quantiser."""
    x = np.asarray(amax, np.float64) / max_value
    m, e = np.frexp(x)  # x = m · 2^e, m in [0.5, 1)
    e = np.where(m == 0.5, e - 1, e)  # exact powers of two
    e = np.where(x > 0, e, -E8M0_BIAS)
    return np.clip(e, -E8M0_BIAS, E8M0_BIAS).astype(np.int32)


def _scale_bytes(exp: np.ndarray) -> np.ndarray:
    return (exp + E8M0_BIAS).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)


def _finite_f64(x: Any, name: str) -> np.ndarray:
    a = np.asarray(x)
    if not jnp.issubdtype(a.dtype, jnp.floating):  # numpy's floats and bfloat16
        raise CheckpointError(f"{name}: cannot quantise dtype {a.dtype}; expected a float array")
    a = a.astype(np.float64)
    if not np.all(np.isfinite(a)):
        raise CheckpointError(f"{name}: cannot quantise a tensor that holds NaN or Inf")
    return a


def quant_fp8(x: Any, block: int, name: str = "weight") -> tuple[np.ndarray, np.ndarray]:
    """Float ``[..., o, i]`` -> (e4m3 values ``[..., o, i]``, e8m0 scales ``[..., ceil(o/B),
    ceil(i/B)]``). Per tile: scale ``2^ceil(log2(amax / 448))``, values ``x / scale`` rounded to
    nearest even and saturated at ±448."""
    a = _finite_f64(x, name)
    if a.ndim < 2:
        raise CheckpointError(f"{name}: fp8 tiles need a matrix, got shape {a.shape}")
    o, i = a.shape[-2:]
    to, ti = -(-o // block), -(-i // block)
    pad = [(0, 0)] * (a.ndim - 2) + [(0, to * block - o), (0, ti * block - i)]
    tiles = np.pad(a, pad).reshape(*a.shape[:-2], to, block, ti, block)
    exp = _pow2_exponent(np.max(np.abs(tiles), axis=(-3, -1)), FP8_MAX)
    q = tiles / np.ldexp(1.0, exp)[..., :, None, :, None]
    q = np.clip(q, -FP8_MAX, FP8_MAX).reshape(*a.shape[:-2], to * block, ti * block)
    q = q[..., :o, :i].astype(ml_dtypes.float8_e4m3fn)
    return q, _scale_bytes(exp)


def quant_fp4(x: Any, name: str = "weight") -> tuple[np.ndarray, np.ndarray]:
    """Float ``[..., o, i]`` (i a multiple of 32) -> (packed int8 ``[..., o, i/2]``, e8m0 scales
    ``[..., o, i/32]``). Per 32 inputs: scale ``2^ceil(log2(amax / 6))``, values ``x / scale``
    rounded to the nearest e2m1 value (ties to even) and saturated at ±6; two codes per byte,
    the even index in the low nibble."""
    a = _finite_f64(x, name)
    if a.ndim < 2 or a.shape[-1] % FP4_GROUP:
        raise CheckpointError(
            f"{name}: packed fp4 needs a matrix whose input width is a multiple of "
            f"{FP4_GROUP}, got shape {a.shape}"
        )
    groups = a.reshape(*a.shape[:-1], a.shape[-1] // FP4_GROUP, FP4_GROUP)
    exp = _pow2_exponent(np.max(np.abs(groups), axis=-1), FP4_MAX)
    v = np.clip(groups / np.ldexp(1.0, exp)[..., None], -FP4_MAX, FP4_MAX).reshape(a.shape)
    mag = np.abs(v)
    code = np.searchsorted(E2M1_MIDS, mag, side="left")  # number of midpoints below mag
    at_mid = np.take(E2M1_MIDS, np.minimum(code, 6)) == mag
    code = code + (at_mid & np.take(E2M1_TIE_UP, np.minimum(code, 6)))
    code = (code | (np.signbit(v).astype(code.dtype) << 3)).astype(np.uint8)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed.view(np.int8), _scale_bytes(exp)


def quant_fp8_rows(x: Any, block: int, name: str = "weight") -> tuple[np.ndarray, np.ndarray]:
    """Float ``[rows, width]`` -> (e4m3 ``[rows, width]``, e8m0 ``[rows, width / B]``): per B
    values of a row, scale ``2^ceil(log2(amax / 448))`` as in `quant_fp8`."""
    a = _finite_f64(x, name)
    if a.ndim != 2 or a.shape[1] % block:
        raise CheckpointError(f"{name}: an fp8 table needs [rows, k * {block}], got {a.shape}")
    groups = a.reshape(a.shape[0], -1, block)
    exp = _pow2_exponent(np.max(np.abs(groups), axis=-1), FP8_MAX)
    q = np.clip(groups / np.ldexp(1.0, exp)[..., None], -FP8_MAX, FP8_MAX).reshape(a.shape)
    return q.astype(ml_dtypes.float8_e4m3fn), _scale_bytes(exp)
