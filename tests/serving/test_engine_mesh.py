"""`LLM(mesh=)`: the engine on a mesh of 8 host devices (data, expert and tensor parallel at
once) generates the tokens of the one-device engine, asynchronous and synchronous, compiles
nothing after warm-up, and leaves every block free. In a subprocess: the host device count is
fixed when JAX starts. A mesh that is not a `dsv4.sharding` mesh is refused at `LLM(...)`."""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.multidevice import run_script

_SCRIPT = textwrap.dedent(
    """
    import json
    import jax, numpy as np
    from dsv4 import sharding
    from serving import LLM, SamplingParams
    from serving.metrics import compilation_count

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, int(n)).tolist() for n in rng.integers(5, 40, 6)]
    prompts.append(prompts[0] + [7, 8, 9])  # a prefix hit
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    kw = dict(dtype="float32", kv_cache_dtype="exact", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=32, token_buckets=(32,), num_gpu_blocks_override=40,
              compilation_cache_dir=None)

    def run(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]

    with jax.default_matmul_precision("highest"):
        want = run(LLM("tiny_v41", **kw))
        mesh = sharding.make_mesh(data=2, expert=2, model=2)
        for async_scheduling in (True, False):
            llm = LLM("tiny_v41", mesh=mesh, async_scheduling=async_scheduling, **kw)
            before = compilation_count()
            got = run(llm)
            engine = llm.engine
            manager = engine.kv_cache_manager
            w = engine.runner.params["layers.2.ffn.experts.w1.weight"]
            print(json.dumps({
                "async": async_scheduling,
                "equal": got == want,
                "compilations": compilation_count() - before,
                "hits": engine.stats.prefix_cache_hits,
                "free": manager.num_free_blocks == manager.kv_cache_config.num_blocks - 1,
                "expert_spec": str(w.sharding.spec),
                "devices": len(w.sharding.device_set),
            }), flush=True)
    """
)


def test_engine_on_a_mesh_equals_one_device():
    out = run_script(_SCRIPT)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["async"] for r in rows] == [True, False], out
    for row in rows:
        assert row["equal"] and row["free"], row
        assert row["compilations"] == 0, row
        assert row["hits"] > 0, row
        assert row["expert_spec"] == "P('expert', None, None)" and row["devices"] == 8, row


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
            llm = LLM("tiny_v41_full", mesh=mesh, **kw)
            out = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
            rows.append((out, llm.engine.stats.spec_num_draft_tokens))
    print(json.dumps({"equal": rows[0] == rows[1], "drafts": rows[1][1]}), flush=True)
    """
)


@pytest.mark.slow  # fast representative: test_engine_on_a_mesh_equals_one_device
def test_dspark_on_a_mesh_equals_one_device():
    """The drafter's window attention runs per device too (heads over model)."""
    out = run_script(_DSPARK)
    row = json.loads(next(x for x in out.splitlines() if x.startswith("{")))
    assert row["equal"] and row["drafts"] > 0, row
