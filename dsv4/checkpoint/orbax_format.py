"""Our own checkpoint format: the params exactly as they are (orbax), released weights included."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.layout import Format

from dsv4.checkpoint.load import resolve_mesh
from dsv4.config import ModelConfig
from dsv4.formats import CheckpointError, QuantisedWeight
from dsv4.params import Storage, check_shapes, param_specs
from dsv4.sharding import param_formats

__all__ = ["restore_params", "save_params"]


def save_params(
    params: Mapping[str, Any], path: str | os.PathLike[str], *, overwrite: bool = False
) -> None:
    """Save the params unchanged (names, shapes, dtypes, values, shardings) with orbax's
    StandardCheckpointer; ``path`` must not exist unless ``overwrite``. Every process must call
    it (each writes the shards it holds). A `QuantisedWeight` is stored as ``<name>/values`` and
    ``<name>/scales``, its format, shape, dtype and block in the checkpoint's custom metadata."""
    import orbax.checkpoint as ocp  # reason: ~0.8 s at import; only save/restore use it

    tree: dict[str, Any] = {}
    quantised: dict[str, dict[str, Any]] = {}
    for name, w in params.items():
        if isinstance(w, QuantisedWeight):
            tree[name] = {"values": w.values, "scales": w.scales}
            quantised[name] = {
                "format": w.format,
                "shape": list(w.shape),
                "dtype": w.dtype.name,
                "block": w.block,
            }
        else:
            tree[name] = w
    path = os.path.abspath(os.fspath(path))
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path, tree, force=overwrite, custom_metadata={"quantised": quantised})
    ckptr.wait_until_finished()


def restore_params(
    path: str | os.PathLike[str],
    *,
    cfg: ModelConfig | None = None,
    dtype: Any = None,
    mesh: jax.sharding.Mesh | None = None,
) -> dict[str, Any]:
    """Restore params written by `save_params`: onto the default device, or with ``mesh``
    straight into their rule-table shardings (`dsv4.sharding.param_formats`), `QuantisedWeight`s
    rebuilt as saved. With ``cfg`` the saved names and shapes are first checked against
    ``param_specs(cfg)`` (one `CheckpointError`). ``dtype`` casts the float arrays (with ``cfg``,
    not the ones the release stores as F32) and is what a `QuantisedWeight` stands for.
    """
    import orbax.checkpoint as ocp  # reason: ~0.8 s at import; only save/restore use it

    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such orbax checkpoint directory")
    ckptr = ocp.StandardCheckpointer()
    meta = ckptr.metadata(path)
    tree = meta.item_metadata.tree
    if not isinstance(tree, Mapping):
        raise CheckpointError(f"{path}: expected a flat dict of arrays, found {type(tree)}")
    quantised = (meta.custom_metadata or {}).get("quantised", {})
    if cfg is not None:
        shapes = {
            n: tuple(quantised[n]["shape"]) if n in quantised else tuple(m.shape)
            for n, m in tree.items()
        }
        title = f"orbax checkpoint {path} does not match the config"
        check_shapes(shapes, cfg, title, ("config expects", "saved"))
    abstract = _abstract_params(tree, quantised, dtype)
    formats, target = _restore_target(abstract, cfg, mesh)
    as_saved = {
        n: {"values": w.values, "scales": w.scales} if isinstance(w, QuantisedWeight) else w
        for n, w in target.items()
    }
    params = _as_params(ckptr.restore(path, as_saved), target, cfg, dtype)
    for n, f in formats.items():  # the routed experts' device layout
        if isinstance(f, Format):
            params[n] = jax.device_put(params[n], f)
    return params


def _abstract_params(
    tree: Mapping[str, Any], quantised: Mapping[str, Any], dtype: Any
) -> dict[str, Any]:
    """The saved arrays' shapes and dtypes, with each saved `QuantisedWeight` rebuilt."""
    abstract: dict[str, Any] = {}
    for n, m in tree.items():
        if n in quantised:
            q = quantised[n]
            abstract[n] = QuantisedWeight(
                jax.ShapeDtypeStruct(tuple(m["values"].shape), m["values"].dtype),
                jax.ShapeDtypeStruct(tuple(m["scales"].shape), m["scales"].dtype),
                format=q["format"],
                shape=tuple(q["shape"]),
                dtype=jnp.dtype(q["dtype"]) if dtype is None else dtype,
                block=q["block"],
            )
        else:
            abstract[n] = jax.ShapeDtypeStruct(tuple(m.shape), m.dtype)
    return abstract


def _restore_target(
    abstract: dict[str, Any], cfg: ModelConfig | None, mesh: jax.sharding.Mesh | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the params' device formats with ``mesh``, else none; the sharded abstract params)."""
    formats: dict[str, Any] = {}
    if mesh is None:
        single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: single, abstract)
    else:
        # orbax restores into shardings; the routed experts' layout is applied after
        formats = param_formats(abstract, cfg, resolve_mesh(mesh, "restore_params"))
        shardings = {n: f.sharding if isinstance(f, Format) else f for n, f in formats.items()}
    target = jax.tree.map(
        lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), abstract, shardings
    )
    return formats, target


def _as_params(
    restored: Mapping[str, Any], target: Mapping[str, Any], cfg: ModelConfig | None, dtype: Any
) -> dict[str, Any]:
    """The restored arrays as params: `QuantisedWeight`s reassembled, floats cast to ``dtype``
    (except, with ``cfg``, the tensors the release stores as F32)."""
    params: dict[str, Any] = {}
    specs = param_specs(cfg) if cfg is not None else {}
    for n, w in target.items():
        x = restored[n]
        if isinstance(w, QuantisedWeight):
            params[n] = QuantisedWeight.tree_unflatten(
                w.tree_flatten()[1], (x["values"], x["scales"])
            )
            continue
        keep = n in specs and specs[n].storage is Storage.F32
        if dtype is not None and not keep and jnp.issubdtype(x.dtype, jnp.floating):
            x = x.astype(dtype)
        params[n] = x
    return params
