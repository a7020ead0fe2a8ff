"""The layers of the code base hold: pyproject.toml's import-linter contracts are kept.

The contracts (``[tool.importlinter]``) put ``cache`` and ``pallas_kernels`` at the bottom,
``dsv4`` above them and ``serving`` on top, order the modules inside ``dsv4``, and keep
training, the memory planner and the lab (a package beside ``serving``) off the inference
path. grimp reads every import statement, function-local ones included.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path

import serving

ROOT = Path(__file__).resolve().parents[1]

# import-linter in a child process: it puts its working directory first on sys.path, so the
# packages it reads are the ones under ``cwd``; no cache is written there
_LINT = (
    "import sys; from importlinter.cli import lint_imports; "
    "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))"
)


def lint(cwd: Path) -> subprocess.CompletedProcess:
    """Run the contracts of ``cwd``'s pyproject.toml on the packages under ``cwd``."""
    return subprocess.run(
        [sys.executable, "-c", _LINT], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_the_import_contracts_hold():
    run = lint(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout, run.stdout


def test_every_serving_module_is_on_the_inference_path_and_the_lab_beside_it():
    """A new serving module must be classified: the inference-path contract lists every one,
    so that a module left off the list cannot import training unchecked; the lab is a package
    beside serving that the inference path may not import."""
    from importlinter.api import read_configuration

    contracts = read_configuration(str(ROOT / "pyproject.toml"))["contracts_options"]
    (inference,) = [c for c in contracts if c.get("id") == "inference-path"]
    modules = {f"serving.{m.name}" for m in pkgutil.iter_modules(serving.__path__)}
    assert "serving.lab" not in modules
    assert (ROOT / "lab" / "__init__.py").is_file()
    assert "lab" in inference["forbidden_modules"]
    assert modules <= set(inference["source_modules"])


_TOY_CONFIG = """
[tool.importlinter]
root_packages = ["toy"]

[[tool.importlinter.contracts]]
name = "toy layers"
type = "layers"
containers = ["toy"]
layers = ["high", "low"]
"""


def test_a_back_edge_breaks_the_contracts(tmp_path):
    """The check above can fail: the same runner reports a lower module importing a higher
    one, even when the import hides inside a function, and passes once it is gone."""
    pkg = tmp_path / "toy"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "high.py").write_text("from toy import low\n")
    (tmp_path / "pyproject.toml").write_text(_TOY_CONFIG)
    (pkg / "low.py").write_text("X = 1\n")
    assert lint(tmp_path).returncode == 0
    (pkg / "low.py").write_text(
        textwrap.dedent(
            """
            def f():
                from toy import high  # a back-edge hidden in a function

                return high
            """
        )
    )
    run = lint(tmp_path)
    assert run.returncode != 0
    assert "toy.low -> toy.high" in run.stdout, run.stdout
