"""Saving params in the released format (fp8 tiles and FP4 groups quantised with power-of-two
scales), and the values such a save and load would give."""

from __future__ import annotations

import glob
import json
import math
import os
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from dsv4.checkpoint.files import CONFIG_FILE, INDEX_FILE, SINGLE_FILE
from dsv4.checkpoint.hf_config import hf_config
from dsv4.config import ModelConfig
from dsv4.formats import (
    DTYPE_BYTES,
    CheckpointError,
    HostTable,
    QuantisedWeight,
    dequant_fp4,
    dequant_fp8,
    dequant_fp8_rows,
    quant_fp4,
    quant_fp8,
    quant_fp8_rows,
)
from dsv4.params import CheckpointTensor, Storage, check_params, checkpoint_tensors, param_specs

__all__ = ["quantize_params_like_checkpoint", "save_pretrained"]

# numpy dtypes of the 1-byte storage dtypes (what save_pretrained hands safetensors)
_NUMPY_DTYPE = {
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    "I8": np.int8,
}


def _encode(params: Mapping[str, Any], cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """The released checkpoint's tensors in `checkpoint_tensors` order, as numpy arrays in their
    stored dtypes. Each param (or expert) is quantised once, for its weight and its scale."""
    blk = cfg.fp8_block_size
    cache_key, cache = None, None
    host: tuple[Any, np.ndarray] | None = None
    for t in checkpoint_tensors(cfg):
        if isinstance(params[t.param], HostTable):  # its stored bytes, as they are
            table = params[t.param]
            raw = table.values if t.role == "weight" else table.scales
            kind = ml_dtypes.float8_e4m3fn if t.role == "weight" else ml_dtypes.float8_e8m0fnu
            yield t.name, np.ascontiguousarray(raw.view(kind))
            continue
        if isinstance(params[t.param], QuantisedWeight):  # its stored bytes, as they are
            if host is None or host[0] != t.param:
                w = params[t.param]
                host = (t.param, (np.asarray(w.values), np.asarray(w.scales)))
            raw = host[1][0 if t.role == "weight" else 1]
            raw = raw if t.expert is None else raw[t.expert]
            yield t.name, np.ascontiguousarray(raw.view(np.uint8).view(_NUMPY_DTYPE[t.dtype]))
            continue
        if host is None or host[0] != t.param:
            host = (t.param, np.asarray(params[t.param]))
        x = host[1] if t.expert is None else host[1][t.expert]
        if t.storage in (Storage.FP8, Storage.FP4, Storage.FP8_ROWS):
            key = (t.param, t.expert)
            if key != cache_key:
                if t.storage is Storage.FP8:
                    cache = quant_fp8(x, blk, t.name)
                elif t.storage is Storage.FP8_ROWS:
                    cache = quant_fp8_rows(x, blk, t.name)
                else:
                    cache = quant_fp4(x, t.name)
                cache_key = key
            arr = cache[0] if t.role == "weight" else cache[1]
        elif t.dtype == "BF16":
            arr = np.asarray(x).astype(ml_dtypes.bfloat16)
        else:
            arr = np.asarray(x).astype(np.float32)
        if tuple(arr.shape) != tuple(t.shape):  # pragma: no cover - a params.py bug
            raise CheckpointError(f"{t.name}: encoded shape {arr.shape}, expected {t.shape}")
        yield t.name, np.ascontiguousarray(arr)


def save_pretrained(
    params: Mapping[str, Any],
    cfg: ModelConfig,
    path: str | os.PathLike[str],
    *,
    max_shard_bytes: int | None = None,
) -> None:
    """Write ``params`` as a released-format checkpoint directory (``config.json`` from
    ``cfg.to_hf_dict()``; each tensor stored as ``param_specs(cfg)`` says, see `quant_fp8`,
    `quant_fp4`). With ``max_shard_bytes``, shards of at most that many data bytes plus an index
    (docs/model.md#saving-a-checkpoint); otherwise one ``model.safetensors``. Files of an earlier
    checkpoint in ``path`` with those names are removed first.
    """
    path = os.fspath(path)
    check_params(params, cfg, "save_pretrained")
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise CheckpointError(f"max_shard_bytes={max_shard_bytes} must be positive or None")
    hf = hf_config(cfg)
    shards = _shard_names(list(checkpoint_tensors(cfg)), max_shard_bytes)
    if max_shard_bytes is None:
        names = [SINGLE_FILE]
    else:
        names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]

    os.makedirs(path, exist_ok=True)
    stale = glob.glob(os.path.join(path, "model-*-of-*.safetensors"))
    stale += [os.path.join(path, f) for f in (SINGLE_FILE, INDEX_FILE)]
    for f in stale:
        if os.path.isfile(f):
            os.remove(f)
    _write_json(os.path.join(path, CONFIG_FILE), hf)

    encoded = _encode(params, cfg)
    weight_map: dict[str, str] = {}
    total = 0
    for fname, shard in zip(names, shards):
        arrays: dict[str, np.ndarray] = {}
        for want in shard:
            name, arr = next(encoded)
            assert name == want, (name, want)
            arrays[name] = arr
            weight_map[name] = fname
            total += arr.nbytes
        save_file(arrays, os.path.join(path, fname), metadata={"format": "pt"})
    if max_shard_bytes is not None:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write_json(os.path.join(path, INDEX_FILE), index)


def _shard_names(tensors: list[CheckpointTensor], max_shard_bytes: int | None) -> list[list[str]]:
    """The tensors' names split greedily, in order, into shards of at most ``max_shard_bytes``
    data bytes (a larger tensor gets a shard of its own); one shard without a limit."""
    shards: list[list[str]] = [[]]
    size = 0
    for t in tensors:
        nbytes = math.prod(t.shape) * DTYPE_BYTES[t.dtype]
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t.name)
        size += nbytes
    return shards


def _write_json(file: str, obj: Any) -> None:
    with open(file, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def quantize_params_like_checkpoint(
    params: Mapping[str, Any], cfg: ModelConfig
) -> dict[str, jax.Array]:
    """The params a `save_pretrained` + `load_pretrained` round trip would give, computed in
    memory: fp8 / fp4 quantise-dequantise (same codecs), BF16 rounding for BF16-stored tensors.
    Each result keeps its input's dtype (F32-stored tensors: float32), so with float32 params
    this equals ``load_pretrained(..., dtype=jnp.float32)`` of a saved checkpoint bit for bit."""
    check_params(params, cfg, "quantize_params_like_checkpoint")
    blk = cfg.fp8_block_size
    out: dict[str, jax.Array] = {}
    for name, spec in param_specs(cfg).items():
        if spec.storage is Storage.DERIVED or isinstance(params[name], HostTable | QuantisedWeight):
            # the token map; a host table's or a quantised weight's bytes are the stored ones
            out[name] = params[name]
            continue
        x = np.asarray(params[name])
        if spec.storage is Storage.FP8:
            q, s = quant_fp8(x, blk, name)
            y = dequant_fp8(q, s, blk, name)
        elif spec.storage is Storage.FP8_ROWS:
            q, s = quant_fp8_rows(x, blk, name)
            y = dequant_fp8_rows(q, s, blk, name)
        elif spec.storage is Storage.FP4:
            q, s = quant_fp4(x, name)
            y = dequant_fp4(q, s, name)
        elif spec.storage is Storage.BF16:
            y = x.astype(ml_dtypes.bfloat16)
        else:
            y = x.astype(np.float32)
        target = np.float32 if spec.storage is Storage.F32 else x.dtype
        out[name] = jnp.asarray(y.astype(target))
    return out
