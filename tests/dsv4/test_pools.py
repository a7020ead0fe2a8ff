"""Device page pools: layout figures against cache.layout and docs/cache.md#page-sizes,
reads and writes through both layouts, isolation of pages within a group, debug checks."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cache.layout import (
    compressed_kv_name,
    for_model,
    indexer_k_name,
    memory_report,
    ring_name,
    swa_cache_name,
)
from dsv4.config import tiny_v41, v41_flash
from dsv4.paged import pools as P
from dsv4.paged import records as R

TINY_PRESETS = ("EXACT", "BF16", "RELEASED", "RELEASED_FP8")  # SM90's v4_584 needs dim > 64


@pytest.fixture(scope="module")
def tiny():
    return tiny_v41()


@pytest.fixture(scope="module")
def flash():
    return v41_flash()


def _config(cfg, formats, num_blocks, **kw):
    kw.setdefault("block_size", 16)
    kw.setdefault("swa_block_size", 4)
    return for_model(P.cache_desc(cfg, formats, **kw), num_gpu_blocks_override=num_blocks)


def _layouts(cfg, formats, num_blocks, **kw):
    config = _config(cfg, formats, num_blocks, **kw)
    return config, {a: P.PoolLayout.build(cfg, config, formats, a) for a in ("aliased", "separate")}


def _flash_config(flash, preset, num_blocks=2):
    formats = R.PRESETS[preset]
    block, align = (64, 576) if preset == "SM90" else (128, 512)
    kw = dict(block_size=block, swa_block_size=32, page_alignment=align)
    return _config(flash, formats, num_blocks, indexer_page_alignment=align, **kw), formats


def _bits(x):
    return np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.uint32))


# --- layout figures --------------------------------------------------------------------------


def test_cache_desc_of_tiny(tiny):
    desc = P.cache_desc(tiny, R.RELEASED, block_size=16, swa_block_size=4, num_speculative_tokens=3)
    assert desc.num_hidden_layers == 8 and desc.num_draft_layers == 1
    assert desc.kv_source_layer_ids == (1, 3) and desc.index_source_layer_ids == (1, 3, 5)
    assert (desc.swa_record_bytes, desc.compressed_record_bytes, desc.indexer_key_bytes) == (
        66,
        36,
        17,
    )
    assert desc.ring_floats_per_row == 128 and desc.sliding_window == 8
    with pytest.raises(ValueError, match=r"swa record.*v4_584.*dim=64"):
        P.cache_desc(tiny, R.SM90, block_size=16, swa_block_size=4)


def test_tiny_exact_layout_figures(tiny):
    config, lay = _layouts(tiny, R.EXACT, 8)
    a, s = lay["aliased"], lay["separate"]
    pages = {lp.name: lp.page_bytes for lp in a.layers}
    assert pages[swa_cache_name(0)] == 4 * 256
    assert pages[compressed_kv_name(1)] == 8 * 256 and pages[compressed_kv_name(3)] == 16 * 256
    assert pages[indexer_k_name(1)] == 8 * 128 and pages[indexer_k_name(3)] == 16 * 128
    assert pages[ring_name(1)] == 8 * 128 * 4
    assert len(a.layers) == 9 + 2 + 2 + 1
    assert a.buffers == (("pool", 9216),)  # the MLA group: 2048 + 4096 + 1024 + 2048
    assert a.pool_bytes() == 8 * 9216 == P.config_pool_bytes(config)
    assert s.bytes_per_block() == 9 * 1024 + 9216 + 4096 == sum(pages.values())
    assert s.pool_bytes() == 8 * 22528


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_tiny_pool_bytes_equal_what_cache_layout_reports(tiny, preset):
    config, lay = _layouts(tiny, R.PRESETS[preset], 16)
    a, s = lay["aliased"], lay["separate"]
    report = memory_report(config, 256, 64, packed_layout=True)
    assert a.pool_bytes() == P.config_pool_bytes(config) == report.pool_bytes_per_block * 16
    assert a.bytes_per_block() == max(g.page_bytes for g in a.groups)
    # separate: every layer has a row for every block id (the debugging layout costs the sum)
    assert s.pool_bytes() == 16 * sum(lp.page_bytes for lp in s.layers) > a.pool_bytes()
    offsets = {t.shared_by[0]: t.offset for t in config.kv_cache_tensors}
    for lp in a.layers:
        assert lp.buffer == "pool" and lp.offset == offsets[lp.name]
        assert lp.used_bytes <= lp.page_bytes
        assert lp.record == R.PRESETS[preset].record(lp.kind)
    assert {lp.buffer for lp in s.layers} == {lp.name for lp in s.layers}
    assert hash(a) == hash(P.PoolLayout.build(tiny, config, R.PRESETS[preset]))


# docs/cache.md#page-sizes: (kind, ratio) -> (real page bytes, padded page bytes)
SECTION_3_3 = {
    "RELEASED_FP8": {  # SM100, B = 128, 528-B records, FP8 index keys
        ("compressed", 1): (67584, 67584),
        ("compressed", 2): (33792, 33792),
        ("index", 1): (16896, 16896),
        ("index", 2): (8448, 8704),
        ("swa", 1): (16896, 16896),
    },
    "RELEASED": {  # SM100, NVFP4 compressed, MXFP4 index keys
        ("compressed", 1): (36864, 36864),
        ("compressed", 2): (18432, 18432),
        ("index", 1): (8704, 8704),
        ("index", 2): (4352, 4608),
        ("swa", 1): (16896, 16896),
    },
    "SM90": {  # H200, B = 64, 584-B records, alignment 576
        ("compressed", 1): (37376, 37440),
        ("compressed", 2): (18688, 19008),
        ("index", 1): (8448, 8640),
        ("index", 2): (4224, 4608),
        ("swa", 1): (18688, 19008),
    },
}


@pytest.mark.parametrize("preset", sorted(SECTION_3_3))
def test_v41_flash_pages_match_section_3_3(flash, preset):
    config, formats = _flash_config(flash, preset)
    layout = P.PoolLayout.build(flash, config, formats)
    seen = {}
    for lp in layout.layers:
        if lp.kind == "ring":
            assert lp.page_bytes == 8 * 1024 * 4 and lp.used_bytes == lp.page_bytes
            continue
        key = (lp.kind, lp.tokens_per_state)
        seen.setdefault(key, set()).add((lp.used_bytes, lp.page_bytes))
    assert {k: v.pop() for k, v in seen.items() if len(v) == 1} == SECTION_3_3[preset]
    kinds = [lp.kind for lp in layout.layers]
    assert [kinds.count(k) for k in ("swa", "compressed", "index", "ring")] == [43, 4, 4, 3]
    assert layout.pool_bytes() == P.config_pool_bytes(config)
    report = memory_report(config, 1 << 20, 8192, packed_layout=True)
    assert layout.bytes_per_block() == report.pool_bytes_per_block


def test_v41_flash_group_pages_are_disjoint_and_fit_the_stride(flash):
    config, formats = _flash_config(flash, "RELEASED")
    layout = P.PoolLayout.build(flash, config, formats)
    stride = dict(layout.buffers)["pool"]
    assert stride == max(g.page_bytes for g in layout.groups)
    for g in layout.groups:
        spans = sorted(
            (lp.offset, lp.offset + lp.page_bytes) for lp in layout.layers if lp.group == g.group
        )
        assert spans[0][0] == 0 and spans[-1][1] == g.page_bytes <= stride
        assert all(end == start for (_, end), (start, _) in itertools.pairwise(spans))


# --- reads and writes ------------------------------------------------------------------------


def _values(key, shape, spread=True):
    x = jax.random.normal(key, shape)
    if spread:  # rows of very different magnitudes exercise the scales
        x = x * 10.0 ** jax.random.randint(jax.random.fold_in(key, 1), (shape[0], 1), -3, 4)
    return x


@pytest.mark.parametrize("alias", ["aliased", "separate"])
@pytest.mark.parametrize("preset", ["EXACT", "RELEASED"])
def test_write_then_read_a_layer(tiny, alias, preset):
    formats = R.PRESETS[preset]
    config = _config(tiny, formats, 8)
    layout = P.PoolLayout.build(tiny, config, formats, alias)
    pools = P.init_pools(layout, fill="nan")
    name = compressed_kv_name(1)  # r = 2: 8 states per page
    lp = layout.layer(name)
    slots = jnp.array([8, 9, -1, 31, 63, 64, -7, 1000, 40])
    vals = _values(jax.random.PRNGKey(0), (9, lp.dim))
    new = P.write_layer(layout, pools, name, slots, vals)
    pages = np.asarray(P.read_layer(layout, new, name))
    assert pages.shape == (8, 8, lp.dim)
    want = np.asarray(R.roundtrip(lp.record, vals))
    for t, slot in enumerate(np.asarray(slots)):
        if 0 <= slot < 64:
            np.testing.assert_array_equal(_bits(pages[slot // 8, slot % 8]), _bits(want[t]))
    written = {8, 9, 31, 63, 40}
    unwritten = [s for s in range(64) if s not in written]
    assert np.isnan(pages.reshape(64, -1)[unwritten]).all()
    # only the written records' bytes changed (out-of-range and -1 slots dropped, not clamped)
    old_b, new_b = np.asarray(pools[lp.buffer]), np.asarray(new[lp.buffer])
    assert (old_b != new_b).sum() <= len(written) * lp.record_bytes
    assert all(new[k] is pools[k] for k in pools if k != lp.buffer)


def _write_each(layout, pools, writes):
    """For every ``(name, slots, values)``, from the same ``pools``: the buffers after writing
    it and every layer of its group read back. One jit for all (compiling per call is slow)."""
    names = tuple(w[0] for w in writes)

    def run(pools, slots, vals):
        out = []
        for name, sl, va in zip(names, slots, vals):
            after = P.write_layer(layout, pools, name, sl, va)
            group = layout.groups[layout.group_of(name)].layer_names
            out.append((after, {n: P.read_layer(layout, after, n) for n in group}))
        return out

    slots = [jnp.asarray(w[1], jnp.int32) for w in writes]
    return jax.jit(run)(pools, slots, [w[2] for w in writes])


def _check_isolation(layout, names):
    """Write two rows of block 1 of each layer in turn: only its own records' bytes change,
    and every other layer of its group reads back unchanged (aliased layout)."""
    pools = P.init_pools(layout, fill="nan")
    before = jax.jit(lambda p: {n: P.read_layer(layout, p, n) for n in layout.names()})(pools)
    writes = []
    for i, name in enumerate(names):
        lp = layout.layer(name)
        slots = [lp.states, 2 * lp.states - 1]  # first and last row of block 1
        writes.append((name, slots, _values(jax.random.PRNGKey(i), (2, lp.dim))))
    old = np.asarray(pools["pool"])
    for (name, _, _), (after, reads) in zip(writes, _write_each(layout, pools, writes)):
        lp = layout.layer(name)
        idx = np.argwhere(np.asarray(after["pool"]) != old)
        assert len(idx) and (idx[:, 0] == 1).all()
        assert (idx[:, 1] >= lp.offset).all() and (idx[:, 1] < lp.offset + lp.used_bytes).all()
        for other, got in reads.items():
            if other != name:
                np.testing.assert_array_equal(_bits(got), _bits(before[other]))


def test_writes_stay_inside_their_page_tiny(tiny):
    layout = P.PoolLayout.build(tiny, _config(tiny, R.RELEASED, 4), R.RELEASED)
    _check_isolation(layout, layout.names())


def test_writes_stay_inside_their_page_v41_flash_mla_group(flash):
    config, formats = _flash_config(flash, "RELEASED", num_blocks=3)
    layout = P.PoolLayout.build(flash, config, formats)
    # the compressed / index-key group: 8 layers of 4 page shapes (nvfp4 / mxfp4, r = 1 / 2)
    (names,) = [g.layer_names for g in layout.groups if g.kind == "MLAAttentionSpec"]
    assert len(names) == 8
    _check_isolation(layout, names)


@pytest.mark.parametrize("preset", ["EXACT", "RELEASED"])
def test_both_layouts_decode_identically_when_blocks_are_owned_by_one_group(tiny, preset):
    formats = R.PRESETS[preset]
    num_blocks = 24
    config, lay = _layouts(tiny, formats, num_blocks)
    rng = np.random.default_rng(0)
    groups = lay["aliased"].groups
    # every block but the null block belongs to one group, every group owns some blocks
    owner = np.concatenate([[-1], rng.permutation(np.resize(np.arange(len(groups)), 23))])
    writes = []
    for i, lp in enumerate(lay["aliased"].layers):
        mine = np.flatnonzero(owner == lp.group)
        cand = (mine[:, None] * lp.states + np.arange(lp.states)).ravel()
        slots = rng.choice(cand, size=min(len(cand), 6), replace=False)
        slots = np.concatenate([slots, [-1]]).astype(np.int32)
        P.check_slots(lay["aliased"], lp.name, slots)
        writes.append((lp.name, slots, _values(jax.random.PRNGKey(i), (len(slots), lp.dim))))
    pages = {a: _apply_writes(lay[a], P.init_pools(lay[a], fill="nan"), writes) for a in lay}
    for lp in lay["aliased"].layers:
        owned = np.flatnonzero((owner == lp.group) | (owner == -1))
        got = {a: np.asarray(pages[a][lp.name])[owned] for a in lay}
        np.testing.assert_array_equal(_bits(got["aliased"]), _bits(got["separate"]))
        assert np.isnan(got["aliased"][0]).all()  # nothing writes the null block
        _, slots, vals = next(w for w in writes if w[0] == lp.name)
        rows = np.asarray(pages["aliased"][lp.name]).reshape(-1, lp.dim)[slots[:-1]]
        np.testing.assert_array_equal(_bits(rows), _bits(R.roundtrip(lp.record, vals[:-1])))
        other = np.flatnonzero((owner != lp.group) & (owner != -1))
        assert np.isnan(np.asarray(pages["separate"][lp.name])[other]).all()  # no aliasing


def _apply_writes(layout, pools, writes):
    """All ``(name, slots, values)`` writes in order, then every layer read back (one jit)."""
    names = tuple(w[0] for w in writes)

    def run(pools, slots, vals):
        for name, sl, va in zip(names, slots, vals):
            pools = P.write_layer(layout, pools, name, sl, va)
        return {n: P.read_layer(layout, pools, n) for n in layout.names()}

    return jax.jit(run)(pools, [jnp.asarray(w[1]) for w in writes], [w[2] for w in writes])


def test_ring_helpers(tiny):
    config, lay = _layouts(tiny, R.BF16, 6, num_speculative_tokens=3)
    for layout in lay.values():
        pools = P.init_pools(layout)
        name = ring_name(1)
        rows = _values(jax.random.PRNGKey(3), (4, 128))
        slots = jnp.asarray([8 * 2 + 0, 8 * 2 + 7, 8 * 5 + 3, -1])
        pools = P.write_ring(layout, pools, name, slots, rows)
        ring = np.asarray(P.read_ring(layout, pools, name))
        assert ring.shape == (6, 8, 128)
        np.testing.assert_array_equal(ring[2, 0], rows[0])  # raw f32, exact
        np.testing.assert_array_equal(ring[2, 7], rows[1])
        np.testing.assert_array_equal(ring[5, 3], rows[2])
        assert np.count_nonzero(ring) == 3 * 128
        with pytest.raises(ValueError, match="not a compressor ring"):
            P.read_ring(layout, pools, swa_cache_name(1))
        with pytest.raises(ValueError, match="not a compressor ring"):
            P.write_ring(layout, pools, compressed_kv_name(1), slots, rows)


def test_read_blocks_never_clamps(tiny):
    config, lay = _layouts(tiny, R.RELEASED, 6)
    layout = lay["aliased"]
    name = indexer_k_name(3)
    lp = layout.layer(name)
    pools = P.init_pools(layout)  # zeros: a clamped read would give zeros, not NaN
    pools = P.write_layer(
        layout,
        pools,
        name,
        jnp.arange(6 * lp.states),
        _values(jax.random.PRNGKey(1), (6 * lp.states, lp.dim)),
    )
    full = np.asarray(P.read_layer(layout, pools, name))
    ids = jnp.asarray([[5, 2], [6, -1]])
    got = np.asarray(P.read_blocks(layout, pools, name, ids))
    assert got.shape == (2, 2, lp.states, lp.dim)
    np.testing.assert_array_equal(got[0, 0], full[5])
    np.testing.assert_array_equal(got[0, 1], full[2])
    assert np.isnan(got[1]).all()


def test_small_reads_of_a_large_pool_stay_on_one_thread(tiny):
    """XLA:CPU splits a fusion over threads by its operands' bytes, and a gather counts all of
    its operand: a decode step's few pages read from a pool of 64 blocks (576 KB, one request's
    engine) were split in two, waiting on a second thread for microseconds of work. Reads now
    see only their layer's bytes (64 or 128 KB here); their bytes: the test below."""
    config, lay = _layouts(tiny, R.EXACT, 64)
    layout = lay["aliased"]
    pools = P.init_pools(layout)
    swa, comp = swa_cache_name(1), compressed_kv_name(1)
    ids = jnp.asarray([3, 5, 7, 9, 11, 64], jnp.int32)
    reads = {
        "read_blocks": (lambda p, i: P.read_blocks(layout, p, swa, i), (pools, ids)),
        "read_selected": (
            lambda p, *a: P.read_selected(layout, p, comp, *a),
            (pools, jnp.asarray([[1, 2]]), jnp.zeros(2, jnp.int32), jnp.asarray([40, 41]),
             jnp.asarray([[0, 1, 2, -1]] * 2)),
        ),
    }  # fmt: skip
    for what, (read, args) in reads.items():
        text = jax.jit(read).lower(*args).compile().as_text()
        assert 'outer_dimension_partitions":["' not in text, what


@pytest.mark.parametrize("gather", ["_gather_bytes", "_gather_in_layer", "_gather_in_buffer"])
def test_gathered_bytes_match_numpy(tiny, gather):
    """Each platform's page read (XLA:CPU's from the layer's columns, every other platform's
    from the whole buffer; only the first runs here unless called by name) gives the stored
    bytes inside the layer and 0xFF for a run past the pool or outside the layer's bytes, on
    either side (the columns of the layers around it)."""
    _, lay = _layouts(tiny, R.EXACT, 64)
    layout = lay["aliased"]
    lp = max((layout.layer(name) for name in layout.names()), key=lambda lp: lp.offset)
    assert lp.offset >= 8  # a layer with another's bytes before it
    shape = P.init_pools(layout)["pool"].shape
    buf = np.random.default_rng(3).integers(0, 256, shape).astype(np.uint8)
    end = lp.offset + lp.used_bytes
    blocks = jnp.asarray([3, 5, 64, 7, 9], jnp.int32)  # 64: past the pool
    cols = jnp.asarray([lp.offset, end - 8, lp.offset, end - 4, lp.offset - 4], jnp.int32)
    got = np.asarray(getattr(P, gather)(jnp.asarray(buf), lp, blocks, cols, 8))
    np.testing.assert_array_equal(got[0], buf[3, lp.offset : lp.offset + 8])
    np.testing.assert_array_equal(got[1], buf[5, end - 8 : end])
    assert (got[2:] == 0xFF).all()  # past the pool; past the layer's end; before its start


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_init_pools_fills(tiny, preset):
    formats = R.PRESETS[preset]
    layout = P.PoolLayout.build(tiny, _config(tiny, formats, 3), formats)
    nan, zero = P.init_pools(layout, fill="nan"), P.init_pools(layout)
    for name in layout.names():
        assert np.isnan(np.asarray(P.read_layer(layout, nan, name))).all()
        assert not np.asarray(P.read_layer(layout, zero, name)).any()
    assert jax.eval_shape(lambda: P.init_pools(layout)) == layout.abstract_pools()
    with pytest.raises(ValueError, match="fill"):
        P.init_pools(layout, fill="ones")


def test_layout_is_a_static_jit_argument(tiny):
    formats = R.RELEASED
    config = _config(tiny, formats, 5)
    layout = P.PoolLayout.build(tiny, config, formats)
    traces = []

    def step(layout, pools, slots, vals):
        traces.append(1)
        pools = P.write_layer(layout, pools, swa_cache_name(2), slots, vals)
        return pools, P.read_layer(layout, pools, swa_cache_name(2))

    jstep = jax.jit(step, static_argnums=0, donate_argnums=1)
    pools = P.init_pools(layout, fill="nan")
    for i in range(3):
        again = P.PoolLayout.build(tiny, config, formats)  # equal and equally hashed
        vals = _values(jax.random.PRNGKey(i), (2, 64))
        pools, pages = jstep(again, pools, jnp.asarray([4 + i, 8 + i]), vals)
    assert len(traces) == 1
    np.testing.assert_array_equal(_bits(pages[1, 2]), _bits(R.roundtrip("mxfp8", vals[0])))
    np.testing.assert_array_equal(_bits(pages[2, 2]), _bits(R.roundtrip("mxfp8", vals[1])))


# --- debug checks and errors -----------------------------------------------------------------


def test_check_slots(tiny):
    layout = P.PoolLayout.build(tiny, _config(tiny, R.BF16, 8), R.BF16)
    name = compressed_kv_name(1)  # 8 states per page, 64 slots
    P.check_slots(layout, name, np.array([-1, 8, 63, -1]))
    for bad, where in ((64, "slot 64 at index \\[1\\]"), (-2, "slot -2"), (3, "null block")):
        with pytest.raises(ValueError, match=where) as err:
            P.check_slots(layout, name, np.array([9, bad]))
        msg = str(err.value)
        assert name in msg and "[8, 64)" in msg and "-1 = no write" in msg
    P.check_slots(layout, name, np.array([3]), allow_null_block=True)
    with pytest.raises(ValueError, match="slot 9 is written 2 times"):
        P.check_slots(layout, name, np.array([9, -1, 9]))
    with pytest.raises(ValueError, match="integers"):
        P.check_slots(layout, name, np.array([1.0]))


def test_check_block_ids(tiny):
    layout = P.PoolLayout.build(tiny, _config(tiny, R.BF16, 8), R.BF16)
    mla = next(g.group for g in layout.groups if g.kind == "MLAAttentionSpec")
    P.check_block_ids(layout, mla, np.array([[1, 7, 0], [0, 0, 0]]))
    for bad in (8, -1):
        with pytest.raises(ValueError, match=f"block id {bad} at \\[1, 2\\]") as err:
            P.check_block_ids(layout, mla, np.array([[1, 7, 0], [0, 0, bad]]))
        assert f"group {mla} (MLAAttentionSpec" in str(err.value) and "[0, 8)" in str(err.value)
    with pytest.raises(ValueError, match="no KV-cache group 99"):
        P.check_block_ids(layout, 99, np.array([1]))


def test_build_and_call_errors(tiny):
    config = _config(tiny, R.BF16, 4)
    with pytest.raises(ValueError, match="cache_desc") as err:
        P.PoolLayout.build(tiny, config, R.EXACT)
    assert "128-B states" in str(err.value) and "256 B" in str(err.value)
    with pytest.raises(ValueError, match="'aliased' or 'separate'"):
        P.PoolLayout.build(tiny, config, R.BF16, "packed")
    with pytest.raises(ValueError, match="no cache layer"):
        P.PoolLayout.build(tiny, config, R.BF16).layer("model.layers.5.attn")
    desc = P.cache_desc(tiny, R.BF16, block_size=16, swa_block_size=4)
    extra = for_model(dataclasses.replace(desc, num_draft_layers=2), num_gpu_blocks_override=4)
    with pytest.raises(ValueError, match=r"model\.layers\.9\.attn\.swa_cache.*has no cache for"):
        P.PoolLayout.build(tiny, extra, R.BF16)
    a = P.PoolLayout.build(tiny, config, R.BF16)
    s = P.PoolLayout.build(tiny, config, R.BF16, "separate")
    with pytest.raises(ValueError, match="separate layout"):
        P.read_layer(s, P.init_pools(a), swa_cache_name(0))
    with pytest.raises(ValueError, match=r"values \[T, 64\]"):
        P.write_layer(a, P.init_pools(a), swa_cache_name(0), jnp.asarray([4]), jnp.zeros((1, 32)))


def test_cache_memory_benchmark_agrees_with_section_3_3():
    import json

    from benchmarks.cache_memory import SECTION_3_3, run_benchmark

    res = run_benchmark(num_blocks=10, max_model_len=4096)
    json.dumps(res)
    assert res["all_checks_ok"]
    assert set(res["results"]) == set(R.PRESETS)
    assert all(f"{p}/{k}" in res["checks"] for p, kinds in SECTION_3_3.items() for k in kinds)
    released = res["results"]["RELEASED"]
    assert released["aliased"]["bytes_per_block"] == 114688
    assert released["layers"]["index_r2"] == {
        "count": 3,
        "record": "mxfp4",
        "record_bytes": 68,
        "real_page_bytes": 4352,
        "page_bytes": 4608,
        "states_per_page": 64,
        "tokens_per_page": 128,
        "bytes_per_token_per_layer": 36.0,
    }
    for entry in res["results"].values():
        assert entry["separate"]["bytes_per_block"] > entry["aliased"]["bytes_per_block"]


@pytest.mark.parametrize("alias", ["aliased", "separate"])
def test_fill_blocks_resets_whole_blocks(tiny, alias):
    formats = R.RELEASED
    layout = P.PoolLayout.build(tiny, _config(tiny, formats, 5), formats, alias)
    pools = P.init_pools(layout)
    name = ring_name(1)  # f32 rows: stale floats in a block later used by a uint8-record group
    pools = P.write_ring(
        layout, pools, name, jnp.arange(8, 40), _values(jax.random.PRNGKey(0), (32, 128))
    )
    pools = P.fill_blocks(layout, pools, jnp.asarray([2, -1, 4, 9]), fill="nan")
    for key, buf in pools.items():
        rows = np.asarray(buf)
        assert (rows[[2, 4]] == 0xFF).all() and not rows[0].any(), key
        assert rows[[1, 3]].any() == (key == layout.layer(name).buffer), key  # others kept
    for n in layout.names():
        assert np.isnan(np.asarray(P.read_layer(layout, pools, n))[[2, 4]]).all()
    pools = P.fill_blocks(layout, pools, jnp.asarray([1, 2]))
    assert not np.asarray(P.read_ring(layout, pools, name))[[1, 2]].any()
    with pytest.raises(ValueError, match="fill"):
        P.fill_blocks(layout, pools, jnp.asarray([1]), fill="x")


# --- reads of only the pages a block table references ----------------------------------------


def _written_pools(layout, seed, names):
    """NaN-filled pools with random records in about half of the slots of layers ``names``."""
    rng = np.random.default_rng(seed)
    pools = P.init_pools(layout, fill="nan")
    for i, name in enumerate(names):
        lp = layout.layer(name)
        n = layout.num_blocks * lp.states
        slots = np.sort(rng.choice(np.arange(lp.states, n), size=n // 2, replace=False))
        vals = _values(jax.random.PRNGKey(seed * 100 + i), (len(slots), lp.dim))
        pools = P.write_layer(layout, pools, lp.name, jnp.asarray(slots, jnp.int32), vals)
    return pools


def _same_pages(got, want):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # NaN == NaN here


@functools.cache
def _jit_read_for_table(layout, name, window=None):
    def run(pools, table, positions=None, token_req=None):
        kw = {} if window is None else dict(positions=positions, token_req=token_req, window=window)
        return P.read_for_table(layout, pools, name, table, **kw), P.read_layer(layout, pools, name)

    return jax.jit(run)


@pytest.mark.parametrize("preset", ["EXACT", "RELEASED"])
@pytest.mark.parametrize("which", ["compressed", "index"])
def test_read_for_table_gathers_every_table_entry(tiny, preset, which):
    formats = R.PRESETS[preset]
    layout = P.PoolLayout.build(tiny, _config(tiny, formats, 40), formats)
    name = (compressed_kv_name if which == "compressed" else indexer_k_name)(1)
    pools = _written_pools(layout, 3, [name, swa_cache_name(1)])  # groups overlap in a row
    rng = np.random.default_rng(4)
    run = _jit_read_for_table(layout, name)
    for _ in range(3):
        table = rng.integers(0, 40, (4, 6)).astype(np.int32)  # 4 * 6 + 1 < 40: gathered
        table[:, 4:] = 0
        (pages, table2), full = run(pools, jnp.asarray(table))
        assert pages.shape == (25, *full.shape[1:]) and full.shape[0] == 40
        np.testing.assert_array_equal(np.asarray(table2), 1 + np.arange(24).reshape(4, 6))
        _same_pages(np.asarray(pages)[np.asarray(table2)], np.asarray(full)[table])
        _same_pages(pages[0], full[0])
    # an id outside the pool reads NaN, never another block (zero-filled pool: no NaN elsewhere)
    zeros = P.init_pools(layout)
    (pages, table2), _ = run(zeros, jnp.asarray([[3, 40, -1, 0, 0, 0]] * 4, jnp.int32))
    got = np.asarray(pages)[np.asarray(table2)[0]]
    assert np.isnan(got[1:3]).all() and not got[[0, 3, 4, 5]].any()


def test_read_for_table_falls_back_to_the_whole_pool(tiny):
    layout = P.PoolLayout.build(tiny, _config(tiny, R.RELEASED, 40), R.RELEASED)
    name, swa = indexer_k_name(3), swa_cache_name(2)
    pools = _written_pools(layout, 5, [name, swa])
    table = np.random.default_rng(6).integers(0, 40, (8, 5)).astype(np.int32)  # 41 >= 40
    (pages, table2), full = _jit_read_for_table(layout, name)(pools, jnp.asarray(table))
    assert pages.shape == full.shape
    _same_pages(pages, full)
    np.testing.assert_array_equal(np.asarray(table2), table)
    # the window path: capacity + null copy + NaN page >= 40 (R = 16, T = 32: bound 72)
    assert P.window_page_bound(32, 16, 8, 4) == 72
    table = np.random.default_rng(7).integers(0, 40, (16, 24)).astype(np.int32)
    pos = np.arange(32, dtype=np.int32)
    req = np.zeros(32, np.int32)
    run = _jit_read_for_table(layout, swa, 8)
    (pages, table2), full = run(pools, jnp.asarray(table), jnp.asarray(pos), jnp.asarray(req))
    assert pages.shape == full.shape
    _same_pages(pages, full)
    np.testing.assert_array_equal(np.asarray(table2), table)


@pytest.mark.parametrize("preset", ["EXACT", "RELEASED"])
@pytest.mark.parametrize("k", [6, 5])
def test_read_selected_decodes_each_pick(tiny, preset, k):
    """`read_selected` gives token t's pick j as entry j of page t: the record `read_layer`
    decodes at (table[token_req[t], id // E], id % E), 0 for -1 picks and padding tokens, NaN
    (never another block) for an id outside the pool; an odd K gets one more -1 pick."""
    formats = R.PRESETS[preset]
    layout = P.PoolLayout.build(tiny, _config(tiny, formats, 40), formats)
    name = compressed_kv_name(1)
    e = layout.layer(name).states
    pools = _written_pools(layout, 8, [name, swa_cache_name(1)])
    full = np.asarray(P.read_layer(layout, pools, name))
    run = jax.jit(functools.partial(P.read_selected, layout, name=name))
    rng = np.random.default_rng(9)
    num_req, nb, num_tok = 3, 5, 7
    table = rng.integers(0, 40, (num_req, nb)).astype(np.int32)
    token_req = rng.integers(0, num_req, num_tok).astype(np.int32)
    positions = rng.integers(0, 50, num_tok).astype(np.int32)
    positions[2] = -1
    topk = np.stack([rng.permutation(nb * e)[:k] for _ in range(num_tok)]).astype(np.int32)
    topk[0, 1] = topk[4, -1] = -1
    pages, table2, req2, topk2 = run(pools, table=table, token_req=token_req,
                                     positions=positions, topk=topk)  # fmt: skip
    k2 = k + k % 2
    assert pages.shape == (num_tok, k2, full.shape[-1]) and pages.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(table2), np.arange(num_tok)[:, None])
    np.testing.assert_array_equal(np.asarray(req2), np.arange(num_tok))
    pages, topk2 = np.asarray(pages), np.asarray(topk2)
    for t in range(num_tok):
        for j in range(k2):
            pick = topk[t, j] if j < k else -1
            if pick < 0 or positions[t] < 0:
                assert topk2[t, j] == -1 and not pages[t, j].any()
            else:
                assert topk2[t, j] == j
                _same_pages(pages[t, j], full[table[token_req[t], pick // e], pick % e])
    # bf16: the same records, rounded once
    half = P.read_selected(
        layout, pools, name, table, token_req, positions, topk, dtype=jnp.bfloat16
    )
    _same_pages(half[0], pages.astype(jnp.bfloat16))
    # a block id outside the pool reads NaN
    bad = table.copy()
    bad[token_req[3], topk[3, 0] // e] = 40
    got = np.asarray(run(pools, table=bad, token_req=token_req, positions=positions, topk=topk)[0])
    assert np.isnan(got[3, 0]).all()
    with pytest.raises(ValueError, match="compressed-entry"):
        P.read_selected(layout, pools, indexer_k_name(1), table, token_req, positions, topk)
    with pytest.raises(ValueError, match=r"must be \[T\]"):
        P.read_selected(layout, pools, name, table, token_req[:3], positions, topk)
    assert P.selected_is_smaller(layout, name, (4, 6), (8, 16)) == (25 * e > 8 * 16)
    assert not P.selected_is_smaller(layout, name, (16, 6), (256, 16))


@pytest.mark.parametrize("preset", ["EXACT", "RELEASED"])
def test_decode_in_chunks_reads_the_same_pages(tiny, preset):
    """A read decoded in a loop of ``chunk`` pages (3 and 7: the last chunk overlaps the one
    before it; 40: one chunk) gives the pages of a read decoded at once, bit for bit, for
    whole layers, gathered blocks (ids outside the pool read NaN) and `read_for_table`; a
    bad chunk is an error naming it."""
    formats = R.PRESETS[preset]
    layout = P.PoolLayout.build(tiny, _config(tiny, formats, 40), formats)
    names = [compressed_kv_name(1), indexer_k_name(1), swa_cache_name(1)]
    pools = _written_pools(layout, 11, names)
    ids = jnp.asarray(np.random.default_rng(3).integers(-1, 42, (5, 4)), jnp.int32)
    table = ids[:4, :3] % 40

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def reads(pools, name, chunk):
        kw = dict(dtype=jnp.bfloat16, chunk=chunk)
        return (P.read_layer(layout, pools, name, chunk=chunk),
                P.read_blocks(layout, pools, name, ids, **kw),
                P.read_for_table(layout, pools, name, table, chunk=chunk,
                                 **({} if "swa" not in name else dict(
                                     positions=jnp.arange(8, dtype=jnp.int32),
                                     token_req=jnp.zeros(8, jnp.int32), window=8))))  # fmt: skip

    for name in names:
        want = reads(pools, name, None)
        assert np.isnan(np.asarray(want[1].astype(jnp.float32))[np.asarray(ids) >= 40]).all()
        for chunk in (3, 7, 40):
            got = reads(pools, name, chunk)
            jax.tree.map(_same_pages, got, want)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=f"chunk must be .* got {bad!r}"):
            P.read_layer(layout, pools, names[0], chunk=bad)


def _window_batch(rng, num_req, num_tok, nb, page, num_blocks):
    """Random contiguous chunks of the first requests (some rows get nothing), padding tokens
    (position -1, the last row) and full-width tables whose early columns may be 0."""
    table = rng.integers(1, num_blocks, (num_req, nb)).astype(np.int32)
    positions = np.full(num_tok, -1, np.int32)
    token_req = np.full(num_tok, num_req - 1, np.int32)
    t = 0
    for r in range(num_req - 1):
        n = int(rng.integers(0, 9))
        if rng.random() < 0.3 or t + n > num_tok:
            continue
        start = int(rng.integers(0, nb * page - n + 1))
        positions[t : t + n] = np.arange(start, start + n)
        token_req[t : t + n] = r
        table[r, : int(rng.integers(0, max(start // page - 1, 0) + 1))] = 0  # SWA: early nulls
        t += n
    table[num_req - 1] = 0
    return table, positions, token_req


@pytest.mark.parametrize("preset", ["EXACT", "RELEASED"])
def test_read_for_table_window_columns(tiny, preset):
    """Every column a window reads maps to the same decoded page; every other column to a
    NaN page; the gathered pages are far fewer than the pool."""
    formats = R.PRESETS[preset]
    window, page, nb, num_req, num_tok = 8, 4, 24, 8, 32
    layout = P.PoolLayout.build(tiny, _config(tiny, formats, 160), formats)
    name = swa_cache_name(2)
    assert layout.layer(name).states == page
    pools = _written_pools(layout, 8, [name, compressed_kv_name(3)])
    rng = np.random.default_rng(9)
    run = _jit_read_for_table(layout, name, window)
    capacity = P.window_page_bound(num_tok, num_req, window, page)
    assert capacity == 8 + 8 * 4
    for _ in range(6):
        table, pos, req = _window_batch(rng, num_req, num_tok, nb, page, 160)
        (pages, table2), full = run(pools, *map(jnp.asarray, (table, pos, req)))
        pages, table2, full = np.asarray(pages), np.asarray(table2), np.asarray(full)
        assert pages.shape == (capacity + 2, *full.shape[1:]) and full.shape[0] == 160
        assert (table2 >= 0).all() and (table2 <= capacity).all()  # nothing overflowed
        _same_pages(pages[0], full[0])
        needed = np.zeros(table.shape, bool)
        for p, r in zip(pos, req):
            if p >= 0:
                needed[r, max(p - window + 1, 0) // page : p // page + 1] = True
        rows, cols = np.nonzero(needed)
        _same_pages(pages[table2[rows, cols]], full[table[rows, cols]])
        assert (table2[~needed] == 0).all()  # the copy of the null block: NaN here
        assert np.isnan(pages[table2[~needed]]).all()
        assert len(np.unique(table2[needed])) == needed.sum()  # one packed page per column


def test_window_page_bound_is_a_bound():
    """Brute force over contiguous chunks: the columns one request reads never exceed its share
    ``n // S + (W + 2S - 4) // S + 1`` of `window_page_bound`, and the share is reached."""
    for window, page in itertools.product(range(1, 10), range(1, 6)):
        for n in range(1, 13):
            share = n // page + (window + 2 * page - 4) // page + 1
            most = max(
                (p0 + n - 1) // page - max(p0 - window + 1, 0) // page + 1 for p0 in range(40)
            )
            assert most <= share, (window, page, n, most, share)
            if n % page == page - 1 or page == 1:
                assert most == share, (window, page, n, most, share)
    assert P.window_page_bound(2048, 256, 128, 32) == 64 + 256 * 6
    with pytest.raises(ValueError, match="window, page >= 1"):
        P.window_page_bound(32, 8, 0, 4)


def test_read_for_table_window_overflow_reads_nan(tiny):
    """A request whose positions are not contiguous can need more columns than the static
    capacity: those columns read a NaN page (also from a zero-filled pool), never clamped."""
    layout = P.PoolLayout.build(tiny, _config(tiny, R.EXACT, 160), R.EXACT)
    name = swa_cache_name(0)
    pools = P.init_pools(layout)
    table = np.zeros((2, 24), np.int32)
    table[0] = np.arange(1, 25)
    pos, req = np.array([0, 90], np.int32), np.array([0, 0], np.int32)
    capacity = P.window_page_bound(2, 2, 8, 4)  # 8: columns 0..22 do not fit
    (pages, table2), _ = _jit_read_for_table(layout, name, 8)(
        pools, *map(jnp.asarray, (table, pos, req))
    )
    pages, table2 = np.asarray(pages), np.asarray(table2)
    assert pages.shape[0] == capacity + 2
    np.testing.assert_array_equal(table2[0, :capacity], np.arange(1, capacity + 1))
    assert (table2[0, capacity:23] == capacity + 1).all() and table2[0, 23] == 0
    assert np.isnan(pages[capacity + 1]).all() and not np.isnan(pages[: capacity + 1]).any()


def test_read_ring_for_table(tiny):
    config, lay = _layouts(tiny, R.BF16, 12, num_speculative_tokens=3)
    for layout in lay.values():
        name = ring_name(1)
        pools = _written_pools(layout, 10, [name])
        full = np.asarray(P.read_ring(layout, pools, name))
        ring_block = np.array([3, 0, 11, 7, 0], np.int32)  # 5 + 1 < 12: gathered
        pages, rb2 = P.read_ring_for_table(layout, pools, name, jnp.asarray(ring_block))
        pages, rb2 = np.asarray(pages), np.asarray(rb2)
        assert pages.shape == (6, *full.shape[1:])
        np.testing.assert_array_equal(rb2, [1, 0, 3, 4, 0])
        _same_pages(pages[rb2], full[ring_block])
        bad = P.read_ring_for_table(layout, pools, name, jnp.asarray([12, -1], jnp.int32))
        assert np.isnan(np.asarray(bad[0])[np.asarray(bad[1])]).all()  # never clamped
        big = np.resize(ring_block, 11)  # 11 + 1 >= 12: the whole ring
        pages, rb2 = P.read_ring_for_table(layout, pools, name, jnp.asarray(big))
        _same_pages(pages, full)
        np.testing.assert_array_equal(np.asarray(rb2), big)


def test_read_for_table_errors(tiny):
    layout = P.PoolLayout.build(tiny, _config(tiny, R.BF16, 40), R.BF16)
    pools = P.init_pools(layout)
    table = jnp.zeros((2, 6), jnp.int32)
    with pytest.raises(ValueError, match="read_ring_for_table"):
        P.read_for_table(layout, pools, ring_name(1), table)
    with pytest.raises(ValueError, match="needs positions, token_req and window"):
        P.read_for_table(layout, pools, swa_cache_name(0), table)
    pos = jnp.zeros(4, jnp.int32)
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        P.read_for_table(layout, pools, swa_cache_name(0), table, positions=pos, token_req=pos,
                         window=0)  # fmt: skip
    with pytest.raises(ValueError, match=r"token_req \[3\] must both be \[T\]"):
        P.read_for_table(layout, pools, swa_cache_name(0), table, positions=pos,
                         token_req=pos[:3], window=8)  # fmt: skip
    with pytest.raises(
        ValueError, match=r"table must be an integer array of 2 dims, got int32\[6\]"
    ):
        P.read_for_table(layout, pools, compressed_kv_name(1), table[0])
    with pytest.raises(ValueError, match=r"ring_block must be an integer array of 1 dims"):
        P.read_ring_for_table(layout, pools, ring_name(1), jnp.zeros((2, 1), jnp.float32))
    with pytest.raises(ValueError, match="not a compressor ring"):
        P.read_ring_for_table(layout, pools, compressed_kv_name(1), table[:, 0])


@pytest.mark.parametrize("num_blocks", [40, 20])  # gathered (4 x 6 + 1 < 40), whole pool
def test_scaled_reads_of_fp8_index_keys(tiny, num_blocks):
    """``scaled=True`` hands fp8_132 records over undecoded: values x scale is the decoded page
    bit for bit (power-of-two scales), NaN pages stay NaN, other records are refused."""
    formats = R.RELEASED_FP8
    layout = P.PoolLayout.build(tiny, _config(tiny, formats, num_blocks), formats)
    name = indexer_k_name(1)
    pools = _written_pools(layout, 8, [name])
    table = np.random.default_rng(9).integers(0, num_blocks, (4, 6)).astype(np.int32)
    (values, scales), table2 = P.read_for_table(
        layout, pools, name, jnp.asarray(table), scaled=True
    )
    pages, table3 = P.read_for_table(layout, pools, name, jnp.asarray(table))
    assert values.dtype == jnp.float8_e4m3fn and scales.dtype == jnp.float32
    assert values.shape == pages.shape and scales.shape == pages.shape[:2]
    np.testing.assert_array_equal(np.asarray(table2), np.asarray(table3))
    e = np.asarray(scales)
    assert np.all(np.isnan(e) | (np.log2(e) == np.round(np.log2(e))))  # powers of two
    _same_pages(values.astype(jnp.float32) * scales[..., None], pages)
    assert np.isnan(np.asarray(values.astype(jnp.float32))[0]).all()  # the NaN null block
    with pytest.raises(ValueError, match="fp8_132"):
        P.read_for_table(layout, pools, compressed_kv_name(1), jnp.asarray(table), scaled=True)
