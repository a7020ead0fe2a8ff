"""dsv4.qweights: fp8 / FP4 weights kept in their released bytes on device.

A checkpoint saved with `save_pretrained` and loaded with ``weights_on_device="released"`` holds
exactly the bytes `quantise_params` makes in memory; dequantised, they are the dequantised load's
values bit for bit, so every path computes the same numbers: the reference forward, `generate`,
the paged step and `LLM` (the model-level runs are long variants behind ``make test-slow``; the
default run keeps the layer-level reads under jit and the reference forward of the full tiny
model). The released params take the checkpoint's bytes: exactly for the tiny models in bf16,
and for the abstract ``v41_flash`` (its Engram tables on the host) 1.000002x the checkpoint's
306.6 GB (the int32 Engram token map is the difference), where dequantised bf16 params take
3.69x (FP4 experts grow fourfold).
"""

from __future__ import annotations

import math
import os
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv4 import checkpoint as ck
from dsv4 import engram, qweights, reference
from dsv4 import layers as L
from dsv4.config import v41_flash
from dsv4.params import Storage, param_specs
from dsv4.qweights import QuantisedWeight
from tests.multidevice import run_script


def _bytes(x) -> np.ndarray:
    a = np.asarray(x)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


def assert_same_params(a, b):
    """Same names, same pytree structure (formats, shapes, dtypes), same leaves bit for bit."""
    assert a.keys() == b.keys()
    for n in a:
        assert jax.tree.structure(a[n]) == jax.tree.structure(b[n]), n
        for x, y in zip(jax.tree.leaves(a[n]), jax.tree.leaves(b[n]), strict=True):
            assert x.dtype == y.dtype and np.array_equal(_bytes(x), _bytes(y)), n


@pytest.fixture(scope="module")
def saved(engram_cfg, engram_params, tmp_path_factory):
    """The full tiny model (Engram + DSpark) in the released format."""
    path = tmp_path_factory.mktemp("released") / "tiny_v41_full"
    ck.save_pretrained(engram_params, engram_cfg, path)
    return str(path)


@pytest.fixture(scope="module")
def both(saved):
    """(dequantised, released) params of the saved checkpoint, Engram tables on device."""
    kw = dict(progress=False, engram_tables="device")
    _, dequantised = ck.load_pretrained(saved, **kw)
    _, released = ck.load_pretrained(saved, weights_on_device="released", **kw)
    return dequantised, released


# -- the format ------------------------------------------------------------------------------


def _random_fp8(rng, shape):
    b = rng.integers(0, 256, shape, dtype=np.uint8)
    b[(b & 0x7F) == 0x7F] = 0x3C  # no NaN codes
    return b


def test_decoding_equals_the_checkpoint_decoders():
    """`astype` against dequant_fp8 / dequant_fp4 / dequant_fp8_rows on random bytes: tiles that
    divide the weight and tiles that overhang it, stacked experts, scale byte 0 (2^-127, a
    float32 subnormal) on values it leaves normal; ``w[ids]`` and ``take`` gather codes and
    scales of the leading axis only. (Scales that make results subnormal are left out: XLA
    flushes those to zero, numpy does not.)"""
    rng = np.random.default_rng(0)
    blk = 32
    decode = jax.jit(lambda w: w.astype(jnp.float32))
    # bfloat16 is decoded in bfloat16 itself: the float32 result, cast (every value is exact)
    decode_bf16 = jax.jit(lambda w: w.astype(jnp.bfloat16).astype(jnp.float32))

    def bf16(x):
        return x.astype(ml_dtypes.bfloat16).astype(np.float32)

    for shape in ((64, 96), (3, 40, 70)):
        v = _random_fp8(rng, shape)
        s = rng.integers(20, 240, (*shape[:-2], -(-shape[-2] // blk), -(-shape[-1] // blk)))
        s = s.astype(np.uint8)
        s[..., 0, 0] = 0
        v[..., :blk, :blk] = (v[..., :blk, :blk] & 0x87) | 0x60  # |values| 32..60
        w = QuantisedWeight(jnp.asarray(v.view(ml_dtypes.float8_e4m3fn)), jnp.asarray(s),
                            format="fp8", shape=shape, dtype=jnp.float32, block=blk)  # fmt: skip
        want = ck.dequant_fp8(v, s, blk)
        np.testing.assert_array_equal(np.asarray(decode(w)), want)
        np.testing.assert_array_equal(np.asarray(decode_bf16(w)), bf16(want))
        np.testing.assert_array_equal(bf16(want), want)
    ids = np.array([[2, 0], [1, 2]])
    np.testing.assert_array_equal(np.asarray(decode(w[ids])), want[ids])
    assert w[ids].shape == (2, 2, 40, 70) and w[1].shape == (40, 70)

    packed = rng.integers(0, 256, (4, 16, 48), dtype=np.uint8)
    s = rng.integers(90, 160, (4, 16, 3), dtype=np.uint8)
    w = QuantisedWeight(jnp.asarray(packed), jnp.asarray(s), format="fp4", shape=(4, 16, 96),
                        dtype=jnp.bfloat16, block=blk)  # fmt: skip
    want = ck.dequant_fp4(packed, s)
    # bf16 holds every e2m1 value times a power of two exactly
    np.testing.assert_array_equal(np.asarray(w.astype(jnp.bfloat16)).astype(np.float32), want)
    np.testing.assert_array_equal(np.asarray(decode(w[jnp.asarray([3, 3])])), want[[3, 3]])

    v, s = _random_fp8(rng, (10, 64)), rng.integers(100, 150, (10, 2), dtype=np.uint8)
    w = QuantisedWeight(jnp.asarray(v.view(ml_dtypes.float8_e4m3fn)), jnp.asarray(s),
                        format="fp8_rows", shape=(10, 64), dtype=jnp.float32, block=blk)  # fmt: skip
    rows = jnp.asarray([[9, 0, 12]])  # 12 is clipped to the last row, as the float table's take
    got = np.asarray(decode(w.take(rows, mode="clip")))
    np.testing.assert_array_equal(got, ck.dequant_fp8_rows(v, s, blk)[np.minimum(rows, 9)])
    np.testing.assert_array_equal(np.asarray(decode_bf16(w)), ck.dequant_fp8_rows(v, s, blk))


def test_fp4_codes_decode_to_the_e2m1_table_bit_for_bit():
    """Every byte's two e2m1 codes (low nibble first) decode under jit to `E2M1_VALUES`' float32
    bits, the sign of zero included, with no table lookup in the compiled program."""
    from dsv4.formats import unpack_e2m1
    from dsv4.quant import E2M1_VALUES

    packed = np.arange(256, dtype=np.uint8).reshape(16, 16)
    unpack = jax.jit(unpack_e2m1)
    got = np.asarray(unpack(jnp.asarray(packed)))
    want = np.stack([E2M1_VALUES[packed & 15], E2M1_VALUES[packed >> 4]], -1).reshape(16, 32)
    np.testing.assert_array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))
    hlo = unpack.lower(jax.ShapeDtypeStruct((16, 16), jnp.uint8)).as_text()
    assert "gather" not in hlo


def test_constructor_and_indexing_errors_name_the_problem():
    v = jnp.zeros((64, 64), jnp.float8_e4m3fn)
    with pytest.raises(
        ValueError, match=r"scales \[2, 2\]; got values \[64, 64\] and scales \[2\]"
    ):
        QuantisedWeight(v, jnp.zeros((2,), jnp.uint8), format="fp8", shape=(64, 64),
                        dtype=jnp.float32, block=32)  # fmt: skip
    with pytest.raises(ValueError, match="format='int4' is not allowed: one of fp8, fp4, fp8_rows"):
        QuantisedWeight(v, v, format="int4", shape=(64, 64), dtype=jnp.float32, block=32)
    w = QuantisedWeight(v, jnp.zeros((2, 2), jnp.uint8), format="fp8", shape=(64, 64),
                        dtype=jnp.float32, block=32)  # fmt: skip
    with pytest.raises(IndexError, match=r"indexed on its 0 leading axes only .* got 3"):
        w[3]


# -- loading, quantising, saving ---------------------------------------------------------------


def test_released_load_is_quantise_params_and_dequantises_exactly(
    engram_cfg, engram_params, saved, both, tmp_path
):
    """Loaded in the released format = `quantise_params` of the params in memory, leaf for leaf;
    dequantised = the dequantised load, bit for bit; saved again = the same file, byte for byte."""
    dequantised, released = both
    formats = {n: w.format for n, w in released.items() if isinstance(w, QuantisedWeight)}
    stored = {n: s.storage.value for n, s in param_specs(engram_cfg).items()}
    assert formats == {n: s for n, s in stored.items() if s in qweights.FORMATS}
    assert {"fp8", "fp4", "fp8_rows"} == set(formats.values())
    assert_same_params(released, qweights.quantise_params(engram_params, engram_cfg))
    assert_same_params(qweights.dequantise_params(released), dequantised)
    assert_same_params(qweights.quantise_params(released, engram_cfg), released)
    ck.save_pretrained(released, engram_cfg, tmp_path)
    with (
        open(os.path.join(saved, ck.SINGLE_FILE), "rb") as f,
        open(tmp_path / ck.SINGLE_FILE, "rb") as g,
    ):
        assert f.read() == g.read()


def test_weights_on_device_values_are_checked(saved, both, tmp_path):
    """Bad option values name themselves and the allowed ones; orbax keeps released params as
    they are (codes, scales, format)."""
    _, released = both
    ck.save_params(released, tmp_path / "orbax")
    assert_same_params(ck.restore_params(tmp_path / "orbax"), released)
    with pytest.raises(
        ValueError, match="weights_on_device='fp8' is not allowed: one of 'dequantised', 'released'"
    ):
        ck.load_pretrained(saved, progress=False, weights_on_device="fp8")
    from serving import LLM, cli_llm

    assert cli_llm._WEIGHTS == qweights.WEIGHTS_ON_DEVICE  # the CLI's choices (it has no JAX)
    with pytest.raises(
        ValueError, match="weights_on_device='int4' is not allowed: 'dequantised' or 'released'"
    ):
        LLM(saved, weights_on_device="int4")


# -- bytes -------------------------------------------------------------------------------------


def test_released_params_take_the_checkpoints_bytes(engram_cfg, saved, tiny_cfg, tiny_params,
                                                    tmp_path):  # fmt: skip
    """In bf16, released params hold exactly the checkpoint's bytes (plus the full model's int32
    Engram token map, which is not a checkpoint tensor); dequantised ones about twice. The
    abstract released ``v41_flash`` (Engram tables on the host, as ``engram_tables="auto"``
    puts them) against its checkpoint: 306.56 GB, ratio 1.000002; dequantised bf16: 3.69x."""
    _, released = ck.load_pretrained(saved, jnp.bfloat16, progress=False,
                                     engram_tables="device", weights_on_device="released")  # fmt: skip
    _, dequantised = ck.load_pretrained(saved, jnp.bfloat16, progress=False, engram_tables="device")
    token_map = 4 * engram_cfg.vocab_size
    ckpt = qweights.checkpoint_bytes(engram_cfg)
    assert qweights.param_bytes(released) == ckpt + token_map
    assert 1.9 < (qweights.param_bytes(dequantised) - token_map) / ckpt < 2.5

    cfg = tiny_cfg
    small = qweights.quantise_params(
        jax.tree.map(lambda x: x.astype(jnp.bfloat16), tiny_params), cfg
    )
    assert qweights.param_bytes(small) == qweights.checkpoint_bytes(cfg)
    abstract = qweights.abstract_released_params(cfg, jnp.bfloat16)
    assert jax.tree.structure(abstract) == jax.tree.structure(small)
    assert qweights.param_bytes(small) == qweights.param_bytes(abstract)

    flash = v41_flash()
    on_device = [n for n, s in param_specs(flash).items() if s.storage is not Storage.FP8_ROWS]
    abstract = qweights.abstract_released_params(flash, jnp.bfloat16)
    got = qweights.param_bytes({n: abstract[n] for n in on_device})
    want = qweights.checkpoint_bytes(flash, on_device)
    assert 306e9 < want < 307e9
    assert want < got < want * 1.00001, (got, want)
    specs = param_specs(flash)  # what abstract_params(flash, bf16) holds, without tracing it
    floats = sum(math.prod(specs[n].shape) * (4 if specs[n].storage in (Storage.F32, Storage.DERIVED) else 2)
                 for n in on_device)  # fmt: skip
    assert 3.6 < floats / want < 3.8


# -- jit and the model's reads -------------------------------------------------------------------


def test_quantised_params_pass_through_jit(both):
    """Codes and scales are the leaves: jit takes, donates and returns released params, and the
    static metadata (format, logical shape, dtype, block) survives."""
    _, released = both
    name = "layers.3.ffn.experts.w1.weight"
    w = released[name]
    assert [x.dtype for x in jax.tree.leaves(w)] == [jnp.uint8, jnp.uint8]  # packed fp4, e8m0
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(released))
    back = jax.jit(lambda p: p)(released)
    assert_same_params(back, released)
    copy = jax.tree.map(jnp.copy, {name: w})
    step = jax.jit(
        lambda p: (p, p[name][jnp.asarray([1, 0])].astype(jnp.float32)), donate_argnums=0
    )
    kept, out = step(copy)
    assert_same_params(kept, {name: w})
    np.testing.assert_array_equal(np.asarray(out), np.asarray(w.astype(jnp.float32))[[1, 0]])
    assert jax.eval_shape(lambda p: p[name].astype(jnp.bfloat16), released).shape == w.shape


def _reads(params, cfg, x, rows):
    """Every kind of weight read the model makes, on activations x [6, dim]: a linear under
    quant_sim, the grouped output projection, the MoE through the gather branch (few tokens)
    and the all-experts branch, an Engram table's rows and the Engram update."""
    a = "layers.1.attn."
    qcfg = cfg.replace(quant_sim=True)
    o = jnp.tile(x, (1, cfg.n_heads * cfg.head_dim // cfg.dim)).reshape(
        6, cfg.n_heads, cfg.head_dim
    )
    cos, sin = L.rope_tables(cfg, 2, jnp.arange(6))
    values = engram.table_rows(params, 1, rows)
    stream = jnp.broadcast_to(x[:, None, None, :], (6, 1, cfg.hc_mult, cfg.dim))
    return (
        L.linear(x, params, a + "wq_a.weight", qcfg),
        L.attention_output(o, cos, sin, params, a, cfg),
        L.moe(x[:1], params, "layers.2.ffn.", cfg),
        L.moe(x, params, "layers.2.ffn.", qcfg),
        values,
        engram.apply(stream, params, 1, cfg, values[:, None], jnp.ones((6, 1), bool)),
    )


def test_every_weight_read_is_identical_under_jit(engram_cfg, both):
    dequantised, released = both
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(6, engram_cfg.dim)), jnp.float32)
    rows = jnp.asarray(rng.integers(0, 400, (6, engram_cfg.engram_columns)), jnp.int32)
    fn = jax.jit(_reads, static_argnums=1)
    want, got = fn(dequantised, engram_cfg, x, rows), fn(released, engram_cfg, x, rows)
    assert engram_cfg.n_activated_experts < engram_cfg.n_routed_experts < 6 * 2  # both branches
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


# -- every path, end to end (long variants; the representative above: every read under jit) --


@pytest.fixture(scope="module")
def both_tiny(tiny_cfg, tiny_params, tmp_path_factory):
    """(dequantised, released) params of `tiny_v41` saved in the released format."""
    path = tmp_path_factory.mktemp("released") / "tiny_v41"
    ck.save_pretrained(tiny_params, tiny_cfg, path)
    _, dequantised = ck.load_pretrained(path, progress=False)
    _, released = ck.load_pretrained(path, progress=False, weights_on_device="released")
    return dequantised, released


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny_v41", "tiny_v41_full"])
def test_jitted_paths_identical(model, tiny_cfg, both_tiny, engram_cfg, both):
    """The jitted reference forward's logits, `generate`'s greedy tokens and (with the drafter)
    `dspark.draft`'s block: bit-identical between dequantised and released params."""
    from dsv4 import dspark, generate

    cfg, (dequantised, released) = (
        (tiny_cfg, both_tiny) if model == "tiny_v41" else (engram_cfg, both)
    )
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(3, 260, (2, 40)), jnp.int32)
    fwd = jax.jit(reference.forward, static_argnums=1)
    np.testing.assert_array_equal(np.asarray(fwd(released, cfg, tokens)),
                                  np.asarray(fwd(dequantised, cfg, tokens)))  # fmt: skip
    lengths = jnp.asarray([40, 23], jnp.int32)
    want = generate(dequantised, cfg, tokens, 12, prompt_lengths=lengths)
    got = generate(released, cfg, tokens, 12, prompt_lengths=lengths)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    if cfg.dspark_block_size:
        nxt = tokens[:, -1]
        want = jax.jit(dspark.draft, static_argnums=1)(dequantised, cfg, tokens, next_token=nxt)
        got = jax.jit(dspark.draft, static_argnums=1)(released, cfg, tokens, next_token=nxt)
        for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.slow
def test_paged_step_identical(engram_cfg, both):
    """The paged step (Engram on device, the real scheduler's chunked prefill, prefix hits,
    preemption and drafts, `tests/dsv4/paged_harness.py`) on the same seeded schedule: every
    token's logits bit-identical."""
    from paged_harness import Harness, random_schedule, shared_prefix_seqs

    from dsv4.paged import records as R

    logits = []
    for params in both:
        rng = np.random.default_rng(11)
        seqs = shared_prefix_seqs(rng, 3, 24, (32, 49))
        h = Harness(engram_cfg, params, R.CacheFormats.EXACT, num_blocks=32,
                    request_buckets=(8,), num_speculative_tokens=2)  # fmt: skip
        random_schedule(h, seqs, rng, spec_k=2, max_running=4)
        logits.append(h.logits)
    want, got = logits
    assert want.keys() == got.keys() and len(want) > 90
    for key in want:
        np.testing.assert_array_equal(got[key], want[key])


@pytest.mark.slow
def test_llm_from_a_checkpoint_generates_the_same_tokens(saved):
    """`LLM(model=path, weights_on_device="released")` against the default: same greedy tokens
    (and sampled ones at a fixed seed), through the engine's paged step and sampler."""
    from serving import LLM, SamplingParams

    args = dict(dtype="float32", max_model_len=96, max_num_seqs=4, max_num_batched_tokens=32,
                num_gpu_blocks_override=48, token_buckets=(32,), compilation_cache_dir=None,
                warm_up=False)  # fmt: skip
    prompts = [[1, 70, 71, 72, 73, 74], [1, 200, 30, 40] * 5]
    outs = []
    for weights in qweights.WEIGHTS_ON_DEVICE:
        llm = LLM(saved, weights_on_device=weights, **args)
        sps = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
               SamplingParams(temperature=0.9, seed=5, max_tokens=10, ignore_eos=True)]  # fmt: skip
        outs.append(
            [
                o.outputs[0].token_ids
                for sp in sps
                for o in llm.generate(prompts, sp, use_tqdm=False)
            ]
        )
    assert isinstance(llm.engine.runner.params["layers.2.ffn.experts.w2.weight"], QuantisedWeight)
    assert outs[0] == outs[1]


_SHARDED = textwrap.dedent(
    """
    import jax
    from dsv4 import qweights, sharding
    from dsv4.config import tiny_v41_full
    from dsv4.params import init_params

    cfg = tiny_v41_full()
    released = qweights.quantise_params(init_params(cfg, jax.random.PRNGKey(0)), cfg)
    mesh = sharding.make_mesh(data=2, expert=2, model=2)
    sharded = sharding.shard_params(released, cfg, mesh)
    w = sharded["layers.3.ffn.experts.w1.weight"]
    assert w.values.sharding.spec == jax.sharding.PartitionSpec("expert", None, None)
    assert w.scales.sharding.spec == jax.sharding.PartitionSpec("expert", None, None)
    q = sharded["layers.2.attn.wq_b.weight"]
    assert q.values.sharding.spec == jax.sharding.PartitionSpec("model", None)
    shardings = sharding.param_shardings(released, cfg, mesh)
    assert jax.tree.structure(shardings) == jax.tree.structure(released)
    from tests.multidevice import check_sharded_forward
    check_sharded_forward(sharded, qweights.dequantise_params(released), cfg, mesh)
    """
)


@pytest.mark.slow
def test_sharded_released_forward_equals_single_device():
    """On 8 host devices (data 2, expert 2, model 2) codes and scales take their weight's spec
    and the sharded forward over released params equals the single-device dequantised one
    (within 1e-4: the sharded matmuls add in another order), and within 1e-5 with the routed
    experts dispatched over the mesh (``mesh=``; each device dequantising its own experts)."""
    assert "max_abs_diff" in run_script(_SHARDED)
