"""KV-cache specs: what one layer's cache looks like, per block (vLLM v1's ``kv_cache_interface``).

A spec gives ``block_size`` (tokens), ``page_size_bytes``, ``max_memory_usage_bytes`` and
``prefix_cacheable``; specs are frozen keyword-only dataclasses validated on construction, with
units in their field names. Where a class differs from vLLM 0.32 its docstring says so. See
docs/allocator_internals.md, section 7.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from enum import IntEnum
from typing import ClassVar, Self

from cache.util import cdiv, lookup, round_up

# Bytes per element of the dtype names a cache may use.
DTYPE_SIZE_BYTES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "int32": 4,
    "bfloat16": 2,
    "float16": 2,
    "int16": 2,
    "uint8": 1,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e8m0fnu": 1,
}

# Model versions the MLA-format specs accept (V4 and V4.1 share the cache record family).
MODEL_VERSIONS = (None, "deepseek_v4")


def dtype_size_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name; ``ValueError`` for an unknown name."""
    return lookup(DTYPE_SIZE_BYTES, dtype, f"dtype={dtype!r} is not a known cache dtype")


def _require_positive(owner: object, name: str, value: int | None, *, optional=False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(
            f"{type(owner).__name__}.{name}={value!r} is invalid; it must be a positive int"
            + (" or None" if optional else "")
        )


def _require_positive_slot_fields(spec: KVCacheSpec) -> None:
    """A spec's `_validate` when its `slot_fields` are all positive ints (sinks, RSWA)."""
    for name in spec.slot_fields:
        _require_positive(spec, name, getattr(spec, name))


def _require_non_negative(owner: object, name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(
            f"{type(owner).__name__}.{name}={value!r} is invalid; it must be an int >= 0"
        )


# ---------------------------------------------------------------------------------------------
# Quantization modes
# ---------------------------------------------------------------------------------------------


def _mode_family(doc: str, *names: str) -> property:
    """A `KVQuantMode` predicate: whether the mode is one of ``names``."""
    return property(lambda mode: mode.name in names, doc=doc)


class KVQuantMode(IntEnum):
    """How a cache's values are quantized; kernels dispatch on this, never on dtype strings.

    Values and predicates follow vLLM 0.32. Per-token-head modes keep one dynamic scale per
    (token, head); backends fold those scale bytes into ``state_content_bytes``.
    """

    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4
    NVFP4 = 5
    TURBOQUANT_K8V4 = 6
    TURBOQUANT_4BIT_NC = 7
    TURBOQUANT_K3V4_NC = 8
    TURBOQUANT_3BIT_NC = 9
    NVFP4_DS_MLA = 10
    ULTRAQUANT_4BIT = 11

    is_per_token_head = _mode_family(
        "True for the int8 / fp8 / int4 per-token-head modes.",
        "INT8_PER_TOKEN_HEAD",
        "FP8_PER_TOKEN_HEAD",
        "INT4_PER_TOKEN_HEAD",
    )
    is_nvfp4 = _mode_family("True for plain NVFP4 (not the opaque DS-MLA NVFP4 record).", "NVFP4")
    is_turboquant = _mode_family(
        "True for the four TurboQuant modes.",
        "TURBOQUANT_K8V4",
        "TURBOQUANT_4BIT_NC",
        "TURBOQUANT_K3V4_NC",
        "TURBOQUANT_3BIT_NC",
    )
    is_ultraquant = _mode_family("True for the UltraQuant 4-bit format.", "ULTRAQUANT_4BIT")


def get_kv_quant_mode(cache_dtype: str) -> KVQuantMode:
    """Map a ``cache_dtype`` string (``"auto"``, ``"fp8"``, ``"fp8_ds_mla"``, ...) to its mode."""
    exact = {
        "int4_per_token_head": KVQuantMode.INT4_PER_TOKEN_HEAD,
        "int8_per_token_head": KVQuantMode.INT8_PER_TOKEN_HEAD,
        "fp8_per_token_head": KVQuantMode.FP8_PER_TOKEN_HEAD,
        # Checked before the generic "nvfp4" prefix, which it would otherwise match.
        "nvfp4_ds_mla": KVQuantMode.NVFP4_DS_MLA,
        "ultraquant_4bit": KVQuantMode.ULTRAQUANT_4BIT,
    }
    if cache_dtype in exact:
        return exact[cache_dtype]
    if cache_dtype.startswith("nvfp4"):
        return KVQuantMode.NVFP4
    if cache_dtype.startswith("turboquant_"):
        try:
            return KVQuantMode[cache_dtype.upper()]
        except KeyError:
            raise ValueError(f"cache_dtype={cache_dtype!r} is not a TurboQuant mode") from None
    if cache_dtype.startswith("fp8"):
        return KVQuantMode.FP8_PER_TENSOR
    return KVQuantMode.NONE


# ---------------------------------------------------------------------------------------------
# Base spec
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class KVCacheSpec:
    """Base of every spec: one layer's cache format, per block of ``block_size`` tokens.

    Validation: each class in the MRO may define ``_validate(self)`` for its own fields;
    ``__post_init__`` runs them base-first (slotted dataclasses cannot use zero-arg ``super``).
    """

    block_size: int
    # Fields that must match for two specs of one uniform-type family to need the same slots.
    slot_fields: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        for klass in reversed(type(self).__mro__):
            check = klass.__dict__.get("_validate")
            if check is not None:
                check(self)

    def _validate(self) -> None:
        _require_positive(self, "block_size", self.block_size)

    @property
    def prefix_cacheable(self) -> bool:
        """Whether this spec's blocks may be shared through the prefix cache."""
        return True

    @property
    def prefix_replay_tokens(self) -> int:
        """Tokens of a prefix hit that must be recomputed (V4.1 SWA bounded replay), else 0."""
        return 0

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer, padding included."""
        raise NotImplementedError

    @property
    def real_page_size_bytes(self) -> int:
        """Bytes of one block of one layer without padding."""
        raise NotImplementedError

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Most bytes one request of up to ``max_model_len`` tokens can hold in this layer.

        ``max_num_batched_tokens`` is the in-flight budget (tokens scheduled but not yet
        settled); recycling specs (windows, chunks) must reserve for it.
        """
        raise NotImplementedError

    def max_num_blocks_per_req(self, max_model_len: int) -> int:
        """Block-table row width a request of ``max_model_len`` tokens needs."""
        return cdiv(max_model_len, self.block_size)

    def copy_with_new_block_size(self, block_size: int) -> Self:
        """The same spec with another block size (re-validated)."""
        return dataclasses.replace(self, block_size=block_size)

    @classmethod
    def merge(cls, specs: list[Self]) -> Self:
        """Collapse the specs of one group's layers into one; they must all be equal."""
        _require_same_type(specs)
        for spec in specs[1:]:
            if spec != specs[0]:
                raise ValueError(
                    "All layers of one KV-cache group must have the same spec; "
                    f"{_differences(specs[0], spec)}"
                )
        return specs[0]

    def is_uniform_with(self, specs: Iterable[KVCacheSpec]) -> bool:
        """Whether every spec in ``specs`` needs the same token slots as this one
        (same manager semantics; page sizes may differ). Used by ``UniformTypeKVCacheSpecs``."""
        return all(type(spec) is type(self) and spec == self for spec in specs)


def _require_same_type(specs: list[KVCacheSpec]) -> None:
    if not specs:
        raise ValueError("merge() needs at least one spec, got an empty list")
    kinds = {type(spec).__name__ for spec in specs}
    if len(kinds) > 1:
        raise ValueError(
            f"All layers of one KV-cache group must have the same spec class, got {sorted(kinds)}"
        )


def _differences(a: KVCacheSpec, b: KVCacheSpec, skip: Iterable[str] = ()) -> str:
    diffs = [
        f"{f.name}: {getattr(a, f.name)!r} vs {getattr(b, f.name)!r}"
        for f in fields(a)
        if f.name not in skip and getattr(a, f.name) != getattr(b, f.name)
    ]
    return "differing fields: " + "; ".join(diffs)


# ---------------------------------------------------------------------------------------------
# Attention specs
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """A paged attention cache: ``[num_blocks, num_heads, num_states, state_content_size_bytes]``.

    Its fields: docs/allocator_internals.md, section 10.
    """

    num_kv_heads: int
    head_size: int
    dtype: str
    head_size_v: int | None = None
    kv_quant_mode: KVQuantMode = KVQuantMode.NONE
    page_size_padded: int | None = None
    num_head_slots: int | None = None
    state_content_bytes: int | None = None
    tokens_per_state: int = 1

    def _validate(self) -> None:
        _require_positive(self, "num_kv_heads", self.num_kv_heads)
        _require_positive(self, "head_size", self.head_size)
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)
        _require_non_negative(self, "head_size_v", self.head_size_v)
        dtype_size_bytes(self.dtype)
        if not isinstance(self.kv_quant_mode, KVQuantMode):
            raise ValueError(
                f"{type(self).__name__}.kv_quant_mode={self.kv_quant_mode!r} must be a "
                "KVQuantMode member"
            )
        _require_positive(self, "num_head_slots", self.num_head_slots, optional=True)
        _require_positive(self, "state_content_bytes", self.state_content_bytes, optional=True)
        _require_positive(self, "tokens_per_state", self.tokens_per_state)
        if self.block_size % self.tokens_per_state:
            raise ValueError(
                f"{type(self).__name__}: block_size={self.block_size} must be a multiple of "
                f"tokens_per_state={self.tokens_per_state} so a block holds whole states"
            )
        self._check_padding()

    def _check_padding(self) -> None:
        _require_positive(self, "page_size_padded", self.page_size_padded, optional=True)
        if self.page_size_padded is not None and self.page_size_padded < self.real_page_size_bytes:
            raise ValueError(
                f"{type(self).__name__}.page_size_padded={self.page_size_padded} is smaller "
                f"than the real page ({self.real_page_size_bytes} B); it must be >= it"
            )

    @property
    def num_heads(self) -> int:
        """H of the page layout: ``num_head_slots`` if set, else ``num_kv_heads``."""
        return self.num_head_slots if self.num_head_slots is not None else self.num_kv_heads

    @property
    def num_states(self) -> int:
        """Stored rows per block (``block_size // tokens_per_state``)."""
        return self.block_size // self.tokens_per_state

    @property
    def state_content_size_bytes(self) -> int:
        """Bytes of one (head slot, state) cell of the page."""
        if self.state_content_bytes is not None:
            return self.state_content_bytes
        return (self.head_size + self.head_size_v) * dtype_size_bytes(self.dtype)

    @property
    def real_page_size_bytes(self) -> int:
        return self.num_heads * self.num_states * self.state_content_size_bytes

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.real_page_size_bytes

    def is_uniform_with(self, specs: Iterable[KVCacheSpec]) -> bool:
        base = _uniform_base(self)
        return all(
            _uniform_base(spec) is base
            and all(getattr(spec, f) == getattr(self, f) for f in base.slot_fields)
            for spec in specs
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Blocks for every token of the request (full manager).

    With the hybrid manager disabled, sliding-window and chunked-local layers are rewritten to
    this spec and keep ``sliding_window`` / ``attention_chunk_size`` for compute only.
    """

    sliding_window: int | None = None
    attention_chunk_size: int | None = None

    def _validate(self) -> None:
        _require_positive(self, "sliding_window", self.sliding_window, optional=True)
        _require_positive(self, "attention_chunk_size", self.attention_chunk_size, optional=True)
        if self.sliding_window is not None and self.attention_chunk_size is not None:
            raise ValueError(
                f"{type(self).__name__}: sliding_window={self.sliding_window} and "
                f"attention_chunk_size={self.attention_chunk_size} are mutually exclusive; "
                "set at most one"
            )

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return cdiv(max_model_len, self.block_size) * self.page_size_bytes

    @classmethod
    def merge(cls, specs: list[Self]) -> Self:
        """Merge one group's full-attention specs.

        All fields must match except ``sliding_window`` / ``attention_chunk_size``: each may
        take at most one value over the group (layers without it are compatible), and a group
        cannot use both.
        """
        _require_same_type(specs)
        windowed = ("sliding_window", "attention_chunk_size")
        for spec in specs[1:]:
            for f in fields(spec):
                if f.name not in windowed and getattr(spec, f.name) != getattr(specs[0], f.name):
                    raise ValueError(
                        "All attention layers of one KV-cache group must have the same spec; "
                        f"{_differences(specs[0], spec, skip=windowed)}"
                    )
        merged = {name: _merge_window_sizes(specs, name) for name in windowed}
        if all(value is not None for value in merged.values()):
            raise ValueError(
                "A KV-cache group cannot mix sliding-window layers "
                f"(window {merged['sliding_window']}) and chunked-local layers "
                f"(chunk {merged['attention_chunk_size']})"
            )
        return dataclasses.replace(specs[0], **merged)


def _merge_window_sizes(specs: list[FullAttentionSpec], name: str) -> int | None:
    values = {getattr(spec, name) for spec in specs} - {None}
    if len(values) > 1:
        raise ValueError(
            f"All layers of one KV-cache group must have the same {name}, got {sorted(values)}"
        )
    return values.pop() if values else None


def _apply_alignment_padding(spec: MLAAttentionSpec | SlidingWindowMLASpec) -> None:
    """Round the real page up to ``alignment`` and store it in ``page_size_padded``.

    Only when no explicit ``page_size_padded`` was given (an explicit one, e.g. a page padded to
    a larger bucket by the DeepSeek-V4 grouping, is kept and only checked to be >= real).
    """
    _require_positive(spec, "alignment", spec.alignment, optional=True)
    if spec.alignment is None or spec.page_size_padded is not None:
        return
    real = spec.real_page_size_bytes
    padded = round_up(real, spec.alignment)
    if padded != real:
        object.__setattr__(spec, "page_size_padded", padded)


def _check_model_version(spec: MLAAttentionSpec | SlidingWindowMLASpec) -> None:
    if spec.model_version not in MODEL_VERSIONS:
        raise ValueError(
            f"{type(spec).__name__}.model_version={spec.model_version!r} is not supported; "
            f"allowed: {MODEL_VERSIONS}"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    """A full-attention cache of single-latent MLA rows (DeepSeek compressed KV, indexer keys).

    ``tokens_per_state`` is V4.1's compress ratio r in {1, 2} (V4.0: 4 or 128): a block of
    ``block_size`` raw tokens stores ``block_size // r`` states. ``alignment`` rounds the page
    up (FlashMLA: 576 B for the 584-B record, 512 B on SM100).
    """

    cache_dtype_str: str | None = None
    alignment: int | None = None
    model_version: str | None = None
    head_size_v: int = 0

    def _validate(self) -> None:
        _check_model_version(self)
        _apply_alignment_padding(self)

    def copy_with_new_block_size(self, block_size: int) -> Self:
        # Alignment padding depends on the block size: recompute it instead of keeping it.
        padded = None if self.alignment is not None else self.page_size_padded
        return dataclasses.replace(self, block_size=block_size, page_size_padded=padded)


@dataclass(frozen=True, slots=True, kw_only=True)
class HiddenStateCacheSpec(MLAAttentionSpec):
    """Marker: a cache that stores hidden states for extraction (never grouped with attention)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """A sliding-window cache: only the last ``sliding_window`` tokens (query included) are kept.

    ``extra_retained_tokens`` keeps that many more tokens below the window alive (not attended),
    for drafters that re-prefill the last few tokens.
    """

    sliding_window: int
    extra_retained_tokens: int = 0
    slot_fields = ("sliding_window",)

    def _validate(self) -> None:
        _require_positive(self, "sliding_window", self.sliding_window)
        _require_non_negative(self, "extra_retained_tokens", self.extra_retained_tokens)

    def max_admission_blocks_per_request(
        self, max_model_len: int, max_num_batched_tokens: int
    ) -> int:
        """Most blocks one request can hold at once; both startup sizing and admission use it.

        The request keeps the last ``sliding_window - 1`` computed tokens plus the retained
        tail plus the in-flight tokens (capped at ``max_model_len``); +1 block because the
        window rarely starts on a block boundary.
        """
        num_tokens = min(
            self.sliding_window - 1 + self.extra_retained_tokens + max_num_batched_tokens,
            max_model_len,
        )
        return cdiv(num_tokens, self.block_size) + 1

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        blocks = self.max_admission_blocks_per_request(max_model_len, max_num_batched_tokens)
        return blocks * self.page_size_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class SlidingWindowMLASpec(SlidingWindowSpec):
    """A sliding-window cache of MLA rows (DeepSeek SWA KV; V4.0 compressor states).

    ``bounded_replay=True`` (V4.1's default in vLLM) recomputes the last ``sliding_window``
    tokens of every prefix hit instead of caching this cache's blocks: not prefix-cacheable.
    """

    cache_dtype_str: str | None = None
    alignment: int | None = None
    model_version: str | None = None
    bounded_replay: bool = False
    head_size_v: int = 0
    slot_fields = ("sliding_window", "bounded_replay")

    def _validate(self) -> None:
        _check_model_version(self)
        _apply_alignment_padding(self)

    @property
    def prefix_cacheable(self) -> bool:
        return not self.bounded_replay

    @property
    def prefix_replay_tokens(self) -> int:
        return self.sliding_window if self.bounded_replay else 0

    def copy_with_new_block_size(self, block_size: int) -> Self:
        padded = None if self.alignment is not None else self.page_size_padded
        return dataclasses.replace(self, block_size=block_size, page_size_padded=padded)


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Chunked local attention: a token attends within its ``attention_chunk_size`` chunk."""

    attention_chunk_size: int
    slot_fields = ("attention_chunk_size",)

    def _validate(self) -> None:
        _require_positive(self, "attention_chunk_size", self.attention_chunk_size)

    def max_admission_blocks_per_request(
        self, max_model_len: int, max_num_batched_tokens: int
    ) -> int:
        """Most blocks one request can hold: one chunk plus the in-flight tokens."""
        num_tokens = min(self.attention_chunk_size + max_num_batched_tokens, max_model_len)
        return cdiv(num_tokens, self.block_size)

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        blocks = self.max_admission_blocks_per_request(max_model_len, max_num_batched_tokens)
        return blocks * self.page_size_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class CrossAttentionSpec(AttentionSpec):
    """Encoder states for cross-attention; written once per request, never prefix-cached.

    vLLM sizes it by the scheduler's encoder-input budget, which defaults to
    ``max_num_batched_tokens``; we take that default.
    """

    @property
    def prefix_cacheable(self) -> bool:
        return False

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return cdiv(max_num_batched_tokens, self.block_size) * self.page_size_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class SinkFullAttentionSpec(FullAttentionSpec):
    """Full attention with ``sink_len`` sink tokens kept in front of every request.

    Unlike vLLM (which groups it under full attention), it forms its own uniform type, so that
    a group's first spec always names the right manager.
    """

    sink_len: int
    slot_fields = ("sink_len",)
    _validate = _require_positive_slot_fields


@dataclass(frozen=True, slots=True, kw_only=True)
class RSWASpec(FullAttentionSpec):
    """Reference sliding window: the prompt stays visible, only the last ``rswa_window``
    generated tokens are kept. Its own uniform type (see ``SinkFullAttentionSpec``)."""

    rswa_window: int
    slot_fields = ("rswa_window",)
    _validate = _require_positive_slot_fields


@dataclass(frozen=True, slots=True, kw_only=True)
class CircularBufferSpec(AttentionSpec):
    """A per-request ring (V4.1 compressor state): one block for the request's whole life.

    ``block_size`` is the ring capacity in rows; it must cover the compress ratio plus the
    speculative rows stored before acceptance is known (V4.1: ``max(8, next_pow2(k + 2))``).
    No slot mapping, never prefix-cached.
    """

    @property
    def prefix_cacheable(self) -> bool:
        return False

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return self.page_size_bytes

    def max_num_blocks_per_req(self, max_model_len: int) -> int:
        return 1


def _uniform_base(spec: KVCacheSpec) -> type[KVCacheSpec]:
    """The family a spec is grouped with (vLLM's ``uniform_type_base_spec``)."""
    for base in (
        CircularBufferSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
        ChunkedLocalAttentionSpec,
        CrossAttentionSpec,
        SinkFullAttentionSpec,
        RSWASpec,
        FullAttentionSpec,
    ):
        if isinstance(spec, base):
            return base
    return type(spec)


# ---------------------------------------------------------------------------------------------
# Uniform-type container
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """Several layers of one type (same token slots and block size), page sizes may differ.

    The allocator treats the group as its first member spec (``first_spec``). ``page_size_bytes``
    is the sum over the layers: one block of the group holds one page of every layer.
    """

    kv_cache_specs: Mapping[str, KVCacheSpec]

    def _validate(self) -> None:
        specs = dict(self.kv_cache_specs)
        object.__setattr__(self, "kv_cache_specs", specs)
        if not specs:
            raise ValueError("UniformTypeKVCacheSpecs.kv_cache_specs must not be empty")
        sizes = {spec.block_size for spec in specs.values()}
        if sizes != {self.block_size}:
            raise ValueError(
                f"UniformTypeKVCacheSpecs(block_size={self.block_size}): member block sizes "
                f"{sorted(sizes)} must all equal it"
            )
        if not self.is_uniform_type(specs):
            kinds = sorted({type(spec).__name__ for spec in specs.values()})
            raise ValueError(
                f"UniformTypeKVCacheSpecs members are not of one uniform type: {kinds}"
            )

    def __hash__(self) -> int:
        return hash((self.block_size, tuple(self.kv_cache_specs.items())))

    @property
    def first_spec(self) -> KVCacheSpec:
        """The member spec the allocator uses for the whole group."""
        return next(iter(self.kv_cache_specs.values()))

    @property
    def prefix_cacheable(self) -> bool:
        return all(spec.prefix_cacheable for spec in self.kv_cache_specs.values())

    @property
    def prefix_replay_tokens(self) -> int:
        return max(spec.prefix_replay_tokens for spec in self.kv_cache_specs.values())

    @property
    def page_size_bytes(self) -> int:
        return sum(spec.page_size_bytes for spec in self.kv_cache_specs.values())

    @property
    def real_page_size_bytes(self) -> int:
        return sum(spec.real_page_size_bytes for spec in self.kv_cache_specs.values())

    def max_memory_usage_pages(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Most blocks one request needs in this group (max over the layers)."""
        return max(
            cdiv(
                spec.max_memory_usage_bytes(max_model_len, max_num_batched_tokens),
                spec.page_size_bytes,
            )
            for spec in self.kv_cache_specs.values()
        )

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        pages = self.max_memory_usage_pages(max_model_len, max_num_batched_tokens)
        return pages * self.page_size_bytes

    def max_num_blocks_per_req(self, max_model_len: int) -> int:
        return self.first_spec.max_num_blocks_per_req(max_model_len)

    def max_admission_blocks_per_request(
        self, max_model_len: int, max_num_batched_tokens: int
    ) -> int:
        """Admission cap of the member specs (they share token slots, so one value)."""
        return self.max_memory_usage_pages(max_model_len, max_num_batched_tokens)

    def get_max_layers_per_page_size(self) -> int:
        """Count of the most common page size (the repeats of a balanced layer pattern)."""
        counts = Counter(spec.page_size_bytes for spec in self.kv_cache_specs.values())
        return counts.most_common(1)[0][1]

    def copy_with_new_block_size(self, block_size: int) -> Self:
        specs = {
            name: spec.copy_with_new_block_size(block_size)
            for name, spec in self.kv_cache_specs.items()
        }
        return type(self)(block_size=block_size, kv_cache_specs=specs)

    @classmethod
    def is_uniform_type(cls, kv_cache_specs: Mapping[str, KVCacheSpec]) -> bool:
        """Whether all specs share one block size and one uniform type."""
        specs = list(kv_cache_specs.values())
        if not specs or len({spec.block_size for spec in specs}) > 1:
            return False
        return specs[0].is_uniform_with(specs)

    @classmethod
    def from_specs(cls, kv_cache_specs: Mapping[str, KVCacheSpec]) -> Self | None:
        """The container for these specs, or None if they are not of one uniform type."""
        if not cls.is_uniform_type(kv_cache_specs):
            return None
        block_size = next(iter(kv_cache_specs.values())).block_size
        return cls(block_size=block_size, kv_cache_specs=kv_cache_specs)


def iter_layer_specs(spec: KVCacheSpec) -> tuple[KVCacheSpec, ...]:
    """The per-layer specs a group spec covers (members of a uniform container, or itself)."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return tuple(spec.kv_cache_specs.values())
    return (spec,)


# ---------------------------------------------------------------------------------------------
# Configuration objects
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KVCacheTensor:
    """One backing buffer (or a view into the shared pool buffer) and the layers using it.

    Layer-outermost (``block_stride=None``): block ``b`` of each layer in ``shared_by`` at
    ``b * page_size_bytes``. Packed (``block_stride`` set): block ``b`` of the layer at
    ``offset + b * block_stride`` (docs/allocator_internals.md, section 7).
    """

    size: int
    shared_by: list[str]
    offset: int = 0
    block_stride: int | None = None


@dataclass(frozen=True, slots=True)
class KVCacheGroupSpec:
    """Layers sharing one block table (one manager). ``is_eagle_group``: holds the drafter's
    layers (vLLM drops the last matched block of such groups on a prefix hit)."""

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec
    is_eagle_group: bool = False


@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    """The static cache layout: one shared pool of ``num_blocks`` blocks (block 0 is the null
    block), the tensors backing it and the groups drawing from it. Pure data; the device side
    reads it to build its page arrays."""

    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor]
    kv_cache_groups: list[KVCacheGroupSpec]

    @property
    def has_mixed_precision_kv_cache(self) -> bool:
        """Whether the attention caches use more than one (dtype, quant mode) pair."""
        precisions = {
            (spec.dtype, spec.kv_quant_mode)
            for group in self.kv_cache_groups
            for spec in iter_layer_specs(group.kv_cache_spec)
            if isinstance(spec, AttentionSpec)
        }
        return len(precisions) > 1

    @property
    def needs_kv_cache_zeroing(self) -> bool:
        """Whether new blocks must be zeroed: a block reused by a group of another precision
        could decode stale bytes as NaN/Inf. (vLLM also zeroes for Mamba, which we lack.)"""
        return self.has_mixed_precision_kv_cache
