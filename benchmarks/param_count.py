"""Parameter counts of the DeepSeek-V4.1-Flash backbone and of ``tiny_v41``, from abstract shapes.

Prints one JSON line: per config the total and a breakdown that sums to it.
Fields: docs/benchmarks.md#benchmarksparam_count.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Mapping
from typing import Any

from dsv4.config import ModelConfig, tiny_v41, v41_flash
from dsv4.params import abstract_params

CATEGORIES = ("embed_head", "attention", "moe_routed", "moe_router", "moe_shared", "mhc_norm")


EXTRAS = ("engram", "dspark")


def category(name: str) -> str:
    """The breakdown bucket of one param name (raises on a name no bucket claims)."""
    if ".engram." in name:
        return "engram"
    if name.startswith("mtp."):
        return "dspark"
    if name in ("embed.weight", "head.weight"):
        return "embed_head"
    if ".attn." in name:
        return "attention"
    if ".ffn.experts." in name:
        return "moe_routed"
    if ".ffn.gate." in name:
        return "moe_router"
    if ".ffn.shared_experts." in name:
        return "moe_shared"
    last = name.rsplit(".", 2)
    if name == "norm.weight" or ".hc_" in name or last[-2] in ("attn_norm", "ffn_norm"):
        return "mhc_norm"
    raise ValueError(f"param {name!r} fits none of the categories {CATEGORIES}")


def breakdown(shapes: Mapping[str, Any], cfg: ModelConfig) -> dict[str, int]:
    """Counts per category, ``total`` and ``active_per_token`` for ``{name: array-like with
    .shape}`` (abstract or concrete params of ``cfg``)."""
    out = dict.fromkeys(CATEGORIES + EXTRAS, 0)
    for name, x in shapes.items():
        if name == "engram.token_map":  # derived from the tokenizer, not a weight
            continue
        out[category(name)] += math.prod(x.shape)
    out["total"] = sum(out[c] for c in CATEGORIES)
    out["release_total"] = out["total"] + out["engram"] + out["dspark"]
    routed = out["moe_routed"]
    active_routed = routed * cfg.n_activated_experts // cfg.n_routed_experts
    out["active_per_token"] = out["total"] - routed + active_routed
    return out


def run() -> dict[str, Any]:
    """The result dict ``main`` prints."""
    t0 = time.perf_counter()
    configs = {"v41_flash": v41_flash(), "tiny_v41": tiny_v41()}
    res: dict[str, Any] = {"benchmark": "param_count", "configs": {}}
    for key, cfg in configs.items():
        counts = breakdown(abstract_params(cfg), cfg)
        counts["total_billions"] = round(counts["total"] / 1e9, 3)
        counts["release_total_billions"] = round(counts["release_total"] / 1e9, 3)
        res["configs"][key] = counts
    res["wall_s"] = round(time.perf_counter() - t0, 2)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.parse_args(argv)
    print(json.dumps(run(), sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
