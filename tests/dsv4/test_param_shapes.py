"""The V4.1-Flash params have exactly the released checkpoint's backbone and Engram tensors.

The expected tables are written out by hand from the released V4.1-Flash checkpoint
(`docs/model.md#checkpoint-format`; names, dtypes, stored shapes; scale shapes for 32 x 32
blocks, Engram table scales per 32 values of a row), not derived from ``dsv4.params``; the
per-block table, shared with the DSpark drafter's test (``test_dspark.py``), is in
``released_tensors.py``. The vision tower and ``ffn.gate.bias_vl`` are not modelled. Shapes come
from ``jax.eval_shape``, so nothing of the 763B parameters is allocated.
"""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import pytest
from released_tensors import BF16, E8M0, F8, F32, I8, block, experts

from benchmarks import param_count
from dsv4.config import tiny_v41, v41_flash
from dsv4.params import abstract_params, checkpoint_tensors, count_params

N_LAYERS, N_EXPERTS = 40, 384
KV_SOURCES_RATIO2 = (2, 8, 14)  # compressor with wgate
KV_SOURCES_RATIO1 = (20,)  # compressor without wgate
REINDEX = (24, 28, 32, 36)  # own indexer query, no compressor / index-key projection

GLOBAL = {
    "embed.weight": (BF16, (129280, 5120)),
    "head.weight": (BF16, (129280, 5120)),
    "norm.weight": (BF16, (5120,)),
}
KV_SOURCE = {
    "attn.compressor.wkv.weight": (BF16, (512, 5120)),
    "attn.compressor.norm.weight": (BF16, (512,)),
    "attn.indexer.wk.weight": (BF16, (128, 512)),
    "attn.indexer.k_norm.weight": (BF16, (128,)),
}
RATIO2_GATE = {"attn.compressor.wgate.weight": (BF16, (512, 5120))}
INDEX_SOURCE = {
    "attn.indexer.wq_b.weight": (F8, (4096, 1280)),
    "attn.indexer.wq_b.scale": (E8M0, (128, 40)),
    "attn.indexer.weights_proj.weight": (BF16, (32, 5120)),
}


ENGRAM_ROWS = {1: 384006168, 14: 384016682}  # engram_num_embeddings of the released config


def engram_tensors() -> dict[str, tuple[str, tuple[int, ...]]]:
    out = {}
    for layer, rows in ENGRAM_ROWS.items():
        e = f"layers.{layer}.engram."
        out |= {
            e + "embed.weight": (F8, (rows, 256)),
            e + "embed.scale": (E8M0, (rows, 8)),
            e + "wkv.weight": (F8, (25600, 6144)),  # 24 rows x 256 -> (4 + 1) x 5120
            e + "wkv.scale": (E8M0, (800, 192)),
            e + "q_weight": (BF16, (4, 5120)),
            e + "k_weight": (BF16, (4, 5120)),
        }
    return out


def released_tensors() -> dict[str, tuple[str, tuple[int, ...]]]:
    """Backbone and Engram tensors of the released V4.1-Flash checkpoint: name -> (dtype,
    stored shape)."""
    out = dict(GLOBAL) | engram_tensors()
    for layer in range(N_LAYERS):
        extra = block(N_EXPERTS)
        if layer in KV_SOURCES_RATIO2 + KV_SOURCES_RATIO1:
            extra |= KV_SOURCE
        if layer in KV_SOURCES_RATIO2:
            extra |= RATIO2_GATE
        if layer in KV_SOURCES_RATIO2 + KV_SOURCES_RATIO1 + REINDEX:
            extra |= INDEX_SOURCE
        extra |= experts(N_EXPERTS)
        out |= {f"layers.{layer}.{k}": v for k, v in extra.items()}
    return out


def dequantised_shapes(released: dict) -> dict[str, tuple[int, ...]]:
    """Value tensors (no scales) with their dequantised shapes: packed fp4 holds 2 per byte."""
    out = {}
    for name, (dtype, shape) in released.items():
        if dtype == E8M0:
            continue
        out[name] = (shape[0], 2 * shape[1]) if dtype == I8 else shape
    return out


def differences(want: dict, got: dict) -> list[str]:
    """Readable differences between two name -> value dicts (a few of each kind)."""
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    wrong = sorted(
        f"{k}: expected {want[k]}, got {got[k]}"
        for k in want.keys() & got.keys()
        if want[k] != got[k]
    )
    out = []
    for label, items in (("missing", missing), ("unexpected", extra), ("different", wrong)):
        if items:
            out.append(f"{len(items)} {label}, e.g. {items[:5]}")
    return out


@pytest.fixture(scope="module")
def released():
    return released_tensors()


@pytest.fixture(scope="module")
def abstract():
    return abstract_params(v41_flash())


def test_table_size(released):
    # 3 global + 40 layers x (29 per-layer + 384 x 6 expert) + 3 ratio-2 sources x 5
    # + 1 ratio-1 source x 4 + 8 index sources x 3 + 2 Engram layers x 6
    assert len(released) == 3 + 40 * (29 + 384 * 6) + 3 * 5 + 4 + 8 * 3 + 2 * 6


def test_abstract_params_match_released_names_and_shapes(abstract, released):
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in abstract.values())
    flat = {}
    for name, x in abstract.items():
        if name.startswith("mtp.") or name == "engram.token_map":
            continue  # test_dspark.py; the token map is derived from the tokenizer
        if ".ffn.experts." in name:
            base, proj = name.split(".ffn.experts.")
            assert x.shape[0] == N_EXPERTS, name
            for e in range(x.shape[0]):
                flat[f"{base}.ffn.experts.{e}.{proj}"] = tuple(x.shape[1:])
        else:
            flat[name] = tuple(x.shape)
    assert not differences(dequantised_shapes(released), flat)


def test_checkpoint_tensors_match_released(released):
    got = {
        t.name: (t.dtype, tuple(t.shape))
        for t in checkpoint_tensors(v41_flash())
        if not t.name.startswith("mtp.")
    }
    assert not differences(released, got)


def test_param_dtypes(abstract, released):
    assert abstract.pop("engram.token_map").dtype == jnp.int32
    assert {x.dtype for x in abstract.values()} == {jnp.dtype(jnp.float32)}
    half = abstract_params(v41_flash(), jnp.bfloat16)
    for name, x in half.items():
        if name.startswith("mtp.") or name == "engram.token_map":
            continue
        stored = released[name.replace(".experts.", ".experts.0.")][0]
        want = jnp.float32 if stored == F32 else jnp.bfloat16
        assert x.dtype == want, name


def test_param_count(abstract, released, capsys):
    shapes = dequantised_shapes(released)
    n = sum(math.prod(s) for name, s in shapes.items() if ".engram." not in name)
    n_engram = sum(math.prod(s) for name, s in shapes.items() if ".engram." in name)
    counts = param_count.breakdown(abstract, v41_flash())
    assert count_params(v41_flash()) == n + n_engram + counts["dspark"]
    assert counts["total"] == n and counts["engram"] == n_engram
    assert 196e9 < n_engram < 197e9  # the "196B Engram" of the tech-report summaries
    assert counts["release_total"] == n + n_engram + counts["dspark"]
    assert sum(counts[c] for c in param_count.CATEGORIES) == n
    assert counts["moe_routed"] == 40 * 384 * 3 * 2304 * 5120
    assert counts["embed_head"] == 2 * 129280 * 5120
    assert 551e9 < n < 553e9  # the "552B backbone" of the tech-report summaries
    assert param_count.main([]) == 0
    line = capsys.readouterr().out.strip().splitlines()
    assert len(line) == 1
    out = json.loads(line[0])
    assert out["configs"]["v41_flash"]["total"] == n
    assert out["configs"]["tiny_v41"]["total"] == count_params(tiny_v41())
