"""benchmarks/decode_scaling.py on the real tiny model at its smallest: the paged path at batches
1 and 2 and the generate path at batch 1, a few tokens, one repeat (each compile costs seconds).
The JSON line's fields, the ratio's arithmetic and the argument checks; the timings themselves
are the benchmark's business (`python -m benchmarks.decode_scaling`)."""

from __future__ import annotations

import json

import pytest

from benchmarks import decode_scaling

ARGV = ["--prompt-len", "5", "--new-tokens", "3", "--repeats", "1", "--paged-calls", "2"]


def _json_line(argv, capsys) -> dict:
    assert decode_scaling.main([*ARGV, *argv]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out["benchmark"] == "decode_scaling" and out["model"] == "tiny_v41"
    assert (out["prompt_len"], out["new_tokens"], out["repeats"]) == (5, 3, 1)
    return out


def test_generate_path(capsys):
    out = _json_line(["--batches", "1", "--paths", "generate"], capsys)
    assert "paged" not in out and out["batches"] == [1]
    assert set(out["generate"]) == {"ms_per_step"}  # one batch: no ratio
    assert out["generate"]["ms_per_step"]["1"] >= 0


def test_paged_path(capsys):
    out = _json_line(["--batches", "1,2", "--paths", "paged"], capsys)
    assert "generate" not in out and out["batches"] == [1, 2]
    ms = out["paged"]["ms_per_step"]
    assert set(ms) == {"1", "2"} and min(ms.values()) > 0
    assert out["paged"]["ratio_b2_over_b1"] == pytest.approx(ms["2"] / ms["1"], abs=2e-3)
    # exact buckets by default: T = B tokens, R = B + 1 rows (the padding row)
    assert out["paged"]["token_bucket"] == {"1": 1, "2": 2}
    assert out["paged"]["request_bucket"] == {"1": 2, "2": 3}
    assert out["paged"]["max_model_len"] == 8


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batches", "1,x"], "--batches"),
        (["--paths", "generate,dense"], "--paths"),
        (["--new-tokens", "1"], "new_tokens=1"),
        (["--repeats", "0"], "repeats=0"),
        (["--batches", "1,8", "--token-bucket", "4"], "token_bucket=4"),
        (["--batches", "1,8", "--request-bucket", "8"], "request_bucket=8"),
    ],
)
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        decode_scaling.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
