"""The small config the training tests share: `tiny_v41` cut to two ratio-2 layers, so that the
jitted training steps compile quickly (see tests/training/test_train.py's docstring)."""

from __future__ import annotations

from typing import Any

from dsv4.config import ModelConfig, tiny_v41


def two_layer_config(**overrides: Any) -> ModelConfig:
    """Layer 0 full (compressor, index keys, its own indexer) and candidate source, layer 1
    reindex over 0's keys inside 0's candidate blocks; top-k 4 of up to 16 entries."""
    fields: dict[str, Any] = dict(
        n_layers=2,
        compress_ratios=(2, 2, 0),
        kv_source_layers=(0,),
        index_source_layers=(0, 1),
        candidate_source_layer=0,
        candidate_topk_blocks=2,
        index_topk=4,
    )
    fields.update(overrides)
    return tiny_v41(**fields)
