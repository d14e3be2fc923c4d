# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create .venv from pyenv's Python 3.12.1, install torch==2.11.0 first, then this project.
SHELL := /bin/bash
PYENV_ROOT ?= $(shell pyenv root 2>/dev/null || echo $$HOME/.pyenv)
PY312 ?= $(PYENV_ROOT)/versions/3.12.1/bin/python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
DEMO_ARGS ?=

.PHONY: setup demo test gpu-test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@if [ ! -x "$(PY312)" ]; then \
	  echo "error: Python 3.12 not found at $(PY312). Install it with 'pyenv install 3.12.1' (or set PY312=/path/to/python3.12)." >&2; \
	  exit 1; fi
	@$(PY312) -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' || \
	  { echo "error: $(PY312) is not Python 3.12" >&2; exit 1; }
	$(PY312) -m venv $(VENV) || { echo "error: could not create $(VENV) with $(PY312)" >&2; exit 1; }
	$(PY) -m pip install -q --upgrade pip || { echo "error: pip upgrade failed" >&2; exit 1; }
	$(PY) -m pip install -q torch==2.11.0 || { echo "error: installing torch==2.11.0 failed (see pip output above)" >&2; exit 1; }
	$(PY) -m pip install -q -e ".[test,bench]" || { echo "error: installing mcore-distill[test,bench] failed (see pip output above)" >&2; exit 1; }
	@touch $@

demo: $(STAMP)
	$(PY) -m torch.distributed.run --standalone --nproc-per-node 2 -m examples.demo.run $(DEMO_ARGS)

test: $(STAMP)
	$(PY) -m pytest -m "not gpu and not sglang" tests $(PYTEST_ARGS)

gpu-test:
	bash scripts/gpu-lane.sh

lint: $(STAMP)
	$(PY) -m pip install -q ruff && $(PY) -m ruff check .

clean:
	rm -rf $(VENV) .pytest_cache
