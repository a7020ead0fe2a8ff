"""Tests of cache.spec: page sizes (vLLM 0.32's V4.1 records), validation, merge, flags."""

import dataclasses

import pytest
from cache_testing import v4_rows

from cache.spec import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVQuantMode,
    MLAAttentionSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    get_kv_quant_mode,
)

MEM = 16 * 2 * 64 * 4 * 2  # one block of one layer in vLLM's test specs


def full(**kw):
    args = dict(block_size=16, num_kv_heads=2, head_size=64, dtype="float32") | kw
    return FullAttentionSpec(**args)


def swa(**kw):
    args = dict(block_size=16, num_kv_heads=2, head_size=64, dtype="float32", sliding_window=1)
    return SlidingWindowSpec(**(args | kw))


def compressed(r, *, block_size, record=584, alignment=576):
    return _v4_rows(r, block_size, record, alignment, state_content_bytes=record)


def indexer(r, *, block_size, key=132, alignment=576):
    return _v4_rows(r, block_size, key, alignment)


def _v4_rows(r, block_size, row_bytes, alignment, **kw):
    """A V4 MLA-format cache of uint8 rows, one per ``r`` tokens."""
    kw |= {"tokens_per_state": r, "alignment": alignment}
    return v4_rows(MLAAttentionSpec, block_size, row_bytes, **kw)


def swa_mla(*, block_size=32, record=584, alignment=576, window=128, **kw):
    kw |= {"state_content_bytes": record, "sliding_window": window, "alignment": alignment}
    return v4_rows(SlidingWindowMLASpec, block_size, record, **kw)


# --- page sizes ------------------------------------------------------------------------------


def test_dense_page_size_is_block_heads_k_plus_v_dtype():
    assert full().page_size_bytes == MEM
    assert full(head_size_v=32).page_size_bytes == 16 * 2 * (64 + 32) * 4
    assert full(dtype="bfloat16").real_page_size_bytes == MEM // 2


@pytest.mark.parametrize(("r", "real", "padded"), [(1, 37376, 37440), (2, 18688, 19008)])
def test_sm90_compressed_kv_pages(r, real, padded):
    spec = compressed(r, block_size=64)
    assert spec.num_states == 64 // r
    assert (spec.real_page_size_bytes, spec.page_size_bytes) == (real, padded)


@pytest.mark.parametrize(("r", "real", "padded"), [(1, 8448, 8640), (2, 4224, 4608)])
def test_sm90_indexer_pages(r, real, padded):
    spec = indexer(r, block_size=64)
    assert (spec.real_page_size_bytes, spec.page_size_bytes) == (real, padded)


def test_sm90_swa_page():
    spec = swa_mla()
    assert (spec.real_page_size_bytes, spec.page_size_bytes) == (18688, 19008)


@pytest.mark.parametrize(
    ("spec", "page"),
    [
        (compressed(1, block_size=128, record=528, alignment=512), 67584),
        (compressed(2, block_size=128, record=528, alignment=512), 33792),
        (compressed(1, block_size=128, record=288, alignment=512), 36864),
        (compressed(2, block_size=128, record=288, alignment=512), 18432),
        (indexer(1, block_size=128, alignment=512), 16896),
        (indexer(2, block_size=128, alignment=512), 8704),
        (indexer(1, block_size=128, key=68, alignment=512), 8704),
        (indexer(2, block_size=128, key=68, alignment=512), 4608),
        (swa_mla(record=528, alignment=512), 16896),
    ],
)
def test_sm100_pages(spec, page):
    assert spec.page_size_bytes == page


def test_ring_page_is_32_kib_at_capacity_8():
    ring = CircularBufferSpec(
        block_size=8, num_kv_heads=1, head_size=1024, head_size_v=0, dtype="float32"
    )
    assert ring.page_size_bytes == 32768
    assert ring.max_memory_usage_bytes(1 << 20, 8192) == 32768
    assert ring.max_num_blocks_per_req(1 << 20) == 1
    assert not ring.prefix_cacheable


def test_explicit_padding_is_kept_and_alignment_recomputed_on_new_block_size():
    spec = dataclasses.replace(
        swa_mla(block_size=4, record=8192, alignment=576), page_size_padded=37440
    )
    assert spec.page_size_bytes == 37440
    bigger = compressed(2, block_size=64).copy_with_new_block_size(128)
    assert bigger.page_size_bytes == 37440  # 64 states x 584 = 37376 -> 37440


def test_num_head_slots_and_state_content_bytes_override_layout():
    spec = full(num_head_slots=1, state_content_bytes=100)
    assert spec.num_heads == 1
    assert spec.page_size_bytes == 16 * 100


# --- window sizes and admission caps -----------------------------------------------------------


def test_sliding_window_admission_cap_covers_window_and_in_flight_tokens():
    spec = swa(block_size=4, sliding_window=4)
    # min(3 + 4, 100) = 7 tokens -> 2 blocks, +1 for a window straddling a block boundary.
    assert spec.max_admission_blocks_per_request(100, 4) == 3
    assert spec.max_admission_blocks_per_request(5, 4) == 3  # capped at max_model_len: 2 + 1
    retained = swa(block_size=4, sliding_window=4, extra_retained_tokens=4)
    assert retained.max_admission_blocks_per_request(100, 4) == 4
    assert spec.max_memory_usage_bytes(100, 4) == 3 * spec.page_size_bytes


def test_chunked_local_admission_cap():
    spec = ChunkedLocalAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype="float32", attention_chunk_size=64
    )
    assert spec.max_admission_blocks_per_request(1000, 32) == 6  # cdiv(96, 16)
    assert spec.max_admission_blocks_per_request(50, 32) == 4


def test_full_and_cross_attention_memory():
    assert full().max_memory_usage_bytes(100, 8) == 7 * MEM
    cross = CrossAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float32")
    assert cross.max_memory_usage_bytes(100, 40) == 3 * MEM
    assert not cross.prefix_cacheable


# --- flags -----------------------------------------------------------------------------------


def test_bounded_replay_swa_is_not_prefix_cacheable():
    assert swa_mla().prefix_cacheable
    replay = swa_mla(bounded_replay=True)
    assert not replay.prefix_cacheable
    assert replay.prefix_replay_tokens == 128


def test_kv_quant_mode_predicates_and_mapping():
    assert KVQuantMode.FP8_PER_TOKEN_HEAD.is_per_token_head
    assert not KVQuantMode.FP8_PER_TENSOR.is_per_token_head
    assert KVQuantMode.NVFP4.is_nvfp4 and not KVQuantMode.NVFP4_DS_MLA.is_nvfp4
    assert KVQuantMode.TURBOQUANT_3BIT_NC.is_turboquant
    assert KVQuantMode.ULTRAQUANT_4BIT.is_ultraquant
    assert get_kv_quant_mode("auto") is KVQuantMode.NONE
    assert get_kv_quant_mode("fp8_ds_mla") is KVQuantMode.FP8_PER_TENSOR
    assert get_kv_quant_mode("nvfp4_ds_mla") is KVQuantMode.NVFP4_DS_MLA
    assert get_kv_quant_mode("nvfp4") is KVQuantMode.NVFP4
    assert get_kv_quant_mode("turboquant_k8v4") is KVQuantMode.TURBOQUANT_K8V4
    assert get_kv_quant_mode("int8_per_token_head") is KVQuantMode.INT8_PER_TOKEN_HEAD


def test_specs_are_frozen_and_hashable():
    spec = full()
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.block_size = 32
    assert hash(spec) == hash(full())
    uniform = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": full()})
    assert hash(uniform) == hash(
        UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": full()})
    )
    with pytest.raises(TypeError):
        FullAttentionSpec(16, num_kv_heads=2, head_size=64, dtype="float32")  # kw_only


def test_mixed_precision_config_needs_zeroing():
    ring = CircularBufferSpec(block_size=8, num_kv_heads=1, head_size=8, dtype="float32")
    mixed = KVCacheConfig(
        4,
        [],
        [KVCacheGroupSpec(["a"], compressed(1, block_size=64)), KVCacheGroupSpec(["b"], ring)],
    )
    assert mixed.has_mixed_precision_kv_cache and mixed.needs_kv_cache_zeroing
    same = KVCacheConfig(4, [], [KVCacheGroupSpec(["a", "b"], full())])
    assert not same.needs_kv_cache_zeroing


# --- merge -----------------------------------------------------------------------------------


def test_full_merge_takes_the_one_window():
    merged = FullAttentionSpec.merge([full(), full(sliding_window=4), full(sliding_window=4)])
    assert merged.sliding_window == 4
    assert FullAttentionSpec.merge([full(), full()]) == full()


def test_full_merge_rejects_two_windows_and_window_plus_chunk():
    with pytest.raises(ValueError, match="same sliding_window"):
        FullAttentionSpec.merge([full(sliding_window=4), full(sliding_window=8)])
    with pytest.raises(ValueError, match="cannot mix"):
        FullAttentionSpec.merge([full(sliding_window=4), full(attention_chunk_size=8)])
    with pytest.raises(ValueError, match="head_size"):
        FullAttentionSpec.merge([full(), full(head_size=32)])
    with pytest.raises(ValueError, match="same spec class"):
        FullAttentionSpec.merge([full(), swa()])


def test_mla_merge_needs_same_ratio():
    with pytest.raises(ValueError, match="tokens_per_state"):
        MLAAttentionSpec.merge([compressed(1, block_size=64), compressed(2, block_size=64)])


def test_swa_merge_needs_equal_specs():
    assert SlidingWindowSpec.merge([swa(), swa()]) == swa()
    with pytest.raises(ValueError, match="sliding_window"):
        SlidingWindowSpec.merge([swa(), swa(sliding_window=2)])


def test_uniform_type_groups_by_token_slots():
    assert UniformTypeKVCacheSpecs.from_specs({"a": full(), "b": full(head_size=128)})
    assert UniformTypeKVCacheSpecs.from_specs({"a": full(), "b": compressed(2, block_size=16)})
    assert UniformTypeKVCacheSpecs.from_specs({"a": swa(), "b": swa(sliding_window=2)}) is None
    assert UniformTypeKVCacheSpecs.from_specs({"a": full(), "b": swa()}) is None
    assert UniformTypeKVCacheSpecs.from_specs({"a": full(), "b": full(block_size=32)}) is None
    sink = SinkFullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype="float32", sink_len=4
    )
    assert UniformTypeKVCacheSpecs.from_specs({"a": full(), "b": sink}) is None


# --- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: full(block_size=0), "block_size=0"),
        (lambda: full(num_kv_heads=-1), "num_kv_heads=-1"),
        (lambda: full(dtype="float12"), "dtype='float12'"),
        (lambda: full(page_size_padded=MEM - 1), "page_size_padded"),
        (lambda: full(sliding_window=0), "sliding_window=0"),
        (lambda: full(sliding_window=4, attention_chunk_size=8), "mutually exclusive"),
        (lambda: swa(sliding_window=0), "sliding_window=0"),
        (lambda: swa(extra_retained_tokens=-1), "extra_retained_tokens=-1"),
        (lambda: compressed(3, block_size=64), "tokens_per_state=3"),
        (lambda: compressed(1, block_size=64, alignment=0), "alignment=0"),
        (lambda: swa_mla(model_version="deepseek_v9"), "model_version"),
        (
            lambda: RSWASpec(
                block_size=16, num_kv_heads=1, head_size=8, dtype="float32", rswa_window=0
            ),
            "rswa_window=0",
        ),
        (
            lambda: SinkFullAttentionSpec(
                block_size=16, num_kv_heads=1, head_size=8, dtype="float32", sink_len=0
            ),
            "sink_len=0",
        ),
        (lambda: UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={}), "must not be empty"),
        (
            lambda: UniformTypeKVCacheSpecs(
                block_size=16, kv_cache_specs={"a": full(), "b": swa()}
            ),
            "not of one uniform type",
        ),
        (
            lambda: UniformTypeKVCacheSpecs(block_size=32, kv_cache_specs={"a": full()}),
            "block sizes",
        ),
    ],
)
def test_construction_errors_name_the_value(make, message):
    with pytest.raises(ValueError, match=message):
        make()
