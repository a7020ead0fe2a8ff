"""The lab's step-time model: bytes and FLOPs of one scheduled step, at a chip's roofline.

A step's time is ``max(bytes / bandwidth, flops / peak)`` over ``num_chips`` chips (ideal
scaling: the figure is a bound, not a prediction of a given parallel layout). Bytes are the
weights a step reads plus the KV records its attention reads; FLOPs the matmuls of the active
parameters plus attention and indexer scoring. The attention terms follow the kernels' own cost
models (`pallas_kernels/*/cost.py`, `benchmarks/kernels.py`), restated here without JAX so a
model-free lab run never imports it (tests check both give the same bytes):

* window attention: a decode token reads its window (``min(window, context)`` records); a
  chunk of ``n`` tokens of one request is read in tiles of 8 tokens, each tile reading
  ``8 + window`` records;
* sparse attention: every token of a compressed layer reads its top-k records
  (``min(topk, context // ratio)``);
* indexer: every index-source layer scores ``context // ratio`` index keys, once per decode
  token or once per tile of 8 tokens of a chunk;
* weights: the non-expert weights once per step, and each routed expert touched by the step's
  tokens once (the expected number under uniform routing, ``E (1 - (1 - k/E)^T)``).

Formats are the released checkpoint's: non-expert weights fp8 (1 byte), the output head bf16,
routed experts FP4 with a one-byte scale per 32 values (17/32 byte per parameter).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["CHIPS", "MODELS", "Chip", "ModelCost", "StepCost", "step_cost"]


@dataclass(frozen=True, slots=True)
class Chip:
    name: str
    hbm_bytes_per_s: float
    peak_flops: float  # dense bf16


# Vendor figures (dense bf16 FLOP/s, HBM bytes/s).
CHIPS = {
    c.name: c
    for c in (
        Chip("H200", 4.8e12, 989e12),
        Chip("H100", 3.35e12, 989e12),
        Chip("B200", 8.0e12, 2250e12),
        Chip("TPU v5e", 8.2e11, 197e12),
        Chip("TPU v5p", 2.765e12, 459e12),
        Chip("TPU v6e", 1.64e12, 918e12),
    )
}


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelCost:
    """What the time model needs from a model (figures of `benchmarks.param_count`).

    Fields:
        dense_weight_bytes: bytes of every non-expert weight a step reads (attention, shared
            experts, router, norms, output head).
        active_params_per_token: parameters one token's forward multiplies (2 FLOPs each).
        num_layers / num_routed_experts / experts_per_token / expert_weight_bytes: routed MoE.
        heads / head_dim: attention; index_heads / index_head_dim: the indexer; topk, window.
    """

    name: str
    dense_weight_bytes: float
    active_params_per_token: float
    num_layers: int
    num_routed_experts: int
    experts_per_token: int
    expert_weight_bytes: float
    heads: int
    head_dim: int
    index_heads: int
    index_head_dim: int
    topk: int
    window: int


_FP4_BYTES = 17 / 32  # e2m1 nibble + a ue8m0 scale per 32 values

MODELS = {
    "v41_flash": ModelCost(
        name="v41_flash",
        # attention 5,126,564,864 + shared experts 1,415,577,600 + router 78,658,560 + mHC and
        # norms 39,738,480 in fp8, plus the bf16 head (129,280 x 5,120)
        dense_weight_bytes=5_126_564_864
        + 1_415_577_600
        + 78_658_560
        + 39_738_480
        + 2 * 129_280 * 5_120,
        active_params_per_token=16_477_832_304,
        num_layers=40,
        num_routed_experts=384,
        experts_per_token=6,
        expert_weight_bytes=3 * 5120 * 2304 * _FP4_BYTES,
        heads=64,
        head_dim=512,
        index_heads=32,
        index_head_dim=128,
        topk=512,
        window=128,
    ),
    "tiny_v41": ModelCost(
        name="tiny_v41",
        dense_weight_bytes=4 * (243_424 + 98_304 + 4_160 + 99_824 + 32_768),
        active_params_per_token=707_856,
        num_layers=8,
        num_routed_experts=8,
        experts_per_token=2,
        expert_weight_bytes=4 * 786_432 / 64,
        heads=4,
        head_dim=64,
        index_heads=2,
        index_head_dim=32,
        topk=8,
        window=8,
    ),
}


@dataclass(frozen=True, slots=True)
class StepCost:
    weight_bytes: float
    kv_bytes: float
    flops: float

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

    def seconds(self, chip: Chip, num_chips: int) -> float:
        return max(
            self.bytes / (chip.hbm_bytes_per_s * num_chips),
            self.flops / (chip.peak_flops * num_chips),
        )


_TILE = 8  # tokens of one request per kernel tile (the kernels' default)


def step_cost(
    model: ModelCost,
    requests: Iterable[tuple[int, int]],
    *,
    ratios: tuple[int, ...],
    index_layers: tuple[int, ...],
    swa_record_bytes: int,
    compressed_record_bytes: int,
    indexer_key_bytes: int,
) -> StepCost:
    """Cost of one step that computes, per request, ``n`` tokens ending at context ``end``
    (``requests`` yields ``(n, end)``). ``ratios`` are the backbone layers' compress ratios,
    ``index_layers`` the layers that run an indexer (kv and index sources)."""
    total_tokens, kv, flops = 0, 0.0, 0.0
    layer_ratios = [ratios[i] if i < len(ratios) else 0 for i in range(model.num_layers)]
    for n, end in requests:
        if n <= 0:
            continue
        total_tokens += n
        tiles = 1 if n == 1 else math.ceil(n / _TILE)
        window_rows = min(model.window, end) if n == 1 else tiles * (_TILE + model.window)
        window_rows = min(window_rows, n * model.window)
        attn_keys = 0
        for layer, r in enumerate(layer_ratios):
            kv += window_rows * swa_record_bytes + n * swa_record_bytes  # reads + writes
            attn_keys += n * min(model.window, end)
            if not r:
                continue
            entries = end // r
            selected = min(model.topk, entries)
            kv += n * selected * compressed_record_bytes
            attn_keys += n * selected
            if layer in index_layers:
                kv += tiles * entries * indexer_key_bytes
                flops += n * entries * 2 * model.index_heads * model.index_head_dim
        flops += 4 * model.heads * model.head_dim * attn_keys
    if total_tokens == 0:
        return StepCost(0.0, 0.0, 0.0)
    experts = model.num_routed_experts
    touched = experts * (1 - (1 - model.experts_per_token / experts) ** total_tokens)
    weights = model.dense_weight_bytes + model.num_layers * touched * model.expert_weight_bytes
    flops += 2 * model.active_params_per_token * total_tokens
    return StepCost(weights, kv, flops)
