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
"""

# Importing Pallas registers configuration that enters the keys of JAX's compilation caches,
# so whatever was jitted before the first import of a kernel compiles again afterwards (e.g.
# `generate` once an engine is built). Importing it with the package keeps the keys stable.
import jax.experimental.pallas  # noqa: F401  (isort: keep first)

from dsv4 import dspark, engram, qweights, reference
from dsv4.checkpoint import load_pretrained, restore_params, save_params, save_pretrained
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
from dsv4.generation import generate
from dsv4.params import abstract_params, init_params, param_specs
from dsv4.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

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
