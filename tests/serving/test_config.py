"""`serving.config`: the engine's configuration objects. Every field has one default, and the
``dsv4`` CLI's flags carry every field with that default; the CLI builds the config `LLM` builds
from the same values; unknown keys and bad values are refused with their name; the names the
config accepts mirror the tables of the modules that import JAX."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import pytest

from serving import config as C
from serving.cli_llm import UsageError, add_engine_arguments, engine_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="test")
    add_engine_arguments(parser)
    return parser


def _actions() -> dict[str, argparse.Action]:
    return {s: a for a in _parser()._actions for s in a.option_strings}


def test_every_field_has_a_flag_with_its_default_and_help():
    actions = _actions()
    names = set()
    for section, cls in C.SECTIONS.items():
        for f in dataclasses.fields(cls):
            names.add(f.name)
            assert f.metadata["help"], f.name
            if f.metadata.get("cli", True) is False:
                continue
            flag = "--" + f.name.replace("_", "-")
            assert flag in actions, (section, f.name)
            action = actions[flag]
            assert action.dest == f.name
            assert action.default == f.default, (f.name, action.default, f.default)
            assert f"(default: {f.default})" in action.help % vars(action)  # as --help shows
    # the only field without a flag: the mesh, a device object
    flagless = {
        f.name
        for cls in C.SECTIONS.values()
        for f in dataclasses.fields(cls)
        if f.metadata.get("cli", True) is False
    }
    assert flagless == {"mesh"}
    assert actions["--speculative-config"].default is None
    # no field name repeats across sections: the flat keywords are unambiguous
    total = sum(len(dataclasses.fields(cls)) for cls in C.SECTIONS.values())
    assert len(names) == total


def test_defaults_parse_to_the_default_config():
    args = _parser().parse_args([])
    assert engine_config(args) == C.EngineConfig()


def test_the_cli_builds_the_config_llm_builds():
    argv = [
        "--model", "tiny_v41", "--dtype", "bfloat16", "--max-model-len", "256",
        "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--token-buckets", "32,8",
        "--table-buckets", "none", "--num-gpu-blocks", "64", "--max-logprobs", "5",
        "--no-compilation-cache", "--sync", "--no-prefix-caching", "--bounded-replay",
        "--kv-cache-dtype", "exact", "--data-parallel-size", "2", "--seed", "3",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
        "--impl", "none", "--no-warm-up", "--fill", "nan",
    ]  # fmt: skip
    got = engine_config(_parser().parse_args(argv))
    want = C.EngineConfig.from_kwargs(
        model="tiny_v41",
        dtype="bfloat16",
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        token_buckets=[8, 32],
        table_buckets=None,
        num_gpu_blocks_override=64,
        max_logprobs=5,
        compilation_cache_dir=None,
        async_scheduling=False,
        enable_prefix_caching=False,
        swa_bounded_replay=True,
        kv_cache_dtype="exact",
        data_parallel_size=2,
        seed=3,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        impl=None,
        warm_up=False,
        fill="nan",
    )
    assert got == want
    assert got.scheduler_config.token_buckets == (8, 32)
    assert got.speculative_config.prompt_lookup_min == 5  # vLLM's default, parsed once
    assert C.EngineConfig.from_kwargs(**got.to_kwargs()) == got
    # the new spellings set the same fields as the old ones
    again = engine_config(
        _parser().parse_args(
            [
                *argv,
                "--num-gpu-blocks-override", "64", "--no-async-scheduling",
                "--no-enable-prefix-caching", "--swa-bounded-replay",
                "--compilation-cache-dir", "none",
            ]
        )
    )  # fmt: skip
    assert again == want


def test_unknown_keys_are_refused_naming_the_closest():
    with pytest.raises(TypeError, match=r"unknown engine argument 'max_num_seq'.*'max_num_seqs'"):
        C.EngineConfig.from_kwargs(max_num_seq=4)
    with pytest.raises(TypeError, match=r"unknown engine argument 'warp_drive'$"):
        C.EngineConfig.from_kwargs(warp_drive=True)


NGRAM = {"method": "ngram", "num_speculative_tokens": 2}


@pytest.mark.parametrize(
    ("kwargs", "message", "flag_message"),
    [
        (dict(max_num_seqs=0), "max_num_seqs=0 is not allowed: an int >= 1", "must be >= 1"),
        (dict(max_num_seqs=2.0), "max_num_seqs=2.0 is not allowed: an int >= 1", None),
        (dict(max_model_len=1), "max_model_len=1 is not allowed: an int >= 2 or None", None),
        (dict(dtype="float16"), "dtype='float16' is not allowed: one of", None),
        (dict(pool_layout="dense"), "pool_layout='dense' is not allowed: 'aliased' or", None),
        (dict(token_buckets=(8, 16), max_num_batched_tokens=32), "token_buckets=.*largest", None),
        (dict(token_buckets=(16, 8, 32), max_num_batched_tokens=32), "ascending", None),
        (dict(data_parallel_size=0), "data_parallel_size=0", "must be >= 1"),
        (dict(num_scheduler_steps=2, async_scheduling=False), "1 with async_scheduling", None),
        (dict(num_scheduler_steps=2, speculative_config=NGRAM), "with a speculative_config", None),
        (dict(num_scheduler_steps=2, data_parallel_size=2), "=2 with data_parallel_size=2", None),
        (dict(mesh="2x4"), "mesh='2x4' is not allowed", None),
        (dict(model="no/such/dir"), "model='no/such/dir' is not allowed: a preset", "not a preset"),
    ],
)  # fmt: skip
def test_bad_values_are_refused_naming_them(kwargs, message, flag_message):
    with pytest.raises(C.ConfigError, match=message) as exc:
        C.EngineConfig.from_kwargs(**kwargs)
    if flag_message is not None:
        assert exc.value.rule.startswith(flag_message)


def test_the_cli_names_the_flag_as_typed():
    for flag in ("--num-gpu-blocks", "--num-gpu-blocks-override"):
        with pytest.raises(UsageError, match=rf"^{flag} 1: must be >= 2$"):
            engine_config(_parser().parse_args([flag, "1"]))
    with pytest.raises(UsageError, match=r"^--table-buckets 'x': comma-separated ints$"):
        engine_config(_parser().parse_args(["--table-buckets", "x"]))


def test_resolved_fills_in_what_follows_from_the_model():
    from dsv4.config import tiny_v41

    arch = tiny_v41()
    config = C.EngineConfig.from_kwargs(dtype="float32").resolved(arch)
    assert config.model_config.max_model_len == arch.max_seq_len
    assert config.cache_config.kv_cache_dtype == "exact"
    assert (config.cache_config.block_size, config.cache_config.swa_block_size) == (16, 4)
    assert config.resolved(arch) == config
    bf16 = C.EngineConfig.from_kwargs(dtype="bfloat16", block_size=32).resolved(arch)
    assert bf16.cache_config.kv_cache_dtype == "bf16" and bf16.cache_config.block_size == 32
    with pytest.raises(C.ConfigError, match=r"max_model_len=100000 .*max_seq_len"):
        C.EngineConfig.from_kwargs(max_model_len=100_000).resolved(arch)


def test_offline_runs_bursts_where_they_can_and_an_engine_one_step_a_program():
    """`LLM`'s default (`EngineConfig.offline`): bursts of `OFFLINE_SCHEDULER_STEPS` where
    they run; 1 when scheduling is synchronous, with drafts, data shards or an Engram model;
    a value given is kept. An engine built from the config alone steps one at a time."""
    from dsv4.config import tiny_v41, tiny_v41_full

    arch = tiny_v41()

    def steps(config, model=arch):
        return config.offline(model).resolved(model).scheduler_config.num_scheduler_steps

    assert steps(C.EngineConfig.from_kwargs()) == C.OFFLINE_SCHEDULER_STEPS == 16
    assert C.EngineConfig.from_kwargs().resolved(arch).scheduler_config.num_scheduler_steps == 1
    assert steps(C.EngineConfig.from_kwargs(num_scheduler_steps=3)) == 3
    assert steps(C.EngineConfig.from_kwargs(num_scheduler_steps=1)) == 1
    assert steps(C.EngineConfig.from_kwargs(async_scheduling=False)) == 1
    assert steps(C.EngineConfig.from_kwargs(data_parallel_size=2)) == 1
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    assert steps(C.EngineConfig.from_kwargs(speculative_config=ngram)) == 1
    engram = tiny_v41_full()
    assert engram.engram_lookback and steps(C.EngineConfig.from_kwargs(), engram) == 1
    # the one list of where bursts run: asked for on an Engram model, refused naming it
    refused = C.EngineConfig.from_kwargs(num_scheduler_steps=4).burst_refusal(3)
    assert isinstance(refused, C.ConfigError) and refused.name == "num_scheduler_steps"
    assert "num_scheduler_steps=4 does not run with an Engram model" in str(refused)
    assert C.EngineConfig.from_kwargs(num_scheduler_steps=4).burst_refusal(0) is None


def test_name_tables_mirror_their_sources():
    from dsv4 import sharding
    from dsv4.checkpoint import SHIPPED
    from dsv4.config import MODEL_PRESETS
    from dsv4.paged import records
    from dsv4.qweights import WEIGHTS_ON_DEVICE

    assert C.SHIPPED_MODELS == SHIPPED
    weights = {name: p.weights for name, p in MODEL_PRESETS.items()}
    assert set(C.MODEL_NAMES) == set(weights) and len(C.MODEL_NAMES) == len(weights)
    assert tuple(n for n, w in weights.items() if w == "random") == C.RANDOM_PRESETS
    assert tuple(n for n, w in weights.items() if w == "shipped") == C.SHIPPED_MODELS
    assert C.WEIGHTS_ON_DEVICE == WEIGHTS_ON_DEVICE
    assert C.MESH_AXES == sharding.AXES
    assert {n.upper() for n in C.KV_CACHE_DTYPES if n != "auto"} == set(records.PRESETS)


def test_the_config_and_the_cli_flags_import_no_jax():
    code = (
        "import sys, serving.config, serving.cli; "
        "serving.cli.build_parser(); assert 'jax' not in sys.modules, 'jax imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("argv", [["--help"], ["plan", "--help"]])
def test_the_preset_table_and_the_cli_help_import_no_jax(argv):
    """One preset table: serving and the CLI read `dsv4.config.MODEL_PRESETS`, which starts no
    JAX (the lazy `dsv4` package), and ``dsv4 --help`` prints without JAX."""
    code = (
        "import sys, serving.config, dsv4.config, serving.cli\n"
        "assert 'jax' not in sys.modules, 'jax imported'\n"
        "assert serving.config.MODEL_NAMES == tuple(dsv4.config.MODEL_PRESETS)\n"
        f"try:\n    serving.cli.main({argv!r})\n"
        "except SystemExit as exit:\n    assert exit.code == 0, exit.code\n"
        "assert 'jax' not in sys.modules, 'jax imported'"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "usage: dsv4" in run.stdout


def test_each_default_has_one_source():
    """`Scheduler` takes no default for a config field (they come in its `SchedulerConfig`); the
    `CacheConfig` fields `cache.KVCacheManager` takes have its defaults (the allocator, used
    without serving, keeps them) and reach it under its keyword names."""
    import inspect

    from cache import KVCacheManager
    from serving.scheduler import Scheduler

    fields = {f.name for cls in C.SECTIONS.values() for f in dataclasses.fields(cls)}
    scheduler = inspect.signature(Scheduler).parameters
    defaulted = {n for n, p in scheduler.items() if p.default is not inspect.Parameter.empty}
    assert not defaulted & fields, defaulted & fields
    manager = inspect.signature(KVCacheManager).parameters
    kwargs = C.CacheConfig().manager_kwargs()
    assert kwargs == {"enable_caching": True, "swa_bounded_replay": False,
                      "enable_kv_cache_events": False}  # fmt: skip
    assert all(manager[k].default == v for k, v in kwargs.items())
    flipped = C.CacheConfig(enable_prefix_caching=False, swa_bounded_replay=True)
    assert flipped.manager_kwargs()["enable_caching"] is False
    assert flipped.manager_kwargs()["swa_bounded_replay"] is True
