"""Step sizes that fit the batch: the engine's default token buckets run a step of n tokens as
at most 2n (a single stream decodes one row, not eight), with few programs, all compiled at
warm-up."""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4.generation import generate
from dsv4.paged.batch import bucket
from serving import LLM, SamplingParams
from serving.runner import default_token_buckets, rows_for


@pytest.mark.parametrize(
    "budget,max_num_seqs", [(64, 16), (256, 256), (48, 5), (1, 1), (8192, 256)]
)
def test_default_buckets_pad_decode_at_most_twice(budget, max_num_seqs):
    """A decode step of n <= max_num_seqs requests runs at most 2n tokens and rows; a larger
    step (a prefill chunk) at most 4n tokens; one program per power of two up to
    max_num_seqs, then one per power of four."""
    buckets = default_token_buckets(budget, max_num_seqs)
    assert buckets[0] == 1 and buckets[-1] == budget
    small = min(budget, max_num_seqs).bit_length()
    assert len(buckets) <= small + (budget // max(1, max_num_seqs)).bit_length() // 2 + 1
    for n in range(1, budget + 1):
        t = bucket(n, buckets)
        if n <= max_num_seqs:  # a decode step of n requests: n rows of one token
            assert n <= t <= 2 * n
            assert n <= rows_for(t, max_num_seqs) <= 2 * n
        else:
            assert n <= t <= 4 * n


def test_default_buckets_of_the_shipped_defaults():
    assert default_token_buckets(64, 16) == (1, 2, 4, 8, 16, 64)
    assert default_token_buckets(8192, 256)[-4:] == (256, 1024, 4096, 8192)


def test_one_stream_decodes_one_row_and_equals_generate():
    """With the default buckets (1, 2, 4 under a budget of 4), one request's decode steps run
    T = R = 1 (in `LLM`'s bursts, whose program also runs the 2-token chunk: a burst of one);
    its greedy tokens equal `dsv4.generate`'s; nothing compiles after warm-up."""
    with jax.default_matmul_precision("highest"):
        llm = LLM("tiny_v41", dtype="float32", max_model_len=64, max_num_seqs=2,
                  max_num_batched_tokens=4, num_gpu_blocks_override=32,
                  compilation_cache_dir=None)  # fmt: skip
        runner = llm.engine.runner
        assert runner.token_buckets == (1, 2, 4)
        shapes = []
        dispatch = runner.dispatch

        def spy(batch, *rest):
            shapes.append((batch.token_ids.shape[0], batch.seq_lens.shape[0]))
            return dispatch(batch, *rest)

        runner.dispatch = spy
        dispatch_burst = runner.dispatch_burst  # LLM's bursts: decode buckets run through it

        def spy_burst(batches, *rest):
            steps = int(rest[-1])  # each step of the burst: [k, T] tokens, [k, R] rows
            shapes.extend([(batches.token_ids.shape[1], batches.seq_lens.shape[1])] * steps)
            return dispatch_burst(batches, *rest)

        runner.dispatch_burst = spy_burst
        prompt = [5, 17, 42, 9, 77, 3]  # two prefill chunks (4 + 2 tokens), then decode
        sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        (out,) = llm.generate([prompt], sp, use_tqdm=False)
        want = generate(runner.params, llm.cfg, jnp.asarray([prompt], jnp.int32), 5)
    assert list(out.outputs[0].token_ids) == np.asarray(want)[0].tolist()
    assert shapes[:2] == [(4, 4), (2, 2)]  # the rows: one per request, one for padding
    assert shapes[2:] and set(shapes[2:]) == {(1, 1)}
    assert llm.engine.stats.compilations_after_warm_up == 0


def test_default_table_widths_one_up_to_256_blocks_then_powers_of_eight(monkeypatch):
    """Full-width tables (one program per token bucket) while the widest table needs at most
    `FULL_WIDTH_BLOCKS` blocks (measured: no step-time difference between 64 and 256 columns on
    tiny_v41_trained, and half the programs to compile); past that, powers of eight from 64."""
    from dsv4.paged.batch import GroupInfo
    from serving import runner

    groups = [GroupInfo(0, "window", 16, (1,)), GroupInfo(1, "compressed", 4, (2,)),
              GroupInfo(2, "ring", 1, ())]  # fmt: skip
    monkeypatch.setattr(runner, "group_infos", lambda config: groups)
    assert runner.FULL_WIDTH_BLOCKS == 256
    assert runner.default_table_buckets(None, 1024) is None  # 256 blocks of 4 tokens
    assert runner.default_table_buckets(None, 1025) == (64,)  # then the full width, 257
    assert runner.default_table_buckets(None, 4 * 4096) == (64, 512)
    assert runner.default_table_buckets(None, 4 * 4096 + 1) == (64, 512, 4096)


def test_warm_up_runs_every_program_once(monkeypatch):
    """Warm-up runs each program it built once (padding that reads and writes nothing): XLA's
    first run of a program costs tens of milliseconds more on CPU, which would otherwise fall on
    the first requests that need it. Then it freezes the heap (`freeze_gc_heap`, on by default)."""
    from serving.programs import StepPrograms

    ran = []
    call = StepPrograms.__call__

    def spy(self, step, state, inputs):
        ran.append(self.shapes(step, inputs))
        return call(self, step, state, inputs)

    monkeypatch.setattr(StepPrograms, "__call__", spy)
    frozen = gc.get_freeze_count()
    llm = LLM("tiny_v41", dtype="float32", max_model_len=64, max_num_seqs=2,
              max_num_batched_tokens=4, num_gpu_blocks_override=32,
              compilation_cache_dir=None)  # fmt: skip
    programs = llm.engine.runner.programs
    assert len(programs) == llm.engine.stats.warm_up_programs - 1  # less the slot writer
    assert sorted(ran, key=repr) == sorted(programs._table, key=repr)
    assert gc.get_freeze_count() > frozen  # and the real heap left the collector's reach


def test_warm_up_freezes_the_heap_unless_asked_not_to(monkeypatch):
    """After warm-up the start-up heap leaves the cyclic collector's reach (vLLM's
    freeze_gc_heap: a full collection of it paused a step by about 0.4 s); garbage is collected
    first, and ``freeze_gc_heap=False`` leaves the collector alone."""
    import dataclasses

    from serving.config import EngineConfig
    from serving.engine import Engine

    calls = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("collect") or 0)
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    engine = Engine.__new__(Engine)  # only warm-up's own parts: no model is built
    engine.runner = type("Runner", (), {"warm_up": lambda self, progress: 0})()
    engine.stats = type("Stats", (), {})()
    for freeze, want in ((True, ["collect", "freeze"]), (False, [])):
        config = EngineConfig()
        compilation = dataclasses.replace(config.compilation_config, freeze_gc_heap=freeze)
        engine.config = dataclasses.replace(config, compilation_config=compilation)
        calls.clear()
        engine.warm_up(progress=False)
        assert calls == want
