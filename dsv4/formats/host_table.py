"""An Engram table kept in host memory, as the checkpoint stores it (e4m3 rows, e8m0 scales).

A released table has ~384M rows of 256 values (98 GB as fp8): `HostTable` memory-maps it and
dequantises only the rows a step asks for (`dsv4.engram.table_rows` fetches them through
`jax.pure_callback`).
"""

from __future__ import annotations

import jax
import jax.experimental.pallas  # first, for stable compilation-cache keys (dsv4/__init__.py)
import ml_dtypes
import numpy as np

__all__ = ["HostTable"]


def _code_tables() -> tuple[np.ndarray, np.ndarray]:
    e4m3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    # byte 255 is e8m0's NaN (2^128 would not fit a float32 anyway)
    e8m0 = np.append(np.ldexp(np.float32(1), np.arange(255) - 127), np.nan).astype(np.float32)
    return e4m3, e8m0


_E4M3, _E8M0 = _code_tables()  # byte -> float32 value / scale


class HostTable:
    """An Engram table that stays in host memory: e4m3 rows and their e8m0 scales as stored in
    the checkpoint (memory-mapped), dequantised row by row when a step asks for them. A pytree
    node with no leaves standing where the float table would; `table_rows` fetches a step's rows
    through `jax.pure_callback` as bf16 (lossless). Why: docs/model.md#dsv4formats."""

    def __init__(self, values: np.ndarray, scales: np.ndarray, block: int, name: str = "table"):
        values, scales = np.asarray(values), np.asarray(scales)
        if values.ndim != 2 or values.dtype.itemsize != 1 or scales.dtype.itemsize != 1:
            raise ValueError(f"{name}: need 1-byte values [rows, width] and scales")
        rows, width = values.shape
        if width % block or scales.shape != (rows, width // block):
            raise ValueError(f"{name}: scales {scales.shape} do not match values "
                             f"{values.shape} with one per {block} values of a row")  # fmt: skip
        self.values, self.scales = values.view(np.uint8), scales.view(np.uint8)
        self.block, self.name = block, name

    @property
    def shape(self) -> tuple[int, int]:
        return self.values.shape

    def gather(self, rows) -> np.ndarray:
        """bf16[..., width]: the dequantised rows ``rows`` (int[...])."""
        ids = np.asarray(rows)
        if ids.size and (ids.min() < 0 or ids.max() >= self.shape[0]):
            raise ValueError(f"{self.name}: row ids span [{ids.min()}, {ids.max()}], the table "
                             f"has {self.shape[0]} rows")  # fmt: skip
        flat = ids.reshape(-1)
        v = _E4M3[self.values[flat]].reshape(len(flat), -1, self.block)
        v *= _E8M0[self.scales[flat]][..., None]
        # exact in bf16 (3 mantissa bits times a power of two): its top 16 bits, no rounding
        bits = (v.reshape(*ids.shape, self.shape[1]).view(np.uint32) >> 16).astype(np.uint16)
        return bits.view(ml_dtypes.bfloat16)

    def __repr__(self) -> str:
        return f"HostTable({self.name}, rows={self.shape[0]}, width={self.shape[1]})"


jax.tree_util.register_pytree_node(HostTable, lambda t: ((), t), lambda aux, _: aux)
