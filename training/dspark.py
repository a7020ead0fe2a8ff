"""Training the DSpark drafter (`dsv4.dspark`) of a trained backbone, the backbone frozen.

The drafter's own tensors (``mtp.{i}.*``) are the only ones that learn; the embedding and the
LM head it shares with the backbone, and every backbone layer, stay as they are. A step:

* runs the frozen backbone over windows int32[B, T + 1] (`dsv4.reference.forward_streams`,
  under ``stop_gradient``) for the target hidden states of positions 0..T-1;
* draws ``cuts_per_row`` cut points c per window, uniformly in 1..T-K (K =
  ``dspark_block_size``): the draft block opens with the window's token at c (in serving, the
  token the backbone just sampled there) and its slot i is trained to predict the token at
  c + 1 + i, from the context latents of positions c - w .. c - 1 (w = the window) as
  `dsv4.dspark.draft_from_hidden` builds them;
* the Markov bias of slot i is teacher-forced with the true token at c + i (serving feeds the
  draft of slot i - 1, which equals it whenever that draft is accepted: the only case in which
  slot i's draft is ever used);
* the loss is the mean next-token cross entropy over the K slots, plus
  ``confidence_weight`` times a logistic loss training the confidence head to predict whether
  the slot's greedy draft is right (our choice of target for a head whose training the
  release does not describe; greedy verification does not read it).

`acceptance` measures a drafter the way greedy speculative decoding uses it: after a held-out
prefix the backbone picks the next token, the drafter drafts K tokens from scratch (no
teacher forcing), one backbone pass over prefix + next + drafts verifies them, and the
accepted length is the number of leading drafts equal to the backbone's greedy tokens.

AdamW with warm-up and cosine decay, clipping, and the data order of `training.data.batch_at`, as
`training.train` does for the backbone.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from dsv4 import dspark, reference
from dsv4.config import ModelConfig
from dsv4.params import init_params
from training import data as D
from training import train as T

__all__ = [
    "DraftState",
    "DraftTrainConfig",
    "acceptance",
    "draft_losses",
    "draft_step",
    "drafter_params",
    "init_draft_state",
    "train_drafter",
]

Params = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class DraftTrainConfig(T.OptimizerConfig):
    """Hyper-parameters of a drafter run (the optimizer's: `training.train.OptimizerConfig`)."""

    steps: int  # optimizer steps
    batch_size: int = 8  # windows per step
    seq_len: int = 256  # backbone positions per window (the window holds seq_len + 1 tokens)
    cuts_per_row: int = 16  # draft blocks trained per window
    seed: int = 0  # drafter init, data order and cut points
    learning_rate: float = dataclasses.field(default=2e-3, kw_only=True)
    warmup_steps: int = dataclasses.field(default=50, kw_only=True)
    confidence_weight: float = 0.1

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len", "cuts_per_row"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")


def drafter_params(params: Mapping[str, Any]) -> Params:
    """The drafter's own tensors (``mtp.*``) of a params dict."""
    return {k: v for k, v in params.items() if k.startswith("mtp.")}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftState:
    params: Params  # the mtp.* tensors
    opt: Any  # optax state
    step: jax.Array  # int32[]
    data_position: jax.Array  # int32[]: batches drawn so far


def _optimizer(dcfg: DraftTrainConfig) -> optax.GradientTransformation:
    return T.optimizer(dcfg.learning_rate, dcfg.steps, dcfg)


def _check(cfg: ModelConfig, dcfg: DraftTrainConfig) -> None:
    k = cfg.dspark_block_size
    if not (cfg.n_mtp_layers and k):
        raise ValueError("the config has no DSpark drafter (n_mtp_layers, dspark_block_size)")
    if dcfg.seq_len <= k + 1 or dcfg.seq_len > cfg.max_seq_len:
        raise ValueError(
            f"seq_len={dcfg.seq_len} must exceed dspark_block_size + 1 = {k + 1} and be at most "
            f"max_seq_len={cfg.max_seq_len}"
        )


def init_draft_state(
    cfg: ModelConfig, dcfg: DraftTrainConfig, backbone: Mapping[str, Any]
) -> DraftState:
    """A fresh drafter (`dsv4.params.init_params`'s ``mtp.*`` tensors, in the dtype of the
    backbone's embedding) and its optimizer state."""
    _check(cfg, dcfg)
    dtype = backbone["embed.weight"].dtype
    fresh = drafter_params(init_params(cfg, jax.random.PRNGKey(dcfg.seed), dtype))
    return DraftState(
        params=fresh,
        opt=_optimizer(dcfg).init(fresh),
        step=jnp.int32(0),
        data_position=jnp.int32(0),
    )


def _blocks(
    params: Params, cfg: ModelConfig, main_hidden: jax.Array, windows: jax.Array, cuts: jax.Array
) -> tuple[dspark.DraftBlock, jax.Array]:
    """Teacher-forced draft blocks at cuts int32[B, M] of windows int32[B, T + 1] from the
    target hidden [B, T, H]: (the blocks of B * M rows, their targets int32[B * M, K])."""
    b, m = cuts.shape
    k, w = cfg.dspark_block_size, cfg.window_size
    pos = cuts[..., None] - w + jnp.arange(w, dtype=jnp.int32)  # [B, M, w]
    visible = pos >= 0
    rows = jnp.arange(b)[:, None, None]
    hidden = main_hidden[rows, jnp.maximum(pos, 0)]  # [B, M, w, H]
    after = cuts[..., None] + jnp.arange(k + 1, dtype=jnp.int32)  # positions c .. c + K
    block_tokens = windows[rows, after].reshape(b * m, k + 1)
    hidden = hidden.reshape(b * m, w, hidden.shape[-1])
    pos = pos.reshape(b * m, w)
    main_x = dspark.main_projection(params, cfg, hidden)
    ctx = [dspark.context_latent(params, cfg, i, main_x, pos) for i in range(cfg.n_mtp_layers)]
    block = dspark.draft_over_latents(
        params,
        cfg,
        ctx,
        visible.reshape(b * m, w),
        block_tokens[:, 0],
        cuts.reshape(b * m),
        slot_tokens=block_tokens[:, 1:k],
    )
    return block, block_tokens[:, 1:]


def draft_losses(
    drafter: Params,
    backbone: Mapping[str, Any],
    cfg: ModelConfig,
    windows: jax.Array,
    cuts: jax.Array,
    confidence_weight: float = 0.1,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(loss, metrics) of the drafter on windows int32[B, T + 1] at cuts int32[B, M] (module
    docstring). Metrics: ``draft_loss`` (mean CE over slots), ``confidence_loss``,
    ``slot_accuracy`` f32[K] (teacher-forced greedy drafts that equal the targets)."""
    t = windows.shape[1] - 1
    _, streams = reference.forward_streams(
        dict(backbone), cfg, windows[:, :t], cfg.dspark_target_layer_ids
    )
    main_hidden = jax.lax.stop_gradient(dspark.target_hidden(cfg, streams))
    block, targets = _blocks({**backbone, **drafter}, cfg, main_hidden, windows, cuts)
    ce = T.cross_entropy(block.logits, targets)
    right = (jnp.argmax(block.logits, axis=-1) == targets).astype(jnp.float32)
    conf = jnp.mean(optax.sigmoid_binary_cross_entropy(block.confidence, right))
    metrics = {"draft_loss": ce, "confidence_loss": conf, "slot_accuracy": jnp.mean(right, axis=0)}
    return ce + confidence_weight * conf, metrics


def _cuts(key: jax.Array, b: int, m: int, t: int, k: int) -> jax.Array:
    return jax.random.randint(key, (b, m), 1, t - k + 1, dtype=jnp.int32)


def _step(state: DraftState, backbone, windows, cfg: ModelConfig, dcfg: DraftTrainConfig):
    key = jax.random.fold_in(jax.random.PRNGKey(dcfg.seed + 1), state.step)
    cuts = _cuts(key, windows.shape[0], dcfg.cuts_per_row, dcfg.seq_len, cfg.dspark_block_size)
    backbone = jax.lax.stop_gradient(backbone)
    (_, metrics), grads = jax.value_and_grad(draft_losses, has_aux=True)(
        state.params, backbone, cfg, windows, cuts, dcfg.confidence_weight
    )
    updates, opt = _optimizer(dcfg).update(grads, state.opt, state.params)
    new = DraftState(
        params=optax.apply_updates(state.params, updates),
        opt=opt,
        step=state.step + 1,
        data_position=state.data_position + 1,
    )
    metrics["grad_norm"] = optax.tree.norm(grads)
    return new, metrics


@functools.lru_cache(maxsize=8)
def draft_step(cfg: ModelConfig, dcfg: DraftTrainConfig) -> Callable:
    """The jitted ``(state, backbone params, windows int32[B, T + 1]) -> (state, metrics)``
    (the state is donated)."""
    return jax.jit(functools.partial(_step, cfg=cfg, dcfg=dcfg), donate_argnums=(0,))


def train_drafter(
    backbone: Mapping[str, Any],
    cfg: ModelConfig,
    dcfg: DraftTrainConfig,
    tokens: np.ndarray,
    *,
    state: DraftState | None = None,
    progress: bool = True,
    log: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[DraftState, list[dict[str, Any]]]:
    """Train the drafter of ``cfg`` on ``tokens`` (`training.data`) over the frozen ``backbone``
    for ``dcfg.steps`` steps (from ``state`` when given); returns the state and a metrics row
    per step."""
    _check(cfg, dcfg)
    D.check_tokens(tokens, dcfg.seq_len + 1, dcfg.batch_size, cfg.vocab_size)
    backbone = {k: v for k, v in backbone.items() if not k.startswith("mtp.")}
    state = init_draft_state(cfg, dcfg, backbone) if state is None else state
    fn = draft_step(cfg, dcfg)
    history = []
    bar = tqdm(total=dcfg.steps, initial=int(state.step), disable=not progress, unit="step")
    for step in range(int(state.step), dcfg.steps):
        windows = D.batch_at(tokens, int(state.data_position), batch_size=dcfg.batch_size,
                             window=dcfg.seq_len + 1, seed=dcfg.seed)  # fmt: skip
        state, metrics = fn(state, backbone, jnp.asarray(windows))
        row = {"step": step, **{k: np.asarray(v).tolist() for k, v in metrics.items()}}
        history.append(row)
        if log is not None:
            log(row)
        bar.set_postfix(loss=f"{row['draft_loss']:.3f}", slot0=f"{row['slot_accuracy'][0]:.2f}")
        bar.update(1)
    bar.close()
    return state, history


@functools.lru_cache(maxsize=8)
def _acceptance_fn(cfg: ModelConfig) -> Callable:
    k = cfg.dspark_block_size

    def fn(params, prefix):
        logits, streams = reference.forward_streams(
            params, cfg, prefix, cfg.dspark_target_layer_ids
        )
        nxt = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
        block = dspark.draft_from_hidden(params, cfg, dspark.target_hidden(cfg, streams), nxt)
        seq = jnp.concatenate([prefix, nxt[:, None], block.tokens], axis=1)
        verify = reference.forward(params, cfg, seq)
        p = prefix.shape[1]
        greedy = jnp.argmax(verify[:, p : p + k], axis=-1)  # the backbone's tokens after each
        return block.tokens == greedy

    return jax.jit(fn)


def acceptance(
    params: Mapping[str, Any],
    cfg: ModelConfig,
    tokens: np.ndarray,
    *,
    prefix_len: int = 128,
    num_prefixes: int = 64,
    batch_size: int = 8,
) -> dict[str, Any]:
    """Greedy acceptance of the drafter of ``params`` after ``num_prefixes`` prefixes of
    ``prefix_len`` tokens cut from ``tokens`` (consecutive windows, evenly spread; module
    docstring): ``mean_acceptance_length`` (accepted drafts per verification, 0..K), the
    per-position acceptance rate (position i only with every draft before it), and the tokens a
    verification step yields on average (1 + accepted)."""
    _check(cfg, DraftTrainConfig(steps=1, seq_len=prefix_len + cfg.dspark_block_size + 2))
    windows = D.consecutive_windows(tokens, prefix_len)
    if len(windows) < num_prefixes:
        raise ValueError(f"{len(tokens)} tokens hold fewer than {num_prefixes} prefixes")
    windows = windows[np.linspace(0, len(windows) - 1, num_prefixes).astype(int)]
    fn = _acceptance_fn(cfg)
    accepted = []
    for i in range(0, num_prefixes, batch_size):
        chunk = windows[i : i + batch_size]
        ok = np.asarray(fn(dict(params), jnp.asarray(chunk)))
        accepted.append(np.cumprod(ok, axis=1))
    acc = np.concatenate(accepted)
    length = acc.sum(axis=1)
    return {
        "prefixes": len(acc),
        "block_size": cfg.dspark_block_size,
        "mean_acceptance_length": float(length.mean()),
        "per_position_acceptance": acc.mean(axis=0).tolist(),
        "tokens_per_verification": float(1 + length.mean()),
    }
