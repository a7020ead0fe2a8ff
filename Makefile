# Two entry points for a fresh machine: `make demo` and `make test`.
# Each creates .venv with Python 3.12 (if needed) and installs the project into it.
SHELL := /bin/bash
VENV := .venv
BIN := $(VENV)/bin
# pytest-xdist workers for `make test` / `make test-slow` (0 runs the suite in this process)
TEST_WORKERS ?= 2

# python3.12 from PATH, or from a pyenv install when the pyenv shim is not activated.
PYTHON312 ?= $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do \
	"$$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && { echo "$$p"; break; }; done)

.PHONY: demo test test-slow lint venv clean

$(BIN)/python:
	@test -n "$(PYTHON312)" || { echo "Python 3.12 not found: install it or set PYTHON312=/path/to/python3.12" >&2; exit 1; }
	$(PYTHON312) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# the demo's install has the lab extra too, so that `dsv4 lab` (its plots) works right after it,
# and the serve extra, so that `dsv4 serve` does
$(VENV)/.installed-main: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[lab,serve]'
	@touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test,aot,lab,serve]'
	@touch $@

venv: $(VENV)/.installed-test

demo: $(VENV)/.installed-main
	$(BIN)/dsv4 demo

lint: $(VENV)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest -n $(TEST_WORKERS)

# the long variants (marked slow) that `make test` leaves to their fast representatives
test-slow: $(VENV)/.installed-test
	$(BIN)/python -m pytest -n $(TEST_WORKERS) -m slow

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
