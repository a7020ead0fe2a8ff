"""Deterministic multi-turn chat workload and a minimal FCFS scheduling loop.

The loop mirrors the parts of vLLM 0.32's synchronous ``Scheduler.schedule`` /
``update_from_output`` that decide what the KV-cache manager sees
(``vllm/v1/core/sched/scheduler.py``, reference note ``vllm_kv_cache.md`` §6.2):

* running requests first, in admission order, ``n = num_tokens - num_computed_tokens``
  capped by the step budget and by ``max_model_len - num_computed_tokens - 1``;
  ``allocate_slots(req, n, num_lookahead_tokens=L)``; on ``None`` preempt the *last* running
  request (FCFS), free it, reset it to 0 computed tokens and prepend it to ``waiting``; stop when
  the victim is the request being scheduled;
* waiting requests only when nothing was preempted this step, while budget remains and fewer
  than ``max_num_seqs`` run: ``get_computed_blocks`` (prefix hit), chunked prefill of
  ``min(num_tokens - hit, budget)`` tokens, ``allocate_slots(req, n, hit, hit_blocks,
  num_lookahead_tokens, full_sequence_must_fit, has_scheduled_reqs=bool(running))``; ``None``
  stops admission (no preemption for waiting requests);
* SWA bounded replay (a group with ``prefix_replay_tokens`` W > 0): hits of at most W tokens are
  dropped, longer hits are adopted whole but their last W tokens are recomputed
  (``Scheduler._mark_prefix_replay``), and ``allocate_slots`` is asked only for the tokens past
  the hit;
* after the step every scheduled request advances ``num_computed_tokens``; a request whose
  computed count reaches its token count samples one output token; a turn that has produced all
  its output tokens (or hits ``max_model_len``) is freed, in scheduling order, and the next turn of
  its conversation is appended to ``waiting``.

Differences from vLLM that are deliberate: no speculative tokens are ever scheduled (the
lookahead variant only reserves slots), no KV connector, no encoder inputs, no async scheduling
(``num_in_flight_tokens`` is 0 at every allocation, as in the synchronous scheduler).

vLLM 0.32 applies ``num_lookahead_tokens`` on a request's first allocation too (it only drops it
for async KV loads, ``scheduler.py`` ``effective_lookahead_tokens``); older vLLM used 0 when
``num_computed_tokens == 0``. ``LoopConfig.first_alloc_lookahead`` selects either rule.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from time import perf_counter_ns
from typing import Any, Protocol

__all__ = [
    "Adapter",
    "ChatWorkload",
    "Conversation",
    "LoopConfig",
    "LoopResult",
    "Turn",
    "make_chat_workload",
    "run_loop",
]


# --------------------------------------------------------------------------------------------
# Workload
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Turn:
    user: tuple[int, ...]
    output: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Conversation:
    conv_id: int
    system: int  # index into ChatWorkload.system_prompts
    turns: tuple[Turn, ...]


@dataclass(frozen=True, slots=True)
class ChatWorkload:
    seed: int
    system_prompts: tuple[tuple[int, ...], ...]
    conversations: tuple[Conversation, ...]

    def prompt(self, conv: Conversation, k: int) -> list[int]:
        """Turn ``k``'s prompt: system prompt + earlier turns (user + output) + new user."""
        toks = list(self.system_prompts[conv.system])
        for t in conv.turns[:k]:
            toks += t.user
            toks += t.output
        toks += conv.turns[k].user
        return toks

    @property
    def num_turns(self) -> int:
        return sum(len(c.turns) for c in self.conversations)

    def summary(self) -> dict[str, int]:
        prompt_tokens = sum(
            len(self.prompt(c, k)) for c in self.conversations for k in range(len(c.turns))
        )
        output_tokens = sum(len(t.output) for c in self.conversations for t in c.turns)
        return {
            "conversations": len(self.conversations),
            "turns": self.num_turns,
            "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens,
        }


def make_chat_workload(
    seed: int = 0,
    *,
    num_system_prompts: int = 8,
    num_conversations: int = 200,
    system_len: tuple[int, int] = (1024, 4096),
    turns: tuple[int, int] = (1, 5),
    user_len: tuple[int, int] = (32, 1024),
    output_len: tuple[int, int] = (16, 512),
    vocab_size: int = 100_000,
) -> ChatWorkload:
    """Seeded chat workload; every range is inclusive. Same seed -> identical workload."""
    rng = random.Random(seed)

    def toks(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(vocab_size) for _ in range(n))

    systems = tuple(toks(rng.randint(*system_len)) for _ in range(num_system_prompts))
    convs = []
    for cid in range(num_conversations):
        sys_idx = rng.randrange(num_system_prompts)
        n_turns = rng.randint(*turns)
        convs.append(
            Conversation(
                conv_id=cid,
                system=sys_idx,
                turns=tuple(
                    Turn(user=toks(rng.randint(*user_len)), output=toks(rng.randint(*output_len)))
                    for _ in range(n_turns)
                ),
            )
        )
    return ChatWorkload(seed=seed, system_prompts=systems, conversations=tuple(convs))


# --------------------------------------------------------------------------------------------
# Adapter interface
# --------------------------------------------------------------------------------------------


class Adapter(Protocol):
    """What the loop needs from a KV-cache manager. ``handle`` is the manager's request object."""

    name: str
    prefix_replay_tokens: int

    def make_request(self, request_id: str, prompt: list[int], max_tokens: int) -> Any: ...

    def get_computed_blocks(self, handle: Any) -> tuple[Any, int]: ...

    def allocate_slots(
        self,
        handle: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
        num_lookahead_tokens: int = 0,
        *,
        admission: bool = False,
        full_sequence_must_fit: bool = False,
        has_scheduled_reqs: bool = True,
    ) -> Any: ...

    def free(self, handle: Any) -> None: ...

    def append_output_token(self, handle: Any, token: int) -> None: ...

    def set_num_computed_tokens(self, handle: Any, n: int) -> None: ...

    def set_status(self, handle: Any, status: str) -> None:
        """``"running"`` on admission, ``"preempted"`` on preemption (bumps num_preemptions)."""

    def empty_blocks(self) -> Any: ...

    def block_ids(self, blocks: Any) -> tuple[tuple[int, ...], ...]: ...


# --------------------------------------------------------------------------------------------
# Loop
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LoopConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 16384
    num_lookahead_tokens: int = 0
    # vLLM 0.32: lookahead also on the first (waiting-queue) allocation; False = older rule.
    first_alloc_lookahead: bool = True
    # vLLM 0.32 default (SchedulerConfig.scheduler_reserve_full_isl = True).
    full_sequence_must_fit: bool = True
    max_steps: int | None = None


@dataclass(slots=True)
class _Req:
    request_id: str
    conv: Conversation
    turn: int
    handle: Any
    num_tokens: int
    max_tokens: int
    outputs: tuple[int, ...]
    num_computed: int = 0
    num_output: int = 0


@dataclass(slots=True)
class LoopResult:
    adapter: str
    steps: int = 0
    wall_ns: int = 0
    n_alloc: int = 0
    t_alloc_ns: int = 0
    n_alloc_fail: int = 0
    n_get: int = 0
    t_get_ns: int = 0
    n_free: int = 0
    t_free_ns: int = 0
    n_hashed_tokens: int = 0
    t_hash_ns: int = 0
    n_preemptions: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    finished_turns: int = 0
    log: list[tuple] | None = field(default=None)
    # (request_id, hit tokens as returned by get_computed_blocks), when logging.
    raw_hits: list[tuple[str, int]] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        def per(t: int, n: int) -> float:
            return round(t / n / 1e3, 4) if n else 0.0

        return {
            "us_per_allocate_slots": per(self.t_alloc_ns, self.n_alloc),
            "us_per_get_computed_blocks": per(self.t_get_ns, self.n_get),
            "us_per_free": per(self.t_free_ns, self.n_free),
            "us_per_hashed_token": per(self.t_hash_ns, self.n_hashed_tokens),
            "steps_per_s": round(self.steps / (self.wall_ns / 1e9), 2) if self.wall_ns else 0.0,
            "prefix_hit_rate": round(self.hit_tokens / self.query_tokens, 6)
            if self.query_tokens
            else 0.0,
        }

    def counts(self) -> dict[str, int]:
        return {
            "steps": self.steps,
            "allocate_slots_calls": self.n_alloc,
            "allocate_slots_none": self.n_alloc_fail,
            "get_computed_blocks_calls": self.n_get,
            "free_calls": self.n_free,
            "hashed_tokens": self.n_hashed_tokens,
            "preemptions": self.n_preemptions,
            "finished_turns": self.finished_turns,
        }


def run_loop(
    workload: ChatWorkload, adapter: Adapter, cfg: LoopConfig, *, record_log: bool = False
) -> LoopResult:
    """Replay ``workload`` through ``adapter`` until every turn has finished.

    Decision-log entries (when ``record_log``):
    ``("get", req_id, hit_block_ids_per_group, hit_tokens)`` (after the bounded-replay drop of
    hits no longer than the window; the raw returned lengths go to ``LoopResult.raw_hits``),
    ``("alloc", req_id, num_new_tokens, num_new_computed_tokens, new_block_ids_per_group | None)``,
    ``("free", req_id, why)`` with why in {"finish", "preempt"}.
    """
    clock = perf_counter_ns
    res = LoopResult(adapter=adapter.name)
    log: list[tuple] | None = [] if record_log else None
    res.log = log
    replay = adapter.prefix_replay_tokens
    lookahead = cfg.num_lookahead_tokens
    first_lookahead = lookahead if cfg.first_alloc_lookahead else 0
    budget_max = cfg.max_num_batched_tokens
    max_len = cfg.max_model_len

    def new_req(conv: Conversation, k: int) -> _Req:
        prompt = workload.prompt(conv, k)
        out = conv.turns[k].output
        rid = f"c{conv.conv_id}t{k}"
        t0 = clock()
        handle = adapter.make_request(rid, prompt, len(out))
        res.t_hash_ns += clock() - t0
        res.n_hashed_tokens += len(prompt)
        return _Req(rid, conv, k, handle, len(prompt), len(out), out)

    def free(r: _Req, why: str) -> None:
        t0 = clock()
        adapter.free(r.handle)
        res.t_free_ns += clock() - t0
        res.n_free += 1
        if log is not None:
            log.append(("free", r.request_id, why))

    def alloc(r: _Req, n: int, hit: int, blocks: Any, la: int, admission: bool, hs: bool) -> Any:
        t0 = clock()
        out = adapter.allocate_slots(
            r.handle,
            n,
            hit,
            blocks,
            la,
            admission=admission,
            full_sequence_must_fit=admission and cfg.full_sequence_must_fit,
            has_scheduled_reqs=hs,
        )
        res.t_alloc_ns += clock() - t0
        res.n_alloc += 1
        if out is None:
            res.n_alloc_fail += 1
        if log is not None:
            ids = None if out is None else adapter.block_ids(out)
            log.append(("alloc", r.request_id, n, hit, ids))
        return out

    t_start = clock()
    waiting: deque[_Req] = deque(new_req(c, 0) for c in workload.conversations)
    running: list[_Req] = []
    while waiting or running:
        if cfg.max_steps is not None and res.steps >= cfg.max_steps:
            break
        res.steps += 1
        budget = budget_max
        scheduled: list[tuple[_Req, int]] = []
        preempted = False

        # 1. running requests, in admission order
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            n = min(r.num_tokens - r.num_computed, budget, max_len - r.num_computed - 1)
            if n <= 0:
                i += 1
                continue
            while True:
                new = alloc(r, n, 0, None, lookahead, False, True)
                if new is not None:
                    break
                victim = running.pop()
                free(victim, "preempt")
                victim.num_computed = 0
                adapter.set_num_computed_tokens(victim.handle, 0)
                adapter.set_status(victim.handle, "preempted")
                res.n_preemptions += 1
                waiting.appendleft(victim)
                preempted = True
                if victim is r:
                    break
            if new is None:
                break
            scheduled.append((r, n))
            budget -= n
            i += 1

        # 2. waiting requests (FCFS), only if nothing was preempted this step
        if not preempted:
            while waiting and budget > 0 and len(running) < cfg.max_num_seqs:
                r = waiting[0]
                t0 = clock()
                blocks, hit = adapter.get_computed_blocks(r.handle)
                res.t_get_ns += clock() - t0
                res.n_get += 1
                raw_hit = hit
                if replay and 0 < hit <= replay:
                    blocks, hit = adapter.empty_blocks(), 0
                if log is not None:
                    # Post-drop values: ours drops short bounded-replay hits inside
                    # get_computed_blocks, vLLM's scheduler drops them after the call.
                    log.append(("get", r.request_id, adapter.block_ids(blocks), hit))
                    res.raw_hits.append((r.request_id, raw_hit))
                num_replay = min(replay, hit)
                computed = hit - num_replay
                n = min(r.num_tokens - computed, budget)
                new = alloc(
                    r, max(n - num_replay, 0), hit, blocks, first_lookahead, True, bool(running)
                )
                if new is None:
                    break
                waiting.popleft()
                running.append(r)
                adapter.set_status(r.handle, "running")
                res.query_tokens += r.num_tokens
                res.hit_tokens += hit
                r.num_computed = computed
                scheduled.append((r, n))
                budget -= n

        if not scheduled and not running:
            raise RuntimeError(
                f"{adapter.name}: step {res.steps} cannot admit {waiting[0].request_id} "
                f"({waiting[0].num_tokens} tokens) into an idle pool; the pool is too small"
            )

        # 3. update after schedule + model output
        finished: list[_Req] = []
        for r, n in scheduled:
            r.num_computed += n
            adapter.set_num_computed_tokens(r.handle, r.num_computed)
            if r.num_computed >= r.num_tokens:
                tok = r.outputs[r.num_output]
                r.num_output += 1
                t0 = clock()
                adapter.append_output_token(r.handle, tok)
                res.t_hash_ns += clock() - t0
                res.n_hashed_tokens += 1
                r.num_tokens += 1
                if r.num_output >= r.max_tokens or r.num_tokens >= max_len:
                    finished.append(r)
        if finished:
            done = set(id(r) for r in finished)
            running = [r for r in running if id(r) not in done]
            for r in finished:
                free(r, "finish")
                res.finished_turns += 1
                if r.turn + 1 < len(r.conv.turns):
                    waiting.append(new_req(r.conv, r.turn + 1))
    res.wall_ns = clock() - t_start
    return res


def first_difference(a: list[tuple], b: list[tuple]) -> dict[str, Any] | None:
    """Index and entries of the first differing decision-log entry (None if identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return {"index": i, "a": repr(x)[:600], "b": repr(y)[:600]}
    if len(a) != len(b):
        i = min(len(a), len(b))
        return {
            "index": i,
            "a": repr(a[i])[:600] if i < len(a) else "<end>",
            "b": repr(b[i])[:600] if i < len(b) else "<end>",
        }
    return None
