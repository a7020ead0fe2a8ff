"""Lab experiments: knobs -> a V4.1 cache layout -> the real scheduler and allocator over a
workload -> one row of results; sweeps over any knob.

`LabConfig` holds and validates every knob, `build_layout` makes the allocator's `KVCacheConfig`,
`run` replays and meters a workload, `sweep` runs a grid. Details: docs/lab.md#labexperiment.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import multiprocessing
import operator
import random
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from cache import KVCacheManager
from cache.layout import (
    ModelCacheDesc,
    blocks_per_request,
    for_model,
    memory_report,
    tiny_v41_desc,
    v41_flash_desc,
)
from cache.spec import KVCacheConfig
from lab.cost import CHIPS, MODELS, step_cost
from lab.drive import DriveResult, EngineBackend, ModelFreeBackend, drive
from lab.workloads import Turn, Workload
from serving.config import SchedulerConfig
from serving.scheduler import Scheduler, SchedulerOutput

__all__ = [
    "KNOBS",
    "LAYOUTS",
    "RECORDS",
    "LabConfig",
    "LabError",
    "build_layout",
    "check_fits",
    "make_manager",
    "make_scheduler",
    "min_pool_blocks",
    "parse_sweep",
    "parse_value",
    "run",
    "run_engine",
    "shortest_hit_prompt",
    "sweep",
]


class LabError(ValueError):
    """A knob, layout or sweep the lab cannot run; the message names it."""


# ---------------------------------------------------------------------------------------------
# Record formats: bytes per stored record of a dim (the formats of dsv4.paged.records, restated
# without JAX; tests check both agree).
# ---------------------------------------------------------------------------------------------


def _record_bytes(fmt: str, dim: int) -> int:
    tiles = {"mxfp8": 32, "nvfp4": 16, "mxfp4": 32}
    if fmt in tiles and dim % tiles[fmt]:
        raise LabError(
            f"record format {fmt!r} needs a dim that is a multiple of {tiles[fmt]}, got {dim}"
        )
    if fmt == "f32":
        return 4 * dim
    if fmt == "bf16":
        return 2 * dim
    if fmt == "mxfp8":
        return dim + dim // 32
    if fmt == "nvfp4":
        return dim // 2 + dim // 16
    if fmt == "mxfp4":
        return dim // 2 + dim // 32
    if fmt == "fp8_132":
        return dim + 4
    if fmt == "v4_584":
        nope = dim - 64
        if nope <= 0 or nope % 64:
            raise LabError(
                f"record format 'v4_584' needs 64 rope dims after a multiple of 64, got {dim}"
            )
        return nope + 128 + -(-(nope // 64) // 8) * 8
    raise LabError(f"unknown record format {fmt!r}")


@dataclass(frozen=True, slots=True)
class RecordPreset:
    """Window / compressed / index-key formats, page alignment and raw tokens per block."""

    window: str
    compressed: str
    index: str
    alignment: int | None = None
    block_size: int | None = None  # None: the model's default


RECORDS = {
    "exact": RecordPreset("f32", "f32", "f32"),
    "bf16": RecordPreset("bf16", "bf16", "bf16"),
    "released": RecordPreset("mxfp8", "nvfp4", "mxfp4"),
    "released_fp8": RecordPreset("mxfp8", "mxfp8", "fp8_132"),
    "sm90": RecordPreset("v4_584", "v4_584", "fp8_132", alignment=576, block_size=64),
    "sm100": RecordPreset("mxfp8", "mxfp8", "fp8_132", alignment=512, block_size=128),
}

# model name -> (layer-plan description, head_dim, index_head_dim)
_MODELS = {
    "v41_flash": (v41_flash_desc, 512, 128),
    "tiny_v41": (tiny_v41_desc, 64, 32),
}

# Named layouts: knob values a layout sets (explicit knobs of a LabConfig win).
LAYOUTS: dict[str, dict[str, Any]] = {
    # V4.1 as vLLM 0.32 serves it: SWA bounded replay on.
    "v41": {"bounded_replay": True},
    # exact window caches: windows are prefix-cached at the retention points
    "v41_noreplay": {"bounded_replay": False},
    # exact windows kept at every aligned boundary (dense retention)
    "v41_dense_retention": {"bounded_replay": False, "retention_interval": None},
    # Blackwell records and 128-token blocks
    "v41_sm100": {"bounded_replay": True, "records": "sm100"},
}


# ---------------------------------------------------------------------------------------------
# Knobs
# ---------------------------------------------------------------------------------------------

_UNSET: Any = "unset"
# knobs a layout may set, with their values when it does not
_LAYOUT_DEFAULTS = {"records": "sm90", "bounded_replay": False, "retention_interval": 0}


@dataclass(frozen=True, slots=True, kw_only=True)
class LabConfig:
    """Every knob of a lab run (`KNOBS` lists them with their allowed values).

    Layout, pool, allocator, scheduler and cost-model knobs; ``layout`` (a `LAYOUTS` name) sets the
    defaults of the layout knobs. Each knob: docs/lab.md#labexperimentlabconfig.
    """

    layout: str = "v41"
    model: str = "v41_flash"
    compress_ratios: tuple[int, ...] | None = None
    kv_sources: tuple[int, ...] | None = None
    index_sources: tuple[int, ...] | None = None
    window: int | None = None
    records: str = _UNSET
    swa_record_bytes: int | None = None
    compressed_record_bytes: int | None = None
    indexer_key_bytes: int | None = None
    block_size: int | None = None
    swa_block_size: int | None = None
    pool_blocks: int | None = None
    memory_gib: float | None = None
    pools: str = "aliased"
    bounded_replay: bool = _UNSET
    retention_interval: int | None = _UNSET
    enable_prefix_caching: bool = True
    lookahead: int = 0
    num_speculative_tokens: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 16384
    async_scheduling: bool = False
    chip: str = "H200"
    num_chips: int = 8
    # the layout-dependent knobs given explicitly (they win over a new layout in `replace`)
    _given: frozenset[str] = dataclasses.field(default=frozenset(), repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise LabError(f"knob layout={self.layout!r}: allowed one of {sorted(LAYOUTS)}")
        given = set(self._given)
        for name, value in _LAYOUT_DEFAULTS.items():
            if getattr(self, name) is _UNSET:
                object.__setattr__(self, name, LAYOUTS[self.layout].get(name, value))
            else:
                given.add(name)
        object.__setattr__(self, "_given", frozenset(given))
        for name in ("compress_ratios", "kv_sources", "index_sources"):
            value = getattr(self, name)
            if value is not None:
                if isinstance(value, str):
                    value = tuple(int(v) for v in value.split(",") if v.strip())
                object.__setattr__(self, name, tuple(value))
        for name, value in self.as_dict().items():
            _check_knob(name, value)
        if (self.pool_blocks is None) == (self.memory_gib is None):
            raise LabError(
                f"give exactly one of pool_blocks / memory_gib (got pool_blocks={self.pool_blocks}, "
                f"memory_gib={self.memory_gib})"
            )

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name[0] != "_"}

    def replace(self, **knobs: Any) -> LabConfig:
        """A copy with ``knobs`` changed; a new ``layout`` brings its own values for the
        knobs it sets, except those given explicitly (here or when this config was made)."""
        unknown = sorted(set(knobs) - set(KNOBS))
        if unknown:
            raise LabError(f"unknown knob {unknown[0]!r}; known: {sorted(KNOBS)}")
        values = self.as_dict()
        values.update(knobs)
        values["_given"] = self._given
        if "layout" in knobs:
            for name in _LAYOUT_DEFAULTS:
                if name not in knobs and name not in self._given:
                    values[name] = _UNSET
        if "memory_gib" in knobs and "pool_blocks" not in knobs:
            values["pool_blocks"] = None
        if "pool_blocks" in knobs and "memory_gib" not in knobs:
            values["memory_gib"] = None
        return LabConfig(**values)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# knob -> (description of what is allowed, check)
KNOBS: dict[str, tuple[str, Any]] = {
    "layout": (f"one of {sorted(LAYOUTS)}", lambda v: v in LAYOUTS),
    "model": (f"one of {sorted(_MODELS)}", lambda v: v in _MODELS),
    "compress_ratios": (
        "None or ratios in {0, 1, 2}",
        lambda v: v is None or all(r in (0, 1, 2) for r in v),
    ),
    "kv_sources": (
        "None or layer ids >= 0",
        lambda v: v is None or all(_is_int(x) and x >= 0 for x in v),
    ),
    "index_sources": (
        "None or layer ids >= 0",
        lambda v: v is None or all(_is_int(x) and x >= 0 for x in v),
    ),
    "window": ("None or an int >= 1", lambda v: v is None or (_is_int(v) and v >= 1)),
    "records": (f"one of {sorted(RECORDS)}", lambda v: v in RECORDS),
    "swa_record_bytes": ("None or an int >= 1", lambda v: v is None or (_is_int(v) and v >= 1)),
    "compressed_record_bytes": (
        "None or an int >= 1",
        lambda v: v is None or (_is_int(v) and v >= 1),
    ),
    "indexer_key_bytes": ("None or an int >= 1", lambda v: v is None or (_is_int(v) and v >= 1)),
    "block_size": ("None or an int >= 1", lambda v: v is None or (_is_int(v) and v >= 1)),
    "swa_block_size": ("None or an int >= 1", lambda v: v is None or (_is_int(v) and v >= 1)),
    "pool_blocks": ("None or an int >= 2", lambda v: v is None or (_is_int(v) and v >= 2)),
    "memory_gib": (
        "None or a number > 0",
        lambda v: v is None or (isinstance(v, int | float) and not isinstance(v, bool) and v > 0),
    ),
    "pools": ("'aliased' or 'separate'", lambda v: v in ("aliased", "separate")),
    "bounded_replay": ("True or False", lambda v: isinstance(v, bool)),
    "retention_interval": ("None or an int >= 0", lambda v: v is None or (_is_int(v) and v >= 0)),
    "enable_prefix_caching": ("True or False", lambda v: isinstance(v, bool)),
    "lookahead": ("an int >= 0", lambda v: _is_int(v) and v >= 0),
    "num_speculative_tokens": ("an int >= 0", lambda v: _is_int(v) and v >= 0),
    "max_num_seqs": ("an int >= 1", lambda v: _is_int(v) and v >= 1),
    "max_num_batched_tokens": ("an int >= 1", lambda v: _is_int(v) and v >= 1),
    "max_model_len": ("an int >= 2", lambda v: _is_int(v) and v >= 2),
    "async_scheduling": ("True or False", lambda v: isinstance(v, bool)),
    "chip": (f"one of {sorted(CHIPS)}", lambda v: v in CHIPS),
    "num_chips": ("an int >= 1", lambda v: _is_int(v) and v >= 1),
}


def _check_knob(name: str, value: Any) -> None:
    allowed, check = KNOBS[name]
    try:
        ok = check(value)
    except TypeError:
        ok = False
    if not ok:
        raise LabError(f"knob {name}={value!r}: allowed {allowed}")


_LIST_KNOBS = ("compress_ratios", "kv_sources", "index_sources")


def parse_value(name: str, text: str) -> Any:
    """A knob value from the command line (``None``, ``true`` / ``false``, ints, floats,
    comma lists for the layer-plan knobs, names)."""
    if name not in KNOBS:
        raise LabError(f"unknown knob {name!r}; known: {sorted(KNOBS)}")
    t = text.strip()
    if t.lower() == "none":
        return None
    if t.lower() in ("true", "false"):
        return t.lower() == "true"
    if name in _LIST_KNOBS:
        try:
            return tuple(int(v) for v in t.split(",") if v.strip())
        except ValueError:
            raise LabError(f"knob {name}={text!r}: allowed comma-separated ints") from None
    for cast in (int, float):
        try:
            return cast(t)
        except ValueError:
            pass
    return t


def parse_sweep(spec: str) -> tuple[str, list[Any]]:
    """``knob=lo:hi:step`` (inclusive integer range) or ``knob=a,b,c`` -> (knob, values);
    a layer-list knob takes plans separated by ``;`` (``kv_sources=2,8;2,8,14``)."""
    if "=" not in spec:
        raise LabError(f"sweep {spec!r}: expected knob=lo:hi:step or knob=a,b,c")
    name, _, rest = spec.partition("=")
    name = name.strip()
    if name not in KNOBS:
        raise LabError(f"sweep {spec!r}: unknown knob {name!r}; known: {sorted(KNOBS)}")
    if name in _LIST_KNOBS:  # layer lists: "2,8;2,8,14" sweeps two plans
        values = [parse_value(name, v) for v in rest.split(";") if v.strip()]
    elif ":" in rest:
        parts = rest.split(":")
        try:
            lo, hi, step = (int(p) for p in parts) if len(parts) == 3 else (None, None, None)
        except ValueError:
            lo = None
        if lo is None or step <= 0 or hi < lo:
            raise LabError(f"sweep {spec!r}: a range is lo:hi:step with ints, step > 0, hi >= lo")
        values = list(range(lo, hi + 1, step))
    else:
        values = [parse_value(name, v) for v in rest.split(",") if v.strip()]
    if not values:
        raise LabError(f"sweep {spec!r}: no values")
    return name, values


# ---------------------------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------------------------


def model_desc(cfg: LabConfig) -> ModelCacheDesc:
    """The layer plan and record sizes of ``cfg`` (`cache.layout.ModelCacheDesc`)."""
    make, head_dim, index_dim = _MODELS[cfg.model]
    preset = RECORDS[cfg.records]
    fields: dict[str, Any] = {
        "swa_record_bytes": cfg.swa_record_bytes or _record_bytes(preset.window, head_dim),
        "compressed_record_bytes": cfg.compressed_record_bytes
        or _record_bytes(preset.compressed, head_dim),
        "indexer_key_bytes": cfg.indexer_key_bytes or _record_bytes(preset.index, index_dim),
        "page_alignment": preset.alignment,
        "indexer_page_alignment": preset.alignment,
        "swa_bounded_replay": cfg.bounded_replay,
        "num_speculative_tokens": cfg.num_speculative_tokens,
    }
    block_size = cfg.block_size or preset.block_size
    if block_size is not None:
        fields["block_size"] = block_size
    if cfg.swa_block_size is not None:
        fields["swa_block_size"] = cfg.swa_block_size
    if cfg.window is not None:
        fields["sliding_window"] = cfg.window
    base = make()
    if cfg.compress_ratios is not None:
        n = base.num_hidden_layers
        if len(cfg.compress_ratios) not in (n, base.num_layers):
            raise LabError(
                f"knob compress_ratios has {len(cfg.compress_ratios)} entries; the {cfg.model} "
                f"plan has {n} backbone layers ({base.num_layers} with draft layers)"
            )
        fields["compress_ratios"] = cfg.compress_ratios + (0,) * (
            base.num_layers - len(cfg.compress_ratios)
        )
    if cfg.kv_sources is not None:
        fields["kv_source_layer_ids"] = cfg.kv_sources
    if cfg.index_sources is not None:
        fields["index_source_layer_ids"] = cfg.index_sources
    try:
        return make(**fields)
    except ValueError as e:
        raise LabError(f"layout {cfg.layout!r} with these knobs cannot be built: {e}") from None


def _separate_bytes_per_block(config: KVCacheConfig, cfg: LabConfig) -> int:
    report = memory_report(
        config, cfg.max_model_len, cfg.max_num_batched_tokens, packed_layout=True
    )
    return sum(g.page_bytes for g in report.groups)


def build_layout(cfg: LabConfig) -> KVCacheConfig:
    """``cfg``'s `KVCacheConfig`: its groups, and ``pool_blocks`` blocks or as many as
    ``memory_gib`` holds at the chosen pool layout's cost per block.

    Raises:
        LabError: the layer plan or records cannot be grouped, or the budget holds no block.
    """
    desc = model_desc(cfg)
    try:
        if cfg.pool_blocks is not None:
            return for_model(desc, num_gpu_blocks_override=cfg.pool_blocks)
        budget = int(cfg.memory_gib * 2**30)
        if cfg.pools == "aliased":
            config = for_model(desc, available_memory_bytes=budget)
        else:
            probe = for_model(desc, num_gpu_blocks_override=2)
            blocks = budget // _separate_bytes_per_block(probe, cfg)
            config = for_model(desc, num_gpu_blocks_override=max(blocks, 1))
    except ValueError as e:
        raise LabError(f"layout {cfg.layout!r} with these knobs cannot be built: {e}") from None
    if config.num_blocks < 2:
        raise LabError(
            f"knob memory_gib={cfg.memory_gib}: holds {config.num_blocks} blocks; need >= 2"
        )
    return config


def bytes_per_block(config: KVCacheConfig, cfg: LabConfig) -> list[int]:
    """Bytes one block held by each group costs: the shared pool's stride (aliased) or the
    group's own page set (separate, where every layer has its own buffer)."""
    report = memory_report(
        config, cfg.max_model_len, cfg.max_num_batched_tokens, packed_layout=True
    )
    if cfg.pools == "aliased":
        return [report.pool_bytes_per_block] * len(report.groups)
    return [g.page_bytes for g in report.groups]


def min_pool_blocks(cfg: LabConfig, longest: int) -> int:
    """Blocks the pool needs (null block included) to hold one request of ``longest`` tokens
    in every group at once: below it the workload's longest request could never run."""
    config = for_model(model_desc(cfg), num_gpu_blocks_override=2)
    return 1 + sum(
        blocks_per_request(g, longest, cfg.max_num_batched_tokens) for g in config.kv_cache_groups
    )


def check_fits(workload: Workload, cfg: LabConfig, config: KVCacheConfig | None = None) -> None:
    """Raise a LabError naming the pool knob when the pool cannot hold the workload's longest
    request, or ``max_model_len`` when a turn is longer than the model allows."""
    longest = max(
        (
            len(workload.prompt(s, k)) + len(t.output)
            for s in workload.sessions
            for k, t in enumerate(s.turns)
        ),
        default=0,
    )
    if longest > cfg.max_model_len:
        raise LabError(
            f"knob max_model_len={cfg.max_model_len}: the workload's longest turn has {longest} "
            "tokens (prompt + output); allowed: max_model_len >= it"
        )
    config = build_layout(cfg) if config is None else config
    need = min_pool_blocks(cfg, longest)
    if config.num_blocks < need:
        knob = (
            f"pool_blocks={cfg.pool_blocks}"
            if cfg.pool_blocks is not None
            else f"memory_gib={cfg.memory_gib} ({config.num_blocks} blocks)"
        )
        raise LabError(
            f"knob {knob}: the workload's longest request ({longest} tokens) needs {need} blocks "
            f"on layout {cfg.layout!r}; allowed: at least {need}"
        )


def make_manager(config: KVCacheConfig, cfg: LabConfig) -> KVCacheManager:
    """The allocator a run of ``cfg`` uses over the layout ``config`` (`build_layout`)."""
    return KVCacheManager(
        config,
        cfg.max_model_len,
        enable_caching=cfg.enable_prefix_caching,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        prefix_cache_retention_interval=cfg.retention_interval,
        swa_bounded_replay=cfg.bounded_replay,
    )


def make_scheduler(manager: KVCacheManager, cfg: LabConfig) -> Scheduler:
    """The scheduler a run of ``cfg`` uses over ``manager`` (`make_manager`)."""
    return Scheduler(
        manager,
        SchedulerConfig(
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            async_scheduling=cfg.async_scheduling,
        ),
        max_model_len=cfg.max_model_len,
        num_lookahead_tokens=cfg.lookahead,
    )


_SHORTEST: dict[tuple, int | None] = {}


def shortest_hit_prompt(cfg: LabConfig, limit: int = 8192) -> int | None:
    """The shortest prompt that can ever get a prefix hit (vllm-ascend#16270): the least
    ``P`` such that a prompt of ``P`` tokens, sent again after it was computed and finished
    (one output token), is admitted with at least one hit token. Each probe runs through the
    lab's loop (the `Scheduler` over the real allocator, synchronous); None: no hit up to
    ``limit`` (e.g. prefix caching off)."""
    key = tuple((k, v) for k, v in cfg.as_dict().items() if k not in ("pool_blocks", "memory_gib"))
    if key in _SHORTEST:
        return _SHORTEST[key]
    probe = cfg.replace(
        pool_blocks=4096, max_model_len=max(cfg.max_model_len, limit + 2), async_scheduling=False
    )
    backend = ModelFreeBackend(make_scheduler(make_manager(build_layout(probe), probe), probe))
    rng = random.Random(0)
    found = None
    for length in range(2, limit + 1):
        prompt = [rng.randrange(1 << 30) for _ in range(length)]
        turn = Turn(user=tuple(prompt), output=(1,))
        for name in ("a", "b"):  # computed and finished, then sent again
            hits = backend.stats.prefix_hits
            backend.add(f"{name}{length}", prompt, turn)
            while backend.has_unfinished():
                backend.step()
        if backend.stats.prefix_hits > hits:
            found = length
            break
    _SHORTEST[key] = found
    return found


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------


class _Meter:
    """Per-step metering of a model-free run: KV blocks held per group, modelled step time,
    arrival and first-token times (hooks of `ModelFreeBackend` and `drive`)."""

    def __init__(self, cfg: LabConfig, manager: KVCacheManager, desc: ModelCacheDesc) -> None:
        self.cfg = cfg
        self.chip = CHIPS[cfg.chip]
        self.model = MODELS[cfg.model]
        self.ratios = desc.compress_ratios[: desc.num_hidden_layers]
        self.index_layers = tuple(desc.index_source_layer_ids)
        self.records = (desc.swa_record_bytes, desc.compressed_record_bytes, desc.indexer_key_bytes)
        self.group_managers = manager.coordinator.single_type_managers
        self.null_block = manager.block_pool.null_block
        self.block_pool = manager.block_pool
        # Per group: its block lists per request; whether its blocks can be shared (only
        # through prefix hits, so only in a prefix-cacheable group); for window kinds how
        # many trailing entries of a list usually hold all its live blocks (the window's
        # blocks and two more; 0: look at the whole list).
        self._groups = [
            (
                m.req_to_blocks,
                m.enable_caching and m.supports_prefix_caching and m.kv_cache_spec.prefix_cacheable,
                -(-m.skip_offset // m.block_size) + 2
                if m.skips_tokens and m.skip_offset is not None
                else 0,
            )
            for m in self.group_managers
        ]
        # Window groups that cannot share blocks and have the same kind, block size and
        # window get the same operations for every request (the allocator decides per group
        # only from these), so their lists always have equal lengths and null prefixes and
        # they hold equally many blocks: one of each such family is counted (`check_counts`
        # verifies it against sets).
        self._same_as: list[int | None] = []
        first: dict[tuple, int] = {}
        for g, (m, (_, cacheable, tail)) in enumerate(zip(self.group_managers, self._groups)):
            key = (type(m), m.block_size, m.skip_offset, m.max_admission_blocks_per_request)
            same = first.setdefault(key, g) if tail and not cacheable else g
            self._same_as.append(same if same != g else None)
        shared = [g for g, (_, cacheable, _) in enumerate(self._groups) if cacheable]
        # With one such group, its count is the pool's blocks in use less the others' (every
        # block a request holds is in exactly one group; `cache` tests check ref counts).
        self._by_difference = shared[0] if len(shared) == 1 else None
        self._count_null = operator.methodcaller("count", self.null_block)
        self.check_counts = False  # also count by sets and compare (tests)
        self.per_block = bytes_per_block(manager.kv_cache_config, cfg)
        self.peak_total_bytes = 0
        self.peak_blocks = [0] * len(self.group_managers)
        self.sum_blocks = [0] * len(self.group_managers)
        self.steps = 0
        self.clock = 0.0
        self.arrival: dict[str, float] = {}
        self.first_token: dict[str, float] = {}
        self.output_tokens = 0

    def on_add(self, request_id: str, num_prompt_tokens: int) -> None:
        self.arrival[request_id] = self.clock

    def on_schedule(self, output: SchedulerOutput) -> None:
        starts = {r.request_id: r.num_computed_tokens for r in output.scheduled_new_reqs}
        starts.update((r.request_id, r.num_computed_tokens) for r in output.scheduled_cached_reqs)
        work = [(n, starts[rid] + n) for rid, n in output.num_scheduled_tokens.items()]
        cost = step_cost(
            self.model,
            work,
            ratios=self.ratios,
            index_layers=self.index_layers,
            swa_record_bytes=self.records[0],
            compressed_record_bytes=self.records[1],
            indexer_key_bytes=self.records[2],
        )
        self.clock += cost.seconds(self.chip, self.cfg.num_chips)
        for request_id in output.sampling_req_ids:
            if request_id not in self.first_token:
                self.first_token[request_id] = self.clock
        self.output_tokens += len(output.sampling_req_ids)
        self.steps += 1
        total = 0
        held_blocks = self.held_blocks()
        if self.check_counts and held_blocks != self.held_blocks_by_sets():
            raise AssertionError(
                f"step {self.steps}: blocks held per group {held_blocks}, by sets "
                f"{self.held_blocks_by_sets()}"
            )
        for g, held in enumerate(held_blocks):
            total += held * self.per_block[g]
            self.sum_blocks[g] += held
            if held > self.peak_blocks[g]:
                self.peak_blocks[g] = held
        self.peak_total_bytes = max(self.peak_total_bytes, total)

    def held_blocks(self) -> list[int]:
        """Distinct blocks each group holds now (a prefix block shared by several requests
        counts once); the same counts as `held_blocks_by_sets`, without building sets where
        blocks cannot be shared."""
        null = self.null_block
        counts = []
        for (tables, cacheable, tail), same in zip(self._groups, self._same_as):
            if same is not None:
                counts.append(counts[same])
            elif cacheable:
                if self._by_difference is not None:
                    counts.append(0)  # filled in below
                    continue
                blocks: set = set().union(*tables.values())
                blocks.discard(null)
                counts.append(len(blocks))
            elif tail:
                # a window group's nulls form a prefix of each list: when the entry before
                # the last `tail` ones is null, those hold every live block
                n = 0
                for held in tables.values():
                    if len(held) > tail and held[-tail - 1] is null:
                        n += tail - held[-tail:].count(null)
                    else:
                        n += len(held) - held.count(null)
                counts.append(n)
            else:
                lists = tables.values()
                counts.append(sum(map(len, lists)) - sum(map(self._count_null, lists)))
        g = self._by_difference
        if g is not None:
            pool = self.block_pool
            in_use = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()
            counts[g] = in_use - sum(counts)
        return counts

    def held_blocks_by_sets(self) -> list[int]:
        """`held_blocks` by its definition: the set of each group's blocks."""
        counts = []
        for m in self.group_managers:
            blocks: set = set()
            for held in m.req_to_blocks.values():
                blocks.update(held)
            blocks.discard(self.null_block)
            counts.append(len(blocks))
        return counts


def run(workload: Workload, cfg: LabConfig, *, max_steps: int | None = None) -> dict[str, Any]:
    """Replay ``workload`` under ``cfg`` without the model; one row of results.

    Returns:
        A flat dict: the knobs, pool sizes, hit rates, recomputed tokens, preemptions, KV bytes per
        group, concurrency, the cost model's times and the lab's own speed; each field:
        docs/lab.md#labexperimentrun.
    """
    config = build_layout(cfg)
    check_fits(workload, cfg, config)
    desc = model_desc(cfg)
    manager = make_manager(config, cfg)
    scheduler = make_scheduler(manager, cfg)
    meter = _Meter(cfg, manager, desc)
    backend = ModelFreeBackend(scheduler, hooks=meter)
    t0 = time.perf_counter()
    result = drive(workload, backend, max_steps=max_steps, on_add=meter.on_add)
    wall = time.perf_counter() - t0
    return _row(workload, cfg, config, result, meter, wall)


def run_engine(workload: Workload, engine: Any, *, sampling: Any = None) -> dict[str, Any]:
    """Run ``workload`` through a `serving.Engine` (the model samples the outputs; each turn
    runs to its workload length) and return its counts in the lab's names, the measured wall
    time and ``trace`` (the workload with the engine's outputs: `run` on it with the engine's
    settings makes the same decisions)."""

    t0 = time.perf_counter()
    result = drive(workload, EngineBackend(engine, sampling))
    wall = time.perf_counter() - t0
    sched = result.scheduler
    stats = engine.stats
    return {
        "workload": workload.kind,
        "turns": workload.num_turns,
        "finished_turns": result.finished_turns,
        "prefix_queries": sched["prefix_queries"],
        "prefix_hits": sched["prefix_hits"],
        "prefix_hit_rate": result.prefix_hit_rate,
        "recomputed_tokens": sched["recomputed_tokens"],
        "replay_tokens": sched["replay_tokens"],
        "preemption_recomputed_tokens": sched["preemption_recomputed_tokens"],
        "preemptions": sched["preemptions"],
        "steps": sched["steps"],
        "scheduled_tokens": sched["scheduled_tokens"],
        "max_running": sched["max_scheduled_requests"],
        "wall_s": wall,
        "output_tokens_per_s": stats.generation_tokens_per_s,
        "trace": result.trace,
    }


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _row(
    workload: Workload,
    cfg: LabConfig,
    config: KVCacheConfig,
    result: DriveResult,
    meter: _Meter,
    wall: float,
) -> dict[str, Any]:
    """A run's row: its knobs, then its pool, decisions, memory and modelled times."""
    per_block = bytes_per_block(config, cfg)
    report = memory_report(
        config, cfg.max_model_len, cfg.max_num_batched_tokens, packed_layout=True
    )
    sched = result.scheduler
    pool_bytes = (
        config.num_blocks * per_block[0]
        if cfg.pools == "aliased"
        else config.num_blocks * sum(per_block)
    )
    return {
        "workload": workload.kind,
        **cfg.as_dict(),
        "num_blocks": config.num_blocks,
        "num_groups": len(config.kv_cache_groups),
        "group_kinds": [g.kind for g in report.groups],
        "bytes_per_block": per_block,
        "pool_bytes": pool_bytes,
        **_decision_columns(workload, result),
        **_memory_columns(meter, report, per_block, sched),
        "shortest_hit_prompt": shortest_hit_prompt(cfg) if cfg.enable_prefix_caching else None,
        **_time_columns(meter, sched, wall),
    }


def _decision_columns(workload: Workload, result: DriveResult) -> dict[str, Any]:
    """The workload's size and the scheduler's decisions: hits, recomputation, preemptions."""
    summary, sched = workload.summary(), result.scheduler
    return dict(
        turns=summary["turns"],
        finished_turns=result.finished_turns,
        prompt_tokens=summary["prompt_tokens"],
        output_tokens=summary["output_tokens"],
        prefix_queries=sched["prefix_queries"],
        prefix_hits=sched["prefix_hits"],
        prefix_hit_rate=result.prefix_hit_rate,
        lookup_hit_rate=result.lookup_hit_rate,
        recomputed_tokens=sched["recomputed_tokens"],
        replay_tokens=sched["replay_tokens"],
        preemption_recomputed_tokens=sched["preemption_recomputed_tokens"],
        preemptions=sched["preemptions"],
        steps=sched["steps"],
        scheduled_tokens=sched["scheduled_tokens"],
    )


def _memory_columns(meter: _Meter, report, per_block: list[int], sched: dict) -> dict[str, Any]:
    """KV bytes held (peak and mean per group), per token and per request; concurrency."""
    steps = max(meter.steps, 1)
    return dict(
        peak_kv_bytes=[b * c for b, c in zip(meter.peak_blocks, per_block)],
        mean_kv_bytes=[s / steps * c for s, c in zip(meter.sum_blocks, per_block)],
        peak_kv_bytes_total=meter.peak_total_bytes,
        bytes_per_token=report.bytes_per_token,
        fixed_bytes_per_request=report.fixed_bytes_per_request,
        max_running=sched["max_scheduled_requests"],
        max_concurrency=report.max_concurrency if math.isfinite(report.max_concurrency) else None,
    )


def _time_columns(meter: _Meter, sched: dict, wall: float) -> dict[str, Any]:
    """The cost model's time, throughput and TTFT, and the simulation's own speed."""
    ttft = [
        meter.first_token[r] - meter.arrival[r] for r in meter.first_token if r in meter.arrival
    ]
    return dict(
        modelled_time_s=meter.clock,
        modelled_output_tokens_per_s=meter.output_tokens / meter.clock if meter.clock else 0.0,
        ttft_mean_s=statistics.fmean(ttft) if ttft else 0.0,
        ttft_p50_s=_percentile(ttft, 0.5),
        ttft_p90_s=_percentile(ttft, 0.9),
        sim_wall_s=wall,
        sim_steps_per_s=sched["steps"] / wall if wall else 0.0,
    )


def sweep(
    workload: Workload,
    base: LabConfig,
    *,
    layouts: Iterable[str] = ("v41",),
    knob: str | None = None,
    values: Iterable[Any] = (None,),
    progress: bool = False,
    workers: int = 1,
) -> list[dict[str, Any]]:
    """One row per (layout, value): ``base`` with ``layout`` and ``knob = value``. Every point
    is validated before the first one runs, so a bad value fails fast and nothing runs.

    ``workers`` > 1 runs the points in that many processes (they are independent: each has
    its own scheduler and allocator); the rows and their order are those of a sequential run
    except ``sim_wall_s`` / ``sim_steps_per_s``.
    """
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise LabError(f"workers={workers!r}: allowed an int >= 1")
    points = _points(workload, base, list(layouts), knob, list(values))
    if workers > 1 and len(points) > 1:
        return _run_in_processes(workload, points, workers, progress)
    iterator: Iterable[LabConfig] = points
    if progress:
        iterator = tqdm(points, desc=f"lab {workload.kind}", unit="run")
    return [run(workload, cfg) for cfg in iterator]


def _points(
    workload: Workload, base: LabConfig, layouts: list[str], knob: str | None, values: list
) -> list[LabConfig]:
    """The sweep's configs, layout-major, each checked to fit ``workload``."""
    for name in layouts:
        if name not in LAYOUTS:
            raise LabError(f"layout {name!r}: unknown; known: {sorted(LAYOUTS)}")
    points = []
    for name in layouts:
        for value in values:
            knobs = {"layout": name}
            if knob is not None:
                knobs[knob] = value
            cfg = base.replace(**knobs)
            check_fits(workload, cfg)  # a layout that cannot be grouped fails here too
            points.append(cfg)
    return points


def _run_in_processes(
    workload: Workload, points: list[LabConfig], workers: int, progress: bool
) -> list[dict[str, Any]]:
    """`run` of every point in a pool of processes; the rows in the points' order."""
    # fork where the platform has it (the workload reaches the workers without pickling),
    # unless JAX is loaded: its threads make forking unsafe, so spawn then
    fork = "fork" in multiprocessing.get_all_start_methods() and "jax" not in sys.modules
    context = multiprocessing.get_context("fork" if fork else "spawn")
    with concurrent.futures.ProcessPoolExecutor(
        min(workers, len(points)), mp_context=context
    ) as pool:
        futures = [pool.submit(run, workload, cfg) for cfg in points]
        if progress:
            for _ in tqdm(
                concurrent.futures.as_completed(futures),
                total=len(futures),
                desc=f"lab {workload.kind}",
                unit="run",
            ):
                pass
        return [f.result() for f in futures]
