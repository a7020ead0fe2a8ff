"""No notebook trips a user on a warning from this project's code: its progress bars are plain
`tqdm`, since ``tqdm.auto`` warns (TqdmWarning: IProgress not found) in every Jupyter kernel
without ipywidgets, at the first import of the package."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("dsv4", "pallas_kernels", "cache", "serving", "training", "planner", "lab")
AUTO = re.compile(
    r"^\s*(from tqdm\.(auto|autonotebook) import|import tqdm\.(auto|autonotebook))", re.M
)


def test_no_module_imports_tqdm_auto():
    found = [
        f"{path.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}"
        for package in PACKAGES
        for path in sorted((REPO / package).rglob("*.py"))
        for text in [path.read_text(encoding="utf-8")]
        for m in AUTO.finditer(text)
    ]
    assert not found, f"tqdm.auto warns in a notebook without ipywidgets: {found}"


def test_the_pattern_finds_both_spellings():
    assert AUTO.search("x = 1\n    from tqdm.auto import tqdm\n")
    assert AUTO.search("import tqdm.autonotebook\n")
    assert not AUTO.search("from tqdm import tqdm\n")
