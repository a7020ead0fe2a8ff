"""Loading a released checkpoint into params: dequantised or kept as released, on one device or
straight into each process's shards of a mesh (each process reads only the slices it holds)."""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from dsv4.checkpoint.files import CONFIG_FILE, Entry, Files, index_checkpoint
from dsv4.checkpoint.shipped import SHIPPED, shipped_checkpoint
from dsv4.config import MODEL_PRESETS, ModelConfig, model_source
from dsv4.engram_hash import compressed_token_map
from dsv4.formats import (
    CheckpointError,
    HostTable,
    QuantisedWeight,
    check_e4m3,
    check_e8m0,
    dequant_fp4,
    dequant_fp8,
    dequant_fp8_rows,
    stored_shapes,
)
from dsv4.params import CheckpointTensor, Storage, byte_token_map, check_token_map, param_specs
from dsv4.qweights import STORAGE_FORMATS, check_weights_on_device, released_weight_spec
from dsv4.sharding import AXES, make_mesh, param_formats

__all__ = ["engram_token_map", "load_pretrained", "resolve_mesh"]

logger = logging.getLogger(__name__)


def _decode(
    files: Files,
    cfg: ModelConfig,
    weight: CheckpointTensor,
    scale: CheckpointTensor | None,
    entries: Mapping[str, Entry],
) -> np.ndarray:
    """One stored tensor (with its scale) -> its float32 (or bf16) values, shaped like the
    dequantised weight."""
    e = entries[weight.name]
    raw = files.raw(e)
    where = f"{weight.name} (in {os.path.basename(e.file)})"
    if weight.storage in (Storage.FP8, Storage.FP4, Storage.FP8_ROWS):
        s = entries[scale.name]
        sraw = files.raw(s).reshape(scale.shape)
        swhere = f"{scale.name} (in {os.path.basename(s.file)})"
        if weight.storage is Storage.FP8:
            return dequant_fp8(raw.reshape(weight.shape), sraw, cfg.fp8_block_size, where, swhere)
        if weight.storage is Storage.FP8_ROWS:
            blk = cfg.fp8_block_size
            return dequant_fp8_rows(raw.reshape(weight.shape), sraw, blk, where, swhere)
        return dequant_fp4(raw.reshape(weight.shape), sraw, where, swhere)
    if weight.dtype == "BF16":
        return raw.view(ml_dtypes.bfloat16).reshape(weight.shape)
    return raw.view("<f4").reshape(weight.shape)


Bounds = tuple[tuple[int, int], ...]  # (start, stop) per dim of a shard's slice


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> Bounds:
    """A shard's index (slices, as `jax.make_array_from_callback` gives it) as (start, stop)."""
    out = []
    for k, size in enumerate(shape):
        sl = index[k] if k < len(index) else slice(None)
        start, stop, step = sl.indices(size)
        if step != 1:  # pragma: no cover - shardings give contiguous blocks
            raise CheckpointError(f"shard index {index} has a step; expected contiguous slices")
        out.append((start, stop))
    return tuple(out)


def _slices(bounds: Bounds) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in bounds)


def _covering(lo: int, hi: int, block: int, size: int) -> tuple[slice, slice, slice]:
    """The whole blocks covering [lo, hi) of a dim of ``size``: (their elements, their block
    indices, [lo, hi) within those elements)."""
    b0, b1 = lo // block, max(-(-hi // block), lo // block)
    start = b0 * block
    return slice(start, min(b1 * block, size)), slice(b0, b1), slice(lo - start, hi - start)


def _decode_slice(
    files: Files,
    cfg: ModelConfig,
    weight: CheckpointTensor,
    scale: CheckpointTensor | None,
    entries: Mapping[str, Entry],
    bounds: Bounds,
) -> np.ndarray:
    """`_decode` of the rows / columns ``bounds`` of one stored tensor, reading only them: fp8
    the tiles that cover them with their scales, FP4 and Engram tables the rows (all their
    inputs: no rule splits those), the rest the slice itself. Equal to ``_decode(...)[bounds]``
    bit for bit: every decoder is elementwise."""
    e = entries[weight.name]
    where = f"{weight.name} (in {os.path.basename(e.file)})"
    if weight.storage not in (Storage.FP8, Storage.FP4, Storage.FP8_ROWS):
        return files.read(e, weight.shape, _slices(bounds))
    s = entries[scale.name]
    swhere = f"{scale.name} (in {os.path.basename(s.file)})"
    blk = cfg.fp8_block_size
    (r0, r1), (c0, c1) = bounds
    if weight.storage is Storage.FP8:
        rows, trows, rcrop = _covering(r0, r1, blk, weight.shape[0])
        cols, tcols, ccrop = _covering(c0, c1, blk, weight.shape[1])
        raw = files.read(e, weight.shape, (rows, cols))
        sraw = files.read(s, scale.shape, (trows, tcols))
        return dequant_fp8(raw, sraw, blk, where, swhere)[rcrop, ccrop]
    raw = files.read(e, weight.shape, (slice(r0, r1), slice(None)))
    sraw = files.read(s, scale.shape, (slice(r0, r1), slice(None)))
    if weight.storage is Storage.FP8_ROWS:
        return dequant_fp8_rows(raw, sraw, blk, where, swhere)[:, c0:c1]
    return dequant_fp4(raw, sraw, where, swhere)[:, c0:c1]


def _released_slice(
    files: Files,
    role: str,
    pairs: Mapping[int | None, Mapping[str, CheckpointTensor]],
    entries: Mapping[str, Entry],
    bounds: Bounds,
    codes_are_e4m3: bool,
) -> np.ndarray:
    """The codes (``role`` "weight") or e8m0 scales ("scale") of a quantised param at
    ``bounds`` of the stored leaf (a leading expert dim for stacked experts: only the per-expert
    tensors in its range are read), checked for NaN codes as `_load_released` checks them."""
    stacked = None not in pairs
    parts = range(*bounds[0]) if stacked else [None]
    rest = bounds[1:] if stacked else bounds
    out = []
    for expert in parts:
        t = pairs[expert][role]
        e = entries[t.name]
        raw = files.read(e, t.shape, _slices(rest))
        where = f"{t.name} (in {os.path.basename(e.file)})"
        if role == "scale":
            check_e8m0(raw, where)
        elif codes_are_e4m3:
            check_e4m3(raw, where)
        out.append(raw)
    return np.stack(out) if stacked else out[0]


def resolve_mesh(mesh: Any, caller: str = "load_pretrained") -> jax.sharding.Mesh:
    """A `jax.sharding.Mesh` with the rule table's axes, or a mapping of axis sizes for
    `dsv4.sharding.make_mesh`; anything else is a ValueError naming it."""
    if isinstance(mesh, Mapping):
        unknown = sorted(set(mesh) - set(AXES))
        if unknown:
            raise ValueError(
                f"{caller}(mesh={dict(mesh)!r}): unknown axes {unknown}; allowed: "
                + ", ".join(AXES)
            )
        try:
            return make_mesh(**mesh)
        except ValueError as exc:
            raise ValueError(f"{caller}(mesh={dict(mesh)!r}): {exc}") from None
    if not isinstance(mesh, jax.sharding.Mesh):
        raise ValueError(
            f"{caller}(mesh={mesh!r}): expected a jax.sharding.Mesh (dsv4.sharding."
            "make_mesh) or a mapping of axis sizes such as {'expert': 8}"
        )
    lacking = [a for a in ("expert", "model") if a not in mesh.axis_names]
    if lacking:
        raise ValueError(
            f"{caller}: the mesh's axes {mesh.axis_names} lack {lacking}; the rule "
            f"table splits over {AXES} (dsv4.sharding.make_mesh builds such a mesh)"
        )
    return mesh


def _from_callback(
    files: Files,
    pname: str,
    shape: tuple[int, ...],
    sharding: jax.sharding.NamedSharding,
    dtype: np.dtype,
    read: Any,
) -> jax.Array:
    """`jax.make_array_from_callback` over ``read(bounds) -> np.ndarray``, each distinct slice
    read once (devices that hold the same slice share it), the reads logged under ``pname``."""
    done: dict[Bounds, np.ndarray] = {}

    def callback(index: tuple[slice, ...]) -> np.ndarray:
        key = _bounds(index, shape)
        if key not in done:
            files.context = (pname, key)
            done[key] = np.asarray(read(key), dtype)
            files.context = None
        return done[key]

    return jax.make_array_from_callback(shape, sharding, callback, dtype=dtype)


def _load_sharded(
    files: Files,
    cfg: ModelConfig,
    pname: str,
    spec,
    tensors: list[CheckpointTensor],
    entries: Mapping[str, Entry],
    target: np.dtype,
    released: bool,
    sharding: Any,
) -> Any:
    """One param as global arrays in ``sharding`` (a `NamedSharding`, or a `QuantisedWeight` of
    them for a released weight), each process decoding only its devices' slices."""
    pairs: dict[int | None, dict[str, CheckpointTensor]] = collections.defaultdict(dict)
    for t in tensors:
        pairs[t.expert][t.role] = t
    fmt = STORAGE_FORMATS.get(spec.storage)
    if released and fmt is not None:
        vshape, vdtype, sshape = stored_shapes(fmt, spec.shape, cfg.fp8_block_size)
        leaves = []
        for role, shape, dt, sh in (
            ("weight", vshape, vdtype, sharding.values),
            ("scale", sshape, np.dtype(np.uint8), sharding.scales),
        ):

            def read(bounds, role=role, dt=dt):
                raw = _released_slice(files, role, pairs, entries, bounds, fmt != "fp4")
                return raw.view(np.uint8).view(dt)

            leaves.append(_from_callback(files, pname, shape, sh, dt, read))
        return QuantisedWeight(
            *leaves, format=fmt, shape=spec.shape, dtype=target, block=cfg.fp8_block_size
        )
    stacked = None not in pairs

    def read(bounds):
        out = np.empty([b - a for a, b in bounds], target)
        if not stacked:
            ts = pairs[None]
            out[...] = _decode_slice(files, cfg, ts["weight"], ts.get("scale"), entries, bounds)
            return out
        for k, expert in enumerate(range(*bounds[0])):
            ts = pairs[expert]
            out[k] = _decode_slice(files, cfg, ts["weight"], ts.get("scale"), entries, bounds[1:])
        return out

    return _from_callback(files, pname, spec.shape, sharding, target, read)


def load_pretrained(
    path: str | os.PathLike[str],
    dtype: Any = jnp.float32,
    *,
    config: ModelConfig | None = None,
    progress: bool = True,
    engram_tables: str = "auto",
    weights_on_device: str = "dequantised",
    mesh: Any = None,
) -> tuple[ModelConfig, dict[str, jax.Array]]:
    """Load a released-format checkpoint directory (or a name in `SHIPPED`) into ``(config,
    params)``: every structural problem in one `CheckpointError` before any value is read, then
    each tensor dequantised from memory maps and cast to ``dtype`` (F32-stored ones stay f32).
    ``config`` overrides ``config.json``; ``engram_tables``, ``weights_on_device`` and ``mesh``
    (params sharded as they are read): docs/model.md#loading-a-checkpoint."""
    path, cfg, mesh, released, np_dtype = _checked_arguments(
        path, dtype, config, engram_tables, weights_on_device, mesh
    )
    entries, expected, by_param = _indexed(path, cfg)
    specs = param_specs(cfg)
    shardings = None if mesh is None else _abstract_shardings(cfg, mesh, released, np_dtype)
    # the tokenizer is checked against the config before any tensor is read
    token_map = engram_token_map(path, cfg) if cfg.engram_layer_ids else None
    files = Files()
    loading = _Loading(
        files, cfg, entries, by_param, np_dtype, released, engram_tables, shardings, token_map
    )
    params: dict[str, jax.Array] = {}
    bar = _progress(len(expected), progress, "loading " + os.path.basename(path.rstrip("/")))
    try:
        for pname, spec in specs.items():
            params[pname] = _load_param(loading, pname, spec, bar)
    finally:
        bar.close()
        files.close()
    return cfg, params


def _checked_arguments(
    path: str | os.PathLike[str],
    dtype: Any,
    config: ModelConfig | None,
    engram_tables: str,
    weights_on_device: str,
    mesh: Any,
) -> tuple[str, ModelConfig, jax.sharding.Mesh | None, bool, np.dtype]:
    """`load_pretrained`'s arguments checked, in order, before any file is indexed; returns the
    directory, the config (``config`` or the directory's), the resolved mesh, whether the
    weights stay released and the params' numpy dtype."""
    path = os.fspath(path)
    if path in MODEL_PRESETS:  # a model name: the one resolver of names (`LLM` uses it too)
        kind, _ = model_source(path)
        if kind == "random":
            raise CheckpointError(
                f"load_pretrained({path!r}): {path} has random weights, no checkpoint: "
                f"dsv4.init_params(dsv4.{path}(), key) builds them; load_pretrained takes a "
                f"checkpoint directory or one of {', '.join(SHIPPED)}"
            )
        path = shipped_checkpoint(path)
    if not os.path.isdir(path):
        raise CheckpointError(
            f"{path}: not a checkpoint directory (no such folder; load_pretrained takes a "
            f"released-format checkpoint directory or one of {', '.join(SHIPPED)})"
        )
    mesh = None if mesh is None else resolve_mesh(mesh)
    if engram_tables not in ("auto", "device", "host"):
        raise CheckpointError(
            f"engram_tables={engram_tables!r}: expected 'auto', 'device' or 'host'"
        )
    released = check_weights_on_device(weights_on_device) == "released"
    np_dtype = np.dtype(jnp.dtype(dtype))
    if not jnp.issubdtype(np_dtype, jnp.floating):
        raise CheckpointError(f"dtype={dtype!r}: params must be a float dtype")
    if config is None:
        if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
            raise CheckpointError(f"{path}: no {CONFIG_FILE} (pass config= to load without one)")
        config = ModelConfig.from_json(path)
    return path, config, mesh, released, np_dtype


def _indexed(
    path: str, cfg: ModelConfig
) -> tuple[dict[str, Entry], list[CheckpointTensor], dict[str, list[CheckpointTensor]]]:
    """The checkpoint's index (`index_checkpoint`: its entries and the tensors the model
    expects, grouped by param), with one log line for the tensors it skips."""
    entries, expected, skipped = index_checkpoint(path, cfg)
    if skipped:
        summary = ", ".join(f"{label}: {n}" for label, n in sorted(skipped.items()))
        logger.warning(
            "%s: skipped %d tensors of parts this package does not model (%s)",
            path,
            sum(skipped.values()),
            summary,
        )

    by_param: dict[str, list[CheckpointTensor]] = collections.defaultdict(list)
    for t in expected:
        by_param[t.param].append(t)
    return entries, expected, by_param


@dataclasses.dataclass(frozen=True)
class _Loading:
    """What loading each param reads: the open files, the index, the target dtype, whether the
    weights stay released, where Engram's tables go, the params' shardings (None without a
    mesh) and Engram's token map (None without Engram)."""

    files: Files
    cfg: ModelConfig
    entries: dict[str, Entry]
    by_param: dict[str, list[CheckpointTensor]]
    np_dtype: np.dtype
    released: bool
    engram_tables: str
    shardings: dict[str, Any] | None
    token_map: np.ndarray | None


def _load_param(ld: _Loading, pname: str, spec, bar: tqdm) -> Any:
    """One param of `load_pretrained`: the derived token map, an Engram table on the host, a
    sharded global array, a released weight or a dense array, advancing ``bar`` by the
    tensors it read."""
    if spec.storage is Storage.DERIVED:
        if ld.shardings is None:
            return jnp.asarray(ld.token_map)
        token_map = ld.token_map
        return jax.make_array_from_callback(
            token_map.shape, ld.shardings[pname], lambda i: token_map[i]
        )
    tensors = ld.by_param[pname]
    stored = np.dtype(np.uint8) if ld.released else ld.np_dtype  # an Engram table's bytes
    if spec.storage is Storage.FP8_ROWS and _on_host(ld.engram_tables, spec, stored):
        ts = {t.role: t for t in tensors}
        w, s = ld.entries[ts["weight"].name], ld.entries[ts["scale"].name]
        value = HostTable(
            ld.files.raw(w).reshape(ts["weight"].shape),
            ld.files.raw(s).reshape(ts["scale"].shape),
            ld.cfg.fp8_block_size,
            pname,
        )
        bar.update(2)
        return value
    target = np.float32 if spec.storage is Storage.F32 else ld.np_dtype
    if ld.shardings is not None:
        value = _load_sharded(
            ld.files,
            ld.cfg,
            pname,
            spec,
            tensors,
            ld.entries,
            target,
            ld.released,
            ld.shardings[pname],
        )
    elif ld.released and spec.storage in STORAGE_FORMATS:
        value = _load_released(ld.files, ld.cfg, spec, tensors, ld.entries, ld.np_dtype)
    else:
        return _load_dense(ld, spec, tensors, target, bar)
    bar.update(len(tensors))
    return value


def _load_dense(
    ld: _Loading, spec, tensors: list[CheckpointTensor], target: type | np.dtype, bar: tqdm
) -> jax.Array:
    """A param as one float array in ``target``: each (per-expert) tensor decoded into its
    place (routed experts stacked into ``[E, out, in]``), advancing ``bar`` per tensor read."""
    out = np.empty(spec.shape, target)
    pairs: dict[int | None, dict[str, CheckpointTensor]] = collections.defaultdict(dict)
    for t in tensors:
        pairs[t.expert][t.role] = t
    for expert, ts in pairs.items():
        value = _decode(ld.files, ld.cfg, ts["weight"], ts.get("scale"), ld.entries)
        if expert is None:
            out[...] = value
        else:
            out[expert] = value
        bar.update(len(ts))
    return jnp.asarray(out)


def _load_released(
    files: Files,
    cfg: ModelConfig,
    spec,
    tensors: list[CheckpointTensor],
    entries: Mapping[str, Entry],
    dtype: np.dtype,
) -> QuantisedWeight:
    """One fp8 / FP4 / Engram-table param in its stored bytes (routed experts stacked), checked
    for e4m3 and e8m0 NaN codes as the decoders check them, standing for a ``dtype`` weight."""
    fmt = STORAGE_FORMATS[spec.storage]
    vshape, vdtype, sshape = stored_shapes(fmt, spec.shape, cfg.fp8_block_size)
    values, scales = np.empty(vshape, np.uint8), np.empty(sshape, np.uint8)
    pairs: dict[int | None, dict[str, CheckpointTensor]] = collections.defaultdict(dict)
    for t in tensors:
        pairs[t.expert][t.role] = t
    for expert, ts in pairs.items():
        w, s = entries[ts["weight"].name], entries[ts["scale"].name]
        raw = files.raw(w).reshape(ts["weight"].shape)
        sraw = files.raw(s).reshape(ts["scale"].shape)
        if fmt != "fp4":  # every e2m1 code is a number
            check_e4m3(raw, f"{w.name} (in {os.path.basename(w.file)})")
        check_e8m0(sraw, f"{s.name} (in {os.path.basename(s.file)})")
        where = ... if expert is None else expert
        values[where], scales[where] = raw, sraw
    return QuantisedWeight(
        jnp.asarray(values.view(vdtype)),
        jnp.asarray(scales),
        format=fmt,
        shape=spec.shape,
        dtype=dtype,
        block=cfg.fp8_block_size,
    )


def _abstract_shardings(
    cfg: ModelConfig, mesh: jax.sharding.Mesh, released: bool, dtype: np.dtype
) -> dict[str, Any]:
    """`dsv4.sharding.param_formats` of the params `load_pretrained` builds (a
    `QuantisedWeight` of shardings for a released weight; the routed experts' device layout
    under an ``expert`` axis), from shapes alone."""
    abstract: dict[str, Any] = {}
    for name, spec in param_specs(cfg).items():
        w = released_weight_spec(spec, dtype, cfg.fp8_block_size) if released else None
        abstract[name] = w if w is not None else jax.ShapeDtypeStruct(spec.shape, dtype)
    return param_formats(abstract, cfg, mesh)


def _on_host(where: str, spec, dtype: np.dtype) -> bool:
    if where != "auto":
        return where == "host"
    return math.prod(spec.shape) * dtype.itemsize > 1 << 30


def engram_token_map(path: str | os.PathLike[str] | None, cfg: ModelConfig) -> np.ndarray:
    """int32[vocab_size]: Engram's compressed token map for a checkpoint directory: from its
    tokenizer.json when it has one (`dsv4.engram_hash.compressed_token_map`), else the built-in
    byte tokenizer's. ValueError when the tokenizer's vocabulary does not fit the config (more
    ids than ``vocab_size``, or another number of compressed ids than
    ``engram_compressed_vocab_size``)."""
    file = None if path is None else os.path.join(os.fspath(path), "tokenizer.json")
    if file is None or not os.path.isfile(file):
        return byte_token_map(cfg)
    tok = Tokenizer.from_file(file)
    n = tok.get_vocab_size(with_added_tokens=True)
    if n > cfg.vocab_size:
        raise CheckpointError(
            f"{file} has {n} tokens but the model's vocab_size is {cfg.vocab_size}"
        )
    token_map, count = compressed_token_map(tok, cfg.vocab_size)
    try:
        check_token_map(cfg, token_map, count, file)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    return token_map.astype(np.int32)


def _progress(total: int, enabled: bool, desc: str) -> tqdm:
    return tqdm(total=total, disable=not enabled, desc=desc, unit="tensor")
