"""The paged step updates its donated pools in place: its compiled program never copies a whole
pool buffer. (A read whose consumer XLA schedules after a later write of the same buffer makes
it keep the old bytes in a copy: a decode step then costs O(pool) memory traffic, 60x slower at
30k blocks on the tiny model before the step ordered its reads and writes.)"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cache import KVCacheManager
from cache.layout import for_model
from dsv4.paged import pools as P
from dsv4.paged import records as R
from dsv4.paged.batch import StepRequest, build_batch
from dsv4.paged.step import paged_step_jit

NUM_BLOCKS = 4096


@pytest.mark.parametrize("layout_kind", ["aliased", "separate"])
def test_compiled_step_copies_no_pool_buffer(tiny_params, tiny_cfg, layout_kind):
    desc = P.cache_desc(tiny_cfg, R.EXACT, block_size=16, swa_block_size=4)
    config = for_model(desc, num_gpu_blocks_override=NUM_BLOCKS)
    layout = P.PoolLayout.build(tiny_cfg, config, R.EXACT, layout_kind)
    mgr = KVCacheManager(config, 128, max_num_batched_tokens=64)
    reqs = []
    for i, n in enumerate((21, 9)):  # a prefill chunk and a short one: every write and read
        tokens = list(range(3, 3 + n))
        req = mgr.new_request(f"r{i}", tokens)
        assert mgr.allocate_slots(req, n) is not None
        reqs.append(StepRequest(tokens, 0, mgr.get_block_ids(req.request_id), req_id=f"r{i}"))
    batch = build_batch(reqs, config, max_model_len=128, token_buckets=(32,), request_buckets=(4,))
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), batch)
    pools = {k: jax.ShapeDtypeStruct(s, jnp.uint8) for k, s in layout.buffer_shapes().items()}
    hlo = paged_step_jit.lower(tiny_params, pools, batch, cfg=tiny_cfg, layout=layout)
    text = hlo.compile().as_text()
    for shape in {s for s in layout.buffer_shapes().values()}:
        dims = ",".join(map(str, shape))
        copies = re.findall(rf"= u8\[{dims}\]\{{[0-9,]*\}} copy\(", text)
        assert not copies, f"{len(copies)} copies of a u8[{dims}] pool buffer"
