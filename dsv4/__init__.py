"""DeepSeek-V4.1 in JAX: a functional model over pytrees (see docs/architecture.md).

* `ModelConfig`, `tiny_v41`, `tiny_v41_full` (with Engram and DSpark), `tiny_v41_trained` (the
  config of the shipped trained checkpoint), `v41_flash`, `LayerPlan`, `Role` — configuration
  and layer plan; `MODEL_PRESETS` — the one table of those model names;
* `init_params`, `abstract_params`, `param_specs` — the parameter pytree (checkpoint names);
* `reference.forward` — the whole-sequence oracle;
* `model.init_cache` / `model.forward_step` — incremental inference with dense caches;
* `generate` — jitted prefill + decode loop;
* `engram` (n-gram memory, in every path), `dspark` (the DSpark drafter: `dspark.draft`);
* `load_pretrained` / `save_pretrained` (released safetensors format) and
  `save_params` / `restore_params` (orbax); `checkpoint.shipped_checkpoint` (the trained
  ``tiny_v41_trained`` that ships in the package); `qweights` (fp8 / FP4 weights kept in their
  released bytes on device: ``load_pretrained(..., weights_on_device="released")``);
* training (`training.data`, `training.train`, `training.dspark`) and the memory planner
  (`planner.plan`) live beside this package, in `training` and `planner`.

The package is lazy (PEP 562): ``import dsv4.config`` and the names above from `dsv4.config` and
`dsv4.tokenizer` import no JAX, so the CLI and `serving.config` read `MODEL_PRESETS` before JAX
starts; the JAX names are imported on first use.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any

from dsv4.config import (
    MODEL_PRESETS,
    LayerPlan,
    ModelConfig,
    Role,
    tiny_v41,
    tiny_v41_full,
    tiny_v41_trained,
    v41_flash,
)
from dsv4.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

# Importing Pallas registers configuration that enters the keys of JAX's compilation caches,
# so whatever was jitted before the first import of a kernel compiles again afterwards (e.g.
# `generate` once an engine is built). The lowest JAX-using modules of this package import it
# (tests/dsv4/test_import_keeps_compilations.py); where JAX is already running, so does this.
if "jax" in sys.modules:
    import jax.experimental.pallas  # noqa: F401

# the JAX names, by the module that defines them (imported on first use)
_LAZY = {
    "load_pretrained": "dsv4.checkpoint",
    "restore_params": "dsv4.checkpoint",
    "save_params": "dsv4.checkpoint",
    "save_pretrained": "dsv4.checkpoint",
    "generate": "dsv4.generation",
    "abstract_params": "dsv4.params",
    "init_params": "dsv4.params",
    "param_specs": "dsv4.params",
}


def __getattr__(name: str) -> Any:
    """A JAX name of `_LAZY`, or a submodule (``dsv4.reference``), imported on first use."""
    if name.startswith("__"):
        raise AttributeError(name)
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "MODEL_PRESETS",
    "ByteTokenizer",
    "HFTokenizer",
    "LayerPlan",
    "ModelConfig",
    "Role",
    "abstract_params",
    "dspark",
    "engram",
    "generate",
    "init_params",
    "load_pretrained",
    "load_tokenizer",
    "param_specs",
    "qweights",
    "reference",
    "restore_params",
    "save_params",
    "save_pretrained",
    "tiny_v41",
    "tiny_v41_full",
    "tiny_v41_trained",
    "v41_flash",
]
