"""The checks of the functional API's arguments, each defined once and called at every entry
point (`reference.forward`, `model.forward_step`, `generate`, `dspark.draft`, the paged step).

Bad input is refused with a ValueError (a wrong value) or TypeError (a wrong kind) whose one
line names the value, the argument and what is allowed; nothing is clamped. Values are read on
the host only where they already are: a concrete array (numpy, a list, an eager jax array) is
checked with numpy; under `jax.jit` its values are abstract and only the shape and dtype are
checked (at trace time, so a compiled step pays nothing).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from dsv4.config import ModelConfig
from dsv4.params import param_specs

__all__ = ["check_model_params", "check_positions", "check_token_ids", "concrete"]


def concrete(x: Any) -> np.ndarray | None:
    """``x`` as a numpy array where its values are known (not traced under jit), else None."""
    if isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def _dtype(x: Any) -> np.dtype:
    dtype = getattr(x, "dtype", None)
    if dtype is not None:
        return np.dtype(dtype)
    return np.asarray(x).dtype


def check_token_ids(
    where: str, name: str, tokens: Any, vocab_size: int, ndim: int, lengths: Any = None
) -> None:
    """``tokens`` must be an integer array of ``ndim`` dims, not empty along its last, with every
    id in [0, vocab_size) (the range is read only where the values are concrete; with
    ``lengths`` [B] only the first ``lengths[b]`` tokens of row b, the rest being padding).

    Raises:
        TypeError: not an integer array (floats, bools, strings).
        ValueError: the wrong number of dims, no tokens, or an id outside the vocabulary.
    """
    dtype = _dtype(tokens)
    if dtype == np.bool_ or not np.issubdtype(dtype, np.integer):
        raise TypeError(f"{where}: {name} must hold integer token ids, got dtype {dtype}")
    shape = tuple(np.shape(tokens))
    if len(shape) != ndim:
        want = "int32[B, T]" if ndim == 2 else f"an int array of {ndim} dims"
        raise ValueError(f"{where}: {name} must be {want}, got shape {list(shape)}")
    if ndim and shape[-1] == 0:
        raise ValueError(f"{where}: {name} has no tokens (shape {list(shape)}): at least 1")
    values = concrete(tokens)
    real = None if lengths is None else concrete(lengths)
    if values is None or values.size == 0 or (lengths is not None and real is None):
        return
    outside = (values < 0) | (values >= vocab_size)
    if real is not None:
        outside &= np.arange(shape[-1]) < np.reshape(real, (-1, 1))
    if outside.any():
        at = tuple(int(i) for i in np.argwhere(outside)[0])
        bad = int(values[at])
        raise ValueError(
            f"{where}: {name}{list(at)} = {bad} is outside the vocabulary [0, {vocab_size})"
        )


def check_positions(where: str, last: int, cfg: ModelConfig, what: str) -> None:
    """``last`` (the last position a call computes, 0-based) must be below ``max_seq_len``."""
    if last >= cfg.max_seq_len:
        raise ValueError(
            f"{where}: {what} reaches position {last}; the model allows positions 0.."
            f"{cfg.max_seq_len - 1} (max_seq_len={cfg.max_seq_len})"
        )


@functools.lru_cache(maxsize=32)
def _expected_shapes(cfg: ModelConfig, drafter: bool) -> dict[str, tuple[int, ...]]:
    specs = param_specs(cfg).items()
    return {n: spec.shape for n, spec in specs if drafter or not n.startswith("mtp.")}


def check_model_params(where: str, params: Any, cfg: ModelConfig, drafter: bool = False) -> None:
    """``params`` must be a mapping with every tensor ``param_specs(cfg)`` names, at its shape
    (parameters built for another config are refused, naming the first differences); the
    DSpark drafter's ``mtp.*`` tensors only with ``drafter`` (the backbone's paths never read
    them). Tensors it does not name are allowed."""
    if not isinstance(params, Mapping):
        raise TypeError(
            f"{where}: params must be a dict of tensors (dsv4.init_params / load_pretrained), "
            f"got {type(params).__name__}"
        )
    missing, wrong = [], []
    for name, shape in _expected_shapes(cfg, drafter).items():
        if name not in params:
            missing.append(name)
        elif tuple(np.shape(params[name])) != shape:
            wrong.append(f"{name} {list(np.shape(params[name]))} (expected {list(shape)})")
    if missing or wrong:
        parts = []
        for label, names in (("missing", missing), ("wrong shape", wrong)):
            if names:
                more = f" and {len(names) - 3} more" if len(names) > 3 else ""
                parts.append(f"{label} {names[:3]}{more}")
        raise ValueError(
            f"{where}: params were not built for this config ({'; '.join(parts)}): build them "
            "with the same ModelConfig (dsv4.init_params(cfg, key), load_pretrained)"
        )
