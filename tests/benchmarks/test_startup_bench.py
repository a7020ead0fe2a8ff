"""benchmarks/startup.py: two fresh processes share a persistent compilation cache; the second
start of the same engine configuration compiles nothing (it loads every executable)."""

from __future__ import annotations

import json

from benchmarks import startup


def test_second_start_compiles_nothing(capsys, tmp_path):
    argv = ["--token-buckets", "8", "--max-num-batched-tokens", "8", "--max-num-seqs", "2",
            "--cache-dir", str(tmp_path)]  # fmt: skip
    assert startup.main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cold, second = out["cold"], out["second"]
    assert cold["warm_up_compilations"] >= 1
    assert second["warm_up_compilations"] == 0 and second["warm_up_cache_hits"] >= 1
    assert out["second_start_compiles_nothing"] is True
    assert any(tmp_path.iterdir()), "the cache directory holds the executables"
