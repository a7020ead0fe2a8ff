"""fp8 index keys (``key_scales``): e4m3 rows with one power-of-two f32 scale per key, the
fp8_132 index-key record. The reference scores the decoded keys (row x scale); the GPU kernel
reads the 8-bit rows and scales each score, the TPU kernel DMAs rows and scales and decodes
each chunk in VMEM (a consumer's wrapper decodes first). All must select
exactly what the reference selects on the decoded keys (integer data: exact scores).
Also: deviceless compiles with fp8 keys at the released shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from aot import compile_for_h100, compile_for_tpu, requires_cuda_plugin, requires_libtpu
from indexer_cases import RELEASED_MODES, indexer_released_args
from test_indexer import (
    KERNEL_BATCH,
    K,
    args_of,
    check_exact,
    make_case,
)

from pallas_kernels.indexer import indexer_topk

# jax 0.12 deprecates (but ships) the Pallas Triton backend the GPU kernel uses.
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


def _fp8_case(seed):
    case = make_case(*KERNEL_BATCH, seed=seed)
    p, e, _ = case["ikey_pages"].shape
    values = case["ikey_pages"].astype(jnp.float8_e4m3fn)  # -2..2 exact; NaN pages stay NaN
    scales = jnp.asarray(2.0 ** np.random.default_rng(seed).integers(-3, 4, (p, e)), jnp.float32)
    decoded = values.astype(jnp.float32) * scales[..., None]
    return case, values, scales, decoded


def _with_pages(case, pages):
    args = list(args_of(case))
    args[2] = pages
    return args


@pytest.mark.parametrize("impl", ["reference", "gpu", pytest.param("tpu", marks=pytest.mark.slow)])
def test_fp8_keys_select_like_decoded_keys(impl):
    case, values, scales, decoded = _fp8_case(31)
    e = case["e"]
    kernel = {} if impl == "reference" else {"interpret": True}
    for extra in ({}, {"candidate_block_size": 4, "candidate_topk_blocks": 3}):
        kw = dict(entries_per_block=e, k=K, **extra)
        want = indexer_topk(*_with_pages(case, decoded), **kw, impl="reference")
        got = indexer_topk(*_with_pages(case, values), **kw, key_scales=scales, impl=impl, **kernel)
        if extra:
            check_exact(got[0], want[0], K)
            check_exact(got[1], want[1], 3)
            cons = dict(entries_per_block=e, k=K, candidate_block_size=4, candidates=want[1])
            want_c = indexer_topk(*_with_pages(case, decoded), **cons, impl="reference")
            got_c = indexer_topk(*_with_pages(case, values), **cons, key_scales=scales, impl=impl,
                                 **kernel)  # fmt: skip
            check_exact(got_c, want_c, K)
        else:
            check_exact(got, want, K)


def test_key_scales_shape_is_checked():
    case, values, scales, _ = _fp8_case(32)
    with pytest.raises(ValueError, match="key_scales must be f32"):
        indexer_topk(*_with_pages(case, values), entries_per_block=case["e"], k=K,
                     key_scales=scales[:, :1], impl="reference")  # fmt: skip


@requires_cuda_plugin
@pytest.mark.parametrize("mode", sorted(RELEASED_MODES))
def test_h100_compiles_with_fp8_keys(mode):
    spec, e, args = _released_fp8(mode)
    kw = dict(spec["kw"], entries_per_block=e, impl="gpu")
    if spec.get("candidates"):
        args.append(jax.ShapeDtypeStruct((8, 2048), jnp.int32))
        compile_for_h100(lambda *a: indexer_topk(*a[:7], key_scales=a[7], candidates=a[8], **kw),
                         *args)  # fmt: skip
    else:
        compile_for_h100(lambda *a: indexer_topk(*a[:7], key_scales=a[7], **kw), *args)


def test_tpu_fp8_keys_checking_interpreter():
    """The TPU kernel DMAs the e4m3 rows and their scales page by page and decodes each chunk
    once in VMEM (a prefill chunk's tiles share it): simulated DMAs, race detection, NaN
    scratch."""
    from test_indexer import checking_interpreter
    from test_indexer_tiles_tpu import PREFILL_BATCH

    case = make_case(*PREFILL_BATCH, e=8, seed=33)
    p, e, _ = case["ikey_pages"].shape
    values = case["ikey_pages"].astype(jnp.float8_e4m3fn)
    scales = jnp.asarray(2.0 ** np.random.default_rng(33).integers(-3, 4, (p, e)), jnp.float32)
    decoded = values.astype(jnp.float32) * scales[..., None]
    for extra in ({}, {"candidate_block_size": 4, "candidate_topk_blocks": 2}):
        kw = dict(entries_per_block=e, k=K, **extra)
        want = indexer_topk(*_with_pages(case, decoded), **kw, impl="reference")
        got = indexer_topk(*_with_pages(case, values), **kw, key_scales=scales, impl="tpu",
                           interpret=checking_interpreter())  # fmt: skip
        if extra:
            check_exact(got[0], want[0], K)
            check_exact(got[1], want[1], 2)
        else:
            check_exact(got, want, K)


def _released_fp8(mode):
    spec = RELEASED_MODES[mode]
    e = spec["e"]
    args = list(indexer_released_args(8, (128 * 1024) // (2 if e == 32 else 1), e))
    args[2] = jax.ShapeDtypeStruct(args[2].shape, jnp.float8_e4m3fn)
    args.append(jax.ShapeDtypeStruct(args[2].shape[:2], jnp.float32))
    return spec, e, args


@requires_libtpu
@pytest.mark.parametrize("topology", ["v5e:1x1", "v6e:1x1"])
@pytest.mark.parametrize("mode", ["plain-r2", "source-r1"])
def test_tpu_compiles_with_fp8_keys(mode, topology):
    spec, e, args = _released_fp8(mode)
    kw = dict(spec["kw"], entries_per_block=e, impl="tpu")
    compile_for_tpu(lambda *a: indexer_topk(*a[:7], key_scales=a[7], **kw), *args,
                    topology=topology)  # fmt: skip
