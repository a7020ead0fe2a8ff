"""XLA's per-device memory of the sharded paged step, compiled without devices, beside the
memory planner (`planner.plan`).

`compiled_step_memory(cfg, mesh, target=...)` lowers and compiles `dsv4.paged.step.paged_step`
(the serving step: chunked prefills and decodes in one ragged batch, real kernels) for an
8-chip target that is not here:

* ``"tpu:v5p:2x2x2"`` (any libtpu compile-only topology ``tpu:<topology>``): libtpu's XLA:TPU
  with the Pallas TPU kernels (Mosaic), ``impl="tpu"``;
* ``"h100x8"``: eight H100s of one host, the CUDA plugin's compile-only topology ``1x1x8``
  (`jax.experimental.topologies.get_topology_desc("", "cuda", target_config=<the H100 SXM
  GpuTargetConfigProto>, topology="1x1x8")`), XLA:GPU with the Pallas GPU kernels (Triton),
  ``impl="gpu"``. The CUDA plugin's import checks the CUDA libraries unless ``JAX_PLATFORMS``
  names no CUDA platform (``JAX_PLATFORMS=cpu``, as the tests run) or
  ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK`` is set; no GPU, cuDNN or driver is needed.

What is compiled, per device of a ``data x expert x model`` mesh (`dsv4.sharding.AXES`), passed
to the step as ``mesh=`` (so `layers.moe` dispatches tokens to the experts' devices,
`dsv4.expert_parallel`):

* params sharded by `dsv4.sharding.PARAM_RULES`: ``weights="bf16"`` the dequantised params
  (`dsv4.params.abstract_params`), ``weights="released"`` the released fp8 / FP4 bytes on
  device (`dsv4.qweights.abstract_released_params`; codes and scales placed by
  `dsv4.sharding.leaf_spec`);
* the KV pools of `cache.layout.for_model` for the chip's record formats and geometry
  (`planner.plan.kv_layout`'s preset), sized for the requests of one data shard (``max_num_seqs``
  / ``data``, rounded up) of ``max_model_len`` tokens plus the null block (the planner's own
  block count). With ``data = 1`` they are replicated over the mesh (the engine's one
  allocator: every device holds every page) and the step is `paged_step`; with ``data > 1``
  each data shard has its own pools, stacked on a leading axis split over ``data``, and the
  step is `dsv4.paged.step.paged_step_data_parallel` (vLLM's data-parallel attention: one
  allocator per shard). Pages are never split over ``model``: V4.1's KV is one shared latent
  per token that every head reads;
* the step batch (`dsv4.paged.batch.empty_batch`: ``num_tokens`` tokens and a shard's rows per
  data shard, full-width block tables), placed like the pools; the pools are donated, as the
  engine donates them.

The Pallas kernels inside this GSPMD program: XLA cannot partition a Mosaic or Triton custom
call, so `dsv4.paged.step` runs each attention kernel inside a `jax.shard_map` over that mesh
(`dsv4.paged.step.local_kernel`): the window and sparse attention with their heads split
over ``model`` (each head's softmax is its own, the pages are replicated), the indexer and the
compressor replicated (the indexer sums its heads' scores before the top-k).

The returned dict puts XLA's `memory_analysis` (arguments, outputs, aliased outputs,
temporaries, generated code) beside `planner.plan.plan` of the same model, mesh and sizes; the
arguments are also split by kind from the compiled program's input shardings (bytes of each
argument's per-device shard): weights, KV pools, batch. See `describe` for one line of it.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import pathlib
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies
from jax.experimental.layout import Format
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from cache.layout import for_model
from dsv4 import sharding
from dsv4.config import ModelConfig
from dsv4.paged.batch import empty_batch
from dsv4.paged.pools import PoolLayout, cache_desc
from dsv4.paged.records import PRESETS
from dsv4.paged.step import paged_step, paged_step_data_parallel
from dsv4.params import abstract_params
from dsv4.qweights import abstract_released_params
from planner import plan as P

__all__ = [
    "H100X8",
    "compiled_step_memory",
    "describe",
    "h100_target_config",
    "reduced_flash_roles",
    "target_devices",
]

H100X8 = "h100x8"
_H100_NAME = "NVIDIA H100 80GB HBM3"


def reduced_flash_roles(**overrides) -> ModelConfig:
    """V4.1-Flash at its released widths (384 experts) with 12 layers, two of every attention
    role: window-only (0, 1), full ratio 2 (2, 4), reuse ratio 2 (3, 5), full ratio 1 (6: the
    candidate source, 9), reuse ratio 1 (7, 10), reindex (8, 11: candidate consumers); no Engram
    (its tables stay on the host, `dsv4.formats.HostTable`), no DSpark drafter."""
    layers = dict(
        n_layers=12,
        compress_ratios=(0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1),
        kv_source_layers=(2, 4, 6, 9),
        index_source_layers=(2, 4, 6, 8, 9, 11),
        candidate_source_layer=6,
    )
    return P.flash_layers(layers, overrides)


def h100_target_config() -> str:
    """XLA's ``GpuTargetConfigProto`` text of an H100 SXM, read out of the installed CUDA plugin
    (which embeds XLA's device spec files)."""
    spec = importlib.util.find_spec("jax_plugins.xla_cuda12")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("jax-cuda12-plugin not installed (pip install -e '.[aot]')")
    so = pathlib.Path(next(iter(spec.submodule_search_locations))) / "xla_cuda_plugin.so"
    return _target_config(str(so), _H100_NAME)


@functools.cache
def _target_config(path: str, description: str) -> str:
    data = pathlib.Path(path).read_bytes()
    marker = f'device_description_str: "{description}"\n'.encode()
    for match in re.finditer(re.escape(marker), data):
        start = data.rfind(b"\x00", 0, match.start()) + 1
        end = data.find(b"\x00", match.end())
        text = data[start:end].decode()
        if text.rstrip().endswith(marker.decode().rstrip()) and "gpu_device_info" in text:
            return text
    raise RuntimeError(f"no target config for {description!r} in {path}")


def target_devices(target: str) -> tuple[list, str, str, P.SliceSpec]:
    """``(devices, platform, impl, planner slice)`` of a compile target (module docstring).

    Raises:
        ValueError: an unknown target.
    """
    if target == H100X8:
        topo = topologies.get_topology_desc(
            "", platform="cuda", target_config=h100_target_config(), topology="1x1x8"
        )
        return list(topo.devices), "cuda", "gpu", P.parse_slice("h100x8")
    m = re.fullmatch(r"tpu:(v5e|v6e|v5p):(\d+(?:x\d+)+)", target)
    if not m:
        raise ValueError(f"target {target!r}: expected 'tpu:<v5e|v6e|v5p>:<AxB[xC]>' or {H100X8!r}")
    devices = list(topologies.get_topology_desc(f"{m[1]}:{m[2]}", platform="tpu").devices)
    n = len(devices) * (2 if m[1] == "v5p" else 1)
    return devices, "tpu", "tpu", P.parse_slice(f"{m[1]}-{n}")


def _sharded_params(cfg: ModelConfig, jmesh, weights: str):
    if weights == "bf16":
        params = abstract_params(cfg, jnp.bfloat16)
    elif weights == "released":
        params = abstract_released_params(cfg, jnp.bfloat16)
    else:
        raise ValueError(f"weights={weights!r}: 'bf16' or 'released'")
    specs = sharding.param_partition_specs(cfg, jmesh)
    formats = sharding.param_formats(params, cfg, jmesh)  # the routed experts' device layout

    def place(name, value):
        if isinstance(formats[name], Format):
            return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=formats[name])
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(
                a.shape,
                a.dtype,
                sharding=NamedSharding(jmesh, sharding.leaf_spec(specs[name], a.shape, jmesh)),
            ),
            value,
        )

    return {name: place(name, value) for name, value in params.items()}


def _shard_bytes(tree, shardings) -> int:
    """Bytes per device of a pytree of abstract arrays under the compiled program's input
    ``shardings`` (the same pytree): each leaf's shard; a leaf the program does not read
    (pruned by jit: its sharding is None, XLA gets no such argument) counts 0."""
    placed = jax.tree.leaves(shardings, is_leaf=lambda x: x is None)
    return sum(
        0 if s is None else math.prod(s.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize
        for a, s in zip(jax.tree.leaves(tree), placed, strict=True)
    )


def compiled_step_memory(
    cfg: ModelConfig,
    mesh: P.MeshAxes,
    *,
    target: str,
    weights: str = "bf16",
    max_num_seqs: int = 16,
    max_model_len: int = 65_536,
    num_tokens: int = 256,
    records: str | None = None,
) -> dict[str, Any]:
    """Deviceless compile of the sharded paged step of ``cfg`` on ``target`` over ``mesh``
    (module docstring) and its per-device memory beside `planner.plan.plan`'s per-chip figures
    for the same model, mesh, ``max_num_seqs``, ``max_model_len`` and
    ``max_num_batched_tokens = num_tokens``; ``records``: the KV record preset
    (`dsv4.paged.records.PRESETS`, default the chip's: TPUs ``RELEASED``, H100 ``SM90``).

    Raises:
        ValueError: a mesh of another device count than the target, or an unknown target /
            weights kind.
    """
    devices, _, impl, slice_ = target_devices(target)
    if len(devices) != mesh.num_chips:
        raise ValueError(f"mesh {mesh} needs {mesh.num_chips} devices; {target} has {len(devices)}")
    t0 = time.perf_counter()
    grid = np.asarray(devices, dtype=object).reshape(mesh.data, mesh.expert, mesh.model)
    jmesh = Mesh(grid, ("data", "expert", "model"))
    plan, config, layout, num_blocks = _planned_pools(
        cfg, slice_, mesh, max_num_seqs, max_model_len, num_tokens, records
    )
    rows = -(-max_num_seqs // mesh.data)  # requests per data shard
    args = _abstract_args(cfg, jmesh, config, layout, weights, rows, max_model_len, num_tokens)
    text, compiled, t_lower = _lower_and_compile(cfg, layout, jmesh, impl, args, t0)
    xla = _xla_bytes(compiled, args)
    planner = _planner_figures(cfg, mesh, slice_, plan, weights, rows, max_model_len, num_tokens)
    return {
        "target": target,
        "device_kind": devices[0].device_kind,
        "num_devices": len(devices),
        "mesh": {"data": mesh.data, "expert": mesh.expert, "model": mesh.model},
        "model": (
            f"{cfg.n_layers} layers (ratios {''.join(map(str, cfg.compress_ratios))}), "
            f"{cfg.n_routed_experts} experts, dim {cfg.dim}"
        ),
        "weights": weights,
        "kernels": impl,
        "records": plan.records,
        "max_num_seqs": max_num_seqs,
        "max_model_len": max_model_len,
        "num_tokens": num_tokens,
        "num_blocks": num_blocks,
        "pools": "split over data" if mesh.data > 1 else "replicated",
        "hlo": _hlo_counts(text),
        "xla": xla,
        "planner": planner,
        "ratios": _ratios(xla, planner),
        "lower_s": round(t_lower, 1),
        "compile_s": round(time.perf_counter() - t0 - t_lower, 1),
    }


def _planned_pools(
    cfg: ModelConfig,
    slice_: P.SliceSpec,
    mesh: P.MeshAxes,
    max_num_seqs: int,
    max_model_len: int,
    num_tokens: int,
    records: str | None,
) -> tuple[Any, Any, PoolLayout, int]:
    """The planner's plan and the KV pools it sized: the cache config for its blocks (plus the
    null block) and the pool layout, whose bytes per block must be the planner's."""
    plan = P.plan(
        cfg,
        slice_,
        mesh=mesh,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=num_tokens,
        records=records,
        contexts=(),
    )
    chip = slice_.chip
    formats = PRESETS[plan.records]
    desc = cache_desc(
        cfg,
        formats,
        block_size=chip.block_size,
        swa_block_size=chip.swa_block_size,
        page_alignment=chip.page_alignment,
        indexer_page_alignment=chip.page_alignment,
    )
    per_block = plan.kv_null_block
    num_blocks = 1 + sum(plan.kv_groups.values()) // per_block  # the planner's blocks + null
    config = for_model(desc, num_gpu_blocks_override=num_blocks)
    layout = PoolLayout.build(cfg, config, formats)
    assert layout.bytes_per_block() == per_block, (layout.bytes_per_block(), per_block)
    return plan, config, layout, num_blocks


def _abstract_args(
    cfg: ModelConfig,
    jmesh: Mesh,
    config,
    layout: PoolLayout,
    weights: str,
    rows: int,
    max_model_len: int,
    num_tokens: int,
) -> tuple[Any, dict[str, jax.ShapeDtypeStruct], Any]:
    """The step's ``(params, pools, batch)`` as sharded abstract arrays; ``rows``: the
    requests of one batch."""
    # data > 1: data-parallel attention, one shard of pools and one batch per data shard (its
    # ceil(max_num_seqs / data) requests, num_tokens tokens), split over data; else replicated
    d = jmesh.shape["data"]
    lead = (d,) if d > 1 else ()
    placed = NamedSharding(jmesh, PartitionSpec("data" if d > 1 else None))
    pools = {
        k: jax.ShapeDtypeStruct(lead + s, jnp.uint8, sharding=placed)
        for k, s in layout.buffer_shapes().items()
    }
    batch = empty_batch(config, max_model_len=max_model_len, num_tokens=num_tokens, num_rows=rows)
    batch = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(lead + np.shape(x), x.dtype, sharding=placed), batch
    )
    params = _sharded_params(cfg, jmesh, weights)
    return params, pools, batch


def _lower_and_compile(
    cfg: ModelConfig, layout: PoolLayout, jmesh: Mesh, impl: str, args: tuple, t0: float
) -> tuple[str, Any, float]:
    """Lower and compile the paged step (data-parallel over a data axis > 1) for ``args``;
    returns the lowered text, the compiled program and the seconds from ``t0`` to lowered."""
    d = jmesh.shape["data"]

    def step(params, pools, batch):
        run = paged_step_data_parallel if d > 1 else paged_step
        return run(params, cfg, layout, pools, batch, impl=impl, mesh=jmesh)

    # the serving precision: under jax.default_matmul_precision("highest") (the model tests'
    # setting) XLA:TPU's ragged-dot kernel (the expert-parallel MoE) fails to compile: Mosaic
    # "Bad lhs type" for a bf16 matmul at fp32 contract precision. The step takes the mesh as
    # data (the kernels' TensorCores too: `dsv4.paged.step.core_options`)
    with jax.default_matmul_precision("default"):
        lowered = jax.jit(step, donate_argnums=1).trace(*args).lower()
        t_lower = time.perf_counter() - t0
        text = lowered.as_text()
        compiled = lowered.compile()
    return text, compiled, t_lower


def _planner_figures(
    cfg: ModelConfig,
    mesh: P.MeshAxes,
    slice_: P.SliceSpec,
    plan,
    weights: str,
    rows: int,
    max_model_len: int,
    num_tokens: int,
) -> dict[str, Any]:
    """The plan's per-chip bytes for the weights this step holds: weights, KV pools and the
    activation peak with its terms (for the released weights, the plan's own terms)."""
    chip = slice_.chip
    planner_w = plan.weights if weights == "released" else plan.weights_bf16
    activations = P.activation_bytes(
        cfg,
        mesh,
        num_tokens=num_tokens,
        num_requests=min(rows, num_tokens),
        released_weights=weights == "released",
        reads=P.kv_reads(cfg, P.kv_layout(cfg, chip, plan.records), plan.records,
                         max_model_len, num_tokens),
        seqs=rows,
        platform=chip.platform,
    )  # fmt: skip
    assert weights == "bf16" or activations == plan.activations
    return {
        "weights_bytes": planner_w,
        "kv_bytes": plan.kv,
        "activation_bytes": activations["peak"],
        "activation_terms": {k: v for k, v in activations.items() if k != "peak"},
    }


def _hlo_counts(text: str) -> dict[str, int]:
    """The lowered program's expert dispatch and kernel calls (Mosaic / Triton custom calls)."""
    return {
        "all_to_all": text.count("stablehlo.all_to_all"),
        "kernel_calls": len(
            re.findall(r"custom_call @(?:tpu_custom_call|__gpu\$xla\.gpu\.triton)", text)
        ),
    }


def _xla_bytes(compiled, args: tuple) -> dict[str, int]:
    """XLA's memory analysis of the compiled step, with the bytes per device of its
    ``args`` (params, pools, batch) under the program's input shardings."""
    stats = compiled.memory_analysis()
    w_bytes, kv_bytes, batch_bytes = (
        _shard_bytes(a, shardings)
        for a, shardings in zip(args, compiled.input_shardings[0], strict=True)
    )
    return {
        "argument_size_in_bytes": stats.argument_size_in_bytes,
        "output_size_in_bytes": stats.output_size_in_bytes,
        "alias_size_in_bytes": stats.alias_size_in_bytes,
        "temp_size_in_bytes": stats.temp_size_in_bytes,
        "generated_code_size_in_bytes": stats.generated_code_size_in_bytes,
        "weights_bytes": w_bytes,
        "kv_pool_bytes": kv_bytes,
        "batch_bytes": batch_bytes,
    }


def _ratios(xla: dict[str, int], planner: dict[str, Any]) -> dict[str, float]:
    """The compiled figures over the planner's: arguments, weights, KV pools, temporaries."""
    planner_args = planner["weights_bytes"] + planner["kv_bytes"] + xla["batch_bytes"]
    return {
        "arguments": round(xla["argument_size_in_bytes"] / planner_args, 6),
        "weights": round(xla["weights_bytes"] / planner["weights_bytes"], 6),
        "kv": round(xla["kv_pool_bytes"] / planner["kv_bytes"], 6),
        "temp_over_activations": round(xla["temp_size_in_bytes"] / planner["activation_bytes"], 3),
    }


def describe(got: dict[str, Any]) -> str:
    """A few lines of `compiled_step_memory`'s figures, per device, with the ratios."""
    x, p, r = got["xla"], got["planner"], got["ratios"]
    gib = P.GiB
    return "\n".join(
        [
            f"paged step of {got['model']} on {got['target']} ({got['num_devices']} x "
            f"{got['device_kind']}), mesh {got['mesh']}, {got['weights']} weights, "
            f"{got['kernels']} kernels, {got['records']} records, pools {got['pools']} "
            f"({got['max_num_seqs']} x {got['max_model_len']} tokens), "
            f"{got['num_tokens']} tokens per step",
            f"  XLA arguments {x['argument_size_in_bytes'] / gib:.3f} GiB = {r['arguments']} x "
            f"planner weights + KV + batch",
            f"  weights       XLA {x['weights_bytes'] / gib:.3f} GiB  planner "
            f"{p['weights_bytes'] / gib:.3f} GiB  ratio {r['weights']}",
            f"  KV pools      XLA {x['kv_pool_bytes'] / gib:.3f} GiB  planner "
            f"{p['kv_bytes'] / gib:.3f} GiB  ratio {r['kv']}",
            f"  temporaries   XLA {x['temp_size_in_bytes'] / gib:.3f} GiB  planner activations "
            f"{p['activation_bytes'] / gib:.3f} GiB  ratio {r['temp_over_activations']}",
            f"  outputs {x['output_size_in_bytes'] / gib:.3f} GiB (aliased "
            f"{x['alias_size_in_bytes'] / gib:.3f}), generated code "
            f"{x['generated_code_size_in_bytes'] / 2**20:.1f} MiB",
        ]
    )
