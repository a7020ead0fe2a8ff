"""benchmarks/table_width.py on a small engine: both widths timed, the wide one wider."""

from __future__ import annotations

import pytest

from benchmarks import table_width


@pytest.mark.slow  # about 25 s of warm-up; the figure it checks is committed from a real run
def test_table_width_benchmark_times_both_widths():
    engine = dict(dtype="float32", max_model_len=64, max_num_seqs=1, max_num_batched_tokens=1,
                  num_gpu_blocks_override=48, compilation_cache_dir=None)  # fmt: skip
    result = table_width.run("tiny_v41", (1,), narrow=1, repeats=2, **engine)
    narrow, wide = result["widths"]["narrow"], result["widths"]["wide"]
    assert all(n <= w for n, w in zip(narrow, wide)) and narrow != wide
    row = result["results"]["tokens_1"]
    assert row["narrow"] > 0 and row["wide"] > 0
    assert row["wide_over_narrow"] == pytest.approx(row["wide"] / row["narrow"], rel=0.01)


def test_table_width_flags_are_checked(capsys):
    with pytest.raises(SystemExit):
        table_width.main(["--tokens", "0"])
    assert "--tokens '0'" in capsys.readouterr().err
