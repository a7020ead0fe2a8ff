"""Training (`training.train`) and its data (`training.data`).

The model here is `tiny_v41` cut to two layers at ratio 2 so that the jitted steps compile
quickly (XLA:CPU compile time grows with the layers; the sparse step of these two compiles in
about 13 s): layer 0 full (compressor, index keys, its own indexer) and candidate source, layer 1
reindex over 0's keys inside 0's candidate blocks. Windows of 32 tokens hold up to 16
compressed entries against a top-k of 4 and 2 candidate blocks of 4, so every selection is
sparse, and the first token of each window sees no entry at all. Every test that trains shares
one `TrainConfig` (one compile per stage); the slow variants compare the forward with the
reference on `tiny_v41` (every role, both ratios) and `tiny_v41_full` (Engram).
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4 import reference
from dsv4.config import Role, tiny_v41_trained
from dsv4.params import count_params, init_params
from dsv4.tokenizer import ByteTokenizer
from tests.training.train_configs import two_layer_config
from training import data as D
from training import train as T

SEQ = 32


@pytest.fixture(scope="module")
def cfg():
    return two_layer_config()


@pytest.fixture(scope="module")
def tcfg():
    return T.TrainConfig(
        steps=4,
        batch_size=2,
        seq_len=SEQ,
        dense_steps=1,
        warmup_steps=1,
        learning_rate=1e-2,
        indexer_learning_rate=1e-2,
        moe_tile=16,
        seed=3,
    )


@pytest.fixture(scope="module")
def tokens():
    """A small real stream: the first three training files of the standard library."""
    split = D.source_split()
    small = dataclasses.replace(split, train=split.train[:3])
    return D.load_split(small, "train")


@pytest.fixture(scope="module")
def params(cfg):
    # under the tests' matmul precision (conftest), so that the eager initialiser ops it
    # compiles are the ones `init_state` reuses inside the tests
    with jax.default_matmul_precision("highest"):
        return init_params(cfg, jax.random.PRNGKey(1))


@pytest.fixture(scope="module")
def windows(tokens):
    return jnp.asarray(D.batch_at(tokens, 0, batch_size=2, window=SEQ + 1, seed=0))


def test_small_config_has_the_roles(cfg):
    roles = [info.role for info in cfg.plan]
    assert roles == [Role.FULL, Role.REINDEX]
    assert cfg.plan[0].is_candidate_source and cfg.plan[1].uses_candidates


# -- the forward and its gradients -----------------------------------------------------------


@pytest.fixture(scope="module")
def sparse_run(cfg, params, windows):
    """The sparse forward's logits, indexer loss and expert load; the indexer loss's gradient
    over every float param; the LM loss's gradient over the indexer's params."""
    tokens = windows[:, :-1]

    def run(p):
        logits, kl, load = T.train_forward(p, cfg, tokens, moe_tile=16)

        def kl_loss(p):
            return T.losses(p, cfg, windows, moe_tile=16)[1]

        def lm_loss(indexer):
            return T.losses({**p, **indexer}, cfg, windows, moe_tile=16)[0]

        indexer = {n: x for n, x in p.items() if T.is_indexer_param(n)}
        return logits, kl, load, jax.grad(kl_loss)(p), jax.grad(lm_loss)(indexer)

    return jax.device_get(jax.jit(run)(params))


def _reference(params, cfg, tokens):
    return np.asarray(jax.jit(lambda p, t: reference.forward(p, cfg, t))(params, tokens))


def test_train_forward_is_the_reference(cfg, params, windows, sparse_run):
    logits, kl, load, _, _ = sparse_run
    tokens = windows[:, :-1]
    np.testing.assert_allclose(logits, _reference(params, cfg, tokens), rtol=1e-5, atol=1e-5)
    assert np.isfinite(kl) and kl > 0
    assert load.shape == (cfg.n_layers, cfg.n_routed_experts)
    assert (load.sum(axis=1) == tokens.size * cfg.n_activated_experts).all()


@pytest.mark.slow
@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
@pytest.mark.parametrize("preset", ["tiny_v41", "tiny_v41_full"])
def test_train_forward_is_the_reference_for_every_role(preset, dense):
    import dsv4.config

    cfg = getattr(dsv4.config, preset)(index_topk=4, candidate_topk_blocks=2)
    params = init_params(cfg, jax.random.PRNGKey(2))
    tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 48), 3, 259)
    got = jax.jit(lambda p, t: T.train_forward(p, cfg, t, dense=dense)[0])(params, tokens)
    want = _reference(params, T.dense_config(cfg, 48) if dense else cfg, tokens)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_dense_config_keeps_every_entry(cfg):
    d = T.dense_config(cfg, SEQ)
    assert d.index_topk >= SEQ
    assert d.candidate_topk_blocks * d.candidate_block_size >= SEQ


def test_indexer_loss_trains_only_the_indexer(sparse_run):
    g_kl = sparse_run[3]
    indexer = sorted(n for n in g_kl if T.is_indexer_param(n))
    # wq_b and weights_proj of the two index sources, wk and k_norm of the kv source
    assert len(indexer) == 2 * 2 + 2
    for name, g in g_kl.items():
        if T.is_indexer_param(name):
            assert np.abs(g).max() > 0, f"{name}: no gradient from the indexer loss"
        else:
            assert not np.any(g), f"{name}: the indexer loss reaches a main weight"


def test_lm_loss_does_not_reach_the_indexer(sparse_run):
    """The top-k and the candidate blocks carry no gradient: the LM loss gives the indexer's
    weights exactly zero (that the main weights get one shows in the step tests)."""
    g_lm = sparse_run[4]
    assert len(g_lm) == 6
    for name, g in g_lm.items():
        assert not np.any(g), f"{name}: gradient through a selection"


def test_selection_is_stop_gradient():
    """What the forward does with the scores: pick through stop_gradient, weight by the picks."""
    scores = jnp.asarray([[[0.3, 2.0, -1.0, 0.5, 1.5]]])
    visible = jnp.asarray([[5]])

    def picked_sum(s):
        sel = reference.topk_indices(jax.lax.stop_gradient(s), visible, 2)
        cand = reference.select_candidate_blocks(jax.lax.stop_gradient(s), visible, 1, 2)
        return jnp.sum(jnp.where(cand, 1.0, 0.0)) + jnp.sum(sel.astype(jnp.float32))

    assert not np.any(np.asarray(jax.grad(picked_sum)(scores)))


# -- steps, reproducibility, resumption ----------------------------------------------------


def test_steps_reduce_the_loss(cfg, tcfg, windows):
    state = T.init_state(cfg, tcfg)
    step = T.train_step(cfg, tcfg, dense=False)
    rows = []
    for _ in range(5):
        state, m = step(state, windows)
        rows.append({k: float(v) for k, v in m.items()})
    assert rows[-1]["lm_loss"] < rows[0]["lm_loss"] - 0.1
    assert rows[-1]["indexer_loss"] < rows[0]["indexer_loss"]
    assert all(r["grad_norm_main"] > 0 and r["grad_norm_indexer"] > 0 for r in rows)


def test_dense_step_freezes_the_main_model(cfg, tcfg, windows):
    """The warm-up step (dense attention: the slow test compares it with the reference) moves
    the indexer's weights only."""
    state = T.init_state(cfg, tcfg)
    before = jax.device_get(state.params)
    state, m = T.train_step(cfg, tcfg, dense=True)(state, windows)
    after = jax.device_get(state.params)
    assert float(m["grad_norm_main"]) == 0 and float(m["grad_norm_indexer"]) > 0
    for name in before:
        same = np.array_equal(before[name], after[name])
        assert same != T.is_indexer_param(name), name


def _run(cfg, tcfg, tokens, **kw):
    return T.train(cfg, tcfg, tokens, progress=False, **kw)


def test_training_is_reproducible_and_resumes_bit_for_bit(cfg, tcfg, tokens, tmp_path):
    state_a, hist_a = _run(cfg, tcfg, tokens)
    state_b, hist_b = _run(cfg, tcfg, tokens)
    keys = ("lm_loss", "indexer_loss", "grad_norm_main", "grad_norm_indexer")
    curve_a = [[row[k] for k in keys] for row in hist_a]
    assert curve_a == [[row[k] for k in keys] for row in hist_b]
    assert len(curve_a) == tcfg.steps and hist_a[0]["grad_norm_main"] == 0  # dense warm-up
    # interrupted after the dense step and one sparse step, then resumed from the checkpoint
    _, first = _run(cfg, tcfg, tokens, checkpoint_dir=tmp_path, stop_after=2)
    assert T.latest_checkpoint(tmp_path).endswith("step_00000002")
    state_c, rest = _run(cfg, tcfg, tokens, checkpoint_dir=tmp_path)
    assert [[row[k] for k in keys] for row in first + rest] == curve_a
    assert int(state_c.step) == int(state_c.data_position) == tcfg.steps
    for leaf_a, leaf_c in zip(
        jax.tree_util.tree_leaves(state_a), jax.tree_util.tree_leaves(state_c), strict=True
    ):
        assert np.array_equal(np.asarray(leaf_a), np.asarray(leaf_c))


def test_restore_refuses_another_config(cfg, tcfg, tmp_path):
    state = T.init_state(cfg, tcfg)
    path = T.save_state(state, tmp_path, cfg, tcfg)
    with pytest.raises(ValueError, match="learning_rate"):
        T.restore_state(path, cfg, dataclasses.replace(tcfg, learning_rate=1.0))
    with pytest.raises(ValueError, match="model config"):
        T.restore_state(path, cfg.replace(index_topk=5), tcfg)
    # a longer run of the same config may continue from it
    longer = dataclasses.replace(tcfg, steps=8)
    assert int(T.restore_state(path, cfg, longer).step) == 0


def test_prune_keeps_the_newest(cfg, tcfg, tmp_path):
    state = T.init_state(cfg, tcfg)
    for step in (3, 1, 2):
        T.save_state(dataclasses.replace(state, step=jnp.int32(step)), tmp_path, cfg, tcfg)
    T.prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002", "step_00000003"]
    with pytest.raises(ValueError, match="keep=0"):
        T.prune_checkpoints(tmp_path, keep=0)


@pytest.mark.slow
def test_evaluate_is_the_mean_loss(cfg, params, tokens):
    got = T.evaluate(params, cfg, tokens, seq_len=SEQ, batch_size=2, batches=2)
    windows = jnp.asarray(D.consecutive_windows(tokens, SEQ + 1)[:4])
    want = np.mean([float(T.losses(params, cfg, windows[i : i + 2])[0]) for i in (0, 2)])
    assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.slow
def test_bf16_params_train(cfg, windows):
    tcfg = T.TrainConfig(steps=3, batch_size=2, seq_len=SEQ, param_dtype="bfloat16", moe_tile=16)
    state = T.init_state(cfg, tcfg)
    assert state.params["embed.weight"].dtype == jnp.bfloat16
    assert state.params["layers.0.hc_attn_fn"].dtype == jnp.float32
    step = T.train_step(cfg, tcfg, dense=False)
    losses = []
    for _ in range(3):
        state, m = step(state, windows)
        losses.append(float(m["lm_loss"]))
    assert np.isfinite(losses).all() and losses[-1] < losses[0]


# -- arguments -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(steps=-3), "steps=-3"),
        (dict(batch_size=0), "batch_size=0"),
        (dict(seq_len=0), "seq_len=0"),
        (dict(dense_steps=4), "dense_steps=4"),
        (dict(learning_rate=0.0), "learning_rate=0.0"),
        (dict(clip_norm=-1.0), "clip_norm=-1.0"),
        (dict(param_dtype="float16"), "param_dtype='float16'"),
        (dict(moe_tile=0), "moe_tile=0"),
    ],
)
def test_bad_train_config_raises(change, match):
    base = dict(steps=4, batch_size=2, seq_len=SEQ)
    with pytest.raises(ValueError, match=match):
        T.TrainConfig(**{**base, **change})


def test_seq_len_must_fit_the_model(cfg, tokens):
    assert T.seq_len_multiple(cfg) == 2
    with pytest.raises(ValueError, match="seq_len=33 must be a multiple of 2"):
        T.init_state(cfg, T.TrainConfig(steps=2, batch_size=1, seq_len=33))
    with pytest.raises(ValueError, match="seq_len=1024 exceeds"):
        T.train(cfg, T.TrainConfig(steps=2, batch_size=1, seq_len=1024), tokens, progress=False)
    with pytest.raises(ValueError, match="quant_sim"):
        T.init_state(cfg.replace(quant_sim=True), T.TrainConfig(steps=2, batch_size=1, seq_len=32))
    with pytest.raises(ValueError, match="stop_after=-1"):
        T.train(cfg, T.TrainConfig(steps=2, batch_size=1, seq_len=32), tokens, stop_after=-1)


# -- data ----------------------------------------------------------------------------------


def test_split_is_deterministic_and_disjoint():
    files = D.source_files()
    assert files == D.source_files() and list(files) == sorted(files)
    assert not any("site-packages" in f or "__pycache__" in f for f in files)
    a, b = D.split_files(files), D.split_files(files)
    assert a == b
    assert not set(a.train) & set(a.heldout)
    assert sorted(a.train + a.heldout) == list(files)
    assert len(a.heldout) == len(files) // 20
    with pytest.raises(ValueError, match="heldout_every=1"):
        D.split_files(files, heldout_every=1)
    # source_split: the same split of the standard library, or of another tree
    assert D.source_split() == dataclasses.replace(a, root=D.stdlib_root())
    sub = pathlib.Path(D.stdlib_root(), "json")
    small = D.source_split(sub)
    assert small.root == str(sub) and not small.heldout  # fewer than 20 files
    assert small.train == tuple(sorted(p.name for p in sub.glob("*.py")))


def test_tokens_are_the_byte_tokenizer_s():
    text = "def f(x):\n    return 'é'  # ünïcode\n"
    ids = D.encode_bytes(text.encode("utf-8")).tolist()
    tok = ByteTokenizer()
    assert ids == tok.encode(text, add_bos=True) + [tok.eos_id]


def test_batches_are_deterministic(tokens):
    kw = dict(batch_size=3, window=SEQ + 1, seed=5)
    a = D.batch_at(tokens, 7, **kw)
    assert a.shape == (3, SEQ + 1) and a.dtype == np.int32
    np.testing.assert_array_equal(a, D.batch_at(tokens, 7, **kw))
    assert not np.array_equal(a, D.batch_at(tokens, 8, **kw))
    assert not np.array_equal(a, D.batch_at(tokens, 7, **{**kw, "seed": 6}))
    # every window is a slice of the stream
    stream = tokens.astype(np.int32)
    for row in a:
        starts = np.flatnonzero(stream[: len(stream) - SEQ] == row[0])
        assert any(np.array_equal(stream[s : s + SEQ + 1], row) for s in starts)
    with pytest.raises(ValueError, match="position=-1"):
        D.batch_at(tokens, -1, **kw)
    with pytest.raises(ValueError, match="hold no batch"):
        D.batch_at(tokens[:50], 0, **kw)


def _bpe_split(tmp_path):
    """Three small train files and one held-out one, one of them not UTF-8."""
    root = tmp_path / "src"
    root.mkdir()
    texts = {
        "a.py": "def add(x, y):\n    return x + y\n" * 40,
        "b.py": "class Stack:\n    def push(self, item):\n        self.items.append(item)\n" * 30,
        "c.py": "# -*- coding: latin-1 -*-\nname = 'caf\xe9'\n",  # written as latin-1 below
        "d.py": "import os\n\nprint(os.path.join('a', 'b'))  # é\n",
    }
    for name, text in texts.items():
        (root / name).write_bytes(text.encode("latin-1" if name == "c.py" else "utf-8"))
    return D.Split(root=str(root), train=("a.py", "b.py", "c.py"), heldout=("d.py",))


def test_bpe_is_deterministic_and_frames_files(tmp_path):
    from dsv4.tokenizer import HFTokenizer

    split = _bpe_split(tmp_path)
    D.train_bpe(split, 300, tmp_path / "t1.json")
    D.train_bpe(split, 300, tmp_path / "t2.json")
    assert (tmp_path / "t1.json").read_bytes() == (tmp_path / "t2.json").read_bytes()
    tok = HFTokenizer.from_file(tmp_path / "t1.json", bos_id=0, eos_id=1)
    assert tok.vocab_size == 300
    for i, name in enumerate(D.BPE_SPECIAL_TOKENS):
        assert tok._tok.token_to_id(name) == i
    text = "def add(x, y):\n    return x + y  # ünïcode\n"
    assert tok.decode(tok.encode(text)) == text
    stream = D.load_split(split, "train", tok)
    # the latin-1 file is left out of the BPE streams, kept in the byte ones
    raw = D.read_split(split, "train", utf8_only=True)
    assert len(raw) == 2 and len(D.read_split(split, "train")) == 3
    assert D.split_bytes(split, "train", tok) == sum(map(len, raw))
    assert D.split_bytes(split, "train") == sum(len(r) for r in D.read_split(split, "train"))
    expect = []
    for r in raw:
        expect += [0, *tok.encode(r.decode("utf-8")), 1]
    assert stream.dtype == np.uint16 and stream.tolist() == expect
    assert len(D.load_split(split, "train")) == sum(
        len(r) + 2 for r in D.read_split(split, "train")
    )
    with pytest.raises(ValueError, match="vocab_size=200"):
        D.train_bpe(split, 200, tmp_path / "t3.json")


# -- the trained model's config ------------------------------------------------------------


def test_tiny_v41_trained_config():
    c = tiny_v41_trained()
    roles = {info.role for info in c.plan}
    assert roles == {Role.SWA, Role.FULL, Role.REINDEX, Role.REUSE}
    assert {info.ratio for info in c.plan} == {0, 1, 2}
    assert any(info.uses_candidates for info in c.plan)
    assert not c.engram_layer_ids and c.vocab_size == 2048  # the BPE of scripts/train_tiny.py
    assert 5_000_000 < count_params(c) < 12_000_000
    seq = 1024  # the windows scripts/train_tiny.py trained on
    assert seq % T.seq_len_multiple(c) == 0 and seq <= c.max_seq_len
    # sparse at every level: fewer picks than entries, fewer candidate entries than entries
    assert c.index_topk < seq // 2 and c.candidate_topk_blocks * c.candidate_block_size < seq
    assert c.candidate_topk_blocks * c.candidate_block_size >= c.index_topk
    assert seq >= 8 * c.window_size


def test_train_tiny_runs_the_shipped_or_the_cpu_hour_model():
    """scripts/train_tiny.py's defaults are the shipped run; ``--cpu-hour`` the narrower model of
    about an hour on two CPU cores, and an explicit flag wins over either."""
    import importlib.util
    import pathlib

    script = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "train_tiny.py"
    spec = importlib.util.spec_from_file_location("train_tiny", script)
    tt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tt)
    a = tt._args([])
    assert (a.steps, a.batch_size, a.seq_len, a.drafter_steps) == (1900, 64, 1024, 1500)
    a = tt._args(["--cpu-hour", "--steps", "7"])
    assert (a.steps, a.batch_size, a.seq_len, a.drafter_steps) == (7, 8, 256, 600)
    narrow = tiny_v41_trained(drafter=False, **tt.CPU_HOUR_WIDTHS)
    assert narrow.dim == 64 and 2_000_000 < count_params(narrow) < 2_500_000
    seq = 256
    assert seq % T.seq_len_multiple(narrow) == 0
