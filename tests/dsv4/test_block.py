"""The decoder block is the one layer loop: every forward path runs `dsv4.block.decoder_layers`,
and the layouts training picks for thousands of tokens compute what inference's do."""

from __future__ import annotations

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4 import layers as L
from dsv4.block import decoder_layers

ROOT = pathlib.Path(__file__).resolve().parents[2]
# the four forward paths and the function of each that runs the layers
PATHS = {
    "dsv4/reference.py": "forward_streams",
    "dsv4/model.py": "forward_step_streams",
    "dsv4/paged/step.py": "paged_forward_streams",
    "training/train.py": "train_forward",
}
MIXES = {"hc_mixes", "hc_pre", "hc_post"}


def _called(node: ast.AST) -> set[str]:
    """Names of the functions called anywhere under ``node`` (``f(..)`` and ``m.f(..)``)."""
    names = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            names.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
    return names


def _tree(rel: str) -> ast.Module:
    return ast.parse((ROOT / rel).read_text(), rel)


def test_every_path_runs_the_layers_through_the_block():
    for rel, fn in PATHS.items():
        tree = _tree(rel)
        defs = {d.name: d for d in ast.walk(tree) if isinstance(d, ast.FunctionDef)}
        assert "decoder_layers" in _called(defs[fn]), f"{rel}:{fn} does not call decoder_layers"
        for d in ast.walk(tree):
            # no loop of the path's own over the decoder layers, and no mHC mixing of its own
            if isinstance(d, ast.For) and "range" in _called(d.iter):
                assert "n_layers" not in ast.unparse(d.iter), f"{rel}: a loop over the layers"
        assert not MIXES & _called(tree), f"{rel} mixes the residual streams itself"


def test_only_the_block_mixes_the_streams():
    # dspark.py: its stages run through decoder_block; it collapses the final streams itself
    # (hc_pre), as its Markov head reads them un-normed
    allowed = {"dsv4/block.py", "dsv4/layers.py", "dsv4/dspark.py"}
    mixing = {
        str(p.relative_to(ROOT))
        for package in ("dsv4", "training")
        for p in (ROOT / package).rglob("*.py")
        if MIXES & _called(ast.parse(p.read_text(), str(p)))
    }
    assert mixing <= allowed, mixing - allowed
    assert "dsv4/block.py" in mixing


def test_capture_names_a_backbone_layer(tiny_params, tiny_cfg):
    # checked before anything runs
    def attention(layer, h, state):
        return h, state

    tokens = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="not a backbone layer"):
        decoder_layers(tiny_params, tiny_cfg, tokens, attention, None, capture=(tiny_cfg.n_layers,))


def test_many_token_layouts_compute_the_same(tiny_params, tiny_cfg):
    cfg, params = tiny_cfg, tiny_params
    key = jax.random.PRNGKey(3)
    x = jax.random.normal(key, (2, 37, cfg.hc_mult, cfg.dim), jnp.float32)
    few = L.hc_mixes(x, params, "layers.1.hc_attn", cfg)
    many = L.hc_mixes(x, params, "layers.1.hc_attn", cfg, many_tokens=True)
    for a, b in zip(few, many):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    _, post, comb = few
    y = x[..., 0, :] * 0.5
    np.testing.assert_allclose(
        np.asarray(L.hc_post(y, x, post, comb)),
        np.asarray(L.hc_post(y, x, post, comb, many_tokens=True)),
        rtol=1e-5,
        atol=1e-5,
    )
    h = x[..., 1, :]
    want, load = L.moe(h, params, "layers.2.ffn.", cfg, return_load=True)
    got, tiled_load = L.moe(h, params, "layers.2.ffn.", cfg, tile=8, return_load=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(tiled_load), np.asarray(load))
    assert int(load.sum()) == 2 * 37 * cfg.n_activated_experts
