"""The lab's step-time model: bytes and FLOPs of one scheduled step, at a chip's roofline.

A step's time is ``max(bytes / bandwidth, flops / peak)`` over ``num_chips`` chips (a bound, not a
prediction); the attention terms restate the kernels' cost models without JAX (tests check both
agree). The terms, one by one: docs/lab.md#labcost.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["CHIPS", "MODELS", "Chip", "ModelCost", "StepCost", "step_cost", "step_cost_by_layer"]


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

    Attributes:
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


_EXACT = 2**53  # integers below it add exactly in floats
_PLANS: dict[tuple, tuple[int, tuple[tuple[int, int, int], ...]] | None] = {}


def _layer_plan(
    model: ModelCost, ratios: tuple[int, ...], index_layers: tuple[int, ...]
) -> tuple[int, tuple[tuple[int, int, int], ...]] | None:
    """(layers, ((ratio, layers with it, of them running an indexer), ...)) of a layer plan;
    None when a size of the model is not an int (`step_cost` then runs the per-layer loop)."""
    key = (model, ratios, index_layers)
    plan = _PLANS.get(key, False)
    if plan is False:
        sizes = (model.num_layers, model.window, model.topk, model.heads, model.head_dim)
        sizes += (model.index_heads, model.index_head_dim, *ratios)
        if any(type(v) is not int for v in sizes):
            _PLANS[key] = None
            return None
        index = set(index_layers)
        counts: dict[int, list[int]] = {}
        for layer in range(model.num_layers):
            r = ratios[layer] if layer < len(ratios) else 0
            if r:
                c = counts.setdefault(r, [0, 0])
                c[0] += 1
                c[1] += layer in index
        plan = _PLANS[key] = (model.num_layers, tuple((r, c, i) for r, (c, i) in counts.items()))
    return plan


class _Layout(NamedTuple):
    """The layer plan and record sizes `step_cost` and `step_cost_by_layer` take as keywords."""

    ratios: tuple[int, ...]
    index_layers: tuple[int, ...]
    swa_record_bytes: int
    compressed_record_bytes: int
    indexer_key_bytes: int


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
    ``index_layers`` the layers that run an indexer (kv and index sources).

    `step_cost_by_layer`'s terms summed once per distinct ratio, in integers, so both give the same
    floats (checked here; beyond 2**53 or with non-integer sizes the per-layer loop runs).
    """
    if not isinstance(requests, list | tuple):
        requests = list(requests)  # (read twice when the per-layer loop takes over)
    layout = _Layout(
        tuple(ratios),
        tuple(index_layers),
        swa_record_bytes,
        compressed_record_bytes,
        indexer_key_bytes,
    )
    cost = _by_ratio(model, requests, layout)
    return cost if cost is not None else _by_layer(model, requests, layout)


def step_cost_by_layer(model: ModelCost, requests: Iterable[tuple[int, int]], **layout) -> StepCost:
    """`step_cost` written layer by layer (its definition; tests compare both); same keywords."""
    return _by_layer(model, requests, _Layout(**layout))


def _by_ratio(model: ModelCost, requests, layout: _Layout) -> StepCost | None:
    """`step_cost` in integers, once per distinct ratio; None where floats could round."""
    plan = _layer_plan(model, layout.ratios, layout.index_layers)
    swa_bytes, compressed_bytes, index_key_bytes = layout[2:]
    if plan is None or any(type(b) is not int for b in layout[2:]):
        return None
    num_layers, per_ratio = plan
    window, topk = model.window, model.topk
    index_flops = 2 * model.index_heads * model.index_head_dim
    total_tokens = kv = flops = attn_keys = 0
    for n, end in requests:
        if n <= 0:
            continue
        total_tokens += n
        if n == 1:
            tiles = 1
            window_rows = window if window < end else end
        else:
            tiles = -(-n // _TILE)
            window_rows = tiles * (_TILE + window)
        if window_rows > n * window:
            window_rows = n * window
        kv += num_layers * (window_rows + n) * swa_bytes
        attn_keys += num_layers * n * (window if window < end else end)
        for r, count, indexed in per_ratio:
            entries = end // r
            selected = topk if topk < entries else entries
            kv += count * n * selected * compressed_bytes
            attn_keys += count * n * selected
            if indexed:
                kv += indexed * tiles * entries * index_key_bytes
                flops += indexed * n * entries * index_flops
    if total_tokens == 0:
        return StepCost(0.0, 0.0, 0.0)
    flops += 4 * model.heads * model.head_dim * attn_keys
    if kv >= _EXACT or flops >= _EXACT:  # a float sum would have rounded
        return None
    return _with_weights(model, total_tokens, float(kv), float(flops))


def _by_layer(model: ModelCost, requests, layout: _Layout) -> StepCost:
    ratios, index_layers, swa_record_bytes, compressed_record_bytes, indexer_key_bytes = layout
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
    return _with_weights(model, total_tokens, kv, flops)


def _with_weights(model: ModelCost, total_tokens: int, kv: float, flops: float) -> StepCost:
    """The step's cost with the weights it reads (dense and the routed experts its tokens touch)
    and the FLOPs of its tokens' active parameters added."""
    experts = model.num_routed_experts
    touched = experts * (1 - (1 - model.experts_per_token / experts) ** total_tokens)
    weights = model.dense_weight_bytes + model.num_layers * touched * model.expert_weight_bytes
    return StepCost(weights, kv, flops + 2 * model.active_params_per_token * total_tokens)
