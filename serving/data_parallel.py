"""Data-parallel serving: D engine shards, each with its own scheduler, allocator, requests and
pages, stepping in lockstep through one program (vLLM's data-parallel attention for DeepSeek).

vLLM runs a DeepSeek model with ``data_parallel_size`` D as D engine cores: each rank has its own
scheduler and KV cache and holds whole requests; a coordinator sends each new request to the
least loaded rank, and every step the ranks' tokens meet in one expert-parallel MoE. Here the D
shards are one host program:

- `DataParallelScheduler` holds D `serving.scheduler.Scheduler`s (each over its own
  `cache.KVCacheManager`), routes every new request to the shard with the least load (vLLM's
  score: 4 x waiting + running, the lowest index on ties) and plans a step as D plans
  (`DataParallelOutput`: their union, and each shard's own plan). A request stays on its shard
  for its whole life: preempted, it waits in that shard's queue and comes back to its pages.
- `DataParallelRunner` holds D host halves of `serving.runner.ModelRunner` (slots, registered
  requests, the tokens each knows) and the stacked device state: every pool, the sampler state
  and the slots with a leading shard axis [D, ...]. A step builds each shard's batch with the
  same token, request and table-width buckets, stacks them, and dispatches one jitted step
  (`serving.runner.engine_step_data_parallel`): each shard's attention reads only its own
  pages (`dsv4.paged.step.paged_forward_streams` with its shard axis) and each shard samples
  its own rows, while everything per token runs on all shards' tokens at once.

On a mesh (`dsv4.sharding.make_mesh`), D is a multiple of the ``data`` axis (by default equal to
it): the shard axis of the pools, sampler state and slots is split over ``data``, so each data
group of devices holds only its shards' pages. Without a mesh the D shards run on one device,
which the CPU tests use.

Limits as in vLLM's per-rank engine: ``max_num_seqs``, ``max_num_batched_tokens`` and the pool
size are per shard. A request's tokens do not depend on which shard runs it (sampling keys are
fixed by the request and the position), so outputs equal those of one engine.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsv4 import sharding
from dsv4.paged import pools as P
from dsv4.paged.batch import bucket, table_width_buckets, widen_tables
from dsv4.paged.step import stack_shards
from serving import sampler as S
from serving.config import EngineConfig
from serving.programs import StepPrograms
from serving.runner import (
    ModelRunner,
    SlotState,
    StepOutput,
    engine_step_data_parallel,
    run_step,
    to_host,
    warm_up_on_mesh,
)
from serving.scheduler import (
    RequestStatus,
    Scheduler,
    SchedulerOutput,
    SpecDecodingStats,
    UpdateResult,
)

__all__ = [
    "DataParallelOutput",
    "DataParallelRunner",
    "DataParallelScheduler",
]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DataParallelOutput(SchedulerOutput):
    """One lockstep step of D shards: the union of their plans (the fields of
    `SchedulerOutput`, request ids being unique across shards) and each shard's own plan."""

    shards: tuple[SchedulerOutput, ...] = ()

    @classmethod
    def of(cls, shards: Sequence[SchedulerOutput]) -> DataParallelOutput:
        groups = len(shards[0].num_common_prefix_blocks)
        return cls(
            scheduled_new_reqs=[r for o in shards for r in o.scheduled_new_reqs],
            scheduled_cached_reqs=[r for o in shards for r in o.scheduled_cached_reqs],
            num_scheduled_tokens={k: v for o in shards for k, v in o.num_scheduled_tokens.items()},
            total_num_scheduled_tokens=sum(o.total_num_scheduled_tokens for o in shards),
            scheduled_spec_decode_tokens={
                k: v for o in shards for k, v in o.scheduled_spec_decode_tokens.items()
            },
            # cascade attention's common prefix holds only within a shard: none across
            num_common_prefix_blocks=[0] * groups,
            preempted_req_ids={r for o in shards for r in o.preempted_req_ids},
            finished_req_ids={r for o in shards for r in o.finished_req_ids},
            sampling_req_ids=frozenset(r for o in shards for r in o.sampling_req_ids),
            shards=tuple(shards),
        )


class DataParallelScheduler:
    """D `Scheduler`s behind the interface the engine drives (see the module docstring)."""

    def __init__(self, shards: Sequence[Scheduler]) -> None:
        if not shards:
            raise ValueError("DataParallelScheduler needs at least one shard")
        self.shards = list(shards)
        self._shard_of: dict[str, int] = {}  # live request id -> its shard
        self.num_routed = [0] * len(self.shards)  # requests each shard was given

    # the limits and switches are every shard's (built alike)
    def __getattr__(self, name: str) -> Any:
        if name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "async_scheduling",
            "num_spec_tokens",
            "drafts_on_device",
            "eos_token_id",
        ):
            return getattr(self.shards[0], name)
        raise AttributeError(name)

    @property
    def kv_cache_managers(self) -> list:
        return [s.kv_cache_manager for s in self.shards]

    @property
    def kv_cache_manager(self):
        """Shard 0's allocator (every shard's has the same config)."""
        return self.shards[0].kv_cache_manager

    @property
    def requests(self) -> dict:
        """Every shard's requests, by id."""
        return {k: v for s in self.shards for k, v in s.requests.items()}

    @property
    def running(self) -> list:
        return [r for s in self.shards for r in s.running]

    def shard_of(self, request_id: str) -> int:
        """The shard a live request runs on."""
        return self._shard_of[request_id]

    def add_request(self, request, stop=None) -> None:
        """Queue ``request`` on the least loaded shard (4 x waiting + running, vLLM's DP
        load balancing; the lowest index on ties)."""
        loads = [4 * len(s.waiting) + len(s.running) for s in self.shards]
        shard = loads.index(min(loads))
        self.shards[shard].add_request(request, stop)
        self._shard_of[request.request_id] = shard
        self.num_routed[shard] += 1

    def finish_requests(
        self,
        request_ids: str | Iterable[str],
        finished_status: RequestStatus = RequestStatus.FINISHED_ABORTED,
    ) -> list:
        """`Scheduler.finish_requests` on each request's shard.

        Raises:
            ValueError: an id no shard knows (nothing is finished then), or a status that is
                not a finished one.
        """
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        unknown = [i for i in ids if i not in self._shard_of]
        if unknown:
            raise ValueError(f"unknown request ids {unknown!r}")
        by_shard: dict[int, list[str]] = {}
        for request_id in dict.fromkeys(ids):
            by_shard.setdefault(self._shard_of[request_id], []).append(request_id)
        done = []
        for shard, shard_ids in sorted(by_shard.items()):
            done += self.shards[shard].finish_requests(shard_ids, finished_status)
        for request in done:
            self._shard_of.pop(request.request_id, None)
        return done

    def update_draft_token_ids(self, draft_token_ids: Mapping[str, list[int]]) -> None:
        by_shard: dict[int, dict[str, list[int]]] = {}
        for request_id, drafts in draft_token_ids.items():
            shard = self._shard_of.get(request_id)
            if shard is not None:
                by_shard.setdefault(shard, {})[request_id] = drafts
        for shard, drafts in by_shard.items():
            self.shards[shard].update_draft_token_ids(drafts)

    def stalled_request(self, output: DataParallelOutput, steps_in_flight: int):
        """The first shard's request that its idle pool cannot admit, or None."""
        for shard, out in zip(self.shards, output.shards, strict=True):
            stalled = shard.stalled_request(out, steps_in_flight)
            if stalled is not None:
                return stalled
        return None

    def has_unfinished_requests(self) -> bool:
        return any(s.has_unfinished_requests() for s in self.shards)

    def get_num_unfinished_requests(self) -> int:
        return sum(s.get_num_unfinished_requests() for s in self.shards)

    def schedule(self) -> DataParallelOutput:
        """Every shard plans its step (an idle shard plans an empty one)."""
        return DataParallelOutput.of([s.schedule() for s in self.shards])

    def update_from_output(
        self, scheduler_output: DataParallelOutput, sampled_token_ids: Mapping[str, list[int]]
    ) -> UpdateResult:
        """`Scheduler.update_from_output` on every shard with its own requests' tokens; the
        results merged (the KV usage is the shards' mean)."""
        results = []
        for shard, out in zip(self.shards, scheduler_output.shards, strict=True):
            mine = {
                r: sampled_token_ids[r] for r in out.num_scheduled_tokens if r in sampled_token_ids
            }
            results.append(shard.update_from_output(out, mine))
        finished = {k: v for r in results for k, v in r.finished.items()}
        for request_id in finished:
            self._shard_of.pop(request_id, None)
        spec = [r.spec_decoding_stats for r in results if r.spec_decoding_stats is not None]
        merged = None
        if spec:
            merged = SpecDecodingStats.new(spec[0].num_spec_tokens)
            for s in spec:
                merged.num_drafts += s.num_drafts
                merged.num_draft_tokens += s.num_draft_tokens
                merged.num_accepted_tokens += s.num_accepted_tokens
                for i in range(merged.num_spec_tokens):
                    merged.num_accepted_tokens_per_pos[i] += s.num_accepted_tokens_per_pos[i]
                    merged.num_draft_tokens_per_pos[i] += s.num_draft_tokens_per_pos[i]
        return UpdateResult(
            new_token_ids={k: v for r in results for k, v in r.new_token_ids.items()},
            finished=finished,
            stop_reasons={k: v for r in results for k, v in r.stop_reasons.items()},
            spec_decoding_stats=merged,
            num_running_reqs=sum(r.num_running_reqs for r in results),
            num_waiting_reqs=sum(r.num_waiting_reqs for r in results),
            kv_cache_usage=sum(r.kv_cache_usage for r in results) / len(results),
        )


class DataParallelHandle:
    """A dispatched lockstep step: its device results, fetched on demand (`fetch` blocks)."""

    def __init__(self, runner: DataParallelRunner, output: DataParallelOutput, rows, out) -> None:
        self.scheduler_output = output
        self._runner = runner
        self._rows = rows  # per shard, its `serving.input_batch.ScheduledRow`s
        self._device_out = out
        self._host: StepOutput | None = None

    def fetch(self) -> StepOutput:
        """Wait for the step, copy its small results to the host, let every shard learn its
        tokens, and merge the shards' outputs (idempotent)."""
        if self._host is None:
            sampled, plp = self._device_out
            wants_plp = any(row.prompt_logprobs for rows in self._rows for row in rows)
            sampled, plp = to_host((sampled, plp) if wants_plp else (sampled, None))
            merged = StepOutput({}, {}, {}, {})
            for i, (shard, rows) in enumerate(zip(self._runner.shards, self._rows, strict=True)):
                if not rows:
                    continue
                mine = (
                    tuple(x[i] for x in sampled),
                    None if plp is None else tuple(x[i] for x in plp),
                )
                out = shard.collect(rows, mine)
                merged.sampled_token_ids.update(out.sampled_token_ids)
                merged.logprobs.update(out.logprobs)
                merged.prompt_logprobs.update(out.prompt_logprobs)
                merged.draft_token_ids.update(out.draft_token_ids)
            self._host = merged
        return self._host


@functools.partial(jax.jit, donate_argnums=(0,))
def _write_shard_slot(state: S.SamplerState, shard, slot, counts, prompt_mask, stop_mask):
    """One slot's sampler rows in shard ``shard`` of a stacked sampler state."""
    one = jax.tree.map(lambda x: x[shard], state)
    one = S.write_slots(one, slot[None], counts[None], prompt_mask[None], stop_mask[None])
    return jax.tree.map(lambda x, y: x.at[shard].set(y), state, one)


class DataParallelRunner:
    """D `ModelRunner` host halves over one stacked device state (see the module docstring).

    Args:
        params, cfg, kv_cache_config, config, eos_token_id: as `ModelRunner`'s (every shard
            has its own pools of ``kv_cache_config``'s blocks; the DSpark drafter is seeded
            and reads its window caches per shard). D is the config's
            ``parallel_config.num_shards`` (a multiple of the mesh's ``data`` axis).
    """

    # one step a program: bursts (`ModelRunner.execute_burst`) run on one data shard only
    num_scheduler_steps = 1

    def __init__(
        self, params, cfg, kv_cache_config, config: EngineConfig, *, eos_token_id=None
    ) -> None:
        self.num_shards = config.parallel_config.num_shards
        if self.num_shards < 2:
            raise ValueError(f"DataParallelRunner needs num_shards >= 2, got {self.num_shards}")
        self.shards = [
            ModelRunner(
                params,
                cfg,
                kv_cache_config,
                config,
                eos_token_id=eos_token_id,
                write_sampler_rows=functools.partial(self._write_sampler_rows, i),
            )
            for i in range(self.num_shards)
        ]
        first = self.shards[0]
        self.mesh = mesh = first.mesh
        if mesh is not None:
            params = sharding.shard_params(params, cfg, mesh)
        self.params, self.cfg = params, cfg
        for name in (
            "kv_cache_config",
            "layout",
            "max_num_seqs",
            "max_model_len",
            "token_buckets",
            "table_buckets",
            "max_logprobs",
            "eos_token_id",
            "num_spec",
            "drafter",
            "plans_ahead",
            "padding_slot",
        ):
            setattr(self, name, getattr(first, name))
        self.static = first.static
        self.programs = StepPrograms(self.static)  # none built: each step runs through the jit
        k, slots, vocab = first.num_spec, first.max_num_seqs + 1, cfg.vocab_size
        fill = config.cache_config.fill
        self.pools = self._stacked(lambda: P.init_pools(first.layout, fill=fill))
        self.sampler_state = self._stacked(lambda: S.init_state(slots, vocab))
        self.slots = self._stacked(lambda: SlotState.zeros(slots, k))

    def _stacked(self, make):
        """``make()``'s tree with a leading shard axis [D, ...], built on the device (split
        over the mesh's ``data`` axis)."""
        d = self.num_shards

        def build():
            return jax.tree.map(lambda x: jnp.broadcast_to(x[None], (d, *x.shape)), make())

        if self.mesh is None:
            return jax.jit(build)()
        out = sharding.data_parallel_sharding(jax.eval_shape(build), self.mesh)
        return jax.jit(build, out_shardings=out)()

    def _write_sampler_rows(self, shard: int, slot: int, rows) -> None:
        self.sampler_state = _write_shard_slot(
            self.sampler_state, np.int32(shard), np.int32(slot), *rows
        )

    # ---------------------------------------------------------------- requests

    def register(self, request) -> None:
        """Every shard remembers the request (the scheduler picks its shard when it arrives;
        `finish` makes every shard forget it)."""
        for shard in self.shards:
            shard.register(request)

    def finish(self, request_ids: Iterable[str]) -> None:
        request_ids = list(request_ids)
        for shard in self.shards:
            shard.finish(request_ids)

    @property
    def requests(self) -> dict:
        return {k: v for shard in self.shards for k, v in shard.requests.items()}

    def set_draft_guesses(self, guesses) -> None:
        for shard in self.shards:
            shard.set_draft_guesses(guesses)

    def in_flight_drafts_usable(self, request_id: str) -> bool:
        return all(shard.in_flight_drafts_usable(request_id) for shard in self.shards)

    @property
    def num_free_slots(self) -> int:
        return sum(shard.num_free_slots for shard in self.shards)

    # ---------------------------------------------------------------- one step

    def execute(self, output: DataParallelOutput) -> DataParallelHandle | None:
        """Dispatch one lockstep step of every shard (None when no shard has tokens)."""
        plans = [shard.plan(out) for shard, out in zip(self.shards, output.shards, strict=True)]
        if all(plan is None for plan in plans):
            return None
        most = max(plan.num_tokens for plan in plans if plan is not None)
        t = bucket(most, self.token_buckets)
        inputs = [None if p is None else s.step_inputs(p, t) for s, p in zip(self.shards, plans)]
        # every shard's tables as wide as the widest shard's (a width tuple is monotone in
        # the longest request, so the widest of each group is itself a compiled bucket)
        built = [x[0] for x in inputs if x is not None]
        widths = [max(w) for w in zip(*(b.table_widths() for b in built), strict=True)]
        shards = []
        for shard, x in zip(self.shards, inputs, strict=True):
            if x is None:
                shards.append(shard.padding_inputs(t, widths))
                continue
            batch, *rest = x
            shards.append((widen_tables(batch, widths), *rest))
        stacked = stack_shards(shards)
        rows = [[] if p is None else p.rows for p in plans]
        return DataParallelHandle(self, output, rows, self.dispatch(*stacked))

    def dispatch(self, batch, feed, sampling, plp_targets):
        """Run the jitted data-parallel step on stacked inputs (every leaf [D, ...]), updating
        the stacked state; returns its device results without waiting (as
        `ModelRunner.dispatch`)."""
        return run_step(engine_step_data_parallel, self, batch, feed, sampling, plp_targets)

    # ---------------------------------------------------------------- warm-up

    def warm_up(self, progress: bool = True) -> int:
        """Compile every (token bucket, table widths) pair of the lockstep step and the
        sampler's slot writer, with padding that reads and writes nothing; returns the
        programs run (the progress bar's count)."""
        from tqdm import tqdm

        v = self.cfg.vocab_size
        rows = (np.zeros(v, np.int32), np.zeros(v, bool), np.zeros(v, bool))
        widths = table_width_buckets(
            self.kv_cache_config, max_model_len=self.max_model_len, table_buckets=self.table_buckets
        )
        pairs = [(t, w) for t in self.token_buckets for w in widths]
        bar = tqdm(total=1 + len(pairs), desc="warm-up: step programs", disable=not progress)
        self._write_sampler_rows(0, self.padding_slot, rows)
        bar.update(1)
        step = engine_step_data_parallel
        calls = [(step, stack_shards([s.padding_inputs(t, w) for s in self.shards]))
                 for t, w in pairs]  # fmt: skip
        warm_up_on_mesh(self, calls, functools.partial(bar.update, 1))
        bar.close()
        return bar.total
