"""One decoder layer of V4.1-Flash at decode, through the engine's paged step, against the bytes
it must move (issue 36 point 1d).

Per layer kind (one-layer models of the released widths, random weights kept on device in the
released fp8 / FP4 form) and per (batch, context): the median time of `dsv4.paged.step`'s
paged forward over pools filled directly, the bytes the step must move (weights, KV), the HBM
roofline and, at batch 64 / 4k, tpu-inference's published per-layer time scaled by bandwidth.
Prints one JSON line. Usage and fields: docs/benchmarks.md#benchmarkslayer.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks.kernels import PEAK_HBM, _time
from cache.layout import compressed_kv_name, for_model, indexer_k_name, swa_cache_name
from dsv4.config import ModelConfig, tiny_v41
from dsv4.formats import QuantisedWeight
from dsv4.paged import pools as P
from dsv4.paged.batch import StepRequest, build_batch, group_infos
from dsv4.paged.records import PRESETS
from dsv4.paged.step import paged_forward
from dsv4.params import init_params, param_specs
from dsv4.qweights import STORAGE_FORMATS, param_bytes, released_weight_spec
from planner.plan import flash_layers

# one-layer models: the layer-plan fields of each kind that reads its own caches at decode
KINDS: dict[str, dict[str, Any]] = {
    "full_r1": dict(  # ratio 1, kv source, indexer over every entry, candidate source
        compress_ratios=(1,), kv_source_layers=(0,), index_source_layers=(0,),
        candidate_source_layer=0,
    ),
    "full_r2": dict(  # ratio 2 (pairs pooled), kv source with its own indexer
        compress_ratios=(2,), kv_source_layers=(0,), index_source_layers=(0,),
        candidate_source_layer=-1,
    ),
    "swa": dict(
        compress_ratios=(0,), kv_source_layers=(), index_source_layers=(),
        candidate_source_layer=-1,
    ),
}  # fmt: skip
WIDTHS = ("released", "tiny")
BATCHES, CONTEXTS = (1, 8, 64), (4096, 65536)
# tpu-inference's DeepSeek-V4 decode layer: 1,345 us at batch 64, 4k context on one v7x chip;
# v7x HBM: 7,380 GB/s a chip (Google Cloud's TPU7x page)
TPU_INFERENCE_US, TPU_INFERENCE_SHAPE, V7X_HBM = 1345.0, (64, 4096), 7.38e12
FP4_RMS = math.sqrt(sum(v * v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)) / 8)  # of random e2m1 codes
# pool bytes are FILL_LOW + 0..7: as the high byte of a bf16 / f32 value 2^-15..2^1, as an e4m3
# code 1..1.875, as a UE8M0 scale 2^-71..2^-64 (tiny but finite), e2m1 nibbles any value
FILL_LOW = 0x38
MEMORY_SHARE = 0.8  # a shape runs when its pools take at most this share of the free memory


def layer_config(kind: str, widths: str = "released") -> ModelConfig:
    """A one-layer model of ``kind`` (`KINDS`): V4.1-Flash's widths or `tiny_v41`'s."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not one of {sorted(KINDS)}")
    fields = dict(n_layers=1, n_mtp_layers=0, **KINDS[kind])
    if widths == "released":
        return flash_layers(fields, {})
    if widths == "tiny":
        return tiny_v41(dspark_target_layer_ids=(), **fields)
    raise ValueError(f"widths={widths!r} is not one of {WIDTHS}")


def flash_layer_kinds() -> dict[str, int]:
    """How many of V4.1-Flash's layers are of each (role, ratio): which share the kinds cover."""
    from dsv4.config import v41_flash

    plan = v41_flash().plan
    return dict(collections.Counter(f"{i.role.value}_r{i.ratio}" for i in plan.layers))


def _codes(key, spec, dtype, block: int) -> QuantisedWeight:
    """A random weight in its released format: e4m3 codes of N(0, 1) or uniform e2m1 pairs,
    each scale the power of two that gives the init's spread (1/sqrt(fan-in) for linears)."""
    w = released_weight_spec(spec, dtype, block)
    std = 1.0 / math.sqrt(spec.shape[-1]) if spec.init in ("linear", "hc_fn") else 1.0
    if w.format == "fp4":
        values = jax.random.bits(key, w.values.shape, jnp.uint8)
        std /= FP4_RMS
    else:
        values = jax.random.normal(key, w.values.shape, jnp.float32).astype(w.values.dtype)
    scales = jnp.full(w.scales.shape, 127 + round(math.log2(std)), jnp.uint8)
    return QuantisedWeight(values, scales, format=w.format, shape=spec.shape, dtype=dtype,
                           block=block)  # fmt: skip


def released_params(cfg: ModelConfig, seed: int = 0, dtype=jnp.bfloat16) -> dict[str, Any]:
    """Random params in the form ``weights_on_device="released"`` holds: the float tensors
    `init_params`' (one jitted call: the quantised ones are never made in float), the fp8 /
    FP4 ones random codes made on device (`_codes`), no host quantisation pass."""
    specs = param_specs(cfg)
    quantised = {n for n, s in specs.items() if s.storage in STORAGE_FORMATS}
    floats = jax.jit(
        lambda k: {n: v for n, v in init_params(cfg, k, dtype).items() if n not in quantised}
    )(jax.random.PRNGKey(seed))
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(specs))
    out = {}
    for k, (name, spec) in zip(keys, specs.items(), strict=True):
        out[name] = (
            _codes(k, spec, dtype, cfg.fp8_block_size) if name in quantised else floats[name]
        )
    return out


def expected_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts that ``tokens`` tokens touch, each picking ``top_k`` of
    ``num_experts`` uniformly: ``E (1 - (1 - k/E)^B)``."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def step_bytes(cfg: ModelConfig, params, layout, batch: int, context: int) -> dict[str, float]:
    """Bytes one decode step of ``batch`` requests at ``context`` tokens must move in layer 0:
    its weights (routed experts: the expected ones touched) and the KV reads (window rows, the
    sparse attention's top-k entries, the indexer's keys over every visible entry)."""
    layer = {n: w for n, w in params.items() if n.startswith("layers.0.")}
    routed = {n: w for n, w in layer.items() if ".ffn.experts." in n}
    shared = {n: w for n, w in layer.items() if ".ffn.shared_experts." in n}
    touched = expected_experts(cfg.n_routed_experts, cfg.n_activated_experts, batch)
    out = {
        "weights_routed": param_bytes(routed) * touched / cfg.n_routed_experts,
        "weights_shared": float(param_bytes(shared)),
        "weights_other": float(param_bytes(layer) - param_bytes(routed) - param_bytes(shared)),
        "experts_touched": touched,
    }
    ratio = cfg.ratio(0)
    window = min(cfg.window_size, context)
    out["kv_window"] = float(batch * window * layout.layer(swa_cache_name(0)).record_bytes)
    entries = context // ratio if ratio else 0
    comp = layout.layer(compressed_kv_name(0)).record_bytes if ratio else 0
    ikey = layout.layer(indexer_k_name(0)).record_bytes if ratio else 0
    out["kv_sparse"] = float(batch * min(cfg.index_topk, entries) * comp)
    out["kv_indexer"] = float(batch * entries * ikey)
    out["total"] = sum(v for k, v in out.items() if k != "experts_touched")
    return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    """The caches of one (batch, context): the pool layout, its `KVCacheConfig`, the requests
    (their block ids), the decode step's batch and the pools' bytes."""

    layout: Any
    config: Any
    requests: list[StepRequest]
    step: Any
    pool_bytes: int


def plan_pools(cfg: ModelConfig, records: str, batch: int, context: int, *, block_size: int,
               swa_block_size: int) -> PoolPlan:  # fmt: skip
    """The `PoolPlan` of ``batch`` requests decoding position ``context - 1``, each with its
    own blocks: the window's last pages (the columns before them the null block, as the
    allocator leaves them), every compressed page, one ring page."""
    formats = PRESETS[records]
    desc = P.cache_desc(cfg, formats, block_size=block_size, swa_block_size=swa_block_size)
    groups = group_infos(for_model(desc, num_gpu_blocks_override=1))
    pos = context - 1

    def columns(g):  # (table columns, first real column) of one request in group g
        if g.kind == "ring":
            return 1, 0
        cols = _cdiv(context, g.block_size)
        if g.kind == "window":
            return cols, max(0, (pos - cfg.window_size + 1) // g.block_size)
        return cols, 0

    need = [c - first for c, first in map(columns, groups)]
    config = for_model(desc, num_gpu_blocks_override=1 + batch * sum(need))
    layout = P.PoolLayout.build(cfg, config, formats)
    nxt, requests = 1, []
    for r in range(batch):
        ids = []
        for g, n in zip(groups, need, strict=True):
            ids.append([0] * columns(g)[1] + list(range(nxt, nxt + n)))
            nxt += n
        requests.append(StepRequest([3 + r % 200], pos, ids, req_id=f"r{r}"))
    step = build_batch(requests, config, max_model_len=context, token_buckets=(batch,),
                       request_buckets=(batch,), groups=groups)  # fmt: skip
    pool_bytes = sum(math.prod(s) for s in layout.buffer_shapes().values())
    return PoolPlan(layout, config, requests, jax.tree.map(jnp.asarray, step), pool_bytes)


def random_pools(layout, seed: int = 0) -> dict[str, jax.Array]:
    """The pools filled directly, no prefill: every byte random in [0x38, 0x40), which every
    record format decodes to finite values of modest size (`FILL_LOW`)."""
    key = jax.random.PRNGKey(seed)
    return {
        name: FILL_LOW + (jax.random.bits(jax.random.fold_in(key, i), shape, jnp.uint8) & 7)
        for i, (name, shape) in enumerate(layout.buffer_shapes().items())
    }


def trace(kind: str, shape: tuple[int, int], *, widths: str = "released", records: str = "SM90",
          blocks: tuple[int, int] = (64, 32), impl: str | None = None) -> dict[str, Any]:  # fmt: skip
    """The one-layer forward of ``kind`` at ``shape`` traced with `jax.eval_shape` (nothing
    allocated, nothing run): the released-width program's shapes checked on a CPU, and its
    bytes (`step_bytes`) and pool bytes."""
    cfg = layer_config(kind, widths)
    plan = plan_pools(cfg, records, *shape, block_size=blocks[0], swa_block_size=blocks[1])
    layout, step, pool_bytes = plan.layout, plan.step, plan.pool_bytes
    params = jax.eval_shape(lambda: released_params(cfg))
    pools = jax.eval_shape(lambda: random_pools(layout))
    h, _ = jax.eval_shape(
        lambda p, q, s: paged_forward(p, cfg, layout, q, s, impl=impl), params, pools, step
    )
    return dict(kind=kind, batch=shape[0], context=shape[1], hidden=list(h.shape),
                pool_bytes=pool_bytes, bytes=step_bytes(cfg, params, layout, *shape))  # fmt: skip


def _free_bytes() -> int | None:
    """Free memory of the default device (None where it keeps no statistics, e.g. a CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))


def peak_hbm(device) -> float | None:
    """The device's HBM bytes/s (`benchmarks.kernels.PEAK_HBM`, a TPU's own figure); None for
    an unknown device (no roofline then)."""
    peak = PEAK_HBM.get(device.device_kind)
    if peak is None and device.platform == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        peak = float(pltpu.get_tpu_info().mem_bw_bytes_per_second)
    return peak


def measure(cfg: ModelConfig, params, shape: tuple[int, int], *, records: str, repeats: int,
            timed: bool, peak: float | None, impl: str | None, blocks: tuple[int, int]) -> dict:  # fmt: skip
    """One row: ``shape`` (batch, context)'s bytes and roofline, and when ``timed`` the median
    time of the jitted one-layer paged forward (pools donated, as the engine's step); a shape
    whose pools do not fit the free memory is skipped with the reason."""
    batch, context = shape
    row: dict[str, Any] = dict(batch=batch, context=context, time_s=None, roofline_s=None,
                               roofline_pct=None)  # fmt: skip
    plan = plan_pools(cfg, records, batch, context, block_size=blocks[0], swa_block_size=blocks[1])
    layout, step, pool_bytes = plan.layout, plan.step, plan.pool_bytes
    row["bytes"] = step_bytes(cfg, params, layout, batch, context)
    row["pool_bytes"] = pool_bytes
    if peak:
        row["roofline_s"] = row["bytes"]["total"] / peak
    if shape == TPU_INFERENCE_SHAPE and peak:
        row["tpu_inference_scaled_s"] = TPU_INFERENCE_US * 1e-6 * V7X_HBM / peak
    free = _free_bytes()
    if free is not None and pool_bytes > MEMORY_SHARE * free:
        row["skipped"] = f"pools of {pool_bytes / 2**30:.1f} GiB; {free / 2**30:.1f} GiB free"
        return row
    pools = random_pools(layout)

    def forward(params, pools, step):
        return paged_forward(params, cfg, layout, pools, step, impl=impl)

    first = jax.jit(forward, donate_argnums=1)
    h, pools = first(params, pools, step)
    row["output_finite"] = bool(jnp.isfinite(h.astype(jnp.float32)).all())
    row["output_sum"] = float(jnp.sum(h.astype(jnp.float32)))
    if not timed:
        return row
    row["time_s"] = _time(forward, (params, pools, step), repeats, {1: 1})
    if peak:
        row["roofline_pct"] = 100.0 * row["roofline_s"] / row["time_s"]
    if "tpu_inference_scaled_s" in row:
        row["time_over_tpu_inference"] = row["time_s"] / row["tpu_inference_scaled_s"]
    return row


def shape_order(batches, contexts) -> list[tuple[int, int]]:
    """(batch, context) pairs, most telling first (what a time budget keeps): tpu-inference's
    shape, then the largest batches, longer contexts first."""
    shapes = [(b, c) for b in batches for c in contexts]
    return sorted(shapes, key=lambda s: (s != TPU_INFERENCE_SHAPE, -s[0], -s[1]))


def run_benchmark(kinds, *, widths: str, batches, contexts, records: str | None, repeats: int,
                  time_it: bool | None, budget_s: float | None, impl: str | None,
                  blocks: tuple[int, int] | None = None, out: str | None = None,
                  seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """The JSON-able result: per kind, its rows in `shape_order` (``out``: a file the result
    so far is written to after each row). With ``budget_s`` each kind may run rows for an equal
    share of what is left of it (unused time passes on); rows past that are reported with
    ``skipped`` (a row in flight finishes)."""
    device = jax.devices()[0]
    timed = jax.default_backend() != "cpu" if time_it is None else time_it
    peak = peak_hbm(device)
    records = records or ("SM90" if widths == "released" else "BF16")
    blocks = blocks or ((64, 32) if widths == "released" else (16, 4))
    result = _header(device, widths, records, timed, repeats, peak, budget_s)
    deadline = None if budget_s is None else time.monotonic() + budget_s
    for i, kind in enumerate(kinds):
        share_end = None
        if deadline is not None:
            now = time.monotonic()
            share_end = now + max(0.0, deadline - now) / (len(kinds) - i)
        cfg = layer_config(kind, widths)
        params = None
        rows = result["results"][kind] = []
        for shape in shape_order(batches, contexts):
            if share_end is not None and time.monotonic() > share_end:
                rows.append(dict(batch=shape[0], context=shape[1], skipped="time budget"))
                continue
            try:
                params = released_params(cfg, seed) if params is None else params
                rows.append(measure(cfg, params, shape, records=records, repeats=repeats,
                                    timed=timed, peak=peak, impl=impl, blocks=blocks))  # fmt: skip
            except Exception as e:  # keep the other shapes; say what failed
                err = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                rows.append(dict(batch=shape[0], context=shape[1], error=err))
            if out:
                with open(out, "w") as f:
                    json.dump(result, f)
        del params
    return result


def _header(device, widths, records, timed, repeats, peak, budget_s) -> dict[str, Any]:
    return {
        "benchmark": "layer",
        "backend": jax.default_backend(),
        "device": device.device_kind,
        "widths": widths,
        "records": records,
        "weights": "released (fp8 / FP4 codes on device, random)",
        "timed": timed,
        "repeats": repeats,
        "peak_hbm_bytes_per_s": peak,
        "v7x_hbm_bytes_per_s": V7X_HBM,
        "tpu_inference_us": TPU_INFERENCE_US,
        "flash_layer_kinds": flash_layer_kinds(),
        "budget_s": budget_s,
        "jax": jax.__version__,
        "results": {},
    }


def trace_released(shapes=((64, 4096), (64, 65536))) -> list[dict[str, Any]]:
    """`trace` of every kind at released widths and ``shapes`` (a dry run's check that the
    device run's programs build), a row with ``error`` for one that does not."""
    rows = []
    for kind in KINDS:
        for shape in shapes:
            try:
                rows.append(trace(kind, shape))
            except Exception as e:  # keep the other shapes; say what failed
                err = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                rows.append(dict(kind=kind, batch=shape[0], context=shape[1], error=err))
    return rows


def _ints(text: str, name: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v)
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise SystemExit(f"--{name} {text!r}: comma-separated integers >= 1")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated layer kinds")
    parser.add_argument("--widths", default="released", choices=WIDTHS)
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    parser.add_argument("--records", default=None, choices=sorted(PRESETS),
                        help="KV record formats (default SM90 released, BF16 tiny)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--impl", default=None)
    timing = parser.add_mutually_exclusive_group()
    timing.add_argument("--time", dest="time_it", action="store_true", default=None)
    timing.add_argument("--no-time", dest="time_it", action="store_false")
    parser.add_argument("--budget-s", type=float, default=None, help="stop timing after this")
    parser.add_argument("--out", default=None, help="JSON file rewritten after each row")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny widths, batch 2, context 64, untimed; released widths traced")  # fmt: skip
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        parser.error(f"--kinds {args.kinds!r}: unknown {unknown}; known: {sorted(KINDS)}")
    widths, batches = args.widths, _ints(args.batches, "batches")
    contexts, time_it = _ints(args.contexts, "contexts"), args.time_it
    if args.dry_run:
        widths, batches, contexts = "tiny", (2,), (64,)
        time_it = False if time_it is None else time_it
    result = run_benchmark(kinds, widths=widths, batches=batches, contexts=contexts,
                           records=args.records, repeats=args.repeats, time_it=time_it,
                           budget_s=args.budget_s, impl=args.impl, out=args.out)  # fmt: skip
    if args.dry_run:
        result["traced_released"] = trace_released()
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
