# The two commands of the README:
#   make demo   set up .venv and run asynchronous GRPO on the embedded tiny model (CPU)
#   make test   set up .venv and run the test suite (+ the CI subset of slow tests)
# Both install pinned versions into .venv themselves.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: setup demo test test-all lint docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# The CPU build of torch comes first so nothing pulls a CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: setup
	$(PY) examples/math/gsm8k_rl.py --config examples/math/gsm8k_grpo_cpu.yaml

test: setup
	$(PY) -m ruff check .
	$(PY) -m pytest -m "not slow or ci_slow" -q

test-all: setup
	$(PY) -m pytest -q

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

docs: setup
	$(PY) docs/generate_cli_docs.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
