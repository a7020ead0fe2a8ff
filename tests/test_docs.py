"""Every link in the docs and the code resolves inside the repository, and README.md stays short.

Checked: markdown links and backticked paths in README.md, docs/*.md and the other markdown files;
every `*.md` reference (with its `#section` anchor, if any) in .py files and notebooks. A link
must name an existing file inside the repository (and an existing heading when it has an
anchor); nothing may point at the design notes outside it or at an absolute path.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200
SKIP_DIRS = {"__pycache__", "build", "dist", "runs", "node_modules"}
OUTSIDE = "../" + "shared"  # the notes beside the repository, which a user never has

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
MD_REF = re.compile(r"(?<![\w./-])((?:\.{1,2}/|/)?[\w./-]*\w\.md(?:#[\w-]+)?)")
PATH_LIKE = re.compile(
    r"^(?:\.{1,2}/|/)?[\w.-]+(?:/[\w.-]+)*\.(?:md|py|ipynb|sh|toml)(?:#[\w-]+)?$"
)
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _files(root: Path, pattern: str) -> list[Path]:
    out = []
    for p in sorted(root.rglob(pattern)):
        parts = p.relative_to(root).parts[:-1]
        if any(s.startswith(".") or s in SKIP_DIRS or s.endswith(".egg-info") for s in parts):
            continue
        out.append(p)
    return out


def _names_a_path(root: Path, span: str) -> bool:
    """A backticked `file.md`, or `dir/file.ext` under one of the repository's folders, names a
    file of ours; a bare `test_x.py` is only a name, and `vllm/...` another project's path."""
    path = span.partition("#")[0]
    if path.endswith(".md"):
        return True
    first = path.split("/")[0]
    return "/" in path and (first in (".", "..") or (root / first).is_dir())


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of a markdown text outside fenced code blocks."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a markdown file's headings (repeated headings get -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        k = seen.get(base, 0)
        seen[base] = k + 1
        out.add(base if k == 0 else f"{base}-{k}")
    return out


def check_target(root: Path, source: Path, target: str, *, root_relative: bool) -> str | None:
    """Why ``target`` (as written in ``source``) does not resolve, or None when it does.

    Markdown links resolve against the linking file's folder; backticked paths and references in
    code may also be written from the repository root.
    """
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
        return None
    if OUTSIDE in target or "shared/reference" in target:
        return f"points outside the repository: {target}"
    path_part, _, anchor = target.partition("#")
    if path_part.startswith("/"):
        return f"absolute path: {target}"
    root = root.resolve()
    if path_part:
        bases = [source.parent, root] if root_relative else [source.parent]
        found = None
        for base in bases:
            cand = (base / path_part).resolve()
            if cand.is_relative_to(root) and cand.exists():
                found = cand
                break
        if found is None:
            return f"no such file in the repository: {target}"
    else:
        found = source
    if anchor:
        if found.suffix != ".md":
            return f"anchor on a file that is not markdown: {target}"
        if anchor not in anchors(found):
            return f"no heading #{anchor} in {found.relative_to(root)}: {target}"
    return None


def markdown_problems(root: Path, path: Path) -> list[str]:
    """Broken links and backticked paths of one markdown file."""
    out = []
    rel = path.relative_to(root)
    for n, line in _prose_lines(path.read_text(encoding="utf-8")):
        if OUTSIDE in line or "shared/reference" in line:
            out.append(f"{rel}:{n}: points outside the repository")
            continue
        spans = CODE_SPAN.findall(line)
        prose = CODE_SPAN.sub("", line)
        found = [(t, False) for t in LINK.findall(prose)]
        found += [(s, True) for s in spans if PATH_LIKE.match(s) and _names_a_path(root, s)]
        for target, root_relative in found:
            why = check_target(root, path, target, root_relative=root_relative)
            if why:
                out.append(f"{rel}:{n}: {why}")
    return out


def code_problems(root: Path, path: Path) -> list[str]:
    """Broken `*.md` references (and references outside the repository) of a .py or notebook."""
    out = []
    rel = path.relative_to(root)
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if OUTSIDE in line or "shared/reference" in line:
            out.append(f"{rel}:{n}: points outside the repository")
        for target in MD_REF.findall(line):
            why = check_target(root, path, target, root_relative=True)
            if why:
                out.append(f"{rel}:{n}: {why}")
    return out


def repo_problems(root: Path, *, skip: tuple[Path, ...] = ()) -> list[str]:
    problems = []
    for md in _files(root, "*.md"):
        problems += markdown_problems(root, md)
    for code in _files(root, "*.py") + _files(root, "*.ipynb"):
        if code.resolve() not in skip:
            problems += code_problems(root, code)
    return problems


def test_every_link_resolves_inside_the_repository():
    problems = repo_problems(REPO, skip=(Path(__file__).resolve(),))
    assert not problems, "\n".join(problems)


def test_docs_exist_and_readme_links_them():
    pages = _files(REPO / "docs", "*.md")
    assert (REPO / "docs" / "architecture.md") in pages
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    for page in pages:
        assert f"docs/{page.name}" in readme, f"README.md does not link docs/{page.name}"


def test_readme_is_short():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


def test_slug_follows_github():
    assert slug("`LLM` and the engine") == "llm-and-the-engine"
    assert slug("Scale-out: meshes, expert parallelism, multi-host") == (
        "scale-out-meshes-expert-parallelism-multi-host"
    )
    assert slug("The trained small model (`tiny_v41_trained`)") == (
        "the-trained-small-model-tiny_v41_trained"
    )


@pytest.fixture
def tiny_repo(tmp_path: Path) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "pkg").mkdir()
    (tmp_path / "docs" / "good.md").write_text("# Good\n\n## A section\n\n## A section\n")
    (tmp_path / "README.md").write_text(
        "# Repo\n\n[good](docs/good.md#a-section), [again](docs/good.md#a-section-1), "
        "`docs/good.md`, `pkg/mod.py`, [web](https://example.com), [self](#repo), vLLM's "
        "`vllm/v1/request.py`\n\n"
        "```\n[in a code block](docs/missing.md)\n```\n"
    )
    (tmp_path / "pkg" / "mod.py").write_text('"""See `docs/good.md#a-section`."""\n')
    return tmp_path


def test_checker_passes_a_good_tree(tiny_repo: Path):
    assert repo_problems(tiny_repo) == []


@pytest.mark.parametrize(
    ("where", "text", "expected"),
    [
        ("docs/bad.md", "[x](missing.md)\n", "no such file"),
        ("docs/bad.md", "[x](good.md#no-such-section)\n", "no heading #no-such-section"),
        ("docs/bad.md", "[x](#nowhere)\n", "no heading #nowhere"),
        ("docs/bad.md", "see `docs/missing.md`\n", "no such file"),
        ("docs/bad.md", "see `missing.md`\n", "no such file"),
        ("docs/bad.md", "see `pkg/missing.py`\n", "no such file"),
        ("docs/bad.md", f"[x]({OUTSIDE}/reference/model_v41.md)\n", "outside the repository"),
        ("docs/bad.md", "[x](/etc/passwd.md)\n", "absolute path"),
        ("docs/bad.md", "[x](../../elsewhere/README.md)\n", "no such file"),
        ("pkg/bad.py", '"""The math (``model_v41.md`` section 2.5)."""\n', "no such file"),
        ("pkg/bad.py", '"""The math (docs/good.md#nothing)."""\n', "no heading #nothing"),
        ("pkg/bad.py", f"# notes: {OUTSIDE}/DESIGN.md\n", "outside the repository"),
    ],
)
def test_checker_finds_each_broken_link(tiny_repo: Path, where: str, text: str, expected: str):
    (tiny_repo / where).write_text(text)
    problems = repo_problems(tiny_repo)
    assert problems and all(where in p for p in problems), problems
    assert any(expected in p for p in problems), problems
