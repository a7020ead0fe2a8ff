"""Reading a released checkpoint directory: safetensors headers, the shard index, and
memory maps of the tensors' bytes, checked against the config's tensors before any value is
read (every problem in one `CheckpointError`)."""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import re
import struct
from typing import Any

import jax
import ml_dtypes
import numpy as np

from dsv4.config import ModelConfig
from dsv4.formats import DTYPE_BYTES, CheckpointError, format_problems
from dsv4.params import CheckpointTensor, checkpoint_tensors

__all__ = [
    "CONFIG_FILE",
    "INDEX_FILE",
    "SINGLE_FILE",
    "Entry",
    "Files",
    "index_checkpoint",
    "read_log",
]

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


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


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor in a safetensors file: where its bytes are and what the header says."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...] | None  # None when the header's shape is malformed
    start: int  # absolute byte offset in the file
    nbytes: int
    problem: str | None  # a corrupt entry (offsets, byte count, dtype string)


def _read_header(path: str) -> dict[str, Entry]:
    """Parse one safetensors file's header. File-level damage raises; per-tensor damage is
    recorded on the entry so that all such problems can be reported together."""
    header, data_start, data_len = _header_json(path)
    fname = os.path.basename(path)
    out: dict[str, Entry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, start, nbytes, problem = _parse_entry(info, data_start, data_len)
        if problem is not None:
            problem = f"{name} in {fname}: {problem}"
        out[name] = Entry(name, path, str(dtype), shape, start, nbytes, problem)
    return out


def _header_json(path: str) -> tuple[dict[str, Any], int, int]:
    """(the header object, where the data region starts, its length); damage raises."""
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
    return header, 8 + n, size - 8 - n


def _parse_entry(
    info: Any, data_start: int, data_len: int
) -> tuple[Any, tuple[int, ...] | None, int, int, str | None]:
    """One tensor's header entry: (dtype, shape, absolute start, bytes, its first problem)."""
    problem = None
    dtype, shape, start, nbytes = "?", None, 0, 0
    if not isinstance(info, dict):
        problem = f"header entry is a {type(info).__name__}, not an object"
        return dtype, shape, start, nbytes, problem
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
    return dtype, shape, start, nbytes, problem


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


def index_checkpoint(
    path: str, cfg: ModelConfig
) -> tuple[dict[str, Entry], list[CheckpointTensor], collections.Counter]:
    """Read every header and check the checkpoint against the config's tensors, raising one
    `CheckpointError` that lists every problem. Returns the entries by name, the expected
    tensors and the per-label counts of skipped out-of-scope tensors."""
    files, wmap = _checkpoint_files(path)
    entries, index_issues = _read_entries(files, wmap)
    expected = list(checkpoint_tensors(cfg))
    missing, wrong_dtype, wrong_shape, corrupt = _check_expected(entries, expected)
    unexpected = []
    skipped: collections.Counter = collections.Counter()
    expected_names = {t.name for t in expected}
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


def _read_entries(
    files: list[str], wmap: dict[str, str] | None
) -> tuple[dict[str, Entry], list[str]]:
    """Every file's header entries by name, and where they disagree with each other or with
    the index's weight map."""
    entries: dict[str, Entry] = {}
    index_issues = []
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
    return entries, index_issues


def _check_expected(
    entries: dict[str, Entry], expected: list[CheckpointTensor]
) -> tuple[list[str], list[str], list[str], list[str]]:
    """The expected tensors that are missing, of the wrong dtype, of the wrong shape, corrupt."""
    missing, wrong_dtype, wrong_shape, corrupt = [], [], [], []
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
    return missing, wrong_dtype, wrong_shape, corrupt


# numpy views of the stored dtypes for slicing a tensor in place (1-byte codes stay raw bytes)
_VIEW = {"BF16": ml_dtypes.bfloat16, "F32": np.dtype("<f4")}


# Tests set this to a list to see what a sharded load reads: one (param, slice, tensor, bytes)
# tuple per slice copied out of a memory map (slice: ((start, stop), ...) of the param's leaf).
read_log: list[tuple[str, tuple[tuple[int, int], ...], str, int]] | None = None


class Files:
    """Read-only memory maps of the checkpoint's files, opened on first use."""

    def __init__(self) -> None:
        self._maps: dict[str, np.memmap] = {}
        self.log = read_log
        self.context: tuple[str, tuple[tuple[int, int], ...]] | None = None

    def raw(self, e: Entry) -> np.ndarray:
        """The entry's bytes as a uint8 view of the memory map, shaped like the tensor for
        1-byte dtypes (nothing is read until the values are used)."""
        if e.nbytes == 0:
            return np.zeros(0, np.uint8)
        mm = self._maps.get(e.file)
        if mm is None:
            mm = self._maps[e.file] = np.memmap(e.file, dtype=np.uint8, mode="r")
        return mm[e.start : e.start + e.nbytes]

    def read(self, e: Entry, shape: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
        """A copy of the tensor's values at ``index`` (slices over its stored ``shape``): only
        those bytes of the map are touched (1-byte dtypes as raw uint8)."""
        view = self.raw(e).view(_VIEW.get(e.dtype, np.uint8)).reshape(shape)
        out = np.array(view[index])
        if self.log is not None and self.context is not None:
            self.log.append((*self.context, e.name, out.nbytes))
        return out

    def close(self) -> None:
        self._maps.clear()
