"""benchmarks/generate_cpu.py without compiling the model: `generate` and `init_params` are
replaced by stand-ins whose cost is known, so the JSON line's shape and the arithmetic that turns
timings into decode throughput are checked in well under a second (a real run compiles the
model four times, minutes on a small CPU; `python -m benchmarks.generate_cpu` is the real thing).
"""

from __future__ import annotations

import json
import time

import jax.numpy as jnp
import pytest

from benchmarks import generate_cpu

PREFILL_S = 0.3
STEP_S = 0.05  # large next to real call overhead on a loaded CI machine


@pytest.fixture
def fake_model(monkeypatch):
    """A `generate` that costs a fixed prefill plus one fixed step per further token, whatever
    the batch, on the benchmark's clock: real time plus a virtual offset the stand-in advances
    instead of sleeping (a loaded machine oversleeps by milliseconds, and two test workers
    share the cores)."""
    import types

    import dsv4.generation
    import dsv4.params

    virtual = [0.0]

    def fake_generate(params, cfg, prompt, max_new_tokens):
        assert prompt.dtype == jnp.int32 and prompt.ndim == 2
        assert int(prompt.min()) >= 3 and int(prompt.max()) < cfg.vocab_size
        virtual[0] += PREFILL_S + STEP_S * (max_new_tokens - 1)
        return jnp.zeros((prompt.shape[0], max_new_tokens), jnp.int32)

    clock = types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + virtual[0])
    monkeypatch.setattr(dsv4.params, "init_params", lambda cfg, key: {})
    monkeypatch.setattr(dsv4.generation, "generate", fake_generate)
    monkeypatch.setattr(generate_cpu, "time", clock)


def test_json_line(fake_model, capsys):
    assert generate_cpu.main(["--new-tokens", "11", "--prompt-len", "5", "--repeats", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out["benchmark"] == "generate_cpu" and out["model"] == "tiny_v41"
    assert (out["prompt_len"], out["new_tokens"], out["repeats"]) == (5, 11, 2)
    assert out["backend"] == "cpu" and out["params"] > 0
    assert set(out["results"]) == {"batch_1", "batch_8"}
    for b in (1, 8):
        r = out["results"][f"batch_{b}"]
        assert r["batch"] == b
        # 10 decode steps of STEP_S each, prefill taken out (plus microseconds of real time)
        assert r["ms_per_decode_step"] == pytest.approx(STEP_S * 1000, rel=0.2)
        assert r["decode_tokens_per_s"] == pytest.approx(b * 10 / r["decode_s"], rel=1e-2)
        assert r["end_to_end_tokens_per_s"] < r["decode_tokens_per_s"]  # prefill is out
        assert r["prefill_s"] >= PREFILL_S and r["compile_s"] >= 0
    ratio = out["decode_tokens_per_s_ratio_b8_over_b1"]
    assert ratio == pytest.approx(8, rel=0.2)  # the stand-in's cost does not depend on the batch


def test_bad_arguments(fake_model, capsys):
    for argv, message in [
        (["--batches", "1,x"], "comma list of ints"),
        (["--batches", "0"], "batch sizes >= 1"),
        (["--new-tokens", "1"], "must be >= 2 to time decode steps"),
        (["--prompt-len", "500", "--new-tokens", "64"], "must fit max_seq_len 512"),
    ]:
        with pytest.raises(SystemExit):
            generate_cpu.main(argv)
        assert message in capsys.readouterr().err
