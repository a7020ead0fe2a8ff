"""The shipped packages keep the code base's shape: short functions and short docstrings.

Checked over every module of the packages pyproject.toml ships (plus ``lab``, ``training`` and
``planner`` where those folders exist), with the standard library's ``ast`` only:
- no function runs over 100 lines, and one over 60 has a ``#`` comment line directly above its
  ``def`` (or its first decorator) saying why it is long;
- a function's or class's docstring says what and why in at most 5 non-blank lines before its
  first section header (``Args:``, ``Returns:``, ...) and stays at most 15 lines in all.
Each failure names every offender as ``path:line``.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXTRA_PACKAGES = ("lab", "training", "planner")  # outside the inference path, when present

MAX_LINES = 100  # no function is longer
EXPLAIN_OVER = 60  # a longer function carries a comment above it saying why
MAX_PROSE = 5  # non-blank lines of a docstring before its first section header
MAX_DOC_LINES = 15  # lines of a whole docstring, its Args/Returns entries included
SECTION = re.compile(
    r"^\s*(Args|Arguments|Returns|Raises|Yields|Attributes|Fields|Examples?|Notes?)\s*:\s*$"
)
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def package_dirs(root: Path = REPO) -> list[Path]:
    """The folders of the shipped packages: pyproject.toml's ``packages.find`` list, plus the
    extra top-level packages that exist."""
    pyproject = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    patterns = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    names = [p.rstrip("*").rstrip(".") for p in patterns] + list(EXTRA_PACKAGES)
    dirs = {root / n for n in names if (root / n / "__init__.py").is_file()}
    return sorted(dirs)


def modules(root: Path = REPO) -> list[Path]:
    """Every .py file of the shipped packages."""
    return [p for d in package_dirs(root) for p in sorted(d.rglob("*.py"))]


def long_functions(source: str, where: str) -> list[str]:
    """``where:line name (n lines)`` of each function over MAX_LINES, or over EXPLAIN_OVER
    with no comment line directly above its def or first decorator."""
    lines = source.splitlines()
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, FUNCTIONS):
            continue
        length = node.end_lineno - node.lineno + 1
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        above = lines[first - 2].strip() if first >= 2 else ""
        if length > MAX_LINES or (length > EXPLAIN_OVER and not above.startswith("#")):
            out.append(f"{where}:{node.lineno} {node.name} ({length} lines)")
    return out


def long_docstrings(source: str, where: str) -> list[str]:
    """``where:line name (prose p, total t)`` of each function or class whose docstring has
    over MAX_PROSE lines of prose before its first section or over MAX_DOC_LINES lines."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (*FUNCTIONS, ast.ClassDef)):
            continue
        doc = ast.get_docstring(node, clean=True)
        if not doc:
            continue
        prose = 0
        for line in doc.splitlines():
            if SECTION.match(line):
                break
            prose += bool(line.strip())
        total = len(doc.splitlines())
        if prose > MAX_PROSE or total > MAX_DOC_LINES:
            out.append(f"{where}:{node.lineno} {node.name} (prose {prose}, total {total})")
    return out


def offenders(check) -> list[str]:
    """Run a check over every shipped module, each named relative to the repository."""
    out = []
    for path in modules():
        out += check(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))
    return out


def test_the_shipped_packages_are_found():
    names = {d.name for d in package_dirs()}
    assert {"cache", "dsv4", "pallas_kernels", "serving"} <= names, names
    assert len(modules()) > 50


def test_no_function_is_too_long_or_long_without_a_reason():
    bad = offenders(long_functions)
    assert not bad, (
        f"{len(bad)} functions over {MAX_LINES} lines, or over {EXPLAIN_OVER} with no "
        "`# why` comment above the def:\n" + "\n".join(bad)
    )


def test_docstrings_are_short():
    bad = offenders(long_docstrings)
    assert not bad, (
        f"{len(bad)} docstrings over {MAX_PROSE} prose lines before their first section or "
        f"over {MAX_DOC_LINES} lines (move the rest to docs/):\n" + "\n".join(bad)
    )


def _function(lines: int, comment: str = "", decorator: str = "") -> str:
    """A synthetic module whose function ``f`` runs ``lines`` lines from its def."""
    body = "".join(f"    x = {i}\n" for i in range(lines - 1))
    return f"import functools\n{comment}{decorator}def f():\n{body}"


@pytest.mark.parametrize(
    "lines, comment, decorator, flagged",
    [
        (60, "", "", False),
        (61, "", "", True),
        (61, "# a flat dispatch table\n", "", False),
        (61, "# why\n", "@functools.cache\n", False),
        (61, "", "@functools.cache\n# not above the decorator\n", True),
        (101, "# too long even with a reason\n", "", True),
    ],
)
def test_the_length_check_can_fail(lines, comment, decorator, flagged):
    source = _function(lines, comment, decorator)
    def_line = source.splitlines().index("def f():") + 1
    expected = [f"synthetic.py:{def_line} f ({lines} lines)"] if flagged else []
    assert long_functions(source, "synthetic.py") == expected


def _docstring(prose: int, args: int) -> str:
    """A synthetic class whose docstring has ``prose`` lines and ``args`` Args entries."""
    text = "\n".join(f"    Prose line {i}." for i in range(prose)).strip()
    if args:
        text += "\n\n    Args:\n" + "\n".join(f"        a{i}: one." for i in range(args))
    return f'class C:\n    """{text}\n    """\n\n    def m(self):\n        """One line."""\n'


@pytest.mark.parametrize(
    "prose, args, total, flagged",
    [(5, 0, 5, False), (6, 0, 6, True), (5, 8, 15, False), (5, 9, 16, True), (3, 12, 17, True)],
)
def test_the_docstring_check_can_fail(prose, args, total, flagged):
    expected = [f"synthetic.py:1 C (prose {prose}, total {total})"] if flagged else []
    assert long_docstrings(_docstring(prose, args), "synthetic.py") == expected
