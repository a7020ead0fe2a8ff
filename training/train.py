"""Training DeepSeek-V4.1 from scratch: next-token loss, the sparse indexer's KL loss, AdamW.

The forward (`train_forward`) is the reference's math (`dsv4.reference.forward`, whose logits the
tests compare it with) rearranged for speed and extended with what training needs:

* attention gathers each query's window keys ``[B, T, window, d]`` and, in the sparse stage, its
  selected compressed entries ``[B, T, index_topk, d]``, instead of masking all T + N keys of a
  broadcast ``[B, T, T + N, d]`` array: one softmax over the same union (window, selected
  entries, sink), at a small fraction of the cost; the routed experts run on their own tokens
  only (`dsv4.layers.moe` with ``tile``), and the mHC mixes use the layouts that suit
  thousands of tokens (``many_tokens``). On two CPU cores the loss gradient of the first
  `tiny_v41_trained` (width 64, 2.3M parameters) on 8 windows of 256 tokens took about 1.1 s
  this way and 3.9 s through `reference.forward`;
* the *dense* mode attends to every visible compressed entry (no top-k, no candidate blocks):
  the reference with ``index_topk`` and ``candidate_topk_blocks`` at least the number of entries
  and blocks (`dense_config`);
* every index source (full and reindex layers) yields its indexer loss (DSA training,
  `docs/model.md#training-the-indexer`): per query t, ``KL(p_t || softmax(I_t))`` over a set
  of compressed entries, where ``p_t`` is the layer's main attention probability on each entry,
  summed over heads and L1-normalised over the set, and ``I_t`` the indexer's scores. The set is
  every visible entry in the dense mode and the layer's selected top-k in the sparse mode.
  ``p_t`` is under stop_gradient, and the indexer reads stop-gradiented inputs (the normed
  hidden state, the query latent, the compressor latent): the indexer loss reaches only the
  indexer's own weights (``attn.indexer.*``);
* the selection (candidate blocks and top-k) reads stop-gradiented scores and yields integers
  and masks: the language-modelling loss reaches the indexer through nothing, and flows into the
  main model only through the selected entries.

Training has two stages (`TrainConfig.dense_steps`): a dense warm-up in which only the indexer
trains (the main model is frozen and attention is dense), then the sparse stage in which both
train, each from its own loss: the main weights from ``lm_weight * LM loss``, the indexer from
``indexer_weight * indexer loss``. Each group has its own AdamW (optax) with its own warm-up +
cosine schedule and global-norm clipping (the two losses' gradients have unrelated scales, so a
joint norm would let one throttle the other). The main schedule runs over the sparse stage, the
indexer's over the whole run.

`TrainState` (params, both optimizer states, step, data position, rng) is what a checkpoint
holds (orbax, one directory per saved step); `train` resumes from the newest one and continues
bit for bit as if never stopped (the batch of step i depends only on the seed and i).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from dsv4 import layers as L
from dsv4.block import decoder_layers
from dsv4.config import ModelConfig, Role
from dsv4.params import init_params
from dsv4.reference import Shared, engram_rows, sequence_entries
from training import data as D

__all__ = [
    "OptimizerConfig",
    "TrainConfig",
    "TrainState",
    "cross_entropy",
    "dense_config",
    "evaluate",
    "init_state",
    "is_indexer_param",
    "latest_checkpoint",
    "losses",
    "optimizer",
    "prune_checkpoints",
    "restore_state",
    "save_state",
    "seq_len_multiple",
    "train",
    "train_forward",
    "train_step",
]

Params = dict[str, jax.Array]
_sg = jax.lax.stop_gradient


# -- configuration ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW over a warm-up + cosine schedule with global-norm clipping (`optimizer`): the
    fields `TrainConfig` and `training.dspark.DraftTrainConfig` share."""

    learning_rate: float = 3e-3  # peak of warm-up + cosine
    warmup_steps: int = 100  # linear warm-up of each schedule (capped at its length - 1)
    min_lr_ratio: float = 0.1  # the cosine ends at this fraction of the peak
    weight_decay: float = 0.1  # AdamW decay of matrices (ndim >= 2); none on norms, sinks, biases
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_norm: float = 1.0  # global-norm clipping, per parameter group; 0 = off


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig(OptimizerConfig):
    """One training run. Hashable (a static argument of the jitted step); validated on
    construction, each error naming the value.

    Steps are optimizer steps of ``batch_size`` sequences of ``seq_len`` input tokens (each
    window holds ``seq_len + 1`` tokens: inputs and their next tokens)."""

    steps: int  # total optimizer steps, both stages
    batch_size: int  # sequences per step
    seq_len: int  # input tokens per sequence
    seed: int = 0  # params init and data order
    dense_steps: int = 0  # steps of the dense warm-up (indexer only, main model frozen)
    # (`OptimizerConfig`'s learning_rate is the main weights' peak, over the sparse stage)
    indexer_learning_rate: float = 1e-3  # indexer: peak of warm-up + cosine over all steps
    lm_weight: float = 1.0  # weight of the next-token loss (trains the main weights)
    indexer_weight: float = 1.0  # weight of the indexer KL loss (trains the indexer weights)
    # DeepSeek-V3's auxiliary-loss-free balancing: after each sparse step every router bias
    # moves by this much towards balance (up for experts below the mean load, down above it)
    router_bias_rate: float = 1e-3
    moe_tile: int = 128  # rows per expert tile in the training MoE (speed only, not the math)
    param_dtype: str = "float32"  # "float32" or "bfloat16" params (mHC, sinks, biases stay f32)

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"TrainConfig: {msg}")

        for name in ("steps", "batch_size", "seq_len", "moe_tile"):
            v = getattr(self, name)
            need(
                isinstance(v, int) and not isinstance(v, bool) and v > 0,
                f"{name}={v!r} must be a positive int",
            )
        for name in ("dense_steps", "warmup_steps", "seed"):
            v = getattr(self, name)
            need(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                f"{name}={v!r} must be an int >= 0",
            )
        need(
            self.dense_steps < self.steps,
            f"dense_steps={self.dense_steps} must be < steps={self.steps} (the sparse stage "
            "needs at least one step)",
        )
        for name in ("learning_rate", "indexer_learning_rate", "adam_eps"):
            v = getattr(self, name)
            need(math.isfinite(v) and v > 0, f"{name}={v!r} must be > 0")
        for name in (
            "weight_decay",
            "clip_norm",
            "lm_weight",
            "indexer_weight",
            "router_bias_rate",
        ):
            v = getattr(self, name)
            need(math.isfinite(v) and v >= 0, f"{name}={v!r} must be >= 0")
        need(0 <= self.min_lr_ratio <= 1, f"min_lr_ratio={self.min_lr_ratio!r} must be in [0, 1]")
        for name in ("beta1", "beta2"):
            v = getattr(self, name)
            need(0 <= v < 1, f"{name}={v!r} must be in [0, 1)")
        need(
            self.param_dtype in ("float32", "bfloat16"),
            f"param_dtype={self.param_dtype!r} must be 'float32' or 'bfloat16'",
        )

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def seq_len_multiple(cfg: ModelConfig) -> int:
    """What ``seq_len`` must be a multiple of: every compress ratio of the model, so that each
    training window ends on a complete compressor group of every layer."""
    ratios = [info.ratio for info in cfg.plan if info.ratio]
    return math.lcm(*ratios) if ratios else 1


def check_trainable(cfg: ModelConfig, tcfg: TrainConfig) -> None:
    """Raise ValueError if the model ``cfg`` cannot be trained with ``tcfg``: windows that do not
    fit it, or the quantisation simulation (a released checkpoint's numerics; training runs
    plain float math and the released formats are written afterwards)."""
    if cfg.quant_sim:
        raise ValueError("quant_sim=True: training runs float math; train with quant_sim=False")
    m = seq_len_multiple(cfg)
    if tcfg.seq_len % m:
        raise ValueError(
            f"seq_len={tcfg.seq_len} must be a multiple of {m} (the model's compress ratios "
            f"{sorted({i.ratio for i in cfg.plan if i.ratio})})"
        )
    if tcfg.seq_len > cfg.max_seq_len:
        raise ValueError(
            f"seq_len={tcfg.seq_len} exceeds the model's max_seq_len={cfg.max_seq_len}"
        )


def dense_config(cfg: ModelConfig, seq_len: int) -> ModelConfig:
    """``cfg`` whose top-k and candidate blocks keep every visible entry of ``seq_len``-token
    sequences: `reference.forward` under it is the dense attention of the warm-up stage."""
    blocks = -(-seq_len // cfg.candidate_block_size) if cfg.candidate_block_size else 0
    return cfg.replace(
        index_topk=max(cfg.index_topk, seq_len),
        candidate_topk_blocks=max(cfg.candidate_topk_blocks, blocks),
    )


# -- params groups ---------------------------------------------------------------------------


def is_indexer_param(name: str) -> bool:
    """True for the lightning indexer's weights (``layers.L.attn.indexer.*``): the weights the
    indexer loss trains, and the only ones the dense warm-up trains."""
    return ".attn.indexer." in name


def _split(params: Mapping[str, jax.Array]) -> tuple[Params, Params, Params]:
    """(indexer, main, constant) params: float indexer weights, other float weights, and the
    non-float leaves (the Engram token map), which nothing trains."""
    indexer, main, const = {}, {}, {}
    for name, x in params.items():
        if not jnp.issubdtype(x.dtype, jnp.floating):
            const[name] = x
        elif is_indexer_param(name):
            indexer[name] = x
        else:
            main[name] = x
    return indexer, main, const


# -- the training forward --------------------------------------------------------------------


def _union_attention(q, win_keys, win_mask, comp_keys, comp_mask, sink, scale):
    """`dsv4.layers.sink_attention` over window keys, compressed keys and the sink, with the
    two key sets kept apart so that neither is broadcast over the queries. q [B, T, H, d];
    win_keys [B, T, w, d], win_mask [B, T, w]; comp_keys [B, T, k, d] or [B, N, d], comp_mask
    [B, T, k] or [B, T, N], or both None (window-only). Returns (out f32 [B, T, H, d], the
    compressed keys' probabilities f32 [B, T, H, k or N])."""
    f32 = jnp.float32
    logits = [jnp.einsum("bthd,btwd->bthw", q, win_keys, preferred_element_type=f32)]
    masks = [win_mask]
    if comp_keys is not None:
        spec = "bthd,bnd->bthn" if comp_keys.ndim == 3 else "bthd,btnd->bthn"
        logits.append(jnp.einsum(spec, q, comp_keys, preferred_element_type=f32))
        masks.append(comp_mask)
    w = win_keys.shape[2]
    p, pv, denom = L.sink_softmax(
        jnp.concatenate(logits, axis=-1), jnp.concatenate(masks, axis=-1), sink, scale, q.dtype
    )
    out = jnp.einsum("bthw,btwd->bthd", pv[..., :w], win_keys.astype(f32))
    if comp_keys is not None:
        spec = "bthn,bnd->bthd" if comp_keys.ndim == 3 else "bthn,btnd->bthd"
        out = out + jnp.einsum(spec, pv[..., w:], comp_keys.astype(f32))
    return out / denom, p[..., w:] / denom


def _indexer_kl(
    scores: jax.Array, probs: jax.Array, mask: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """(sum over rows of KL(p || softmax(scores)), number of rows) over the entries of ``mask``.

    scores f32 [B, T, n] (the indexer's; finite where ``mask``), probs f32 [B, T, H, n] (the
    main attention's, any scale: summed over heads and L1-normalised over the mask here, under
    stop_gradient), mask bool [B, T, n]. Rows whose set is empty or carries no attention count
    for nothing."""
    p = _sg(jnp.sum(jnp.where(mask[:, :, None, :], probs, 0.0), axis=2))
    total = jnp.sum(p, axis=-1, keepdims=True)
    row = mask.any(axis=-1) & (total[..., 0] > 0)
    p = p / jnp.where(total > 0, total, 1.0)
    s = jnp.where(mask, scores, -1e30)  # finite: no inf - inf in the row's log-normaliser
    logq = s - jax.nn.logsumexp(s, axis=-1, keepdims=True)
    safe_p = jnp.where(p > 0, p, 1.0)
    terms = jnp.where(mask & (p > 0), p * (jnp.log(safe_p) - logq), 0.0)
    return jnp.sum(jnp.where(row, jnp.sum(terms, axis=-1), 0.0)), jnp.sum(row)


def _attention(x, params, layer: int, cfg: ModelConfig, shared: Shared, dense: bool):
    """One layer's attention (the reference's), the updated `Shared`, and, for an index
    source, its indexer loss terms (sum, rows), else None."""
    info = cfg.plan[layer]
    a = f"layers.{layer}.attn."
    b, t, _ = x.shape
    r = info.ratio
    w = cfg.window_size
    pos = jnp.arange(t)
    cos, sin = L.rope_tables(cfg, r, pos)
    qr, q, kv = L.query_and_latent(x, params, a, cfg, cos, sin, qdq_latent=cfg.quant_sim)
    win = pos[:, None] - jnp.arange(w)  # [T, w]: positions t, t-1, .., t-w+1
    win_mask = jnp.broadcast_to(win >= 0, (b, t, w))
    win_keys = kv[:, jnp.maximum(win, 0)]  # [B, T, w, hd]
    sink = params[a + "attn_sink"]
    scale = cfg.head_dim**-0.5
    n = t // r if r else 0
    kl = None
    if not (r and n > 0):
        o, _ = _union_attention(q, win_keys, win_mask, None, None, sink, scale)
        return L.attention_output(o.astype(x.dtype), cos, sin, params, a, cfg), shared, kl
    visible = jnp.broadcast_to((pos + 1) // r, (b, t))
    if info.role is Role.FULL:
        k, c = sequence_entries(x, params, a, r, cfg, detach_keys=True)
        shared = shared._replace(
            index_keys={**shared.index_keys, layer: k}, compressed={**shared.compressed, layer: c}
        )
    scores = None
    if info.owns_indexer:
        qi, wi = L.index_query(_sg(x), _sg(qr), params, a, cfg, cos, sin)
        scores = L.index_scores(qi, wi, shared.index_keys[info.kv_source], visible)  # [B, T, n]
        topk, candidates = L.select_entries(_sg(scores), visible, info, cfg, shared.candidates)
        shared = shared._replace(topk=topk, candidates=candidates)
    comp = shared.compressed[info.kv_source]
    if dense:
        comp_mask = jnp.arange(n) < visible[..., None]  # [B, T, n]
        o, probs = _union_attention(q, win_keys, win_mask, comp, comp_mask, sink, scale)
        if scores is not None:
            kl = _indexer_kl(scores, probs, comp_mask)
    else:
        sel = shared.topk  # [B, T, k], -1 = no entry
        ok = sel >= 0
        picked = jax.vmap(lambda c, s: c[s])(comp, jnp.maximum(sel, 0))  # [B, T, k, hd]
        o, probs = _union_attention(q, win_keys, win_mask, picked, ok, sink, scale)
        if scores is not None:
            at = jnp.take_along_axis(scores, jnp.maximum(sel, 0), axis=-1)
            kl = _indexer_kl(at, probs, ok)
    return L.attention_output(o.astype(x.dtype), cos, sin, params, a, cfg), shared, kl


def train_forward(
    params, cfg: ModelConfig, tokens: jax.Array, *, dense: bool = False, moe_tile: int = 128
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(logits f32[B, T, vocab], indexer loss f32[], expert load int32[n_layers, experts]) of
    tokens int32[B, T] at positions 0..T-1: `reference.forward`'s logits (under `dense_config`
    with ``dense``) and the indexer's mean KL loss (module docstring), whose gradient reaches
    only ``attn.indexer.*``. ``moe_tile``: rows per expert tile (`dsv4.layers.moe`), for speed.
    """
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be int32[B, T], got shape {tokens.shape}")
    rows = engram_rows(params, cfg, tokens) if cfg.engram_layer_ids else None

    def attention(layer, h, state):
        shared, kl_sum, kl_rows, loads = state
        y, shared, kl = _attention(h, params, layer, cfg, shared, dense)
        if kl is not None:
            kl_sum, kl_rows = kl_sum + kl[0], kl_rows + kl[1]
        return y, (shared, kl_sum, kl_rows, loads)

    def ffn(layer, h, state):
        y, load = L.moe(h, params, f"layers.{layer}.ffn.", cfg, tile=moe_tile, return_load=True)
        return y, (*state[:3], (*state[3], load))

    state = (Shared({}, {}), jnp.float32(0.0), jnp.int32(0), ())
    h, (_, kl_sum, kl_rows, loads), _ = decoder_layers(
        params, cfg, tokens, attention, state, engram_rows=rows, ffn=ffn, many_tokens=True
    )
    return L.lm_head(params, h), kl_sum / jnp.maximum(kl_rows, 1), jnp.stack(loads)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token loss in nats: logits f32[B, T, V], targets int32[B, T]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def losses(
    params, cfg: ModelConfig, windows: jax.Array, *, dense: bool = False, moe_tile: int = 128
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(LM loss, indexer loss, expert load) of windows int32[B, T + 1] (`train_forward`): the
    model reads ``windows[:, :-1]`` and predicts ``windows[:, 1:]``."""
    logits, kl, load = train_forward(params, cfg, windows[:, :-1], dense=dense, moe_tile=moe_tile)
    return cross_entropy(logits, windows[:, 1:]), kl, load


# -- optimizer and state ----------------------------------------------------------------------


def _schedule(peak: float, length: int, tcfg: TrainConfig) -> optax.Schedule:
    """Learning rate of step i (0-based) of ``length``: ``peak * (i + 1) / warmup`` for the
    first ``warmup`` steps (so step 0 already learns), then a cosine from ``peak`` to ``peak *
    min_lr_ratio`` reached at the last step."""
    warmup = min(tcfg.warmup_steps, length - 1)
    end = peak * tcfg.min_lr_ratio

    def lr(count):
        i = jnp.asarray(count, jnp.float32)
        done = jnp.clip((i - warmup) / max(length - 1 - warmup, 1), 0.0, 1.0)
        cosine = end + (peak - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * done))
        return jnp.where(i < warmup, peak * (i + 1) / max(warmup, 1), cosine)

    return lr


def optimizer(peak: float, length: int, tcfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW with `_schedule`'s warm-up + cosine to ``peak`` over ``length`` steps, weight
    decay on matrices only, and global-norm clipping (``tcfg``'s betas, eps, decay, clip)."""

    def decay_mask(p):
        return {k: v.ndim >= 2 for k, v in p.items()}

    adamw = optax.adamw(
        _schedule(peak, length, tcfg),
        b1=tcfg.beta1,
        b2=tcfg.beta2,
        eps=tcfg.adam_eps,
        weight_decay=tcfg.weight_decay,
        mask=decay_mask,
    )
    if tcfg.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(tcfg.clip_norm), adamw)
    return adamw


def _optimizers(tcfg: TrainConfig):
    """(main, indexer) optimizers: the main one counts only sparse-stage steps."""
    main = optimizer(tcfg.learning_rate, tcfg.steps - tcfg.dense_steps, tcfg)
    indexer = optimizer(tcfg.indexer_learning_rate, tcfg.steps, tcfg)
    return main, indexer


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything a run needs to continue bit for bit (what a checkpoint holds)."""

    params: Params  # checkpoint names -> arrays
    main_opt: Any  # optax state of the main weights
    indexer_opt: Any  # optax state of the indexer weights
    step: jax.Array  # int32[]: optimizer steps done
    data_position: jax.Array  # int32[]: batches drawn from the data so far
    rng: jax.Array  # uint32[2]: a key advanced once per step, for stochastic parts of a step


def init_state(cfg: ModelConfig, tcfg: TrainConfig, params: Params | None = None) -> TrainState:
    """Step 0: ``params`` or random ones (`init_params` with ``tcfg.seed``), fresh optimizers.

    The arrays are committed to the default device, as restored ones are, so that a fresh and a
    resumed run hit the same compiled step."""
    check_trainable(cfg, tcfg)
    key, rng = jax.random.split(jax.random.PRNGKey(tcfg.seed))
    if params is None:
        params = init_params(cfg, key, jnp.dtype(tcfg.param_dtype))
    indexer, main, _ = _split(params)
    main_opt, indexer_opt = _optimizers(tcfg)
    state = TrainState(
        params=dict(params),
        main_opt=main_opt.init(main),
        indexer_opt=indexer_opt.init(indexer),
        step=jnp.int32(0),
        data_position=jnp.int32(0),
        rng=rng,
    )
    return jax.device_put(state, jax.devices()[0])


def _update(opt, grads, opt_state, params):
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def _balance_routers(main: Params, load: jax.Array, rate: float) -> Params:
    """Router biases moved by ``rate`` towards balance: down for the experts of a layer that got
    more than the mean load this step, up for those below it (DeepSeek-V3, auxiliary-loss-free
    balancing). The biases steer the top-k only, so no gradient ever moves them."""
    if rate == 0:
        return main
    out = dict(main)
    for layer in range(load.shape[0]):
        name = f"layers.{layer}.ffn.gate.bias"
        lf = load[layer].astype(jnp.float32)
        out[name] = (main[name] + rate * jnp.sign(jnp.mean(lf) - lf)).astype(main[name].dtype)
    return out


def _step(state: TrainState, windows: jax.Array, cfg: ModelConfig, tcfg: TrainConfig, dense: bool):
    main_opt, indexer_opt = _optimizers(tcfg)
    indexer, main, const = _split(state.params)

    def objective(indexer, main):
        lm, kl, load = losses(
            {**const, **main, **indexer}, cfg, windows, dense=dense, moe_tile=tcfg.moe_tile
        )
        return tcfg.lm_weight * lm + tcfg.indexer_weight * kl, (lm, kl, load)

    if dense:  # the main model is frozen: differentiate the indexer only
        (_, (lm, kl, load)), g_indexer = jax.value_and_grad(objective, has_aux=True)(indexer, main)
        g_main = None
    else:
        (_, (lm, kl, load)), (g_indexer, g_main) = jax.value_and_grad(
            objective, argnums=(0, 1), has_aux=True
        )(indexer, main)
        main, main_state = _update(main_opt, g_main, state.main_opt, main)
        main = _balance_routers(main, load, tcfg.router_bias_rate)
    indexer, indexer_state = _update(indexer_opt, g_indexer, state.indexer_opt, indexer)
    rng, _ = jax.random.split(state.rng)
    new = TrainState(
        params={**const, **main, **indexer},
        main_opt=state.main_opt if dense else main_state,
        indexer_opt=indexer_state,
        step=state.step + 1,
        data_position=state.data_position + 1,
        rng=rng,
    )
    metrics = {
        "lm_loss": lm,
        "indexer_loss": kl,
        # the busiest expert's share of the assignments over a balanced share (1 = balanced)
        "max_expert_load": jnp.max(load) * load.shape[1] / jnp.maximum(jnp.sum(load[0]), 1),
        "grad_norm_indexer": optax.tree.norm(g_indexer),
        "grad_norm_main": optax.tree.norm(g_main) if g_main is not None else jnp.float32(0),
    }
    return new, metrics


@functools.lru_cache(maxsize=16)
def train_step(cfg: ModelConfig, tcfg: TrainConfig, *, dense: bool) -> Callable:
    """The jitted step ``(state, windows int32[B, T + 1]) -> (state, metrics)`` of one stage
    (the input state is donated). Metrics: ``lm_loss``, ``indexer_loss`` (of the batch, before
    the update), ``grad_norm_main``, ``grad_norm_indexer`` (before clipping),
    ``max_expert_load`` (the busiest expert's tokens over a balanced share)."""
    return jax.jit(functools.partial(_step, cfg=cfg, tcfg=tcfg, dense=dense), donate_argnums=(0,))


# -- checkpoints ----------------------------------------------------------------------------

_STEP_DIR = "step_{:08d}"
_META = "train.json"


def _flat(state: TrainState) -> dict[str, Any]:
    """The state as a flat dict of arrays keyed by their tree paths (what orbax stores)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(state)
    return {jax.tree_util.keystr(path): leaf for path, leaf in leaves}


def save_state(
    state: TrainState, directory: str | os.PathLike[str], cfg: ModelConfig, tcfg: TrainConfig
) -> str:
    """Write ``state`` to ``directory/step_NNNNNNNN`` (orbax) with the model and train configs,
    and return that path. An existing checkpoint of the same step is replaced."""
    import orbax.checkpoint as ocp

    step = int(state.step)
    path = os.path.join(os.path.abspath(os.fspath(directory)), _STEP_DIR.format(step))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(os.path.join(path, "state"), _flat(state), force=True)
    ckptr.wait_until_finished()
    meta = {"step": step, "model": cfg.to_dict(), "train": tcfg.to_dict()}
    with open(os.path.join(path, _META), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
    return path


def _checkpoints(directory: str) -> list[str]:
    """The complete checkpoints under ``directory``, oldest first."""
    if not os.path.isdir(directory):
        return []
    return [
        os.path.join(directory, d)
        for d in sorted(os.listdir(directory))
        if d.startswith("step_") and os.path.isfile(os.path.join(directory, d, _META))
    ]


def latest_checkpoint(directory: str | os.PathLike[str]) -> str | None:
    """The newest complete checkpoint under ``directory`` (None if there is none)."""
    done = _checkpoints(os.fspath(directory))
    return done[-1] if done else None


def prune_checkpoints(directory: str | os.PathLike[str], keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints under ``directory``."""
    import shutil

    if keep < 1:
        raise ValueError(f"keep={keep} must be >= 1")
    for path in _checkpoints(os.fspath(directory))[:-keep]:
        shutil.rmtree(path)


def restore_state(path: str | os.PathLike[str], cfg: ModelConfig, tcfg: TrainConfig) -> TrainState:
    """The state saved at ``path`` by `save_state`. The checkpoint's model config must equal
    ``cfg``, and its train config ``tcfg`` except in ``steps`` (a run may be extended)."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    with open(os.path.join(path, _META), encoding="utf-8") as f:
        meta = json.load(f)
    if ModelConfig.from_dict(meta["model"]) != cfg:
        raise ValueError(f"{path}: saved with another model config")
    saved = dict(meta["train"])
    mine = tcfg.to_dict()
    diff = sorted(k for k in mine if k != "steps" and saved.get(k) != mine[k])
    if diff:
        raise ValueError(
            f"{path}: saved with another train config ({
                ', '.join(f'{k}: {saved.get(k)!r} vs {mine[k]!r}' for k in diff)
            })"
        )
    template = jax.eval_shape(lambda: init_state(cfg, tcfg))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = {
        jax.tree_util.keystr(p): jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        for p, x in leaves
    }
    flat = ocp.StandardCheckpointer().restore(os.path.join(path, "state"), abstract)
    return jax.tree_util.tree_unflatten(treedef, [flat[jax.tree_util.keystr(p)] for p, _ in leaves])


# -- evaluation and the loop ----------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _eval_fn(cfg: ModelConfig) -> Callable:
    return jax.jit(lambda params, windows: losses(params, cfg, windows)[0])


def evaluate(
    params, cfg: ModelConfig, tokens: np.ndarray, *, seq_len: int, batch_size: int, batches: int
) -> float:
    """Mean next-token loss (nats per token; / ln 2 for bits per byte of the byte tokenizer) over
    the first ``batches`` batches of consecutive ``seq_len + 1``-token windows of ``tokens``."""
    fn = _eval_fn(cfg)
    windows = D.consecutive_windows(tokens, seq_len + 1)
    total, count = 0.0, 0
    for i in range(0, min(len(windows), batches * batch_size), batch_size):
        chunk = windows[i : i + batch_size]
        if len(chunk) < batch_size:
            break
        total += float(fn(params, jnp.asarray(chunk))) * len(chunk)
        count += len(chunk)
    if count == 0:
        raise ValueError(
            f"evaluate: {len(tokens)} tokens make no batch of {batch_size} windows of "
            f"{seq_len + 1} tokens"
        )
    return total / count


def _batches(tokens: np.ndarray, tcfg: TrainConfig, start: int) -> Iterator[tuple[int, np.ndarray]]:
    position = start
    while True:
        yield (
            position,
            D.batch_at(
                tokens,
                position,
                batch_size=tcfg.batch_size,
                window=tcfg.seq_len + 1,
                seed=tcfg.seed,
            ),
        )
        position += 1


def _starting_state(
    cfg: ModelConfig,
    tcfg: TrainConfig,
    tokens: np.ndarray,
    checkpoint_dir: str | os.PathLike[str] | None,
    checkpoint_every: int,
    keep_checkpoints: int,
    state: TrainState | None,
    stop_after: int | None,
) -> TrainState:
    """`train`'s arguments checked, and the state it starts from (see `train`)."""
    if checkpoint_every < 0:
        raise ValueError(f"checkpoint_every={checkpoint_every} must be >= 0")
    if keep_checkpoints < 1:
        raise ValueError(f"keep_checkpoints={keep_checkpoints} must be >= 1")
    if stop_after is not None and stop_after < 0:
        raise ValueError(f"stop_after={stop_after} must be >= 0")
    check_trainable(cfg, tcfg)
    D.check_tokens(tokens, tcfg.seq_len + 1, tcfg.batch_size, cfg.vocab_size)
    if state is None and checkpoint_dir is not None:
        last = latest_checkpoint(checkpoint_dir)
        if last is not None:
            state = restore_state(last, cfg, tcfg)
    if state is None:
        state = init_state(cfg, tcfg)
    return state


def train(
    cfg: ModelConfig,
    tcfg: TrainConfig,
    tokens: np.ndarray,
    *,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    checkpoint_every: int = 0,
    keep_checkpoints: int = 2,
    state: TrainState | None = None,
    stop_after: int | None = None,
    progress: bool = True,
    log: Callable[[dict[str, float]], None] | None = None,
) -> tuple[TrainState, list[dict[str, float]]]:
    """Run ``tcfg`` on ``tokens`` (uint16/int32[N], `training.data`): the final state and one
    metrics row per step. Starts from ``state`` (donated), else the newest checkpoint in
    ``checkpoint_dir``, else `init_state`; writes a checkpoint every ``checkpoint_every`` steps
    (0 = at the end) keeping the newest ``keep_checkpoints``. ``stop_after`` ends the call after
    that many steps (the schedule still spans ``tcfg.steps``); a tqdm bar shows the losses."""
    state = _starting_state(
        cfg, tcfg, tokens, checkpoint_dir, checkpoint_every, keep_checkpoints, state, stop_after
    )
    first = int(state.step)
    end = tcfg.steps if stop_after is None else min(tcfg.steps, first + stop_after)
    history: list[dict[str, float]] = []
    bar = tqdm(total=tcfg.steps, initial=first, disable=not progress, unit="step")
    batches = _batches(tokens, tcfg, int(state.data_position))
    tick = time.perf_counter()
    for step in range(first, end):
        _, windows = next(batches)
        fn = train_step(cfg, tcfg, dense=step < tcfg.dense_steps)
        state, metrics = fn(state, jnp.asarray(windows))
        row = {k: float(v) for k, v in metrics.items()}
        now = time.perf_counter()
        row["step"] = step
        row["tokens_per_s"] = tcfg.tokens_per_step / max(now - tick, 1e-9)
        tick = now
        history.append(row)
        if log is not None:
            log(row)
        bar.set_postfix(
            lm=f"{row['lm_loss']:.3f}", kl=f"{row['indexer_loss']:.3f}",
            tok_s=f"{row['tokens_per_s']:.0f}",
        )  # fmt: skip
        bar.update(1)
        done = step + 1
        if checkpoint_dir is not None and (
            (checkpoint_every and done % checkpoint_every == 0) or done == end
        ):
            save_state(state, checkpoint_dir, cfg, tcfg)
            prune_checkpoints(checkpoint_dir, keep_checkpoints)
    bar.close()
    return state, history
