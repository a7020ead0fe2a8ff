"""planner.plan: per-chip weights are the checkpoint's stored bytes split by the rule table (exact on
one chip, never fewer than the whole over the slice), KV bytes are cache.layout's, the largest
batch is the edge of what fits, collectives follow their formulas, and bad slices and meshes
are errors naming the value. The compiled (deviceless, libtpu) comparison is in
tests/benchmarks/test_sharding_bench.py."""

from __future__ import annotations

import math

import pytest

from benchmarks import cache_memory
from cache.layout import memory_report
from dsv4.config import tiny_v41_full, v41_flash
from dsv4.params import checkpoint_tensors
from planner import plan as P

_ITEM = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "BF16": 2, "F32": 4}


@pytest.fixture(scope="module")
def flash():
    return v41_flash()


def _checkpoint_bytes(cfg) -> int:
    return sum(math.prod(t.shape) * _ITEM[t.dtype] for t in checkpoint_tensors(cfg))


@pytest.mark.parametrize("make", [v41_flash, tiny_v41_full], ids=["v41_flash", "tiny_v41_full"])
def test_one_chip_holds_exactly_the_checkpoint(make):
    cfg = make()
    got = P.weight_bytes_per_chip(cfg, P.MeshAxes())
    assert got["device"] + got["host"] == _checkpoint_bytes(cfg)
    engram = sum(
        math.prod(t.shape) * _ITEM[t.dtype]
        for t in checkpoint_tensors(cfg)
        if t.param.endswith(".engram.embed.weight")
    )
    assert got["host"] == engram > 0  # the tables stay on the host


@pytest.mark.parametrize(
    "mesh",
    [P.MeshAxes(model=8), P.MeshAxes(expert=8), P.MeshAxes(data=2, expert=4, model=2)],
    ids=str,
)
def test_splitting_never_loses_bytes(flash, mesh):
    whole = P.weight_bytes_per_chip(flash, P.MeshAxes())["device"]
    per_chip = P.weight_bytes_per_chip(flash, mesh)["device"]
    assert per_chip * mesh.num_chips >= whole  # replicated tensors count on every chip
    assert per_chip < whole
    # the routed experts split exactly: with only the expert axis, what is left over is the
    # rest of the model, replicated
    if mesh == P.MeshAxes(expert=8):
        routed = sum(
            math.prod(t.shape) * _ITEM[t.dtype]
            for t in checkpoint_tensors(flash)
            if ".ffn.experts." in t.name and not t.param.endswith("engram.embed.weight")
        )
        assert per_chip == whole - routed + routed // 8
    bf16 = P.weight_bytes_per_chip(flash, mesh, stored=False)["device"]
    assert bf16 > per_chip  # dequantised weights are larger than fp8 / fp4


def test_kv_bytes_are_cache_layouts(flash):
    p = P.plan(
        flash,
        P.parse_slice("h200x8"),
        mesh=P.MeshAxes(data=2, expert=4),
        max_num_seqs=10,
        max_model_len=65_536,
        max_num_batched_tokens=cache_memory.MAX_NUM_BATCHED_TOKENS,
    )
    config = P.kv_layout(flash, P.CHIPS["h200"])
    report = memory_report(config, 65_536, cache_memory.MAX_NUM_BATCHED_TOKENS, packed_layout=True)
    want = [5 * g.max_blocks_per_request * report.pool_bytes_per_block for g in report.groups]
    assert list(p.kv_groups.values()) == want  # 10 requests over 2 data shards
    assert p.kv_null_block == report.pool_bytes_per_block
    # the same figure benchmarks.cache_memory reports for the H200 (SM90) layout
    entry, checks = cache_memory.measure(
        flash, "SM90", cache_memory.PRESETS["SM90"], "SM90", num_blocks=2, max_model_len=65_536
    )
    assert all(c["ok"] for c in checks.values())
    assert sum(want) == 5 * entry["aliased"]["request_bytes_at_max_len"]


def test_largest_batch_is_the_edge_of_what_fits(flash):
    # (on v5p-16, data=2 x expert=4 holds no 128K request: 96 local experts, 6.3 GiB once
    # dequantised, do not fit beside their released bytes)
    slice_ = P.parse_slice("v5p-32")
    mesh = P.MeshAxes(data=2, expert=8)
    p = P.plan(flash, slice_, mesh=mesh, contexts=(131_072,))
    ((context, most),) = p.largest
    assert most > 0 and most % mesh.data == 0
    at = P.plan(flash, slice_, mesh=mesh, max_num_seqs=most, max_model_len=context, contexts=())
    over = P.plan(
        flash, slice_, mesh=mesh, max_num_seqs=most + mesh.data, max_model_len=context, contexts=()
    )
    assert at.fits and not over.fits
    assert at.total == at.weights + at.kv + at.activations["peak"]
    shorter = P.plan(flash, slice_, mesh=mesh, contexts=(8192, 1_048_576)).largest
    assert shorter[0][1] > most > shorter[1][1]


def test_default_mesh_fits_the_slice_and_v5e_16_cannot_hold_the_weights(flash):
    p = P.plan(flash, P.parse_slice("v5p-16"))
    assert p.mesh.num_chips == 8 and p.fits
    small = P.plan(flash, P.parse_slice("v5e-16"))
    assert not small.fits and all(n == 0 for _, n in small.largest)
    assert small.weights > small.budget


def test_collectives_follow_their_formulas(flash):
    one = P.collective_bytes_per_decode_step(flash, P.MeshAxes(), num_seqs=8, context=4096)
    assert set(one.values()) == {0}
    got = P.collective_bytes_per_decode_step(
        flash, P.MeshAxes(data=2, expert=4, model=2), num_seqs=16, context=4096
    )
    t, d = 8, flash.dim  # tokens per data shard
    assert got["attention_allreduce"] == 40 * (2 * 1 * t * d * 2 // 2)
    assert got["expert_all_to_all"] == 40 * 2 * 2 * 6 * d * 2 * 3 // 4
    assert got["expert_allgather"] == 40 * (3 * t * d * 2 // 4)
    assert got["logits_allgather"] == t * flash.vocab_size * 4 // 2
    index_rows = 3 * 4096 // 2 + 5 * 4096  # index sources 2, 8, 14 (r=2); 20, 24..36 (r=1)
    assert got["indexer_allreduce"] == 2 * t * index_rows * 4 // 2
    assert got["total"] == sum(v for k, v in got.items() if k != "total")


def test_activation_peak_is_its_formula(flash):
    a = P.activation_bytes(flash, P.MeshAxes(model=2), num_tokens=16, num_requests=4)
    assert a["residual"] == 2 * 16 * 4 * 5120 * 2
    assert a["logits"] == 4 * flash.vocab_size * 4 * 3 // 2
    # released weights on the device: the MoE layer dequantises the experts it reads (here,
    # one device's view of a model split, all 16 x 6 selected of the 384)
    assert a["dequantised_experts"] == 3 * 16 * 6 * flash.moe_inter_dim * 5120 * 2
    assert (
        a["peak"]
        == a["residual"] + max(a["attention"], a["moe"] + a["dequantised_experts"]) + a["logits"]
    )
    e = P.activation_bytes(flash, P.MeshAxes(expert=8), num_tokens=16, num_requests=4)
    assert e["dequantised_experts"] == 3 * 48 * flash.moe_inter_dim * 5120 * 2  # 384 / 8 whole
    b = P.activation_bytes(
        flash, P.MeshAxes(model=2), num_tokens=16, num_requests=4, released_weights=False
    )
    assert b["dequantised_experts"] == 0 and b["peak"] < a["peak"]


def test_kv_reads_count_what_the_step_decodes(flash):
    """The attention's decoded reads: the index keys of every page the indexer's table
    references (none for fp8_132 index records, read as they are) and the sparse attention's
    picks (T·K, or the referenced pages when fewer), each the largest layer's."""
    from dsv4.paged.pools import PoolLayout
    from dsv4.paged.records import PRESETS

    chip = P.parse_slice("v5p-16").chip
    config = P.kv_layout(flash, chip, "RELEASED")
    reads = P.kv_reads(flash, config, "RELEASED", 65_536, 256)
    layout = PoolLayout.build(flash, config, PRESETS["RELEASED"])
    ratio1 = next(lp for lp in layout.layers if lp.kind == "index" and lp.tokens_per_state == 1)
    pages = -(-65_536 // (ratio1.states * ratio1.tokens_per_state))
    assert reads.index_entries(16) == (16 * pages + 1) * ratio1.states
    assert reads.selected_entries(16) == 256 * flash.index_topk  # fewer than the pages
    one = reads.comp_per_request + reads.comp_fixed  # one request's pages: fewer than T·K
    assert reads.selected_entries(1) == one < 256 * flash.index_topk
    a = P.activation_bytes(flash, P.MeshAxes(model=2), num_tokens=256, num_requests=16,
                           released_weights=False, reads=reads, seqs=16)  # fmt: skip
    assert a["index_keys"] == reads.index_entries(16) * flash.index_head_dim * 2
    assert a["selected_entries"] == 256 * flash.index_topk * flash.head_dim * 2
    kv = a["attention"] + a["index_keys"] + a["selected_entries"]
    assert a["peak"] == a["residual"] + max(kv, a["moe"]) + a["logits"]
    # XLA:GPU's dense lowering of the expert dispatch: every local expert's copy of the rows a
    # device receives (T k / model), on an expert axis only
    g = P.activation_bytes(flash, P.MeshAxes(expert=4, model=2), num_tokens=256, num_requests=16,
                           released_weights=False, platform="gpu")  # fmt: skip
    assert g["dense_dispatch"] == 256 * 6 // 2 * (384 // 4) * flash.dim * 2
    assert g["peak"] == g["residual"] + g["moe"] + g["dense_dispatch"] + g["logits"]
    for platform, mesh in (("tpu", P.MeshAxes(expert=4, model=2)), ("gpu", P.MeshAxes(model=8))):
        one = P.activation_bytes(flash, mesh, num_tokens=256, num_requests=16, platform=platform)
        assert one["dense_dispatch"] == 0
    assert P.parse_slice("h200x8").chip.platform == "gpu" == P.parse_slice("h100").chip.platform
    assert P.parse_slice("v5p-16").chip.platform == "tpu"
    fp8 = P.kv_reads(flash, P.kv_layout(flash, chip, "RELEASED_FP8"), "RELEASED_FP8", 65_536, 256)
    assert fp8.index_entries(16) == 0 and fp8.selected_entries(16) == reads.selected_entries(16)


@pytest.mark.parametrize(
    ("text", "chips"),
    [("v5p-16", 8), ("v6e-32", 32), ("v5e-16", 16), ("v5litepod-4", 4), ("H200x8", 8), ("h100", 1)],
)
def test_slice_names(text, chips):
    assert P.parse_slice(text).num_chips == chips


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("v5p-15", r"'v5p-15'.*even number.*got 15"),
        ("v7x-8", r"'v7x-8': not a slice; expected v5e-N"),
        ("h200x0", r"'h200x0'.*>= 1 chips, got 0"),
    ],
)
def test_bad_slices_name_the_value(text, match):
    with pytest.raises(ValueError, match=match):
        P.parse_slice(text)


def test_bad_meshes_name_the_value(flash):
    with pytest.raises(ValueError, match=r"'modle=4' is not AXIS=SIZE"):
        P.parse_mesh("data=2,modle=4")
    with pytest.raises(ValueError, match=r"model='x' must be an int"):
        P.parse_mesh("model=x")
    h8 = P.parse_slice("h200x8")
    with pytest.raises(ValueError, match=r"needs 16 chips; the slice h200x8 has 8"):
        P.plan(flash, h8, mesh=P.MeshAxes(expert=16))
    with pytest.raises(ValueError, match=r"mesh model=3 does not divide n_heads=64"):
        P.plan(flash, P.parse_slice("h200x3"), mesh=P.MeshAxes(model=3))
    odd_vocab = v41_flash(vocab_size=129_281)
    with pytest.raises(ValueError, match=r"'embed.weight' dim 0 \(size 129281\).*model=2"):
        P.plan(odd_vocab, P.parse_slice("h200x2"), mesh=P.MeshAxes(model=2))
    with pytest.raises(ValueError, match=r"experts\.w1\.weight' dim 0 \(size 384\).*expert=5"):
        P.plan(flash, P.parse_slice("h200x5"), mesh=P.MeshAxes(expert=5))
    with pytest.raises(ValueError, match=r"mesh model=16 does not divide o_groups=8"):
        P.plan(flash, P.parse_slice("v5e-16"), mesh=P.MeshAxes(model=16))
    with pytest.raises(ValueError, match=r"--records 'FP2'.*known"):
        P.plan(flash, h8, records="FP2")


def test_markdown_table_has_a_row_per_slice(flash):
    plans = [P.plan(flash, P.parse_slice(s)) for s in ("v5p-16", "h200x8")]
    lines = P.markdown_table(plans).splitlines()
    assert len(lines) == 4 and lines[2].startswith("| v5p-16 | 8 |")
    assert all(line.count("|") == lines[0].count("|") for line in lines)


@pytest.mark.parametrize(
    ("text", "topology"),
    [
        ("v5p-16", "v5p:2x2x2"),
        ("v5p-128", "v5p:4x4x4"),
        ("v5e-64", "v5e:8x8"),
        ("v6e-32", "v6e:4x8"),
    ],
)
def test_tpu_topologies_of_slices(text, topology):
    assert P.tpu_topology(P.parse_slice(text)) == topology


@pytest.mark.parametrize(
    ("text", "match"),
    [("h200x8", "libtpu compiles TPU slices only"), ("v5e-2", "a power of 2 >= 4")],
)
def test_slices_without_a_topology_say_why(text, match):
    with pytest.raises(ValueError, match=match):
        P.tpu_topology(P.parse_slice(text))


def test_contexts_stop_at_the_models_length():
    cfg = tiny_v41_full()
    p = P.plan(cfg, P.parse_slice("v5e-4"), max_model_len=256, records="BF16")
    assert [c for c, _ in p.largest] == [c for c in P.CONTEXTS if c <= cfg.max_seq_len]
    with pytest.raises(ValueError, match=r"max_model_len=4096 exceeds the model's max_seq_len"):
        P.plan(cfg, P.parse_slice("v5e-4"), max_model_len=4096, records="BF16")
