"""The whole paged step with the real kernels (not interpreted) compiles deviceless for TPU v6e
(libtpu) and an H100 (CUDA plugin), for the serving default (bf16 activations, bf16 records),
the released record formats and fp32: the step's use of the kernels (dtypes, page shapes, the
compressor without records, the compacted tables) must hold on the chips, not only in the
interpreters. Tiny V4.1 model (every layer role), one ragged batch of two prefills. The serving
default runs with Engram (`tiny_v41_full`: its 32-bit-halves hash and row lookup must compile
too) in every test run; the other formats are long variants (marked slow)."""

from __future__ import annotations

import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_harness import Harness, plan_step

from dsv4.config import tiny_v41_full
from dsv4.paged import records as R
from dsv4.paged.batch import build_batch
from dsv4.paged.step import paged_step
from dsv4.params import abstract_params
from serving.input_batch import InputBatch
from serving.scheduler import StopCriteria

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "pallas_kernels"))
from aot import (
    compile_for_h100,
    compile_for_tpu,
    requires_cuda_plugin,
    requires_libtpu,
)

# jax 0.12 deprecates (but ships) the Pallas Triton backend the GPU kernels use.
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

CASES = {  # (record formats, parameter / activation dtype)
    "bf16-serving": (R.CacheFormats.BF16, jnp.bfloat16),
    "released": (R.CacheFormats.RELEASED, jnp.bfloat16),
    "released-fp8": (R.CacheFormats.RELEASED_FP8, jnp.bfloat16),  # fp8 index keys undecoded
    "fp32-exact": (R.CacheFormats.EXACT, jnp.float32),
}


def _abstract_step(cfg, formats, dtype, impl):
    """(step function, abstract params, pools, batch) for one two-request prefill batch."""
    h = Harness(cfg, None, formats)
    scheduler = h.scheduler(max_num_seqs=2)
    for i, n in enumerate((20, 9)):
        request = h.mgr.new_request(f"r{i}", list(range(3, 3 + n)), max_tokens=1)
        scheduler.add_request(request, StopCriteria())
    output, _, reqs = plan_step(scheduler, InputBatch(2, engram_lookback=cfg.engram_lookback))
    assert output.num_scheduled_tokens == {"r0": 20, "r1": 9}, output.num_scheduled_tokens
    batch = build_batch(reqs, h.config, max_model_len=h.max_model_len, token_buckets=(32,),
                        request_buckets=(8,), engram_lookback=cfg.engram_lookback)  # fmt: skip
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), batch)
    pools = {k: jax.ShapeDtypeStruct(s, jnp.uint8) for k, s in h.layout.buffer_shapes().items()}
    step = functools.partial(paged_step, cfg=cfg, layout=h.layout, impl=impl)
    return (lambda p, po, b: step(p, pools=po, batch=b)), abstract_params(cfg, dtype), pools, batch


# the serving default with Engram in the default run; the other formats are long variants
PARAMS = [pytest.param(c, marks=() if c == "bf16-serving" else pytest.mark.slow) for c in CASES]


def _cfg(case, tiny_cfg):
    return tiny_v41_full() if case == "bf16-serving" else tiny_cfg


@requires_libtpu
@pytest.mark.parametrize("case", PARAMS)
def test_paged_step_compiles_for_tpu(tiny_cfg, case):
    fn, *args = _abstract_step(_cfg(case, tiny_cfg), *CASES[case], impl="tpu")
    compile_for_tpu(fn, *args, topology="v6e:1x1")


@requires_cuda_plugin
@pytest.mark.parametrize("case", PARAMS)
def test_paged_step_compiles_for_h100(tiny_cfg, case):
    fn, *args = _abstract_step(_cfg(case, tiny_cfg), *CASES[case], impl="gpu")
    compile_for_h100(fn, *args)
