"""Quantised weights on device: the released fp8 / FP4 formats kept as stored, dequantised where
a matmul reads them.

`dsv4.load_pretrained` dequantises every fp8 and FP4 tensor into the params' float dtype by
default: simple, and what training wants, but the params then take about twice the released
checkpoint's bytes in bf16 (fp8 linears: 1 -> 2 bytes a value; FP4 experts: 0.5 -> 2).
``load_pretrained(..., weights_on_device="released")`` keeps those tensors as the checkpoint
stores them instead, each one a `dsv4.formats.QuantisedWeight` (the formats and how the model
reads them are described there) standing where the float array would be.

One cost stays: where the model runs every routed expert on every token (`dsv4.layers`'
all-experts branch, taken when a step routes more tokens than there are experts), a layer's
whole expert stack is dequantised inside the step, a transient buffer of that layer's experts
in the activation dtype (the gather branch of small steps dequantises only the selected ones).
A grouped matmul that decodes tiles inside its kernel would avoid it; there is none here yet.

`quantise_params` turns in-memory float params into the released form exactly as
`dsv4.save_pretrained` would store them (same codecs), so ``quantise_params(p, cfg)`` equals
``load_pretrained(<p saved>, weights_on_device="released")`` code for code, and
`dequantise_params` of it equals `dsv4.checkpoint.quantize_params_like_checkpoint` of ``p`` bit
for bit. `param_bytes` is what a params pytree holds on device; `checkpoint_bytes` what the
released checkpoint stores for the same tensors; `abstract_released_params` gives the released
form's shapes without allocating (for the full model's byte report).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dsv4.config import ModelConfig
from dsv4.formats import (
    DTYPE_BYTES,
    FORMATS,
    HostTable,
    QuantisedWeight,
    quant_fp4,
    quant_fp8,
    quant_fp8_rows,
    stored_shapes,
)
from dsv4.params import ParamSpec, Storage, check_params, checkpoint_tensors, param_specs

__all__ = [
    "FORMATS",
    "STORAGE_FORMATS",
    "WEIGHTS_ON_DEVICE",
    "QuantisedWeight",
    "abstract_released_params",
    "check_weights_on_device",
    "checkpoint_bytes",
    "dequantise_params",
    "param_bytes",
    "quantise_params",
    "released_weight_spec",
    "stored_shapes",
]

# what `load_pretrained(weights_on_device=)` / `LLM(weights_on_device=)` accept
WEIGHTS_ON_DEVICE = ("dequantised", "released")
# the checkpoint storages kept quantised, and their format names
STORAGE_FORMATS = {Storage.FP8: "fp8", Storage.FP4: "fp4", Storage.FP8_ROWS: "fp8_rows"}


def check_weights_on_device(value: Any) -> str:
    """``value`` if it is one of `WEIGHTS_ON_DEVICE`, else a ValueError naming it."""
    if not isinstance(value, str) or value not in WEIGHTS_ON_DEVICE:
        raise ValueError(
            f"weights_on_device={value!r} is not allowed: one of "
            + ", ".join(repr(v) for v in WEIGHTS_ON_DEVICE)
        )
    return value


# -- whole params ----------------------------------------------------------------------------


def quantise_params(params: Mapping[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """``params`` stored as `dsv4.save_pretrained` stores them, kept in memory: fp8 / FP4 /
    Engram-table tensors become `QuantisedWeight`s of save_pretrained's bytes (standing for the
    input's dtype), BF16-stored ones are rounded to bf16, F32 ones become float32, the rest kept.
    Equals ``load_pretrained(<params saved>, dtype, weights_on_device="released")`` leaf for leaf.

    Raises:
        CheckpointError: names or shapes differ from the config's, or a NaN / Inf tensor.
    """
    check_params(params, cfg, "quantise_params")
    blk = cfg.fp8_block_size
    out: dict[str, Any] = {}
    for name, spec in param_specs(cfg).items():
        x = params[name]
        if spec.storage is Storage.DERIVED or isinstance(x, QuantisedWeight | HostTable):
            out[name] = x
            continue
        host = np.asarray(x)
        fmt = STORAGE_FORMATS.get(spec.storage)
        if fmt is not None:
            if fmt == "fp8":
                q, s = quant_fp8(host, blk, name)
            elif fmt == "fp4":
                q, s = quant_fp4(host, name)
            else:
                q, s = quant_fp8_rows(host, blk, name)
            values = q.view(np.uint8) if fmt == "fp4" else q
            out[name] = QuantisedWeight(
                jnp.asarray(values),
                jnp.asarray(s.view(np.uint8)),
                format=fmt,
                shape=spec.shape,
                dtype=host.dtype,
                block=blk,
            )
        elif spec.storage is Storage.BF16:
            out[name] = jnp.asarray(host.astype(ml_dtypes.bfloat16).astype(host.dtype))
        else:
            out[name] = jnp.asarray(host.astype(np.float32))
    return out


# one small program per weight signature (cheaper to compile than the decode's ops one by one)
_dequantise = jax.jit(lambda w: w.astype(w.dtype))


def dequantise_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` with every `QuantisedWeight` dequantised to its dtype (the rest as is)."""
    return {n: _dequantise(w) if isinstance(w, QuantisedWeight) else w for n, w in params.items()}


def released_weight_spec(spec: ParamSpec, dtype: Any, block: int) -> QuantisedWeight | None:
    """The abstract `QuantisedWeight` (ShapeDtypeStruct leaves) of a quantised tensor's spec,
    or None for a tensor stored as a float."""
    fmt = STORAGE_FORMATS.get(spec.storage)
    if fmt is None:
        return None
    vshape, vdtype, sshape = stored_shapes(fmt, spec.shape, block)
    return QuantisedWeight(
        jax.ShapeDtypeStruct(vshape, vdtype),
        jax.ShapeDtypeStruct(sshape, np.uint8),
        format=fmt,
        shape=spec.shape,
        dtype=dtype,
        block=block,
    )


def abstract_released_params(cfg: ModelConfig, dtype: Any = jnp.bfloat16) -> dict[str, Any]:
    """Shapes and dtypes of ``load_pretrained(..., dtype, weights_on_device="released",
    engram_tables="device")`` without reading or allocating anything: `QuantisedWeight`s of
    ShapeDtypeStructs for the quantised tensors, ShapeDtypeStructs for the rest (F32-stored
    ones float32, the Engram token map int32, the others ``dtype``)."""
    out: dict[str, Any] = {}
    for name, spec in param_specs(cfg).items():
        w = released_weight_spec(spec, dtype, cfg.fp8_block_size)
        if w is None:
            dt = {Storage.F32: jnp.float32, Storage.DERIVED: jnp.int32}.get(spec.storage, dtype)
            w = jax.ShapeDtypeStruct(spec.shape, dt)
        out[name] = w
    return out


def param_bytes(params: Any) -> int:
    """Bytes the params' leaves hold: arrays, ShapeDtypeStructs (abstract params) and the codes
    and scales of `QuantisedWeight`s. An Engram `HostTable` has no leaves: its table is in host
    memory, not counted."""
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))


def checkpoint_bytes(cfg: ModelConfig, params: Iterable[str] | None = None) -> int:
    """Bytes the released checkpoint stores for the tensors of ``params`` (param names; None:
    all of `dsv4.params.checkpoint_tensors`), values and scales, from its dtypes and shapes."""
    keep = None if params is None else set(params)
    return sum(
        math.prod(t.shape) * DTYPE_BYTES[t.dtype]
        for t in checkpoint_tensors(cfg)
        if keep is None or t.param in keep
    )
