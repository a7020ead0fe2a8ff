"""The paged step with the Pallas kernels (interpret mode on CPU) instead of the jnp references:
the same schedule must give the reference forward's logits (fp32 records, 1e-4).

The TPU kernels run under the HLO interpreter (`interpret=True`) and the Triton kernels under
Pallas' GPU interpreter; the kernels' own tests cover the checking interpreter, NaN pages and
lowering. Sequences are short (28 tokens: the r=1 layers already select 16 of up to 28 entries)
because interpreted kernels are slow.
"""

from __future__ import annotations

import numpy as np
import pytest
from paged_harness import Harness, data_parallel_schedules, random_schedule
from test_paged_step import make_seqs, reference_logits

from dsv4.paged import records as R


@pytest.mark.parametrize("impl", ["gpu", pytest.param("tpu", marks=pytest.mark.slow)])
def test_paged_step_with_interpreted_kernels(tiny_params, tiny_cfg, impl):
    rng = np.random.default_rng(4)
    seqs = make_seqs(tiny_cfg, rng, 2)
    for s in seqs:
        s.tokens = s.tokens[:28]
        s.prompt_len = min(s.prompt_len, 20)
    ref = reference_logits(tiny_params, tiny_cfg, seqs)
    h = Harness(
        tiny_cfg,
        tiny_params,
        R.CacheFormats.EXACT,
        impl=impl,
        interpret=True,
        token_buckets=(16,),
        request_buckets=(4,),
    )
    random_schedule(h, seqs, rng, spec_k=2)
    assert h.steps >= 10
    assert 0 < h.stats.num_accepted_tokens < h.stats.num_draft_tokens, h.stats
    d = np.array([np.abs(v - ref[sid, p]).max() for (sid, p), v in h.logits.items()])
    assert len(d) >= 40 and np.isfinite(d).all()
    assert d.max() < 1e-4, d.max()


@pytest.mark.parametrize("impl", ["gpu", pytest.param("tpu", marks=pytest.mark.slow)])
def test_data_parallel_step_with_interpreted_kernels(tiny_params, tiny_cfg, impl):
    """`paged_step_data_parallel` runs the kernels under its vmap (a batched Pallas call): two
    shards, each its own allocator and pools, give the reference forward's logits."""
    rng = np.random.default_rng(5)
    seqs = [make_seqs(tiny_cfg, rng, 1 + i) for i in range(2)]
    for shard in seqs:
        for s in shard:
            s.tokens = s.tokens[:24]
            s.prompt_len = min(s.prompt_len, 16)
    kw = dict(impl=impl, interpret=True, token_buckets=(16,), request_buckets=(4,))
    hs = [Harness(tiny_cfg, tiny_params, R.CacheFormats.EXACT, **kw) for _ in seqs]
    data_parallel_schedules(hs, seqs, rng)
    for h, shard in zip(hs, seqs):
        ref = reference_logits(tiny_params, tiny_cfg, shard)
        d = np.array([np.abs(v - ref[sid, p]).max() for (sid, p), v in h.logits.items()])
        assert len(d) >= 20 and np.isfinite(d).all()
        assert d.max() < 1e-4, d.max()
