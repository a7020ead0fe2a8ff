"""`cache` is pure Python (importing it pulls in neither jax nor numpy), and its modules import
only downward (docs/allocator_internals.md, section 1)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import cache


def test_cache_imports_no_jax_or_numpy():
    code = (
        "import sys, cache, cache.layout, cache.spec, cache.coordinator, cache.kv_cache_manager,"
        " cache.single_type_kv_cache_manager, cache.manager;"
        "bad = sorted(m for m in ('jax', 'numpy', 'torch') if m in sys.modules);"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _cache_imports() -> dict[str, list[tuple[str, bool]]]:
    """Module -> (imported `cache` module, whether the import sits inside a def), per import."""
    root = Path(cache.__file__).parent
    graph: dict[str, list[tuple[str, bool]]] = {}
    for path in sorted(root.glob("*.py")):
        tree = ast.parse(path.read_text())
        local = {
            id(node)
            for fn in ast.walk(tree)
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            for node in ast.walk(fn)
        }
        edges = []
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cache"):
                targets = [node.module] if node.module != "cache" else []
                targets += [f"cache.{a.name}" for a in node.names if node.module == "cache"]
                edges += [(t, id(node) in local) for t in targets]
            elif isinstance(node, ast.Import):
                edges += [
                    (a.name, id(node) in local) for a in node.names if a.name.startswith("cache")
                ]
        graph[f"cache.{path.stem}"] = edges
    return graph


def test_cache_modules_import_only_downward():
    """No import inside a function, and no cycle among the modules of `cache`."""
    graph = _cache_imports()
    local = [(m, t) for m, edges in graph.items() for t, inside in edges if inside]
    assert not local, f"function-local imports: {local}"
    deps = {
        m: {t for t, _ in edges if t in graph}
        for m, edges in graph.items()
        if m != "cache.__init__"
    }
    order: list[str] = []
    while deps:
        ready = sorted(m for m, d in deps.items() if d <= set(order))
        assert ready, f"import cycle among {sorted(deps)}"
        order += ready
        for m in ready:
            del deps[m]
