"""`ModelRunner`: the device side of the engine (docs/architecture.md#serving).

It owns the params, the page pools (built from the same `KVCacheConfig` the allocator hands out
block ids of), the sampler's per-slot state and, for every running request, its device-side
state: a persistent slot, the block ids of each KV-cache group, the tokens the host knows and how
many of its sampled tokens are still on the device. `execute` turns one `SchedulerOutput` into a
`StepBatch` padded to a token bucket, dispatches one jitted function — the paged step on donated
pools, the LM head on the sampled rows, the sampler, and prompt logprobs when a row asks for
them — and returns at once (JAX dispatches asynchronously); `StepHandle.fetch` waits for the
tokens.

Tokens stay on the device between steps: each slot's last sampled token is kept in
``slots.last`` (`SlotState`), and a scheduled position whose token the host does not know yet
(the asynchronous engine plans a step before the previous one's tokens arrive) is read from there
inside the next step, never through the host; so are the DSpark drafts a step made
(``slots.drafts``), which the next step verifies.

Asynchronous speculation: a row planned after drafts still in flight assumes they were all
accepted. The step reads how many its slot's last step rejected (``slots.rejected``) and moves
the row back by that many before anything runs (`_move_back`): positions, sequence lengths,
every slot mapping (recomputed from the block tables, which hold the blocks of the planned
positions and so of the earlier ones), the sampler's position keys, min_tokens and the Engram
look-back. Drafts a host proposer made past a step in flight carry a guess of that step's
outcome (its token, and how many drafts it rejects: none, or all once its own guess is known to
have failed); the device verifies them only if the guess held.

Speculative decoding (``num_speculative_tokens`` k > 0): each request's 1 + d rows are verified
in the step (`_verify`). With the DSpark drafter (``drafter=True``) the step also seeds the
drafter's window caches (the draft layers' KV-cache groups) from the target layers' hidden states
of every token it ran, and drafts the next block of every sampling row from the token it sampled
last (`dsv4.paged.draft`); the drafts come back with the step's tokens
(`StepOutput.draft_token_ids`).

On a mesh (the config's ``mesh``, a `dsv4.sharding.make_mesh` mesh): the params are placed by
the rule table (`dsv4.sharding.shard_params`), and every step takes the mesh as a static
argument (``mesh=``, handed down to `dsv4.paged.step`), so XLA's SPMD partitioner splits heads over ``model`` and `dsv4.expert_parallel` sends tokens to
their experts' devices over ``expert``. A `ModelRunner` has one allocator's requests: its pools,
sampler state and slots are replicated over ``data``. Requests and their pages split over
``data`` are `serving.data_parallel.DataParallelRunner`'s: D host halves of this class
(``write_sampler_rows`` given) over one stacked device state, stepped by
`engine_step_data_parallel` (the engine builds it when ``data_parallel_size`` > 1, by default
whenever the mesh's ``data`` axis is).

Buckets: one compilation per token bucket T and block-table width bucket W. The request rows R
follow from T (``min(T, max_num_seqs) + 1`` rounded up to a power of two: one row is always free
for padding). The default T are powers of two up to ``max_num_seqs`` (a decode step of n
requests runs at most 2n rows), then powers of four up to the token budget
(`default_token_buckets`). The tables are as wide as ``max_model_len`` needs, or, with
``table_buckets`` (the default once that is more than 256 blocks: powers of eight from 64), only
as wide as the step's longest request needs, rounded up to a bucket: a long ``max_model_len``
then does not make every step decode and address the pages of the longest possible request.
`warm_up` builds every (T, W) pair's program (`serving.programs.StepPrograms`: compiled a core's
worth at a time, or loaded from the folder a previous start wrote) and the few small helpers
the loop uses; afterwards the loop compiles nothing (the engine's tests count compilations).

Bursts (``num_scheduler_steps`` k > 1): `execute_burst` takes up to k pure decode steps that the
scheduler planned in a row, builds each step's inputs as `execute` would (in order, so that each
is planned after the one before it), widens their block tables to the widest and stacks them;
`_engine_burst` runs `_engine_step` on them one after the other in one program, the pools,
sampler state and slots carried, each step's tokens fed to the next from ``slots.last``. Its
loop runs as many steps as were planned, so one compilation per decode bucket (T up to
``max_num_seqs``) and width serves every burst length; `warm_up` compiles those too.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsv4 import dspark, sharding
from dsv4 import layers as L
from dsv4.config import ModelConfig
from dsv4.paged import pools as P
from dsv4.paged import records as R
from dsv4.paged.batch import (
    BlockTables,
    StepBatch,
    StepRequest,
    bucket,
    build_batch,
    build_burst,
    empty_batch,
    group_infos,
    ring_slots_at,
    state_slots_at,
    table_width_buckets,
    window_slots_at,
)
from dsv4.paged.draft import draft_paged, seed_drafter
from dsv4.paged.step import data_shards, paged_forward_streams
from serving import sampler as S
from serving.config import EngineConfig
from serving.input_batch import InputBatch, RequestState, ScheduledRow
from serving.programs import StepPrograms
from serving.request import Request
from serving.scheduler import SchedulerOutput

__all__ = [
    "ModelRunner",
    "SlotState",
    "SpecBatch",
    "StepHandle",
    "StepOutput",
    "default_table_buckets",
    "default_token_buckets",
    "engine_step_data_parallel",
    "rows_for",
    "run_step",
    "to_host",
    "warm_up_on_mesh",
]


def default_token_buckets(
    max_num_batched_tokens: int, max_num_seqs: int | None = None
) -> tuple[int, ...]:
    """Powers of two from 1 up to ``max_num_seqs`` (a decode step of n requests runs at most
    2n rows: a single stream decodes one row, not eight), then powers of four up to (and
    always including) the token budget: a prefill chunk runs at most 4x its tokens, and few
    programs have to be compiled."""
    seqs = max_num_batched_tokens if max_num_seqs is None else max_num_seqs
    out, t = [], 1
    while t < max_num_batched_tokens:
        out.append(t)
        t *= 2 if t < seqs else 4
    out.append(max_num_batched_tokens)
    return tuple(out)


# up to this many blocks a full-width table costs a step no measurable time (tiny_v41_trained:
# the same step time with 64 and 256 columns, at 1 and 16 tokens), while a second width doubles
# the programs to compile
FULL_WIDTH_BLOCKS = 256

# XLA:CPU compiles the programs of a step of at most this many tokens for one core
# (`serving.programs.one_core`): its page reads are a few rows of a pool whose whole size XLA
# charges them for, and splitting them over threads costs more than they do (tiny_v41 on 2
# cores, 2048-block pool: engine over generate 1.38 instead of 1.58 at batch 1, 1.38 instead
# of 1.44 at batch 2; at 32 tokens it was 1.28 instead of 1.12: larger steps keep their splits)
CPU_SERIAL_MAX_TOKENS = 2


def default_table_buckets(kv_cache_config, max_model_len: int) -> tuple[int, ...] | None:
    """None (full-width tables) when ``max_model_len`` needs at most `FULL_WIDTH_BLOCKS` blocks
    in every group; else powers of eight from 64 blocks: a step's tables are at most 8x as wide
    as its longest request needs, and each width is one more program per token bucket."""
    groups = [g for g in group_infos(kv_cache_config) if g.kind != "ring"]
    widest = max(-(-max_model_len // g.block_size) for g in groups)
    if widest <= FULL_WIDTH_BLOCKS:
        return None
    out, w = [], 64
    while w < widest:
        out.append(w)
        w *= 8
    return tuple(out)


def rows_for(num_tokens: int, max_num_seqs: int) -> int:
    """Request rows R of the token bucket T: ``min(T, max_num_seqs + 1)`` rounded up to a power
    of two. That is room for every request the bucket can hold and, when they leave padding
    tokens, for the padding row; T requests fill T tokens and leave none, so a decode bucket of
    8 runs 8 rows, not 16 (the head and the sampler work on every row)."""
    need = min(num_tokens, max_num_seqs + 1)
    return 1 << (need - 1).bit_length()


@dataclasses.dataclass(frozen=True, slots=True)
class _Plan:
    """A step's rows as `ModelRunner.plan` placed them, before its size is fixed."""

    rows: list[ScheduledRow]
    step_requests: list[StepRequest]  # the model's view of each row, in row order
    # per scheduled token, the prompt token it predicts (-1 = none); empty when no row asks
    targets: list[int]
    num_tokens: int


@dataclasses.dataclass(slots=True)
class StepOutput:
    """A step's results on the host."""

    # sampling requests -> [token] (with drafts: the accepted drafts, then the bonus token)
    sampled_token_ids: dict[str, list[int]]
    # request id -> per sampled token, (logprob, rank, top ids, top logprobs); only rows that
    # asked for logprobs (`ScheduledRow.logprobs`: the others' would be built for nobody)
    logprobs: dict[str, list[tuple[float, int, list[int], list[float]]]]
    # request id -> {position p: (logprob, rank, top ids, top logprobs) of prompt token p}
    prompt_logprobs: dict[str, dict[int, tuple[float, int, list[int], list[float]]]]
    # DSpark: sampling requests -> the k drafts the device made after their last sampled token
    draft_token_ids: dict[str, list[int]] = dataclasses.field(default_factory=dict)


def to_host(tree):
    """``tree`` with its arrays copied to the host (numpy), as `jax.device_get` gives it: every
    copy started before any is read (they overlap on an accelerator), without device_get's own
    overhead (about 40 us a step for a step's four small arrays on CPU)."""
    leaves, treedef = jax.tree.flatten(tree)
    for leaf in leaves:
        if isinstance(leaf, jax.Array):
            leaf.copy_to_host_async()
    return jax.tree.unflatten(treedef, [np.asarray(leaf) for leaf in leaves])


class _Burst:
    """The stacked device results of the k steps of a burst (`ModelRunner.execute_burst`),
    copied to the host once, when the first of its steps is fetched; prompt logprobs only when
    a step asked for them (``wants_plp``: a step of one, `ModelRunner.execute`)."""

    def __init__(self, device_out, wants_plp: bool) -> None:
        sampled, plp = device_out
        self._device = (sampled, plp if wants_plp else None)
        self._host = None

    def step(self, i: int):
        if self._host is None:
            self._host = to_host(self._device)
            self._device = None
        return jax.tree.map(lambda x: x[i], self._host)


class StepHandle:
    """A dispatched step: its device results, fetched on demand (`fetch` blocks). A step of a
    burst holds the burst and its index in it (``part``)."""

    def __init__(
        self, runner: ModelRunner, output: SchedulerOutput, rows, device_out, part=None
    ) -> None:
        self.scheduler_output = output
        self._runner = runner
        self._rows: list[ScheduledRow] = rows
        self._device_out = device_out
        self._part: tuple[_Burst, int] | None = part
        self._host: StepOutput | None = None

    def fetch(self) -> StepOutput:
        """Wait for the step, copy its small results to the host and let the runner learn its
        tokens (idempotent; the steps of a burst are fetched in order). Prompt logprobs travel
        only when a row asked for them."""
        if self._host is None:
            if self._part is not None:
                burst, i = self._part
                host = burst.step(i)
            else:
                sampled, plp = self._device_out
                wants_plp = any(row.prompt_logprobs for row in self._rows)
                host = to_host((sampled, plp) if wants_plp else (sampled, None))
            self._host = self._runner.collect(self._rows, host)
        return self._host


class ModelRunner:
    """Runs scheduled steps on the device (see the module docstring).

    Args:
        params: the model's params (checkpoint names).
        cfg: the model's architecture.
        kv_cache_config: the allocator's layout (block counts, groups).
        config: the engine's configuration (`serving.config.EngineConfig`: its fields say why).
        eos_token_id: the tokenizer's EOS (min_tokens masks it).
        write_sampler_rows: given, this is one data shard's host half (`serving.data_parallel`).
    """

    def __init__(
        self,
        params,
        cfg: ModelConfig,
        kv_cache_config,
        config: EngineConfig,
        *,
        eos_token_id: int | None = None,
        write_sampler_rows: Callable[[int, tuple], None] | None = None,
    ) -> None:
        self.config = config = config.resolved(cfg)
        sched, cache = config.scheduler_config, config.cache_config
        k = check_num_speculative_tokens(config, cfg)
        self.max_num_seqs = max_num_seqs = sched.max_num_seqs
        self.max_model_len = max_model_len = config.model_config.max_model_len
        self.token_buckets = sched.token_buckets or default_token_buckets(
            sched.max_num_batched_tokens, max_num_seqs
        )
        self.mesh = mesh = config.parallel_config.mesh
        device_state = write_sampler_rows is None
        if mesh is not None and device_state:
            params = sharding.shard_params(params, cfg, mesh)
        self.params, self.cfg = params, cfg
        self.kv_cache_config = kv_cache_config
        formats = R.PRESETS[cache.kv_cache_dtype.upper()]
        self.layout = P.PoolLayout.build(cfg, kv_cache_config, formats, cache.pool_layout)
        table_buckets = sched.table_buckets
        if table_buckets == "auto":
            table_buckets = default_table_buckets(kv_cache_config, max_model_len)
        self.table_buckets = table_buckets
        self.max_logprobs = config.model_config.max_logprobs
        self.eos_token_id = eos_token_id
        self.debug = config.compilation_config.debug
        # drafts verified per request and step (0: no speculative decoding; the step then
        # samples one row per request, else 1 + k rows, see `_engine_step`)
        self.num_spec = k
        self.drafter = config.drafter
        self.plans_ahead = sched.async_scheduling
        self.num_scheduler_steps = sched.num_scheduler_steps
        if self.num_scheduler_steps > 1 and (refused := config.burst_refusal(cfg.engram_lookback)):
            raise refused
        decode = range(1, min(max_num_seqs, max(self.token_buckets)) + 1)
        bursts = self.num_scheduler_steps > 1
        # a decode step's buckets with bursts on: burst program only, every step of them (`execute`)
        self.burst_buckets = frozenset(bucket(n, self.token_buckets) for n in decode if bursts)
        self._groups = group_infos(kv_cache_config)
        self.static = self._static_arguments()
        self.programs = StepPrograms(self.static, serial_max_tokens=CPU_SERIAL_MAX_TOKENS)
        self.padding_slot = max_num_seqs
        self._write_rows = write_sampler_rows
        if device_state:
            self.pools = self._replicated(P.init_pools(self.layout, fill=cache.fill))
            self.sampler_state = self._replicated(S.init_state(max_num_seqs + 1, cfg.vocab_size))
            self.slots = self._replicated(SlotState.zeros(max_num_seqs + 1, k))
        self.inputs = InputBatch(max_num_seqs, engram_lookback=cfg.engram_lookback)
        self.slot_sampling = S.SlotSampling(max_num_seqs + 1)  # the last: the padding slot
        # the requests the engine registered, which the scheduler may (re)admit, by id; the
        # ids of those that asked for logprobs (or prompt logprobs), and for min_tokens
        self._registered: dict[str, Request] = {}
        self._logprob_requests, self._min_tokens_requests = set(), set()

    def _static_arguments(self) -> dict[str, Any]:
        """The engine step's static arguments (`_STATIC`): one compilation per value."""
        compilation = self.config.compilation_config
        # this runner's attributes of the same names, and three named otherwise
        own = ("cfg", "layout", "num_spec", "drafter", "plans_ahead", "mesh")
        static = {name: getattr(self, name) for name in own}
        static.update(num_logprobs=self.max_logprobs, groups=self._groups)
        return static | dict(impl=compilation.impl, interpret=compilation.interpret)

    def _replicated(self, tree):
        """``tree`` replicated over the mesh (as it is without one)."""
        if self.mesh is None:
            return tree
        return jax.device_put(
            tree, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        )

    # ---------------------------------------------------------------- requests

    def register(self, request: Request) -> None:
        """Remember a request (its sampling parameters and key), for whenever the scheduler
        admits it."""
        self._registered[request.request_id] = request
        params = request.sampling_params
        if params.logprobs is not None or params.prompt_logprobs is not None:
            self._logprob_requests.add(request.request_id)
        if params.min_tokens:
            self._min_tokens_requests.add(request.request_id)

    def finish(self, request_ids: Iterable[str]) -> None:
        """Forget finished requests and free their slots at once. A step still in flight may
        write a freed slot's device state: it runs before any step that reuses the slot."""
        request_ids = list(request_ids)
        for request_id in request_ids:
            self._registered.pop(request_id, None)
        self._logprob_requests.difference_update(request_ids)
        self._min_tokens_requests.difference_update(request_ids)
        self.inputs.release(request_ids)

    @property
    def requests(self) -> dict[str, RequestState]:
        """The running requests' host state, by id."""
        return self.inputs.requests

    def set_draft_guesses(self, guesses) -> None:
        """A host proposer's guesses of what each request's step in flight does: request id
        -> (the token it samples, the drafts it rejects), or None (see
        `serving.spec_decode.next_drafts_ahead`)."""
        for request_id, guess in guesses.items():
            state = self.requests.get(request_id)
            if state is not None:
                state.guess = guess

    def in_flight_drafts_usable(self, request_id: str) -> bool:
        """Whether the drafts of the request's step in flight can be accepted: False once the
        guess they were proposed under is known to have failed (then that step rejects them
        all)."""
        state = self.requests.get(request_id)
        return state is None or state.in_flight_usable

    def _admit(self, new) -> None:
        """A request (re)entering the batch, and its sampler rows when it needs them
        (penalties, min_tokens)."""
        request = self._registered[new.request_id]
        num_prompt = request.num_prompt_tokens
        state = self.inputs.admit(new, num_prompt)
        state.request = request
        params = request.sampling_params
        self.slot_sampling.write(state.slot, params, request.key_data)
        if params.uses_penalties or params.min_tokens:
            tokens = state.tokens
            rows = S.slot_rows(
                self.cfg.vocab_size,
                params,
                tokens[:num_prompt],
                tokens[num_prompt:],
                self.eos_token_id,
            )
            self._write_sampler_rows(state.slot, rows)

    def _write_sampler_rows(self, slot: int, rows) -> None:
        """Write one slot's sampler rows (penalty counts, prompt and stop masks)."""
        if self._write_rows is not None:  # a data shard: the stacked state is not ours
            self._write_rows(slot, rows)
            return
        self.sampler_state = _write_slot(self.sampler_state, np.int32(slot), *rows)

    # ---------------------------------------------------------------- one step

    def execute(self, output: SchedulerOutput) -> StepHandle | None:
        """Dispatch one scheduled step; returns before the device has finished it (None when
        nothing was scheduled: then only finished and preempted requests are let go). A step
        of a bucket compiled only as a burst (`burst_buckets`) runs as a burst of one."""
        plan = self.plan(output)
        if plan is None:
            return None
        t = bucket(output.total_num_scheduled_tokens, self.token_buckets)
        if t in self.burst_buckets:
            return self._run_burst([output], [plan], t)[0]
        batch, *inputs = self.step_inputs(plan, t)
        return StepHandle(self, output, plan.rows, self.dispatch(batch, *inputs))

    def burst_bucket(self, output: SchedulerOutput) -> int | None:
        """The token bucket of ``output`` if it can run in a burst (`execute_burst`), else
        None: a pure decode step (every scheduled request samples its one next token; none is
        new, resumed or verifies drafts)."""
        n = output.total_num_scheduled_tokens
        if (
            self.num_scheduler_steps < 2
            or not n
            or output.scheduled_new_reqs
            or output.preempted_req_ids
            or output.scheduled_spec_decode_tokens
            or len(output.num_scheduled_tokens) != n
            or len(output.sampling_req_ids) != n
        ):
            return None
        return bucket(n, self.token_buckets)

    def execute_burst(self, outputs: Sequence[SchedulerOutput]) -> list[StepHandle]:
        """Dispatch several scheduled steps, planned in a row, as one program: each a pure
        decode step (`burst_bucket`) of at most the first one's bucket. The device runs them in
        order (`_engine_burst`), each step's tokens feeding the next as they feed an
        asynchronously planned step; each step's results are those `execute` gives it."""
        buckets = [self.burst_bucket(o) for o in outputs]
        t = buckets[0]
        if None in buckets or max(buckets) > t:
            raise ValueError(
                "a burst takes pure decode steps (each request samples its one next token) of "
                "at most its first step's token bucket"
            )
        if len(outputs) > self.num_scheduler_steps:
            raise ValueError(
                f"a burst of {len(outputs)} steps; allowed: at most "
                f"num_scheduler_steps={self.num_scheduler_steps}"
            )
        return self._run_burst(outputs, [self.plan(o) for o in outputs], t)

    def _run_burst(self, outputs, plans: list[_Plan], t: int) -> list[StepHandle]:
        """Dispatch planned steps of token bucket ``t`` as one burst program (in order)."""
        stacked = self.burst_inputs(plans, t)
        burst = _Burst(self.dispatch_burst(*stacked, np.int32(len(plans))),
                       any(row.prompt_logprobs for plan in plans for row in plan.rows))  # fmt: skip
        return [
            StepHandle(self, output, plan.rows, None, (burst, i))
            for i, (output, plan) in enumerate(zip(outputs, plans, strict=True))
        ]

    def burst_inputs(self, plans: Sequence[_Plan], num_tokens: int):
        """A burst's ``(batches, feeds, samplings, plp_targets)``, every leaf [k, ...] (k =
        ``num_scheduler_steps``; zeros past the plans): step i is `step_inputs` of ``plans[i]``
        in token bucket ``num_tokens``, its tables widened by null columns to the burst's
        widest. Built in one pass over every step's rows (`build_burst`, one
        `SlotSampling.batch`)."""
        k, r = self.num_scheduler_steps, rows_for(num_tokens, self.max_num_seqs)
        if len(plans) == 1:  # a step alone, of any kind (`execute`'s burst of one)
            return jax.tree.map(lambda x: _padded_to(np.asarray(x)[None], k),
                                self.step_inputs(plans[0], num_tokens))  # fmt: skip
        batches = build_burst(
            [plan.step_requests for plan in plans],
            self.kv_cache_config,
            num_steps=k,
            token_bucket=num_tokens,
            request_rows=r,
            max_model_len=self.max_model_len,
            table_buckets=self.table_buckets,
            debug=self.debug,
            groups=self._groups,
            engram_lookback=self.cfg.engram_lookback,
            tables=self.inputs.keep_tables(self._groups, self.max_model_len),
        )
        m = len(plans)
        # one token per row: step i's token and row j are its plan's row j (`build_burst`)
        where = np.arange(r) < np.array([len(plan.rows) for plan in plans])[:, None]  # [m, R]
        real = [row for plan in plans for row in plan.rows]
        feeds = np.zeros((k, num_tokens), np.int32)  # zeros past the plans
        plp_targets = np.zeros((k, num_tokens), np.int32)
        feeds[:m] = plp_targets[:m] = -1
        for i, plan in enumerate(plans):
            feeds[i, : len(plan.rows)] = [row.device_slots[0] for row in plan.rows]
            plp_targets[i, : len(plan.targets)] = plan.targets

        def per_step(x, pad):  # [real rows, ...] -> [k, R, ...], padding rows from ``pad``
            out = np.zeros((k, r, *x.shape[1:]), x.dtype)
            out[:m] = pad
            out[:m][where] = x
            return out

        padding = self.slot_sampling.batch([self.padding_slot], [], [])
        ahead = _tokens_ahead(plans) if self._min_tokens_requests else None
        samplings = jax.tree.map(per_step, self._sampling_batch(real, len(real), ahead), padding)
        return batches, feeds, samplings, plp_targets

    def dispatch_burst(self, batches: StepBatch, feeds, samplings, plp_targets, num_steps):
        """Run `_engine_burst` on k stacked steps' inputs (every leaf [k, ...]), the first
        ``num_steps`` of them; returns the stacked results (sampled, prompt logprobs) without
        waiting."""
        return run_step(_engine_burst, self, batches, feeds, samplings, plp_targets, num_steps)

    def plan(self, output: SchedulerOutput) -> _Plan | None:
        """The host's part of a step before its size is fixed: the runner's requests updated
        (finished and preempted ones let go, new ones admitted), and each scheduled row's
        place; None when nothing was scheduled."""
        self.inputs.update(output)
        if not output.total_num_scheduled_tokens:
            return None
        for new in output.scheduled_new_reqs:
            self._admit(new)
        rows, step_requests = self.inputs.schedule(output)
        requests = self.inputs.requests
        targets: list[int] = []  # none: no row predicts a prompt token it scores
        # only requests that asked for logprobs or prompt logprobs change a row below
        for i, row in enumerate(rows if self._logprob_requests else ()):
            state = requests[row.request_id]
            params = state.request.sampling_params
            plp = params.prompt_logprobs is not None and row.start < state.num_prompt_tokens - 1
            if plp:
                if not targets:  # the rows before asked for none
                    targets = [-1] * sum(r.num_tokens for r in rows[:i])
                targets += self._prompt_targets(state, row.start, row.num_tokens)
            elif targets:
                targets += [-1] * row.num_tokens
            if plp or params.logprobs is not None:
                logprobs = params.logprobs is not None
                rows[i] = dataclasses.replace(row, prompt_logprobs=plp, logprobs=logprobs)
        return _Plan(rows, step_requests, targets, output.total_num_scheduled_tokens)

    def step_inputs(self, plan: _Plan, num_tokens: int):
        """``(batch, feed, sampling, plp_targets)`` of a planned step padded to the token
        bucket ``num_tokens`` (R = `rows_for` it): what `dispatch` runs."""
        tables = self.inputs.keep_tables(self._groups, self.max_model_len)
        batch = self.step_batch(plan.step_requests, plan.num_tokens, num_tokens, tables)
        t, r = batch.token_ids.shape[0], batch.seq_lens.shape[0]
        rows = plan.rows
        sampling = self._sampling_batch(rows, r)
        if self.num_spec:
            guesses = self._take_guesses(rows)
            sampling = (sampling, self._spec_batch(rows, r, guesses))
        feed = np.full(t, -1, np.int32)
        width = self.num_spec + 1  # a slot's device tokens: its last sampled one, its drafts
        if width == 1:  # no drafts: a token's device index is its slot's (or -1)
            devices = list(itertools.chain.from_iterable(row.device_slots for row in rows))
        else:
            devices = self._device_indices(rows, width)
        feed[: len(devices)] = devices
        plp_targets = np.full(t, -1, np.int32)
        plp_targets[: len(plan.targets)] = plan.targets
        return batch, feed, sampling, plp_targets

    def _device_indices(self, rows: Sequence[ScheduledRow], width: int) -> list[int]:
        """Per token of ``rows``, where its input waits on the device (``slot * width``: the
        slot's last sampled token, ``+ 1 + j``: its draft j), or -1 (the host has it)."""
        devices = []
        for row in rows:
            d = row.num_drafts
            devices += [-1 if s < 0 else s * width for s in row.device_slots[: row.num_tokens - d]]
            slot = self.requests[row.request_id].slot
            devices += [slot * width + 1 + j for j in range(d)] if row.device_drafts else [-1] * d
        return devices

    def step_batch(
        self,
        step_requests: Sequence[StepRequest],
        num_tokens: int,
        bucket_tokens: int | None = None,
        tables: BlockTables | None = None,
    ) -> StepBatch:
        """The step batch of ``step_requests`` (``num_tokens`` tokens in all), padded to this
        runner's buckets: T the smallest token bucket that holds them (or ``bucket_tokens``),
        R = `rows_for(T)`; ``tables``: their slots' block tables (`InputBatch.keep_tables`)."""
        t = bucket(num_tokens, self.token_buckets) if bucket_tokens is None else bucket_tokens
        return build_batch(
            step_requests,
            self.kv_cache_config,
            max_model_len=self.max_model_len,
            token_buckets=(t,),
            request_buckets=(rows_for(t, self.max_num_seqs),),
            table_buckets=self.table_buckets,
            debug=self.debug,
            groups=self._groups,
            engram_lookback=self.cfg.engram_lookback,
            tables=tables,
        )

    def dispatch(self, batch: StepBatch, feed, sampling: S.SamplingBatch, plp_targets):
        """Run the jitted engine step on prepared inputs (numpy or device arrays; see
        `_engine_step`), updating the pools and per-slot state; returns its device results
        without waiting."""
        return run_step(_engine_step, self, batch, feed, sampling, plp_targets)

    @staticmethod
    def _prompt_targets(state: RequestState, start: int, n: int) -> list[int]:
        """For each scheduled position p: the prompt token p + 1 it predicts, or -1."""
        last = state.num_prompt_tokens - 1
        return [state.tokens[p + 1] if p < last else -1 for p in range(start, start + n)]

    def _num_outputs(self, row: ScheduledRow) -> int:
        """Outputs a request had before this step's first sampled token (the row was counted
        in flight already; drafts in flight as accepted: the device corrects a moved row)."""
        state = self.requests[row.request_id]
        return state.num_tokens - state.num_prompt_tokens - row.samples * (1 + len(row.drafts))

    def _sampling_batch(
        self, rows: Sequence[ScheduledRow], num_rows: int, ahead: Sequence[int] | None = None
    ) -> S.SamplingBatch:
        """The rows' `SamplingBatch` from their slots' parameters (`SlotSampling`): per row
        only the counter (the position of its (first) sampled token: after the verified
        tokens), whether min_tokens still masks its stop tokens, and whether it samples.
        ``ahead``: per row, the tokens its request has planned in steps after the row's (a
        burst's later steps), which its outputs before the row must not count."""
        if len(rows) > num_rows:
            raise ValueError(f"{len(rows)} rows do not fit num_rows={num_rows}")
        requests = self.inputs.requests
        slots, counters, flags = [], [], []
        for i, row in enumerate(rows):
            state = requests[row.request_id]
            slots.append(state.slot)
            counters.append(row.start + row.num_tokens - len(row.drafts))
            min_tokens = state.request.sampling_params.min_tokens
            # outputs are never negative: without min_tokens nothing is suppressed
            suppress = bool(min_tokens) and (
                self._num_outputs(row) - (ahead[i] if ahead else 0) < min_tokens
            )
            flags.append((suppress, row.samples))
        slots += [self.padding_slot] * (num_rows - len(rows))
        return self.slot_sampling.batch(slots, counters, flags)

    def _take_guesses(self, rows: Sequence[ScheduledRow]) -> dict[str, tuple[int, int]]:
        """The guess each row's host drafts were proposed under (`set_draft_guesses`), by
        request id. A guess serves the step right after its proposal only: every scheduled
        request's is taken, and a sampling row's is recorded with its step in flight (the
        host needs it to know whether that step's drafts can be accepted)."""
        guesses = {}
        for row in rows:
            state = self.requests[row.request_id]
            if row.drafts and not row.device_drafts and state.guess is not None:
                guesses[row.request_id] = state.guess
                if row.samples:
                    self.inputs.note_guess(row.request_id, state.guess)
            state.guess = None
        return guesses

    def _spec_batch(self, rows: Sequence[ScheduledRow], num_rows: int, guesses=None) -> SpecBatch:
        """Each row's draft count, how far min_tokens still masks the stop tokens, whether its
        positions are optimistic (then the Engram history a moved row needs), and the guess
        its drafts were proposed under (``guesses``, from `_take_guesses`)."""
        k = self.num_spec
        num_drafts = np.zeros(num_rows, np.int32)
        min_tokens_left = np.zeros(num_rows, np.int32)
        shifted = np.zeros(num_rows, bool)
        history = np.full((num_rows, k), -1, np.int32)
        guess = np.full(num_rows, -1, np.int32)
        guess_rejected = np.zeros(num_rows, np.int32)
        for i, row in enumerate(rows):
            state = self.requests[row.request_id]
            num_drafts[i] = row.num_drafts
            min_tokens_left[i] = state.request.sampling_params.min_tokens - self._num_outputs(row)
            shifted[i] = row.shifted > 0
            if row.shifted and not self.plans_ahead:
                raise RuntimeError(
                    f"{row.request_id!r} was planned past {row.shifted} drafts in flight, but "
                    "this runner was built with plans_ahead=False (its step cannot move it back)"
                )
            history[i, : len(row.history)] = row.history
            if guesses and row.request_id in guesses:
                guess[i], guess_rejected[i] = guesses[row.request_id]
        return SpecBatch(
            num_drafts=num_drafts,
            min_tokens_left=min_tokens_left,
            shifted=shifted,
            engram_history=history,
            guess=guess,
            guess_rejected=guess_rejected,
        )

    def collect(self, rows: Sequence[ScheduledRow], host) -> StepOutput:
        """Host copies of a fetched step -> per-request results; the runner learns the sampled
        tokens of requests it still runs."""
        (ints, floats, accepted, drafts), plp = host
        token_ids = ints[..., 0].tolist()  # [R, 1 + k] ([R, 1] without k)
        accepted = accepted.tolist()
        drafts = drafts.tolist()  # [R, k] with the drafter, else [R, 0]
        sampled: dict[str, list[int]] = {}
        draft_token_ids: dict[str, list[int]] = {}
        logprobs = {}
        prompt_logprobs: dict[str, dict] = {}
        t = 0
        for i, row in enumerate(rows):
            if row.samples:
                tokens = token_ids[i][: accepted[i] + 1]
                sampled[row.request_id] = tokens
                if row.logprobs:
                    logprobs[row.request_id] = _logprob_entries(ints[i], floats[i], len(tokens))
                self.inputs.learn(row.request_id, tokens, drafts[i])
                if self.drafter:
                    draft_token_ids[row.request_id] = drafts[i]
            if row.prompt_logprobs:
                p_ints, p_floats = plp
                entries = {}
                for k in range(row.num_tokens):
                    p = row.start + k
                    if p < row.num_prompt_tokens - 1:  # p's logits score prompt token p + 1
                        _, rank, *top_ids = p_ints[t + k].tolist()
                        logprob, *top_logprobs = p_floats[t + k].tolist()
                        entries[p + 1] = (logprob, rank, top_ids, top_logprobs)
                prompt_logprobs[row.request_id] = entries
            t += row.num_tokens
        return StepOutput(sampled, logprobs, prompt_logprobs, draft_token_ids)

    # ---------------------------------------------------------------- warm-up

    def warm_up(self, progress: bool = True) -> int:
        """Compile every token bucket (as the burst program where `burst_buckets` has it; the
        sampler's slot writer too) now and run each once, with batches of padding that read and
        write nothing; returns the programs built (the progress bar's count: one compilation
        each in a fresh process)."""
        from tqdm import tqdm

        v = self.cfg.vocab_size
        slot = np.int32(self.padding_slot)
        rows = (np.zeros(v, np.int32), np.zeros(v, bool), np.zeros(v, bool))
        widths = table_width_buckets(
            self.kv_cache_config, max_model_len=self.max_model_len, table_buckets=self.table_buckets
        )
        # a bucket a pure decode step can have, with bursts on, as the burst program only
        k = self.num_scheduler_steps
        steps = [(t, k if t in self.burst_buckets else 1) for t in self.token_buckets]
        pairs = [(t, w, n) for t, n in steps for w in widths]
        bar = tqdm(total=1 + len(pairs), desc="warm-up: step programs", disable=not progress)
        self.sampler_state = _write_slot(self.sampler_state, slot, *rows)
        bar.update(1)
        state = (self.params, self.pools, self.sampler_state, self.slots)
        steps = [self.padding_inputs(t, w) for t, w, n in pairs if n == 1]
        bursts = [self._burst_inputs(self.padding_inputs(t, w), n) for t, w, n in pairs if n > 1]
        calls = [(_engine_step, x) for x in steps] + [(_engine_burst, x) for x in bursts]
        if self.mesh is None:  # compiled several at once, or loaded (`serving.programs`)
            self.programs.build(_engine_step, state, steps, functools.partial(bar.update, 1))
            self.programs.build(_engine_burst, state, bursts, functools.partial(bar.update, 1))
            # each run once: XLA's first run of a program costs 40-250 ms more on CPU (lazy
            # set-up), which would otherwise fall on a user's first requests
            for step, inputs in calls:
                jax.block_until_ready(run_step(step, self, *inputs))
        else:  # on a mesh the state is placed as the steps leave it (`warm_up_on_mesh`)
            warm_up_on_mesh(self, calls, functools.partial(bar.update, 1))
        bar.close()
        return bar.total

    @staticmethod
    def _burst_inputs(inputs, num_steps: int):
        """A burst's inputs: ``inputs`` stacked ``num_steps`` times, and the steps to run."""
        return (*jax.tree.map(lambda x: np.stack([x] * num_steps), inputs), np.int32(num_steps))

    def padding_inputs(self, num_tokens: int, table_widths):
        """`dispatch`'s inputs for a step of padding only (T = ``num_tokens``, R = `rows_for`
        it, tables of ``table_widths``): it reads and writes nothing (warm-up, and a data
        shard with no tokens in a step)."""
        r = rows_for(num_tokens, self.max_num_seqs)
        batch = empty_batch(
            self.kv_cache_config,
            max_model_len=self.max_model_len,
            num_tokens=num_tokens,
            num_rows=r,
            table_widths=table_widths,
            engram_lookback=self.cfg.engram_lookback,
        )
        sampling = S.build_sampling_batch([], r, self.padding_slot)
        if self.num_spec:
            sampling = (sampling, self._spec_batch([], r))
        none = np.full(num_tokens, -1, np.int32)
        return batch, none, sampling, none

    @property
    def num_free_slots(self) -> int:
        return self.inputs.num_free_slots


def check_num_speculative_tokens(config: EngineConfig, cfg: ModelConfig) -> int:
    """``config``'s drafts verified per step, k (0: no speculative decoding), or a ValueError
    where the DSpark drafter cannot draft that many."""
    k = config.num_speculative_tokens
    if config.drafter and not 1 <= k <= cfg.dspark_block_size:
        raise ValueError(
            f"the DSpark drafter drafts num_speculative_tokens={k}; "
            f"allowed: 1..dspark_block_size={cfg.dspark_block_size}"
        )
    return k


def warm_up_on_mesh(runner, calls, on_done: Callable[[], None]) -> None:
    """Compile ``runner``'s (step, inputs) ``calls`` through the jit: the first one run twice
    (a step may hand back its state placed otherwise than it was built: XLA replicates an
    empty leaf, such as the slots' drafts without speculation; every later step sees the state
    as steps leave it), the others compiled a core's worth at a time against that state, then
    each run once (nothing left to compile)."""
    (step, inputs), *rest = calls
    for _ in range(2):
        jax.block_until_ready(run_step(step, runner, *inputs))
    on_done()
    state = (runner.params, runner.pools, runner.sampler_state, runner.slots)
    runner.programs.compile_for_jit([(s, (*state, *x)) for s, x in rest], on_done)
    for step, inputs in rest:
        jax.block_until_ready(run_step(step, runner, *inputs))


def _tokens_ahead(plans: Sequence[_Plan]) -> list[int]:
    """Per row of ``plans`` (a burst's steps, in order), the tokens its request samples in the
    later steps (one a step: a burst runs no drafts)."""
    seen: dict[str, int] = {}
    out = []
    for plan in reversed(plans):
        step = []
        for row in plan.rows:
            step.append(seen.get(row.request_id, 0))
            seen[row.request_id] = step[-1] + row.samples
        out.append(step)
    return [n for step in reversed(out) for n in step]


def _padded_to(x: np.ndarray, k: int) -> np.ndarray:
    """``x`` [n, ...] with zeros after it to [k, ...]."""
    return np.concatenate([x, np.zeros((k - len(x), *x.shape[1:]), x.dtype)])


def run_step(step, runner, *inputs):
    """``step`` (a jitted engine step) on ``runner``'s params and device state (``pools``,
    ``sampler_state``, ``slots``, updated in place) and a step's ``inputs``: the program its
    warm-up built for their buckets (``runner.programs``), else the jit with the runner's
    ``static`` arguments; returns the step's device results without waiting."""
    state = (runner.params, runner.pools, runner.sampler_state, runner.slots)
    out, runner.pools, runner.sampler_state, runner.slots = runner.programs(step, state, inputs)
    return out


def _logprob_entries(ints: np.ndarray, floats: np.ndarray, n: int) -> list[tuple]:
    """A row's first ``n`` sampled tokens' ``(logprob, rank, top ids, top logprobs)`` from
    its rows of the step's packed results (``ints`` [1 + k, 2 + L]: token, rank, top ids;
    ``floats`` [1 + k, 1 + L]: logprob, top logprobs)."""
    entries = []
    for (_, rank, *top_ids), (logprob, *top_logprobs) in zip(
        ints[:n].tolist(), floats[:n].tolist(), strict=True
    ):
        entries.append((logprob, rank, top_ids, top_logprobs))
    return entries


@functools.partial(jax.jit, donate_argnums=(0,))
def _write_slot(state: S.SamplerState, slot, counts, prompt_mask, stop_mask) -> S.SamplerState:
    """One slot's sampler rows (the runner writes them when a request enters)."""
    return S.write_slots(state, slot[None], counts[None], prompt_mask[None], stop_mask[None])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, slots=True)
class SpecBatch:
    """The drafts a step verifies (rows as in `StepBatch`; k = num_speculative_tokens). The
    drafts themselves are the row's last ``num_drafts`` tokens of the step."""

    num_drafts: Any  # i32[R] drafts of the row
    # i32[R] min_tokens minus the outputs before the row's first sampled token (as planned):
    # position j masks the stop tokens while j - (rejected drafts moved back) < this
    min_tokens_left: Any
    # bool[R] the row was planned after drafts in flight as if all were accepted: the device
    # moves it back by the drafts its slot's last step rejected (`_move_back`)
    shifted: Any
    # i32[R, k] Engram: tokens of the positions before the planned look-back (newest first,
    # -1 = none), which a moved row's look-back reaches
    engram_history: Any
    # i32[R] host drafts proposed past a step in flight: the token that step must sample, and
    # i32[R] how many drafts it must reject, for them to be verified; guess -1 = none needed
    guess: Any
    guess_rejected: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, slots=True)
class SlotState:
    """What the device keeps per slot between steps (S = max_num_seqs + 1 slots, the last one
    for padding; k = num_speculative_tokens)."""

    last: Any  # i32[S] the token sampled last
    drafts: Any  # i32[S, k] the drafts made after it (a device drafter)
    rejected: Any  # i32[S] drafts its last verifying step rejected

    @classmethod
    def zeros(cls, num_slots: int, k: int) -> SlotState:
        return cls(
            last=jnp.zeros((num_slots,), jnp.int32),
            drafts=jnp.zeros((num_slots, k), jnp.int32),
            rejected=jnp.zeros((num_slots,), jnp.int32),
        )


def _move_back(batch: StepBatch, back: jax.Array, groups, history) -> StepBatch:
    """The batch with each row's positions moved back by ``back`` (i32[R], 0 = unchanged):
    positions, sequence lengths and every slot mapping recomputed from the block tables (which
    hold the earlier positions' blocks too), the Engram look-back from ``history``. Moved rows
    are decode rows past any bounded replay: every position writes."""
    # a row's ring rows stay the same tokens of its chunk; the compressed states written are
    # those that close at the new positions
    req = batch.token_req
    moved = back[req] > 0  # [T]; padding rows never move
    pos = jnp.where(moved, batch.positions - back[req], batch.positions)
    window, state, ring = dict(batch.window_slots), dict(batch.state_slots), dict(batch.ring_slots)
    for g in groups:
        table = batch.block_tables[g.index]
        if g.kind == "window":
            slots = window_slots_at(table, req, pos, g.block_size)
            window[g.index] = jnp.where(moved, slots, window[g.index])
        elif g.kind == "ring":  # the same tokens of the chunk keep their rows
            old = ring[g.index]
            ring[g.index] = jnp.where(
                moved, ring_slots_at(table, req, pos, g.block_size, old >= 0), old
            )
        else:
            for r in g.ratios:
                slots = state_slots_at(table, req, pos, g.block_size, r, True)
                state[(g.index, r)] = jnp.where(moved, slots, state[(g.index, r)])
    prev = batch.engram_prev
    m = prev.shape[1]
    if m:
        longer = jnp.concatenate([prev, history], axis=1)  # [R, m + k], newest first
        prev = jnp.take_along_axis(longer, back[:, None] + jnp.arange(m)[None, :], axis=1)
    return dataclasses.replace(
        batch,
        positions=pos,
        seq_lens=batch.seq_lens - back,
        window_slots=window,
        state_slots=state,
        ring_slots=ring,
        engram_prev=prev,
    )


def _verify(
    params,
    h: jax.Array,  # [T, D] the step's hidden states
    token_ids: jax.Array,  # i32[T] the step's tokens
    logits_indices: jax.Array,  # i32[R] each row's last token
    sampling: S.SamplingBatch,
    spec: SpecBatch,
    back: jax.Array,  # i32[R] how far each row was moved back
    drafts_ok: jax.Array,  # bool[R] the row's drafts may be accepted (SpecBatch.guess)
    sampler_state: S.SamplerState,
    *,
    num_spec: int,
    num_logprobs: int,
):
    """Score the 1 + d verified positions of every row and accept drafts while they equal the
    token the sampler draws at their position (serving.spec_decode), each position sampled
    with its own key and the counts of the tokens accepted before it: the step-by-step engine's
    tokens. ``back``: how far each row was moved back (``sampling.counter`` is as planned).

    Returns:
        (the sampler outputs of every position [R, 1 + k], the accepted draft counts i32[R],
        the state with counts added for the emitted tokens only)."""
    j = jnp.arange(num_spec + 1)
    rows = logits_indices[:, None] - spec.num_drafts[:, None] + j  # [R, 1 + k]
    valid = j[None, :] <= spec.num_drafts[:, None]
    r = rows.shape[0]
    safe = jnp.where(valid, rows, 0)
    logits = L.lm_head(params, h[safe.reshape(-1)])
    logits = logits.reshape(r, num_spec + 1, -1)
    # the drafts are the row's tokens after its first verified one (none accepted when they
    # were proposed past a guess that failed)
    usable = valid[:, 1:] & drafts_ok[:, None]
    drafts = jnp.where(usable, token_ids[safe[:, 1:]], -1)  # [R, k]
    sampling = dataclasses.replace(sampling, counter=sampling.counter - back)
    suppress = j[None, :] - back[:, None] < spec.min_tokens_left[:, None]  # [R, 1 + k]
    padded = jnp.concatenate([drafts, jnp.full((r, 1), -1, jnp.int32)], axis=1)
    xs = (logits, j, suppress, padded, valid)
    sampler_state, outs = _sample_positions(sampling, sampler_state, xs, num_logprobs)
    match = (outs.token_ids[:, :num_spec] == drafts) & (drafts >= 0)
    accepted = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)
    return outs, accepted.astype(jnp.int32), sampler_state


def _sample_positions(sampling, sampler_state, xs, num_logprobs: int):
    """`_verify`'s sampler over the positions j in turn (`jax.lax.scan`), a row's sampling
    stopping at its first draft the sampler does not draw. ``xs``: (logits [R, 1 + k, V],
    j, suppress, drafts padded, valid; each [R, 1 + k] but j [1 + k]). Returns the state and
    the outputs [R, 1 + k, ...]."""

    def position(carry, xs):
        state, alive = carry
        logits_j, j_, suppress_j, draft_j, valid_j = xs
        alive = alive & valid_j  # past the row's drafts nothing is sampled
        batch_j = dataclasses.replace(
            sampling,
            counter=sampling.counter + j_,
            suppress_stop=suppress_j,
            samples=sampling.samples & alive,
        )
        out, state = S.sample(logits_j, batch_j, state, num_logprobs=num_logprobs)
        return (state, alive & (out.token_ids == draft_j)), out

    logits, j, suppress, padded, valid = xs
    xs = (
        jnp.swapaxes(logits, 0, 1),
        j,
        jnp.swapaxes(suppress, 0, 1),
        jnp.swapaxes(padded, 0, 1),
        jnp.swapaxes(valid, 0, 1),
    )
    alive = jnp.ones((logits.shape[0],), bool)
    (sampler_state, _), outs = jax.lax.scan(position, (sampler_state, alive), xs)
    return sampler_state, jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), outs)  # [R, 1 + k, ...]


# the engine steps' static arguments, and their jit: the pools and per-slot state donated
_STATIC = ("cfg", "layout", "num_logprobs", "impl", "interpret", "num_spec", "groups",
           "plans_ahead", "drafter", "mesh")  # fmt: skip
_engine_jit = functools.partial(
    jax.jit, static_argnames=_STATIC, donate_argnames=("pools", "sampler_state", "slots")
)


@_engine_jit
def _engine_step(
    params,
    pools,
    sampler_state: S.SamplerState,
    slots: SlotState,
    batch: StepBatch,
    # i32[T] where this token's id is on the device, -1 = batch.token_ids: slot s's last
    # sampled token at s * (k + 1), its draft j at s * (k + 1) + 1 + j
    feed: jax.Array,
    sampling,  # S.SamplingBatch, or (S.SamplingBatch, SpecBatch) when num_spec > 0
    plp_targets: jax.Array,  # i32[T] prompt token each position predicts, -1 = none
    **static,  # `_step`'s keywords: _STATIC
):
    """One engine step on the device: inputs (device-fed tokens; rows planned after drafts in
    flight moved back by the drafts rejected, `_move_back`), the paged step, the head on the
    sampled rows, the sampler (with drafts: the verification, `_verify`), prompt logprobs when
    some position asks for them, and with the drafter the next drafts (`_step`)."""
    inputs = (batch, feed, sampling, plp_targets)
    return _step(params, pools, sampler_state, slots, *inputs, shard_axis=False, **static)


@_engine_jit
def engine_step_data_parallel(
    params,
    pools,  # every leaf [D, ...]: D data shards (`dsv4.paged.step.stack_shards`)
    sampler_state: S.SamplerState,  # [D, S, ...]
    slots: SlotState,  # [D, S, ...]
    batch: StepBatch,  # [D, ...]: the shards' batches, built with the same buckets
    feed: jax.Array,  # i32[D, T]
    sampling,  # [D, ...] as `_engine_step`'s
    plp_targets: jax.Array,  # i32[D, T]
    **static,  # `_engine_step`'s static arguments
):
    """`_engine_step` for D data shards in one program: each shard's inputs, sampler and slot
    state are its own (`jax.vmap`, split over the mesh's ``data`` axis when it has more than
    one device); the paged step and the drafter run with their shard axis (data-parallel
    attention, the MoE on every shard's tokens at once). Shard ``i``'s results are those of
    `_engine_step` on shard ``i``'s state and inputs."""
    inputs = (batch, feed, sampling, plp_targets)
    return _step(params, pools, sampler_state, slots, *inputs, shard_axis=True, **static)


def _step(
    params, pools, sampler_state, slots, batch, feed, sampling, plp_targets, *, cfg, layout,
    num_logprobs, impl, interpret, num_spec=0, drafter=False, groups=(), plans_ahead=False,
    mesh=None, shard_axis: bool,
):  # fmt: skip
    """The engine step's body (`_engine_step`); with ``shard_axis`` every per-request part runs
    per data shard (`engine_step_data_parallel`)."""
    split = "data" if shard_axis and data_shards(mesh) > 1 else None

    def per_shard(fn, *args):
        return jax.vmap(fn, spmd_axis_name=split)(*args) if shard_axis else fn(*args)

    step_in = functools.partial(_step_in, num_spec=num_spec, groups=groups, plans_ahead=plans_ahead)
    batch, sampling, spec, back, drafts_ok = per_shard(step_in, slots, batch, feed, sampling)
    kern = dict(impl=impl, interpret=interpret, shard_axis=shard_axis, mesh=mesh)
    targets = cfg.dspark_target_layer_ids if drafter else ()
    h, pools, streams = paged_forward_streams(params, cfg, layout, pools, batch, targets, **kern)
    if drafter:
        seed = functools.partial(seed_drafter, params, cfg, layout)
        pools = per_shard(seed, pools, batch, dspark.target_hidden(cfg, streams))
    sample = functools.partial(_sample_rows, params, num_spec=num_spec, num_logprobs=num_logprobs)
    out, accepted, last, sampler_state = per_shard(
        sample, h, batch, sampling, spec, back, drafts_ok, sampler_state
    )
    drafts = None
    if drafter:
        start = per_shard(_draft_start, batch, spec, accepted, sampling)
        block = draft_paged(params, cfg, layout, pools, batch, last, start, **kern)
        drafts = block.tokens[..., :num_spec]
    finish = functools.partial(_step_out, params, num_spec=num_spec, num_logprobs=num_logprobs)
    result, slots = per_shard(
        finish, h, sampling, spec, out, accepted, last, drafts, slots, plp_targets
    )
    if split is not None:
        # the host reads every shard's few results: replicated, each process (multi-host)
        # holds them whole
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        result = jax.lax.with_sharding_constraint(result, replicated)
    return result, pools, sampler_state, slots


@_engine_jit
def _engine_burst(
    params,
    pools,
    sampler_state: S.SamplerState,
    slots: SlotState,
    batches: StepBatch,  # k steps' batches, every leaf [k, ...] (the same buckets)
    feeds: jax.Array,  # i32[k, T]
    samplings,  # S.SamplingBatch, every leaf [k, ...]
    plp_targets: jax.Array,  # i32[k, T]
    num_steps: jax.Array,  # i32[] the steps to run, 1..k (the first num_steps of the k)
    **static,  # `_engine_step`'s static arguments
):
    """Up to k engine steps in one program (`ModelRunner.execute_burst`): `_engine_step` on
    the first ``num_steps`` steps' inputs in turn, the state carried from one to the next (a
    step's device-fed tokens are those the step before it sampled); one compilation for every
    burst length. Returns the packed results (sampled, prompt logprobs) stacked ([k, ...],
    zeros past ``num_steps``) and the state after the last step."""
    inputs = (batches, feeds, samplings, plp_targets)

    def one(i, state):
        step_inputs = jax.tree.map(lambda x: x[i], inputs)
        out, *state = _engine_step.__wrapped__(params, *state, *step_inputs, **static)
        return out, tuple(state)

    def body(i, carry):
        state, stacked = carry
        sampled, state = one(i, state)
        stacked = jax.tree.map(lambda acc, x: acc.at[i].set(x), stacked, sampled)
        return state, stacked

    state = (pools, sampler_state, slots)
    shapes, _ = jax.eval_shape(one, 0, state)
    stacked = jax.tree.map(lambda x: jnp.zeros((feeds.shape[0], *x.shape), x.dtype), shapes)
    # a loop of num_steps iterations: a burst shorter than k runs no step of padding
    state, stacked = jax.lax.fori_loop(0, num_steps, body, (state, stacked))
    return stacked, *state


def _step_in(slots: SlotState, batch: StepBatch, feed, sampling, *, num_spec, groups, plans_ahead):
    """A step's inputs on the device: tokens the host does not know read from the slots
    (``feed``); with drafts, rows planned past drafts in flight moved back by those their
    slot's last step rejected (`_move_back`). Returns ``(batch, sampling, spec, back,
    drafts_ok)`` (the last three None without drafts)."""
    on_device = jnp.concatenate([slots.last[:, None], slots.drafts], axis=1).reshape(-1)
    fed = on_device[jnp.maximum(feed, 0)]
    batch = dataclasses.replace(batch, token_ids=jnp.where(feed >= 0, fed, batch.token_ids))
    spec = back = drafts_ok = None
    if num_spec:
        sampling, spec = sampling
        rejected = slots.rejected[sampling.slot]
        # only a step planned while the one before was in flight has rows to move back
        back = jnp.where(spec.shifted, rejected, 0) if plans_ahead else jnp.zeros_like(rejected)
        guessed = (rejected == spec.guess_rejected) & (slots.last[sampling.slot] == spec.guess)
        drafts_ok = (spec.guess < 0) | guessed  # bool[R]
        if plans_ahead:
            batch = _move_back(batch, back, groups, spec.engram_history)
    return batch, sampling, spec, back, drafts_ok


def _sample_rows(
    params, h, batch, sampling, spec, back, drafts_ok, sampler_state, *, num_spec, num_logprobs
):
    """The head and the sampler on each row's sampled position (with drafts, `_verify`):
    the sampler outputs [R, 1 + k] (k = 0 without drafts), the accepted draft counts i32[R],
    each row's last emitted token i32[R] and the sampler state."""
    if num_spec:
        out, accepted, sampler_state = _verify(
            params,
            h,
            batch.token_ids,
            batch.logits_indices,
            sampling,
            spec,
            back,
            drafts_ok,
            sampler_state,
            num_spec=num_spec,
            num_logprobs=num_logprobs,
        )
        last = jnp.take_along_axis(out.token_ids, accepted[:, None], axis=1)[:, 0]
    else:
        logits = L.lm_head(params, h[batch.logits_indices])
        out, sampler_state = S.sample(logits, sampling, sampler_state, num_logprobs=num_logprobs)
        out = jax.tree.map(lambda x: x[:, None], out)  # one sampled position per row
        accepted = jnp.zeros(out.token_ids.shape[:1], jnp.int32)
        last = out.token_ids[:, 0]
    return out, accepted, last, sampler_state


def _step_out(
    params, h, sampling, spec, out, accepted, last, drafts, slots: SlotState, plp_targets,
    *, num_spec, num_logprobs,
):  # fmt: skip
    """The slots' state after a step (last token, drafts made: ``drafts`` i32[R, k] or None
    without a drafter, drafts rejected), prompt logprobs when some position asks for them,
    and the step's results packed for the host (`StepHandle.fetch`)."""
    slot, samples = sampling.slot, sampling.samples
    new_last = slots.last.at[slot].set(jnp.where(samples, last, slots.last[slot]))
    new_drafts, rejected = slots.drafts, slots.rejected
    if num_spec:
        keep = rejected[slot]
        rejected = rejected.at[slot].set(jnp.where(samples, spec.num_drafts - accepted, keep))
    if drafts is not None:
        keep = new_drafts[slot]
        new_drafts = new_drafts.at[slot].set(jnp.where(samples[:, None], drafts, keep))
    else:
        drafts = jnp.zeros((accepted.shape[0], 0), jnp.int32)
    slots = SlotState(last=new_last, drafts=new_drafts, rejected=rejected)

    def prompt_logprobs():
        return S.logprobs_of(L.lm_head(params, h), jnp.maximum(plp_targets, 0), num_logprobs)

    def nothing():
        return S.no_logprobs(plp_targets.shape[0], num_logprobs)

    plp = jax.lax.cond(jnp.any(plp_targets >= 0), prompt_logprobs, nothing)
    sampled = _pack(out.token_ids, out.logprob, out.rank, out.top_ids, out.top_logprobs)
    return ((*sampled, accepted, drafts), _pack(plp_targets, *plp)), slots


def _draft_start(batch: StepBatch, spec: SpecBatch, accepted, sampling) -> jax.Array:
    """i32[R] where each sampling row's DSpark block starts: the position after its last
    accepted token, ``(last verified position) + accepted + 1`` (0: the row drafts nothing)."""
    verified = batch.positions[batch.logits_indices] - spec.num_drafts  # [R]
    return jnp.where(sampling.samples, verified + accepted + 1, 0)


def _pack(token_ids, logprob, rank, top_ids, top_logprobs) -> tuple[jax.Array, jax.Array]:
    """Per row (and position): i32[..., 2 + L] (token, rank, top ids) and f32[..., 1 + L]
    (logprob, top logprobs): two transfers to the host instead of five."""
    ints = jnp.concatenate([token_ids[..., None], rank[..., None], top_ids], axis=-1)
    floats = jnp.concatenate([logprob[..., None], top_logprobs], axis=-1)
    return ints.astype(jnp.int32), floats.astype(jnp.float32)
