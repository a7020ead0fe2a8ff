"""Engine tests run with full-precision matmuls, as the model tests do (their fp32 outputs are
compared with the reference). `tiny_cfg` / `tiny_params` come from tests/."""

from __future__ import annotations

import jax
import pytest


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture
def usage_error(capsys):
    """``usage_error(argv)`` runs ``dsv4 argv``, which must exit with a usage error: status 2
    and one line on stderr (no usage dump, no traceback); returns (stdout, stderr)."""
    from serving.cli import main

    def run(argv: list[str]) -> tuple[str, str]:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        captured = capsys.readouterr()
        assert len(captured.err.splitlines()) == 1, captured.err
        return captured.out, captured.err

    return run
