"""KV-cache memory of DeepSeek-V4.1-Flash per record format and pool layout (no device work).

Prints one JSON line: record, page and pool bytes per cache kind and group for both pool layouts,
checked against docs/cache.md#page-sizes. Fields: docs/benchmarks.md#benchmarkscache_memory.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from cache.layout import blocks_per_request, for_model, memory_report, v41_flash_desc
from dsv4.config import ModelConfig, v41_flash
from dsv4.paged.pools import PoolLayout, cache_desc, config_pool_bytes
from dsv4.paged.records import PRESETS, CacheFormats, get_record

PLATFORMS: dict[str, dict[str, int]] = {
    "SM100": {"block_size": 128, "swa_block_size": 32, "page_alignment": 512},
    "SM90": {"block_size": 64, "swa_block_size": 32, "page_alignment": 576},
}
PRESET_PLATFORM = {
    "EXACT": "SM100",
    "BF16": "SM100",
    "RELEASED": "SM100",
    "RELEASED_FP8": "SM100",
    "SM90": "SM90",
}
MAX_NUM_BATCHED_TOKENS = 8192

# docs/cache.md#page-sizes: preset -> layer kind -> (real page bytes, padded page bytes)
SECTION_3_3: dict[str, dict[str, tuple[int, int]]] = {
    "RELEASED_FP8": {  # SM100 B=128: 528-B compressed records, FP8 (132-B) index keys
        "compressed_r1": (67584, 67584),
        "compressed_r2": (33792, 33792),
        "index_r1": (16896, 16896),
        "index_r2": (8448, 8704),
        "swa": (16896, 16896),
    },
    "RELEASED": {  # SM100 B=128: NVFP4 (288-B) compressed records, MXFP4 (68-B) index keys
        "compressed_r1": (36864, 36864),
        "compressed_r2": (18432, 18432),
        "index_r1": (8704, 8704),
        "index_r2": (4352, 4608),
        "swa": (16896, 16896),
    },
    "SM90": {  # H200 B=64: 584-B records, alignment 576, FP8 index keys
        "compressed_r1": (37376, 37440),
        "compressed_r2": (18688, 19008),
        "index_r1": (8448, 8640),
        "index_r2": (4224, 4608),
        "swa": (18688, 19008),
    },
}


def _kind_key(kind: str, tokens_per_state: int) -> str:
    return f"{kind}_r{tokens_per_state}" if kind in ("compressed", "index") else kind


def _layers(layout: PoolLayout) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for lp in layout.layers:
        key = _kind_key(lp.kind, lp.tokens_per_state)
        tokens = lp.states * lp.tokens_per_state
        row = {
            "record": lp.record,
            "record_bytes": lp.record_bytes,
            "real_page_bytes": lp.used_bytes,
            "page_bytes": lp.page_bytes,
            "states_per_page": lp.states,
            "tokens_per_page": tokens,
            # rings are per request, not per token; SWA pages only hold the window
            "bytes_per_token_per_layer": (
                None if lp.kind == "ring" else round(lp.page_bytes / tokens, 3)
            ),
        }
        if key in out:
            if {k: v for k, v in out[key].items() if k != "count"} != row:
                raise AssertionError(f"layers of kind {key} differ: {out[key]} vs {row}")
            out[key]["count"] += 1
        else:
            out[key] = {"count": 1, **row}
    return out


def _groups(aliased: PoolLayout, separate: PoolLayout) -> list[dict[str, Any]]:
    stride_a, stride_s = aliased.bytes_per_block(), separate.bytes_per_block()
    rows = []
    for g in aliased.groups:
        kinds = sorted(
            {
                _kind_key(lp.kind, lp.tokens_per_state)
                for lp in aliased.layers
                if lp.group == g.group
            }
        )
        rows.append(
            {
                "group": g.group,
                "kind": g.kind,
                "cache_kinds": kinds,
                "block_size": g.block_size,
                "num_layers": len(g.layer_names),
                "page_bytes": g.page_bytes,
                "own_bytes_per_token": round(g.page_bytes / g.block_size, 3),
                "aliased_bytes_per_token": round(stride_a / g.block_size, 3),
                "separate_bytes_per_token": round(stride_s / g.block_size, 3),
            }
        )
    return rows


def measure(
    cfg: ModelConfig,
    preset: str,
    formats: CacheFormats,
    platform: str,
    *,
    num_blocks: int,
    max_model_len: int,
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Figures of one preset on one platform, and its checks."""
    plat = PLATFORMS[platform]
    desc = cache_desc(
        cfg,
        formats,
        block_size=plat["block_size"],
        swa_block_size=plat["swa_block_size"],
        page_alignment=plat["page_alignment"],
        indexer_page_alignment=plat["page_alignment"],
    )
    config = for_model(desc, num_gpu_blocks_override=num_blocks)
    aliased = PoolLayout.build(cfg, config, formats, "aliased")
    separate = PoolLayout.build(cfg, config, formats, "separate")
    report = memory_report(config, max_model_len, MAX_NUM_BATCHED_TOKENS, packed_layout=True)
    blocks_per_req = sum(
        blocks_per_request(g, max_model_len, MAX_NUM_BATCHED_TOKENS) for g in config.kv_cache_groups
    )
    layers = _layers(aliased)
    checks = _checks(preset, layers, config, report, aliased, separate, num_blocks)
    entry = {
        "platform": platform,
        **plat,
        "formats": {
            "window": formats.window,
            "compressed": formats.compressed,
            "index": formats.index,
        },
        "records": _records(cfg, formats),
        "layers": layers,
        "groups": _groups(aliased, separate),
        "aliased": {
            "bytes_per_block": aliased.bytes_per_block(),
            "pool_bytes": aliased.pool_bytes(),
            "pool_gib": round(aliased.pool_bytes() / 2**30, 4),
            "request_bytes_at_max_len": blocks_per_req * aliased.bytes_per_block(),
            "request_fixed_bytes": report.fixed_bytes_per_request,
            "request_bytes_per_token": round(report.bytes_per_token, 3),
        },
        "separate": {
            "bytes_per_block": separate.bytes_per_block(),
            "pool_bytes": separate.pool_bytes(),
            "pool_gib": round(separate.pool_bytes() / 2**30, 4),
            "request_bytes_at_max_len": blocks_per_req * separate.bytes_per_block(),
            "over_aliased": round(separate.bytes_per_block() / aliased.bytes_per_block(), 3),
        },
        "blocks_per_request_at_max_len": blocks_per_req,
    }
    return entry, checks


def _checks(
    preset: str, layers: dict, config, report, aliased, separate, num_blocks: int
) -> dict[str, dict[str, Any]]:
    """Page sizes against section 3.3's, and each pool's bytes against the layout's."""
    checks: dict[str, dict[str, Any]] = {}
    for kind, want in SECTION_3_3.get(preset, {}).items():
        got = (layers[kind]["real_page_bytes"], layers[kind]["page_bytes"])
        checks[f"{preset}/{kind}"] = {"expected": list(want), "got": list(got), "ok": got == want}
    layout_bytes = config_pool_bytes(config)
    checks[f"{preset}/aliased_pool_bytes"] = {
        "expected": [layout_bytes, report.pool_bytes_per_block * num_blocks],
        "got": aliased.pool_bytes(),
        "ok": aliased.pool_bytes() == layout_bytes == report.pool_bytes_per_block * num_blocks,
    }
    sep_want = num_blocks * sum(lp.page_bytes for lp in separate.layers)
    checks[f"{preset}/separate_pool_bytes"] = {
        "expected": sep_want,
        "got": separate.pool_bytes(),
        "ok": separate.pool_bytes() == sep_want,
    }
    return checks


def _records(cfg: ModelConfig, formats: CacheFormats) -> dict[str, dict[str, Any]]:
    """Each cache kind's record format, its bytes and the dimension it stores."""
    return {
        kind: {
            "record": formats.record(kind),
            "bytes": get_record(formats.record(kind)).record_bytes(dim),
            "dim": dim,
        }
        for kind, dim in (
            ("swa", cfg.head_dim),
            ("compressed", cfg.head_dim),
            ("index", cfg.index_head_dim),
            ("ring", 2 * cfg.head_dim),
        )
    }


def _cache_layout_defaults(num_blocks: int, max_model_len: int) -> dict[str, Any]:
    """``cache.layout.v41_flash_desc()`` (584-B records, H200) as it stands."""
    desc = v41_flash_desc()
    config = for_model(desc, num_gpu_blocks_override=num_blocks)
    report = memory_report(config, max_model_len, MAX_NUM_BATCHED_TOKENS, packed_layout=True)
    return {
        "kv_source_layer_ids": list(desc.kv_source_layer_ids),
        "block_size": desc.block_size,
        "record_bytes": desc.compressed_record_bytes,
        "bytes_per_block": report.pool_bytes_per_block,
        "pool_bytes": config_pool_bytes(config),
        "groups": [
            {"kind": g.kind, "num_layers": g.num_layers, "page_bytes": g.page_bytes}
            for g in report.groups
        ],
    }


def run_benchmark(num_blocks: int = 1000, max_model_len: int | None = None) -> dict[str, Any]:
    """All presets on the released config; see the module docstring."""
    t0 = time.perf_counter()
    cfg = v41_flash()
    max_model_len = max_model_len or cfg.max_seq_len
    out: dict[str, Any] = {
        "model": "v41_flash",
        "config": {
            "n_layers": cfg.n_layers,
            "n_mtp_layers": cfg.n_mtp_layers,
            "head_dim": cfg.head_dim,
            "index_head_dim": cfg.index_head_dim,
            "window_size": cfg.window_size,
            "kv_source_layers": list(cfg.kv_source_layers),
            "index_source_layers": list(cfg.index_source_layers),
        },
        "num_blocks": num_blocks,
        "max_model_len": max_model_len,
        "platforms": PLATFORMS,
        "results": {},
        "checks": {},
    }
    for preset, formats in PRESETS.items():
        entry, checks = measure(
            cfg,
            preset,
            formats,
            PRESET_PLATFORM[preset],
            num_blocks=num_blocks,
            max_model_len=max_model_len,
        )
        out["results"][preset] = entry
        out["checks"].update(checks)
    out["cache_layout_defaults"] = _cache_layout_defaults(num_blocks, max_model_len)
    out["all_checks_ok"] = all(c["ok"] for c in out["checks"].values())
    out["wall_s"] = round(time.perf_counter() - t0, 3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-blocks", type=int, default=1000, help="blocks in the pool")
    ap.add_argument(
        "--max-model-len", type=int, default=None, help="request length (default: max_seq_len)"
    )
    args = ap.parse_args(argv)
    res = run_benchmark(num_blocks=args.num_blocks, max_model_len=args.max_model_len)
    print(json.dumps(res, sort_keys=True))
    return 0 if res["all_checks_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
