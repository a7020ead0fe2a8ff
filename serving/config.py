"""The engine's configuration as objects, each default and check defined once (vLLM's configs).

`EngineConfig` composes `ModelConfig`, `CacheConfig`, `SchedulerConfig`, `ParallelConfig`,
`SpeculativeConfig` and `CompilationConfig`. `LLM(**kwargs)` builds one with
`EngineConfig.from_kwargs`; `Engine.build` and `ModelRunner` read it; the ``dsv4`` CLI makes its
engine flags, defaults and help from the same fields (`engine_fields`). No JAX here: the CLI
checks its flags before JAX starts.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from cache import KVCacheManager
from dsv4.config import MODEL_PRESETS
from serving.request_queue import SchedulingPolicy
from serving.sampling_params import check_keyword
from serving.spec_decode import SpeculativeConfig

__all__ = [
    "DTYPES",
    "KV_CACHE_DTYPES",
    "MESH_AXES",
    "MODEL_NAMES",
    "RANDOM_PRESETS",
    "SCHEDULING_POLICIES",
    "SECTIONS",
    "SHIPPED_MODELS",
    "VLLM_ONLY",
    "WEIGHTS_ON_DEVICE",
    "CacheConfig",
    "CompilationConfig",
    "ConfigError",
    "EngineConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "engine_fields",
]

# The model names of the one preset table (`dsv4.config`, which imports no JAX), by where their
# weights come from.
MODEL_NAMES = tuple(MODEL_PRESETS)  # every preset (the planner's)
RANDOM_PRESETS = tuple(n for n, p in MODEL_PRESETS.items() if p.weights == "random")
SHIPPED_MODELS = tuple(n for n, p in MODEL_PRESETS.items() if p.weights == "shipped")
# Names of tables in modules that import JAX, mirrored so that the CLI checks its flags before
# JAX starts; tests/serving/test_config.py keeps each equal to its source:
# `dsv4.qweights.WEIGHTS_ON_DEVICE`, `dsv4.paged.records.PRESETS`, `dsv4.sharding.AXES`.
DTYPES = ("bfloat16", "float32")
KV_CACHE_DTYPES = ("auto", "exact", "bf16", "released", "released_fp8", "sm90")
WEIGHTS_ON_DEVICE = ("dequantised", "released")
MESH_AXES = ("data", "expert", "model")


# vLLM's engine arguments that this engine does not take, and what to use instead (`LLM`
# refuses them by this table, naming the replacement, instead of "unknown argument").
VLLM_ONLY = {
    "gpu_memory_utilization": "size the KV pool with kv_cache_memory_bytes (bytes; default 90% "
    "of the device's free memory after the weights, vLLM's 0.9) or num_gpu_blocks_override",
    "tensor_parallel_size": "pass mesh=dsv4.sharding.make_mesh(...) (heads over its model axis, "
    "experts over expert)",
    "pipeline_parallel_size": "no pipeline parallelism; pass mesh=dsv4.sharding.make_mesh(...)",
    "enforce_eager": "warm_up=False compiles each step on first use instead of at start-up",
    "quantization": "weights_on_device='released' keeps the checkpoint's fp8 / FP4 bytes",
    "tokenizer": "the tokenizer is the checkpoint directory's tokenizer.json (model=PATH)",
    "trust_remote_code": "drop it: the model's code is this package",
    "swap_space": "drop it: preempted requests are recomputed, never swapped",
    "download_dir": "give model= a local checkpoint directory",
    "revision": "give model= a local checkpoint directory",
    "max_seq_len_to_capture": "drop it: every step bucket is compiled (token_buckets)",
    "cpu_offload_gb": "drop it: weights stay on the device (weights_on_device='released' halves "
    "them)",
    "enable_expert_parallel": "pass mesh=dsv4.sharding.make_mesh(expert=...) (experts over its "
    "expert axis)",
    "distributed_executor_backend": "drop it: this process drives every device of mesh=",
    "tokenizer_mode": "drop it: the tokenizer is the checkpoint directory's tokenizer.json",
    "load_format": "give model= a released-format checkpoint directory (safetensors) or a preset",
    "hf_overrides": "edit the checkpoint directory's config.json",
    "compilation_config": "warm_up, token_buckets and compilation_cache_dir say what is compiled "
    "when and where it is kept",
    "disable_log_stats": "drop it: the engine's counters (llm.engine.stats) are kept and never "
    "logged",
    "generation_config": "give the sampling values in SamplingParams (the checkpoint's "
    "generation_config.json is not read)",
    "enable_lora": "drop it: no LoRA adapters are served",
}


class ConfigError(ValueError):
    """A configuration value out of range: ``name=value is not allowed: allowed``. The CLI
    reports it by its flag with ``rule`` (``--name value: rule``)."""

    def __init__(
        self, name: str, value: Any, allowed: str, rule: str | None = None, message: str = ""
    ) -> None:
        super().__init__(message or f"{name}={value!r} is not allowed: {allowed}")
        self.name, self.value, self.allowed = name, value, allowed
        self.rule = rule or f"must be {allowed}"


def _field(default: Any, help: str, **cli: Any) -> Any:
    """A config field: its default, one line of help, and how the CLI spells it (``choices``,
    ``parse``: text -> value, ``aliases``: older flag names, ``negations``: flag -> value,
    ``cli=False``: no flag)."""
    return dataclasses.field(default=default, metadata={"help": help, **cli})


def _int(name: str, value: Any, minimum: int, *, none_ok: bool = False) -> None:
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, value, f"an int >= {minimum}" + (" or None" if none_ok else ""))
    if value < minimum:
        allowed = f"an int >= {minimum}" + (" or None" if none_ok else "")
        raise ConfigError(name, value, allowed, f"must be >= {minimum}")


def _choice(name: str, value: Any, choices: Sequence[str], *, quoted: bool = False) -> None:
    if value not in choices:
        allowed = " or ".join(repr(c) for c in choices) if quoted else f"one of {tuple(choices)}"
        raise ConfigError(name, value, allowed)


def _ints(text: str) -> tuple[int, ...]:
    """``"8,32"`` -> ``(8, 32)`` (sorted, without repeats)."""
    try:
        return tuple(sorted({int(x) for x in text.split(",")}))
    except ValueError:
        raise ValueError("comma-separated ints") from None


def _table_buckets(text: str) -> tuple[int, ...] | str | None:
    """``"auto"``, ``"none"`` (None) or comma-separated widths."""
    named = {"auto": "auto", "none": None}
    return named[text.lower()] if text.lower() in named else _ints(text)


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise ValueError("a JSON object") from None


def _optional(text: str) -> str | None:
    return None if text.lower() == "none" else text


def _optional_int(text: str) -> int | None:
    """``"none"`` (None) or an int."""
    try:
        return None if text.lower() == "none" else int(text)
    except ValueError:
        raise ValueError("an int or none") from None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Which model and how it runs (vLLM's ``ModelConfig``). The architecture it loads is
    `dsv4.config.ModelConfig` (vLLM's ``hf_config``): serving keeps vLLM's name for this one."""

    model: str = _field(
        "tiny_v41_trained",
        "tiny_v41_trained (the shipped small model, trained on the Python standard library), a "
        "random preset (tiny_v41: seeded random weights; tiny_v41_full: with Engram and DSpark) "
        "or a checkpoint directory",
    )
    dtype: str = _field("float32", "params and activations", choices=DTYPES)
    max_model_len: int | None = _field(
        None, "longest sequence, prompt and outputs (None: the model's max_seq_len)"
    )
    max_logprobs: int = _field(20, "most logprobs a request may ask for")
    seed: int = _field(0, "random weights, and the sampling seed of requests that give none")
    quant_sim: bool = _field(False, "the official reference's quantisation simulation")
    weights_on_device: str = _field(
        "dequantised",
        "released: fp8 / FP4 weights stay in the checkpoint's bytes, dequantised per matmul",
        choices=WEIGHTS_ON_DEVICE,
    )
    skip_tokenizer_init: bool = _field(
        False, "no tokenizer: prompts are token ids, outputs carry token ids and no text"
    )

    def __post_init__(self) -> None:
        _choice("dtype", self.dtype, DTYPES)
        _choice("weights_on_device", self.weights_on_device, WEIGHTS_ON_DEVICE, quoted=True)
        _int("max_model_len", self.max_model_len, 2, none_ok=True)
        _int("max_logprobs", self.max_logprobs, 1)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError("seed", self.seed, "an int")
        if not isinstance(self.skip_tokenizer_init, bool):
            raise ConfigError("skip_tokenizer_init", self.skip_tokenizer_init, "True or False")
        names = ", ".join((*RANDOM_PRESETS, *SHIPPED_MODELS))
        model = self.model
        if not isinstance(model, str) or not (self.is_preset or os.path.isdir(model)):
            raise ConfigError(
                "model",
                model,
                f"a preset ({names}) or a checkpoint directory",
                f"not a preset ({names}) nor a directory",
            )
        if not self.is_preset and not os.path.isfile(os.path.join(model, "config.json")):
            raise ConfigError(
                "model",
                model,
                "a checkpoint directory (it has no config.json)",
                "no config.json (not a checkpoint directory)",
            )

    @property
    def is_preset(self) -> bool:
        """A name the package builds or ships (not a directory)."""
        return self.model in RANDOM_PRESETS or self.model in SHIPPED_MODELS


# CacheConfig fields that are `cache.KVCacheManager` keywords, by the keyword's name. The cache
# package is also used without serving, so the manager keeps their defaults; the fields read them
# from its signature rather than restate them.
_MANAGER_KEYWORDS = {
    "enable_prefix_caching": "enable_caching",
    "swa_bounded_replay": "swa_bounded_replay",
    "enable_kv_cache_events": "enable_kv_cache_events",
}
_MANAGER_DEFAULTS = {
    name: p.default for name, p in inspect.signature(KVCacheManager).parameters.items()
}


def _manager_default(field_name: str) -> Any:
    return _MANAGER_DEFAULTS[_MANAGER_KEYWORDS[field_name]]


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The KV cache: its record format, block sizes, pool size and prefix caching (vLLM's
    ``CacheConfig``)."""

    kv_cache_dtype: str = _field(
        "auto",
        "cache records (dsv4.paged.records presets); auto: exact for float32, else bf16",
        choices=KV_CACHE_DTYPES,
    )
    block_size: int | None = _field(
        None, "tokens per compressed block (None: 16 for the tiny family, else 64)"
    )
    swa_block_size: int | None = _field(
        None, "tokens per window block (None: 4 for the tiny family, else 32)"
    )
    num_gpu_blocks_override: int | None = _field(
        None, "KV blocks in the pool (wins over the memory budget)", aliases=("--num-gpu-blocks",)
    )
    kv_cache_memory_bytes: int | None = _field(
        None, "KV pool budget (None: 90% of the device's free memory, 256 MiB on the CPU)"
    )
    enable_prefix_caching: bool = _field(
        _manager_default("enable_prefix_caching"),
        "reuse cached prefixes across requests",
        negations={"--no-prefix-caching": False},
    )
    swa_bounded_replay: bool = _field(
        _manager_default("swa_bounded_replay"),
        "V4.1's approximate window replay on prefix hits",
        aliases=("--bounded-replay",),
    )
    pool_layout: str = _field(
        "aliased", "aliased (one byte pool, as vLLM) or separate", choices=("aliased", "separate")
    )
    enable_kv_cache_events: bool = _field(
        _manager_default("enable_kv_cache_events"), "record KV events (Engine.subscribe_kv_events)"
    )
    fill: str = _field(
        "zeros",
        "initial pool bytes (nan: a wrong read poisons the logits)",
        choices=("zeros", "nan"),
    )
    prompt_logprobs_on_hits: bool = _field(
        False,
        "a request asking prompt logprobs may hit the prefix cache (its cached positions get "
        "None; vLLM reads no cache for it)",
    )

    def __post_init__(self) -> None:
        _choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _choice("pool_layout", self.pool_layout, ("aliased", "separate"), quoted=True)
        _choice("fill", self.fill, ("zeros", "nan"), quoted=True)
        for name in ("block_size", "swa_block_size", "kv_cache_memory_bytes"):
            _int(name, getattr(self, name), 1, none_ok=True)
        _int("num_gpu_blocks_override", self.num_gpu_blocks_override, 2, none_ok=True)

    def manager_kwargs(self) -> dict[str, Any]:
        """The `cache.KVCacheManager` keywords this config sets."""
        return {keyword: getattr(self, name) for name, keyword in _MANAGER_KEYWORDS.items()}


SCHEDULING_POLICIES = tuple(p.value for p in SchedulingPolicy)
# LLM's bursts (``num_scheduler_steps=None`` offline, `EngineConfig.offline`)
OFFLINE_SCHEDULER_STEPS = 16


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """What a step may hold and how steps are planned and compiled (vLLM's
    ``SchedulerConfig``)."""

    max_num_seqs: int = _field(16, "most requests running at once")
    max_num_batched_tokens: int = _field(64, "token budget of a step (chunked prefill)")
    async_scheduling: bool = _field(
        True, "plan step N+1 while step N runs", negations={"--sync": False}
    )
    num_scheduler_steps: int | None = _field(
        None,
        "decode steps run as one program (bursts; vLLM v0's multi-step scheduling; None: "
        f"{OFFLINE_SCHEDULER_STEPS} for LLM.generate and dsv4 generate where bursts can run, "
        "else 1, and 1 in dsv4 serve)",
    )
    token_buckets: tuple[int, ...] | None = _field(
        None,
        "step sizes to compile, comma-separated (None: powers of two from 1 to max_num_seqs, "
        "then of four to the budget)",
        parse=_ints,
    )
    table_buckets: tuple[int, ...] | str | None = _field(
        "auto",
        "block-table widths to compile, comma-separated (auto: full width up to 256 blocks, "
        "else powers of eight from 64 blocks; none: always full width)",
        parse=_table_buckets,
    )
    scheduling_policy: str = _field(
        "fcfs",
        "admission and preemption order (priority: by request priority, then arrival)",
        choices=SCHEDULING_POLICIES,
    )
    long_prefill_token_threshold: int = _field(0, "if > 0, most tokens one request gets in a step")
    enable_chunked_prefill: bool = _field(
        True, "split a long prompt over steps (else one that does not fit stops admission)"
    )
    scheduler_reserve_full_isl: bool = _field(
        True, "admit a request only if its whole remaining sequence fits (else one chunk)"
    )

    def __post_init__(self) -> None:
        _int("max_num_seqs", self.max_num_seqs, 1)
        _int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _int("num_scheduler_steps", self.num_scheduler_steps, 1, none_ok=True)
        _int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        _choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES, quoted=True)
        if (self.num_scheduler_steps or 1) > 1 and (refused := self.burst_refusal()):
            raise refused
        budget = self.max_num_batched_tokens
        if self.token_buckets is not None:
            buckets = _int_tuple("token_buckets", self.token_buckets)
            if list(buckets) != sorted(set(buckets)) or buckets[0] < 1 or buckets[-1] < budget:
                raise ConfigError(
                    "token_buckets",
                    self.token_buckets,
                    f"ascending positive sizes, the largest >= max_num_batched_tokens ({budget})",
                    f"positive sizes, the largest >= --max-num-batched-tokens ({budget})",
                )
            object.__setattr__(self, "token_buckets", buckets)
        if self.table_buckets not in ("auto", None):
            widths = _int_tuple("table_buckets", self.table_buckets)
            if list(widths) != sorted(set(widths)) or widths[0] < 1:
                raise ConfigError(
                    "table_buckets", widths, "'auto', None or ascending positive ints"
                )
            object.__setattr__(self, "table_buckets", widths)

    def burst_refusal(self, steps: int | None = None) -> ConfigError | None:
        """The error bursts of ``steps`` (default: this config's ``num_scheduler_steps``)
        meet in this section (they need asynchronous scheduling), or None. The rest of where
        bursts run: `EngineConfig.burst_refusal`."""
        steps = self.num_scheduler_steps if steps is None else steps
        if not self.async_scheduling:
            return ConfigError("num_scheduler_steps", steps, "1 with async_scheduling=False")
        return None


def _int_tuple(name: str, values: Any) -> tuple[int, ...]:
    if isinstance(values, str) or not isinstance(values, Sequence) or not values:
        raise ConfigError(name, values, "a non-empty sequence of ints")
    if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise ConfigError(name, values, "a non-empty sequence of ints")
    return tuple(values)


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Where the model runs: a device mesh and the data shards (vLLM's ``ParallelConfig``)."""

    mesh: Any = _field(  # noqa: RUF009 - `_field` returns a dataclasses.field
        None,
        "a dsv4.sharding.make_mesh mesh (params by the rule table, heads over model, experts "
        "over expert, requests over data); None: one device",
        cli=False,  # a device mesh is an object, not a value a flag carries
    )
    data_parallel_size: int | None = _field(
        None,
        "data shards, each its own scheduler, KV cache and requests, limits per shard (None: "
        "the mesh's data axis, 1 without a mesh)",
    )

    def __post_init__(self) -> None:
        mesh = self.mesh
        if mesh is not None:
            # a Mesh exists only once JAX is imported: no need to import it here
            jax = sys.modules.get("jax")
            if (
                jax is None
                or not isinstance(mesh, jax.sharding.Mesh)
                or (tuple(mesh.axis_names) != MESH_AXES)
            ):
                raise ConfigError(
                    "mesh",
                    mesh,
                    f"a jax.sharding.Mesh with axes {MESH_AXES} (dsv4.sharding.make_mesh)",
                )
        size = self.data_parallel_size
        _int("data_parallel_size", size, 1, none_ok=True)
        data = self.mesh_data_size
        if size is not None and size > 1 and size % data:
            raise ConfigError(
                "data_parallel_size",
                size,
                f"1 or a positive multiple of the mesh's data axis ({data})",
            )

    @property
    def mesh_data_size(self) -> int:
        """The mesh's ``data`` axis (1 without a mesh)."""
        return 1 if self.mesh is None else dict(self.mesh.shape).get("data", 1)

    @property
    def num_shards(self) -> int:
        """D, the data shards: ``data_parallel_size``, or the mesh's ``data`` axis."""
        size = self.data_parallel_size
        return self.mesh_data_size if size is None else size


@dataclasses.dataclass(frozen=True)
class CompilationConfig:
    """How the step programs are compiled and checked (vLLM's ``CompilationConfig``)."""

    compilation_cache_dir: str | None = _field(
        "default",
        'JAX\'s persistent compilation cache ("default": ~/.cache/dsv4-jax/jax; none: off)',
        parse=_optional,
        negations={"--no-compilation-cache": None},
    )
    warm_up: bool = _field(True, "compile every bucket at start-up (else on first use)")
    freeze_gc_heap: bool = _field(
        True,
        "after warm-up, move the heap built so far out of Python's cyclic collector's reach "
        "(vLLM's freeze_gc_heap): collecting it paused steps by about 0.4 s",
    )
    gc_threshold: int | None = _field(
        50_000,
        "while the engine loop runs (LLM.generate, the server's driver), Python's young "
        "collections start after this many new objects, not 700 (SGLang's --gc-threshold); "
        "None: Python's own",
        parse=_optional_int,
    )
    impl: str | None = _field(None, "attention kernels (None: by backend)", parse=_optional)
    interpret: bool = _field(False, "run the Pallas kernels in interpret mode")
    debug: bool = _field(False, "check every step's block ids and slots on the host (slow)")

    def __post_init__(self) -> None:
        _int("gc_threshold", self.gc_threshold, 1, none_ok=True)


# EngineConfig's sections by attribute name (every field name is unique across them)
SECTIONS = {
    "model_config": ModelConfig,
    "cache_config": CacheConfig,
    "scheduler_config": SchedulerConfig,
    "parallel_config": ParallelConfig,
    "compilation_config": CompilationConfig,
}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from (vLLM's ``VllmConfig``); `from_kwargs` builds one
    from `LLM`'s flat keywords. ``speculative_config`` None: no speculative decoding."""

    model_config: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    cache_config: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    speculative_config: SpeculativeConfig | None = None
    compilation_config: CompilationConfig = dataclasses.field(default_factory=CompilationConfig)

    def __post_init__(self) -> None:
        if (self.scheduler_config.num_scheduler_steps or 1) > 1 and (
            refused := self.burst_refusal()
        ):
            raise refused

    def burst_refusal(
        self, engram_lookback: int = 0, steps: int | None = None
    ) -> ConfigError | None:
        """The error bursts (``num_scheduler_steps`` = ``steps`` > 1, default this config's)
        meet with this config and a model of ``engram_lookback``, or None where they run: the
        one list of it (checked here, by `offline` and by the runner). Bursts need asynchronous
        scheduling, no speculative decoding, one data shard and no Engram look-back (a step's
        look-back is read on the host; a burst's tokens are on the device)."""
        sched = self.scheduler_config
        steps = sched.num_scheduler_steps if steps is None else steps
        if (refused := sched.burst_refusal(steps)) is not None:
            return refused
        if self.speculative_config is not None:
            return ConfigError("num_scheduler_steps", steps, "1 with a speculative_config")
        shards = self.parallel_config.num_shards
        if shards > 1:
            return ConfigError(
                "num_scheduler_steps",
                steps,
                "1 (bursts run on one data shard)",
                message=f"num_scheduler_steps={steps!r} with data_parallel_size={shards}; "
                "allowed there: 1 (bursts run on one data shard)",
            )
        if engram_lookback:
            return ConfigError(
                "num_scheduler_steps",
                steps,
                "1 with an Engram model",
                message=f"num_scheduler_steps={steps} does not run with an Engram model (its "
                "look-back is read on the host); allowed there: 1",
            )
        return None

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """`LLM`'s flat keywords (every field of every section, and ``speculative_config``:
        vLLM's dict or a `SpeculativeConfig`) -> the config; a missing key keeps its default.

        Raises:
            TypeError: a key no section has (naming the closest ones).
            ValueError: a value out of range (`ConfigError`, naming it and what is allowed).
        """
        spec = kwargs.pop("speculative_config", None)
        parts: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
        owner = {f.name: section for section, f in _section_fields()}
        for key, value in kwargs.items():
            check_keyword(key, value, [*owner, "speculative_config"], VLLM_ONLY, "engine argument")
            parts[owner[key]][key] = value
        spec = None if spec is None else SpeculativeConfig.from_dict(spec)
        return cls(
            **{section: SECTIONS[section](**values) for section, values in parts.items()},
            speculative_config=spec,
        )

    def to_kwargs(self) -> dict[str, Any]:
        """The flat keywords `from_kwargs` takes back (``speculative_config`` as the object)."""
        out = {f.name: getattr(getattr(self, s), f.name) for s, f in _section_fields()}
        out["speculative_config"] = self.speculative_config
        return out

    def resolved(self, arch) -> EngineConfig:
        """The config with what follows from the model's architecture ``arch``
        (`dsv4.config.ModelConfig`) filled in: ``max_model_len`` (its ``max_seq_len``), the
        block sizes (by its window: the tiny family's is under 128 tokens),
        ``kv_cache_dtype`` (exact for float32, else bf16) and ``num_scheduler_steps`` (None: 1,
        one step a program; `offline` chose before for `LLM`). Idempotent.

        Raises:
            ConfigError: ``max_model_len`` above the model's ``max_seq_len``.
        """
        model, cache = self.model_config, self.cache_config
        length = model.max_model_len or arch.max_seq_len
        if length > arch.max_seq_len:
            raise ConfigError(
                "max_model_len", length, f"at most the model's max_seq_len {arch.max_seq_len}"
            )
        tiny = arch.window_size < 128
        kv = cache.kv_cache_dtype
        sched = self.scheduler_config
        steps = sched.num_scheduler_steps or 1  # an engine or server steps one at a time
        if kv == "auto":
            kv = "exact" if model.dtype == "float32" else "bf16"
        return dataclasses.replace(
            self,
            model_config=dataclasses.replace(model, max_model_len=length),
            cache_config=dataclasses.replace(
                cache,
                kv_cache_dtype=kv,
                block_size=cache.block_size or (16 if tiny else 64),
                swa_block_size=cache.swa_block_size or (4 if tiny else 32),
            ),
            scheduler_config=dataclasses.replace(sched, num_scheduler_steps=steps),
        )

    def offline(self, arch) -> EngineConfig:
        """`LLM`'s config: ``num_scheduler_steps`` None becomes `OFFLINE_SCHEDULER_STEPS`
        where bursts can run (asynchronous scheduling, no speculative decoding, one data shard,
        no Engram look-back in ``arch``), else 1. Offline outputs come whole, so bursts cost
        them nothing; a server's streams and arrivals would wait for a burst to end."""
        sched = self.scheduler_config
        if sched.num_scheduler_steps is not None:
            return self
        bursts = self.burst_refusal(arch.engram_lookback, OFFLINE_SCHEDULER_STEPS) is None
        steps = OFFLINE_SCHEDULER_STEPS if bursts else 1
        return dataclasses.replace(
            self, scheduler_config=dataclasses.replace(sched, num_scheduler_steps=steps)
        )

    @property
    def num_speculative_tokens(self) -> int:
        """k, the drafts verified per request and step (0: no speculative decoding)."""
        spec = self.speculative_config
        return 0 if spec is None else spec.num_speculative_tokens

    @property
    def drafter(self) -> bool:
        """Whether the step runs the model's DSpark drafter."""
        spec = self.speculative_config
        return spec is not None and spec.method == "dspark"


def _section_fields() -> Iterator[tuple[str, dataclasses.Field]]:
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            yield section, f


@dataclasses.dataclass(frozen=True)
class EngineField:
    """One engine option as the CLI shows it: ``--flag`` (kebab-case of ``name``), its type
    (``annotation``, as written), default, help, choices, text parser, older flag names
    (``aliases``) and flags that set one value (``negations``)."""

    name: str
    section: str
    annotation: str
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    parse: Callable[[str], Any] | None = None
    aliases: tuple[str, ...] = ()
    negations: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


# vLLM's speculative_config, as the CLI carries it: a JSON object
_SPECULATIVE = EngineField(
    "speculative_config",
    "speculative_config",
    "SpeculativeConfig | None",
    None,
    'vLLM\'s dict as JSON, e.g. {"method": "ngram", "num_speculative_tokens": 3} or '
    '{"method": "dspark", "num_speculative_tokens": 2}',
    parse=_json,
)


def engine_fields() -> list[EngineField]:
    """Every engine option a flag carries, in section order (the mesh, an object, has none)."""
    out = []
    for section, f in _section_fields():
        meta = f.metadata
        if meta.get("cli", True):
            out.append(
                EngineField(
                    f.name,
                    section,
                    str(f.type),
                    f.default,
                    meta["help"],
                    meta.get("choices"),
                    meta.get("parse"),
                    meta.get("aliases", ()),
                    dict(meta.get("negations", {})),
                )
            )
    return [*out, _SPECULATIVE]
