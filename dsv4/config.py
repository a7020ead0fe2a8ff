"""Model configuration and the per-layer plan of DeepSeek-V4.1.

`ModelConfig` is one frozen, hashable dataclass (so it can be a static argument under `jax.jit`),
validated on construction. Field names are the official inference names (the keys of the
reference's `inference/config.json`); `ModelConfig.from_dict` also accepts the Hugging Face names
of a checkpoint's `config.json`, including V4.1's nesting of text fields under `text_config`.

`LayerPlan` is derived once from the config: per layer its compress ratio, its role (window-only,
full, reindex, reuse), its kv source, its index source and its part in the two-level candidate
selection. The rules follow the reference and vLLM (`docs/model.md#layer-roles`); every
violation names the layer.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from dsv4.engram_hash import next_prime

__all__ = [
    "MODEL_PRESETS",
    "SHIPPED_DIR",
    "LayerInfo",
    "LayerPlan",
    "ModelConfig",
    "Preset",
    "Role",
    "model_source",
    "tiny_v41",
    "tiny_v41_full",
    "tiny_v41_trained",
    "v41_flash",
]


class Role(enum.Enum):
    """What a layer's attention computes (docs/model.md#layer-roles)."""

    SWA = "swa"  # ratio 0: sliding window only
    FULL = "full"  # kv source (and index source): compressor, caches, own indexer
    REINDEX = "reindex"  # index source only: own indexer over its kv source's index keys
    REUSE = "reuse"  # neither: the latest published top-k over its kv source's cache


# Hugging Face config.json name -> inference name. Names that are the same in both are omitted.
_HF_NAMES = {
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_nextn_predict_layers": "n_mtp_layers",
    "num_attention_heads": "n_heads",
    "moe_intermediate_size": "moe_inter_dim",
    "num_experts_per_tok": "n_activated_experts",
    "scoring_func": "score_func",
    "routed_scaling_factor": "route_scale",
    "rms_norm_eps": "norm_eps",
    "qk_rope_head_dim": "rope_head_dim",
    "sliding_window": "window_size",
    "kv_source_layer_ids": "kv_source_layers",
    "index_source_layer_ids": "index_source_layers",
    "candidate_source_layer_id": "candidate_source_layer",
    "max_position_embeddings": "max_seq_len",
    "dspark_num_experts_per_tok": "dspark_n_activated_experts",
    "engram_pad_token_id": "engram_pad_id",
}
# Keys (inference names) a config must set: they fix the architecture's shapes, and a config
# without them would silently become a default model.
REQUIRED_KEYS = ("vocab_size", "dim", "n_layers", "n_heads", "head_dim", "compress_ratios")
# Keys of a checkpoint config that describe things this package deliberately does not model
# (vision tower, token ids of special spans, HF bookkeeping) or that it reads through other
# paths. They are accepted and ignored; any other unknown key is an error.
_IGNORED_KEYS = frozenset(
    {
        "architectures",
        "model_type",
        "transformers_version",
        "auto_map",
        "vision_config",
        "text_config",
        "quantization_config",
        "rope_scaling",
        "rope_parameters",
        "num_key_value_heads",
        "hidden_act",
        "tie_word_embeddings",
        "topk_method",
        "n_group",
        "topk_group",
        "first_k_dense_replace",
        "initializer_range",
        "use_cache",
        "attention_bias",
        "attention_dropout",
        "pad_token_id",
        "image_token_id",
        "num_hash_layers",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "v_head_dim",
        "moe_layer_freq",
        "ep_size",
        "intermediate_size",
        "max_batch_size",
        "temperature",
        "vision_n_layers",
        "vision_dim",
        "vision_n_heads",
        "vision_inter_dim",
        "vision_patch_size",
        "vision_rope_theta",
        "vision_downsample_ratio",
        "vision_max_n_token",
        "vision_min_pixels",
        "vision_max_wh_ratio",
        "scale_fmt",
    }
)


# The inference config's "dtype" (the reference's ModelArgs): the storage of the weights.
_INFERENCE_DTYPES = ("fp8", "bf16")
# What transformers writes as a config's top-level "dtype" / "torch_dtype" (torch dtype names,
# with or without the "torch." prefix, or "auto"): the torch model's storage dtype.
_TORCH_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "auto")


def _storage_dtype(key: str, value: Any) -> str:
    name = value.removeprefix("torch.") if isinstance(value, str) else value
    if name not in _TORCH_DTYPES:
        raise ValueError(
            f"config {key!r}={value!r} is neither an inference dtype {list(_INFERENCE_DTYPES)} "
            f"nor a torch storage dtype {list(_TORCH_DTYPES)}"
        )
    return name


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The DeepSeek-V4.1 text model. Defaults are the released V4.1-Flash values.

    The vision tower is parsed, not computed (see docs/model.md).
    """

    vocab_size: int = 129280
    dim: int = 5120
    n_layers: int = 40
    n_mtp_layers: int = 3
    n_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_lora_rank: int = 1024
    o_groups: int = 8
    window_size: int = 128
    # one entry per layer, draft layers included: 0 window only, 1 per-token, 2 pairs pooled
    compress_ratios: tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)
    kv_source_layers: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layers: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    candidate_source_layer: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    original_seq_len: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    max_seq_len: int = 1048576
    norm_eps: float = 1e-20
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    moe_inter_dim: int = 2304
    score_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    gate_temp: float = 1.0
    # checkpoint storage: fp8 e4m3 weights with one e8m0 scale per block x block tile; routed
    # experts packed fp4 (e2m1) with one e8m0 scale per 32 inputs
    dtype: str = "fp8"
    expert_dtype: str | None = "fp4"
    fp8_block_size: int = 32
    bos_token_id: int = 0
    eos_token_id: int = 1
    # Engram (docs/model.md#engram): n-gram memory added to the stream before these layers' blocks
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_vocab_size: int = 16000000  # the (n, head) primes are drawn above this - 1
    # table rows per Engram layer: the sum of its primes; () = derive them (a given value
    # must equal the derived one)
    engram_num_embeddings: tuple[int, ...] = (384006168, 384016682)
    engram_max_ngram_size: int = 4
    engram_pad_id: int = 2  # a token id; its compressed id fills look-backs past the start
    engram_compressed_vocab_size: int = 99092  # distinct ids of the compressed token map
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    # the DSpark drafter (docs/model.md#dspark-drafter): n_mtp_layers stages after the backbone
    dspark_block_size: int = 5
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)
    dspark_n_routed_experts: int = 128
    dspark_n_activated_experts: int = 3
    dspark_noise_token_id: int = 128799
    dspark_markov_rank: int = 256
    # reproduce the official reference's quantisation simulation (fp8 activations before fp8/fp4
    # GEMMs, fp8 window latent, FP4 compressed entries and index q/k)
    quant_sim: bool = False

    def __post_init__(self) -> None:
        for name in ("compress_ratios", "kv_source_layers", "index_source_layers"):
            value = getattr(self, name)
            if not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(int(v) for v in value))
        for name in ("engram_layer_ids", "engram_num_embeddings", "dspark_target_layer_ids"):
            value = getattr(self, name)
            if not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(int(v) for v in value))
        self._validate()
        if self.engram_layer_ids and not self.engram_num_embeddings:
            # () asks for the derived table sizes: store them, so both spellings compare equal
            object.__setattr__(self, "engram_num_embeddings", self.engram_table_rows)
        # the plan validates the topology and names the offending layer
        LayerPlan.from_config(self)

    # -- validation --------------------------------------------------------------------------
    def _validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"ModelConfig: {msg}")

        positive = [
            "vocab_size",
            "dim",
            "n_layers",
            "n_heads",
            "head_dim",
            "rope_head_dim",
            "q_lora_rank",
            "o_lora_rank",
            "o_groups",
            "window_size",
            "index_n_heads",
            "index_head_dim",
            "index_topk",
            "max_seq_len",
            "hc_mult",
            "hc_sinkhorn_iters",
            "n_routed_experts",
            "n_activated_experts",
            "moe_inter_dim",
            "fp8_block_size",
        ]
        for name in positive:
            value = getattr(self, name)
            need(
                isinstance(value, int) and not isinstance(value, bool) and value > 0,
                f"{name}={value!r} must be a positive int",
            )
        need(self.n_mtp_layers >= 0, f"n_mtp_layers={self.n_mtp_layers} must be >= 0")
        need(
            self.rope_head_dim % 2 == 0 and self.rope_head_dim <= self.head_dim,
            f"rope_head_dim={self.rope_head_dim} must be even and <= head_dim={self.head_dim}",
        )
        need(
            self.rope_head_dim <= self.index_head_dim,
            f"rope_head_dim={self.rope_head_dim} must be <= index_head_dim={self.index_head_dim}",
        )
        need(
            self.n_heads % self.o_groups == 0,
            f"n_heads={self.n_heads} must be a multiple of o_groups={self.o_groups}",
        )
        need(
            self.n_activated_experts <= self.n_routed_experts,
            f"n_activated_experts={self.n_activated_experts} exceeds "
            f"n_routed_experts={self.n_routed_experts}",
        )
        need(
            self.n_shared_experts == 1,
            f"n_shared_experts={self.n_shared_experts}: exactly one shared expert is supported",
        )
        need(
            self.score_func == "sqrtsoftplus",
            f"score_func={self.score_func!r}: V4.1 uses 'sqrtsoftplus'",
        )
        need(self.dtype in ("fp8", "bf16"), f"dtype={self.dtype!r} must be 'fp8' or 'bf16'")
        need(
            self.expert_dtype in ("fp4", None),
            f"expert_dtype={self.expert_dtype!r} must be 'fp4' or None",
        )
        need(self.norm_eps >= 0, f"norm_eps={self.norm_eps} must be >= 0")
        need(self.gate_temp > 0, f"gate_temp={self.gate_temp} must be > 0")
        need(self.rope_factor >= 1, f"rope_factor={self.rope_factor} must be >= 1")
        need(
            len(self.compress_ratios) >= self.n_layers,
            f"compress_ratios has {len(self.compress_ratios)} entries, fewer than "
            f"n_layers={self.n_layers}",
        )
        if self.candidate_source_layer >= 0:
            need(
                self.candidate_block_size > 0 and self.candidate_topk_blocks > 0,
                f"candidate_source_layer={self.candidate_source_layer} needs "
                f"candidate_block_size > 0 and candidate_topk_blocks > 0 (got "
                f"{self.candidate_block_size}, {self.candidate_topk_blocks})",
            )
        self._validate_engram(need)
        self._validate_dspark(need)
        if self.quant_sim:
            for name, value, block in (
                ("dim", self.dim, self.fp8_block_size),
                ("q_lora_rank", self.q_lora_rank, self.fp8_block_size),
                ("moe_inter_dim", self.moe_inter_dim, 32),
                ("head_dim", self.head_dim, 32),
                ("index_head_dim", self.index_head_dim, 32),
                ("o_groups*o_lora_rank", self.o_groups * self.o_lora_rank, self.fp8_block_size),
            ):
                need(
                    value % block == 0,
                    f"quant_sim needs {name}={value} to be a multiple of {block}",
                )

    def _validate_engram(self, need) -> None:
        ids = self.engram_layer_ids
        if not ids:
            return
        need(
            list(ids) == sorted(set(ids)) and all(0 <= i < self.n_layers for i in ids),
            f"engram_layer_ids={list(ids)} must be sorted, distinct layers of the backbone "
            f"0..{self.n_layers - 1}",
        )
        for name, least in (
            ("engram_vocab_size", 2),
            ("engram_max_ngram_size", 2),
            ("engram_compressed_vocab_size", 1),
            ("engram_n_heads", 1),
            ("engram_head_dim", 32),
        ):
            value = getattr(self, name)
            need(
                isinstance(value, int) and not isinstance(value, bool) and value >= least,
                f"{name}={value!r} must be an int >= {least}",
            )
        need(
            self.engram_head_dim % 32 == 0,
            f"engram_head_dim={self.engram_head_dim} must be a multiple of 32 (one e8m0 scale "
            "per 32 table values)",
        )
        need(
            0 <= self.engram_pad_id < self.vocab_size,
            f"engram_pad_id={self.engram_pad_id} must be a token id in [0, {self.vocab_size})",
        )
        need(
            self.engram_compressed_vocab_size <= self.vocab_size,
            f"engram_compressed_vocab_size={self.engram_compressed_vocab_size} exceeds "
            f"vocab_size={self.vocab_size}",
        )
        primes = _engram_primes(
            len(ids), self.engram_max_ngram_size, self.engram_n_heads, self.engram_vocab_size
        )
        need(
            max(max(layer) for layer in primes) < ENGRAM_MAX_PRIME,
            f"engram_vocab_size={self.engram_vocab_size} needs primes of 2**28 or more; the "
            "hash is computed exactly in 32-bit pieces only below that",
        )
        rows = tuple(sum(layer) for layer in primes)
        if self.engram_num_embeddings:
            need(
                tuple(self.engram_num_embeddings) == rows,
                f"engram_num_embeddings={list(self.engram_num_embeddings)} disagrees with the "
                f"sums of the (n, head) primes above engram_vocab_size - 1: {list(rows)} for "
                f"layers {list(ids)}",
            )

    def _validate_dspark(self, need) -> None:
        if self.n_mtp_layers == 0 or self.dspark_block_size == 0:
            return
        need(
            self.dspark_block_size >= 1,
            f"dspark_block_size={self.dspark_block_size} must be >= 1 (0 = no drafter)",
        )
        t = self.dspark_target_layer_ids
        need(
            len(t) >= 1 and list(t) == sorted(set(t)) and all(0 <= i < self.n_layers for i in t),
            f"dspark_target_layer_ids={list(t)} must be sorted, distinct layers of the backbone "
            f"0..{self.n_layers - 1}",
        )
        need(
            0 <= self.dspark_noise_token_id < self.vocab_size,
            f"dspark_noise_token_id={self.dspark_noise_token_id} must be a token id in [0, "
            f"{self.vocab_size})",
        )
        need(
            0 < self.dspark_n_activated_experts <= self.dspark_n_routed_experts,
            f"dspark_n_activated_experts={self.dspark_n_activated_experts} must be in 1.."
            f"dspark_n_routed_experts={self.dspark_n_routed_experts}",
        )
        need(
            self.dspark_markov_rank > 0, f"dspark_markov_rank={self.dspark_markov_rank} must be > 0"
        )

    # -- derived ---------------------------------------------------------------------------
    @property
    def engram_table_rows(self) -> tuple[int, ...]:
        """Rows of each Engram layer's table (the sums of its (n, head) primes)."""
        if not self.engram_layer_ids:
            return ()
        primes = _engram_primes(
            len(self.engram_layer_ids),
            self.engram_max_ngram_size,
            self.engram_n_heads,
            self.engram_vocab_size,
        )
        return tuple(sum(layer) for layer in primes)

    @property
    def engram_lookback(self) -> int:
        """Tokens before a position that its n-grams read: max_ngram_size - 1 (0 without
        Engram)."""
        return self.engram_max_ngram_size - 1 if self.engram_layer_ids else 0

    @property
    def engram_columns(self) -> int:
        """Table rows each token reads per Engram layer: (max_ngram_size - 1) * n_heads."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    @property
    def plan(self) -> LayerPlan:
        return LayerPlan.from_config(self)

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer] if layer < len(self.compress_ratios) else 0

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # -- parsing ---------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], **overrides: Any) -> ModelConfig:
        """Build from a checkpoint's config.json (HF names, with or without `text_config`) or
        from the reference's inference config (inference names). ``overrides`` win."""
        if not isinstance(raw, Mapping):
            raise TypeError(f"config must be a mapping, got {type(raw).__name__}")
        merged: dict[str, Any] = dict(raw)
        text = raw.get("text_config")
        if isinstance(text, Mapping):
            # V4.1 keeps the text model under text_config; top-level keys (e.g. quantisation)
            # still apply where the nested block does not set them.
            merged.update(text)
        values, storage = _config_values(merged, {f.name for f in dataclasses.fields(cls)})
        missing = [name for name in REQUIRED_KEYS if name not in values and name not in overrides]
        if missing:
            hf = {v: k for k, v in _HF_NAMES.items()}
            named = [f"{n} ({hf[n]})" if n in hf else n for n in missing]
            raise ValueError(
                f"config lacks the keys {named} that define the architecture (no defaults are "
                "assumed for them)"
            )
        _rope_values(merged, values)
        _storage_values(merged, values, text is not None or storage is not None, storage)
        _layout_values(raw, merged, values, cls.n_layers)
        values.update(overrides)
        try:
            return cls(**values)
        except TypeError as exc:  # e.g. a wrong type for a field
            raise ValueError(f"invalid config: {exc}") from exc

    @classmethod
    def from_json(cls, path: str | os.PathLike[str], **overrides: Any) -> ModelConfig:
        """Read ``config.json`` (a file, or a checkpoint directory that holds one)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"{path}: no such file (a checkpoint's config.json)")
        with open(path, encoding="utf-8") as f:
            text = f.read()
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{path}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
            ) from None
        if not isinstance(raw, Mapping):
            raise ValueError(f"{path}: holds a JSON {type(raw).__name__}, not an object")
        try:
            return cls.from_dict(raw, **overrides)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        """Inference names; `from_dict(to_dict())` round-trips."""
        out = dataclasses.asdict(self)
        for k, v in out.items():
            if isinstance(v, tuple):
                out[k] = list(v)
        return out

    def to_hf_dict(self) -> dict[str, Any]:
        """A V4.1-style config.json (text fields under text_config) for checkpoints we write."""
        inv = {v: k for k, v in _HF_NAMES.items()}
        text: dict[str, Any] = {}
        for k, v in self.to_dict().items():
            if k in (
                "quant_sim",
                "dtype",
                "expert_dtype",
                "fp8_block_size",
                "rope_factor",
                "original_seq_len",
                "beta_fast",
                "beta_slow",
            ):
                continue
            text[inv.get(k, k)] = v
        text["rope_scaling"] = {
            "type": "yarn",
            "factor": self.rope_factor,
            "original_max_position_embeddings": self.original_seq_len,
            "beta_fast": self.beta_fast,
            "beta_slow": self.beta_slow,
        }
        text["model_type"] = "deepseek_v41_text"
        out: dict[str, Any] = {
            "architectures": ["DeepseekV41ForCausalLM"],
            "model_type": "deepseek_v41",
            "text_config": text,
        }
        text["expert_dtype"] = self.expert_dtype
        if self.dtype == "fp8":
            out["quantization_config"] = {
                "quant_method": "fp8",
                "activation_scheme": "dynamic",
                "fmt": "e4m3",
                "scale_fmt": "ue8m0",
                "weight_block_size": [self.fp8_block_size, self.fp8_block_size],
                "expert_dtype": self.expert_dtype,
            }
        return out


# -- Engram primes ---------------------------------------------------------------------------

ENGRAM_MAX_PRIME = 1 << 28  # dsv4.engram reduces 64-bit hashes modulo primes below this
_PRIMES_CACHE: dict[tuple[int, int, int, int], tuple[tuple[int, ...], ...]] = {}


def _engram_primes(
    n_layers: int, max_ngram: int, n_heads: int, vocab: int
) -> tuple[tuple[int, ...], ...]:
    """Per Engram layer, its primes in (n, head) order (`dsv4.engram_hash.EngramHashing`)."""
    key = (n_layers, max_ngram, n_heads, vocab)
    if key not in _PRIMES_CACHE:
        taken: set[int] = set()
        out = []
        for _ in range(n_layers):
            layer = []
            for _ in range(max_ngram - 1):
                current = vocab - 1
                for _ in range(n_heads):
                    current = next_prime(current, taken)
                    taken.add(current)
                    layer.append(current)
            out.append(tuple(layer))
        _PRIMES_CACHE[key] = tuple(out)
    return _PRIMES_CACHE[key]


# -- config.json parsing steps (`ModelConfig.from_dict`) ---------------------------------------


def _config_values(
    merged: Mapping[str, Any], fields: set[str]
) -> tuple[dict[str, Any], str | None]:
    """(the keys that name a field, under our names; the torch storage dtype if one is named)."""
    values: dict[str, Any] = {}
    unknown = []
    storage = None  # a torch dtype name from an HF config's "dtype" / "torch_dtype"
    for key, value in merged.items():
        if key in ("dtype", "torch_dtype") and value not in _INFERENCE_DTYPES:
            # transformers writes the torch model's storage dtype under these keys; the
            # quantised formats come from quantization_config and expert_dtype instead
            storage = _storage_dtype(key, value)
            continue
        name = _HF_NAMES.get(key, key)
        if name in fields:
            if name in values and values[name] != value:
                raise ValueError(
                    f"config sets {name!r} twice with different values ({values[name]!r} "
                    f"and {value!r} from {key!r})"
                )
            values[name] = value
        elif key in _IGNORED_KEYS or key.startswith("vision_"):
            continue
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}")
    return values, storage


def _rope_values(merged: Mapping[str, Any], values: dict[str, Any]) -> None:
    """YaRN's fields from ``rope_scaling`` / ``rope_parameters`` (its ``compress`` block if any)."""
    rope = merged.get("rope_scaling") or merged.get("rope_parameters")
    if isinstance(rope, Mapping) and "compress" in rope and isinstance(rope["compress"], Mapping):
        rope = rope["compress"]
    if isinstance(rope, Mapping) and rope.get("type", rope.get("rope_type")) not in (
        None,
        "default",
    ):
        values.setdefault("rope_factor", rope.get("factor", 1.0))
        if "original_max_position_embeddings" in rope:
            values.setdefault("original_seq_len", rope["original_max_position_embeddings"])
        for k in ("beta_fast", "beta_slow"):
            if k in rope:
                values.setdefault(k, rope[k])


def _storage_values(
    merged: Mapping[str, Any], values: dict[str, Any], hf: bool, storage: str | None
) -> None:
    """The weights' formats from ``quantization_config``, else plain weights for an HF config."""
    quant = merged.get("quantization_config")
    if isinstance(quant, Mapping):
        block = quant.get("weight_block_size")
        if block is not None:
            if len(block) != 2 or block[0] != block[1]:
                raise ValueError(f"weight_block_size={block} must be square [B, B]")
            values.setdefault("fp8_block_size", int(block[0]))
        values.setdefault("dtype", "fp8")
        if "expert_dtype" in quant:
            values.setdefault("expert_dtype", quant["expert_dtype"])
    elif "dtype" not in values and hf:
        # an HF config without quantization_config: plain (bf16 / fp16 / fp32) weights
        values.setdefault("dtype", "bf16")
        if storage is not None:
            values.setdefault("expert_dtype", None)


def _layout_values(
    raw: Mapping[str, Any], merged: Mapping[str, Any], values: dict[str, Any], n_layers: int
) -> None:
    """Engram layers, DSpark fields, the candidate defaults, layer tuples and the MTP count."""
    if "engram_layer_ids" in merged:
        values["engram_layer_ids"] = tuple(merged["engram_layer_ids"])
        # a config that names its Engram layers but not their table sizes: derive them
        values.setdefault("engram_num_embeddings", ())
    elif "text_config" in raw or "n_layers" in raw or "num_hidden_layers" in raw:
        values["engram_layer_ids"] = ()
    for key in ("dspark_target_layer_ids", "dspark_block_size"):
        if key in merged:
            values[key] = merged[key]
    if "candidate_source_layer" not in values:
        values["candidate_source_layer"] = -1
        values.setdefault("candidate_topk_blocks", 0)
        values.setdefault("candidate_block_size", 0)
    for key in ("kv_source_layers", "index_source_layers", "compress_ratios"):
        if key in values:
            values[key] = tuple(int(v) for v in values[key])
    if "n_mtp_layers" not in values:
        values["n_mtp_layers"] = max(
            0, len(values.get("compress_ratios", ())) - values.get("n_layers", n_layers)
        )


# -- layer plan ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerInfo:
    layer: int
    ratio: int
    role: Role
    kv_source: int | None  # layer whose compressed cache (and index keys) this layer reads
    index_source: int | None  # layer whose top-k this layer uses (itself for index sources)
    is_candidate_source: bool
    uses_candidates: bool

    @property
    def owns_compressor(self) -> bool:
        return self.role is Role.FULL

    @property
    def owns_indexer(self) -> bool:
        return self.role in (Role.FULL, Role.REINDEX)


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """Per backbone layer: ratio, role and sources (draft layers are not part of the plan)."""

    layers: tuple[LayerInfo, ...]

    def __getitem__(self, layer: int) -> LayerInfo:
        return self.layers[layer]

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self):
        return iter(self.layers)

    def by_role(self, role: Role) -> tuple[int, ...]:
        return tuple(info.layer for info in self.layers if info.role is role)

    def describe(self) -> str:
        """One line per layer, for the demo and for humans."""
        lines = []
        for info in self.layers:
            extra = []
            if info.kv_source is not None and info.kv_source != info.layer:
                extra.append(f"kv<-{info.kv_source}")
            if info.role is Role.REUSE and info.index_source is not None:
                extra.append(f"top-k<-{info.index_source}")
            if info.is_candidate_source:
                extra.append("candidate source")
            if info.uses_candidates:
                extra.append("candidate consumer")
            lines.append(
                f"layer {info.layer:3d}  ratio {info.ratio}  {info.role.value:8s} "
                + " ".join(extra)
            )
        return "\n".join(lines)

    @staticmethod
    def from_config(cfg: ModelConfig) -> LayerPlan:
        return _build_plan(
            cfg.n_layers,
            tuple(cfg.ratio(layer) for layer in range(cfg.n_layers)),
            cfg.kv_source_layers,
            cfg.index_source_layers,
            cfg.candidate_source_layer,
            cfg.candidate_topk_blocks,
            cfg.candidate_block_size,
            cfg.index_topk,
            tuple(cfg.compress_ratios[cfg.n_layers :]),
        )


_PLAN_CACHE: dict[tuple, LayerPlan] = {}


def _build_plan(
    n_layers: int,
    ratios: tuple[int, ...],
    kv_sources: tuple[int, ...],
    index_sources: tuple[int, ...],
    candidate_source: int,
    candidate_topk_blocks: int,
    candidate_block_size: int,
    index_topk: int,
    draft_ratios: tuple[int, ...],
) -> LayerPlan:
    key = (n_layers, ratios, kv_sources, index_sources, candidate_source, draft_ratios)
    if key in _PLAN_CACHE:
        return _PLAN_CACHE[key]
    sources = _PlanSources(n_layers, ratios, kv_sources, index_sources, candidate_source)
    sources.check(draft_ratios)
    plan = LayerPlan(tuple(sources.layer_info(layer) for layer in range(n_layers)))
    _PLAN_CACHE[key] = plan
    return plan


def _plan_error(msg: str) -> NoReturn:
    raise ValueError(f"layer plan: {msg}")


@dataclasses.dataclass(frozen=True)
class _PlanSources:
    """The config's ratios and source layers, checked and turned into per-layer roles."""

    n_layers: int
    ratios: tuple[int, ...]
    kv_sources: tuple[int, ...]
    index_sources: tuple[int, ...]
    candidate_source: int

    def check(self, draft_ratios: tuple[int, ...]) -> None:
        """The ratios and source lists on their own: allowed ratios, sorted in-range sources."""
        fail, ratios, n_layers = _plan_error, self.ratios, self.n_layers
        for layer, r in enumerate(ratios):
            if r not in (0, 1, 2):
                fail(f"layer {layer} has compress ratio {r}; V4.1 allows 0, 1 or 2")
        for layer, r in enumerate(draft_ratios, start=n_layers):
            if r != 0:
                fail(f"draft layer {layer} has compress ratio {r}; draft layers are window-only")
        lists = (("kv_source_layers", self.kv_sources), ("index_source_layers", self.index_sources))
        for name, ids in lists:
            if list(ids) != sorted(set(ids)):
                fail(f"{name}={list(ids)} must be sorted and unique")
            for s in ids:
                if not 0 <= s < n_layers:
                    fail(f"{name} names layer {s}, outside the backbone's layers 0..{n_layers - 1}")
                if ratios[s] == 0:
                    fail(f"layer {s} is in {name} but has compress ratio 0")
        for s in self.kv_sources:
            if s not in self.index_sources:
                fail(
                    f"layer {s} is a kv source but not an index source (nobody would make its keys)"
                )
        if self.candidate_source >= 0 and self.candidate_source not in self.kv_sources:
            fail(f"candidate source layer {self.candidate_source} must be a kv source")

    def layer_info(self, layer: int) -> LayerInfo:
        """One layer's role and sources, checked against its sources' ratios."""
        fail, ratios, cand = _plan_error, self.ratios, self.candidate_source
        kv_sources, index_sources = self.kv_sources, self.index_sources
        r = ratios[layer]
        if r == 0:
            return LayerInfo(
                layer=layer,
                ratio=0,
                role=Role.SWA,
                kv_source=None,
                index_source=None,
                is_candidate_source=False,
                uses_candidates=False,
            )
        kv = max((s for s in kv_sources if s <= layer), default=None)
        idx = max((s for s in index_sources if s <= layer), default=None)
        if kv is None:
            fail(f"layer {layer} has compress ratio {r} but no kv source at or below it")
        if idx is None:
            fail(f"layer {layer} has compress ratio {r} but no index source at or below it")
        if ratios[kv] != r:
            fail(f"layer {layer} has ratio {r} but its kv source {kv} has ratio {ratios[kv]}")
        if ratios[idx] != r:
            fail(f"layer {layer} has ratio {r} but its index source {idx} has ratio {ratios[idx]}")
        # the top-k a reuse layer inherits is the latest one any index source published; it
        # must come from an index source over the same kv source
        if idx < kv:
            fail(
                f"layer {layer}: its latest index source {idx} precedes its kv source {kv}, "
                "so the top-k it would reuse indexes another cache"
            )
        if layer in kv_sources:
            role = Role.FULL
        elif layer in index_sources:
            role = Role.REINDEX
        else:
            role = Role.REUSE
        uses = layer in index_sources and 0 <= cand < layer
        if uses and ratios[cand] != r:
            fail(
                f"layer {layer} consumes candidates of layer {cand} but its ratio "
                f"{r} differs from the candidate source's {ratios[cand]}"
            )
        if uses and kv != max(s for s in kv_sources if s <= layer and s >= cand):
            fail(f"layer {layer} consumes candidates but reads a different kv source ({kv})")
        return LayerInfo(
            layer=layer,
            ratio=r,
            role=role,
            kv_source=kv,
            index_source=idx,
            is_candidate_source=layer == cand,
            uses_candidates=uses,
        )


# -- presets ---------------------------------------------------------------------------------


def v41_flash(**overrides: Any) -> ModelConfig:
    """DeepSeek-V4.1-Flash as released (dba1be0a): 40 backbone layers + 3 DSpark stages."""
    return ModelConfig(**overrides)


def tiny_v41(**overrides: Any) -> ModelConfig:
    """A small V4.1 that covers every role (`docs/model.md#the-tiny-test-topology`):

    layer 0 window-only; 1 full r=2 (dense indexer); 2 reuse r=2; 3 full r=1 and candidate
    source; 4 reuse r=1; 5 reindex and candidate consumer; 6 reuse of 5's top-k; 7 window-only;
    plus one window-only draft layer (parsed, not computed). With window 8, top-k 16 and
    candidate blocks of 4 x 8, prompts of 40-80 tokens reach every sparse regime.
    """
    fields: dict[str, Any] = dict(
        vocab_size=512,
        dim=64,
        n_layers=8,
        n_mtp_layers=1,
        n_heads=4,
        head_dim=64,
        rope_head_dim=16,
        q_lora_rank=32,
        o_lora_rank=32,
        o_groups=2,
        window_size=8,
        compress_ratios=(0, 2, 2, 1, 1, 1, 1, 0, 0),
        kv_source_layers=(1, 3),
        index_source_layers=(1, 3, 5),
        candidate_source_layer=3,
        candidate_topk_blocks=8,
        candidate_block_size=4,
        index_n_heads=4,
        index_head_dim=32,
        index_topk=16,
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        rope_factor=4.0,
        original_seq_len=64,
        beta_fast=32.0,
        beta_slow=1.0,
        max_seq_len=512,
        norm_eps=1e-6,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        hc_eps=1e-6,
        n_routed_experts=8,
        n_shared_experts=1,
        n_activated_experts=2,
        moe_inter_dim=64,
        engram_layer_ids=(),
        dspark_block_size=0,
        dspark_target_layer_ids=(),
        dspark_n_routed_experts=8,
        dspark_n_activated_experts=2,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


# The small DSpark drafter both drafting tiny presets carry: it reads layers 5-7, with 8 routed
# experts of which 2 active and a Markov rank of 16.
_TINY_DRAFTER: dict[str, Any] = dict(
    dspark_target_layer_ids=(5, 6, 7),
    dspark_markov_rank=16,
    dspark_n_routed_experts=8,
    dspark_n_activated_experts=2,
)


def tiny_v41_trained(*, drafter: bool = True, **overrides: Any) -> ModelConfig:
    """`tiny_v41` at width 128 with 16 routed experts (2 active), the config of the shipped
    weights trained on the standard library's source (docs/trained_model.md says how and what).

    With ``drafter`` (the shipped checkpoint's config) a 2-stage DSpark drafter drafts blocks of
    5 with the padding id as its noise token; ``drafter=False`` is the backbone alone, the config
    `training.train` trains.
    """
    fields: dict[str, Any] = dict(
        vocab_size=2048,
        dim=128,
        moe_inter_dim=128,
        q_lora_rank=64,
        o_lora_rank=64,
        window_size=16,
        index_topk=16,
        candidate_block_size=4,
        candidate_topk_blocks=8,
        n_routed_experts=16,
        original_seq_len=256,
        max_seq_len=1024,
    )
    if drafter:
        fields.update(
            n_mtp_layers=2,
            compress_ratios=(0, 2, 2, 1, 1, 1, 1, 0, 0, 0),
            dspark_block_size=5,
            dspark_noise_token_id=2,
            **_TINY_DRAFTER,
        )
    fields.update(overrides)
    return tiny_v41(**fields)


def tiny_v41_full(**overrides: Any) -> ModelConfig:
    """`tiny_v41` with the rest of V4.1: Engram on layer 1 (a kv source, ratio 2) and layer 4 (a
    reuse layer, ratio 1), 2 heads of 32 values, n-grams up to 4, small primes (above 63: tables
    of 462 and 630 rows) and the compressed vocabulary of the built-in byte tokenizer (230 ids;
    token ids past its 259 are DEAD); and a 3-stage DSpark drafter (blocks of 3, noise id 500)
    reading layers 5, 6 and 7, with 8 experts of which 2 active and a Markov rank of 16."""
    fields: dict[str, Any] = dict(
        n_mtp_layers=3,
        compress_ratios=(0, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
        engram_layer_ids=(1, 4),
        engram_vocab_size=64,
        engram_num_embeddings=(),
        engram_max_ngram_size=4,
        engram_n_heads=2,
        engram_head_dim=32,
        engram_compressed_vocab_size=230,
        engram_pad_id=2,
        dspark_block_size=3,
        dspark_noise_token_id=500,
        **_TINY_DRAFTER,
    )
    fields.update(overrides)
    return tiny_v41(**fields)


@dataclasses.dataclass(frozen=True)
class Preset:
    """A model name: its config builder (keyword overrides win) and where its weights come from:
    ``"random"`` (seeded `dsv4.init_params`), ``"shipped"`` (a checkpoint inside the package,
    `dsv4.checkpoint.shipped_checkpoint`), or None (a released checkpoint you supply)."""

    config: Callable[..., ModelConfig]
    weights: str | None = None


# The one table of model names: the planner (`planner.plan.MODELS`), the shipped checkpoints
# (`dsv4.checkpoint.SHIPPED`, which `load_pretrained` accepts by name), `serving.config` (`LLM`)
# and the CLI read it (this module imports no JAX, so the CLI reads it before JAX starts).
MODEL_PRESETS: dict[str, Preset] = {
    "v41_flash": Preset(v41_flash),
    "tiny_v41": Preset(tiny_v41, "random"),
    "tiny_v41_full": Preset(tiny_v41_full, "random"),
    "tiny_v41_trained": Preset(tiny_v41_trained, "shipped"),
}


# Where the "shipped" presets' checkpoints live (inside the package, `dsv4/weights/<name>`).
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "weights")


def model_source(model: Any) -> tuple[str, str | None]:
    """The one resolver of model names every entry point uses (`load_pretrained`, `LLM`, the
    CLI): ``("random", None)`` for a random-weight preset of `MODEL_PRESETS`, ``("checkpoint",
    directory)`` for a shipped preset or a checkpoint directory (one with a config.json).

    Raises:
        ValueError: ``model`` is neither, naming it, the accepted names, and what is wrong
            (a released preset without weights, no such folder, a folder without config.json).
    """
    if not isinstance(model, str | os.PathLike):
        raise TypeError(f"model={model!r} must be a model name or a checkpoint directory")
    name = os.fspath(model)
    preset = MODEL_PRESETS.get(name)
    if preset is not None and preset.weights == "random":
        return "random", None
    if preset is not None and preset.weights == "shipped":
        return "checkpoint", os.path.join(SHIPPED_DIR, name)
    names = ", ".join(n for n, p in MODEL_PRESETS.items() if p.weights is not None)
    if preset is not None:
        raise ValueError(
            f"model={name!r} is a config without weights here: give its checkpoint directory "
            f"(released format), or one of {names}"
        )
    if not os.path.isdir(name):
        raise ValueError(
            f"model={name!r} is not allowed: no such directory; give a checkpoint directory or "
            f"one of {names}"
        )
    if not os.path.isfile(os.path.join(name, "config.json")):
        raise ValueError(
            f"model={name!r} is not allowed: the directory has no config.json (not a "
            f"checkpoint); give a checkpoint directory or one of {names}"
        )
    return "checkpoint", name


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def rope_inv_freq(cfg: ModelConfig, ratio: int) -> tuple[float, ...]:
    """Inverse frequencies of one layer's rotary table (plain for ratio 0, YaRN otherwise)."""
    dim = cfg.rope_head_dim
    if ratio == 0:
        base, orig = cfg.rope_theta, 0
    else:
        base, orig = cfg.compress_rope_theta, cfg.original_seq_len
    freqs = [1.0 / (base ** (i / dim)) for i in range(0, dim, 2)]
    if orig > 0 and cfg.rope_factor != 1.0:

        def corrected(rotations: float) -> float:
            return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corrected(cfg.beta_fast)), 0)
        high = min(math.ceil(corrected(cfg.beta_slow)), dim - 1)
        out = []
        for i, f in enumerate(freqs):
            ramp = min(max((i - low) / max(high - low, 1e-3), 0.0), 1.0)
            smooth = 1.0 - ramp
            out.append(f / cfg.rope_factor * (1 - smooth) + f * smooth)
        freqs = out
    return tuple(freqs)
