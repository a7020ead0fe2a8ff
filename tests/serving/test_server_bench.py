"""benchmarks/serve.py on a small engine: HTTP and offline produce the same tokens, and every
figure it prints is there and positive."""

from __future__ import annotations

import pytest

from benchmarks import serve


@pytest.mark.slow
def test_serve_benchmark_runs_small():
    engine = dict(dtype="float32", max_num_batched_tokens=64, token_buckets=(64,))
    result = serve.run("tiny_v41_trained", 4, 16, 6, 64, compilation_cache_dir=None, **engine)
    assert result["same_tokens"] is True
    assert result["offline_output_tokens_per_s"] > 0 and result["http_output_tokens_per_s"] > 0
    assert result["http_over_offline"] > 0
    assert result["http_ttft_ms"]["p50"] > 0 and result["http_itl_ms"]["p99"] > 0
    assert "streaming clients" in serve.table_row(result)


def test_readme_shows_the_committed_serve_line():
    """README.md's serving figures are `table_row` of the committed run
    (benchmarks/results/serve/), not typed."""
    import json
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    (committed,) = sorted((root / "benchmarks" / "results" / "serve").glob("*.json"))
    result = json.loads(committed.read_text())
    assert result["benchmark"] == "serve" and result["same_tokens"] is True
    assert serve.table_row(result) in (root / "README.md").read_text()
