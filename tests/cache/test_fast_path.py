"""The fused allocation path must make exactly the decisions of the general path."""

from __future__ import annotations

import random

import pytest
from cache_testing import full, manager, swa

from cache import KVCacheManager
from cache.layout import for_model, tiny_v41_desc


def _replay(mgr: KVCacheManager, seed: int) -> list:
    """A deterministic chat-like run; returns every decision (hits, block ids, frees)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(10, 90))] for _ in range(3)]
    log: list = []
    running = []
    for step in range(400):
        if len(running) < 6 and rng.random() < 0.3:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 60))]
            req = mgr.new_request(f"r{step}", prompt)
            hits, num_hits = mgr.get_computed_blocks(req)
            n = min(req.num_tokens - num_hits, rng.randint(1, 64))
            new = mgr.allocate_slots(
                req, n, num_hits, hits, num_lookahead_tokens=rng.choice([0, 3])
            )
            log.append(("admit", num_hits, None if new is None else new.get_block_ids()))
            if new is not None:
                req.num_computed_tokens = num_hits + n
                running.append(req)
            continue
        if not running:
            continue
        req = rng.choice(running)
        if rng.random() < 0.1:
            mgr.free(req)
            running.remove(req)
            log.append(("free", req.request_id))
            continue
        if req.num_computed_tokens < req.num_tokens:
            n = min(req.num_tokens - req.num_computed_tokens, rng.randint(1, 64))
        else:
            req.append_output_token_ids(rng.randrange(50))
            n = req.num_tokens - req.num_computed_tokens
        if req.num_computed_tokens + n >= mgr.max_model_len:
            continue
        new = mgr.allocate_slots(req, n, num_lookahead_tokens=rng.choice([0, 3]))
        log.append(("step", req.request_id, None if new is None else new.get_block_ids()))
        if new is None:
            mgr.free(req)
            running.remove(req)
            req.num_computed_tokens = 0
        else:
            req.num_computed_tokens += n
        log.append(
            [[b.block_id for b in g] for g in mgr.get_blocks(req.request_id).blocks]
            if new
            else None
        )
    log.append([b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()])
    return log


LAYOUTS = {
    "full": lambda **kw: manager([full()], num_blocks=22, baseline=False, **kw),
    "swa+full": lambda **kw: manager([full(32), swa(16, 32)], num_blocks=30, baseline=False, **kw),
    "v41": lambda **kw: KVCacheManager(
        for_model(tiny_v41_desc(), num_gpu_blocks_override=70), 512, **kw
    ),
}


@pytest.mark.parametrize("seed", [7, 11, 23])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("options", [{}, {"use_eagle": True}, {"enable_caching": False}])
def test_fused_path_matches_general_path(layout, options, seed):
    """Also covers the fused path's shortcut for calls with nothing to do (the quiet limits):
    most decode steps of the replay take it."""
    fast = LAYOUTS[layout](**options)
    slow = LAYOUTS[layout](**options)
    slow.coordinator.plain_path = False
    assert _replay(fast, seed=seed) == _replay(slow, seed=seed)
