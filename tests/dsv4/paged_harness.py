"""A small driver for the paged step in tests: the real `serving.Scheduler` plans every step over
the host allocator, `serving.InputBatch` turns each plan into `StepRequest`s, the builder makes
the batch, the jitted step runs it, and every real token's logits are collected by (sequence,
position) so they can be compared with `reference.forward`.

The harness plays only the model's and the drafter's parts: sequences are teacher-forced (a
sampling request "samples" its next true token), drafts are random with some true tokens among
them (a verifier accepts up to the first wrong one), and the token budget varies per step. Chunked
prefill, decodes mixed with prefills, prefix-cache hits, preemption with recompute (when the pool
is small), lookahead slots and the rejected draft rows that later steps overwrite all come from
the scheduler's own rules.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from cache import KVCacheManager
from cache.layout import for_model
from dsv4.paged import pools as P
from dsv4.paged.batch import StepBatch, StepRequest, build_batch, empty_batch
from dsv4.paged.step import paged_step_data_parallel_jit, paged_step_jit, stack_shards
from serving.config import SchedulerConfig
from serving.input_batch import InputBatch, ScheduledRow
from serving.scheduler import Scheduler, SchedulerOutput, StopCriteria

# What a sequence's last position "samples": the request stops on it (max_tokens), so it is
# never fed to the model and its value does not matter.
END_TOKEN = 0


@dataclasses.dataclass
class Seq:
    """A request and the whole sequence it is teacher-forced along."""

    sid: int
    tokens: np.ndarray  # the full sequence (prompt + continuation)
    prompt_len: int

    @property
    def request_id(self) -> str:
        return f"s{self.sid}"

    def token(self, position: int) -> int:
        """The true token at ``position``; END_TOKEN past the end."""
        return int(self.tokens[position]) if position < len(self.tokens) else END_TOKEN


def shared_prefix_seqs(rng: np.random.Generator, n: int, prefix_len: int, lengths: tuple[int, int]):
    """``n`` sequences of lengths drawn from ``[lengths[0], lengths[1])`` behind one shared
    prefix of ``prefix_len`` tokens (prefix hits); odd ones prompt part-way past the prefix,
    even ones are all prompt."""
    prefix = rng.integers(3, 300, prefix_len)
    seqs = []
    for i in range(n):
        length = int(rng.integers(*lengths))
        tokens = np.concatenate([prefix, rng.integers(3, 300, length - prefix_len)])
        prompt = int(rng.integers(prefix_len + 1, length)) if i % 2 else length
        seqs.append(Seq(i, tokens.astype(np.int32), prompt))
    return seqs


@dataclasses.dataclass
class ScheduleStats:
    """What the schedules of one harness exercised (summed over its `random_schedule` calls)."""

    num_steps: int = 0
    num_preempted: int = 0  # requests preempted (each one recomputes from scratch)
    prefix_hits: list[int] = dataclasses.field(default_factory=list)  # hit tokens per admission
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # of which accepted


class Harness:
    def __init__(
        self,
        cfg,
        params,
        formats,
        layout_kind="aliased",
        *,
        num_blocks=160,
        block_size=16,
        swa_block_size=4,
        max_model_len=96,
        num_speculative_tokens=0,
        bounded_replay=False,
        token_buckets=(32,),
        request_buckets=(8,),
        table_buckets=None,
        impl=None,
        interpret=False,
        scaled_index_keys=True,
    ):
        self.cfg, self.params = cfg, params
        desc = P.cache_desc(
            cfg,
            formats,
            block_size=block_size,
            swa_block_size=swa_block_size,
            num_speculative_tokens=num_speculative_tokens,
        )
        if bounded_replay:
            desc = dataclasses.replace(desc, swa_bounded_replay=True)
        self.config = for_model(desc, num_gpu_blocks_override=num_blocks)
        self.layout = P.PoolLayout.build(cfg, self.config, formats, layout_kind)
        self.pools = P.init_pools(self.layout, fill="nan")
        self.mgr = KVCacheManager(
            self.config,
            max_model_len,
            enable_caching=True,
            max_num_batched_tokens=token_buckets[-1],
            swa_bounded_replay=bounded_replay,
            use_eagle=False,
        )
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.impl, self.interpret = impl, interpret
        self.scaled_index_keys = scaled_index_keys
        self.mesh = None  # the device mesh the step runs on (`paged_step`'s ``mesh``)
        self.token_buckets, self.request_buckets = token_buckets, request_buckets
        self.table_buckets = table_buckets
        self.table_widths: set[tuple[int, ...]] = set()  # widths of the tables each step used
        self.logits: dict[tuple[int, int], np.ndarray] = {}
        self.stats = ScheduleStats()

    @property
    def steps(self) -> int:
        return self.stats.num_steps

    def scheduler(self, *, max_num_seqs: int, spec_k: int = 0) -> Scheduler:
        """A scheduler over this harness's allocator, its budget the largest token bucket, with
        ``spec_k`` drafts per request and as many lookahead slots (an MTP-style drafter)."""
        return Scheduler(
            self.mgr,
            SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=self.token_buckets[-1],
                async_scheduling=False,
            ),
            max_model_len=self.max_model_len,
            num_spec_tokens=spec_k,
            num_lookahead_tokens=spec_k,
        )

    def batch(self, step_requests: list[StepRequest]) -> StepBatch:
        """The step batch of ``step_requests`` (host arrays), in this harness's buckets."""
        batch = build_batch(
            step_requests,
            self.config,
            max_model_len=self.max_model_len,
            token_buckets=self.token_buckets,
            request_buckets=self.request_buckets,
            table_buckets=self.table_buckets,
            debug=True,
            engram_lookback=self.cfg.engram_lookback,
        )
        self.table_widths.add(batch.table_widths())
        return batch

    def run(self, step_requests: list[StepRequest]) -> np.ndarray:
        """One paged step over ``step_requests``: the logits of every scheduled token, in the
        requests' order (f32[T, vocab], T the token bucket)."""
        batch = jax.tree.map(jnp.asarray, self.batch(step_requests))
        logits, self.pools = paged_step_jit(
            self.params,
            self.pools,
            batch,
            cfg=self.cfg,
            layout=self.layout,
            all_logits=True,
            impl=self.impl,
            interpret=self.interpret,
            scaled_index_keys=self.scaled_index_keys,
            mesh=self.mesh,
        )
        self.stats.num_steps += 1
        return np.asarray(logits)


def plan_step(
    scheduler: Scheduler, inputs: InputBatch
) -> tuple[SchedulerOutput, list[ScheduledRow], list[StepRequest]]:
    """One `schedule()` and its rows and `StepRequest`s, as the model runner makes them."""
    output = scheduler.schedule()
    inputs.update(output)
    for new in output.scheduled_new_reqs:
        inputs.admit(new, scheduler.requests[new.request_id].num_prompt_tokens)
    if not output.total_num_scheduled_tokens:
        return output, [], []
    rows, step_requests = inputs.schedule(output)
    return output, rows, step_requests


def verify(seq: Seq, num_tokens: int, drafts: list[int]) -> list[int]:
    """What a verifier samples for a request that has ``num_tokens`` tokens and proposed
    ``drafts`` for the next ones: the true tokens up to and including the first mismatch."""
    sampled = [seq.token(num_tokens)]
    for i, draft in enumerate(drafts):
        if draft != seq.token(num_tokens + i):
            break
        sampled.append(seq.token(num_tokens + i + 1))
    return sampled


def propose(seq: Seq, num_tokens: int, spec_k: int, vocab_size: int, rng) -> list[int]:
    """Up to ``spec_k`` drafts for positions ``num_tokens``.., never past the sequence's end;
    each is the true token with probability 1/2, else a random one."""
    k = min(int(rng.integers(0, spec_k + 1)), len(seq.tokens) - num_tokens)
    true = [seq.token(num_tokens + i) for i in range(k)]
    noise = rng.integers(3, vocab_size, k)
    return [t if rng.random() < 0.5 else int(x) for t, x in zip(true, noise)]


def random_schedule(h: Harness, seqs: list[Seq], rng: np.random.Generator, *, spec_k=0,
                    max_chunk=8, max_running=4):  # fmt: skip
    """Teacher-force every sequence to its end through the real scheduler.

    Each sequence is a request whose prompt is ``tokens[:prompt_len]``; it runs until its
    last position has been computed (one output more than the continuation: the last
    position's sample, END_TOKEN, stops it). Before each step the token budget is drawn from
    [1, largest token bucket] (chunks cut at any point, sometimes a step of one token) and
    ``long_prefill_token_threshold`` from [1, max_chunk] (prefills advance in small chunks
    over many steps, so they mix with decodes, and a small cap also cuts drafts); both are read
    by `schedule()` afresh each call. Preemption comes from pool pressure: pass a small
    ``num_blocks`` to the harness. At the end every block is free again.
    """
    run = ScheduleRun(h, seqs, rng, spec_k=spec_k, max_chunk=max_chunk, max_running=max_running)
    while run.busy():
        run.learn(h.run(run.plan()))
    run.check_free()


def data_parallel_schedules(hs: list[Harness], seqs: list[list[Seq]], rng: np.random.Generator,
                            *, spec_k=0, max_chunk=8, max_running=4, mesh=None) -> int:  # fmt: skip
    """`random_schedule` for ``D = len(hs)`` data shards in lockstep, every step ONE
    `paged_step_data_parallel` over all of them: shard ``i`` has its own harness (allocator,
    scheduler, pools) and teacher-forces ``seqs[i]``; a shard with nothing left to run gets a
    batch of padding. The shards' pools are stacked (on ``mesh``: split over ``data``, and the
    step runs on it) and handed back to their harnesses at the end. Each harness collects
    its own logits. Returns the number of steps."""
    from dsv4 import sharding

    h0 = hs[0]
    runs = [ScheduleRun(h, s, rng, spec_k=spec_k, max_chunk=max_chunk, max_running=max_running)
            for h, s in zip(hs, seqs, strict=True)]  # fmt: skip
    pools = stack_shards([h.pools for h in hs])
    params = h0.params
    if mesh is not None:
        pools = jax.device_put(pools, sharding.data_parallel_sharding(pools, mesh))
        params = sharding.shard_params(params, h0.cfg, mesh)
    idle = empty_batch(h0.config, max_model_len=h0.max_model_len,
                       num_tokens=h0.token_buckets[-1], num_rows=h0.request_buckets[-1],
                       engram_lookback=h0.cfg.engram_lookback)  # fmt: skip
    steps = 0
    while any(run.busy() for run in runs):
        planned = [run.plan() if run.busy() else None for run in runs]
        batches = [idle if p is None else h.batch(p) for h, p in zip(hs, planned)]
        batch = jax.tree.map(jnp.asarray, stack_shards(batches))
        if mesh is not None:
            batch = jax.device_put(batch, sharding.data_parallel_sharding(batch, mesh))
        logits, pools = paged_step_data_parallel_jit(
            params, pools, batch, cfg=h0.cfg, layout=h0.layout, all_logits=True,
            impl=h0.impl, interpret=h0.interpret, scaled_index_keys=h0.scaled_index_keys,
            mesh=mesh,
        )  # fmt: skip
        logits = np.asarray(logits)
        for i, (run, p) in enumerate(zip(runs, planned)):
            if p is not None:
                hs[i].stats.num_steps += 1
                run.learn(logits[i])
        steps += 1
    for i, (h, run) in enumerate(zip(hs, runs)):
        h.pools = jax.tree.map(lambda x, i=i: x[i], pools)  # as random_schedule leaves them
        run.check_free()
    return steps


class ScheduleRun:
    """`random_schedule`'s loop, one step at a time: `plan` draws the step's knobs and plans it
    (the `StepRequest`s to run), `learn` takes that step's logits (f32[T, vocab]) and updates
    the scheduler as the model runner would."""

    def __init__(self, h: Harness, seqs: list[Seq], rng: np.random.Generator, *, spec_k=0,
                 max_chunk=8, max_running=4):  # fmt: skip
        self.h, self.rng, self.spec_k, self.max_chunk = h, rng, spec_k, max_chunk
        # build_batch keeps one request row for padding
        max_num_seqs = min(max_running, h.request_buckets[-1] - 1)
        self.scheduler = h.scheduler(max_num_seqs=max_num_seqs, spec_k=spec_k)
        self.inputs = InputBatch(max_num_seqs, engram_lookback=h.cfg.engram_lookback)
        self.by_id = {s.request_id: s for s in seqs}
        for s in seqs:
            request = h.mgr.new_request(s.request_id, s.tokens[: s.prompt_len].tolist(),
                                        max_tokens=len(s.tokens) - s.prompt_len + 1)  # fmt: skip
            self.scheduler.add_request(request, StopCriteria())

    def busy(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def plan(self) -> list[StepRequest]:
        h, rng, scheduler = self.h, self.rng, self.scheduler
        # Both knobs: the budget alone would hand the first prefill all of it (few, big chunks,
        # little mixing); the threshold alone would cut every chunk at the same sizes.
        scheduler.max_num_batched_tokens = int(rng.integers(1, h.token_buckets[-1] + 1))
        scheduler.long_prefill_token_threshold = int(rng.integers(1, self.max_chunk + 1))
        self.output, self.rows, step_requests = plan_step(scheduler, self.inputs)
        output = self.output
        h.stats.num_preempted += len(output.preempted_req_ids)
        h.stats.prefix_hits += [n.num_computed_tokens + n.num_replay_tokens
                                for n in output.scheduled_new_reqs]  # fmt: skip
        if not step_requests:
            raise RuntimeError(f"nothing scheduled with {len(scheduler.waiting)} requests "
                               f"waiting: the pool ({h.num_blocks} blocks) is too small")  # fmt: skip
        return step_requests

    def learn(self, logits: np.ndarray) -> None:
        h, output, scheduler = self.h, self.output, self.scheduler
        sampled = {}
        t = 0
        for row in self.rows:
            seq = self.by_id[row.request_id]
            num_real = row.num_tokens - row.num_drafts  # known tokens; drafts follow them
            if row.samples:
                drafts = output.scheduled_spec_decode_tokens.get(row.request_id, [])
                sampled[row.request_id] = verify(seq, row.start + num_real, drafts)
                self.inputs.learn(row.request_id, sampled[row.request_id])
                num_real += len(sampled[row.request_id]) - 1  # the accepted drafts' rows
            for i in range(num_real):
                h.logits[(seq.sid, row.start + i)] = logits[t + i]
            t += row.num_tokens
        result = scheduler.update_from_output(output, sampled)
        if result.spec_decoding_stats is not None:
            h.stats.num_draft_tokens += result.spec_decoding_stats.num_draft_tokens
            h.stats.num_accepted_tokens += result.spec_decoding_stats.num_accepted_tokens
        if self.spec_k:
            scheduler.update_draft_token_ids({
                request_id: propose(self.by_id[request_id],
                                    scheduler.requests[request_id].num_tokens, self.spec_k,
                                    h.cfg.vocab_size, self.rng)
                for request_id in result.new_token_ids if request_id not in result.finished
            })  # fmt: skip

    def check_free(self) -> None:
        free = self.h.mgr.num_free_blocks
        assert free == self.h.num_blocks - 1, (
            f"{free} of {self.h.num_blocks - 1} blocks free after the schedule"
        )
