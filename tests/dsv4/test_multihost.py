"""Multi-host: two processes on this machine (`jax.distributed.initialize` on localhost, CPU
collectives over gloo, 4 host devices each) run the same host program over one global mesh of
8 devices and generate the tokens one process generates alone.

Every process builds the same params from the same seed, places them by the rule table
(`shard_params` keeps the shards its own devices hold), splits the prompts over ``data`` and
calls `dsv4.generate(..., mesh=)`: the expert axis spans both processes, so the
routed experts' all-to-all crosses the process boundary. The output is a global array; each
process gathers it (`multihost_utils.process_allgather`) and prints it. A long variant runs
`serving.LLM(mesh=)` the same way: both processes run the same engine loop and print the tokens
of the one-process engine.
"""

from __future__ import annotations

import json
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4
from dsv4.config import tiny_v41
from dsv4.params import init_params
from tests.multidevice import run_processes

NEW_TOKENS = 5

_WORKER = textwrap.dedent(
    """
    import json, sys
    import jax
    pid, port = int(sys.argv[1]), sys.argv[2]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"localhost:{port}", num_processes=2, process_id=pid
    )
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P
    import dsv4
    from dsv4 import sharding
    from dsv4.config import tiny_v41
    from dsv4.params import init_params

    assert jax.process_count() == 2 and len(jax.devices()) == 8, jax.devices()
    assert len(jax.local_devices()) == 4
    cfg = tiny_v41()
    params = init_params(cfg, jax.random.PRNGKey(0))
    prompts = np.asarray(json.loads(sys.argv[3]), np.int32)
    lengths = json.loads(sys.argv[4])
    # the expert axis spans the processes: the routed experts' all-to-all crosses them
    by_process = [[d for d in jax.devices() if d.process_index == p] for p in (0, 1)]
    order = [by_process[p][2 * i + m] for i in (0, 1) for p in (0, 1) for m in (0, 1)]
    mesh = sharding.make_mesh(data=2, expert=2, model=2, devices=order)
    for row in mesh.devices:  # [expert, model] of one data index
        assert [d.process_index for d in row[:, 0]] == [0, 1], mesh.devices
    if sys.argv[6] == "engine":  # every process runs the same engine loop
        from serving import LLM, SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[5]), ignore_eos=True)
        with jax.default_matmul_precision("highest"):
            llm = LLM("tiny_v41", mesh=mesh, **json.loads(sys.argv[7]))
            outs = llm.generate([p[:n] for p, n in zip(prompts.tolist(), lengths)], sp,
                                use_tqdm=False)
        print("TOKENS " + json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
        sys.exit(0)
    sharded = sharding.shard_params(params, cfg, mesh)
    tokens = jax.device_put(prompts, NamedSharding(mesh, P("data")))
    with jax.default_matmul_precision("highest"):
        out = dsv4.generate(sharded, cfg, tokens, int(sys.argv[5]), prompt_lengths=lengths,
                            mesh=mesh)
    out = multihost_utils.process_allgather(out, tiled=True)
    print("TOKENS " + json.dumps(np.asarray(out).tolist()), flush=True)
    """
)


def _prompts():
    cfg = tiny_v41()
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, cfg.vocab_size, (8, 40)).astype(np.int32)
    lengths = [int(v) for v in rng.integers(20, 41, 8)]
    return cfg, prompts, lengths


def _two_processes(what: str, prompts, lengths, engine_kw=None) -> list[np.ndarray]:
    """Each process's printed tokens."""
    args = [json.dumps(prompts.tolist()), json.dumps(lengths), str(NEW_TOKENS), what,
            json.dumps(engine_kw or {})]  # fmt: skip
    outputs = run_processes(_WORKER, *args)
    got = []
    for out in outputs:
        line = next(x for x in out.splitlines() if x.startswith("TOKENS "))
        got.append(np.asarray(json.loads(line[len("TOKENS ") :])))
    return got


def test_two_processes_generate_what_one_process_generates():
    cfg, prompts, lengths = _prompts()
    with jax.default_matmul_precision("highest"):
        params = init_params(cfg, jax.random.PRNGKey(0))
        want = np.asarray(
            dsv4.generate(params, cfg, jnp.asarray(prompts), NEW_TOKENS, prompt_lengths=lengths)
        )
    for got in _two_processes("generate", prompts, lengths):
        np.testing.assert_array_equal(got, want)


ENGINE_KW = dict(dtype="float32", kv_cache_dtype="exact", max_model_len=128, max_num_seqs=4,
                 max_num_batched_tokens=32, token_buckets=[32], num_gpu_blocks_override=64,
                 compilation_cache_dir=None)  # fmt: skip


@pytest.mark.slow  # fast representative: the two-process generate above
def test_two_processes_run_the_engine_of_one_process():
    """Every process runs the same host program: the same scheduler decisions follow from the
    same requests (its rules read no clock and no randomness but the requests' seeds; the
    mesh's data axis of 2 makes two data shards, each spanning both processes, and the
    least-loaded routing reads only the shards' queues), and the sampled tokens, replicated
    over the mesh at the end of each step, reach every process's host."""
    from serving import LLM, SamplingParams

    _, prompts, lengths = _prompts()
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with jax.default_matmul_precision("highest"):
        llm = LLM("tiny_v41", **ENGINE_KW)
        outs = llm.generate([p[:n] for p, n in zip(prompts.tolist(), lengths)], sp, use_tqdm=False)
    want = np.asarray([o.outputs[0].token_ids for o in outs])
    for got in _two_processes("engine", prompts, lengths, ENGINE_KW):
        np.testing.assert_array_equal(got, want)
