"""Meshes and the partitioning rule table of V4.1's parameters (docs/scale_out.md).

`make_mesh(data=, model=, expert=)` builds a named mesh ``("data", "expert", "model")`` over the
present devices. `param_partition_specs(cfg, mesh)` gives every parameter a `PartitionSpec`,
chosen by its checkpoint name from `PARAM_RULES` (first match wins; a name no rule matches is an
error, so a new tensor cannot silently end up replicated):

* attention heads over ``model``: ``wq_b`` (output rows are heads), ``attn_sink``, the grouped
  output projection by group (``wo_a`` rows are groups, ``wo_b`` columns), the indexer's query
  heads (``indexer.wq_b``, ``weights_proj``);
* the single shared KV latent and everything per token (``wq_a``, ``wkv``, norms, the
  compressor, the indexer's key projection, mHC) replicated;
* routed experts over ``expert`` (the leading expert dim), shared experts column / row parallel
  over ``model``; the router replicated;
* the vocabulary-split embedding, LM head and DSpark heads over ``model``; Engram replicated.

`shard_params(params, cfg, mesh)` places a params dict into those shardings (`param_shardings`
gives them as a pytree of `NamedSharding`s, for jit; `param_formats` adds the device layout of
the routed experts under an ``expert`` axis, `EXPERT_WEIGHT_LAYOUT`: the dims the expert
dispatch multiplies by, so that XLA reads them without a copy). A weight kept in its released format
(`dsv4.formats.QuantisedWeight`) has its codes and scales placed with the weight's spec, on
each dim their (packed or per-tile) size lets the axis divide (`leaf_spec`), so each device
dequantises its own slice. XLA's SPMD partitioner then runs `reference.forward` (or any jitted path) on the sharded params; the tests
check the sharded forward equals the single-device one on a mesh of host devices.

A dimension an axis does not divide is refused with an error naming the tensor, the dim and the
axis (pick a mesh whose ``model`` divides the heads, index heads, output groups and vocabulary,
and whose ``expert`` divides the routed experts).

``dsv4.load_pretrained(path, mesh=)`` places each param straight into these shardings, every
process decoding only its devices' slices of the checkpoint (`param_shardings` of the abstract
params gives them).

Under a mesh set with `jax.set_mesh`, the routed experts dispatch their tokens over ``expert``
(`dsv4.expert_parallel`); the engine takes a mesh (`serving.LLM(mesh=)`) and replicates its
pools. The data-parallel step (`dsv4.paged.step.paged_step_data_parallel`, vLLM's
data-parallel attention: one allocator, one set of pools and one batch per data shard) takes
pools and batches with a leading shard axis, which `data_parallel_sharding` splits over
``data``; the engine does not drive it yet (it has one allocator).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental.layout import Format, Layout
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dsv4.config import ModelConfig
from dsv4.formats import QuantisedWeight
from dsv4.params import param_specs

__all__ = [
    "AXES",
    "EXPERT_WEIGHT_LAYOUT",
    "PARAM_RULES",
    "data_parallel_sharding",
    "leaf_spec",
    "make_mesh",
    "param_formats",
    "param_partition_specs",
    "param_shardings",
    "partition_spec_for",
    "shard_params",
]

AXES = ("data", "expert", "model")

_M, _E = "model", "expert"

# (regex on the checkpoint name, spec by dim); the block prefix is ``layers.N.`` or ``mtp.N.``.
_BLOCK = r"(?:layers|mtp)\.\d+\."
PARAM_RULES: tuple[tuple[str, tuple[str | None, ...] | None], ...] = (
    # attention: heads split, the shared latent replicated
    (_BLOCK + r"attn\.(wq_b|wo_a|indexer\.wq_b|indexer\.weights_proj)\.weight$", (_M, None)),
    (_BLOCK + r"attn\.wo_b\.weight$", (None, _M)),
    (_BLOCK + r"attn\.attn_sink$", (_M,)),
    (_BLOCK + r"attn\.(wq_a|wkv|q_norm|kv_norm|indexer\.wk|indexer\.k_norm)\.weight$", None),
    (_BLOCK + r"attn\.compressor\.", None),
    # MoE: routed experts over the expert axis, shared experts tensor-parallel
    (_BLOCK + r"ffn\.experts\.w[123]\.weight$", (_E, None, None)),
    (_BLOCK + r"ffn\.shared_experts\.w[13]\.weight$", (_M, None)),
    (_BLOCK + r"ffn\.shared_experts\.w2\.weight$", (None, _M)),
    (_BLOCK + r"ffn\.gate\.(weight|bias)$", None),
    # per-block norms, mHC, DSpark's projections
    (_BLOCK + r"(attn_norm|ffn_norm|norm|main_norm)\.weight$", None),
    (_BLOCK + r"hc_(attn|ffn)_(fn|base|scale)$", None),
    (_BLOCK + r"main_proj\.weight$", None),
    (_BLOCK + r"confidence_head\.", None),
    (_BLOCK + r"markov_head\.(embed|head)\.weight$", (_M, None)),
    # Engram: replicated (the released tables stay on the host as `dsv4.formats.HostTable`s;
    # their row counts, sums of primes, divide no mesh axis)
    (_BLOCK + r"engram\.", None),
    (r"^engram\.token_map$", None),
    # vocabulary-split embedding and head
    (r"^embed\.weight$", (_M, None)),
    (r"^head\.weight$", (_M, None)),
    (r"^norm\.weight$", None),
)
_COMPILED = tuple((re.compile(p), spec) for p, spec in PARAM_RULES)
_NO_RULE = object()


def make_mesh(*, data: int = 1, model: int = 1, expert: int | None = None, devices=None) -> Mesh:
    """A ``("data", "expert", "model")`` mesh of ``data * expert * model`` devices (the first
    ones of ``devices``, default `jax.devices()`); ``expert=None`` means 1.

    Raises:
        ValueError: an axis size below 1, or more devices asked for than there are.
    """
    expert = 1 if expert is None else expert
    for name, size in (("data", data), ("expert", expert), ("model", model)):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"make_mesh {name}={size!r}: must be an int >= 1")
    devices = list(jax.devices() if devices is None else devices)
    need = data * expert * model
    if need > len(devices):
        raise ValueError(
            f"make_mesh(data={data}, expert={expert}, model={model}) needs {need} devices; "
            f"{len(devices)} present"
        )
    grid = np.asarray(devices[:need], dtype=object).reshape(data, expert, model)
    return Mesh(grid, AXES)


def partition_spec_for(name: str, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """The spec of one parameter by its checkpoint name (`PARAM_RULES`).

    Raises:
        ValueError: no rule matches the name, the rule's rank differs from the tensor's, or a
            mesh axis does not divide the dim it splits.
    """
    spec = next((rule for pattern, rule in _COMPILED if pattern.search(name)), _NO_RULE)
    if spec is _NO_RULE:
        raise ValueError(f"no partition rule for parameter {name!r} (shape {shape})")
    if spec is None:
        return PartitionSpec()
    if len(spec) != len(shape):
        raise ValueError(f"partition rule {spec} for {name!r} has rank {len(spec)}; shape {shape}")
    for dim, axis in enumerate(spec):
        if axis is not None and shape[dim] % mesh.shape[axis]:
            raise ValueError(
                f"parameter {name!r} dim {dim} (size {shape[dim]}) is not divisible by mesh "
                f"axis {axis}={mesh.shape[axis]}"
            )
    return PartitionSpec(*spec)


def param_partition_specs(
    cfg: ModelConfig, mesh: Mesh, params: Mapping[str, Any] | None = None
) -> dict[str, PartitionSpec]:
    """Every parameter's spec: of ``params`` when given, else of `dsv4.params.param_specs`."""
    if params is None:
        shapes = {n: tuple(s.shape) for n, s in param_specs(cfg).items()}
    else:
        shapes = {n: tuple(np.shape(v)) for n, v in params.items()}
    return {n: partition_spec_for(n, shape, mesh) for n, shape in shapes.items()}


def leaf_spec(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """The spec of an array that stores a weight of spec ``spec`` dim for dim (a quantised
    weight's codes or scales): the weight's axis on every dim of ``shape`` it divides, None on
    the others (a packed or per-tile dim too short to split stays whole on each device)."""
    if spec == PartitionSpec():
        return spec
    axes = tuple(spec) + (None,) * (len(shape) - len(spec))
    return PartitionSpec(
        *(
            a if a is not None and shape[d] % mesh.shape[a] == 0 else None
            for d, a in enumerate(axes)
        )
    )


def param_shardings(params: Mapping[str, Any], cfg: ModelConfig, mesh: Mesh) -> dict[str, Any]:
    """A `NamedSharding` for every leaf of ``params``, in the params' pytree structure (for
    ``jax.jit``'s ``in_shardings`` / ``out_shardings`` or ``jax.device_put``): an array's
    by its rule, a `dsv4.formats.QuantisedWeight`'s codes and scales by `leaf_spec`; a node
    without leaves (an Engram `HostTable`) is kept as it is."""
    specs = param_partition_specs(cfg, mesh, params)
    out: dict[str, Any] = {}
    for name, value in params.items():
        if isinstance(value, QuantisedWeight):
            out[name] = jax.tree.map(
                lambda a, s=specs[name]: NamedSharding(mesh, leaf_spec(s, np.shape(a), mesh)),
                value,
            )
        elif jax.tree.leaves(value):
            out[name] = NamedSharding(mesh, specs[name])
        else:
            out[name] = value
    return out


# The routed experts' weights are [e, out, in] (the checkpoint's layout). The expert dispatch
# (`dsv4.expert_parallel`) multiplies by them as [e, in, out], the operand layout of XLA's
# ragged dot. In the checkpoint's row-major layout, XLA:TPU for v5p copied every local
# expert's weights into that layout at each step (deviceless compiles: a temporary of the
# whole projection, 1.9 GiB for 96 local experts of V4.1-Flash), and XLA:GPU's ragged dot took
# 2.6 GiB of temporaries where it takes 0.7 GiB with this layout. Stored on the device with
# their dims ordered (e, in, out) from major to minor (`jax.experimental.layout`), the same
# logical arrays cost no copy. Only where the dispatch runs (an ``expert`` axis over 1): the
# one-device branches read the experts in the checkpoint's order.
EXPERT_WEIGHT_LAYOUT = Layout(major_to_minor=(0, 2, 1))
_ROUTED_EXPERT = re.compile(_BLOCK + r"ffn\.experts\.w[123]\.weight$")


def param_formats(params: Mapping[str, Any], cfg: ModelConfig, mesh: Mesh) -> dict[str, Any]:
    """`param_shardings`, with the routed experts' plain arrays as a `Format` of
    `EXPERT_WEIGHT_LAYOUT` and their sharding when ``mesh`` splits them over ``expert`` (for
    ``jax.device_put`` and ``jax.make_array_from_callback``; the values are unchanged)."""
    out = param_shardings(params, cfg, mesh)
    if mesh.shape[_E] == 1:
        return out
    for name, value in out.items():
        if isinstance(value, NamedSharding) and _ROUTED_EXPERT.search(name):
            out[name] = Format(EXPERT_WEIGHT_LAYOUT, value)
    return out


def shard_params(params: Mapping[str, Any], cfg: ModelConfig, mesh: Mesh) -> dict[str, Any]:
    """``params`` placed into their `param_formats` on ``mesh`` (host-side nodes without
    leaves, such as an Engram `HostTable`, stay where they are)."""
    shardings = param_formats(params, cfg, mesh)
    out = {}
    for name, value in params.items():
        if isinstance(value, jax.Array | np.ndarray | QuantisedWeight):
            out[name] = jax.device_put(value, shardings[name])
        else:
            out[name] = value
    return out


def data_parallel_sharding(tree: Any, mesh: Mesh) -> Any:
    """A `NamedSharding` per leaf of ``tree`` (arrays or abstract arrays with a leading shard
    axis: `dsv4.paged.step.stack_shards` of per-shard pools or batches) that splits that axis
    over ``data`` and replicates the rest: each data shard's devices hold its own pages and
    step inputs.

    Raises:
        ValueError: a leaf whose leading axis the ``data`` axis does not divide, naming it.
    """
    n = dict(mesh.shape).get("data", 1)
    split = NamedSharding(mesh, PartitionSpec("data"))

    def one(path, leaf):
        shape = np.shape(leaf)
        if not shape or shape[0] % n:
            raise ValueError(
                f"{jax.tree_util.keystr(path) or 'leaf'} of shape {list(shape)}: its leading "
                f"(shard) axis must be a multiple of the mesh's data axis ({n})"
            )
        return split

    return jax.tree_util.tree_map_with_path(one, tree)
