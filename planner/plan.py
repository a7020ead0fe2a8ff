"""The memory planner: what one chip of a slice holds when it serves a model, without devices.

``dsv4 plan --model v41_flash --chips v5p-16`` (`serving.cli`) prints it; `plan` computes it:

* **weights** per chip: every checkpoint tensor (`dsv4.params.checkpoint_tensors`, the released
  stored formats: fp8 values + e8m0 tile scales, packed FP4 experts + per-32 scales, bf16, f32)
  split by the one rule table `dsv4.sharding.PARAM_RULES` over the mesh's axis sizes. A split
  dim of ``n`` over an axis of ``a`` holds ``n / a`` rows per chip where ``a`` divides it and
  all ``n`` where not (a scale-tile dim too short to split stays whole, as `dsv4.sharding`
  places quantised weights); stacked routed experts hold ``E / expert`` experts each.
  Replicated tensors count on every chip. The bf16 column is the same split of the
  dequantised params (bf16, f32 where the checkpoint stores f32), what
  `dsv4.params.init_params` holds. Engram's tables (``layers.L.engram.embed.weight``, most of
  the release's bytes) stay on the host (`dsv4.formats.HostTable`): they are reported as
  ``host_bytes``, not on the chip. The Engram token map (derived, int32 per vocabulary id) is
  not counted.
* **KV pages** per chip, per KV-cache group: the packed layout of `cache.layout.for_model` for
  the model's layer plan and the chip's record formats (`dsv4.paged.pools.cache_desc`);
  a request of ``max_model_len`` tokens holds `cache.layout.blocks_per_request` blocks of each
  group, each block costing ``pool_bytes_per_block`` (groups alias one pool). Requests and
  their pages are split over ``data`` (each data shard owns its pools); within a shard the
  pages are NOT split: V4.1's KV is one shared latent per token, which every ``model`` /
  ``expert`` rank reads whole. Plus the null block.
* **activations**: an estimate of one step's peak per chip (`activation_bytes`), with
  ``T = max_num_batched_tokens`` tokens and ``R`` requests per data shard, ``b`` = 2 (bf16):
  ``residual = 2 T hc dim b`` (a layer's mHC streams in and out) + the larger of
  ``attention = T (2 heads/model head_dim + index_heads/model index_head_dim) b`` (queries and
  outputs of the local heads) plus what the attention decodes from the pools (`kv_reads`:
  ``index_keys``, the indexer's keys of every page its table references, ``(R nb + 1) states
  index_head_dim b`` for the layer with the most, none when the index records are ``fp8_132``,
  which the indexer reads as they are; ``selected_entries``, the sparse attention's picks
  ``min(T index_topk, pages) head_dim b``, `dsv4.paged.pools.read_selected`; both count: a
  layer's index decode depends only on the pools, so XLA may run it while the layer before
  still holds its picks) and ``moe = T k / expert (3 inter + 2 dim) b + 3 T inter/model b``
  (routed tokens under uniform routing: gate/up/product and dispatch/combine rows; the shared
  expert) + ``logits = R vocab 4 / model`` (f32 rows of the local vocabulary slice; with
  ``model > 1`` plus the gathered ``R vocab 4``), ``R = min(requests, T)``; with the weights
  in their released formats on the device the MoE term adds ``dequantised_experts = 3 E' inter
  dim b``, the routed experts a MoE layer dequantises (``E' = E / expert`` under the expert
  dispatch; on one device the selected ``min(T k, E)``). Not counted: the
  indexer's score rows (the kernels tile them), the window pages (a few per request), a
  decode's own intermediates (the step decodes ``DECODE_CHUNK`` pages at a time), XLA's
  fragmentation, the runtime's own reserve (the ``headroom`` covers them).
* **largest batch**: for a few context lengths, the most requests (a multiple of ``data``)
  whose weights + KV + activations fit in ``(1 - headroom)`` of the chip's HBM.

Slices (`parse_slice`), case-insensitive:

* ``v5e-N`` (also ``v5litepod-N``), ``v6e-N``: ``N`` chips (Cloud TPU names count chips for
  v5e and v6e);
* ``v5p-N``: ``N`` TensorCores, ``N/2`` chips (Cloud TPU names count cores for v5p: two per
  chip, driven as one megacore device);
* ``h100xN``, ``h200xN`` (``h200`` alone = 1): ``N`` GPUs.

HBM per chip (`CHIPS`): v5e 16 GiB, v6e 32 GiB, v5p 95 GiB, H100 80 GB, H200 141 GB (vendor
figures; what a runtime lets a program use is less, hence the headroom). The KV record formats
default to what the chip runs: Hopper the ``SM90`` preset (the 584-B V4 record, B 64,
alignment 576, as vLLM runs V4.1 on H200); TPUs the ``RELEASED`` preset (mxfp8 window, nvfp4
compressed, mxfp4 index keys: the released model's own quantisation) on the SM100 geometry
(B 128, alignment 512), the layout the Blackwell kernels were specified with.

Meshes (`MeshAxes`): ``data x expert x model`` = the slice's chips. The default (`default_mesh`)
tries every such factorisation whose ``model`` divides the heads, index heads and output groups
and whose axes divide every tensor they split, and takes the one that fits the most
``max_model_len`` requests (then fewer weight bytes, then a smaller ``model``). An explicit mesh
that does not divide a tensor, or that needs another number of chips than the slice has, is an
error naming the value.

`collective_bytes_per_decode_step` gives the bytes one chip sends per decode step.
`compiled_memory` (``dsv4 plan --compiled``, `benchmarks.sharding`) compiles ``reference.forward``
with params sharded over a mesh for a TPU topology without a device (libtpu's compile-only
topologies) and sets XLA's per-device memory beside the planner's weight bytes;
`planner.compiled_step` does the same for the sharded paged step (real kernels, KV pools, the step
batch) on 8 TPU chips or 8 H100s.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib.util
import math
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from cache.layout import for_model, memory_report
from cache.spec import KVCacheConfig
from dsv4 import reference, sharding
from dsv4.config import MODEL_PRESETS, ModelConfig, v41_flash
from dsv4.formats import DTYPE_BYTES
from dsv4.paged.pools import SCALED_RECORDS, PoolLayout, cache_desc
from dsv4.paged.records import PRESETS
from dsv4.params import Storage, checkpoint_tensors, param_specs
from dsv4.sharding import AXES, partition_spec_for

__all__ = [
    "CHIPS",
    "CONTEXTS",
    "MODELS",
    "ChipKind",
    "ChipPlan",
    "MeshAxes",
    "SliceSpec",
    "activation_bytes",
    "collective_bytes_per_decode_step",
    "compiled_check",
    "compiled_memory",
    "default_mesh",
    "describe",
    "describe_compiled",
    "flash_layers",
    "kv_group_bytes_per_request",
    "kv_layout",
    "markdown_table",
    "parse_mesh",
    "parse_slice",
    "plan",
    "reduced_flash",
    "stored_bytes_total",
    "tpu_topology",
    "weight_bytes_per_chip",
]

GiB = 2**30
ACT_BYTES = 2  # bf16 activations
LOGIT_BYTES = 4  # f32 logits
CONTEXTS = (8192, 131_072, 1_048_576)  # context lengths of the largest-batch column
_QUANTISED = (Storage.FP8, Storage.FP4)  # stored formats a weight is dequantised from
MODELS = {name: preset.config for name, preset in MODEL_PRESETS.items()}  # every model name


@dataclasses.dataclass(frozen=True, slots=True)
class ChipKind:
    """One accelerator: its HBM, how slice names count it, and its default KV records.

    Fields:
        name / device: the slice prefix (``v5e``, ``h200``...) and a readable name.
        hbm_bytes / cores_per_chip: HBM per chip; slice-name units per chip (v5p: 2 cores).
        records: the `dsv4.paged.records.PRESETS` name of its KV records.
        block_size / swa_block_size / page_alignment: the cache geometry for those records.
        platform: ``"tpu"`` or ``"gpu"`` (XLA's lowering of the expert dispatch differs).
    """

    name: str
    device: str
    hbm_bytes: int
    cores_per_chip: int
    records: str
    block_size: int
    swa_block_size: int
    page_alignment: int
    platform: str = "tpu"


_TPU_GEOMETRY = {"records": "RELEASED", "block_size": 128, "swa_block_size": 32}
_HOPPER_GEOMETRY = {"records": "SM90", "block_size": 64, "swa_block_size": 32, "platform": "gpu"}

CHIPS: dict[str, ChipKind] = {
    c.name: c
    for c in (
        ChipKind("v5e", "TPU v5e", 16 * GiB, 1, page_alignment=512, **_TPU_GEOMETRY),
        ChipKind("v6e", "TPU v6e", 32 * GiB, 1, page_alignment=512, **_TPU_GEOMETRY),
        ChipKind("v5p", "TPU v5p", 95 * GiB, 2, page_alignment=512, **_TPU_GEOMETRY),
        ChipKind("h100", "H100", 80 * 10**9, 1, page_alignment=576, **_HOPPER_GEOMETRY),
        ChipKind("h200", "H200", 141 * 10**9, 1, page_alignment=576, **_HOPPER_GEOMETRY),
    )
}
_ALIASES = {"v5litepod": "v5e"}


@dataclasses.dataclass(frozen=True, slots=True)
class SliceSpec:
    """A slice: ``num_chips`` chips of one kind, and the name it was given."""

    chip: ChipKind
    num_chips: int
    name: str


_SLICE_GRAMMAR = (
    "v5e-N / v5litepod-N / v6e-N (N chips), v5p-N (N TensorCores = N/2 chips), "
    "h100xN / h200xN (N GPUs)"
)


def parse_slice(text: str) -> SliceSpec:
    """``v5p-16`` -> 8 v5p chips; ``h200x8`` -> 8 H200s (grammar in the module docstring).

    Raises:
        ValueError: an unknown chip, a count below 1, or an odd v5p core count; the message
            names the value and the grammar.
    """
    s = text.strip().lower()
    tpu = re.fullmatch(r"(v5e|v5litepod|v6e|v5p)-(\d+)", s)
    gpu = re.fullmatch(r"(h100|h200)(?:x(\d+))?", s)
    if tpu:
        kind, count = _ALIASES.get(tpu.group(1), tpu.group(1)), int(tpu.group(2))
    elif gpu:
        kind, count = gpu.group(1), int(gpu.group(2) or 1)
    else:
        raise ValueError(f"--chips {text!r}: not a slice; expected {_SLICE_GRAMMAR}")
    chip = CHIPS[kind]
    if count < 1 or count % chip.cores_per_chip:
        unit = "TensorCores (two per chip), an even number" if chip.cores_per_chip > 1 else "chips"
        raise ValueError(f"--chips {text!r}: the count must be >= 1 {unit}, got {count}")
    return SliceSpec(chip, count // chip.cores_per_chip, text)


@dataclasses.dataclass(frozen=True, slots=True)
class MeshAxes:
    """The sizes of the ``("data", "expert", "model")`` mesh axes (no devices)."""

    data: int = 1
    expert: int = 1
    model: int = 1

    @property
    def num_chips(self) -> int:
        return self.data * self.expert * self.model

    def abstract(self) -> AbstractMesh:
        """A device-free mesh of these sizes (what `dsv4.sharding.partition_spec_for` reads)."""
        return AbstractMesh((self.data, self.expert, self.model), AXES)

    def __str__(self) -> str:
        return f"data={self.data},expert={self.expert},model={self.model}"


def parse_mesh(text: str) -> MeshAxes:
    """``"data=2,model=8,expert=4"`` (any order; a missing axis is 1).

    Raises:
        ValueError: an unknown axis, a repeated one, or a size that is not an int >= 1.
    """
    sizes: dict[str, int] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or key not in AXES:
            raise ValueError(f"--mesh {text!r}: {part.strip()!r} is not AXIS=SIZE, AXIS in {AXES}")
        if key in sizes:
            raise ValueError(f"--mesh {text!r}: axis {key} given twice")
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"--mesh {text!r}: {key}={value!r} must be an int >= 1")
        sizes[key] = int(value)
    return MeshAxes(**sizes)


# -- weights ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _Stored:
    """Checkpoint tensors of one param and role, identical but for the expert index."""

    param: str
    dtype: str
    shape: tuple[int, ...]  # one tensor's stored shape (one expert's, if stacked)
    count: int  # tensors (experts) of this shape; 1 unless stacked
    stacked: bool
    host: bool  # Engram tables: held by the host, not the chip


def _is_host(param: str) -> bool:
    return param.endswith(".engram.embed.weight")


@functools.cache
def _stored_tensors(cfg: ModelConfig) -> tuple[_Stored, ...]:
    counts: collections.Counter = collections.Counter()
    for t in checkpoint_tensors(cfg):
        counts[(t.param, t.role, t.dtype, t.shape, t.expert is not None)] += 1
    return tuple(
        _Stored(param, dtype, shape, n, stacked, _is_host(param))
        for (param, _, dtype, shape, stacked), n in counts.items()
    )


def _split(shape: Sequence[int], spec: Sequence[str | None], mesh: MeshAxes) -> int:
    """Elements per chip of ``shape`` split by ``spec``: ``n / axis`` on a dim the axis divides,
    ``n`` (whole on every chip) on one it does not (a packed or per-tile dim too short to
    split: how `dsv4.sharding` places a quantised weight's codes and scales)."""
    sizes = dataclasses.asdict(mesh)
    per_dim = (
        n // sizes[a] if a and n % sizes[a] == 0 else n for n, a in zip(shape, spec, strict=True)
    )
    return math.prod(per_dim)


@functools.cache
def _param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {n: s.shape for n, s in param_specs(cfg).items()}


@functools.cache
def _rules(cfg: ModelConfig) -> dict[str, tuple[str | None, ...]]:
    """Every param's rule (`dsv4.sharding.partition_spec_for` on a 1-chip mesh, where every
    dim divides) as a tuple of axis names per dim."""
    one = MeshAxes().abstract()
    out = {}
    for name, shape in _param_shapes(cfg).items():
        spec = tuple(partition_spec_for(name, shape, one))
        out[name] = spec + (None,) * (len(shape) - len(spec))
    return out


def _specs(cfg: ModelConfig, mesh: MeshAxes) -> dict[str, tuple[str | None, ...]]:
    """The rules, checked against ``mesh``: where an axis does not divide a dim it splits,
    `partition_spec_for` raises its error (naming the tensor, the dim and the axis)."""
    rules, shapes, sizes = _rules(cfg), _param_shapes(cfg), dataclasses.asdict(mesh)
    for name, spec in rules.items():
        if any(a and shapes[name][d] % sizes[a] for d, a in enumerate(spec)):
            partition_spec_for(name, shapes[name], mesh.abstract())
    return rules


def weight_bytes_per_chip(cfg: ModelConfig, mesh: MeshAxes, *, stored: bool = True) -> dict:
    """Weight bytes one chip holds on ``mesh``: ``{"device": int, "host": int}``.

    ``stored``: the released formats (`checkpoint_tensors`); else the dequantised params (bf16,
    f32 where stored so). ``host``: Engram tables, whole (the host keeps one copy).

    Raises:
        ValueError: a mesh axis does not divide a dim it splits (names tensor, dim and axis).
    """
    _check_mesh_divides_model(cfg, mesh)
    specs = _specs(cfg, mesh)
    device = host = 0
    if stored:
        for t in _stored_tensors(cfg):
            spec = specs[t.param]
            if t.host:
                host += t.count * math.prod(t.shape) * DTYPE_BYTES[t.dtype]
                continue
            count = t.count // mesh.expert if t.stacked and spec[0] else t.count
            dims = spec[1:] if t.stacked else spec
            device += count * _split(t.shape, dims, mesh) * DTYPE_BYTES[t.dtype]
        return {"device": device, "host": host}
    for name, ps in param_specs(cfg).items():
        if ps.storage is Storage.DERIVED:
            continue
        item = 4 if ps.storage is Storage.F32 else 2
        if _is_host(name):
            host += math.prod(ps.shape) * item
        else:
            device += _split(ps.shape, specs[name], mesh) * item
    return {"device": device, "host": host}


def _check_mesh_divides_model(cfg: ModelConfig, mesh: MeshAxes) -> None:
    """What the rule table cannot see from shapes: ``model`` splits whole heads and output
    groups (a row count can divide where a group count does not)."""
    for what, n in (
        ("n_heads", cfg.n_heads),
        ("index_n_heads", cfg.index_n_heads),
        ("o_groups", cfg.o_groups),
    ):
        if n % mesh.model:
            raise ValueError(f"mesh model={mesh.model} does not divide {what}={n}")


# -- KV pages ----------------------------------------------------------------------------------


@functools.cache
def kv_layout(
    cfg: ModelConfig, chip: ChipKind, records: str | None = None, num_speculative_tokens: int = 0
) -> KVCacheConfig:
    """The packed ``KVCacheConfig`` (one block) of ``cfg`` with ``records`` (default: the
    chip's) on the chip's geometry."""
    name = records or chip.records
    if name not in PRESETS:
        raise ValueError(f"--records {name!r}: not a preset; known: {sorted(PRESETS)}")
    desc = cache_desc(
        cfg,
        PRESETS[name],
        block_size=chip.block_size,
        swa_block_size=chip.swa_block_size,
        num_speculative_tokens=num_speculative_tokens,
        page_alignment=chip.page_alignment,
        indexer_page_alignment=chip.page_alignment,
    )
    return for_model(desc, num_gpu_blocks_override=1)


def kv_group_bytes_per_request(
    config: KVCacheConfig, max_model_len: int, max_num_batched_tokens: int
) -> dict[str, int]:
    """Pool bytes one ``max_model_len`` request holds, per KV-cache group (``"g0:SlidingWindow
    MLASpec[43]"``): its blocks (`cache.layout.blocks_per_request`) x the pool's bytes per
    block (groups alias one pool, so any group's block costs the widest page set)."""
    report = memory_report(config, max_model_len, max_num_batched_tokens, packed_layout=True)
    return {
        f"g{g.group_id}:{g.kind}[{g.num_layers}]": g.max_blocks_per_request
        * report.pool_bytes_per_block
        for g in report.groups
    }


def _block_bytes(config: KVCacheConfig) -> int:
    return memory_report(config, 1, 1, packed_layout=True).pool_bytes_per_block


# -- activations -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KVReads:
    """What one data shard's step decodes from its pools for the attention kernels, per layer
    at most (`dsv4.paged.step`): the indexer's keys (`dsv4.paged.pools.read_for_table`) and the
    sparse attention's entries (`dsv4.paged.pools.read_selected`). Entry counts for ``seqs``
    requests: ``per_request * seqs + fixed`` (the null block's copy), the largest layer's."""

    index_per_request: int = 0
    index_fixed: int = 0
    comp_per_request: int = 0
    comp_fixed: int = 0
    picks: int = 0  # T·K

    def index_entries(self, seqs: int) -> int:
        return self.index_per_request * seqs + self.index_fixed

    def selected_entries(self, seqs: int) -> int:
        pages = self.comp_per_request * seqs + self.comp_fixed
        return min(self.picks, pages) if pages else 0


def kv_reads(
    cfg: ModelConfig, config: KVCacheConfig, records: str, max_model_len: int, num_tokens: int
) -> KVReads:
    """`KVReads` of ``cfg``'s layout ``config`` (record preset ``records``) for requests of
    ``max_model_len`` tokens and steps of ``num_tokens`` tokens."""
    layout = PoolLayout.build(cfg, config, PRESETS[records])
    report = memory_report(config, max_model_len, num_tokens, packed_layout=True)
    blocks = {g.group_id: g.max_blocks_per_request for g in report.groups}

    def largest(kind):
        rates = [
            (blocks[lp.group] * lp.states, lp.states) for lp in layout.layers if lp.kind == kind
        ]
        return max(rates, default=(0, 0))

    index = (0, 0) if PRESETS[records].record("index") in SCALED_RECORDS else largest("index")
    comp = largest("compressed")
    return KVReads(*index, *comp, picks=num_tokens * cfg.index_topk)


@functools.cache
def _experts_quantised(cfg: ModelConfig) -> bool:
    """Whether the checkpoint stores the routed experts in a quantised format."""
    return any(
        name.endswith("ffn.experts.w1.weight") and spec.storage in _QUANTISED
        for name, spec in param_specs(cfg).items()
    )


def activation_bytes(
    cfg: ModelConfig,
    mesh: MeshAxes,
    *,
    num_tokens: int,
    num_requests: int,
    released_weights: bool = True,
    reads: KVReads = KVReads(),
    seqs: int = 0,
    platform: str = "tpu",
) -> dict[str, int]:
    """The step's peak activation estimate per chip, by term (formulas in the module
    docstring); ``peak = residual + max(attention + index_keys + selected_entries, moe +
    dequantised_experts) + logits``. ``released_weights``: the weights stay in their released
    formats on the device; ``reads`` (`kv_reads`) and ``seqs`` (requests per data shard): what
    the attention decodes; ``platform``: docs/planner.md#activation-terms."""
    t, b, m, e = num_tokens, ACT_BYTES, mesh.model, mesh.expert
    index_keys = reads.index_entries(seqs) * cfg.index_head_dim * b
    selected = reads.selected_entries(seqs) * cfg.head_dim * b
    residual = 2 * t * cfg.hc_mult * cfg.dim * b
    attention = t * (2 * cfg.n_heads * cfg.head_dim + cfg.index_n_heads * cfg.index_head_dim)
    attention = attention * b // m
    routed = -(-t * cfg.n_activated_experts // e) * (3 * cfg.moe_inter_dim + 2 * cfg.dim) * b
    moe = routed + 3 * t * cfg.moe_inter_dim * cfg.n_shared_experts * b // m
    # the expert dispatch dequantises a device's experts whole; one device alone, the selected
    # experts (a few tokens) or all of them (`dsv4.layers.moe`'s branches)
    quantised = _experts_quantised(cfg)
    n_experts = cfg.n_routed_experts
    read = n_experts // e if e > 1 else min(t * cfg.n_activated_experts, n_experts)
    dequantised = (
        3 * read * cfg.moe_inter_dim * cfg.dim * b if released_weights and quantised else 0
    )
    # XLA:GPU's ragged_dot: each local expert's masked copy of the rows a device receives
    # (T k / model: its T / (expert model) tokens' k picks from each of the expert ranks)
    dense_dispatch = 0
    if platform == "gpu" and e > 1:
        rows = -(-t * cfg.n_activated_experts // m)
        dense_dispatch = rows * (n_experts // e) * cfg.dim * b
    logits = num_requests * cfg.vocab_size * LOGIT_BYTES
    logits = logits // m + (logits if m > 1 else 0)
    out = {
        "residual": residual,
        "attention": attention,
        "index_keys": index_keys,
        "selected_entries": selected,
        "moe": moe,
        "dequantised_experts": dequantised,
        "dense_dispatch": dense_dispatch,
        "logits": logits,
    }
    kv = attention + index_keys + selected
    out["peak"] = residual + max(kv, moe + dequantised + dense_dispatch) + logits
    return out


# -- the plan ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ChipPlan:
    """Per-chip bytes of one slice, mesh and serving size (all ints are bytes per chip).

    Fields:
        weights / weights_bf16: device weight bytes, stored formats / dequantised.
        host_bytes: Engram tables on the host. kv_groups: KV bytes per group.
        kv_null_block: the pool's null block. activations: `activation_bytes`'s terms.
        total: weights + KV + null block + peak activations. budget: HBM x (1 - headroom).
        largest: ``(context, most requests that fit)`` per context of `CONTEXTS` (0: none).
    """

    slice: SliceSpec
    mesh: MeshAxes
    records: str
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    headroom: float
    weights: int
    weights_bf16: int
    host_bytes: int
    kv_groups: dict[str, int]
    kv_null_block: int
    activations: dict[str, int]
    total: int
    budget: int
    largest: tuple[tuple[int, int], ...]

    @property
    def kv(self) -> int:
        return sum(self.kv_groups.values()) + self.kv_null_block

    @property
    def fits(self) -> bool:
        return self.total <= self.budget

    def as_dict(self) -> dict:
        """JSON-ready figures."""
        return {
            "chips": self.slice.name,
            "device": self.slice.chip.device,
            "num_chips": self.slice.num_chips,
            "hbm_bytes": self.slice.chip.hbm_bytes,
            "mesh": dataclasses.asdict(self.mesh),
            "records": self.records,
            "max_num_seqs": self.max_num_seqs,
            "max_model_len": self.max_model_len,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "headroom": self.headroom,
            "weights_bytes": self.weights,
            "weights_bf16_bytes": self.weights_bf16,
            "host_bytes": self.host_bytes,
            "kv_bytes": self.kv,
            "kv_group_bytes": dict(self.kv_groups),
            "kv_null_block_bytes": self.kv_null_block,
            "activation_bytes": dict(self.activations),
            "total_bytes": self.total,
            "budget_bytes": self.budget,
            "fits": self.fits,
            "largest_num_seqs": {str(c): n for c, n in self.largest},
        }


def _seqs_per_shard(num_seqs: int, mesh: MeshAxes) -> int:
    return -(-num_seqs // mesh.data)


# over 60 lines: its checks and searches are named steps; the rest fills ChipPlan's 16 fields
def plan(
    cfg: ModelConfig,
    slice_: SliceSpec,
    *,
    mesh: MeshAxes | None = None,
    max_num_seqs: int = 64,
    max_model_len: int = 131_072,
    max_num_batched_tokens: int = 2048,
    records: str | None = None,
    headroom: float = 0.1,
    contexts: Sequence[int] = CONTEXTS,
) -> ChipPlan:
    """Per-chip bytes of serving ``cfg`` on ``slice_`` (module docstring).

    Raises:
        ValueError: a mesh of another chip count than the slice, or one that does not divide
            a tensor, an unknown record preset, or a bad size; the message names the value.
    """
    _check_plan_sizes(cfg, max_num_seqs, max_model_len, max_num_batched_tokens, headroom)
    contexts = tuple(c for c in contexts if c <= cfg.max_seq_len)
    if mesh is None:
        mesh = default_mesh(
            cfg,
            slice_,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            records=records,
            headroom=headroom,
        )
    _check_plan_mesh(mesh, slice_)
    config = kv_layout(cfg, slice_.chip, records)
    weights = weight_bytes_per_chip(cfg, mesh)
    weights_bf16 = weight_bytes_per_chip(cfg, mesh, stored=False)["device"]
    seqs = _seqs_per_shard(max_num_seqs, mesh)
    per_req = kv_group_bytes_per_request(config, max_model_len, max_num_batched_tokens)
    kv_groups = {g: seqs * b for g, b in per_req.items()}
    null = _block_bytes(config)
    records = records or slice_.chip.records
    reads = kv_reads(cfg, config, records, max_model_len, max_num_batched_tokens)
    acts = _shard_activations(cfg, mesh, reads, seqs, max_num_batched_tokens, slice_.chip.platform)
    budget = int(slice_.chip.hbm_bytes * (1 - headroom))
    tokens = max_num_batched_tokens
    platform, device = slice_.chip.platform, weights["device"]
    largest = tuple(
        (c, _largest_seqs(cfg, mesh, config, records, platform, device, c, tokens, budget))
        for c in contexts
    )
    return ChipPlan(
        slice=slice_,
        mesh=mesh,
        records=records,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        headroom=headroom,
        weights=weights["device"],
        weights_bf16=weights_bf16,
        host_bytes=weights["host"],
        kv_groups=kv_groups,
        kv_null_block=null,
        activations=acts,
        total=weights["device"] + sum(kv_groups.values()) + null + acts["peak"],
        budget=budget,
        largest=largest,
    )


def _check_plan_mesh(mesh: MeshAxes, slice_: SliceSpec) -> None:
    if mesh.num_chips != slice_.num_chips:
        raise ValueError(
            f"--mesh {mesh} needs {mesh.num_chips} chips; the slice {slice_.name} has "
            f"{slice_.num_chips}"
        )


def _check_plan_sizes(
    cfg: ModelConfig,
    max_num_seqs: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    headroom: float,
) -> None:
    """`plan`'s sizes: each at least 1, the headroom in [0, 1), the length within the model's."""
    for flag, value in (
        ("max_num_seqs", max_num_seqs),
        ("max_model_len", max_model_len),
        ("max_num_batched_tokens", max_num_batched_tokens),
    ):
        if value < 1:
            raise ValueError(f"{flag}={value} must be >= 1")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom={headroom} must be in [0, 1)")
    if max_model_len > cfg.max_seq_len:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's max_seq_len={cfg.max_seq_len}"
        )


def _shard_activations(
    cfg: ModelConfig, mesh: MeshAxes, reads: KVReads, seqs: int, num_tokens: int, platform: str
) -> dict[str, int]:
    """`activation_bytes` of a step of ``num_tokens`` tokens over ``seqs`` requests a shard."""
    return activation_bytes(
        cfg,
        mesh,
        num_tokens=num_tokens,
        num_requests=min(seqs, num_tokens),
        reads=reads,
        seqs=seqs,
        platform=platform,
    )


def _largest_seqs(
    cfg: ModelConfig,
    mesh: MeshAxes,
    config: KVCacheConfig,
    records: str,
    platform: str,
    weights: int,
    context: int,
    max_num_batched_tokens: int,
    budget: int,
) -> int:
    """Most requests of ``context`` tokens the slice holds (a multiple of ``data``). Logit
    rows grow with the requests up to the token budget: the figure is exact for any request
    count, searched by bisection (the total only grows with it)."""
    per_req = sum(kv_group_bytes_per_request(config, context, max_num_batched_tokens).values())
    null = _block_bytes(config)
    reads = kv_reads(cfg, config, records, context, max_num_batched_tokens)

    def total(seqs: int) -> int:
        acts = _shard_activations(cfg, mesh, reads, seqs, max_num_batched_tokens, platform)
        return weights + null + seqs * per_req + acts["peak"]

    if total(1) > budget:
        return 0
    lo, hi = 1, max(1, budget // max(1, per_req)) + 1  # total(hi) > budget
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if total(mid) <= budget else (lo, mid)
    return lo * mesh.data


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def default_mesh(
    cfg: ModelConfig,
    slice_: SliceSpec,
    *,
    max_model_len: int = 131_072,
    max_num_batched_tokens: int = 2048,
    records: str | None = None,
    headroom: float = 0.1,
) -> MeshAxes:
    """The factorisation ``data x expert x model`` of the slice's chips that holds the most
    ``max_model_len`` requests (then the fewest weight bytes per chip, then the smallest
    ``model``: fewer all-reduces); meshes some tensor does not divide are skipped."""
    n = slice_.num_chips
    config = kv_layout(cfg, slice_.chip, records)
    budget = int(slice_.chip.hbm_bytes * (1 - headroom))
    best, best_key = None, None
    for model in _divisors(n):
        for expert in _divisors(n // model):
            mesh = MeshAxes(data=n // (model * expert), expert=expert, model=model)
            try:
                weights = weight_bytes_per_chip(cfg, mesh)["device"]
            except ValueError:
                continue
            seqs = _largest_seqs(
                cfg,
                mesh,
                config,
                records or slice_.chip.records,
                slice_.chip.platform,
                weights,
                max_model_len,
                max_num_batched_tokens,
                budget,
            )
            key = (-seqs, weights, model)
            if best_key is None or key < best_key:
                best, best_key = mesh, key
    if best is None:
        raise ValueError(f"no data x expert x model mesh of {n} chips divides the model's tensors")
    return best


# -- collectives -------------------------------------------------------------------------------


def collective_bytes_per_decode_step(
    cfg: ModelConfig, mesh: MeshAxes, *, num_seqs: int, context: int
) -> dict[str, int]:
    """Bytes one chip sends in one decode step (one token per request), by collective: the
    attention, shared-expert, indexer and embedding all-reduces over ``model``, the logits
    all-gather, and the experts' all-to-all and all-gather over ``expert`` (formulas in
    docs/planner.md#collectives-per-decode-step). The DSpark drafter's stages are not counted.
    """
    t, d, b, m, e = _seqs_per_shard(num_seqs, mesh), cfg.dim, ACT_BYTES, mesh.model, mesh.expert

    def allreduce(size: int, a: int) -> int:
        return 2 * (a - 1) * size // a

    def allgather(size: int, a: int) -> int:
        return (a - 1) * size // a

    layers = cfg.n_layers
    index_rows = sum(context // cfg.ratio(layer) for layer in cfg.index_source_layers)
    out = {
        "attention_allreduce": layers * allreduce(t * d * b, m),
        "shared_expert_allreduce": layers * allreduce(t * d * b, m),
        "indexer_allreduce": allreduce(t * index_rows * 4, m),
        "embed_allreduce": allreduce(t * d * b, m),
        "logits_allgather": allgather(t * cfg.vocab_size * LOGIT_BYTES, m),
        "expert_all_to_all": layers
        * 2
        * (-(-t // e))
        * cfg.n_activated_experts
        * d
        * b
        * (e - 1)
        // e,
        "expert_allgather": layers * allgather(t * d * b, e),
    }
    out["total"] = sum(out.values())
    return out


# -- XLA's figures (deviceless compile) --------------------------------------------------------


def tpu_topology(slice_: SliceSpec) -> str:
    """libtpu's compile-only topology name of a TPU slice: ``v5e:2x4`` for 8 v5e chips,
    ``v5p:2x2x2`` for 8 v5p chips (shapes doubled one dim at a time, smallest dim first).

    Raises:
        ValueError: a GPU slice, or a chip count that is not a power of two >= 4.
    """
    chip, n = slice_.chip, slice_.num_chips
    if chip.name not in ("v5e", "v6e", "v5p"):
        raise ValueError(f"{slice_.name}: no deviceless compile (libtpu compiles TPU slices only)")
    if n < 4 or n & (n - 1):
        raise ValueError(
            f"{slice_.name}: {n} chips; a compile-only topology here is a power of 2 >= 4"
        )
    dims = [1, 1, 1] if chip.name == "v5p" else [1, 1]
    while math.prod(dims) < n:
        dims[dims.index(min(dims))] *= 2
    return f"{chip.name}:{'x'.join(map(str, sorted(dims)))}"


def reduced_flash(**overrides) -> ModelConfig:
    """V4.1-Flash at its released widths (384 experts) with 6 layers, every attention role:
    two window-only layers, a full and a reuse layer of ratio 2, a full and a reindex layer of
    ratio 1; no Engram, no DSpark drafter. What `compiled_memory` compiles in place of the
    40-layer model (whose compile takes far longer on a CPU)."""
    layers = dict(
        n_layers=6,
        compress_ratios=(0, 0, 2, 2, 1, 1),
        kv_source_layers=(2, 4),
        index_source_layers=(2, 4, 5),
        candidate_source_layer=4,
    )
    return flash_layers(layers, overrides)


def flash_layers(layers: Mapping[str, Any], overrides: Mapping[str, Any]) -> ModelConfig:
    """V4.1-Flash at its released widths with ``layers`` (its layer-plan fields) in place of its
    40, no Engram, no DSpark drafter; ``overrides`` win. The reduced models compiled in place of
    the whole one (`reduced_flash`, `planner.compiled_step.reduced_flash_roles`) are made by it."""
    fields = dict(n_mtp_layers=0, dspark_block_size=0, engram_layer_ids=())
    return v41_flash(**{**fields, **layers, **overrides})


def compiled_memory(
    cfg: ModelConfig, mesh: MeshAxes, *, topology: str, num_tokens: int = 8
) -> dict:
    """XLA's per-device memory of ``reference.forward(params, cfg, tokens[data, num_tokens])``
    compiled for the TPU ``topology`` (no device), params sharded by the rule table over
    ``mesh``, next to the planner's bf16 weight bytes of the same model and mesh."""
    devices = topologies.get_topology_desc(topology, platform="tpu").devices
    if len(devices) != mesh.num_chips:
        raise ValueError(
            f"mesh {mesh} needs {mesh.num_chips} chips; the topology {topology} has {len(devices)}"
        )
    grid = np.asarray(devices, dtype=object).reshape(mesh.data, mesh.expert, mesh.model)
    jmesh = Mesh(grid, sharding.AXES)
    specs = sharding.param_partition_specs(cfg, jmesh)
    params = {
        name: jax.ShapeDtypeStruct(
            ps.shape,
            jnp.float32 if ps.storage is Storage.F32 else jnp.bfloat16,
            sharding=NamedSharding(jmesh, specs[name]),
        )
        for name, ps in param_specs(cfg).items()
        if ps.storage is not Storage.DERIVED
    }
    tokens = jax.ShapeDtypeStruct(
        (mesh.data, num_tokens), jnp.int32, sharding=NamedSharding(jmesh, PartitionSpec("data"))
    )
    t0 = time.perf_counter()
    fwd = jax.jit(reference.forward, static_argnums=1)
    stats = fwd.trace(params, cfg, tokens).lower().compile().memory_analysis()
    planner = weight_bytes_per_chip(cfg, mesh, stored=False)["device"]
    token_bytes = num_tokens * 4
    return {
        "topology": topology,
        "device_kind": devices[0].device_kind,
        "mesh": {"data": mesh.data, "expert": mesh.expert, "model": mesh.model},
        "model": f"{cfg.n_layers} layers, {cfg.n_routed_experts} experts, dim {cfg.dim}",
        "argument_size_in_bytes": stats.argument_size_in_bytes,
        "output_size_in_bytes": stats.output_size_in_bytes,
        "temp_size_in_bytes": stats.temp_size_in_bytes,
        "token_bytes": token_bytes,
        "planner_weights_bf16_bytes": planner,
        "weights_ratio": round((stats.argument_size_in_bytes - token_bytes) / planner, 6),
        "compile_s": round(time.perf_counter() - t0, 2),
    }


def compiled_check(cfg: ModelConfig, p: ChipPlan) -> dict:
    """`compiled_memory` of ``cfg`` on the plan's slice (its `tpu_topology`) and mesh, or
    ``{"skipped": why}``: a GPU slice or a chip count without a topology, or no libtpu."""
    try:
        topology = tpu_topology(p.slice)
    except ValueError as exc:
        return {"skipped": str(exc)}
    if importlib.util.find_spec("libtpu") is None:
        return {"skipped": "libtpu not installed (pip install -e '.[aot]')"}
    return compiled_memory(cfg, p.mesh, topology=topology)


def describe_compiled(got: dict) -> str:
    """One line of `compiled_check`'s figures (what ``dsv4 plan --compiled`` adds)."""
    if "skipped" in got:
        return f"  compiled      skipped: {got['skipped']}"
    return (
        f"  compiled      reference.forward of the {got['model']} model on libtpu's "
        f"{got['topology']} (no device): {got['argument_size_in_bytes'] / GiB:.2f} GiB of "
        f"arguments per device = {got['weights_ratio']} x the planner's bf16 weights of that "
        f"model ({got['planner_weights_bf16_bytes'] / GiB:.2f} GiB); temporaries "
        f"{got['temp_size_in_bytes'] / GiB:.2f} GiB (the reference's dense math)"
    )


# -- the planner table (docs/planner.md) -----------------------------------------------------------


def describe(p: ChipPlan, model: str) -> str:
    """The plan in words, one figure a line (what ``dsv4 plan`` prints)."""
    chip = p.slice.chip
    per_shard = _seqs_per_shard(p.max_num_seqs, p.mesh)
    lines = [
        f"{model} on {p.slice.name}: {p.slice.num_chips} x {chip.device} "
        f"({chip.hbm_bytes / GiB:.1f} GiB HBM each), mesh {p.mesh}; KV records {p.records}",
        f"per chip, for {p.max_num_seqs} requests of {p.max_model_len:,} tokens "
        f"({per_shard} per data shard), {p.max_num_batched_tokens} tokens per step:",
        f"  weights       {_size(p.weights):>10} released formats "
        f"({_size(p.weights_bf16)} dequantised to bf16); host: "
        f"{_size(p.host_bytes)} of Engram tables",
    ]
    for group, n in p.kv_groups.items():
        lines.append(f"  KV {group:<36} {_size(n):>10}")
    lines.append(f"  KV null block {'':<25} {_size(p.kv_null_block):>10}")
    acts = ", ".join(f"{k} {_size(v)}" for k, v in p.activations.items() if k != "peak")
    lines.append(f"  activations   {_size(p.activations['peak']):>10} peak ({acts})")
    verdict = "fits" if p.fits else "does NOT fit"
    lines.append(
        f"  total         {_size(p.total):>10} of {_size(p.budget)} "
        f"(HBM less {p.headroom:.0%} headroom): {verdict}"
    )
    most = ", ".join(f"{_ctx(c)} tokens: {n:,}" for c, n in p.largest)
    lines.append(f"most requests that fit, by context length: {most}")
    return "\n".join(lines)


def _size(n: int) -> str:
    """Bytes in GiB, MiB or KiB, whichever shows them with a leading digit."""
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} B"


def _gib(n: int) -> str:
    return f"{n / GiB:.1f}"


def markdown_table(plans: Sequence[ChipPlan]) -> str:
    """One row per plan: slice, mesh, HBM, weights (stored / bf16), KV per request at the
    plan's ``max_model_len``, peak activations, and the largest batch per context."""
    contexts = [c for c, _ in plans[0].largest]
    ctx_cols = " | ".join(f"max seqs @ {_ctx(c)}" for c in contexts)
    head = (
        "| slice | chips | mesh (data, expert, model) | HBM GiB/chip | weights GiB/chip "
        f"(released) | weights GiB/chip (bf16) | KV MiB/request @ {_ctx(plans[0].max_model_len)}"
        f" | activations GiB | {ctx_cols} |"
    )
    sep = "|" + "---|" * (head.count("|") - 1)
    rows = [head, sep]
    for p in plans:
        per_req = sum(p.kv_groups.values()) / _seqs_per_shard(p.max_num_seqs, p.mesh)
        cells = [
            p.slice.name,
            str(p.slice.num_chips),
            f"{p.mesh.data}, {p.mesh.expert}, {p.mesh.model}",
            _gib(p.slice.chip.hbm_bytes),
            _gib(p.weights),
            _gib(p.weights_bf16),
            f"{per_req / 2**20:,.0f}",
            _gib(p.activations["peak"]),
            *(f"{n:,}" for _, n in p.largest),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _ctx(n: int) -> str:
    return f"{n // 1_048_576}M" if n % 1_048_576 == 0 else f"{n // 1024}K"


def stored_bytes_total(cfg: ModelConfig) -> int:
    """Bytes of every checkpoint tensor (the 1-chip plan's device + host weights)."""
    return sum(math.prod(t.shape) * DTYPE_BYTES[t.dtype] for t in checkpoint_tensors(cfg))
