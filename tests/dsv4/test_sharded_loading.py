"""Sharded loading: ``load_pretrained(path, mesh=)`` builds every param as a global array in its
rule-table sharding from the memory-mapped checkpoint, each device's slice decoded alone, equal
bit for bit to ``shard_params(load_pretrained(path))``; orbax saves and restores sharded params
(released ones too) into the same shardings; bad meshes and missing shard files are named.

The 8-device checks run in a subprocess (the host device count is fixed when JAX starts) on
tiny_v41_full (Engram + a DSpark drafter) saved as a sharded checkpoint from random numpy params
(values do not matter here; `init_params` would cost ~20 s). What a load reads is seen through
`dsv4.checkpoint.files.read_log`: one (param, slice, tensor, bytes) record per slice copied out of a
memory map.
"""

from __future__ import annotations

import json
import os
import textwrap

import numpy as np
import pytest

from dsv4 import checkpoint as ck
from dsv4.config import tiny_v41
from dsv4.params import param_specs
from tests.multidevice import run_processes, run_script

_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    import jax, jax.numpy as jnp, numpy as np
    from dsv4 import checkpoint as ck, sharding
    from dsv4.config import tiny_v41_full
    from dsv4.engram import HostTable
    from dsv4.params import checkpoint_tensors, param_specs

    case, tmp = json.loads(sys.argv[1]), sys.argv[2]
    assert len(jax.devices()) == 8
    cfg = tiny_v41_full()
    rng = np.random.default_rng(0)
    params = {n: rng.standard_normal(s.shape, np.float32) * 0.05
              for n, s in param_specs(cfg).items()}
    path = os.path.join(tmp, "ckpt")
    ck.save_pretrained(params, cfg, path, max_shard_bytes=400_000)
    nbytes = {t.name: int(np.prod(t.shape)) * (4 if t.dtype == "F32" else 2 if t.dtype == "BF16"
              else 1) for t in checkpoint_tensors(cfg)}
    report = {}

    def same(a, b, what):
        assert a.keys() == b.keys(), what
        la, lb = [], []
        for n in a:
            if isinstance(a[n], HostTable):  # kept on the host: its memory-mapped bytes
                assert isinstance(b[n], HostTable), n
                assert np.array_equal(a[n].values, b[n].values), n
                assert np.array_equal(a[n].scales, b[n].scales), n
                continue
            assert jax.tree.structure(a[n]) == jax.tree.structure(b[n]), (what, n)
            la += jax.tree.leaves(a[n])
            lb += jax.tree.leaves(b[n])
        for x, y in zip(la, lb, strict=True):
            assert x.sharding == y.sharding and x.dtype == y.dtype, (what, x.sharding, y.sharding)
            assert x.format == y.format, (what, x.format, y.format)  # routed experts' layout
            bits = lambda s: np.ascontiguousarray(s.data).view(np.uint8)
            for sx, sy in zip(x.addressable_shards, y.addressable_shards):
                assert sx.device == sy.device and sx.index == sy.index, what
                assert np.array_equal(bits(sx), bits(sy)), what
        return len(la)

    for axes, mode, dtype, tables in case["equal"]:
        mesh = sharding.make_mesh(**axes)
        kw = dict(dtype=jnp.dtype(dtype), progress=False, weights_on_device=mode,
                  engram_tables=tables)
        want = sharding.shard_params(ck.load_pretrained(path, **kw)[1], cfg, mesh)
        t = time.time()
        got = ck.load_pretrained(path, mesh=mesh, **kw)[1]
        report[f"{axes} {mode} {dtype} {tables}"] = {
            "leaves": same(got, want, (axes, mode)), "load_s": round(time.time() - t, 2)}
        if [axes, mode] in case.get("orbax", []) + case.get("orbax_kinds", []):
            if [axes, mode] in case.get("orbax_kinds", []):
                # one param of each (format or dtype, spec): every kind of leaf, at a fraction
                # of the whole save's cost (orbax spends ~50 ms an array here)
                kinds = {}
                for n, w in got.items():
                    if not isinstance(w, HostTable):
                        leaf = jax.tree.leaves(w)[0]
                        kinds.setdefault((getattr(w, "format", w.dtype), leaf.sharding.spec), n)
                got = {n: got[n] for n in kinds.values()}
            orb = os.path.join(tmp, f"orbax_{len(report)}")
            t = time.time()
            ck.save_params(got, orb)
            back = ck.restore_params(orb, mesh=mesh)
            report[f"orbax {axes} {mode}"] = {
                "leaves": same(back, got, "orbax"), "save_restore_s": round(time.time() - t, 2)}

    # what each device's callbacks read on an expert=8 mesh
    mesh = sharding.make_mesh(expert=8)
    log = ck.files.read_log = []
    got = ck.load_pretrained(path, progress=False, mesh=mesh, weights_on_device=case["reads"])[1]
    ck.files.read_log = None
    routed = [n for n, s in param_specs(cfg).items() if s.stacked]
    per_device = {d: 0 for d in mesh.devices.flat}
    for name in routed:
        leaves = jax.tree.leaves(got[name])
        records = [r for r in log if r[0] == name]
        total = sum(nbytes[t.name] for t in checkpoint_tensors(cfg) if t.param == name)
        assert sum(r[3] for r in records) == total, name  # each expert tensor read once
        for leaf in leaves:
            for dev, index in leaf.sharding.devices_indices_map(leaf.shape).items():
                key = tuple(sl.indices(n)[:2] for sl, n in zip(index, leaf.shape))
                mine = [r for r in records if r[1] == key and r[1][0][1] - r[1][0][0] == 1]
                e = key[0][0]
                # only this device's expert's tensors (weight or scale as the leaf holds)
                assert mine and all(f".experts.{e}." in r[2] for r in mine), (name, dev, mine)
                per_device[dev] += sum(r[3] for r in mine)
    routed_total = sum(nbytes[t.name] for t in checkpoint_tensors(cfg) if t.param in routed)
    assert set(per_device.values()) == {routed_total // 8}, (per_device, routed_total)
    assert sum(r[3] for r in log) == sum(nbytes.values())  # every stored byte read once
    report["reads"] = {"mode": case["reads"], "routed_bytes": routed_total,
                       "routed_bytes_per_device": sorted(set(per_device.values())),
                       "bytes_read": sum(r[3] for r in log),
                       "checkpoint_bytes": sum(nbytes.values())}
    print("REPORT " + json.dumps(report), flush=True)
    """
)


def _run(case: dict, tmp_path) -> dict:
    out = run_script(_SCRIPT, json.dumps(case), str(tmp_path))
    line = next(x for x in out.splitlines() if x.startswith("REPORT "))
    return json.loads(line[len("REPORT ") :])


DXM = {"data": 2, "expert": 2, "model": 2}


def test_sharded_load_equals_shard_params_and_reads_only_its_slices(tmp_path):
    """Both weights_on_device modes on a data x expert x model mesh, bit for bit and in the same
    shardings; orbax saves sharded released params (one of each format / dtype and spec) and
    restores them into the same shardings bit for bit; on expert=8 each device's callbacks read exactly its expert's
    tensors, 1/8 of the routed experts' bytes, and the whole load reads every stored byte
    once."""
    report = _run(
        {
            "equal": [
                [DXM, "dequantised", "float32", "auto"],
                [DXM, "released", "bfloat16", "auto"],
            ],
            "orbax_kinds": [[DXM, "released"]],
            "reads": "dequantised",
        },
        tmp_path,
    )
    print(report)
    assert report["reads"]["bytes_read"] == report["reads"]["checkpoint_bytes"]
    assert report[f"orbax {DXM} released"]["leaves"] > 10


@pytest.mark.slow
def test_sharded_load_variants_and_orbax(tmp_path):
    """Engram tables on the host, bf16, other meshes; the released read accounting (codes and
    scales: 1/8 of the routed bytes a device); orbax of whole sharded params."""
    report = _run(
        {
            "equal": [
                [DXM, "dequantised", "bfloat16", "host"],
                [{"data": 2, "model": 4}, "released", "float32", "device"],
                [{"data": 2, "expert": 4}, "released", "bfloat16", "host"],
                [{"expert": 4, "model": 2}, "dequantised", "float32", "device"],
            ],
            "orbax": [
                [{"expert": 4, "model": 2}, "dequantised"],
                [{"data": 2, "model": 4}, "released"],
            ],
            "reads": "released",
        },
        tmp_path,
    )
    print(report)
    assert report[f"orbax {dict(expert=4, model=2)} dequantised"]["leaves"] == 297
    assert report[f"orbax {dict(data=2, model=4)} released"]["leaves"] == 426


# -- bad input (one device, in this process) ---------------------------------------------------


@pytest.fixture(scope="module")
def sharded_ckpt(tmp_path_factory):
    cfg = tiny_v41()
    rng = np.random.default_rng(0)
    params = {n: rng.standard_normal(s.shape, np.float32) for n, s in param_specs(cfg).items()}
    path = tmp_path_factory.mktemp("sharded_ckpt")
    ck.save_pretrained(params, cfg, path, max_shard_bytes=400_000)
    return path


def test_a_mesh_larger_than_the_devices_is_named(sharded_ckpt):
    with pytest.raises(ValueError, match=r"load_pretrained\(mesh=\{'expert': 16\}\): .*needs 16 "):
        ck.load_pretrained(sharded_ckpt, progress=False, mesh={"expert": 16})
    with pytest.raises(ValueError, match=r"unknown axes \['tensor'\]; allowed: data, expert"):
        ck.load_pretrained(sharded_ckpt, progress=False, mesh={"tensor": 2})
    with pytest.raises(ValueError, match=r"expected a jax.sharding.Mesh"):
        ck.load_pretrained(sharded_ckpt, progress=False, mesh=8)


def test_a_missing_shard_file_is_named_with_its_tensors(sharded_ckpt, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in os.listdir(sharded_ckpt):
        if f != "model-00002-of-00004.safetensors":
            os.symlink(os.path.join(sharded_ckpt, f), broken / f)
    with open(sharded_ckpt / ck.INDEX_FILE) as f:
        lost = sorted(
            n for n, v in json.load(f)["weight_map"].items() if v.startswith("model-00002")
        )
    with pytest.raises(ck.CheckpointError) as exc:
        ck.load_pretrained(broken, progress=False, mesh={"expert": 1})
    msg = str(exc.value)
    assert f"model-00002-of-00004.safetensors (holds {len(lost)} tensors: {lost[0]}, " in msg


# -- two processes (jax.distributed on localhost, gloo; 4 host devices each) -------------------

_WORKER = textwrap.dedent(
    """
    import json, os, sys
    import jax
    pid, port, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"localhost:{port}", num_processes=2, process_id=pid
    )
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P
    import dsv4
    from dsv4 import checkpoint as ck, sharding
    from dsv4.params import checkpoint_tensors, param_specs

    assert jax.process_count() == 2 and len(jax.local_devices()) == 4
    if pid == 1:  # this host's copy lacks a shard file: it says so, naming it and the process
        try:
            ck.load_pretrained(sys.argv[4], progress=False, mesh={"expert": 2})
        except ck.CheckpointError as exc:
            print("MISSING " + json.dumps(str(exc)), flush=True)
    # the expert axis across the processes: grid[d, e, m] is a device of process e
    local = {p: [d for d in jax.devices() if d.process_index == p] for p in (0, 1)}
    order = [local[e][2 * d + m] for d in range(2) for e in range(2) for m in range(2)]
    mesh = sharding.make_mesh(data=2, expert=2, model=2, devices=order)
    log = ck.files.read_log = []
    cfg, params = ck.load_pretrained(path, progress=False, mesh=mesh)
    ck.files.read_log = None
    _, whole = ck.load_pretrained(path, progress=False)  # this process alone, one device
    mine = set(jax.local_devices())
    for name, x in params.items():
        assert {s.device for s in x.addressable_shards} == mine & set(x.sharding.device_set)
        for s in x.addressable_shards:
            assert np.array_equal(np.asarray(s.data), np.asarray(whole[name])[s.index]), name
    stacked = [n for n, s in param_specs(cfg).items() if s.stacked]
    size = {t.name: int(np.prod(t.shape)) for t in checkpoint_tensors(cfg) if t.param in stacked}
    read = [r for r in log if r[0] in stacked]
    experts = {int(r[2].split(".experts.")[1].split(".")[0]) for r in read}
    half = cfg.n_routed_experts // 2
    assert experts == set(range(pid * half, (pid + 1) * half)), experts  # its own experts only
    assert sum(r[3] for r in read) * 2 == sum(size.values())
    prompts = np.asarray(json.loads(sys.argv[5]), np.int32)
    tokens = jax.device_put(prompts, NamedSharding(mesh, P("data")))
    with jax.default_matmul_precision("highest"):
        out = dsv4.generate(params, cfg, tokens, int(sys.argv[7]),
                            prompt_lengths=json.loads(sys.argv[6]), mesh=mesh)
    out = multihost_utils.process_allgather(out, tiled=True)
    print("TOKENS " + json.dumps(np.asarray(out).tolist()), flush=True)
    """
)


@pytest.mark.slow
def test_two_processes_load_their_slices_and_generate_what_one_process_generates(
    sharded_ckpt, tmp_path
):
    """Each process of two decodes only its devices' slices (the expert axis spans the
    processes: each reads half the routed experts' tensors, those of its own experts), the
    shards equal the one-process load's slices, and greedy generation on the global mesh gives
    the tokens one process gives alone; a process whose copy lacks a shard file is told which,
    and which process it is."""

    import jax
    import jax.numpy as jnp

    import dsv4

    cfg = tiny_v41()
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, cfg.vocab_size, (4, 24)).astype(np.int32)
    lengths = [int(v) for v in rng.integers(12, 25, 4)]
    new_tokens = 3
    _, params = ck.load_pretrained(sharded_ckpt, progress=False)
    with jax.default_matmul_precision("highest"):
        want = np.asarray(
            dsv4.generate(params, cfg, jnp.asarray(prompts), new_tokens, prompt_lengths=lengths)
        )
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in os.listdir(sharded_ckpt):
        if f != "model-00003-of-00004.safetensors":
            os.symlink(os.path.join(sharded_ckpt, f), broken / f)

    args = [str(sharded_ckpt), str(broken), json.dumps(prompts.tolist()), json.dumps(lengths)]
    outputs = run_processes(_WORKER, *args, str(new_tokens))
    for out in outputs:
        line = next(x for x in out.splitlines() if x.startswith("TOKENS "))
        np.testing.assert_array_equal(np.asarray(json.loads(line[len("TOKENS ") :])), want)
    assert not any(x.startswith("MISSING ") for x in outputs[0].splitlines())
    line = next(x for x in outputs[1].splitlines() if x.startswith("MISSING "))
    msg = json.loads(line[len("MISSING ") :])
    assert "missing from" in msg and "on process 1 of 2" in msg, msg
    assert "model-00003-of-00004.safetensors (holds " in msg, msg
