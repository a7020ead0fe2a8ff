"""Reading and writing checkpoints: the released safetensors format, and our own orbax format.

Released format (``../shared/reference/model_v41.md`` section 4): a directory with
``config.json`` and either ``model.safetensors`` or ``model.safetensors.index.json`` plus the
shards it names. Linear weights are fp8 e4m3 with one e8m0 (power-of-two) scale per
``fp8_block_size`` square tile, routed experts are packed fp4 e2m1 (two codes per byte, low nibble
= even index) with one e8m0 scale per 32 inputs, the rest BF16 or F32 (`dsv4.params.Storage`).

* `load_pretrained` reads such a directory into our params (a flat dict of dequantised float
  arrays, routed experts stacked ``[E, out, in]``). It parses the safetensors headers itself and
  memory-maps each tensor's byte range, because numpy has no dtype for F8_E8M0 scales or packed
  fp4 and a whole shard must never be read into RAM. Before decoding anything it checks every
  tensor against `dsv4.params.checkpoint_tensors` and reports all missing, unexpected, mistyped,
  mis-shaped and corrupt tensors in one `CheckpointError`. Engram tables (e4m3 rows, one e8m0
  scale per ``fp8_block_size`` values of a row) are dequantised like the rest, and the Engram
  compressed token map is built from the directory's tokenizer.json (`engram_token_map`).
  Tensors of parts this package does not model (the vision tower, the image bias; Engram or
  DSpark tensors under a config without them) are skipped with one log line.
* `save_pretrained` writes our params in that released format (quantising fp8 tiles and fp4
  groups with power-of-two scales), optionally sharded; `quantize_params_like_checkpoint` gives
  the values a save + load round trip would give, without touching disk.
* ``load_pretrained(path, mesh=)`` builds each param as a global `jax.Array` in its rule-table
  sharding (`dsv4.sharding.param_shardings`) with `jax.make_array_from_callback`: a process
  decodes only the slices its own devices hold, straight from the memory maps (fp8 the tiles
  covering a slice, routed experts only the per-expert tensors in its range), so a multi-host
  load reads each host's share of the checkpoint and never the whole of it on one host.
* `save_params` / `restore_params` store the params as they are (orbax), sharded or not,
  released `QuantisedWeight`s included (codes and scales as arrays, their format in the
  checkpoint's metadata); ``restore_params(..., mesh=)`` restores into the rule-table shardings.

The low-level codecs (`dequant_fp8`, `dequant_fp4`, `e8m0_to_float`, `quant_fp8`, `quant_fp4`)
are public so tests can check them on hand-built bytes.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import json
import logging
import math
import os
import re
import struct
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.experimental.layout import Format
from safetensors.numpy import save_file
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from dsv4.config import ModelConfig
from dsv4.engram_hash import compressed_token_map
from dsv4.formats import (
    DTYPE_BYTES,
    CheckpointError,
    HostTable,
    QuantisedWeight,
    check_e4m3,
    check_e8m0,
    dequant_fp4,
    dequant_fp8,
    dequant_fp8_rows,
    e8m0_to_float,
    format_problems,
    quant_fp4,
    quant_fp8,
    quant_fp8_rows,
    stored_shapes,
)
from dsv4.params import (
    CheckpointTensor,
    Storage,
    byte_token_map,
    check_params,
    check_token_map,
    checkpoint_tensors,
    param_specs,
)
from dsv4.qweights import STORAGE_FORMATS, check_weights_on_device, released_weight_spec
from dsv4.sharding import AXES, make_mesh, param_formats

# the codecs and CheckpointError live in dsv4.formats; their names here are kept for callers
__all__ = [
    "CheckpointError",
    "dequant_fp4",
    "dequant_fp8",
    "dequant_fp8_rows",
    "e8m0_to_float",
    "load_pretrained",
    "quant_fp4",
    "quant_fp8",
    "quant_fp8_rows",
    "quantize_params_like_checkpoint",
    "restore_params",
    "save_params",
    "save_pretrained",
]

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# numpy dtypes of the 1-byte storage dtypes (what save_pretrained hands safetensors)
_NUMPY_DTYPE = {
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    "I8": np.int8,
}

# Released tensors of parts this package does not model; each pattern has a short label for the
# skip summary. Engram tables alone are ~196B parameters.
_OUT_OF_SCOPE = (
    ("engram", re.compile(r"^layers\.\d+\.engram\.")),
    # a drafter stage's copies of the shared embedding / head (what a torch model that aliases
    # them writes): the backbone's own tensors are what the drafter uses
    ("mtp_shared", re.compile(r"^mtp\.\d+\.(?:embed|head)\.weight$")),
    ("mtp", re.compile(r"^mtp\.")),
    ("vision", re.compile(r"^vision\.")),
    ("aligner", re.compile(r"^aligner\.")),
    ("image", re.compile(r"^image_(?:start|end|newline)(?:\.|$)")),
    ("bias_vl", re.compile(r"^(?:layers|mtp)\.\d+\.ffn\.gate\.bias_vl$")),
)


def _out_of_scope(name: str, cfg: ModelConfig) -> str | None:
    for label, pattern in _OUT_OF_SCOPE:
        if pattern.match(name):
            # a config with Engram layers / a drafter models their tensors: a stray one of
            # those is unexpected, not out of scope
            if label == "engram" and cfg.engram_layer_ids:
                return None
            if label == "mtp" and cfg.n_mtp_layers and cfg.dspark_block_size:
                return None
            return label
    return None


# -- safetensors headers ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One tensor in a safetensors file: where its bytes are and what the header says."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...] | None  # None when the header's shape is malformed
    start: int  # absolute byte offset in the file
    nbytes: int
    problem: str | None  # a corrupt entry (offsets, byte count, dtype string)


def _read_header(path: str) -> dict[str, _Entry]:
    """Parse one safetensors file's header. File-level damage raises; per-tensor damage is
    recorded on the entry so that all such problems can be reported together."""
    fname = os.path.basename(path)
    size = os.path.getsize(path)
    if size < 8:
        raise CheckpointError(f"{path}: {size} bytes, too short for a safetensors header")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if 8 + n > size:
            raise CheckpointError(
                f"{path}: header length {n} exceeds the file's {size} bytes (truncated file, "
                "or not a safetensors file)"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is a JSON {type(header).__name__}, not an object")
    data_start, data_len = 8 + n, size - 8 - n
    out: dict[str, _Entry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        problem = None
        dtype, shape, start, nbytes = "?", None, 0, 0
        if not isinstance(info, dict):
            problem = f"header entry is a {type(info).__name__}, not an object"
        else:
            dtype = info.get("dtype")
            raw_shape = info.get("shape")
            offsets = info.get("data_offsets")
            if isinstance(raw_shape, list) and all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in raw_shape
            ):
                shape = tuple(raw_shape)
            else:
                problem = f"malformed shape {raw_shape!r}"
            if not (
                isinstance(offsets, list)
                and len(offsets) == 2
                and all(isinstance(k, int) and not isinstance(k, bool) for k in offsets)
            ):
                problem = problem or f"malformed data_offsets {offsets!r}"
            else:
                begin, end = offsets
                start, nbytes = data_start + begin, end - begin
                if not 0 <= begin <= end <= data_len:
                    problem = problem or (
                        f"data_offsets {offsets} lie outside the file's {data_len}-byte data "
                        "region (truncated file?)"
                    )
                elif not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
                    problem = problem or f"unknown dtype {dtype!r}"
                elif shape is not None and nbytes != math.prod(shape) * DTYPE_BYTES[dtype]:
                    problem = (
                        f"holds {nbytes} bytes but {dtype} {list(shape)} needs "
                        f"{math.prod(shape) * DTYPE_BYTES[dtype]}"
                    )
        if problem is not None:
            problem = f"{name} in {fname}: {problem}"
        out[name] = _Entry(name, path, str(dtype), shape, start, nbytes, problem)
    return out


def _checkpoint_files(path: str) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files of a checkpoint directory, and the index's weight map if any."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                data = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{index}: not valid JSON ({exc})") from exc
        wmap = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wmap, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in wmap.items()
        ):
            raise CheckpointError(f"{index}: needs a 'weight_map' object of tensor name -> file")
        by_file: dict[str, list[str]] = collections.defaultdict(list)
        for name, fname in wmap.items():
            by_file[fname].append(name)
        missing = [f for f in sorted(by_file) if not os.path.isfile(os.path.join(path, f))]
        if missing:
            raise CheckpointError(
                f"{index} names shard files missing from {path}{_on_process()}:\n  "
                + "\n  ".join(f"{f} (holds {_listed(by_file[f])})" for f in missing)
            )
        return [os.path.join(path, f) for f in sorted(by_file)], wmap
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        return [single], None
    raise CheckpointError(f"{path}: no {SINGLE_FILE} and no {INDEX_FILE}")


def _listed(names: list[str], most: int = 8) -> str:
    """``n tensors: a, b, ...`` with the first ``most`` names (sorted) and the count of the rest."""
    names = sorted(names)
    shown = ", ".join(names[:most])
    more = f", ... and {len(names) - most} more" if len(names) > most else ""
    return f"{len(names)} tensor{'' if len(names) == 1 else 's'}: {shown}{more}"


def _on_process() -> str:
    """`` on process k of n`` when JAX runs several processes (else nothing): which host of a
    multi-host load lacks a file."""
    n = jax.process_count()
    return f" on process {jax.process_index()} of {n}" if n > 1 else ""


def _index_checkpoint(
    path: str, cfg: ModelConfig
) -> tuple[dict[str, _Entry], list[CheckpointTensor], collections.Counter]:
    """Read every header and check the checkpoint against the config's tensors, raising one
    `CheckpointError` that lists every problem. Returns the entries by name, the expected
    tensors and the per-label counts of skipped out-of-scope tensors."""
    files, wmap = _checkpoint_files(path)
    entries: dict[str, _Entry] = {}
    corrupt, index_issues = [], []
    for file in files:
        for name, entry in _read_header(file).items():
            if name in entries:
                index_issues.append(
                    f"{name} is in both {os.path.basename(entries[name].file)} and "
                    f"{os.path.basename(file)}"
                )
                continue
            entries[name] = entry
    if wmap is not None:
        for name, fname in wmap.items():
            got = entries.get(name)
            if got is None:
                index_issues.append(f"{INDEX_FILE} maps {name} to {fname}, which lacks it")
            elif os.path.basename(got.file) != fname:
                index_issues.append(
                    f"{INDEX_FILE} maps {name} to {fname}, but it is in "
                    f"{os.path.basename(got.file)}"
                )
        for name, entry in entries.items():
            if name not in wmap:
                index_issues.append(
                    f"{name} is in {os.path.basename(entry.file)} but not in {INDEX_FILE}"
                )

    expected = list(checkpoint_tensors(cfg))
    expected_names = {t.name for t in expected}
    missing, wrong_dtype, wrong_shape = [], [], []
    for t in expected:
        e = entries.get(t.name)
        if e is None:
            missing.append(t.name)
            continue
        if e.problem is not None:
            corrupt.append(e.problem)
        if e.dtype != t.dtype:
            wrong_dtype.append(f"{t.name}: expected {t.dtype}, got {e.dtype}")
        if e.shape != tuple(t.shape):
            got = list(e.shape) if e.shape is not None else "malformed"
            wrong_shape.append(f"{t.name}: expected {list(t.shape)}, got {got}")
    unexpected = []
    skipped: collections.Counter = collections.Counter()
    for name in entries:
        if name in expected_names:
            continue
        label = _out_of_scope(name, cfg)
        if label is None:
            unexpected.append(f"{name} (in {os.path.basename(entries[name].file)})")
        else:
            skipped[label] += 1
    groups = [
        ("missing tensors", missing),
        ("unexpected tensors", unexpected),
        ("wrong dtype", wrong_dtype),
        ("wrong shape", wrong_shape),
        ("corrupt tensors", corrupt),
        ("inconsistent index", index_issues),
    ]
    if any(items for _, items in groups):
        raise CheckpointError(
            format_problems(f"checkpoint {path} does not match its config", groups)
        )
    return entries, expected, skipped


# -- loading ---------------------------------------------------------------------------------


# numpy views of the stored dtypes for slicing a tensor in place (1-byte codes stay raw bytes)
_VIEW = {"BF16": ml_dtypes.bfloat16, "F32": np.dtype("<f4")}

# Tests set this to a list to see what a sharded load reads: one (param, slice, tensor, bytes)
# tuple per slice copied out of a memory map (slice: ((start, stop), ...) of the param's leaf).
_read_log: list[tuple[str, tuple[tuple[int, int], ...], str, int]] | None = None


class _Files:
    """Read-only memory maps of the checkpoint's files, opened on first use."""

    def __init__(self) -> None:
        self._maps: dict[str, np.memmap] = {}
        self.log = _read_log
        self.context: tuple[str, tuple[tuple[int, int], ...]] | None = None

    def raw(self, e: _Entry) -> np.ndarray:
        """The entry's bytes as a uint8 view of the memory map, shaped like the tensor for
        1-byte dtypes (nothing is read until the values are used)."""
        if e.nbytes == 0:
            return np.zeros(0, np.uint8)
        mm = self._maps.get(e.file)
        if mm is None:
            mm = self._maps[e.file] = np.memmap(e.file, dtype=np.uint8, mode="r")
        return mm[e.start : e.start + e.nbytes]

    def read(self, e: _Entry, shape: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
        """A copy of the tensor's values at ``index`` (slices over its stored ``shape``): only
        those bytes of the map are touched (1-byte dtypes as raw uint8)."""
        view = self.raw(e).view(_VIEW.get(e.dtype, np.uint8)).reshape(shape)
        out = np.array(view[index])
        if self.log is not None and self.context is not None:
            self.log.append((*self.context, e.name, out.nbytes))
        return out

    def close(self) -> None:
        self._maps.clear()


def _decode(
    files: _Files,
    cfg: ModelConfig,
    weight: CheckpointTensor,
    scale: CheckpointTensor | None,
    entries: Mapping[str, _Entry],
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


# -- sharded loading -------------------------------------------------------------------------

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
    files: _Files,
    cfg: ModelConfig,
    weight: CheckpointTensor,
    scale: CheckpointTensor | None,
    entries: Mapping[str, _Entry],
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
    files: _Files,
    role: str,
    pairs: Mapping[int | None, Mapping[str, CheckpointTensor]],
    entries: Mapping[str, _Entry],
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


def _resolve_mesh(mesh: Any, caller: str = "load_pretrained") -> jax.sharding.Mesh:
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
    files: _Files,
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
    files: _Files,
    cfg: ModelConfig,
    pname: str,
    spec,
    tensors: list[CheckpointTensor],
    entries: Mapping[str, _Entry],
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


# Checkpoints that ship inside the package, in the released format (`shipped_checkpoint`).
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "weights")
SHIPPED = ("tiny_v41_trained",)


def shipped_checkpoint(name: str) -> str:
    """The directory of a checkpoint shipped with the package (``SHIPPED``): ``config.json``,
    ``model.safetensors`` in the released format, ``tokenizer.json``; for `load_pretrained`,
    `serving.LLM` (``LLM(model="tiny_v41_trained")``) and ``dsv4 demo``."""
    if name not in SHIPPED:
        raise ValueError(f"no shipped checkpoint {name!r}: the package ships {', '.join(SHIPPED)}")
    path = os.path.join(SHIPPED_DIR, name)
    missing = [
        f for f in ("config.json", "model.safetensors") if not os.path.isfile(os.path.join(path, f))
    ]
    if missing:
        raise FileNotFoundError(
            f"{path}: the shipped checkpoint {name!r} lacks {', '.join(missing)} (an install "
            "without package data? reinstall the package)"
        )
    return path


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
    """Load a released-format checkpoint directory into ``(config, params)``.

    ``engram_tables``: where Engram's tables live: "device" (arrays like every other tensor),
    "host" (`dsv4.engram.HostTable`: the checkpoint's fp8 bytes, memory-mapped, rows fetched
    per step through the host), or "auto" (host for a table that would take more than 1 GiB on
    device, such as the released ones: ~98 GB of fp8 each).

    ``weights_on_device``: "dequantised" (float arrays in ``dtype``, the default) or
    "released": every fp8 / FP4 tensor (and an Engram table on device) stays in the
    checkpoint's bytes as a `dsv4.qweights.QuantisedWeight` that the model dequantises where it
    reads it, standing for a ``dtype`` weight; the values the model computes with are the same
    bit for bit, the params take the checkpoint's bytes (in bf16) instead of about twice them.

    ``config`` overrides the directory's ``config.json``. Quantised tensors are dequantised
    exactly (fp8 · tile scale, fp4 · group scale) and, like every tensor not stored as F32, cast
    to ``dtype``; F32 tensors (mHC, attention sinks, router bias) stay float32. Routed experts
    are stacked into ``[E, out, in]``. Every structural problem (missing, unexpected, wrong dtype,
    wrong shape, corrupt byte ranges, inconsistent index) is reported in one `CheckpointError`
    (a ValueError) before any value is read; tensors of the vision tower and the image router
    bias (and of Engram / DSpark when the config has none) are skipped with one log line.
    Files are memory-mapped and read one tensor at a time.

    ``mesh`` (a `jax.sharding.Mesh` with the axes of `dsv4.sharding.make_mesh`, or a mapping
    of axis sizes for it such as ``{"expert": 8}``): every param becomes a global `jax.Array`
    in its rule-table sharding (`dsv4.sharding.param_shardings`), built by
    `jax.make_array_from_callback`: each process decodes only the slices its own devices hold,
    straight from the memory maps (fp8: the tiles covering the slice and their scales; routed
    experts: only the per-expert tensors in the slice's range; released weights: the slices of
    codes and scales), each distinct slice once. The result equals
    ``shard_params(load_pretrained(path, ...), cfg, mesh)`` bit for bit. Every process still
    reads all headers and checks the whole structure first, so a shard file missing on one
    process fails there, naming the file and its tensors, before any value is read. A mesh that
    needs more devices than are present, an axis that does not divide a tensor, or a mesh
    without the rule table's axes is a ValueError naming the sizes / the tensor."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a checkpoint directory")
    mesh = None if mesh is None else _resolve_mesh(mesh)
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
    cfg = config
    entries, expected, skipped = _index_checkpoint(path, cfg)
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
    specs = param_specs(cfg)
    shardings = None if mesh is None else _abstract_shardings(cfg, mesh, released, np_dtype)
    # the tokenizer is checked against the config before any tensor is read
    token_map = engram_token_map(path, cfg) if cfg.engram_layer_ids else None
    files = _Files()
    params: dict[str, jax.Array] = {}
    bar = _progress(len(expected), progress, "loading " + os.path.basename(path.rstrip("/")))
    try:
        for pname, spec in specs.items():
            if spec.storage is Storage.DERIVED:
                if mesh is None:
                    params[pname] = jnp.asarray(token_map)
                else:
                    params[pname] = jax.make_array_from_callback(
                        token_map.shape, shardings[pname], lambda i: token_map[i]
                    )
                continue
            stored = np.dtype(np.uint8) if released else np_dtype  # an Engram table's bytes
            if spec.storage is Storage.FP8_ROWS and _on_host(engram_tables, spec, stored):
                ts = {t.role: t for t in by_param[pname]}
                w, s = entries[ts["weight"].name], entries[ts["scale"].name]
                params[pname] = HostTable(
                    files.raw(w).reshape(ts["weight"].shape),
                    files.raw(s).reshape(ts["scale"].shape),
                    cfg.fp8_block_size,
                    pname,
                )
                bar.update(2)
                continue
            if mesh is not None:
                target = np.float32 if spec.storage is Storage.F32 else np_dtype
                params[pname] = _load_sharded(
                    files,
                    cfg,
                    pname,
                    spec,
                    by_param[pname],
                    entries,
                    target,
                    released,
                    shardings[pname],
                )
                bar.update(len(by_param[pname]))
                continue
            if released and spec.storage in STORAGE_FORMATS:
                params[pname] = _load_released(files, cfg, spec, by_param[pname], entries, np_dtype)
                bar.update(len(by_param[pname]))
                continue
            target = np.float32 if spec.storage is Storage.F32 else np_dtype
            out = np.empty(spec.shape, target)
            pairs: dict[int | None, dict[str, CheckpointTensor]] = collections.defaultdict(dict)
            for t in by_param[pname]:
                pairs[t.expert][t.role] = t
            for expert, ts in pairs.items():
                value = _decode(files, cfg, ts["weight"], ts.get("scale"), entries)
                if expert is None:
                    out[...] = value
                else:
                    out[expert] = value
                bar.update(len(ts))
            params[pname] = jnp.asarray(out)
    finally:
        bar.close()
        files.close()
    return cfg, params


def _load_released(
    files: _Files,
    cfg: ModelConfig,
    spec,
    tensors: list[CheckpointTensor],
    entries: Mapping[str, _Entry],
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


# -- saving ----------------------------------------------------------------------------------


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


def _hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """``cfg.to_hf_dict()``, plus the expert storage where the HF layout alone would not bring it
    back (a bf16 config without a quantization_config reads back with fp4 experts)."""
    out = cfg.to_hf_dict()
    back = ModelConfig.from_dict(out)
    if back.expert_dtype != cfg.expert_dtype:
        out["text_config"]["expert_dtype"] = cfg.expert_dtype
        back = ModelConfig.from_dict(out)
    if back.replace(quant_sim=cfg.quant_sim) != cfg:  # pragma: no cover - a config.py bug
        diff = [
            f"{f.name}: {getattr(cfg, f.name)!r} -> {getattr(back, f.name)!r}"
            for f in dataclasses.fields(cfg)
            if getattr(cfg, f.name) != getattr(back, f.name) and f.name != "quant_sim"
        ]
        raise CheckpointError(f"config does not round-trip through config.json: {diff}")
    return out


def save_pretrained(
    params: Mapping[str, Any],
    cfg: ModelConfig,
    path: str | os.PathLike[str],
    *,
    max_shard_bytes: int | None = None,
) -> None:
    """Write ``params`` as a released-format checkpoint directory.

    ``config.json`` is ``cfg.to_hf_dict()``; fp8 linears become e4m3 tiles with e8m0 tile scales,
    routed experts packed fp4 with per-32 e8m0 scales (see `quant_fp8`, `quant_fp4`), the rest
    BF16 (round to nearest even) or F32, following ``param_specs(cfg)``. With ``max_shard_bytes``
    the tensors are split greedily, in checkpoint order, into ``model-0000K-of-0000N.safetensors``
    shards of at most that many data bytes (a larger tensor gets a shard of its own) plus
    ``model.safetensors.index.json``; otherwise one ``model.safetensors``. Files of an earlier
    checkpoint in ``path`` with those names are removed first, so a stale index cannot shadow
    the new files. One shard's tensors are held in memory at a time.
    """
    path = os.fspath(path)
    check_params(params, cfg, "save_pretrained")
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise CheckpointError(f"max_shard_bytes={max_shard_bytes} must be positive or None")
    hf = _hf_config(cfg)
    tensors = list(checkpoint_tensors(cfg))
    shards: list[list[str]] = [[]]
    size = 0
    for t in tensors:
        nbytes = math.prod(t.shape) * DTYPE_BYTES[t.dtype]
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t.name)
        size += nbytes
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
    with open(os.path.join(path, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(hf, f, indent=2)
        f.write("\n")

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
        with open(os.path.join(path, INDEX_FILE), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
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


# -- our own format (orbax) ------------------------------------------------------------------


def save_params(
    params: Mapping[str, Any], path: str | os.PathLike[str], *, overwrite: bool = False
) -> None:
    """Save the params unchanged (names, shapes, dtypes, exact values, and their shardings)
    with orbax's StandardCheckpointer. ``path`` must not exist unless ``overwrite``.

    Sharded params (global `jax.Array`s, e.g. of ``load_pretrained(..., mesh=)``) are written
    by the processes that hold their shards (every process must call this, as orbax requires).
    A released weight (`dsv4.qweights.QuantisedWeight`) is stored as its two arrays, codes
    (float8_e4m3fn for fp8, uint8 for fp4) and uint8 scales, under ``<name>/values`` and
    ``<name>/scales``; its format, logical shape, dtype and block go in the checkpoint's custom
    metadata, from which `restore_params` rebuilds it."""
    import orbax.checkpoint as ocp  # reason: ~0.8 s at import; only save/restore use it

    tree: dict[str, Any] = {}
    quantised: dict[str, dict[str, Any]] = {}
    for name, w in params.items():
        if isinstance(w, QuantisedWeight):
            tree[name] = {"values": w.values, "scales": w.scales}
            quantised[name] = {
                "format": w.format,
                "shape": list(w.shape),
                "dtype": w.dtype.name,
                "block": w.block,
            }
        else:
            tree[name] = w
    path = os.path.abspath(os.fspath(path))
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path, tree, force=overwrite, custom_metadata={"quantised": quantised})
    ckptr.wait_until_finished()


def restore_params(
    path: str | os.PathLike[str],
    *,
    cfg: ModelConfig | None = None,
    dtype: Any = None,
    mesh: jax.sharding.Mesh | None = None,
) -> dict[str, Any]:
    """Restore params written by `save_params`: onto the default device, or with ``mesh``
    straight into their rule-table shardings (`dsv4.sharding.param_formats` on that mesh;
    each process reads the shards its devices hold), `QuantisedWeight`s rebuilt as saved.

    With ``cfg`` the saved names and (logical) shapes are first checked against
    ``param_specs(cfg)`` and every difference is reported in one `CheckpointError`. ``dtype``
    casts the restored float arrays and is what a restored `QuantisedWeight` stands for (its
    codes and scales are kept); with ``cfg`` the tensors the released checkpoint stores as F32
    stay float32, without ``cfg`` every float array is cast.
    """
    import orbax.checkpoint as ocp  # reason: ~0.8 s at import; only save/restore use it

    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such orbax checkpoint directory")
    ckptr = ocp.StandardCheckpointer()
    meta = ckptr.metadata(path)
    tree = meta.item_metadata.tree
    if not isinstance(tree, Mapping):
        raise CheckpointError(f"{path}: expected a flat dict of arrays, found {type(tree)}")
    quantised = (meta.custom_metadata or {}).get("quantised", {})
    shapes = {
        n: tuple(quantised[n]["shape"]) if n in quantised else tuple(m.shape)
        for n, m in tree.items()
    }
    if cfg is not None:
        specs = param_specs(cfg)
        missing = [n for n in specs if n not in tree]
        unexpected = [n for n in tree if n not in specs]
        wrong = [
            f"{n}: config expects {list(specs[n].shape)}, saved {list(shapes[n])}"
            for n in specs
            if n in tree and shapes[n] != specs[n].shape
        ]
        groups = [("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)]
        if missing or unexpected or wrong:
            raise CheckpointError(
                format_problems(f"orbax checkpoint {path} does not match the config", groups)
            )
    abstract: dict[str, Any] = {}
    for n, m in tree.items():
        if n in quantised:
            q = quantised[n]
            abstract[n] = QuantisedWeight(
                jax.ShapeDtypeStruct(tuple(m["values"].shape), m["values"].dtype),
                jax.ShapeDtypeStruct(tuple(m["scales"].shape), m["scales"].dtype),
                format=q["format"],
                shape=tuple(q["shape"]),
                dtype=jnp.dtype(q["dtype"]) if dtype is None else dtype,
                block=q["block"],
            )
        else:
            abstract[n] = jax.ShapeDtypeStruct(tuple(m.shape), m.dtype)
    formats: dict[str, Any] = {}
    if mesh is None:
        single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: single, abstract)
    else:
        # orbax restores into shardings; the routed experts' layout is applied after
        formats = param_formats(abstract, cfg, _resolve_mesh(mesh, "restore_params"))
        shardings = {n: f.sharding if isinstance(f, Format) else f for n, f in formats.items()}
    target = jax.tree.map(
        lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), abstract, shardings
    )
    as_saved = {
        n: {"values": w.values, "scales": w.scales} if isinstance(w, QuantisedWeight) else w
        for n, w in target.items()
    }
    restored = ckptr.restore(path, as_saved)
    params: dict[str, Any] = {}
    specs = param_specs(cfg) if cfg is not None else {}
    for n, w in target.items():
        x = restored[n]
        if isinstance(w, QuantisedWeight):
            params[n] = QuantisedWeight.tree_unflatten(
                w.tree_flatten()[1], (x["values"], x["scales"])
            )
            continue
        keep = n in specs and specs[n].storage is Storage.F32
        if dtype is not None and not keep and jnp.issubdtype(x.dtype, jnp.floating):
            x = x.astype(dtype)
        params[n] = x
    for n, f in formats.items():  # the routed experts' device layout
        if isinstance(f, Format):
            params[n] = jax.device_put(params[n], f)
    return params
