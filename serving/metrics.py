"""Engine-wide figures: compilations, throughput, prefix-cache hits, KV usage, preemptions.

`compilation_count()` counts XLA backend compilations in this process (`jax.monitoring`
listeners), so tests can prove nothing compiles after warm-up; executables loaded from the
persistent compilation cache count apart (`persistent_cache_hits()`), not as compilations.
"""

from __future__ import annotations

import dataclasses
import threading

import jax

__all__ = ["EngineStats", "compilation_count", "count_program_load", "persistent_cache_hits"]

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_lock = threading.Lock()
_counts = {"compilations": 0, "cache_hits": 0, "program_loads": 0}
_installed = False


def _on_duration(event: str, duration: float, **_: object) -> None:
    if event == _COMPILE_EVENT:
        with _lock:
            _counts["compilations"] += 1


def _on_event(event: str, **_: object) -> None:
    if event == _CACHE_HIT_EVENT:
        with _lock:
            _counts["cache_hits"] += 1


def _install() -> None:
    global _installed
    with _lock:
        if _installed:
            return
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        jax.monitoring.register_event_listener(_on_event)
        _installed = True


def compilation_count() -> int:
    """XLA compilations in this process since the engine module was first used (executables
    loaded from the persistent cache excluded)."""
    _install()
    with _lock:
        return _counts["compilations"] - _counts["cache_hits"]


def persistent_cache_hits() -> int:
    """Executables loaded instead of compiled: from JAX's persistent compilation cache, and the
    step programs loaded from theirs (`serving.programs`, `count_program_load`)."""
    _install()
    with _lock:
        return _counts["cache_hits"] + _counts["program_loads"]


def count_program_load() -> None:
    """Count one step program loaded from `serving.programs`' folder (no JAX event says so)."""
    with _lock:
        _counts["program_loads"] += 1


@dataclasses.dataclass(slots=True)
class EngineStats:
    """Totals since the engine started (`Engine.stats`)."""

    num_steps: int = 0
    num_requests_finished: int = 0
    num_prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission)
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    # Tokens whose KV was computed before and is computed again: bounded replay of prefix
    # hits plus recompute after preemption (`serving.scheduler.SchedulerStats`).
    num_recomputed_tokens: int = 0
    num_replay_tokens: int = 0  # of them, bounded-replay tokens
    # Prompt tokens of first admissions, and of them the prefix-cache hits they were admitted
    # with (bounded-replay tokens included), `SchedulerStats.prefix_queries / prefix_hits`.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # speculative decoding (vLLM's SpecDecodingStats, summed): verifications, draft tokens
    # verified, accepted, and per draft position how many were verified / accepted
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_draft_tokens_per_pos: list[int] = dataclasses.field(default_factory=list)
    spec_accepted_tokens_per_pos: list[int] = dataclasses.field(default_factory=list)
    kv_cache_usage: float = 0.0  # fraction of blocks in use after the last step
    # (per KV-cache group: `Engine.kv_cache_usage_per_group()`, computed on demand)
    warm_up_s: float = 0.0
    warm_up_programs: int = 0  # programs the warm-up ran (its progress bar's count)
    warm_up_compilations: int = 0
    warm_up_cache_hits: int = 0  # executables the warm-up loaded from the persistent cache
    compilations_after_warm_up: int = 0
    elapsed_s: float = 0.0  # wall time spent inside Engine.step
    host_s: float = 0.0  # of it: scheduling, batch building, output processing
    wait_s: float = 0.0  # of it: waiting for the device's results

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted over verified draft tokens (0 without drafts)."""
        n = self.spec_num_draft_tokens
        return self.spec_num_accepted_tokens / n if n else 0.0

    @property
    def spec_mean_acceptance_length(self) -> float:
        """Tokens a verification emits on average: 1 + accepted drafts (vLLM's figure)."""
        n = self.spec_num_drafts
        return 1 + self.spec_num_accepted_tokens / n if n else 0.0

    @property
    def spec_acceptance_per_pos(self) -> list[float]:
        """Per draft position: accepted over verified."""
        return [
            a / d if d else 0.0
            for a, d in zip(self.spec_accepted_tokens_per_pos, self.spec_draft_tokens_per_pos)
        ]

    def observe_spec(self, spec) -> None:
        """Add one step's `serving.scheduler.SpecDecodingStats`."""
        self.spec_num_drafts += spec.num_drafts
        self.spec_num_draft_tokens += spec.num_draft_tokens
        self.spec_num_accepted_tokens += spec.num_accepted_tokens
        for name, values in (
            ("spec_draft_tokens_per_pos", spec.num_draft_tokens_per_pos),
            ("spec_accepted_tokens_per_pos", spec.num_accepted_tokens_per_pos),
        ):
            mine = getattr(self, name)
            mine.extend([0] * (len(values) - len(mine)))
            for i, v in enumerate(values):
                mine[i] += v

    @property
    def generation_tokens_per_s(self) -> float:
        return self.num_generation_tokens / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.num_requests_finished / self.elapsed_s if self.elapsed_s else 0.0

    def as_dict(self) -> dict[str, float | int]:
        out = dataclasses.asdict(self)
        out["prefix_cache_hit_rate"] = self.prefix_cache_hit_rate
        out["generation_tokens_per_s"] = self.generation_tokens_per_s
        out["requests_per_s"] = self.requests_per_s
        out["spec_acceptance_rate"] = self.spec_acceptance_rate
        out["spec_mean_acceptance_length"] = self.spec_mean_acceptance_length
        return out
