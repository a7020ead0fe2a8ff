"""Every Python block of README.md and docs/*.md runs as written.

Each block runs alone in a fresh interpreter (what a reader pasting it gets: nothing defined
before it, no XLA flags but those it sets, a fresh persistent compilation cache), in an empty
directory. A block whose fence says ``python slow`` runs in the slow tier only (`make
test-slow`); the others run by default. One that says ``server`` talks to ``dsv4 serve`` on
port 8000, as the README starts it: the test starts one first (small engine sizes, the API key
the block's client sends; the block sees only the HTTP API). A block in several files runs once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)
TAGS = {"slow", "server"}  # what a fence may say after ``python``
TIMEOUT_S = 900


@dataclasses.dataclass(frozen=True)
class Block:
    source: str
    places: tuple[str, ...]  # "README.md:31": where the block's fence opens
    tags: frozenset[str]


def find_blocks(files: list[Path] = FILES) -> list[Block]:
    """The Python blocks of ``files`` in order, each distinct source once (with every place)."""
    found: dict[str, Block] = {}
    for path in files:
        text = path.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            place = f"{path.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}"
            tags = frozenset(m.group(1).split())
            if not tags <= TAGS:
                raise ValueError(f"{place}: fence tags {sorted(tags - TAGS)}; allowed: {TAGS}")
            old = found.get(m.group(2))
            if old is None:
                found[m.group(2)] = Block(m.group(2), (place,), tags)
            else:
                found[m.group(2)] = Block(old.source, (*old.places, place), old.tags | tags)
    return list(found.values())


def _param(block: Block):
    marks = [pytest.mark.slow] if "slow" in block.tags else []
    return pytest.param(block, id=block.places[0], marks=marks)


def run_block(block: Block, workdir: Path) -> subprocess.CompletedProcess:
    """``block`` in a fresh interpreter in ``workdir``, the repository importable."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["XDG_CACHE_HOME"] = str(workdir / "cache")  # LLM's persistent compilation cache
    env.setdefault("JAX_PLATFORMS", "cpu")
    return subprocess.run(
        [sys.executable, "-c", block.source],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


# the server a ``server`` block talks to: the README's `dsv4 serve` on its port, small sizes
SERVER = [sys.executable, "-m", "serving.cli", "serve", "tiny_v41_trained", "--port", "8000",
          "--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
          "--token-buckets", "64", "--num-gpu-blocks", "200", "--no-compilation-cache"]  # fmt: skip


def _read_lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)
    out.put(None)


@contextlib.contextmanager
def serving(block: Block) -> Iterator[None]:
    """`SERVER` running (until ready) while the block runs, if the block needs it."""
    if "server" not in block.tags:
        yield
        return
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    key = re.search(r'api_key="([^"]*)"', block.source)
    cmd = [*SERVER, "--api-key", key.group(1)] if key else SERVER
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True).start()
    try:
        seen = []
        while not seen or "ready, listening on http://" not in seen[-1]:
            seen.append(lines.get(timeout=TIMEOUT_S))
            assert seen[-1] is not None, "dsv4 serve exited:\n" + "".join(seen[:-1])
        yield
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("block", [_param(b) for b in find_blocks()])
def test_block_runs_as_written(block: Block, tmp_path: Path):
    with serving(block):
        done = run_block(block, tmp_path)
    where = ", ".join(block.places)
    assert done.returncode == 0, f"{where} failed:\n{done.stdout}\n{done.stderr}"
    # Python's warnings, and XLA's C++ log lines ("W1206 10:43:20.926381 5801 file.cc:666] ...")
    xla = re.compile(r"^[WE]\d{4} [\d:.]+ +\d+ \S+:\d+\]")
    warnings = [
        line for line in done.stderr.splitlines() if "warning" in line.lower() or xla.match(line)
    ]
    assert not warnings, f"{where} warns:\n" + "\n".join(warnings)


def test_readme_has_a_block_in_the_default_run():
    readme = [b for b in find_blocks() if any(p.startswith("README.md:") for p in b.places)]
    assert len(readme) >= 3
    assert any("slow" not in b.tags for b in readme)


def test_find_blocks_reads_tags_places_and_repeats(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("x\n```python\nprint(1)\n```\n\n```bash\nls\n```\n```python slow\nf()\n```\n")
    b.write_text("```python\nprint(1)\n```\n")
    blocks = find_blocks([a, b])
    assert blocks == [
        Block("print(1)\n", ("a.txt:2", "b.txt:1"), frozenset()),
        Block("f()\n", ("a.txt:9",), frozenset({"slow"})),
    ]
    b.write_text("```python notest\nprint(2)\n```\n")
    with pytest.raises(ValueError, match=r"b.txt:1: fence tags \['notest'\]"):
        find_blocks([b])


def test_the_trained_models_size_is_the_computed_one():
    """The docs and notebooks give tiny_v41_trained's size as `dsv4 demo` prints it: the
    backbone's parameters and the DSpark drafter's apart, in millions to one decimal (the only
    other size named is the narrower ``--cpu-hour`` model's, scripts/train_tiny.py)."""
    import importlib.util

    from dsv4.checkpoint import shipped_checkpoint
    from dsv4.config import ModelConfig, tiny_v41_trained
    from dsv4.params import count_params

    spec = importlib.util.spec_from_file_location("train_tiny", REPO / "scripts/train_tiny.py")
    train_tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_tiny)
    narrow = tiny_v41_trained(drafter=False, **train_tiny.CPU_HOUR_WIDTHS)
    cfg = ModelConfig.from_json(shipped_checkpoint("tiny_v41_trained"))
    backbone = f"{count_params(cfg, drafter=False) / 1e6:.1f}"
    drafter = f"{(count_params(cfg) - count_params(cfg, drafter=False)) / 1e6:.1f}"
    figures = {backbone, drafter, f"{count_params(narrow) / 1e6:.1f}"}
    files = (
        "docs/trained_model.md",
        "notebooks/quickstart.ipynb",
        "notebooks/cache_layout_lab.ipynb",
    )
    for name in files:
        text = (REPO / name).read_text(encoding="utf-8")
        found = re.findall(r"(\d+\.\d)M parameters", text)
        assert backbone in found and set(found) <= figures, (name, found, figures)
    text = (REPO / "docs/trained_model.md").read_text(encoding="utf-8")
    assert f"DSpark drafter ({drafter}M" in text
