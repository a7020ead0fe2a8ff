"""`LLM(mesh=)`: the engine on a mesh of 8 host devices (data, expert and tensor parallel at
once: one scheduler and allocator per data shard, `serving.data_parallel`) generates the tokens
of the one-device engine, asynchronous and synchronous, compiles nothing after warm-up, keeps
each shard's pages on its own devices, and leaves every block free. In a subprocess: the host device count is
fixed when JAX starts. A mesh that is not a `dsv4.sharding` mesh is refused at `LLM(...)`."""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.multidevice import run_script

_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np
    from dsv4 import sharding
    from serving import LLM, SamplingParams
    from serving.metrics import compilation_count

    data, expert, model = (int(x) for x in sys.argv[1].split("x"))
    name = "tiny_v41"
    if sys.argv[2:] == ["eight_heads"]:  # heads, index heads, groups and experts split 8 ways
        import tempfile
        from dsv4.checkpoint import save_pretrained
        from dsv4.config import tiny_v41
        from dsv4.params import init_params
        cfg = tiny_v41(n_heads=8, index_n_heads=8, o_groups=8, n_routed_experts=8)
        name = tempfile.mkdtemp()
        save_pretrained(init_params(cfg, jax.random.PRNGKey(3)), cfg, name)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, int(n)).tolist() for n in rng.integers(5, 48, 8)]
    # siblings: prefix hits; added all at once, request i goes to data shard i % data, so
    # request 8 + i meets its sibling's pages on its shard
    prompts += [p + [7, 8, 9] for p in prompts]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    kw = dict(dtype="float32", kv_cache_dtype="exact", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=32, token_buckets=(32,), num_gpu_blocks_override=40,
              compilation_cache_dir=None)

    def run(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]

    with jax.default_matmul_precision("highest"):
        want = run(LLM(name, **kw))
        mesh = sharding.make_mesh(data=data, expert=expert, model=model)
        for async_scheduling in (True, False):
            llm = LLM(name, mesh=mesh, async_scheduling=async_scheduling, **kw)
            before = compilation_count()
            got = run(llm)
            engine = llm.engine
            managers = engine.kv_cache_managers
            w = engine.runner.params["layers.2.ffn.experts.w1.weight"]
            pool = next(iter(engine.runner.pools.values()))
            per_device = {d: s.data.shape for d, s in
                          ((s.device, s) for s in pool.addressable_shards)}
            print(json.dumps({
                "async": async_scheduling,
                "equal": got == want,
                "compilations": compilation_count() - before,
                "hits": engine.stats.prefix_cache_hits,
                "shards": len(managers),
                "free": all(m.num_free_blocks == m.kv_cache_config.num_blocks - 1
                            for m in managers),
                "routed": getattr(engine.scheduler, "num_routed", None),
                "expert_spec": str(w.sharding.spec),
                "devices": len(w.sharding.device_set),
                "pool_spec": str(pool.sharding.spec) if len(managers) > 1 else None,
                "pool_rows_per_device": sorted({v[0] for v in per_device.values()}),
            }), flush=True)
    # one scheduler over the whole data axis (pools replicated), sized by default
    one = LLM(name, mesh=mesh, data_parallel_size=1, dtype="float32", max_model_len=128,
              warm_up=False, compilation_cache_dir=None)
    print(json.dumps({"replicated_shards": one.engine.data_parallel_size}), flush=True)
    """
)


def _check_mesh_run(shape: str, *extra: str) -> None:
    data = int(shape.split("x")[0])
    out = run_script(_SCRIPT, shape, *extra)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert rows.pop() == {"replicated_shards": 1}, out
    assert [r["async"] for r in rows] == [True, False], out
    for row in rows:
        assert row["equal"] and row["free"], row
        assert row["compilations"] == 0, row
        assert row["hits"] > 0, row
        assert row["devices"] == 8, row
        assert row["shards"] == data, row
        if data > 1:
            # each data group of devices holds its own shard's pages only
            assert row["pool_spec"] == "P('data',)", row
            assert row["pool_rows_per_device"] == [1], row
            assert row["routed"] == [16 // data] * data, row  # every shard served requests


def test_engine_on_a_mesh_equals_one_device():
    """data 2 x expert 2 x model 2: requests and pages split over data, experts dispatched,
    heads split."""
    _check_mesh_run("2x2x2")


@pytest.mark.slow  # fast representative: test_engine_on_a_mesh_equals_one_device
@pytest.mark.parametrize("shape", ["2x1x4", "4x1x2", "8x1x1", "1x8x1"])
def test_engine_on_data_by_model_meshes_equals_one_device(shape):
    """The issue's meshes, data x model 2x4, 4x2 and 8x1, and 1x8 over experts."""
    _check_mesh_run(shape)


def test_engine_on_model_8_with_eight_heads_equals_one_device():
    """1x8 over model for a tiny config with 8 heads, 8 index heads, 8 output groups and 8
    experts (a checkpoint on disk, `LLM(path, mesh=)`): every device runs one head."""
    _check_mesh_run("1x1x8", "eight_heads")


def test_llm_refuses_a_mesh_it_cannot_use():
    from serving import LLM

    with pytest.raises(ValueError, match="mesh='2x4' is not allowed"):
        LLM("tiny_v41", mesh="2x4", warm_up=False)


_DSPARK = textwrap.dedent(
    """
    import json
    import jax, numpy as np
    from dsv4 import sharding
    from serving import LLM, SamplingParams

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, int(n)).tolist() for n in rng.integers(5, 40, 4)]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    kw = dict(dtype="float32", kv_cache_dtype="exact", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=32, token_buckets=(32,), num_gpu_blocks_override=64,
              compilation_cache_dir=None, async_scheduling=False,
              speculative_config={"method": "dspark", "num_speculative_tokens": 2})
    with jax.default_matmul_precision("highest"):
        rows = []
        for mesh in (None, sharding.make_mesh(data=2, expert=2, model=2)):
            llm = LLM("tiny_v41_full", mesh=mesh, **kw)  # two data shards
            out = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
            rows.append((out, llm.engine.stats.spec_num_draft_tokens))
    print(json.dumps({"equal": rows[0] == rows[1], "drafts": rows[1][1]}), flush=True)
    """
)


@pytest.mark.slow  # fast representative: test_engine_on_a_mesh_equals_one_device
def test_dspark_on_a_mesh_equals_one_device():
    """The drafter on two data shards of a 2x2x2 mesh: its window attention per shard and
    per device (heads over model), its stages' MoE dispatched over expert."""
    out = run_script(_DSPARK)
    row = json.loads(next(x for x in out.splitlines() if x.startswith("{")))
    assert row["equal"] and row["drafts"] > 0, row
