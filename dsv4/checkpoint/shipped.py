"""Checkpoints that ship inside the package, in the released format."""

from __future__ import annotations

import os

from dsv4.config import MODEL_PRESETS, SHIPPED_DIR

__all__ = ["SHIPPED", "SHIPPED_DIR", "shipped_checkpoint"]

# Checkpoints that ship inside the package, in the released format (`shipped_checkpoint`).
SHIPPED = tuple(name for name, preset in MODEL_PRESETS.items() if preset.weights == "shipped")


def shipped_checkpoint(name: str) -> str:
    """The directory of a checkpoint shipped with the package (``SHIPPED``): ``config.json``,
    ``model.safetensors`` in the released format, ``tokenizer.json``; for `load_pretrained`,
    `serving.LLM` (``LLM(model="tiny_v41_trained")``) and ``dsv4 demo``."""
    if name not in SHIPPED:
        raise ValueError(f"no shipped checkpoint {name!r}: the package ships {', '.join(SHIPPED)}")
    path = os.path.join(SHIPPED_DIR, name)
    missing = [
        f for f in ("config.json", "model.safetensors") if not os.path.isfile(os.path.join(path, f))
    ]
    if missing:
        raise FileNotFoundError(
            f"{path}: the shipped checkpoint {name!r} lacks {', '.join(missing)} (an install "
            "without package data? reinstall the package)"
        )
    return path
