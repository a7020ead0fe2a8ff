"""The parameter pytree: names, shapes, checkpoint formats, and random initialisation.

Params are a flat ``dict[str, jax.Array]`` keyed by the checkpoint's tensor names (the official
inference names, e.g. ``layers.3.attn.wq_a.weight``), holding *dequantised* values in one float
dtype. One deliberate difference: the routed experts of a layer are stacked into one tensor per
projection, ``layers.L.ffn.experts.w1.weight`` of shape ``[n_routed_experts, out, in]``, because
the MoE computes over all experts at once; `checkpoint_tensors` expands them back into the
released per-expert names (``layers.L.ffn.experts.E.w1.weight``) for loading and saving.

Each tensor also records its storage format in the released checkpoint (`Storage`): ``fp8``
(e4m3 values + one e8m0 scale per ``fp8_block_size`` square tile), ``fp4`` (two e2m1 codes per
byte, low nibble first, + one e8m0 scale per 32 inputs), ``bf16`` or ``f32``. With
``ModelConfig.quant_sim`` the model fake-quantises the activations that feed fp8 and fp4 GEMMs,
so the set of quantised weights is part of the model's numerics.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsv4 import engram_hash
from dsv4.config import ModelConfig, Role
from dsv4.formats import CheckpointError, format_problems

__all__ = [
    "CheckpointTensor",
    "ParamSpec",
    "Storage",
    "abstract_params",
    "block_specs",
    "byte_token_map",
    "check_params",
    "check_shapes",
    "check_token_map",
    "checkpoint_tensors",
    "count_params",
    "dspark_specs",
    "init_params",
    "param_specs",
    "require_drafter",
]


class Storage(enum.Enum):
    FP8 = "fp8"
    FP4 = "fp4"
    BF16 = "bf16"
    F32 = "f32"
    # Engram tables: e4m3 rows with one e8m0 scale per fp8_block_size values of a row
    FP8_ROWS = "fp8_rows"
    # not in the checkpoint: derived at load time (the Engram compressed token map, int32,
    # from the tokenizer)
    DERIVED = "derived"


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    storage: Storage
    # how random init draws it: "linear" (normal / sqrt(fan_in)), "norm" (around 1), "normal",
    # "zeros", "hc_fn" (small), "hc_scale"
    init: str = "linear"
    stacked: bool = False  # leading axis = routed expert


def _linear(cfg: ModelConfig, out: int, inp: int) -> ParamSpec:
    return ParamSpec((out, inp), Storage.FP8 if cfg.dtype == "fp8" else Storage.BF16)


def _bf16(*shape: int, init: str = "linear") -> ParamSpec:
    return ParamSpec(tuple(shape), Storage.BF16, init)


def _f32(*shape: int, init: str) -> ParamSpec:
    return ParamSpec(tuple(shape), Storage.F32, init)


def block_specs(
    cfg: ModelConfig, p: str, n_experts: int, role: Role = Role.SWA, ratio: int = 0
) -> dict[str, ParamSpec]:
    """One block's tensors under prefix ``p`` (a backbone layer ``layers.L.``, or a DSpark
    stage ``mtp.i.``, which is a window-only block): norms, mHC mixes, attention (with the
    compressor and indexer its ``role`` owns) and the MoE with ``n_experts`` routed experts."""
    d, h, hd = cfg.dim, cfg.n_heads, cfg.head_dim
    mix = (2 + cfg.hc_mult) * cfg.hc_mult
    expert_storage = Storage.FP4 if cfg.expert_dtype == "fp4" else _linear(cfg, 1, 1).storage
    specs: dict[str, ParamSpec] = {}
    specs[p + "attn_norm.weight"] = _bf16(d, init="norm")
    specs[p + "ffn_norm.weight"] = _bf16(d, init="norm")
    for sub in ("attn", "ffn"):
        specs[p + f"hc_{sub}_fn"] = _f32(mix, cfg.hc_mult * d, init="hc_fn")
        specs[p + f"hc_{sub}_base"] = _f32(mix, init="hc_base")
        specs[p + f"hc_{sub}_scale"] = _f32(3, init="hc_scale")
    a = p + "attn."
    specs[a + "wq_a.weight"] = _linear(cfg, cfg.q_lora_rank, d)
    specs[a + "q_norm.weight"] = _bf16(cfg.q_lora_rank, init="norm")
    specs[a + "wq_b.weight"] = _linear(cfg, h * hd, cfg.q_lora_rank)
    specs[a + "wkv.weight"] = _linear(cfg, hd, d)
    specs[a + "kv_norm.weight"] = _bf16(hd, init="norm")
    specs[a + "wo_a.weight"] = _linear(cfg, cfg.o_groups * cfg.o_lora_rank, h * hd // cfg.o_groups)
    specs[a + "wo_b.weight"] = _linear(cfg, d, cfg.o_groups * cfg.o_lora_rank)
    specs[a + "attn_sink"] = _f32(h, init="normal")
    if role is Role.FULL:
        specs[a + "compressor.wkv.weight"] = _bf16(hd, d)
        if ratio > 1:
            specs[a + "compressor.wgate.weight"] = _bf16(hd, d)
        specs[a + "compressor.norm.weight"] = _bf16(hd, init="norm")
        specs[a + "indexer.wk.weight"] = _bf16(cfg.index_head_dim, hd)
        specs[a + "indexer.k_norm.weight"] = _bf16(cfg.index_head_dim, init="norm")
    if role in (Role.FULL, Role.REINDEX):
        specs[a + "indexer.wq_b.weight"] = _linear(
            cfg, cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank
        )
        specs[a + "indexer.weights_proj.weight"] = _bf16(cfg.index_n_heads, d)
    f = p + "ffn."
    e, inter = n_experts, cfg.moe_inter_dim
    specs[f + "gate.weight"] = _bf16(e, d)
    specs[f + "gate.bias"] = _f32(e, init="bias")
    specs[f + "experts.w1.weight"] = ParamSpec((e, inter, d), expert_storage, stacked=True)
    specs[f + "experts.w2.weight"] = ParamSpec((e, d, inter), expert_storage, stacked=True)
    specs[f + "experts.w3.weight"] = ParamSpec((e, inter, d), expert_storage, stacked=True)
    specs[f + "shared_experts.w1.weight"] = _linear(cfg, inter, d)
    specs[f + "shared_experts.w2.weight"] = _linear(cfg, d, inter)
    specs[f + "shared_experts.w3.weight"] = _linear(cfg, inter, d)
    return specs


def param_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """Every backbone tensor (Engram, DSpark and vision excluded), in checkpoint order."""
    d = cfg.dim
    specs: dict[str, ParamSpec] = {
        "embed.weight": _bf16(cfg.vocab_size, d, init="embed"),
    }
    for info in cfg.plan:
        p = f"layers.{info.layer}."
        specs.update(block_specs(cfg, p, cfg.n_routed_experts, info.role, info.ratio))
    specs["norm.weight"] = _bf16(d, init="norm")
    specs["head.weight"] = _bf16(cfg.vocab_size, d)
    if cfg.engram_layer_ids:
        specs.update(_engram_specs(cfg))
    if cfg.n_mtp_layers and cfg.dspark_block_size:
        specs.update(dspark_specs(cfg))
    return specs


def require_drafter(cfg: ModelConfig) -> None:
    """A ValueError unless the config has a DSpark drafter."""
    if not (cfg.n_mtp_layers and cfg.dspark_block_size):
        raise ValueError(
            f"config has no DSpark drafter (n_mtp_layers={cfg.n_mtp_layers}, "
            f"dspark_block_size={cfg.dspark_block_size}; both must be > 0)"
        )


def dspark_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """Every ``mtp.{i}.*`` tensor of the DSpark drafter with its released storage and shape:
    per stage a window-only backbone layer's, with ``dspark_n_routed_experts`` experts; stage 0
    adds ``main_proj`` and ``main_norm``, the last ``norm``, the Markov head and
    ``confidence_head.proj`` (shapes: docs/model.md#dspark-drafter). ``ffn.gate.bias_vl`` (the
    image-span routing bias) is left out like the backbone's."""
    require_drafter(cfg)
    d = cfg.dim
    specs: dict[str, ParamSpec] = {}
    for i in range(cfg.n_mtp_layers):
        p = f"mtp.{i}."
        specs.update(block_specs(cfg, p, cfg.dspark_n_routed_experts))  # a window-only block
        if i == 0:
            n_t = len(cfg.dspark_target_layer_ids)
            specs[p + "main_proj.weight"] = _linear(cfg, d, n_t * d)
            specs[p + "main_norm.weight"] = _bf16(d, init="norm")
        if i == cfg.n_mtp_layers - 1:
            r = cfg.dspark_markov_rank
            specs[p + "norm.weight"] = _bf16(d, init="norm")
            specs[p + "markov_head.embed.weight"] = _bf16(cfg.vocab_size, r, init="embed")
            specs[p + "markov_head.head.weight"] = _bf16(cfg.vocab_size, r)
            specs[p + "confidence_head.proj.weight"] = _bf16(1, d + r)
    return specs


def check_shapes(
    shapes: Mapping[str, tuple[int, ...]],
    cfg: ModelConfig,
    title: str,
    words: tuple[str, str] = ("expected", "got"),
) -> None:
    """Names and shapes must be exactly ``param_specs(cfg)``'s; else one
    `dsv4.formats.CheckpointError` titled ``title`` listing every difference (a wrong shape
    reads ``"<name>: <words[0]> <spec shape>, <words[1]> <shape>"``)."""
    specs = param_specs(cfg)
    missing = [n for n in specs if n not in shapes]
    unexpected = [n for n in shapes if n not in specs]
    wrong = [
        f"{n}: {words[0]} {list(specs[n].shape)}, {words[1]} {list(shapes[n])}"
        for n in specs
        if n in shapes and tuple(shapes[n]) != specs[n].shape
    ]
    groups = [("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)]
    if missing or unexpected or wrong:
        raise CheckpointError(format_problems(title, groups))


def check_params(params: Mapping[str, Any], cfg: ModelConfig, what: str) -> None:
    """`check_shapes` of ``params`` (``what`` names the caller in the error)."""
    shapes = {n: tuple(np.shape(w)) for n, w in params.items()}
    check_shapes(shapes, cfg, f"{what}: params do not match the config")


def _engram_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """Engram's tensors (docs/model.md#engram): per Engram layer its table, ``wkv`` and the gate
    weights (ordered as the layers, after the backbone's), then the compressed token map."""
    specs: dict[str, ParamSpec] = {}
    hd, hc, d = cfg.engram_head_dim, cfg.hc_mult, cfg.dim
    for layer, rows in zip(cfg.engram_layer_ids, cfg.engram_table_rows, strict=True):
        e = f"layers.{layer}.engram."
        specs[e + "embed.weight"] = ParamSpec((rows, hd), Storage.FP8_ROWS, "normal")
        specs[e + "wkv.weight"] = _linear(cfg, (hc + 1) * d, cfg.engram_columns * hd)
        specs[e + "q_weight"] = _bf16(hc, d, init="norm")
        specs[e + "k_weight"] = _bf16(hc, d, init="norm")
    specs["engram.token_map"] = ParamSpec((cfg.vocab_size,), Storage.DERIVED, "token_map")
    return specs


def quantised_weights(cfg: ModelConfig) -> frozenset[str]:
    """Names whose GEMM takes fp8-quantised activations under ``quant_sim`` (fp8 and fp4
    weights). ``wo_a`` is fp8 in the checkpoint but the reference dequantises it to bf16 at
    conversion and runs it as a plain einsum, so it is not in this set."""
    out = set()
    for name, spec in param_specs(cfg).items():
        if spec.storage in (Storage.FP8, Storage.FP4) and not name.endswith("wo_a.weight"):
            out.add(name)
    return frozenset(out)


# -- checkpoint view -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CheckpointTensor:
    """One tensor of the released checkpoint: its name, safetensors dtype and stored shape, and
    where its values live in our params (``param`` name, and the expert index if stacked)."""

    name: str
    dtype: str  # safetensors dtype string: F8_E4M3, F8_E8M0, I8, BF16, F32
    shape: tuple[int, ...]
    param: str
    expert: int | None
    role: str  # "weight" (values) or "scale"
    storage: Storage


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _stored_parts(
    storage: Storage, shape: tuple[int, ...], blk: int
) -> list[tuple[str, tuple[int, ...], str]]:
    """(safetensors dtype, stored shape, role) of each tensor one param of ``shape`` is saved as."""
    if storage is Storage.FP8:
        out, inp = shape
        scale = (_ceil_div(out, blk), _ceil_div(inp, blk))
        return [("F8_E4M3", shape, "weight"), ("F8_E8M0", scale, "scale")]
    if storage is Storage.FP4:
        out, inp = shape
        return [("I8", (out, inp // 2), "weight"), ("F8_E8M0", (out, inp // 32), "scale")]
    if storage is Storage.FP8_ROWS:
        rows, width = shape
        return [("F8_E4M3", shape, "weight"), ("F8_E8M0", (rows, _ceil_div(width, blk)), "scale")]
    if storage is Storage.DERIVED:
        return []
    return [("BF16" if storage is Storage.BF16 else "F32", shape, "weight")]


def checkpoint_tensors(cfg: ModelConfig) -> Iterator[CheckpointTensor]:
    """The released checkpoint's tensors for our params: names, dtypes and stored shapes
    (fp8 weights with their ``.scale`` tiles, packed fp4 experts with per-32 scales)."""
    blk = cfg.fp8_block_size
    for name, spec in param_specs(cfg).items():
        entries: list[tuple[str, tuple[int, ...], int | None]]
        if spec.stacked:
            base, proj = name.rsplit(".experts.", 1)
            entries = [
                (f"{base}.experts.{e}.{proj}", spec.shape[1:], e) for e in range(spec.shape[0])
            ]
        else:
            entries = [(name, spec.shape, None)]
        for tname, shape, expert in entries:
            for dtype, stored, role in _stored_parts(spec.storage, shape, blk):
                tensor = tname if role == "weight" else tname.removesuffix(".weight") + ".scale"
                yield CheckpointTensor(tensor, dtype, stored, name, expert, role, spec.storage)


# -- initialisation --------------------------------------------------------------------------


def _init_one(key: jax.Array, spec: ParamSpec, dtype: jnp.dtype, cfg: ModelConfig) -> jax.Array:
    shape = spec.shape
    kind = spec.init
    if kind == "linear":
        fan_in = shape[-1]
        x = jax.random.normal(key, shape, jnp.float32) / np.sqrt(fan_in)
    elif kind == "embed":
        x = jax.random.normal(key, shape, jnp.float32)
    elif kind == "norm":
        x = 1.0 + 0.1 * jax.random.normal(key, shape, jnp.float32)
    elif kind == "normal":
        x = jax.random.normal(key, shape, jnp.float32)
    elif kind == "bias":
        x = 0.1 * jax.random.normal(key, shape, jnp.float32)
    elif kind == "hc_fn":
        x = jax.random.normal(key, shape, jnp.float32) / np.sqrt(shape[-1])
    elif kind == "hc_base":
        x = 0.5 * jax.random.normal(key, shape, jnp.float32)
    elif kind == "hc_scale":
        x = 0.5 + 0.5 * jax.random.uniform(key, shape, jnp.float32)
    elif kind == "zeros":
        x = jnp.zeros(shape, jnp.float32)
    else:  # pragma: no cover - a spec bug
        raise ValueError(f"unknown init {kind!r}")
    keep_f32 = spec.storage is Storage.F32
    return x if keep_f32 else x.astype(dtype)


def init_params(
    cfg: ModelConfig,
    key: jax.Array | int = 0,
    dtype: jnp.dtype = jnp.float32,
    *,
    token_map: np.ndarray | None = None,
) -> dict[str, jax.Array]:
    """Random params with activations of sensible size at every layer (for tests and the demo).

    Float tensors stored as f32 in the checkpoint (mHC, sinks, gate bias) stay f32; the rest take
    ``dtype``. With Engram layers, ``token_map`` int[vocab_size] is the compressed token map
    (`dsv4.engram_hash.compressed_token_map` of a tokenizer); None = the built-in byte
    tokenizer's (`byte_token_map`)."""
    if isinstance(key, int):
        key = jax.random.PRNGKey(key)
    specs = param_specs(cfg)
    keys = jax.random.split(key, len(specs))
    out = {}
    for k, (name, spec) in zip(keys, specs.items(), strict=True):
        if spec.storage is Storage.DERIVED:
            out[name] = jnp.asarray(
                byte_token_map(cfg) if token_map is None else _given_map(cfg, token_map)
            )
        else:
            out[name] = _init_one(k, spec, jnp.dtype(dtype), cfg)
    return out


def _given_map(cfg: ModelConfig, token_map) -> np.ndarray:
    dead = engram_hash.DEAD
    m = np.asarray(token_map)
    if m.shape != (cfg.vocab_size,) or not np.issubdtype(m.dtype, np.integer):
        raise ValueError(f"token_map must be int[{cfg.vocab_size}], got {m.dtype}{list(m.shape)}")
    if m.size and (m.min() < dead or m.max() >= cfg.engram_compressed_vocab_size):
        raise ValueError(
            f"token_map values span [{m.min()}, {m.max()}]; compressed ids are "
            f"0..{cfg.engram_compressed_vocab_size - 1} or DEAD={dead}"
        )
    return m.astype(np.int32)


def abstract_params(
    cfg: ModelConfig, dtype: jnp.dtype = jnp.float32
) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes and dtypes of `init_params` without allocating (``jax.eval_shape``)."""
    placeholder = np.zeros(cfg.vocab_size, np.int32) if cfg.engram_layer_ids else None
    return jax.eval_shape(
        lambda: init_params(cfg, jax.random.PRNGKey(0), dtype, token_map=placeholder)
    )


def byte_token_map(cfg: ModelConfig) -> np.ndarray:
    """int32[vocab_size]: the Engram compressed token map of the built-in byte tokenizer (what
    random params and checkpoints without a tokenizer.json use), checked against the config."""
    token_map, count = engram_hash.byte_token_map(cfg.vocab_size)
    check_token_map(cfg, token_map, count, "the built-in byte tokenizer")
    return token_map.astype(np.int32)


def check_token_map(cfg: ModelConfig, token_map: np.ndarray, count: int, what: str) -> None:
    """A compressed token map must cover the vocabulary and have the config's number of ids
    (every hash multiplier is derived from it)."""
    if token_map.shape != (cfg.vocab_size,):
        raise ValueError(
            f"{what}: its Engram token map covers {token_map.shape[0]} token ids, the model's "
            f"vocab_size is {cfg.vocab_size}"
        )
    if count != cfg.engram_compressed_vocab_size:
        raise ValueError(
            f"{what} normalises to {count} distinct Engram ids, but the config says "
            f"engram_compressed_vocab_size={cfg.engram_compressed_vocab_size} (a tokenizer other "
            "than the one the tables were trained with?)"
        )


def count_params(cfg: ModelConfig, *, drafter: bool = True) -> int:
    """The model's parameters (dequantised: one per weight), its DSpark drafter's ``mtp.*``
    stages included unless ``drafter=False`` (the backbone alone)."""
    return sum(
        int(np.prod(s.shape))
        for name, s in param_specs(cfg).items()
        if s.storage is not Storage.DERIVED and (drafter or not name.startswith("mtp."))
    )
