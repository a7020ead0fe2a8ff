"""The allocator benchmark in --quick mode: output shape, determinism, prefix hits; the loop
drives `serving.scheduler.Scheduler`; the vLLM adapter's translation layer, exercised over our
own manager (and over vLLM 0.32's when it is importable)."""

from __future__ import annotations

import json

import pytest

from benchmarks import allocator
from benchmarks.adapters import MirroredRequest, VllmKVCacheManager, make_manager, vllm_available
from benchmarks.workload import LoopConfig, first_difference, make_chat_workload, run_loop
from cache import Request

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
    """The quick pools are small enough that the preemption path runs; every preemption frees
    the victim once, logged as such, and every turn still finishes."""
    res = allocator.run_benchmark(
        quick=True, layouts=("swa_full",), lookaheads=(3,), keep_logs=True
    )
    entry = res["results"]["swa_full/lookahead3"]
    counts = entry["ours_counts"]
    assert counts["preemptions"] > 0
    frees = [e for e in entry["_logs"]["ours"] if e[0] == "free"]
    assert sum(e[2] == "preempt" for e in frees) == counts["preemptions"]
    assert sum(e[2] == "finish" for e in frees) == counts["finished_turns"]
    assert counts["finished_turns"] == res["workload"]["turns"]


def test_loop_config_drives_the_scheduler():
    """LoopConfig's knobs reach the Scheduler: a tiny budget means more, smaller steps, and
    max_steps stops the replay early."""
    wl, scale = allocator.make_workload(True, 0)
    kv = allocator.make_layout("full", scale=scale)

    def run(cfg: LoopConfig):
        manager = make_manager("ours", kv, cfg.max_model_len, max_num_batched_tokens=2048)
        return run_loop(wl, manager, cfg, record_log=True)

    wide, narrow = run(LoopConfig()), run(LoopConfig(max_num_batched_tokens=256))
    assert narrow.steps > wide.steps
    assert narrow.finished_turns == wide.finished_turns == wl.num_turns
    assert max(e[2] for e in narrow.log if e[0] == "alloc") <= 256
    capped = run(LoopConfig(max_steps=5))
    assert capped.steps == 5 and capped.finished_turns < wl.num_turns


def test_loop_reports_a_pool_too_small_for_one_request():
    wl = make_chat_workload(0, num_conversations=1, system_len=(2048, 2048), turns=(1, 1))
    kv = allocator.make_layout("full", scale=0.0)  # 64 blocks of 16 tokens: < 2048 tokens
    manager = make_manager("ours", kv, 16384, max_num_batched_tokens=2048)
    with pytest.raises(RuntimeError, match=r"c0t0 \(\d+ tokens\) does not fit into an idle pool"):
        run_loop(wl, manager, LoopConfig())


# -- the vLLM adapter's translation, over our own manager ----------------------------------------


class _VllmShapedManager:
    """Our manager with vLLM 0.32's call shapes: get_computed_blocks returns the shared-prefix
    boundary as a third value (ours leaves it on the request), and the adapter receives the
    inner (hashed) requests as vLLM's manager receives vLLM's."""

    def __init__(self, manager):
        self._manager = manager
        self.num_kv_cache_groups = manager.num_kv_cache_groups
        self.empty_kv_cache_blocks = manager.empty_kv_cache_blocks
        self.allocate_slots = manager.allocate_slots
        self.free = manager.free
        self.get_block_ids = manager.get_block_ids
        self.get_num_common_prefix_blocks = manager.get_num_common_prefix_blocks

    @property
    def usage(self):
        return self._manager.usage

    def get_computed_blocks(self, request):
        blocks, num_hits = self._manager.get_computed_blocks(request)
        return blocks, num_hits, request.shared_prefix_boundary


def _ours_behind_the_adapter(kv_cache_config) -> VllmKVCacheManager:
    ours = make_manager("ours", kv_cache_config, 16384, max_num_batched_tokens=2048)
    return VllmKVCacheManager(
        _VllmShapedManager(ours),
        lambda request_id, prompt: Request(
            request_id, prompt, hash_block_size=ours.hash_block_size
        ),
        hash_block_size=ours.hash_block_size,
        scheduler_block_size=ours.scheduler_block_size,
        prefix_replay_tokens=ours.num_replay_tokens_max,
        running_status="RUNNING",
        preempted_status="PREEMPTED",
    )


@pytest.mark.parametrize(("layout", "lookahead"), [("swa_full", 3), ("v41_replay", 0)])
def test_adapter_over_our_manager_makes_our_decisions(layout, lookahead):
    """The same Scheduler over our manager, directly and through the vLLM adapter's translation
    (mirrored requests, 3-value lookup, status, keyword pass-through): identical decision logs,
    preemptions and bounded replay included."""
    wl, scale = allocator.make_workload(True, 0)
    kv = allocator.make_layout(layout, scale=scale)
    cfg = LoopConfig(num_lookahead_tokens=lookahead)
    direct = run_loop(
        wl, make_manager("ours", kv, 16384, max_num_batched_tokens=2048), cfg, record_log=True
    )
    adapted = run_loop(wl, _ours_behind_the_adapter(kv), cfg, name="adapted", record_log=True)
    assert first_difference(direct.log, adapted.log) is None
    assert direct.counts() == adapted.counts()
    assert direct.metrics()["prefix_hit_rate"] == adapted.metrics()["prefix_hit_rate"]
    if layout == "swa_full":
        assert direct.n_preemptions > 0


class _StubVllmManager:
    """Records what the adapter passes; answers a fixed 64-token hit with boundary 96."""

    num_kv_cache_groups = 1
    empty_kv_cache_blocks = "no blocks"

    def __init__(self):
        self.calls = []

    def get_computed_blocks(self, request):
        return "hit blocks", 64, 96

    def allocate_slots(self, request, *args, **kwargs):
        self.calls.append((request, args, kwargs))
        return "new blocks"

    def free(self, request):
        self.calls.append(("free", request))


def _stub_adapter(prefix_replay_tokens: int) -> tuple[VllmKVCacheManager, _StubVllmManager]:
    stub = _StubVllmManager()
    adapter = VllmKVCacheManager(
        stub,
        lambda request_id, prompt: Request(request_id, prompt, hash_block_size=16),
        hash_block_size=16,
        scheduler_block_size=16,
        prefix_replay_tokens=prefix_replay_tokens,
        running_status="RUNNING",
        preempted_status="PREEMPTED",
    )
    return adapter, stub


def test_adapter_drops_short_replay_hits_after_the_lookup():
    """vLLM's scheduler, not its manager, drops a hit no longer than the replay window; the
    boundary stays on the request either way."""
    adapter, _ = _stub_adapter(prefix_replay_tokens=128)
    request = adapter.new_request("r", list(range(200)), max_tokens=4)
    assert adapter.get_computed_blocks(request) == ("no blocks", 0)
    assert adapter.raw_num_hit_tokens == 64
    assert request.shared_prefix_boundary == request.vllm_request.shared_prefix_boundary == 96
    assert adapter.num_replay_tokens(64) == 64 and adapter.num_replay_tokens(500) == 128

    adapter, _ = _stub_adapter(prefix_replay_tokens=32)
    request = adapter.new_request("r", list(range(200)))
    assert adapter.get_computed_blocks(request) == ("hit blocks", 64)


def test_adapter_mirrors_requests():
    """One vLLM request per request: progress fields live on it, outputs reach both (only the
    vLLM one is hashed), allocation marks it RUNNING and a preemption PREEMPTED; allocate_slots
    forwards the Scheduler's arguments unchanged."""
    adapter, stub = _stub_adapter(prefix_replay_tokens=0)
    request = adapter.new_request("r", list(range(40)), max_tokens=4, priority=2)
    vllm_request = request.vllm_request
    assert isinstance(request, MirroredRequest) and isinstance(request, Request)
    assert (request.max_tokens, request.priority) == (4, 2)
    assert not request.block_hashes and len(vllm_request.block_hashes) == 2

    blocks = adapter.allocate_slots(
        request, 40, 0, None, 3, full_sequence_must_fit=True, has_scheduled_reqs=False
    )
    assert blocks == "new blocks" and vllm_request.status == "RUNNING"
    assert stub.calls[-1] == (
        vllm_request,
        (40, 0, None, 3),
        {"full_sequence_must_fit": True, "has_scheduled_reqs": False},
    )
    request.num_computed_tokens = 40
    request.num_in_flight_tokens = 40
    request.spec_token_ids = [7, 8]
    assert (vllm_request.num_computed_tokens, vllm_request.num_in_flight_tokens) == (40, 40)
    assert vllm_request.spec_token_ids == [7, 8] and request.num_tokens_with_spec == 42
    for token in range(100, 108):
        request.append_output_token_ids(token)
    assert request.all_token_ids == vllm_request.all_token_ids
    assert len(vllm_request.block_hashes) == 3 and not request.block_hashes

    adapter.free(request)
    assert stub.calls[-1] == ("free", vllm_request)
    request.num_preemptions += 1
    assert vllm_request.status == "PREEMPTED" and vllm_request.num_preemptions == 1
    with pytest.raises(TypeError):
        adapter.new_request("salted", [1, 2, 3], cache_salt="x")  # would change the hashes


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
