# One command each: `make demo`, `make test`, `make bench`, `make lint`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.dlop-installed

.PHONY: demo test bench bench-peers lint env clean

env: $(STAMP)

# torch is pinned to the CPU build; an unpinned torch pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	touch $(STAMP)

demo: env
	$(PY) -m dlop.tools.demo

test: env
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -q

bench: env
	$(VENV)/bin/dlop-bench

lint: env
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy formats runtime

clean:
	rm -rf $(VENV) build *.egg-info
