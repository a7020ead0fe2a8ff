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
from dsv4.formats import CheckpointError, QuantisedWeight, format_problems
from dsv4.params import Storage, param_specs
from dsv4.sharding import param_formats

__all__ = ["restore_params", "save_params"]


def save_params(
    params: Mapping[str, Any], path: str | os.PathLike[str], *, overwrite: bool = False
) -> None:
    """Save the params unchanged (names, shapes, dtypes, exact values, and their shardings)
    with orbax's StandardCheckpointer. ``path`` must not exist unless ``overwrite``.

    Sharded params (global `jax.Array`s, e.g. of ``load_pretrained(..., mesh=)``) are written
    by the processes that hold their shards (every process must call this, as orbax requires).
    A released weight (`dsv4.formats.QuantisedWeight`) is stored as its two arrays, codes
    (float8_e4m3fn for fp8, uint8 for fp4) and uint8 scales, under ``<name>/values`` and
    ``<name>/scales``; its format, logical shape, dtype and block go in the checkpoint's custom
    metadata, from which `restore_params` rebuilds it."""
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
    straight into their rule-table shardings (`dsv4.sharding.param_formats` on that mesh;
    each process reads the shards its devices hold), `QuantisedWeight`s rebuilt as saved.

    With ``cfg`` the saved names and (logical) shapes are first checked against
    ``param_specs(cfg)`` and every difference is reported in one `CheckpointError`. ``dtype``
    casts the restored float arrays and is what a restored `QuantisedWeight` stands for (its
    codes and scales are kept); with ``cfg`` the tensors the released checkpoint stores as F32
    stay float32, without ``cfg`` every float array is cast.
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
    shapes = {
        n: tuple(quantised[n]["shape"]) if n in quantised else tuple(m.shape)
        for n, m in tree.items()
    }
    if cfg is not None:
        specs = param_specs(cfg)
        missing = [n for n in specs if n not in tree]
        unexpected = [n for n in tree if n not in specs]
        wrong = [
            f"{n}: config expects {list(specs[n].shape)}, saved {list(shapes[n])}"
            for n in specs
            if n in tree and shapes[n] != specs[n].shape
        ]
        groups = [("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)]
        if missing or unexpected or wrong:
            raise CheckpointError(
                format_problems(f"orbax checkpoint {path} does not match the config", groups)
            )
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
    as_saved = {
        n: {"values": w.values, "scales": w.scales} if isinstance(w, QuantisedWeight) else w
        for n, w in target.items()
    }
    restored = ckptr.restore(path, as_saved)
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
    for n, f in formats.items():  # the routed experts' device layout
        if isinstance(f, Format):
            params[n] = jax.device_put(params[n], f)
    return params
