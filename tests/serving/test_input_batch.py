"""`InputBatch`'s kept block tables (`dsv4.paged.batch.BlockTables`): over random admissions,
growth, preemptions (a resumed request re-enters with new blocks) and finishes, every step's
`build_batch` from the kept tables equals `build_batch` from the requests' block ids."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from cache.layout import for_model
from dsv4.paged import batch as B
from dsv4.paged import pools as P
from dsv4.paged import records as R
from serving.input_batch import InputBatch
from serving.scheduler import CachedRequestData, NewRequestData, SchedulerOutput

MAX_LEN = 96
NUM_SLOTS = 8


@pytest.fixture(scope="module")
def config(tiny_cfg):
    # a sliding-window group (blocks of 4), a compressed group (blocks of 16, two ratios), a ring
    desc = P.cache_desc(tiny_cfg, R.PRESETS["EXACT"], block_size=16, swa_block_size=4)
    return for_model(desc, num_gpu_blocks_override=200)


class _Sim:
    """Requests with host-known tokens and the blocks their positions need (a few spare),
    planned step by step as the scheduler would send them to the runner."""

    def __init__(self, config, rng) -> None:
        self.groups = B.group_infos(config)
        self.rng = rng
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.blocks: dict[str, list[list[int]]] = {}
        self.running: list[str] = []
        self.preempted: list[str] = []
        self.count = 0

    def _grow(self, request_id: str, end: int) -> tuple[list[int], ...]:
        """Blocks appended so that positions up to ``end`` find theirs (sometimes one spare)."""
        added = []
        for g, held in zip(self.groups, self.blocks[request_id], strict=True):
            if g.kind == "ring":
                more = [] if held or self.rng.random() < 0.2 else [int(self.rng.integers(1, 200))]
            else:
                full = -(-MAX_LEN // g.block_size)
                need = min(full, -(-end // g.block_size) + int(self.rng.integers(0, 2)))
                more = self.rng.integers(1, 200, max(0, need - len(held))).tolist()
            held.extend(more)
            added.append(more)
        return tuple(added)

    def step(self, inputs: InputBatch) -> SchedulerOutput:
        rng = self.rng
        finished = {r for r in self.running if rng.random() < 0.1}
        preempted = {r for r in self.running if r not in finished and rng.random() < 0.1}
        self.running = [r for r in self.running if r not in finished | preempted]
        self.preempted += sorted(preempted)
        new, cached, scheduled = [], [], {}
        for request_id in self.running:
            start = self.computed[request_id]
            n = min(int(rng.integers(1, 9)), len(self.tokens[request_id]) - start)
            if n == 0 or start + n > MAX_LEN - 1:
                continue
            added = self._grow(request_id, start + n)
            cached.append(CachedRequestData(request_id=request_id, new_block_ids=added,
                                            num_computed_tokens=start))  # fmt: skip
            scheduled[request_id] = n
        while len(self.running) < NUM_SLOTS and rng.random() < 0.6:
            if self.preempted and rng.random() < 0.5:  # a resumed request: new blocks
                request_id = self.preempted.pop(0)
            else:
                request_id = f"r{self.count}"
                self.count += 1
                self.tokens[request_id] = rng.integers(3, 100, int(rng.integers(2, 40))).tolist()
            self.blocks[request_id] = [[] for _ in self.groups]
            start = int(rng.integers(0, len(self.tokens[request_id])))  # a prefix hit
            n = min(int(rng.integers(1, 9)), len(self.tokens[request_id]) - start)
            self._grow(request_id, start + n)
            new.append(NewRequestData(request_id=request_id,
                                      token_ids=tuple(self.tokens[request_id]),
                                      block_ids=tuple(list(b) for b in self.blocks[request_id]),
                                      num_computed_tokens=start))  # fmt: skip
            self.computed[request_id] = start
            self.running.append(request_id)
            scheduled[request_id] = n
        for request_id, n in scheduled.items():
            self.computed[request_id] += n
        sampling = {r for r in scheduled if self.computed[r] == len(self.tokens[r])}
        return SchedulerOutput(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            scheduled_spec_decode_tokens={},
            num_common_prefix_blocks=[0] * len(self.groups),
            preempted_req_ids=preempted,
            finished_req_ids=finished,
            sampling_req_ids=frozenset(sampling),
        )

    def learn(self, inputs: InputBatch, output: SchedulerOutput) -> None:
        for request_id in output.sampling_req_ids:
            token = int(self.rng.integers(3, 100))
            self.tokens[request_id].append(token)
            inputs.learn(request_id, [token])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("table_buckets", [None, (2, 4)])
def test_kept_tables_build_the_batch_built_from_the_ids(config, seed, table_buckets):
    rng = np.random.default_rng(seed)
    sim = _Sim(config, rng)
    inputs = InputBatch(NUM_SLOTS)
    kwargs = dict(max_model_len=MAX_LEN, token_buckets=(8, 16, 32, 64, 128),
                  request_buckets=(4, 8, 16), table_buckets=table_buckets)  # fmt: skip
    sizes = set()
    for step in range(60):
        output = sim.step(inputs)
        inputs.update(output)
        if step == 5:  # kept from a batch that already runs requests
            inputs.keep_tables(sim.groups, MAX_LEN)
        for new in output.scheduled_new_reqs:
            inputs.admit(new, len(sim.tokens[new.request_id]))
        if not output.total_num_scheduled_tokens:
            continue
        _, step_requests = inputs.schedule(output)
        expected = B.build_batch(step_requests, config, **kwargs)
        if inputs.tables is not None:
            got = B.build_batch(step_requests, config, tables=inputs.tables, debug=True, **kwargs)
            assert expected.table_widths() == got.table_widths()
            for want, have in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
                np.testing.assert_array_equal(have, want)
            sizes.add((len(step_requests) > 4, output.total_num_scheduled_tokens > B._FEW_TOKENS))
        sim.learn(inputs, output)
    # both fills (token by token, vectorised), with a few rows and with more
    # the kept rows gathered by both fills (token by token, vectorised)
    assert {(True, False), (True, True)} <= sizes


def test_stale_or_missing_slots_raise(config):
    groups = B.group_infos(config)
    tables = B.BlockTables(groups, 2, MAX_LEN)
    ids = [[5, 6], [7], [9]]
    tables.set(1, ids)
    request = B.StepRequest(token_ids=[3], start=4, block_ids=ids, req_id="a", slot=1)
    kwargs = dict(max_model_len=MAX_LEN, token_buckets=(8,), request_buckets=(4,))
    good = B.build_batch([request], config, tables=tables, debug=True, **kwargs)
    np.testing.assert_array_equal(good.block_tables[0][0, :2], [5, 6])
    with pytest.raises(ValueError, match=r"request 0 \('a'\) has slot -1; .* slots 0\.\.1"):
        B.build_batch([dataclasses.replace(request, slot=-1)], config, tables=tables, **kwargs)
    tables.append(1, [[8], [], []])  # the tables saw a block the request does not hold
    with pytest.raises(ValueError, match=r"holds 2 blocks in group 0, but slot 1 .* holds 3"):
        B.build_batch([request], config, tables=tables, debug=True, **kwargs)
