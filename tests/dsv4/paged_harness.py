"""A small driver for the paged step in tests: the host allocator hands out block ids, the
builder makes the batch, the jitted step runs it, and every real token's logits are collected
by (sequence, position) so they can be compared with `reference.forward`.

It plays the scheduler's part by hand: random chunk sizes, decodes mixed with prefills,
requests that share a cached prefix, preemption with recompute, and speculative rows (random
draft tokens written at lookahead positions, then rejected and overwritten by the next step).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from cache import KVCacheManager
from cache.layout import for_model
from dsv4.paged import pools as P
from dsv4.paged.batch import StepRequest, build_batch
from dsv4.paged.step import paged_step_jit


@dataclasses.dataclass
class Seq:
    """A request and the whole sequence it is teacher-forced along."""

    sid: int
    tokens: np.ndarray  # the full sequence (prompt + continuation)
    prompt_len: int
    req: object = None
    done: bool = False


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
        self.max_model_len = max_model_len
        self.impl, self.interpret = impl, interpret
        self.scaled_index_keys = scaled_index_keys
        self.bounded_replay = bounded_replay
        self.token_buckets, self.request_buckets = token_buckets, request_buckets
        self.table_buckets = table_buckets
        self.table_widths: set[tuple[int, ...]] = set()  # widths of the tables each step used
        self.logits: dict[tuple[int, int], np.ndarray] = {}
        self.steps = 0

    def run(self, work):
        """work: list of (Seq, tokens, start, replay_start, cache_write_from, n_real); the
        first n_real tokens are real (their logits are recorded), the rest are drafts."""
        reqs = [
            StepRequest(
                token_ids=list(tokens),
                start=start,
                block_ids=self.mgr.get_block_ids(s.req.request_id),
                replay_start=replay,
                cache_write_from=write_from,
                req_id=s.req.request_id,
            )
            for s, tokens, start, replay, write_from, _ in work
        ]
        batch = build_batch(
            reqs,
            self.config,
            max_model_len=self.max_model_len,
            token_buckets=self.token_buckets,
            request_buckets=self.request_buckets,
            table_buckets=self.table_buckets,
            debug=True,
        )
        self.table_widths.add(batch.table_widths())
        batch = jax.tree.map(jnp.asarray, batch)
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
        )
        logits = np.asarray(logits)
        t = 0
        for s, tokens, start, _, _, n_real in work:
            for i in range(n_real):
                self.logits[(s.sid, start + i)] = logits[t + i]
            t += len(tokens)
        self.steps += 1


def random_schedule(h: Harness, seqs: list[Seq], rng: np.random.Generator, *, spec_k=0,
                    preempt_p=0.0, max_chunk=8, max_running=4):  # fmt: skip
    """Teacher-force every sequence to its end through random steps."""
    waiting = list(seqs)
    running: list[Seq] = []
    while waiting or running:
        # admit
        while waiting and len(running) < max_running:
            s = waiting.pop(0)
            if s.req is None:
                s.req = h.mgr.new_request(f"s{s.sid}", list(s.tokens[: s.prompt_len]))
            hits, n_hits = h.mgr.get_computed_blocks(s.req)
            replay = h.mgr.num_replay_tokens(n_hits)
            s.hit = (hits, n_hits, replay)
            # bounded replay: windows clipped at the replay start, no compressed/index writes
            # for the replayed hit tokens (they are cached already)
            s.replay_start = n_hits - replay if h.bounded_replay else 0
            s.write_from = n_hits
            s.req.num_computed_tokens = 0
            s.fresh = True
            running.append(s)
        work = []
        budget = h.token_buckets[-1]
        for s in list(running):
            req = s.req
            if s.fresh:
                hits, n_hits, replay = s.hit
                start = n_hits - replay
                n = int(min(rng.integers(1, max_chunk + 1), req.num_tokens - start, budget))
                if n <= 0:
                    continue
                out = h.mgr.allocate_slots(req, max(n - replay, 0), n_hits, hits)
                assert out is not None, "pool too small for the test schedule"
                s.fresh = False
                work.append((s, s.tokens[start : start + n], start, s.replay_start, n_hits, n))
                req.num_computed_tokens = start + n
                budget -= n
                continue
            done_tokens = req.num_computed_tokens
            if done_tokens >= len(s.tokens):
                h.mgr.free(req)
                running.remove(s)
                s.done = True
                continue
            if preempt_p and rng.random() < preempt_p:
                h.mgr.free(req)
                running.remove(s)
                waiting.append(s)
                continue
            if done_tokens < req.num_tokens:  # prefill continues
                n = int(min(rng.integers(1, max_chunk + 1), req.num_tokens - done_tokens, budget))
                if n <= 0:
                    continue
                assert h.mgr.allocate_slots(req, n) is not None
                chunk = s.tokens[done_tokens : done_tokens + n]
                work.append((s, chunk, done_tokens, s.replay_start, s.write_from, n))
                req.num_computed_tokens += n
                budget -= n
            else:  # decode: the next true token, plus k random drafts that will be rejected
                k = int(rng.integers(0, spec_k + 1)) if spec_k else 0
                k = min(k, h.max_model_len - done_tokens - 1, budget - 1)
                if budget < 1:
                    continue
                nxt = int(s.tokens[done_tokens])
                req.append_output_token_ids(nxt)
                assert h.mgr.allocate_slots(req, 1, num_lookahead_tokens=k) is not None
                drafts = rng.integers(3, h.cfg.vocab_size, k)
                work.append((s, [nxt, *drafts.tolist()], done_tokens, s.replay_start, 0, 1))
                req.num_computed_tokens += 1
                budget -= 1 + k
        if work:
            h.run(work)
