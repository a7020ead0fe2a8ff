"""Tests of cache.layout: scenarios 30-33, 37, 40 (docs/allocator_internals.md, section 9) and the V4.1 layouts."""

import types

import pytest
from cache_testing import v4_rows

from cache.layout import (
    ModelCacheDesc,
    approximate_gcd,
    compressed_kv_name,
    for_model,
    get_kv_cache_config,
    get_kv_cache_groups,
    group_and_unify,
    indexer_k_name,
    max_concurrency,
    memory_report,
    resolve_kv_cache_block_sizes,
    ring_capacity,
    ring_name,
    swa_cache_name,
    tiny_v41_desc,
    v41_flash_desc,
    v41_layer_specs,
)
from cache.spec import (
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

MEM = 16 * 2 * 64 * 4 * 2  # bytes per block per layer of the default test spec


def full(**kw):
    return FullAttentionSpec(
        **(dict(block_size=16, num_kv_heads=2, head_size=64, dtype="float32") | kw)
    )


def swa(**kw):
    args = dict(block_size=16, num_kv_heads=2, head_size=64, dtype="float32", sliding_window=1)
    return SlidingWindowSpec(**(args | kw))


def layers(*specs):
    return {f"l{i}": spec for i, spec in enumerate(specs, start=1)}


def names(config):
    return [g.layer_names for g in config.kv_cache_groups]


def tensors(config):
    return [(t.size, t.shared_by) for t in config.kv_cache_tensors]


# --- scenario 30 -----------------------------------------------------------------------------


def test_scenario_30_two_full_layers_one_group_tensor_per_layer():
    config = get_kv_cache_config(layers(full(), full()), MEM * 2 * 32)
    assert config.num_blocks == 32
    assert config.kv_cache_groups == [KVCacheGroupSpec(["l1", "l2"], full())]
    assert tensors(config) == [(MEM * 32, ["l1"]), (MEM * 32, ["l2"])]


def test_scenario_30_full_plus_swa_hybrid_two_groups_share_one_tensor():
    config = get_kv_cache_config(layers(full(), swa()), MEM * 2 * 32)
    assert config.num_blocks == 64
    assert config.kv_cache_groups == [
        KVCacheGroupSpec(["l1"], full()),
        KVCacheGroupSpec(["l2"], swa()),
    ]
    assert config.kv_cache_tensors == [KVCacheTensor(MEM * 64, ["l1", "l2"])]


def test_scenario_30_hybrid_disabled_one_full_group_keeps_window_for_compute():
    config = get_kv_cache_config(
        layers(full(), swa()), MEM * 2 * 32, disable_hybrid_kv_cache_manager=True
    )
    assert config.num_blocks == 32
    assert config.kv_cache_groups == [KVCacheGroupSpec(["l1", "l2"], full(sliding_window=1))]
    assert tensors(config) == [(MEM * 32, ["l1"]), (MEM * 32, ["l2"])]


# --- scenario 31 -----------------------------------------------------------------------------


def test_scenario_31_two_full_four_swa_strided_groups():
    config = get_kv_cache_config(layers(full(), full(), swa(), swa(), swa(), swa()), MEM * 2 * 32)
    assert names(config) == [["l1", "l2"], ["l3", "l5"], ["l4", "l6"]]
    assert config.num_blocks == 32
    assert tensors(config) == [(MEM * 32, ["l1", "l3", "l4"]), (MEM * 32, ["l2", "l5", "l6"])]


def test_scenario_31_three_full_seven_swa_pads_groups_of_three():
    groups = get_kv_cache_groups(layers(*[full()] * 3, *[swa()] * 7))
    assert [g.layer_names for g in groups] == [
        ["l1", "l2", "l3"],
        ["l4", "l7", "l10"],
        ["l5", "l8"],
        ["l6", "l9"],
    ]


def test_scenario_31_six_full_five_swa_uses_the_larger_group_size():
    groups = get_kv_cache_groups(layers(*[full()] * 6, *[swa()] * 5))
    assert [len(g.layer_names) for g in groups] == [6, 5]


# --- scenario 32 -----------------------------------------------------------------------------


def test_scenario_32_smaller_page_gets_a_larger_block_size():
    config = get_kv_cache_config(layers(full(), swa(head_size=32)), MEM * 32)
    assert config.num_blocks == 32
    assert config.kv_cache_groups == [
        KVCacheGroupSpec(["l1"], full()),
        KVCacheGroupSpec(["l2"], swa(head_size=32, block_size=32)),
    ]
    assert config.kv_cache_tensors == [KVCacheTensor(MEM * 32, ["l1", "l2"])]


def test_scenario_32_page_not_divisible_raises_not_implemented():
    with pytest.raises(NotImplementedError, match="does not divide"):
        get_kv_cache_config(layers(full(), swa(head_size=96)), MEM * 32)


def test_scenario_32_uniform_type_group_with_per_layer_tensors_and_override():
    specs = layers(full(head_size=128), full())
    config = get_kv_cache_config(specs, MEM * 3 * 32)
    [group] = config.kv_cache_groups
    assert isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs)
    assert group.layer_names == ["l1", "l2"]
    assert config.num_blocks == 32
    assert tensors(config) == [(2 * MEM * 32, ["l1"]), (MEM * 32, ["l2"])]
    override = get_kv_cache_config(specs, MEM * 3 * 32, num_gpu_blocks_override=16)
    assert override.num_blocks == 16
    assert tensors(override) == [(2 * MEM * 16, ["l1"]), (MEM * 16, ["l2"])]


# --- scenario 33 (sizing part) ---------------------------------------------------------------


def _one_group(spec, num_blocks, num_layers=32):
    group = KVCacheGroupSpec([f"l{i}" for i in range(num_layers)], spec)
    return KVCacheConfig(num_blocks, [], [group])


def test_scenario_33_max_concurrency_full():
    config = _one_group(full(), 1536)
    assert max_concurrency(config, 16384, 1024) == 1.5


def test_scenario_33_max_concurrency_sliding_window():
    spec = swa(sliding_window=1024)
    assert spec.max_admission_blocks_per_request(16384, 1024) == 129
    assert max_concurrency(_one_group(spec, 387), 16384, 1024) == 3


def test_scenario_33_max_concurrency_hybrid():
    groups = [
        KVCacheGroupSpec([f"f{i}" for i in range(16)], full()),
        KVCacheGroupSpec([f"s{i}" for i in range(16)], swa(sliding_window=1024)),
    ]
    config = KVCacheConfig((1024 + 129) * 3, [], groups)
    assert max_concurrency(config, 16384, 1024) == 3


# --- scenario 37 and 40: DeepSeek-V4.0 (DSv4-Flash) ------------------------------------------


def _v40_mla(head, ratio, *, dtype="uint8", record=None):
    kw = {"dtype": dtype, "state_content_bytes": record, "tokens_per_state": ratio}
    return v4_rows(MLAAttentionSpec, 256, head, **kw)


def _v40_window(block, window, head, *, dtype="float32", record=None):
    kw = {"dtype": dtype, "state_content_bytes": record, "sliding_window": window}
    return v4_rows(SlidingWindowMLASpec, block, head, **kw)


def dsv4_flash_specs(*, with_mtp=True):
    """DSv4-Flash: layers 0-1 SWA only, then alternating C4 / C128 (21 + 20), + MTP layer."""
    swa_kv = _v40_window(64, 128, 584, dtype="uint8", record=584)
    specs = {}
    ratios = [0, 0] + [4 if i % 2 == 0 else 128 for i in range(41)] + ([0] if with_mtp else [])
    for layer, ratio in enumerate(ratios):
        p = f"layers.{layer}"
        if ratio == 4:
            specs[f"{p}.attn"] = _v40_mla(584, 4, record=584)
            specs[f"{p}.indexer"] = _v40_mla(132, 4)
        elif ratio == 128:
            specs[f"{p}.attn"] = _v40_mla(584, 128, record=584)
        specs[f"{p}.swa"] = swa_kv
        if ratio == 4:
            specs[f"{p}.state"] = _v40_window(4, 8, 2048)
            specs[f"{p}.indexer_state"] = _v40_window(4, 8, 512)
        elif ratio == 128:
            specs[f"{p}.state"] = _v40_window(8, 128, 1024)
    return specs


def test_scenario_37_dsv4_flash_pages():
    specs = dsv4_flash_specs()
    pages = {name.split(".", 2)[2]: s.page_size_bytes for name, s in specs.items()}
    assert specs["layers.2.attn"].page_size_bytes == 37440
    assert specs["layers.2.indexer"].page_size_bytes == 8640
    assert specs["layers.3.attn"].page_size_bytes == 1728
    assert pages["swa"] == 37440
    assert specs["layers.2.state"].page_size_bytes == 32832
    assert specs["layers.2.indexer_state"].page_size_bytes == 8640
    assert specs["layers.3.state"].page_size_bytes == 32832


@pytest.mark.parametrize("with_mtp", [True, False])
def test_scenario_37_dsv4_flash_grouping(with_mtp):
    specs = dsv4_flash_specs(with_mtp=with_mtp)
    num_swa = 44 if with_mtp else 43
    assert approximate_gcd([21, num_swa, 21, 20], lower_bound=21) == 22
    groups = group_and_unify(specs)
    assert get_kv_cache_groups(specs) == groups
    assert [len(g.layer_names) for g in groups] == [62, 22, num_swa - 22, 42, 20]
    assert all(isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs) for g in groups)
    kinds = [type(g.kv_cache_spec.first_spec).__name__ for g in groups]
    assert kinds == ["MLAAttentionSpec"] + ["SlidingWindowMLASpec"] * 4
    windows = [
        (g.kv_cache_spec.block_size, g.kv_cache_spec.first_spec.sliding_window) for g in groups[1:]
    ]
    assert windows == [(64, 128), (64, 128), (4, 8), (8, 128)]
    pages = {s.page_size_bytes for g in groups for s in g.kv_cache_spec.kv_cache_specs.values()}
    assert pages == {1728, 8640, 37440}
    config = get_kv_cache_config(specs, 47808 * 22 * 100)
    assert config.num_blocks == 100
    assert resolve_kv_cache_block_sizes(config) == (256, 4)


def test_scenario_37_dsv4_tensors_share_tuple_slots_across_groups():
    config = get_kv_cache_config(dsv4_flash_specs(), 47808 * 22 * 10)
    by_layer = {}
    for tensor in config.kv_cache_tensors:
        for name in tensor.shared_by:
            by_layer.setdefault(name, []).append(tensor.size)
    assert all(len(sizes) == 1 for sizes in by_layer.values())  # every layer in one tensor
    assert len(by_layer) == sum(len(g.layer_names) for g in config.kv_cache_groups)
    assert sum(t.size for t in config.kv_cache_tensors) <= 47808 * 22 * 10


def test_scenario_40_dsv4_admission_caps():
    specs = dsv4_flash_specs()
    one_m, budget = 1 << 20, 8192
    assert specs["layers.0.swa"].max_admission_blocks_per_request(one_m, budget) == 131
    assert specs["layers.2.state"].max_admission_blocks_per_request(one_m, budget) == 2051
    assert specs["layers.3.state"].max_admission_blocks_per_request(one_m, budget) == 1041
    mla = specs["layers.2.attn"]
    assert mla.max_memory_usage_bytes(one_m, budget) // mla.page_size_bytes == 4096
    assert mla.max_num_blocks_per_req(one_m) == 4096


# --- block sizes -----------------------------------------------------------------------------


def test_resolve_block_sizes_rules():
    two = get_kv_cache_config(layers(full(), swa(head_size=32)), MEM * 32)  # blocks 16 and 32
    assert resolve_kv_cache_block_sizes(two) == (32, 16)
    assert resolve_kv_cache_block_sizes(two, enable_caching=False) == (32, 32)
    assert resolve_kv_cache_block_sizes(two, hash_block_size=8) == (32, 8)
    with pytest.raises(ValueError, match="must divide"):
        resolve_kv_cache_block_sizes(two, hash_block_size=3)
    one = get_kv_cache_config(layers(full(), full()), MEM * 2 * 32)
    assert resolve_kv_cache_block_sizes(one) == (16, 16)
    with pytest.raises(ValueError, match="single KV-cache group"):
        resolve_kv_cache_block_sizes(one, hash_block_size=8)


def test_attention_free_model_has_only_the_null_block():
    config = get_kv_cache_config({}, 10**9)
    assert (config.num_blocks, config.kv_cache_groups, config.kv_cache_tensors) == (1, [], [])


# --- V4.1 layouts ----------------------------------------------------------------------------


def _kinds(config):
    return [
        (type(g.kv_cache_spec.first_spec).__name__, len(g.layer_names))
        for g in config.kv_cache_groups
    ]


def test_v41_flash_layout_buckets():
    config = for_model(v41_flash_desc(), num_gpu_blocks_override=1000)
    # 43 SWA caches in groups of at most 6 (a block holds 6 SWA pages of 19008 B next to the
    # MLA slab), the compressed KV + index keys of the 4 kv sources, 3 rings (r=2 sources)
    assert _kinds(config) == [("SlidingWindowMLASpec", n) for n in (6, 6, 6, 5, 5, 5, 5, 5)] + [
        ("MLAAttentionSpec", 8),
        ("CircularBufferSpec", 3),
    ]
    mla = config.kv_cache_groups[8].kv_cache_spec
    # 3 r=2 compressed + 1 r=1 compressed + 3 r=2 index + 1 r=1 index pages in one slab.
    assert mla.page_size_bytes == 3 * 19008 + 37440 + 3 * 4608 + 8640 == 116928
    strides = {t.block_stride for t in config.kv_cache_tensors}
    assert strides == {116928}
    assert {t.size for t in config.kv_cache_tensors} == {116928 * 1000}
    assert resolve_kv_cache_block_sizes(config) == (64, 32)
    assert config.needs_kv_cache_zeroing  # fp32 rings next to uint8 records


def test_v41_flash_memory_budget_and_concurrency():
    config = for_model(v41_flash_desc(), available_memory_bytes=116928 * 5000 + 7)
    assert config.num_blocks == 5000
    # one 1M-token request: 16384 MLA blocks + 8 x 261 SWA blocks + 1 ring block
    assert max_concurrency(config, 1 << 20, 8192) == 5000 / (16384 + 8 * 261 + 1)
    report = memory_report(config, 1 << 20, 8192, packed_layout=True)
    assert report.pool_bytes_per_block == 116928
    assert report.groups[8].bytes_per_token == 116928 / 64
    assert report.groups[9].fixed_bytes_per_request == 116928
    assert "per request" in str(report) and "MLAAttentionSpec" in str(report)


def test_v41_layer_specs_roles_and_order():
    specs = v41_layer_specs(tiny_v41_desc())
    assert list(specs)[:5] == [
        swa_cache_name(0),
        compressed_kv_name(1),
        indexer_k_name(1),
        swa_cache_name(1),
        ring_name(1),
    ]
    assert set(n for n in specs if n.endswith(".attn")) == {
        compressed_kv_name(1),
        compressed_kv_name(3),
    }
    assert specs[compressed_kv_name(1)].tokens_per_state == 2
    assert specs[compressed_kv_name(3)].tokens_per_state == 1
    assert indexer_k_name(5) not in specs  # reindex layer reads layer 3's keys
    assert [n for n in specs if "state_cache" in n] == [ring_name(1)]
    assert sum(".swa_cache" in n for n in specs) == 9
    assert next(reversed(specs)) == swa_cache_name(8)


def test_v41_tiny_layout():
    config = for_model(tiny_v41_desc(), num_gpu_blocks_override=64)
    assert _kinds(config) == [
        ("SlidingWindowMLASpec", 9),
        ("MLAAttentionSpec", 4),
        ("CircularBufferSpec", 1),
    ]
    assert config.num_blocks == 64
    assert resolve_kv_cache_block_sizes(config) == (16, 4)


def test_v41_bounded_replay_hashes_only_compressed_groups():
    config = for_model(v41_flash_desc(swa_bounded_replay=True), num_gpu_blocks_override=10)
    assert not config.kv_cache_groups[0].kv_cache_spec.prefix_cacheable
    assert resolve_kv_cache_block_sizes(config) == (64, 64)


def test_v41_eagle_group_holds_the_last_draft_layer():
    config = for_model(v41_flash_desc(num_speculative_tokens=3), num_gpu_blocks_override=10)
    flagged = [g for g in config.kv_cache_groups if g.is_eagle_group]
    assert len(flagged) == 1 and swa_cache_name(42) in flagged[0].layer_names
    assert not any(
        g.is_eagle_group
        for g in for_model(v41_flash_desc(), num_gpu_blocks_override=10).kv_cache_groups
    )


@pytest.mark.parametrize(("k", "capacity"), [(0, 8), (3, 8), (6, 8), (7, 16), (14, 16), (15, 32)])
def test_ring_capacity(k, capacity):
    assert ring_capacity(k) == capacity
    ring = v41_layer_specs(tiny_v41_desc(num_speculative_tokens=k))[ring_name(1)]
    assert isinstance(ring, CircularBufferSpec) and ring.block_size == capacity


def test_desc_from_config_object_and_mapping():
    cfg = types.SimpleNamespace(
        compress_ratios=[0, 2, 2, 1, 1, 1, 1, 0, 0],
        kv_source_layer_ids=[1, 3],
        index_source_layer_ids=[1, 3, 5],
        num_hidden_layers=8,
        sliding_window=8,
        hidden_size=64,
    )
    desc = ModelCacheDesc.from_config(cfg, block_size=16)
    assert desc.num_draft_layers == 1 and desc.block_size == 16
    assert desc.kv_source_of(4) == 3 and desc.index_source_of(4) == 3
    assert desc.kv_source_of(6) == 3 and desc.index_source_of(6) == 5
    assert desc.kv_source_of(0) is None
    assert ModelCacheDesc.from_config(vars(cfg)) == ModelCacheDesc.from_config(cfg)


def _plan(ratios, kv_sources, index_sources, layers, **more) -> dict:
    """A layer plan's ModelCacheDesc fields: compress ratios, sources, layer count, the rest."""
    return {
        "compress_ratios": ratios,
        "kv_source_layer_ids": kv_sources,
        "index_source_layer_ids": index_sources,
        "num_hidden_layers": layers,
        **more,
    }


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (_plan((2, 2), (1,), (1,), 2), "no kv source <= 0"),
        (_plan((0, 2, 1), (1,), (1,), 3), "ratios inside a sharing"),
        (_plan((0, 2, 2, 1), (1, 3), (1,), 4), "not index sources"),
        (_plan((0, 3), (1,), (1,), 2), "not in"),
        (_plan((0, 2, 2), (1,), (1,), 2, num_draft_layers=1), "drafts must be 0"),
        (_plan((0, 2), (0,), (0, 1), 2), "compress ratio is 0"),
        (_plan((0, 2), (1,), (1,), 2, block_size=0), "block_size=0"),
    ],
)
def test_desc_rejects_ungroupable_layer_plans(changes, message):
    with pytest.raises(ValueError, match=message):
        ModelCacheDesc(**changes)


def test_for_model_needs_a_budget():
    with pytest.raises(ValueError, match="available_memory_bytes"):
        for_model(tiny_v41_desc())


def test_v40_grouping_rejects_rings():
    specs = v41_layer_specs(tiny_v41_desc())
    with pytest.raises(ValueError, match="packed_layout=True"):
        get_kv_cache_groups(specs)
