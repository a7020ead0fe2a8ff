"""lab: workloads and their JSONL, knobs and their errors, the model-free runs' tables
and plots, and the lab against the engine on the same workload."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import lab
from cache.layout import memory_report
from lab import experiment as X
from lab.drive import ModelFreeBackend, drive

SMALL_CHAT = dict(
    num_system_prompts=2,
    num_conversations=12,
    system_len=(300, 900),
    turns=(1, 3),
    user_len=(20, 200),
    output_len=(8, 60),
)


@pytest.fixture(scope="module")
def chat():
    return lab.make_workload("chat", 0, **SMALL_CHAT)


# -- workloads ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(lab.WORKLOADS))
def test_workloads_are_seeded_and_round_trip_through_jsonl(kind, tmp_path):
    small = {
        "chat": SMALL_CHAT,
        "agentic": dict(num_sessions=3, preamble_len=(50, 80), turns=(2, 4)),
        "rag": dict(num_documents=2, num_sessions=4, document_len=(60, 90)),
        "long_context": dict(num_sessions=2, prompt_len=(200, 300)),
    }[kind]
    a, b = lab.make_workload(kind, 3, **small), lab.make_workload(kind, 3, **small)
    assert a == b and a != lab.make_workload(kind, 4, **small)
    path = tmp_path / "w.jsonl"
    lab.save_jsonl(a, path)
    assert lab.load_jsonl(path) == a
    if kind in ("chat", "agentic", "rag"):  # sessions share their prefixes
        assert len({s.prefix for s in a.sessions}) < len(a.sessions)


def test_chat_workload_is_the_allocator_benchmarks():
    """The recorded vLLM decisions depend on these exact draws: the digest is the one the
    allocator benchmark's own generator gave before it moved here."""
    import hashlib

    from benchmarks.workload import make_chat_workload

    wl = make_chat_workload(0, num_conversations=20)
    h = hashlib.sha256()
    for c in wl.conversations:
        for k in range(len(c.turns)):
            h.update(repr((c.conv_id, k, wl.prompt(c, k), c.turns[k].output)).encode())
    assert h.hexdigest()[:16] == "42ab1f34d4fc72aa"
    assert wl.summary() == {
        "conversations": 20,
        "turns": 47,
        "prompt_tokens": 179962,
        "output_tokens": 10322,
    }


@pytest.mark.parametrize(
    ("lines", "match"),
    [
        (['{"workload": "t", "seed": 0, "version": 1}', "{not json"], "line 2: not JSON"),
        (['{"seed": 0}'], "line 1: the first line must be the header"),
        (
            ['{"workload": "t", "seed": 0, "version": 1}', '{"prefix": 1, "tokens": [1]}'],
            "line 2: prefix 1 out of order",
        ),
        (
            [
                '{"workload": "t", "seed": 0, "version": 1}',
                '{"session": 0, "turn": 0, "prefix": null, "arrival": 0, "user": [1, -2], '
                '"output": [3]}',
            ],
            "line 2: 'user' must be a list of token ids",
        ),
        (
            [
                '{"workload": "t", "seed": 0, "version": 1}',
                '{"session": 0, "turn": 1, "prefix": null, "arrival": 0, "user": [1], '
                '"output": [3]}',
            ],
            "line 2: session 0 turn 1 out of order",
        ),
        (
            [
                '{"workload": "t", "seed": 0, "version": 1}',
                '{"session": 0, "turn": 0, "prefix": 0, "arrival": 0, "user": [1], "output": [3]}',
            ],
            "line 2: prefix 0 is not defined",
        ),
        (
            [
                '{"workload": "t", "seed": 0, "version": 1}',
                '{"session": 0, "turn": 0, "prefix": null, "arrival": 0, "user": [1], '
                '"output": [3], "extra": 1}',
            ],
            r"line 2: a turn line has keys .*unknown \['extra'\]",
        ),
    ],
)
def test_malformed_trace_lines_are_named(tmp_path, lines, match):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(lab.WorkloadError, match=match):
        lab.load_jsonl(path)


def test_bad_generator_arguments():
    with pytest.raises(lab.WorkloadError, match="unknown workload 'chats'"):
        lab.make_workload("chats")
    with pytest.raises(lab.WorkloadError, match=r"turns=\(3, 1\)"):
        lab.make_workload("chat", turns=(3, 1))
    with pytest.raises(lab.WorkloadError, match=r"workload 'rag'.*num_conversations"):
        lab.make_workload("rag", num_conversations=3)


# -- knobs -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("knobs", "match"),
    [
        ({"layout": "v42"}, "knob layout='v42': allowed one of"),
        ({"pool_blocks": 1}, "knob pool_blocks=1: allowed None or an int >= 2"),
        ({"pools": "shared"}, "knob pools='shared'"),
        ({"records": "fp3"}, "knob records='fp3'"),
        ({"max_num_seqs": 0}, "knob max_num_seqs=0"),
        ({"retention_interval": -1}, "knob retention_interval=-1"),
        ({"pool_blocks": 100, "memory_gib": 1.0}, "exactly one of pool_blocks / memory_gib"),
    ],
)
def test_knob_values_outside_their_range(knobs, match):
    with pytest.raises(lab.LabError, match=match):
        lab.LabConfig(**{"pool_blocks": 1000, **knobs})


def test_unknown_knobs_and_bad_sweeps():
    base = lab.LabConfig(pool_blocks=1000)
    with pytest.raises(lab.LabError, match="unknown knob 'pool_size'"):
        base.replace(pool_size=3)
    for spec, match in [
        ("pool_size=1:2:1", "unknown knob 'pool_size'"),
        ("pool_blocks=4000:500:500", "hi >= lo"),
        ("pool_blocks", "expected knob="),
    ]:
        with pytest.raises(lab.LabError, match=match):
            lab.parse_sweep(spec)
    assert lab.parse_sweep("pool_blocks=500:1500:500") == ("pool_blocks", [500, 1000, 1500])
    assert lab.parse_sweep("kv_sources=2,8;2,8,14") == ("kv_sources", [(2, 8), (2, 8, 14)])


def test_layouts_that_cannot_be_built_are_named(chat):
    # a kv source whose ratio is 0, a plan of the wrong length, a block size no ratio divides
    for knobs, match in [
        ({"kv_sources": (0, 2)}, "layer 0 whose compress ratio is 0"),
        ({"compress_ratios": (0, 2, 1)}, "compress_ratios has 3 entries"),
        ({"block_size": 63}, "not a multiple of ratio 2"),
    ]:
        with pytest.raises(lab.LabError, match=match):
            lab.build_layout(lab.LabConfig(pool_blocks=1000, **knobs))
    with pytest.raises(lab.LabError, match=r"knob pool_blocks=50: .* needs \d+ blocks"):
        lab.sweep(chat, lab.LabConfig(pool_blocks=50))
    with pytest.raises(lab.LabError, match="knob max_model_len=512"):
        lab.run(chat, lab.LabConfig(pool_blocks=4000, max_model_len=512))


def test_layout_defaults_and_explicit_knobs():
    cfg = lab.LabConfig(pool_blocks=100)
    assert cfg.bounded_replay and cfg.records == "sm90"
    assert not cfg.replace(layout="v41_noreplay").bounded_replay
    assert cfg.replace(layout="v41_dense_retention").retention_interval is None
    mine = lab.LabConfig(pool_blocks=100, bounded_replay=False)
    assert not mine.replace(layout="v41_sm100").bounded_replay  # given explicitly: it wins
    assert mine.replace(layout="v41_sm100").records == "sm100"


def test_record_bytes_match_the_device_formats():
    from dsv4.paged import records as R

    for fmt in ("f32", "bf16", "mxfp8", "nvfp4", "mxfp4", "fp8_132"):
        for dim in (32, 64, 128, 512):
            assert X._record_bytes(fmt, dim) == R.record_bytes(fmt, dim), (fmt, dim)
    for dim in (128, 512):
        assert X._record_bytes("v4_584", dim) == R.record_bytes("v4_584", dim)
    # the presets are the device's named formats
    for name, formats in (("exact", R.EXACT), ("bf16", R.BF16), ("released", R.RELEASED)):
        p = lab.RECORDS[name]
        assert (p.window, p.compressed, p.index) == (
            formats.window,
            formats.compressed,
            formats.index,
        )


def test_cost_model_matches_the_kernels_cost_models():
    from lab.cost import MODELS, step_cost
    from pallas_kernels.indexer.common import cost as indexer_cost
    from pallas_kernels.sparse_attention.cost import sparse_cost

    m = MODELS["v41_flash"]
    # one decode token at context 8192 on one r=1 index layer: window, top-k and index keys
    one = step_cost(
        m,
        [(1, 8192)],
        ratios=(1,),
        index_layers=(0,),
        swa_record_bytes=584,
        compressed_record_bytes=584,
        indexer_key_bytes=132,
    )
    base = step_cost(
        m,
        [(1, 8192)],
        ratios=(),
        index_layers=(),
        swa_record_bytes=584,
        compressed_record_bytes=584,
        indexer_key_bytes=132,
    )
    extra = one.kv_bytes - base.kv_bytes
    rows = sparse_cost(
        num_tokens=1, heads=1, dim=584, topk=512, q_bytes=0, kv_bytes=1, with_state=False
    )
    keys = indexer_cost(1, 1, 132, 8192, k=512, key_dtype="uint8", q_dtype="uint8")
    assert extra == 512 * 584 + 8192 * 132
    assert rows.bytes_accessed - 512 * 8 == 512 * 584  # the kernel's row bytes, no metadata
    assert keys["bytes"] >= 8192 * 132  # the kernel reads every visible key once


def test_step_cost_is_the_per_layer_sum():
    """`step_cost` (per distinct ratio, in integers) gives the per-layer loop's floats bit for
    bit, on both models' layer plans, and falls back to it for non-integer record sizes."""
    import random

    from cache.layout import tiny_v41_desc, v41_flash_desc
    from lab.cost import MODELS, step_cost, step_cost_by_layer

    rng = random.Random(0)
    for name, desc in (("v41_flash", v41_flash_desc()), ("tiny_v41", tiny_v41_desc())):
        plan = {
            "ratios": tuple(desc.compress_ratios[: desc.num_hidden_layers]),
            "index_layers": tuple(desc.index_source_layer_ids),
        }
        for records in ((584, 584, 132), (1024, 292, 68), (584.5, 584, 132)):
            sizes = dict(
                zip(("swa_record_bytes", "compressed_record_bytes", "indexer_key_bytes"), records)
            )
            for _ in range(200):
                work = [
                    (rng.choice([0, 1, 1, 3, 8, 9, 2048]), rng.randint(1, 70_000))
                    for _ in range(rng.randint(0, 64))
                ]
                fast = step_cost(MODELS[name], iter(work), **plan, **sizes)
                slow = step_cost_by_layer(MODELS[name], work, **plan, **sizes)
                assert fast == slow, (name, records, work)


@pytest.mark.parametrize(
    "knobs",
    [
        {"layout": "v41"},
        {"layout": "v41_noreplay"},
        {"layout": "v41_dense_retention", "pools": "separate"},
        {"layout": "v41_sm100", "async_scheduling": True, "lookahead": 3},
        {"layout": "v41", "enable_prefix_caching": False},
        {"layout": "v41", "model": "tiny_v41", "records": "bf16", "max_num_seqs": 8},
    ],
)
def test_meter_counts_held_blocks_as_sets_do(chat, knobs):
    """The meter's block counts (window families counted once, the shared group by
    difference from the pool) equal the sets of each group's blocks at every step."""
    cfg = lab.LabConfig(pool_blocks=300, **knobs)
    manager = X.make_manager(lab.build_layout(cfg), cfg)
    meter = X._Meter(cfg, manager, X.model_desc(cfg))
    meter.check_counts = True
    result = drive(chat, ModelFreeBackend(X.make_scheduler(manager, cfg), hooks=meter))
    assert result.finished_turns == chat.num_turns and meter.steps == result.steps
    assert max(meter.peak_blocks) > 0


# -- runs --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool_sweep(chat):
    base = lab.LabConfig(pool_blocks=1500)
    return lab.sweep(
        chat, base, layouts=["v41", "v41_noreplay"], knob="pool_blocks", values=[1000, 1500, 4000]
    )


def test_rows_within_their_definitions(pool_sweep, chat):
    summary = chat.summary()
    for row in pool_sweep:
        assert 0 <= row["prefix_hit_rate"] <= 1 and 0 <= row["lookup_hit_rate"] <= 1
        assert row["finished_turns"] == row["turns"] == summary["turns"]
        assert row["prefix_queries"] == summary["prompt_tokens"]
        assert (
            row["recomputed_tokens"] == row["replay_tokens"] + row["preemption_recomputed_tokens"]
        )
        assert (row["replay_tokens"] > 0) == (row["layout"] == "v41" and row["prefix_hits"] > 0)
        cfg = lab.LabConfig(layout=row["layout"], pool_blocks=row["pool_blocks"])
        config = lab.build_layout(cfg)
        report = memory_report(
            config, cfg.max_model_len, cfg.max_num_batched_tokens, packed_layout=True
        )
        assert row["bytes_per_block"] == [report.pool_bytes_per_block] * len(config.kv_cache_groups)
        assert row["pool_bytes"] == config.num_blocks * report.pool_bytes_per_block
        assert row["peak_kv_bytes_total"] <= row["pool_bytes"]
        assert all(0 <= m <= p for m, p in zip(row["mean_kv_bytes"], row["peak_kv_bytes"]))
        assert row["bytes_per_token"] == report.bytes_per_token
        assert 1 <= row["max_running"] <= cfg.max_num_seqs
        assert row["modelled_time_s"] > 0 and row["ttft_p50_s"] <= row["ttft_p90_s"]
        assert row["steps"] > 0 and row["sim_steps_per_s"] > 0


def test_sweep_in_worker_processes_gives_the_same_rows(chat):
    base = lab.LabConfig(pool_blocks=1500)
    kwargs = dict(layouts=["v41", "v41_noreplay"], knob="pool_blocks", values=[600, 1500])
    timing = ("sim_wall_s", "sim_steps_per_s")
    rows = [lab.sweep(chat, base, **kwargs, workers=w) for w in (1, 2)]
    assert [[{k: v for k, v in r.items() if k not in timing} for r in x] for x in rows] == [
        [{k: v for k, v in r.items() if k not in timing} for r in rows[0]]
    ] * 2
    with pytest.raises(lab.LabError, match="workers"):
        lab.sweep(chat, base, workers=0)


def test_bounded_replay_and_memory_pressure(pool_sweep):
    """Bounded replay (docs/serving.md#bounded-replay): windows leave the lookup, so hits are only
    bounded by the full-attention groups (much higher here, each hit paying a window of
    replay); both degrade when the pool shrinks."""
    by = {(r["layout"], r["pool_blocks"]): r for r in pool_sweep}
    for blocks in (1500, 4000):
        assert by["v41", blocks]["prefix_hit_rate"] > by["v41_noreplay", blocks]["prefix_hit_rate"]
    for layout in ("v41", "v41_noreplay"):
        assert by[layout, 1000]["prefix_hit_rate"] <= by[layout, 4000]["prefix_hit_rate"]
    assert by["v41", 1000]["preemptions"] >= by["v41", 4000]["preemptions"]
    assert by["v41_noreplay", 4000]["replay_tokens"] == 0


def test_shortest_prompt_that_can_hit():
    """A hit is a whole number of 64-token blocks (V4.1's compressed block) and stops one token
    short of the prompt; bounded replay drops hits no longer than the 128-token window."""
    assert lab.shortest_hit_prompt(lab.LabConfig(layout="v41_noreplay", pool_blocks=100)) == 65
    assert lab.shortest_hit_prompt(lab.LabConfig(layout="v41", pool_blocks=100)) == 3 * 64 + 1
    assert lab.shortest_hit_prompt(lab.LabConfig(layout="v41_sm100", pool_blocks=100)) == 129 + 128


def test_memory_budget_and_separate_pools(chat):
    aliased = lab.build_layout(lab.LabConfig(memory_gib=0.5))
    separate = lab.build_layout(lab.LabConfig(memory_gib=0.5, pools="separate"))
    assert separate.num_blocks < aliased.num_blocks  # every layer's page per block
    row = lab.run(chat, lab.LabConfig(memory_gib=0.5, pools="separate"))
    assert row["pool_bytes"] <= 0.5 * 2**30
    assert sum(row["bytes_per_block"]) > row["bytes_per_block"][0]


def test_table_and_plots_are_written(pool_sweep, tmp_path):
    files = lab.write_table(pool_sweep, tmp_path)
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == json.loads(json.dumps(pool_sweep))
    assert (tmp_path / "results.csv").read_text().count("\n") == len(pool_sweep) + 1
    for path in (
        lab.plot_sweep(pool_sweep, "pool_blocks", tmp_path),
        lab.plot_memory(pool_sweep, tmp_path),
    ):
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert len(files) == 2


def test_model_free_runs_import_no_jax(tmp_path):
    code = (
        "import sys\n"
        "import lab\n"
        "wl = lab.make_workload('rag', 0, num_documents=1, num_sessions=3, document_len=(300, 400))\n"
        "lab.run(wl, lab.LabConfig(pool_blocks=500))\n"
        "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)\n"
    )
    # from the repository root: its packages, not an installed copy, are the ones imported
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env=None)


def test_cli_sweep_and_bad_input(tmp_path):
    out = tmp_path / "out"
    base = [sys.executable, "-m", "serving.cli", "lab", "--workload", "chat", "--no-progress"]
    args = ["--workload-arg", "num_conversations=6", "--workload-arg", "system_len=200,400"]
    bad = subprocess.run(
        [
            *base,
            *args,
            "--sweep",
            "pool_blocks=1000:2000:500",
            "--set",
            "pool_size=3",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "unknown knob 'pool_size'" in bad.stderr
    assert not out.exists()
    ok = subprocess.run(
        [
            *base,
            *args,
            "--sweep",
            "pool_blocks=1000:2000:1000",
            "--layouts",
            "v41,v41_noreplay",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    summary = json.loads(ok.stdout.strip().splitlines()[-1])
    assert summary["runs"] == 4
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "memory_per_layout.png",
        "results.csv",
        "results.jsonl",
        "sweep_pool_blocks.png",
        "workload.jsonl",
    ]


# -- the lab against the engine ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("async_scheduling", "bounded_replay"),
    [(False, False), (True, True)],
    ids=["sync", "async-replay"],
)
def test_lab_reports_what_the_engine_reports(
    tiny_params, tiny_cfg, async_scheduling, bounded_replay
):
    """The same workload through the engine (tiny model) and through the lab without the model:
    the same hits, preemptions and recomputed tokens, decision for decision (the lab replays the
    engine's outputs, so the prompts of later turns are the same)."""
    import jax

    from tests.serving import engine_testing as E

    # SMALL_CHAT's shape at the tiny model's scale
    short = dict(num_conversations=8, system_len=(30, 50), user_len=(4, 12), output_len=(4, 8))
    wl = lab.make_workload("chat", 1, **{**SMALL_CHAT, **short}, vocab_size=tiny_cfg.vocab_size)
    with jax.default_matmul_precision("highest"):
        engine = E.make_engine(
            tiny_params,
            tiny_cfg,
            async_scheduling=async_scheduling,
            swa_bounded_replay=bounded_replay,
        )
        on_engine = lab.run_engine(wl, engine)
    cfg = lab.LabConfig(
        layout="v41" if bounded_replay else "v41_noreplay",
        model="tiny_v41",
        records="exact",
        block_size=16,
        swa_block_size=4,
        pool_blocks=E.NUM_BLOCKS,
        max_num_seqs=E.MAX_NUM_SEQS,
        max_num_batched_tokens=E.TOKEN_BUCKET,
        max_model_len=E.MAX_MODEL_LEN,
        async_scheduling=async_scheduling,
    )
    manager = X.make_manager(lab.build_layout(cfg), cfg)
    assert manager.kv_cache_config == engine.kv_cache_manager.kv_cache_config
    model_free = drive(on_engine["trace"], ModelFreeBackend(X.make_scheduler(manager, cfg)))
    assert model_free.trace == on_engine["trace"]
    assert model_free.scheduler == engine.scheduler_stats.as_dict()
    assert model_free.finished_turns == on_engine["finished_turns"] == wl.num_turns
    st = engine.stats
    assert (st.prefix_cache_hits, st.prefix_cache_queries) == (
        on_engine["prefix_hits"],
        on_engine["prefix_queries"],
    )
    assert st.num_preemptions == on_engine["preemptions"] > 0
    assert st.num_recomputed_tokens == on_engine["recomputed_tokens"] > 0
    assert on_engine["prefix_hits"] > 0
    row = lab.run(on_engine["trace"], cfg)
    for key in ("prefix_hit_rate", "preemptions", "recomputed_tokens", "replay_tokens", "steps"):
        assert row[key] == on_engine[key], key
