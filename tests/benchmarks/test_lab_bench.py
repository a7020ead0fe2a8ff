"""benchmarks.lab prints one JSON line with the lab's speed (small sizes here)."""

from __future__ import annotations

import json

import pytest

from benchmarks import lab as bench


def test_json_line(capsys):
    bench.main(
        [
            "--requests",
            "300",
            "--max-steps",
            "150",
            "--sweep-points",
            "2",
            "--sweep-conversations",
            "8",
            "--sweep-workers",
            "2",
        ]
    )
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["benchmark"] == "lab" and out["steps"] == 150
    assert out["scheduler_allocator_steps_per_s"] > 0 and out["lab_run_steps_per_s"] > 0
    sweep = out["sweep"]
    assert sweep["points"] == 2 and sweep["pool_blocks"] == [1000, 1500] and sweep["workers"] == 2
    assert all(0 <= h <= 1 for h in sweep["hit_rates"])


def test_bad_flags():
    with pytest.raises(SystemExit):
        bench.main(["--sweep-points", "0"])
    with pytest.raises(SystemExit):
        bench.main(["--sweep-workers", "0"])
