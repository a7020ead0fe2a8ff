"""The allocator benchmark in --quick mode: output shape, determinism, prefix hits."""

from __future__ import annotations

import json

import pytest

from benchmarks import allocator
from benchmarks.adapters import vllm_available
from benchmarks.workload import first_difference, make_chat_workload

EXPECTED_KEYS = {f"{layout}/lookahead{la}" for layout in allocator.DEFAULT_LAYOUTS for la in (0, 3)}


@pytest.fixture(scope="module")
def quick_runs():
    return [allocator.run_benchmark(quick=True, keep_logs=True) for _ in range(2)]


def test_json_keys(quick_runs, capsys):
    assert allocator.main(["--quick"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"benchmark", "workload", "loop", "results", "wall_s"} <= out.keys()
    assert set(out["results"]) == EXPECTED_KEYS
    for entry in out["results"].values():
        assert set(entry["ours"]) == set(allocator.METRICS)
        assert entry["ours_counts"]["finished_turns"] == out["workload"]["turns"]
        assert entry["ours"]["us_per_allocate_slots"] > 0
        assert entry["ours"]["steps_per_s"] > 0


def test_decision_logs_deterministic(quick_runs):
    a, b = quick_runs
    assert a["workload"] == b["workload"]
    for key in EXPECTED_KEYS:
        la, lb = a["results"][key]["_logs"]["ours"], b["results"][key]["_logs"]["ours"]
        assert la, key
        assert first_difference(la, lb) is None, key


def test_prefix_hits_on_chat_workload(quick_runs):
    for key, entry in quick_runs[0]["results"].items():
        assert entry["ours"]["prefix_hit_rate"] > 0, key
        log = entry["_logs"]["ours"]
        assert any(e[0] == "get" and e[3] > 0 for e in log), key


def test_quick_workload_preempts():
    """The quick pools are small enough that the preemption path runs."""
    res = allocator.run_benchmark(quick=True, layouts=("swa_full",), lookaheads=(3,))
    assert res["results"]["swa_full/lookahead3"]["ours_counts"]["preemptions"] > 0


def test_workload_seeded():
    w1, w2 = make_chat_workload(7, num_conversations=5), make_chat_workload(7, num_conversations=5)
    assert w1 == w2
    assert make_chat_workload(8, num_conversations=5) != w1
    conv = w1.conversations[0]
    for k in range(1, len(conv.turns)):
        prev = w1.prompt(conv, k - 1) + list(conv.turns[k - 1].output)
        assert w1.prompt(conv, k)[: len(prev)] == prev


@pytest.mark.skipif(not vllm_available(), reason="vLLM 0.32 is not importable here")
def test_vllm_decisions_identical():
    res = allocator.run_benchmark(
        quick=True, layouts=(*allocator.DEFAULT_LAYOUTS, "v41_replay"), with_vllm=True
    )
    for key, entry in res["results"].items():
        assert entry["decisions_identical"], (key, entry.get("first_difference"))
