"""The KV-cache managers the allocator benchmark drives: ours, and vLLM 0.32's behind an adapter
shaped like ours.

vLLM is imported lazily (`VllmKVCacheManager.from_config`); it is never a dependency of the
project. Details: docs/benchmarks.md#benchmarksadapters.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any

from cache import KVCacheManager, Request

__all__ = [
    "MANAGER_KINDS",
    "MirroredRequest",
    "VllmKVCacheManager",
    "make_manager",
    "prefix_replay_tokens",
    "resolve_block_sizes",
    "to_vllm_config",
    "to_vllm_spec",
    "vllm_available",
]

MANAGER_KINDS = ("ours", "vllm")


def vllm_available() -> bool:
    try:
        import vllm.v1.core.kv_cache_manager  # noqa: F401
    except Exception:
        return False
    return True


def make_manager(
    kind: str,
    kv_cache_config: Any,
    max_model_len: int,
    *,
    max_num_batched_tokens: int,
    prefix_cache_retention_interval: int | None = 0,
    enable_caching: bool = True,
) -> Any:
    """A fresh manager of ``kind`` ("ours": `cache.KVCacheManager`; "vllm":
    `VllmKVCacheManager` over vLLM 0.32's) for ``kv_cache_config`` (our config), statistics off.

    Raises:
        ValueError: ``kind`` is not one of ``MANAGER_KINDS``.
    """
    if kind == "ours":
        return KVCacheManager(
            kv_cache_config,
            max_model_len,
            enable_caching=enable_caching,
            max_num_batched_tokens=max_num_batched_tokens,
            prefix_cache_retention_interval=prefix_cache_retention_interval,
            log_stats=False,
        )
    if kind == "vllm":
        return VllmKVCacheManager.from_config(
            kv_cache_config,
            max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            prefix_cache_retention_interval=prefix_cache_retention_interval,
            enable_caching=enable_caching,
        )
    raise ValueError(f"unknown manager kind {kind!r}; choose from {MANAGER_KINDS}")


def _prefix_cacheable(spec: Any) -> bool:
    pc = getattr(spec, "prefix_cacheable", True)
    return bool(pc)


def resolve_block_sizes(kv_cache_config: Any) -> tuple[int, int]:
    """(scheduler_block_size, hash_block_size) by vLLM 0.32's rule
    (``kv_cache_utils.resolve_kv_cache_block_sizes`` with prefix caching on, no DCP, no Mamba):
    one group -> (B, B); several -> (lcm of all group block sizes, gcd of the prefix-cacheable
    ones, or of all when none is cacheable)."""
    groups = kv_cache_config.kv_cache_groups
    sizes = [g.kv_cache_spec.block_size for g in groups]
    if len(groups) <= 1:
        return sizes[0], sizes[0]
    sched = math.lcm(*sizes)
    cacheable = [
        g.kv_cache_spec.block_size for g in groups if _prefix_cacheable(g.kv_cache_spec)
    ] or sizes
    return sched, math.gcd(*cacheable)


def prefix_replay_tokens(vllm_kv_cache_config: Any) -> int:
    """vLLM 0.32 ``Scheduler.prefix_replay_tokens``: the one bounded-replay window of the groups
    whose spec declares ``prefix_replay_tokens > 0`` (0: no bounded replay).

    Raises:
        ValueError: the groups declare different windows (vLLM asserts they agree).
    """
    windows = {
        w
        for g in vllm_kv_cache_config.kv_cache_groups
        if (w := g.kv_cache_spec.prefix_replay_tokens) > 0
    }
    if len(windows) > 1:
        raise ValueError(f"prefix replay windows should agree, got {sorted(windows)}")
    return windows.pop() if windows else 0


# --------------------------------------------------------------------------------------------
# vLLM 0.32: specs and config
# --------------------------------------------------------------------------------------------

# Our spec class name -> vLLM 0.32 class name (same names; listed to fail loudly on a new one).
_VLLM_SPEC_CLASSES = {
    "FullAttentionSpec": "FullAttentionSpec",
    "MLAAttentionSpec": "MLAAttentionSpec",
    "HiddenStateCacheSpec": "HiddenStateCacheSpec",
    "SlidingWindowSpec": "SlidingWindowSpec",
    "SlidingWindowMLASpec": "SlidingWindowMLASpec",
    "ChunkedLocalAttentionSpec": "ChunkedLocalAttentionSpec",
    "CrossAttentionSpec": "CrossAttentionSpec",
    "SinkFullAttentionSpec": "SinkFullAttentionSpec",
    "RSWASpec": "RSWASpec",
    "CircularBufferSpec": "CircularBufferSpec",
}
# Manager-relevant scalar fields copied from our spec when both sides have them.
_COPY_FIELDS = (
    "sliding_window",
    "attention_chunk_size",
    "sink_len",
    "rswa_window",
    "bounded_replay",
    "extra_retained_tokens",
    "tokens_per_state",
    "model_version",
)


def to_vllm_spec(spec: Any) -> Any:
    """Build the vLLM 0.32 spec that behaves like ``spec`` in the allocator. Page sizes are not
    mirrored (the allocator only sees ``num_blocks``)."""
    import torch
    from vllm.v1 import kv_cache_interface as kvi

    cls_name = type(spec).__name__
    if cls_name == "UniformTypeKVCacheSpecs":
        return kvi.UniformTypeKVCacheSpecs(
            block_size=spec.block_size,
            kv_cache_specs={k: to_vllm_spec(v) for k, v in spec.kv_cache_specs.items()},
        )
    if cls_name not in _VLLM_SPEC_CLASSES:
        raise TypeError(f"no vLLM counterpart for spec class {cls_name}")
    vcls = getattr(kvi, _VLLM_SPEC_CLASSES[cls_name])
    vfields = {f.name for f in dataclasses.fields(vcls)}
    kw: dict[str, Any] = {
        "block_size": spec.block_size,
        "num_kv_heads": 1,
        "head_size": 64,
        "dtype": torch.bfloat16,
    }
    for name in _COPY_FIELDS:
        if name in vfields and hasattr(spec, name):
            val = getattr(spec, name)
            if val is not None:
                kw[name] = val
    if "tokens_per_state" in vfields and "tokens_per_state" not in kw:
        ratio = getattr(spec, "compress_ratio", None)
        if isinstance(ratio, int) and ratio > 1:
            kw["tokens_per_state"] = ratio
    return vcls(**kw)


def to_vllm_config(kv_cache_config: Any, prefix_cache_retention_interval: int | None) -> Any:
    """vLLM's *scheduler-side* config for ours: like ``generate_scheduler_kv_cache_config``, a
    ``UniformTypeKVCacheSpecs`` group is represented by its first member spec."""
    from vllm.v1 import kv_cache_interface as kvi
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config

    groups = [
        kvi.KVCacheGroupSpec(
            list(g.layer_names),
            to_vllm_spec(g.kv_cache_spec),
            is_eagle_group=bool(getattr(g, "is_eagle_group", False)),
        )
        for g in kv_cache_config.kv_cache_groups
    ]
    worker_cfg = kvi.KVCacheConfig(
        num_blocks=kv_cache_config.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        prefix_cache_retention_interval=prefix_cache_retention_interval,
    )
    return generate_scheduler_kv_cache_config([worker_cfg])


# --------------------------------------------------------------------------------------------
# vLLM 0.32: our manager's interface
# --------------------------------------------------------------------------------------------


def _on_vllm_request(name: str) -> property:
    """An attribute of `MirroredRequest` that lives on its vLLM request."""

    def get(self):
        return getattr(self.vllm_request, name)

    def set_(self, value) -> None:
        setattr(self.vllm_request, name, value)

    return property(get, set_)


class MirroredRequest(Request):
    """Our `cache.Request` (what the Scheduler reads and writes) paired with the vLLM
    ``Request`` that vLLM's manager reads.

    The Scheduler's progress fields live on the vLLM request, so both views always agree; only the
    vLLM request is hashed. Details: docs/benchmarks.md#benchmarksadaptersmirroredrequest.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        vllm_request: Any,
        *,
        preempted_status: Any,
        **kwargs: Any,
    ) -> None:
        self.vllm_request = vllm_request
        self._preempted_status = preempted_status
        super().__init__(request_id, prompt_token_ids, **kwargs)

    # the Scheduler's progress fields: read and written on the vLLM request
    num_computed_tokens = _on_vllm_request("num_computed_tokens")
    num_in_flight_tokens = _on_vllm_request("num_in_flight_tokens")
    spec_token_ids = _on_vllm_request("spec_token_ids")
    shared_prefix_boundary = _on_vllm_request("shared_prefix_boundary")

    @property
    def num_preemptions(self) -> int:
        return self.vllm_request.num_preemptions

    @num_preemptions.setter
    def num_preemptions(self, value: int) -> None:
        vllm_request = self.vllm_request
        if value > vllm_request.num_preemptions:
            vllm_request.status = self._preempted_status
        vllm_request.num_preemptions = value

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        if not isinstance(token_ids, int):
            token_ids = list(token_ids)
        super().append_output_token_ids(token_ids)
        self.vllm_request.append_output_token_ids(token_ids)


class VllmKVCacheManager:
    """`cache.KVCacheManager`'s interface over ``manager``, a vLLM 0.32 ``KVCacheManager`` (or one
    shaped like it), driven as vLLM's scheduler drives it: docs/benchmarks.md#benchmarksadapters.

    Args:
        new_vllm_request: ``(request_id, prompt_token_ids) -> vLLM Request``, hashed per block.
        hash_block_size, scheduler_block_size: the block sizes ``manager`` was built with.
        prefix_replay_tokens: the bounded-replay window (vLLM's; 0: none).
        running_status, preempted_status: vLLM's ``RequestStatus.RUNNING`` / ``PREEMPTED``.
    """

    def __init__(
        self,
        manager: Any,
        new_vllm_request: Callable[[str, list[int]], Any],
        *,
        hash_block_size: int,
        scheduler_block_size: int,
        prefix_replay_tokens: int,
        running_status: Any,
        preempted_status: Any,
    ) -> None:
        self.manager = manager
        self.hash_block_size = hash_block_size
        self.scheduler_block_size = scheduler_block_size
        self.num_kv_cache_groups = manager.num_kv_cache_groups
        self.empty_kv_cache_blocks = manager.empty_kv_cache_blocks
        self.prefix_replay_tokens = prefix_replay_tokens
        self.raw_num_hit_tokens = 0  # of the last get_computed_blocks, before the replay drop
        self._new_vllm_request = new_vllm_request
        self._running = running_status
        self._preempted = preempted_status
        self._get = manager.get_computed_blocks
        self._allocate = manager.allocate_slots
        self._free = manager.free

    @classmethod
    def from_config(
        cls,
        kv_cache_config: Any,
        max_model_len: int,
        *,
        max_num_batched_tokens: int,
        prefix_cache_retention_interval: int | None = 0,
        enable_caching: bool = True,
    ) -> VllmKVCacheManager:
        """vLLM 0.32's manager for our ``kv_cache_config``, built as vLLM's ``Scheduler`` builds
        it under synchronous scheduling (``max_in_flight_tokens = max_num_batched_tokens``, no
        EAGLE, no events, no stats), with SHA-256 block hashes."""
        import logging

        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
        from vllm.v1.request import Request as VllmRequest
        from vllm.v1.request import RequestStatus

        logging.getLogger("vllm").setLevel(logging.ERROR)
        vllm_config = to_vllm_config(kv_cache_config, prefix_cache_retention_interval)
        scheduler_block_size, hash_block_size = resolve_block_sizes(kv_cache_config)
        kv_cache_utils.init_none_hash(sha256)
        hasher = kv_cache_utils.get_request_block_hasher(hash_block_size, sha256)
        # One shared SamplingParams: vLLM's manager never reads it; our Scheduler stops turns.
        sampling_params = SamplingParams(max_tokens=1 << 20)
        manager = VllmManager(
            kv_cache_config=vllm_config,
            max_model_len=max_model_len,
            scheduler_block_size=scheduler_block_size,
            hash_block_size=hash_block_size,
            max_in_flight_tokens=max_num_batched_tokens,
            enable_caching=enable_caching,
            use_eagle=False,
            log_stats=False,
            enable_kv_cache_events=False,
        )

        def new_vllm_request(request_id: str, prompt_token_ids: list[int]) -> Any:
            return VllmRequest(
                request_id,
                prompt_token_ids,
                sampling_params=sampling_params,
                pooling_params=None,
                arrival_time=0.0,
                block_hasher=hasher,
            )

        return cls(
            manager,
            new_vllm_request,
            hash_block_size=hash_block_size,
            scheduler_block_size=scheduler_block_size,
            prefix_replay_tokens=prefix_replay_tokens(vllm_config),
            running_status=RequestStatus.RUNNING,
            preempted_status=RequestStatus.PREEMPTED,
        )

    @property
    def usage(self) -> float:
        return self.manager.usage

    def new_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        *,
        max_tokens: int | None = None,
        priority: int = 0,
        arrival_time: float = 0.0,
    ) -> MirroredRequest:
        """Our request and its vLLM twin (only these scheduling fields are mirrored; nothing
        that changes the block hashes, such as a cache salt, is supported)."""
        prompt = list(prompt_token_ids)
        return MirroredRequest(
            request_id,
            prompt,
            self._new_vllm_request(request_id, prompt),
            preempted_status=self._preempted,
            max_tokens=max_tokens,
            priority=priority,
            arrival_time=arrival_time,
        )

    def get_computed_blocks(self, request: MirroredRequest) -> tuple[Any, int]:
        vllm_request = request.vllm_request
        blocks, num_hits, vllm_request.shared_prefix_boundary = self._get(vllm_request)
        self.raw_num_hit_tokens = num_hits
        if 0 < num_hits <= self.prefix_replay_tokens:
            # vLLM's scheduler: a hit no longer than the replayed window saves nothing.
            return self.empty_kv_cache_blocks, 0
        return blocks, num_hits

    def num_replay_tokens(self, num_hit_tokens: int) -> int:
        return min(self.prefix_replay_tokens, num_hit_tokens)

    def allocate_slots(
        self,
        request: MirroredRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
        num_lookahead_tokens: int = 0,
        **kwargs: Any,
    ) -> Any:
        """vLLM's ``allocate_slots``; ``kwargs`` are our keyword-only arguments (vLLM 0.32
        has each under the same name)."""
        vllm_request = request.vllm_request
        blocks = self._allocate(
            vllm_request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            **kwargs,
        )
        if blocks is not None:
            vllm_request.status = self._running
        return blocks

    def free(self, request: MirroredRequest) -> None:
        self._free(request.vllm_request)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.manager.get_block_ids(request_id)

    def get_num_common_prefix_blocks(self, request_id: str) -> list[int]:
        return self.manager.get_num_common_prefix_blocks(request_id)
