"""benchmarks/engram.py at its smallest: the JSON line's shape, the released byte counts (2
layers x 24 rows x (256 e4m3 bytes + 8 scales) per token), and the host-table fetch, with the
decode steps replaced by stand-ins of known cost (a real run compiles the model twice)."""

from __future__ import annotations

import json
import time
import types

import pytest

from benchmarks import engram as bench


@pytest.fixture
def fake_decode(monkeypatch):
    """Stand-ins that cost 40 and 30 ms on the benchmark's clock without sleeping: the clock is
    the real one plus a virtual offset the stand-ins advance, so the decode figures differ by
    10 ms give or take microseconds of real overhead (sleeps drifted by a millisecond under a
    loaded CI and flipped the order)."""
    virtual = [0.0]

    def cases(batch, prompt_len):
        def cost(seconds):
            def call():
                virtual[0] += seconds
                return 0

            return call

        return {"with_engram": cost(0.040), "without_engram": cost(0.030)}

    clock = types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + virtual[0])
    monkeypatch.setattr(bench, "_decode_cases", cases)
    monkeypatch.setattr(bench, "time", clock)


def test_json_line(fake_decode, capsys):
    argv = ["--batch", "2", "--repeats", "1", "--calls", "3", "--host-rows", "4096"]
    assert bench.main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip())
    assert out["benchmark"] == "engram"
    decode = out["decode"]
    assert decode["with_engram_ms"] > decode["without_engram_ms"] > 0
    assert 0.1 < decode["engram_share"] < 0.4  # 1 - 30/40, give or take real overhead
    released = out["released_gather"]
    assert released["stored_bytes_per_token"] == 2 * 24 * (256 + 8)
    assert released["bf16_bytes_per_token"] == 2 * 24 * 256 * 2
    assert released["stored_bytes_per_step"] == 2 * released["stored_bytes_per_token"]
    assert released["table_rows"] == [384006168, 384016682]
    host = out["host_gather"]
    assert host["rows_per_step"] == 2 * 2 * 24 and host["table_rows"] == 4096
    assert host["numpy_us"] > 0 and host["jit_us"] > 0 and host["device_take_us"] > 0


def test_bad_flags():
    with pytest.raises(SystemExit):
        bench.main(["--batch", "0"])
    with pytest.raises(SystemExit):
        bench.main(["--prompt-len", "600"])
