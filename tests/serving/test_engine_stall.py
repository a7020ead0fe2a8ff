"""A request the whole pool cannot hold finishes with "error" instead of hanging the engine.

vLLM refuses at start-up a pool that cannot hold one ``max_model_len`` request, so its scheduler
never meets such a request; this engine accepts tight pools, and before this check it waited
forever when the head of ``waiting`` did not fit an idle pool: a long prompt, or a request that
outgrew the pool (alone, it preempts itself; each readmission recomputes it and samples one
token more, until the recompute no longer fits). Both are checked next to requests that fit:
their tokens are the reference's, the stalled request keeps the tokens it had (a prefix of the
reference's), and every block is free after.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from engine_testing import Arrival, assert_pool_is_whole, drive, make_engine, reference_tokens

from serving.metrics import compilation_count
from serving.sampling_params import SamplingParams

NUM_BLOCKS = 10  # a 40-token prompt is never admitted; a 10-token one grows to about 80 tokens


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.parametrize(
    "async_scheduling",
    [pytest.param(False, id="sync", marks=pytest.mark.slow), pytest.param(True, id="async")],
)
def test_requests_the_pool_cannot_hold_finish_with_error(tiny_params, tiny_cfg, async_scheduling):
    rng = np.random.default_rng(0)
    prompt = lambda n: tuple(rng.integers(3, tiny_cfg.vocab_size, n).tolist())  # noqa: E731
    fits = [
        Arrival(0, "small0", prompt(6), _greedy(8)),
        Arrival(2, "small1", prompt(7), _greedy(6)),
    ]
    huge = Arrival(0, "huge", prompt(40), _greedy(4))  # never admitted, even alone
    grow = Arrival(0, "grow", prompt(10), _greedy(110))  # admitted; outgrows the pool
    late = Arrival(200, "late", prompt(5), _greedy(5))  # after both have failed
    arrivals = sorted([huge, grow, *fits, late], key=lambda a: a.step)
    engine = make_engine(
        tiny_params, tiny_cfg, num_gpu_blocks_override=NUM_BLOCKS, async_scheduling=async_scheduling
    )
    before = compilation_count()
    with pytest.warns(RuntimeWarning, match=r"'huge' finished with 'error': its 40 tokens"):
        finals, _ = drive(engine, arrivals)
    assert compilation_count() == before
    assert_pool_is_whole(engine)

    assert finals["huge"].outputs[0].finish_reason == "error"
    assert finals["huge"].outputs[0].token_ids == []
    # grow's first 16 tokens come from the same reference batch (one compilation)
    grow16 = Arrival(grow.step, grow.request_id, grow.prompt, _greedy(16))
    expected = reference_tokens(tiny_params, tiny_cfg, [*fits, late, grow16])
    for a in [*fits, late]:
        out = finals[a.request_id].outputs[0]
        assert (out.finish_reason, out.token_ids) == ("length", expected[a.request_id])

    out = finals["grow"].outputs[0]
    assert out.finish_reason == "error"
    assert 16 < len(out.token_ids) < 110
    assert out.token_ids[:16] == expected["grow"]
    assert finals["grow"].metrics.num_preemptions > 0  # it outgrew the pool, then stalled
    assert engine.stats.num_requests_finished == 5


def test_stalled_request_is_none_while_anything_can_move(tiny_params, tiny_cfg):
    """`Scheduler.stalled_request` is a pure query: None while a step is scheduled, a request
    runs, nothing waits, a step is in flight (it may hold blocks), or a preemption in the step
    skipped admission."""
    engine = make_engine(tiny_params, tiny_cfg, num_gpu_blocks_override=NUM_BLOCKS)
    scheduler = engine.scheduler
    engine.add_request("huge", list(range(3, 43)), _greedy(4))
    output = scheduler.schedule()
    assert scheduler.stalled_request(output, steps_in_flight=1) is None  # may still free blocks
    assert scheduler.stalled_request(output, steps_in_flight=0).request_id == "huge"
    preempting = dataclasses.replace(output, preempted_req_ids={"huge"})
    assert scheduler.stalled_request(preempting, steps_in_flight=0) is None
    engine.abort_request("huge")
    engine.add_request("ok", list(range(3, 9)), _greedy(2))
    output = scheduler.schedule()
    assert output.total_num_scheduled_tokens == 6
    assert scheduler.stalled_request(output, steps_in_flight=0) is None
