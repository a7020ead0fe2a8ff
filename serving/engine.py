"""`Engine`: requests in, `RequestOutput`s out; the loop schedule -> execute -> update.

One `Scheduler` plans every step (vLLM's rules, host side), one `ModelRunner` runs it (device
side), and the engine turns sampled tokens into text, logprobs, stop decisions and metrics.
docs/serving.md explains its asynchronous scheduling, bursts and speculative decoding.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import numbers
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

from cache import KVCacheManager
from cache.layout import blocks_per_request, for_model
from dsv4.inputs import check_model_params
from dsv4.paged import pools as P
from dsv4.paged import records as R
from serving import sampler as S
from serving.config import ConfigError, EngineConfig
from serving.data_parallel import DataParallelRunner, DataParallelScheduler
from serving.metrics import EngineStats, compilation_count, persistent_cache_hits
from serving.outputs import RequestMetrics, RequestOutput
from serving.request import ParentRequest, Request, RequestStatus, StopCriteria, logprob_dict
from serving.runner import ModelRunner, StepHandle, StepOutput
from serving.sampling_params import RequestOutputKind, SamplingParams
from serving.scheduler import Scheduler, SchedulerStats
from serving.spec_decode import (
    DSparkProposer,
    NgramProposer,
    SpeculativeConfig,
    next_drafts,
    next_drafts_ahead,
)

__all__ = ["Engine"]

_CPU_KV_BYTES = 256 << 20  # pool size on a device that reports no memory (the CPU)

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) % 2**64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    return x ^ (x >> 31)


class Engine:
    """vLLM's engine loop over our scheduler and model runner (docs/serving.md).

    Args:
        runner: the device side (params, pools, sampler state).
        scheduler: the host side; its ``async_scheduling`` decides the loop.
        config: what it was built from; the engine reads ``seed`` and ``prompt_logprobs_on_hits``.
        tokenizer: decodes outputs and gives the EOS; None: token ids only.
        eos_token_id: the EOS without a tokenizer (skip_tokenizer_init: the model config's).
        proposer: the next step's drafts (`serving.spec_decode`); None: no speculation.
    """

    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        config: EngineConfig,
        tokenizer: Any | None = None,
        *,
        proposer: Any = None,
        eos_token_id: int | None = None,
    ) -> None:
        self.runner = runner
        self.config = config
        # vLLM reads no prefix cache for a request that asks prompt_logprobs (every position is
        # scored); True lets it hit, scoring the positions computed after the hit (those served
        # from the cache are None): how the quality benchmark measures bounded replay.
        self.prompt_logprobs_on_hits = config.cache_config.prompt_logprobs_on_hits
        self.scheduler = scheduler
        self.proposer = proposer
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id if tokenizer is None else tokenizer.eos_id
        self.seed = config.model_config.seed
        self.vocab_size = runner.cfg.vocab_size
        self.max_model_len = scheduler.max_model_len
        self.stats = EngineStats()
        # Decision counts (preemptions, recomputed tokens), kept as the lab keeps them.
        self.scheduler_stats = SchedulerStats()
        # the users' requests, and each one's n sampled sequences (every live Request), by id
        self._parents: dict[str, ParentRequest] = {}
        self._requests: dict[str, Request] = {}
        self._finished_ids: set[str] = set()
        self._in_flight: collections.deque[StepHandle] = collections.deque()
        self._ready: list[RequestOutput] = []  # outputs of aborted requests, for the next step
        self._num_unseeded = 0
        self._kv_event_subscribers: list[Callable[[list], None]] = []
        self._compilations_at_warm_up: int | None = None

    @classmethod
    def build(
        cls,
        params,
        cfg,
        config: EngineConfig | None = None,
        *,
        tokenizer: Any | None = None,
        eos_token_id: int | None = None,
    ) -> Engine:
        """An engine over ``params`` of the architecture ``cfg``, as ``config`` says (default
        `EngineConfig()`; `LLM` builds it from its keywords): the cache layout, one allocator
        and scheduler per data shard (`serving.data_parallel` steps them in lockstep), the
        model runner and the drafts' proposer. The EOS is the tokenizer's, else
        ``eos_token_id``."""
        config = (config or EngineConfig()).resolved(cfg)
        # params built for another config (the drafter's too where DSpark drafts)
        check_model_params("Engine.build", params, cfg, drafter=config.drafter)
        sched = config.scheduler_config
        max_model_len = config.model_config.max_model_len
        # the proposer first: DSpark's checks k before the cache layout uses it
        proposer = _proposer(config.speculative_config, cfg, max_model_len)
        kv_config = _kv_cache_config(cfg, config)
        eos = eos_token_id if tokenizer is None else tokenizer.eos_id

        def one_scheduler() -> Scheduler:
            manager = KVCacheManager(
                kv_config,
                max_model_len,
                max_num_batched_tokens=sched.max_num_batched_tokens,
                **config.cache_config.manager_kwargs(),
            )
            return Scheduler(
                manager,
                sched,
                max_model_len=max_model_len,
                eos_token_id=eos,
                num_spec_tokens=config.num_speculative_tokens,
                drafts_on_device=sched.async_scheduling and config.drafter,
            )

        shards = config.parallel_config.num_shards
        if shards == 1:
            scheduler = one_scheduler()
            runner = ModelRunner(params, cfg, kv_config, config, eos_token_id=eos)
        else:
            runner = DataParallelRunner(params, cfg, kv_config, config, eos_token_id=eos)
            scheduler = DataParallelScheduler([one_scheduler() for _ in range(shards)])
        return cls(runner, scheduler, config, tokenizer, proposer=proposer, eos_token_id=eos)

    @staticmethod
    def check_config(cfg, config: EngineConfig) -> None:
        """`build`'s checks that need the architecture ``cfg`` but no weights: the speculative
        config, and a pool too small for one request where its size is given (`LLM` runs them
        before it loads weights; the default size is what the device has left after them).

        Raises:
            ValueError: as `build` raises it (`ConfigError` naming the field).
        """
        config = config.resolved(cfg)
        _check_speculative(config.speculative_config, cfg)
        cache = config.cache_config
        if cache.num_gpu_blocks_override is not None or cache.kv_cache_memory_bytes is not None:
            _kv_cache_config(cfg, config)

    @property
    def kv_cache_manager(self) -> KVCacheManager:
        """The allocator (shard 0's with data parallelism: every shard has its own, all with
        the same config; `kv_cache_managers` lists them)."""
        return self.scheduler.kv_cache_manager

    @property
    def kv_cache_managers(self) -> list[KVCacheManager]:
        """Every shard's allocator (one without data parallelism)."""
        return getattr(self.scheduler, "kv_cache_managers", [self.scheduler.kv_cache_manager])

    @property
    def data_parallel_size(self) -> int:
        return len(self.kv_cache_managers)

    @property
    def async_scheduling(self) -> bool:
        return self.scheduler.async_scheduling

    # ---------------------------------------------------------------- start-up

    def warm_up(self, progress: bool = True) -> float:
        """Compile every bucket of the runner now; returns the seconds it took."""
        t0 = time.perf_counter()
        before, hits = compilation_count(), persistent_cache_hits()
        self.stats.warm_up_programs = self.runner.warm_up(progress=progress)
        self.stats.warm_up_s = time.perf_counter() - t0
        self.stats.warm_up_compilations = compilation_count() - before
        self.stats.warm_up_cache_hits = persistent_cache_hits() - hits
        self._compilations_at_warm_up = compilation_count()
        if self.config.compilation_config.freeze_gc_heap:
            # what start-up built (jax's traces and programs: ~660k objects on tiny_v41) stays
            # alive; the collector's full passes over it paused serving by ~0.4 s each
            gc.collect()
            gc.freeze()
        return self.stats.warm_up_s

    @contextlib.contextmanager
    def serving_loop(self):
        """For a caller that loops `step` (LLM's loop, the server's driver): meanwhile Python's
        young collections start after ``gc_threshold`` new objects instead of CPython's 700
        (put back after). A burst's rows, views and results crossed 700 again and again: 21
        collections, about 7 ms, a run of 32 requests of 64 tokens (docs/serving.md)."""
        threshold = self.config.compilation_config.gc_threshold
        before = gc.get_threshold()
        if threshold is None or threshold <= before[0]:
            yield
            return
        gc.set_threshold(threshold, *before[1:])
        try:
            yield
        finally:
            gc.set_threshold(*before)

    # ---------------------------------------------------------------- requests

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        prompt: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request. With ``params.n > 1`` it runs as n sequences ``"{i}_{request_id}"``
        (vLLM's child ids) whose outputs come back together under ``request_id``.

        Raises:
            ValueError: a duplicate or empty request id, an empty prompt, a prompt of
                ``max_model_len`` tokens or more, a token id outside the vocabulary, sampling
                parameters the engine cannot honour (logprobs above ``max_logprobs``, stop
                strings without a tokenizer). Nothing is queued then.
        """
        params = SamplingParams() if params is None else params
        prompt_ids = self.check_request(request_id, prompt_token_ids, params)
        now = time.monotonic() if arrival_time is None else arrival_time
        ids = [request_id] if params.n == 1 else [f"{i}_{request_id}" for i in range(params.n)]
        clash = [i for i in ids[1:] if i in self._requests or i in self._parents]
        if clash:
            raise ValueError(f"request id {clash[0]!r} (a child of {request_id!r}) is in use")
        parent = ParentRequest(
            request_id, prompt, prompt_ids, params, RequestMetrics(arrival_time=now)
        )
        self._parents[request_id] = parent
        for index, child_id in enumerate(ids):
            child_params = dataclasses.replace(params, n=1)
            if params.seed is not None:
                child_params.seed = params.seed + index  # vLLM's parallel-sampling seeds
            self._add_sequence(parent, child_id, index, child_params, now, priority)

    def check_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        where: str | None = None,
    ) -> list[int]:
        """The prompt as ints if `add_request` would queue this request, else the ValueError /
        TypeError it would raise, naming ``where`` (default ``request '<id>'``; `LLM.generate`
        names the prompt's list index) (`LLM.generate` checks a batch before queueing any)."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        where = where or f"request {request_id!r}"
        if request_id in self._parents or request_id in self._requests:
            raise ValueError(f"{where}: duplicate request id {request_id!r}: it is still running")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"{where}: sampling params must be a SamplingParams, got {params!r}")
        prompt_ids = _prompt_ids(where, prompt_token_ids)
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"{where}: the prompt has {len(prompt_ids)} tokens; allowed "
                f"1..{self.max_model_len - 1} (max_model_len={self.max_model_len} leaves room for "
                "one output token)"
            )
        bad = [(i, t) for i, t in enumerate(prompt_ids) if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"{where}: prompt token {bad[0][0]} is {bad[0][1]}, outside the vocabulary "
                f"[0, {self.vocab_size}) ({len(bad)} such tokens)"
            )
        try:
            params.verify(self.vocab_size, self.runner.max_logprobs)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        if params.stop and self.tokenizer is None:
            raise ValueError(
                f"{where}: stop strings {params.stop!r} need a tokenizer; give stop_token_ids "
                "instead"
            )
        return prompt_ids

    def _add_sequence(
        self,
        parent: ParentRequest,
        request_id: str,
        index: int,
        params: SamplingParams,
        arrival_time: float,
        priority: int,
    ) -> None:
        """One sampled sequence of ``parent``: its `Request`, queued and registered."""
        prompt_ids = parent.prompt_token_ids
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - len(prompt_ids)
        if params.seed is not None:
            key_data = S.key_data_for_seed(params.seed)
        else:
            key_data = S.key_data_for_seed(_splitmix64(self.seed * 2**32 + self._num_unseeded))
            self._num_unseeded += 1
        manager = self.kv_cache_manager
        request = Request(
            request_id,
            prompt_ids,
            params,
            stop=StopCriteria.of(params, self.eos_token_id),
            key_data=key_data,
            parent=parent,
            index=index,
            # hashed at the allocator's granularity when prefix caching is on
            hash_block_size=manager.hash_block_size if manager.enable_caching else None,
            max_tokens=max_tokens,
            priority=priority,
            arrival_time=arrival_time,
            skip_reading_prefix_cache=(
                params.prompt_logprobs is not None and not self.prompt_logprobs_on_hits
            ),
        )
        self.scheduler.add_request(request)
        self.runner.register(request)
        parent.children.append(request)
        parent.num_unfinished += 1
        self._requests[request_id] = request

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests (by the ids given to `add_request`), running or waiting; their final
        output (finish_reason "abort") comes with the next `step`. Requests that finished
        already are ignored, as in vLLM.

        Raises:
            ValueError: an id this engine has never seen (nothing is aborted then).
        """
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        unknown = [i for i in ids if i not in self._parents and i not in self._finished_ids]
        if unknown:
            raise ValueError(f"cannot abort unknown request ids {unknown!r}")
        for request_id in dict.fromkeys(ids):
            req = self._parents.get(request_id)
            if req is None:
                continue
            live = [c for c in req.children if not c.is_finished]
            self.scheduler.finish_requests(
                [c.request_id for c in live], RequestStatus.FINISHED_ABORTED
            )
            for child in live:
                self._finish(child, "abort", None)
            out = self._output(req)
            if out.finished:
                self._ready.append(out)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    def subscribe_kv_events(self, callback: Callable[[list], None]) -> None:
        """Call ``callback(events)`` after every step with that step's KV events (`cache.events`);
        needs ``enable_kv_cache_events=True``. With data parallelism it is called as
        ``callback(events, data_parallel_rank)``, once per shard that has events (vLLM tags its
        event batches with the rank the same way)."""
        if not all(m.enable_kv_cache_events for m in self.kv_cache_managers):
            raise ValueError("KV events are off: build the engine with enable_kv_cache_events=True")
        self._kv_event_subscribers.append(callback)

    # ---------------------------------------------------------------- the loop

    def step(self) -> list[RequestOutput]:
        """Plan and dispatch one step (with ``num_scheduler_steps`` > 1, a burst of decode
        steps, `_plan_burst`), and apply every step dispatched before: asynchronously the
        steps just dispatched stay in flight, synchronously none does. Returns the outputs of
        the requests that got new tokens or finished."""
        t0 = time.perf_counter()
        outputs, self._ready = self._ready, []
        dispatched = 0
        if self.scheduler.has_unfinished_requests():
            scheduler_output = self.scheduler.schedule()
            self._note_scheduled(scheduler_output)
            stalled = self.scheduler.stalled_request(scheduler_output, len(self._in_flight))
            if stalled is not None:
                outputs += self._fail_stalled(stalled)
            burst, rest = self._plan_burst(scheduler_output)
            if len(burst) > 1:
                handles = self.runner.execute_burst(burst)
            else:
                handles = [self.runner.execute(scheduler_output)]
            if rest is not None:
                handles.append(self.runner.execute(rest))
            handles = [h for h in handles if h is not None]
            self._in_flight.extend(handles)
            dispatched = len(handles)
        # apply every step dispatched before this call (asynchronously the steps just
        # dispatched stay in flight; synchronously nothing does)
        keep = dispatched if self.async_scheduling else 0
        wait = 0.0
        while len(self._in_flight) > keep:
            handle = self._in_flight.popleft()
            t_wait = time.perf_counter()
            step_output = handle.fetch()
            wait += time.perf_counter() - t_wait
            result = self.scheduler.update_from_output(
                handle.scheduler_output, step_output.sampled_token_ids
            )
            outputs += self._apply(step_output, result, handle.scheduler_output)
            if self.proposer is not None:
                self._propose(step_output)
        self._publish_kv_events()
        self._update_stats(time.perf_counter() - t0, wait, max(1, dispatched))
        return outputs

    def _plan_burst(self, first) -> tuple[list, Any]:
        """The steps to dispatch now: ``first`` alone or, when it is a pure decode
        (`ModelRunner.burst_bucket`), k = ``num_scheduler_steps`` > 1, nobody waits and every
        step in flight decodes too (a prefill's first token is not held up), up to k steps
        planned in a row and run as one program; the first step that is not pure decode or
        needs a larger bucket (``rest``, else None) is dispatched alone after the burst."""
        k = self.runner.num_scheduler_steps
        burst, rest = [first], None
        if k < 2 or len(self.scheduler.waiting):
            return burst, rest
        if any(self.runner.burst_bucket(h.scheduler_output) is None for h in self._in_flight):
            return burst, rest
        t = self.runner.burst_bucket(first)
        if t is None:
            return burst, rest
        while len(burst) < k and self.scheduler.has_unfinished_requests():
            nxt = self.scheduler.schedule()
            self._note_scheduled(nxt)
            t_next = self.runner.burst_bucket(nxt)
            if t_next is None or t_next > t:
                rest = nxt
                break
            burst.append(nxt)
        return burst, rest

    def _fail_stalled(self, request) -> list[RequestOutput]:
        """Finish a request an idle pool cannot admit (`Scheduler.stalled_request`) with
        finish_reason "error", keeping the tokens it has, instead of waiting forever; the
        requests behind it go on. A warning names it and the sizes involved."""
        request_id = request.request_id
        usable = self.kv_cache_manager.block_pool.num_gpu_blocks - 1
        warnings.warn(
            f"request {request_id!r} finished with 'error': its {request.num_tokens} tokens do "
            f"not fit the KV-cache pool even alone ({usable} blocks over "
            f"{self.kv_cache_manager.num_kv_cache_groups} groups). Give the engine more blocks "
            "(num_gpu_blocks_override / kv_cache_memory_bytes) or lower max_tokens",
            RuntimeWarning,
            stacklevel=3,
        )
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ERROR)
        request = self._requests[request_id]
        self._finish(request, "error", None)
        return self._outputs_due([request.parent])

    def _note_scheduled(self, output) -> None:
        now = time.monotonic()
        for new in output.scheduled_new_reqs:
            request = self._requests.get(new.request_id)
            if request is None or request.metrics.first_scheduled_time is not None:
                continue  # gone, or resumed after a preemption
            request.metrics.first_scheduled_time = now
            request.metrics.num_cached_tokens = new.num_computed_tokens
            parent = request.parent.metrics
            if parent.first_scheduled_time is None:
                parent.first_scheduled_time = now
                parent.num_cached_tokens = new.num_computed_tokens
            self.stats.num_prompt_tokens += request.num_prompt_tokens
        sched = self.scheduler_stats
        sched.observe(output)
        self.stats.num_preemptions = sched.preemptions
        self.stats.num_replay_tokens = sched.replay_tokens
        self.stats.num_recomputed_tokens = sched.recomputed_tokens
        self.stats.prefix_cache_queries = sched.prefix_queries
        self.stats.prefix_cache_hits = sched.prefix_hits
        for request_id in output.preempted_req_ids:
            request = self._requests.get(request_id)
            if request is not None:
                request.metrics.num_preemptions += 1
                request.parent.metrics.num_preemptions += 1

    def _propose(self, step_output: StepOutput) -> None:
        """Drafts for the next step of every running request (the scheduler keeps only those
        of requests that decode); DSpark's came back with ``step_output``. Asynchronously,
        DSpark's stay on the device (the scheduler plans placeholders), and a host proposer
        proposes past the step in flight (`next_drafts_ahead`)."""
        if not self.async_scheduling:
            drafts = next_drafts(self.proposer, self.scheduler.running, step_output)
            if drafts:
                self.scheduler.update_draft_token_ids(drafts)
            return
        if self.scheduler.drafts_on_device:
            return
        in_flight: dict[str, tuple[list[int], bool]] = {}
        for handle in self._in_flight:
            out = handle.scheduler_output
            for request_id in out.sampling_req_ids:
                drafts = list(out.scheduled_spec_decode_tokens.get(request_id, ()))
                usable = self.runner.in_flight_drafts_usable(request_id)
                in_flight[request_id] = (drafts, usable)
        k = self.scheduler.num_spec_tokens
        ahead = next_drafts_ahead(self.proposer, self.scheduler.running, in_flight, k)
        self.scheduler.update_draft_token_ids({rid: d for rid, (_, d) in ahead.items()})
        self.runner.set_draft_guesses({rid: g for rid, (g, _) in ahead.items()})

    def _apply(self, step_output: StepOutput, result, scheduled=None) -> list[RequestOutput]:
        """Tokens into sequences (text, logprobs, stop strings); finished sequences out."""
        now = time.monotonic()
        # in the order they were touched; by identity (eq=False), not id(): Python 3.12 audits
        # every id() call, and an audit hook (filelock's, imported by JAX) runs for each
        touched: dict[ParentRequest, None] = {}
        if result.spec_decoding_stats is not None:
            self.stats.observe_spec(result.spec_decoding_stats)
        if scheduled is not None:
            for request_id, drafts in scheduled.scheduled_spec_decode_tokens.items():
                request = self._requests.get(request_id)
                sampled = step_output.sampled_token_ids.get(request_id)
                if request is None or not sampled:
                    continue
                for m in (request.metrics, request.parent.metrics):
                    m.spec_num_draft_tokens += len(drafts)
                    m.spec_num_accepted_tokens += len(sampled) - 1
        requests, logprobs = self._requests, step_output.logprobs
        for request_id, tokens in result.new_token_ids.items():
            request = requests[request_id]
            self._note_tokens(request, tokens, logprobs.get(request_id) if logprobs else None, now)
            parent = request.parent
            touched[parent] = None
        for request_id, entries in step_output.prompt_logprobs.items():
            request = self._requests.get(request_id)
            if request is None:
                continue
            prompt = request.prompt_token_ids
            n = request.sampling_params.prompt_logprobs
            for position, entry in entries.items():
                if position not in request.prompt_logprobs:  # a recompute scores it again
                    request.prompt_logprobs[position] = logprob_dict(
                        entry, prompt[position], n, self._decode_token
                    )
        # stop strings need the text (`_check_stop_strings`: none without a tokenizer)
        for request_id in result.new_token_ids if self.tokenizer is not None else ():
            request = requests[request_id]
            stop = self._check_stop_strings(request)
            if stop is None:
                continue
            if request_id not in result.finished:  # vLLM aborts it in the engine core
                self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_STOPPED)
            self._finish(request, "stop", stop)  # also over a length cap on the same token
        for request_id, status in result.finished.items():
            request = self._requests[request_id]
            if request.finish_reason is None:
                reason = _FINISH_REASONS[status]
                self._finish(request, reason, result.stop_reasons.get(request_id))
            touched[request.parent] = None
        return self._outputs_due(touched)

    def _outputs_due(self, parents: Iterable[ParentRequest]) -> list[RequestOutput]:
        """The outputs of these requests that are due now: every request that finished, and
        the unfinished ones unless they asked for the final output only."""
        outputs = []
        for req in parents:
            if (
                req.num_unfinished == 0
                or req.params.output_kind is not RequestOutputKind.FINAL_ONLY
            ):
                outputs.append(self._output(req))
        return outputs

    def _note_tokens(self, request: Request, tokens: list[int], logprob, now: float) -> None:
        """Metrics and logprobs of the tokens the scheduler just appended to ``request``."""
        m, parent = request.metrics, request.parent.metrics
        if m.first_token_time is None:
            m.first_token_time = now
            if parent.first_token_time is None:
                parent.first_token_time = now
        m.last_token_time = parent.last_token_time = now
        m.num_generation_tokens += len(tokens)
        parent.num_generation_tokens += len(tokens)
        self.stats.num_generation_tokens += len(tokens)
        request.append_logprobs(tokens, logprob, self._decode_token)

    def _decode_token(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _check_stop_strings(self, request: Request) -> str | None:
        """vLLM's stop-string check on the new text: the first stop string (in the order
        given) found ends the sequence; the text is cut before it (or after it with
        include_stop_str_in_output)."""
        params = request.sampling_params
        stops = params.stop
        if not stops or self.tokenizer is None:
            return None
        text = request.output_text(self.tokenizer)
        # every stop string was looked for in the text up to the last check: one found now
        # ends after it
        checked = request.num_stop_checked_chars
        request.num_stop_checked_chars = request.num_settled_chars
        for stop in stops:
            index = text.find(stop, max(0, checked - len(stop) + 1))
            if index < 0:
                continue
            end = index + len(stop) if params.include_stop_str_in_output else index
            request.text = text[:end]
            return stop
        return None

    def _finish(self, request: Request, reason: str, stop_reason: int | str | None) -> None:
        request.finish_reason, request.stop_reason = reason, stop_reason
        request.metrics.finished_time = time.monotonic()
        self.runner.finish([request.request_id])
        req = request.parent
        req.num_unfinished -= 1
        if req.num_unfinished == 0:
            req.metrics.finished_time = request.metrics.finished_time
            self.stats.num_requests_finished += 1

    def _output(self, req: ParentRequest) -> RequestOutput:
        seqs = req.children
        finished = req.finished
        plp = None
        if req.params.prompt_logprobs is not None:
            first = seqs[0]
            plp = [None] + [
                first.prompt_logprobs.get(p) for p in range(1, len(req.prompt_token_ids))
            ]
        out = RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=list(req.prompt_token_ids),
            prompt_logprobs=plp,
            outputs=[s.completion(self.tokenizer) for s in seqs],
            finished=finished,
            metrics=dataclasses.replace(req.metrics),
            num_cached_tokens=req.metrics.num_cached_tokens,
        )
        if finished:
            for child in req.children:
                del self._requests[child.request_id]
                self._finished_ids.add(child.request_id)
            del self._parents[req.request_id]
            self._finished_ids.add(req.request_id)
        return out

    def _publish_kv_events(self) -> None:
        if not self._kv_event_subscribers:
            return
        managers = self.kv_cache_managers
        for rank, manager in enumerate(managers):
            events = manager.take_events()
            if not events:
                continue
            for callback in self._kv_event_subscribers:
                if len(managers) == 1:
                    callback(events)
                else:
                    callback(events, rank)

    def _update_stats(self, elapsed: float, wait: float, steps: int = 1) -> None:
        st = self.stats
        st.num_steps += steps
        st.elapsed_s += elapsed
        st.wait_s += wait
        st.host_s += elapsed - wait
        managers = self.kv_cache_managers
        st.kv_cache_usage = sum(m.usage for m in managers) / len(managers)
        if self._compilations_at_warm_up is not None:
            st.compilations_after_warm_up = compilation_count() - self._compilations_at_warm_up

    def kv_cache_usage_per_group(self) -> list[float]:
        """Fraction of the pool's usable blocks each KV-cache group holds now (the mean over
        the shards with data parallelism)."""
        managers = self.kv_cache_managers
        usable = max(managers[0].kv_cache_config.num_blocks - 1, 1)
        out = [0.0] * len(managers[0].coordinator.single_type_managers)
        for allocator in managers:
            for g, manager in enumerate(allocator.coordinator.single_type_managers):
                held = sum(
                    sum(not b.is_null for b in blocks) for blocks in manager.req_to_blocks.values()
                )
                out[g] += held / usable / len(managers)
        return out


def _prompt_ids(where: str, prompt_token_ids: Any) -> list[int]:
    """A prompt of token ids (a sequence or a 1-D integer array) as Python ints; floats, bools
    and strings are refused, never rounded."""
    if isinstance(prompt_token_ids, np.ndarray):
        if prompt_token_ids.ndim != 1 or not np.issubdtype(prompt_token_ids.dtype, np.integer):
            raise TypeError(
                f"{where}: the prompt must be a 1-D integer array of token ids, got "
                f"{prompt_token_ids.dtype}{list(prompt_token_ids.shape)}"
            )
        prompt_token_ids = prompt_token_ids.tolist()
    if isinstance(prompt_token_ids, str | bytes) or not isinstance(prompt_token_ids, Sequence):
        raise TypeError(
            f"{where}: the prompt must be a list of token ids, got "
            f"{type(prompt_token_ids).__name__}"
        )
    for i, t in enumerate(prompt_token_ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"{where}: prompt token {i} is {t!r}; token ids are ints")
    if not prompt_token_ids:
        raise ValueError(f"{where}: the prompt is empty (at least 1 token)")
    return [int(t) for t in prompt_token_ids]


def _proposer(config, cfg, max_model_len: int) -> Any:
    """The drafts' proposer the speculative config asks for (None: no speculation)."""
    spec = _check_speculative(config, cfg)
    if spec is None:
        return None
    if spec.method == "dspark":  # checks k against the drafter's block
        return DSparkProposer(spec, cfg, max_model_len)
    return NgramProposer(spec, max_model_len)


def _kv_cache_config(cfg, config: EngineConfig):
    """The cache layout of the resolved ``config``'s records: its block count, or as many blocks
    as its memory budget holds (default: 90% of the device's free memory, 256 MiB on a device
    without memory statistics, split between the shards one device holds)."""
    cache, parallel = config.cache_config, config.parallel_config
    desc = P.cache_desc(
        cfg,
        R.PRESETS[cache.kv_cache_dtype.upper()],
        block_size=cache.block_size,
        swa_block_size=cache.swa_block_size,
        swa_bounded_replay=cache.swa_bounded_replay,
        num_speculative_tokens=config.num_speculative_tokens,  # the compressor rings hold drafts
    )
    memory = cache.kv_cache_memory_bytes
    if cache.num_gpu_blocks_override is None and memory is None:
        # each device holds shards / (the mesh's data axis) shards' pools
        memory = _default_kv_bytes() // max(1, parallel.num_shards // parallel.mesh_data_size)
    kv_config = for_model(
        desc,
        available_memory_bytes=memory,
        num_gpu_blocks_override=cache.num_gpu_blocks_override,
    )
    _check_pool(kv_config, config)
    return kv_config


def _check_pool(kv_config, config: EngineConfig) -> None:
    """Refuse a pool that cannot hold even the smallest request (one prompt token and one
    output, with the drafts' lookahead): every request would finish with an error. The CLI
    reports the same ConfigError by its flag."""
    groups = kv_config.kv_cache_groups
    budget = config.scheduler_config.max_num_batched_tokens

    def blocks(num_tokens: int) -> int:  # the null block and one request's blocks
        return 1 + sum(blocks_per_request(g, num_tokens, budget) for g in groups)

    need = blocks(2 + config.num_speculative_tokens)
    if kv_config.num_blocks >= need:
        return
    longest = config.model_config.max_model_len
    override = config.cache_config.num_gpu_blocks_override
    name, value = (
        ("num_gpu_blocks_override", override)
        if override is not None
        else ("kv_cache_memory_bytes", config.cache_config.kv_cache_memory_bytes)
    )
    why = (
        f"the null block plus the smallest request (1 prompt token, 1 output) in the "
        f"{len(groups)} KV-cache groups; a request of max_model_len={longest} tokens takes "
        f"{blocks(longest)}"
    )
    raise ConfigError(
        name,
        value,
        f"a pool of at least {need} blocks ({why})",
        f"gives {kv_config.num_blocks} blocks; at least {need} needed ({why})",
    )


def _check_speculative(config, cfg) -> SpeculativeConfig | None:
    """The parsed speculative config, or None; errors name what cannot run."""
    if config is None:
        return None
    spec = SpeculativeConfig.from_dict(config)
    if spec.method == "dspark":
        DSparkProposer(spec, cfg, cfg.max_seq_len)  # the model's drafter and k
    return spec


def _default_kv_bytes() -> int:
    """vLLM's gpu_memory_utilization=0.9 of what the device has left, or 256 MiB without
    memory statistics."""
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        return _CPU_KV_BYTES
    return int(0.9 * limit) - int(stats.get("bytes_in_use", 0))
