"""The `dsv4` command line: the README's demo and the layout report run and say something true."""

from __future__ import annotations

import re

import pytest

from serving.cli import main


@pytest.mark.parametrize(
    "extra", [[], ["--bounded-replay"], ["--model", "tiny", "--num-speculative-tokens", "3"]]
)
def test_demo_runs_and_hits_on_later_turns(capsys, extra):
    assert main(["demo", "--conversations", "2", "--turns", "3", *extra]) == 0
    out = capsys.readouterr().out
    hits = [int(h) for h in re.findall(r"hit\s+(\d+)", out)]
    assert len(hits) == 6
    assert hits[0] == 0 and all(h > 0 for h in hits[1:3])  # later turns reuse the history
    assert "prefix-cache hit rate over 6 turns" in out


def test_layout_report(capsys):
    assert main(["layout", "--memory-gib", "4"]) == 0
    out = capsys.readouterr().out
    assert "KV-cache pool:" in out and "MLAAttentionSpec" in out and "per request:" in out
