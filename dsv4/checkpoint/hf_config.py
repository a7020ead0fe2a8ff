"""The ``config.json`` a saved released checkpoint carries: our config under the reference's
inference names (`dsv4.config.ModelConfig.from_json` reads it back)."""

from __future__ import annotations

import dataclasses
from typing import Any

from dsv4.config import ModelConfig
from dsv4.formats import CheckpointError

__all__ = ["hf_config"]


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """``cfg.to_hf_dict()``, plus the expert storage where the HF layout alone would not bring it
    back (a bf16 config without a quantization_config reads back with fp4 experts)."""
    out = cfg.to_hf_dict()
    back = ModelConfig.from_dict(out)
    if back.expert_dtype != cfg.expert_dtype:
        out["text_config"]["expert_dtype"] = cfg.expert_dtype
        back = ModelConfig.from_dict(out)
    if back.replace(quant_sim=cfg.quant_sim) != cfg:  # pragma: no cover - a config.py bug
        diff = [
            f"{f.name}: {getattr(cfg, f.name)!r} -> {getattr(back, f.name)!r}"
            for f in dataclasses.fields(cfg)
            if getattr(cfg, f.name) != getattr(back, f.name) and f.name != "quant_sim"
        ]
        raise CheckpointError(f"config does not round-trip through config.json: {diff}")
    return out
