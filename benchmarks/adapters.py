"""Adapters that expose our ``cache.KVCacheManager`` and vLLM 0.32's ``KVCacheManager`` to the
benchmark loop in :mod:`benchmarks.workload`.

Both adapters are thin: they forward to the manager and translate the few places where the two
APIs differ (vLLM's ``get_computed_blocks`` returns a 3-tuple whose third entry the vLLM scheduler
stores on ``request.shared_prefix_boundary``; vLLM's Request needs ``SamplingParams`` and a
status). vLLM is imported lazily and only by :class:`VllmAdapter`; it is never a dependency of the
project.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any

__all__ = ["OursAdapter", "VllmAdapter", "resolve_block_sizes", "vllm_available"]


def vllm_available() -> bool:
    try:
        import vllm.v1.core.kv_cache_manager  # noqa: F401
    except Exception:
        return False
    return True


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


def _prefix_replay_tokens(kv_cache_config: Any) -> int:
    """Bounded-replay window declared by the layout (vLLM: ``spec.prefix_replay_tokens``)."""
    out = 0
    for g in kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        members = getattr(spec, "kv_cache_specs", None)
        for s in members.values() if members else (spec,):
            w = getattr(s, "prefix_replay_tokens", None)
            if w is None:
                w = s.sliding_window if getattr(s, "bounded_replay", False) else 0
            out = max(out, int(w))
    return out


def _ids(blocks: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(b.block_id for b in g) for g in blocks.blocks)


# --------------------------------------------------------------------------------------------
# Ours
# --------------------------------------------------------------------------------------------


class OursAdapter:
    name = "ours"

    def __init__(
        self,
        kv_cache_config: Any,
        max_model_len: int,
        *,
        max_num_batched_tokens: int,
        prefix_cache_retention_interval: int | None = 0,
        enable_caching: bool = True,
    ) -> None:
        import cache

        self._Request = cache.Request
        self.mgr = cache.KVCacheManager(
            kv_cache_config,
            max_model_len,
            enable_caching=enable_caching,
            max_num_batched_tokens=max_num_batched_tokens,
            prefix_cache_retention_interval=prefix_cache_retention_interval,
            log_stats=False,
        )
        self.hash_block_size = self.mgr.hash_block_size
        self.scheduler_block_size = self.mgr.scheduler_block_size
        self.prefix_replay_tokens = _prefix_replay_tokens(kv_cache_config)
        params = inspect.signature(self.mgr.allocate_slots).parameters
        self.supports_full_sequence_must_fit = "full_sequence_must_fit" in params
        self.supports_has_scheduled_reqs = "has_scheduled_reqs" in params
        self._alloc = self.mgr.allocate_slots
        self._get = self.mgr.get_computed_blocks
        self._free = self.mgr.free
        self._empty = None

    def make_request(self, request_id: str, prompt: list[int], max_tokens: int) -> Any:
        return self._Request(
            request_id, prompt, hash_block_size=self.hash_block_size, max_tokens=max_tokens
        )

    def get_computed_blocks(self, req: Any) -> tuple[Any, int]:
        blocks, hit = self._get(req)[:2]
        if self._empty is None and not any(blocks.blocks):
            self._empty = blocks
        return blocks, hit

    def allocate_slots(
        self,
        req: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
        num_lookahead_tokens: int = 0,
        *,
        admission: bool = False,
        full_sequence_must_fit: bool = False,
        has_scheduled_reqs: bool = True,
    ) -> Any:
        if admission:
            kw: dict[str, Any] = {}
            if self.supports_full_sequence_must_fit:
                kw["full_sequence_must_fit"] = full_sequence_must_fit
            if self.supports_has_scheduled_reqs:
                kw["has_scheduled_reqs"] = has_scheduled_reqs
            return self._alloc(
                req,
                num_new_tokens,
                num_new_computed_tokens,
                new_computed_blocks,
                num_lookahead_tokens,
                **kw,
            )
        return self._alloc(req, num_new_tokens, num_lookahead_tokens=num_lookahead_tokens)

    def free(self, req: Any) -> None:
        self._free(req)

    def append_output_token(self, req: Any, token: int) -> None:
        req.append_output_token_ids(token)

    def set_num_computed_tokens(self, req: Any, n: int) -> None:
        req.num_computed_tokens = n

    def set_status(self, req: Any, status: str) -> None:
        if status == "preempted":
            req.num_preemptions += 1

    def empty_blocks(self) -> Any:
        if self._empty is None:
            from cache import KVCacheBlocks

            self._empty = KVCacheBlocks(tuple(() for _ in range(self.mgr.num_kv_cache_groups)))
        return self._empty

    def block_ids(self, blocks: Any) -> tuple[tuple[int, ...], ...]:
        return _ids(blocks)


# --------------------------------------------------------------------------------------------
# vLLM 0.32
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


class VllmAdapter:
    name = "vllm"

    def __init__(
        self,
        kv_cache_config: Any,
        max_model_len: int,
        *,
        max_num_batched_tokens: int,
        prefix_cache_retention_interval: int | None = 0,
        enable_caching: bool = True,
    ) -> None:
        import logging

        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.request import Request, RequestStatus

        logging.getLogger("vllm").setLevel(logging.ERROR)
        self._Request = Request
        self._RUNNING = RequestStatus.RUNNING
        self._PREEMPTED = RequestStatus.PREEMPTED
        # One shared SamplingParams: the allocator never reads max_tokens; the loop stops turns.
        self._sp = SamplingParams(max_tokens=1 << 20)
        self.vllm_config = to_vllm_config(kv_cache_config, prefix_cache_retention_interval)
        sched_bs, hash_bs = resolve_block_sizes(kv_cache_config)
        self.scheduler_block_size, self.hash_block_size = sched_bs, hash_bs
        kv_cache_utils.init_none_hash(sha256)
        self._hasher = kv_cache_utils.get_request_block_hasher(hash_bs, sha256)
        # Scheduler.__init__ (sync scheduling): max_in_flight_tokens =
        # max_concurrent_batches(1) * max_num_batched_tokens; eagle off; watermark 0.
        self.mgr = KVCacheManager(
            kv_cache_config=self.vllm_config,
            max_model_len=max_model_len,
            scheduler_block_size=sched_bs,
            hash_block_size=hash_bs,
            max_in_flight_tokens=max_num_batched_tokens,
            enable_caching=enable_caching,
            use_eagle=False,
            log_stats=False,
            enable_kv_cache_events=False,
        )
        self.prefix_replay_tokens = _prefix_replay_tokens(self.vllm_config)
        self._alloc = self.mgr.allocate_slots
        self._get = self.mgr.get_computed_blocks
        self._free = self.mgr.free

    def make_request(self, request_id: str, prompt: list[int], max_tokens: int) -> Any:
        return self._Request(
            request_id,
            prompt,
            sampling_params=self._sp,
            pooling_params=None,
            arrival_time=0.0,
            block_hasher=self._hasher,
        )

    def get_computed_blocks(self, req: Any) -> tuple[Any, int]:
        # Scheduler._get_local_prefix_cache_hit: the boundary is stored on the request.
        blocks, hit, req.shared_prefix_boundary = self._get(req)
        return blocks, hit

    def allocate_slots(
        self,
        req: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
        num_lookahead_tokens: int = 0,
        *,
        admission: bool = False,
        full_sequence_must_fit: bool = False,
        has_scheduled_reqs: bool = True,
    ) -> Any:
        if admission:
            return self._alloc(
                req,
                num_new_tokens,
                num_new_computed_tokens=num_new_computed_tokens,
                new_computed_blocks=new_computed_blocks,
                num_lookahead_tokens=num_lookahead_tokens,
                full_sequence_must_fit=full_sequence_must_fit,
                has_scheduled_reqs=has_scheduled_reqs,
            )
        return self._alloc(req, num_new_tokens, num_lookahead_tokens=num_lookahead_tokens)

    def free(self, req: Any) -> None:
        self._free(req)

    def append_output_token(self, req: Any, token: int) -> None:
        req.append_output_token_ids(token)

    def set_num_computed_tokens(self, req: Any, n: int) -> None:
        req.num_computed_tokens = n

    def set_status(self, req: Any, status: str) -> None:
        if status == "running":
            req.status = self._RUNNING
        else:
            req.status = self._PREEMPTED
            req.num_preemptions += 1

    def empty_blocks(self) -> Any:
        return self.mgr.empty_kv_cache_blocks

    def block_ids(self, blocks: Any) -> tuple[tuple[int, ...], ...]:
        return _ids(blocks)
