# Two commands on a fresh clone: `make demo` and `make test`. Each (re)builds .venv when it
# is missing or pyproject.toml changed, then runs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c 'import sys; assert sys.version_info >= (3, 12), f"substrax needs Python >= 3.12, $(PYTHON) is {sys.version.split()[0]}; set PYTHON=python3.12"'
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m substrax.demo

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/train_step.py --quick --json benchmarks/results/train_step_quick.json
	$(PY) benchmarks/collectives.py --quick

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
