"""The paged step against the whole-sequence reference, under random schedules.

Block ids come from the host allocator (`cache.KVCacheManager`) on the tiny V4.1 layout, so
physical blocks are scattered and reused; unused pages start NaN-filled. Every real token's logits
must equal `reference.forward` of its sequence at its position: fp32 records within 1e-4 for both
pool layouts; bf16 records and the released fp8/FP4 records within measured tolerances (see the
tests' docstrings).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_harness import Harness, Seq, plan_step, random_schedule

from cache.layout import compressed_kv_name, indexer_k_name, ring_name, swa_cache_name
from dsv4 import reference
from dsv4.paged import pools as P
from dsv4.paged import records as R
from dsv4.paged.batch import StepRequest, build_batch, group_infos

WIDTH = 64  # reference width: every test sequence is at most this long
# A pool small enough that the scheduler preempts; 64 request rows (more than the pool's blocks)
# make every read decode the whole pool. The tests that use it share its jitted step.
SMALL_POOL = dict(num_blocks=32, request_buckets=(64,))


@functools.cache
def _ref_fn():
    return jax.jit(reference.forward, static_argnums=1)


def reference_logits(params, cfg, seqs):
    """Reference logits of each sequence (padded to WIDTH; the forward is causal)."""
    toks = np.zeros((len(seqs), WIDTH), np.int32)
    for i, s in enumerate(seqs):
        toks[i, : len(s.tokens)] = s.tokens
    return np.asarray(_ref_fn()(params, cfg, jnp.asarray(toks)))


def make_seqs(cfg, rng, n, *, shared_prefix=0):
    prefix = rng.integers(3, cfg.vocab_size, shared_prefix)
    seqs = []
    for i in range(n):
        length = int(rng.integers(max(shared_prefix + 4, 20), WIDTH + 1))
        tail = rng.integers(3, cfg.vocab_size, length - shared_prefix)
        tokens = np.concatenate([prefix, tail]).astype(np.int32)
        prompt = int(rng.integers(shared_prefix + 1, length)) if i % 2 else length
        seqs.append(Seq(i, tokens, prompt))
    return seqs


def compare(h: Harness, ref, seqs, atol):
    """Every computed position against the reference. Positions a request took from another
    request's cached blocks are never computed for it (also after a preemption)."""
    worst = 0.0
    for s in seqs:
        computed = sorted(p for sid, p in h.logits if sid == s.sid)
        assert computed, f"sequence {s.sid} never computed"
        assert computed[-1] == len(s.tokens) - 1, f"sequence {s.sid} did not finish"
        for p in computed:
            got = h.logits[(s.sid, p)]
            assert np.isfinite(got).all(), f"sequence {s.sid} position {p}: non-finite logits"
            worst = max(worst, float(np.abs(got - ref[s.sid, p]).max()))
    assert worst <= atol, worst
    return worst


def read_paths(h: Harness) -> dict[str, bool]:
    """Per cache kind, whether the step's reads gather pages by table (True) or decode the whole
    pool (False) at the harness's bucket shapes (a static choice: shapes only)."""
    layout, cfg = h.layout, h.cfg
    vec = jax.ShapeDtypeStruct((h.token_buckets[-1],), jnp.int32)
    width = {g.index: 1 if g.kind == "ring" else -(-h.max_model_len // g.block_size)
             for g in group_infos(h.config)}  # fmt: skip
    src = cfg.kv_source_layers[0]  # ratio 2: it has a ring
    names = {"swa": swa_cache_name(src), "compressed": compressed_kv_name(src),
             "index": indexer_k_name(src), "ring": ring_name(src)}  # fmt: skip

    def read(kind, table, positions, token_req):
        if kind == "ring":
            return P.read_ring_for_table(layout, h.pools, names[kind], table[:, 0])
        kw = {}
        if kind == "swa":
            kw = dict(positions=positions, token_req=token_req, window=cfg.window_size)
        return P.read_for_table(layout, h.pools, names[kind], table, **kw)

    out = {}
    for kind, name in names.items():
        table = jax.ShapeDtypeStruct(
            (h.request_buckets[-1], width[layout.group_of(name)]), jnp.int32
        )
        pages, _ = jax.eval_shape(functools.partial(read, kind), table, vec, vec)
        out[kind] = pages.shape[0] < layout.num_blocks
    return out


@pytest.mark.parametrize(
    "layout_kind,pool",
    [
        ("aliased", "large"),
        pytest.param("separate", "large", marks=pytest.mark.slow),
        ("aliased", "small"),
    ],
)
def test_random_schedules_fp32_records(tiny_params, tiny_cfg, layout_kind, pool):
    """The default harness pool (160 blocks, 8 request rows) makes every read gather its pages
    by table; the small pool (32 blocks, 64 request rows) makes every read decode the whole
    pool (the sparse attention's decode steps read only their picks in both: see
    test_sparse_attention_reads_only_the_picked_entries), and the scheduler preempts in it. The large pool never fills (these
    schedules hold at most 37 blocks at once, and with 8 rows every read gathers only in pools
    of 56 blocks or more), so only the small one preempts. Every run has prefix hits and
    accepted and rejected drafts."""
    rng = np.random.default_rng({"aliased": 0, "separate": 1}[layout_kind] + 2 * (pool == "small"))
    seqs = make_seqs(tiny_cfg, rng, 6, shared_prefix=32)
    ref = reference_logits(tiny_params, tiny_cfg, seqs)
    kw = SMALL_POOL if pool == "small" else {}
    h = Harness(tiny_cfg, tiny_params, R.CacheFormats.EXACT, layout_kind,
                num_speculative_tokens=3, **kw)  # fmt: skip
    gathered = pool == "large"
    assert read_paths(h) == dict.fromkeys(("swa", "compressed", "index", "ring"), gathered)
    random_schedule(h, seqs, rng, spec_k=3)
    compare(h, ref, seqs, 1e-4)
    st = h.stats
    assert max(st.prefix_hits) >= 16, st
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens, st
    assert (st.num_preempted > 0) == (pool == "small"), st


@pytest.mark.slow  # fast representative: tests/serving/test_engine.py::test_trimmed_block_tables
def test_tables_trimmed_to_the_longest_request(tiny_params, tiny_cfg):
    """`table_buckets`: each step's tables are only as wide as its longest request needs (in
    power-of-two buckets), so early steps decode and address fewer pages; same logits."""
    rng = np.random.default_rng(9)
    seqs = make_seqs(tiny_cfg, rng, 5, shared_prefix=16)
    ref = reference_logits(tiny_params, tiny_cfg, seqs)
    h = Harness(tiny_cfg, tiny_params, R.CacheFormats.EXACT, num_speculative_tokens=2,
                table_buckets=(1, 2, 4, 8, 16))  # fmt: skip
    random_schedule(h, seqs, rng, spec_k=2)
    compare(h, ref, seqs, 1e-4)
    full = tuple(1 if g.kind == "ring" else -(-h.max_model_len // g.block_size)
                 for g in group_infos(h.config))  # fmt: skip
    assert len(h.table_widths) >= 3 and full not in h.table_widths, h.table_widths
    assert all(w <= f for ws in h.table_widths for w, f in zip(ws, full))


def test_prefix_hits_and_preemption_are_exercised(tiny_params, tiny_cfg):
    """The schedule really shares cached blocks and recomputes preempted requests: in the small
    pool the scheduler preempts the last of 4 running requests in mid-prefill, and it resumes
    from a 32-token hit."""
    rng = np.random.default_rng(5)
    seqs = make_seqs(tiny_cfg, rng, 4, shared_prefix=40)
    ref = reference_logits(tiny_params, tiny_cfg, seqs)
    h = Harness(tiny_cfg, tiny_params, R.CacheFormats.EXACT, **SMALL_POOL)
    random_schedule(h, seqs, rng, max_running=4)
    compare(h, ref, seqs, 1e-4)
    assert h.stats.num_preempted > 0, h.stats
    assert max(h.stats.prefix_hits) >= 32, h.stats


def _diffs(params, cfg, formats) -> np.ndarray:
    """Max-abs logit differences from the reference of every position of one seeded schedule
    (3 sequences, 149 positions) run in ``formats``; all finite."""
    rng = np.random.default_rng(2)
    seqs = make_seqs(cfg, rng, 3)
    ref = reference_logits(params, cfg, seqs)
    h = Harness(cfg, params, formats)
    random_schedule(h, seqs, rng)
    d = np.array([np.abs(v - ref[sid, p]).max() for (sid, p), v in h.logits.items()])
    assert np.isfinite(d).all()
    return d


def test_bf16_records(tiny_params, tiny_cfg):
    """bf16 records round every cached latent, entry and index key to 8 mantissa bits while the
    activations stay fp32. Measured on this schedule (149 positions): median max-abs logit
    difference 0.014, mean 0.087, max 1.86 where rounding flips a top-k selection; bounded here
    at median 0.05 and mean 0.25."""
    d = _diffs(tiny_params, tiny_cfg, R.CacheFormats.BF16)
    assert np.median(d) < 0.05 and d.mean() < 0.25, (np.median(d), d.mean())


def test_fp8_index_keys_reach_the_indexer_undecoded(tiny_params, tiny_cfg, monkeypatch):
    """RELEASED_FP8 index keys (fp8_132) go to the indexer as e4m3 rows + scales: the same
    logits, bit for bit, as decoding them to pages first, over one schedule."""
    from dsv4.paged import step as S

    seen = []  # at trace time: did the indexer get key_scales (and fp8 rows)?
    indexer = S.indexer_topk

    def spy(qi, w, ikey_pages, *args, **kw):
        seen.append((kw.get("key_scales") is not None, str(ikey_pages.dtype)))
        return indexer(qi, w, ikey_pages, *args, **kw)

    monkeypatch.setattr(S, "indexer_topk", spy)

    def run(scaled):
        S.paged_step_jit.clear_cache()  # retrace, so that the spy sees the indexer's inputs
        seen.clear()
        rng = np.random.default_rng(12)
        seqs = make_seqs(tiny_cfg, rng, 3, shared_prefix=16)
        h = Harness(tiny_cfg, tiny_params, R.CacheFormats.RELEASED_FP8, num_speculative_tokens=2,
                    scaled_index_keys=scaled)  # fmt: skip
        random_schedule(h, seqs, rng, spec_k=2)
        want = (True, "float8_e4m3fn") if scaled else (False, "float32")
        assert seen and all(x == want for x in seen), seen
        return h.logits

    scaled, decoded = run(True), run(False)
    assert scaled.keys() == decoded.keys() and len(scaled) > 50
    for key, v in scaled.items():
        np.testing.assert_array_equal(v, decoded[key], err_msg=str(key))


@pytest.mark.parametrize("preset", ["RELEASED", "EXACT"])
def test_sparse_attention_reads_only_the_picked_entries(tiny_params, tiny_cfg, monkeypatch, preset):
    """Where T·K picks are fewer than the pages the table references, the step decodes only
    the picked compressed entries (`pools.read_selected`); otherwise the pages. Both give the
    same logits, bit for bit, over one schedule (NVFP4 / fp32 records, NaN-filled pools), and
    with fp32 records the picks' logits are the reference forward's (1e-4)."""
    from dsv4.paged import step as S

    chosen = []
    smaller = P.selected_is_smaller

    def spy(*args):
        chosen.append(smaller(*args))
        return chosen[-1] if force is None else force

    monkeypatch.setattr(P, "selected_is_smaller", spy)

    def run():
        S.paged_step_jit.clear_cache()  # retrace: the choice is made at trace time
        chosen.clear()
        rng = np.random.default_rng(13)
        seqs = make_seqs(tiny_cfg, rng, 3, shared_prefix=16)
        h = Harness(tiny_cfg, tiny_params, R.PRESETS[preset],
                    num_speculative_tokens=2)  # fmt: skip
        random_schedule(h, seqs, rng, spec_k=2)
        if force and preset == "EXACT":
            compare(h, reference_logits(tiny_params, tiny_cfg, seqs), seqs, 1e-4)
        return h.logits, set(chosen)

    force = None
    natural, both = run()
    assert both == {True, False}  # decode steps pick entries, long prefill chunks read pages
    force = True
    picked, _ = run()
    force = False
    pages, _ = run()
    assert natural.keys() == picked.keys() == pages.keys() and len(natural) > 50
    for key, v in pages.items():
        np.testing.assert_array_equal(picked[key], v, err_msg=str(key))
        np.testing.assert_array_equal(natural[key], v, err_msg=str(key))


def test_released_records_match_quant_sim(tiny_params, tiny_cfg):
    """The released records (mxfp8 window latent, NVFP4 compressed entries, MXFP4 index keys)
    store exactly the reference's quantise-dequantise, so with quant_sim the paged step follows
    `reference.forward(quant_sim=True)`. Measured on this schedule (149 positions): all within
    2e-6 (max 1.4e-6), as under the earlier hand-played schedule with today's model code. An
    earlier measurement saw 5% of positions up to 0.83 off, where a rounding-order difference
    between chunk shapes flips one quantisation step (see test_model_math), hence the bounds:
    median 1e-5, at most 20% of positions above 1e-3, max 2."""
    d = _diffs(tiny_params, tiny_cfg.replace(quant_sim=True), R.CacheFormats.RELEASED)
    assert np.median(d) < 1e-5 and (d > 1e-3).mean() < 0.2 and d.max() < 2.0, (
        np.median(d),
        (d > 1e-3).mean(),
        d.max(),
    )


def test_debug_check_catches_bad_block_ids(tiny_params, tiny_cfg):
    h = Harness(tiny_cfg, tiny_params, R.CacheFormats.EXACT, num_blocks=40)
    groups = group_infos(h.config)
    ok_ids = [[9] if g.kind == "ring" else [1, 2, 3, 4] for g in groups]
    good = StepRequest(token_ids=[5, 6, 7], start=0, block_ids=ok_ids)
    build_batch([good], h.config, max_model_len=96, debug=True)
    bad = [list(b) for b in ok_ids]
    bad[0][0] = 40  # one past the pool
    with pytest.raises(ValueError, match=r"block id 40, outside the pool's 0\.\.39"):
        build_batch([StepRequest(token_ids=[5, 6, 7], start=0, block_ids=bad)], h.config,
                    max_model_len=96, debug=True)  # fmt: skip
    null = [list(b) for b in ok_ids]
    null[0][0] = 0
    with pytest.raises(ValueError, match="null block"):
        build_batch([StepRequest(token_ids=[5, 6, 7], start=0, block_ids=null)], h.config,
                    max_model_len=96, debug=True)  # fmt: skip
    with pytest.raises(ValueError, match="holds 1 blocks"):
        short = [[9] if g.kind == "ring" else [1] for g in groups]
        build_batch([StepRequest(token_ids=list(range(3, 12)), start=0, block_ids=short)],
                    h.config, max_model_len=96)  # fmt: skip


def test_a_full_token_bucket_needs_no_padding_row(tiny_params, tiny_cfg):
    """Requests that fill the token bucket leave no padding token, so the batch needs no padding
    row: R may equal the request count (the engine's decode buckets, `serving.runner.rows_for`).
    Its logits equal those of the same step with a padding row, and the reference's; a bucket
    with padding tokens still needs the extra row."""
    from dsv4.paged.step import paged_step_jit
    from serving.input_batch import InputBatch
    from serving.scheduler import StopCriteria

    rng = np.random.default_rng(3)
    lens = (5, 7, 4)  # 16 tokens: the whole bucket
    seqs = [Seq(i, rng.integers(3, tiny_cfg.vocab_size, n).astype(np.int32), n)
            for i, n in enumerate(lens)]  # fmt: skip
    h = Harness(tiny_cfg, tiny_params, R.CacheFormats.EXACT, num_blocks=40, token_buckets=(16,))
    scheduler = h.scheduler(max_num_seqs=3)
    for seq in seqs:
        request = h.mgr.new_request(seq.request_id, seq.tokens.tolist(), max_tokens=1)
        scheduler.add_request(request, StopCriteria())
    _, _, step_requests = plan_step(scheduler, InputBatch(3))
    assert sum(len(r.token_ids) for r in step_requests) == 16

    def build(tokens, rows):
        return build_batch(step_requests, h.config, max_model_len=h.max_model_len,
                           token_buckets=(tokens,), request_buckets=(rows,))  # fmt: skip

    exact, padded = build(16, 3), build(16, 4)
    assert exact.seq_lens.shape == (3,) and padded.seq_lens.shape == (4,)
    np.testing.assert_array_equal(exact.token_req, np.repeat(np.arange(3), lens))
    with pytest.raises(ValueError, match="4 exceeds the largest bucket 3"):
        build(32, 3)  # 16 padding tokens need a row of their own
    assert (build(32, 4).token_req[16:] == 3).all()

    logits = []
    for batch in (exact, padded):
        pools = jax.tree.map(jnp.copy, h.pools)
        out, _ = paged_step_jit(h.params, pools, jax.tree.map(jnp.asarray, batch), cfg=h.cfg,
                                layout=h.layout, all_logits=True)  # fmt: skip
        logits.append(np.asarray(out))
    np.testing.assert_array_equal(logits[0], logits[1])
    ref = reference_logits(tiny_params, tiny_cfg, seqs)
    want = np.concatenate([ref[i, :n] for i, n in enumerate(lens)])
    np.testing.assert_allclose(logits[0], want, atol=1e-4, rtol=0)


def test_no_compilation_after_warm_up(tiny_params, tiny_cfg):
    """Every step of a schedule uses the same bucket shapes: after the first step compiled the
    jitted step, a whole further schedule (prefix hits, preemptions, drafts) compiles nothing
    (the pools are donated each step)."""
    from dsv4.paged.step import paged_step_jit

    rng = np.random.default_rng(11)
    seqs = make_seqs(tiny_cfg, rng, 5, shared_prefix=16)
    h = Harness(tiny_cfg, tiny_params, R.CacheFormats.EXACT, **SMALL_POOL)
    random_schedule(h, seqs[:1], rng)
    warm = paged_step_jit._cache_size()
    steps = h.steps
    random_schedule(h, seqs[1:], rng, spec_k=2)
    assert h.steps > steps + 10
    st = h.stats
    assert st.num_preempted > 0 and max(st.prefix_hits) > 0 and st.num_draft_tokens > 0, st
    assert paged_step_jit._cache_size() == warm


def test_bounded_replay_follows_its_definition(tiny_params, tiny_cfg):
    """With SWA bounded replay a request that hits H cached tokens recomputes only the last
    `window` of them: replayed rows see windows clipped at the replay start and leave the cached
    compressed entries and index keys alone. The oracle is the dense-cache path run the same way
    (prefix prefilled normally, window ring emptied, the rest from the replay start with
    `write_from=H`), which differs from a full recompute."""
    from dsv4 import model

    rng = np.random.default_rng(21)
    prefix = rng.integers(3, tiny_cfg.vocab_size, 52)
    a = Seq(
        0, np.concatenate([prefix, rng.integers(3, tiny_cfg.vocab_size, 6)]).astype(np.int32), 58
    )
    b = Seq(
        1, np.concatenate([prefix, rng.integers(3, tiny_cfg.vocab_size, 10)]).astype(np.int32), 62
    )
    h = Harness(tiny_cfg, tiny_params, R.CacheFormats.EXACT, bounded_replay=True)
    random_schedule(h, [a], rng)
    num_admitted = len(h.stats.prefix_hits)
    random_schedule(h, [b], rng)
    hits = h.stats.prefix_hits[num_admitted:]
    hit = hits[0]
    assert hit == 48, hits
    start = hit - tiny_cfg.window_size
    assert min(p for sid, p in h.logits if sid == 1) == start

    step = jax.jit(model.forward_step, static_argnums=1)
    cache = model.init_cache(tiny_cfg, 1, WIDTH, fill=np.nan)
    toks = jnp.asarray(b.tokens)[None]
    _, cache = step(tiny_params, tiny_cfg, cache, toks[:, :hit], jnp.array([0]), jnp.array([hit]))
    cache = dict(cache, win_pos=jnp.full_like(cache["win_pos"], -1))
    n = len(b.tokens) - start
    want, _ = model.forward_step(
        tiny_params, tiny_cfg, cache, toks[:, start:], jnp.array([start]), jnp.array([n]),
        write_from=jnp.array([hit]),
    )  # fmt: skip
    want = np.asarray(want)[0]
    got = np.stack([h.logits[(1, p)] for p in range(start, len(b.tokens))])
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    full = reference_logits(tiny_params, tiny_cfg, [b])[0, start : len(b.tokens)]
    assert np.abs(got - full).max() > 1e-3  # the replay approximation is visible


@pytest.mark.parametrize("seed", range(4))
def test_slot_formulas_agree_in_numpy_and_jax(seed):
    """`build_batch` evaluates the slot helpers on numpy arrays and the engine's step moves
    rows back with the same helpers on jax arrays: both give the slots the layout defines,
    written here token by token (a block column past the table clips to its last column)."""
    from dsv4.paged.batch import ring_slots_at, state_slots_at, window_slots_at

    rng = np.random.default_rng(seed)
    rows, width, block, n = 5, 6, 16, 64
    table = rng.permutation(rows * width * 3)[: rows * width].reshape(rows, width)
    req = rng.integers(0, rows, n)
    pos = rng.integers(0, block * width + 8, n)  # a few past the table: clipped
    writes = rng.random(n) < 0.8

    def both(fn, *args):
        got_np = fn(table, req, pos, *args)
        got_jnp = fn(*(jnp.asarray(a) for a in (table, req, pos)), *map(_jnp_or, args))
        assert isinstance(got_np, np.ndarray)
        np.testing.assert_array_equal(got_np, np.asarray(got_jnp))
        return got_np

    col = lambda c: min(c, width - 1)  # noqa: E731
    want = [table[r, col(p // block)] * block + p % block for r, p in zip(req, pos)]
    np.testing.assert_array_equal(both(window_slots_at, block), want)
    for ratio in (4, 16):
        e = block // ratio
        want = [
            table[r, col(p // ratio // e)] * e + p // ratio % e
            if (p + 1) % ratio == 0 and w
            else -1
            for r, p, w in zip(req, pos, writes)
        ]
        np.testing.assert_array_equal(both(state_slots_at, block, ratio, writes), want)
    want = [table[r, 0] * 24 + p % 24 if w else -1 for r, p, w in zip(req, pos, writes)]
    np.testing.assert_array_equal(both(ring_slots_at, 24, writes), want)


def _jnp_or(a):
    return jnp.asarray(a) if isinstance(a, np.ndarray) else a
