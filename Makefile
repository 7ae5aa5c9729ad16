# Two commands on a fresh clone: `make demo` and `make test`. Each (re)builds .venv when it
# is missing or pyproject.toml changed, then runs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-floor test-tpu test-gpu bench fuzz lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c 'import sys; assert sys.version_info >= (3, 12), f"substrax needs Python >= 3.12, $(PYTHON) is {sys.version.split()[0]}; set PYTHON=python3.12"'
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m substrax.demo

# The suite on WORKERS processes (pytest-xdist), each test file whole on one of them: on 2
# cores most of a file's time is compiling, which one process does on one core. `make test`
# leaves out the tests marked slow (the fuzzers' random samples, the three longest notebooks);
# `make test-slow` runs just those, and .ci/run runs both.
WORKERS ?= 2
# The jax compilation cache the suite keeps between runs (tests/conftest.py): a program no
# change touched is read back, not compiled again. A fresh clone starts empty;
# `make test TEST_CACHE=` gives each run a new one.
TEST_CACHE ?= .jax-test-cache

.PHONY: test-slow
test: $(STAMP)
	SUBSTRAX_TEST_CACHE=$(TEST_CACHE) $(PY) -m pytest -q -n $(WORKERS) --dist loadfile -m "not slow"

test-slow: $(STAMP)
	SUBSTRAX_TEST_CACHE=$(TEST_CACHE) $(PY) -m pytest -q -n $(WORKERS) --dist loadfile -m slow

# An extra installed into .venv beside the dev one (`.venv/.installed-tpu` for the tpu extra, -gpu,
# -docs), again whenever .venv is refreshed.
$(VENV)/.installed-%: $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,$*]'
	touch $@

# Steps compiled on this machine for topologies it does not have (the tests/test_tpu_*.py or
# tests/test_gpu_*.py): `make test-tpu` for TPU v5e topologies (the tpu extra: libtpu, about 480 MB; the
# guide "Plan a pod from a laptop"), `make test-gpu` for NVIDIA H100 topologies (the gpu extra: jax's CUDA
# plugin, ptxas, libdevice; about 390 MB of wheels). Without the extra, `make test` skips these tests,
# saying so. JAX_PLATFORMS=cpu: the CUDA plugin starts no GPU (it would fail on cuDNN). No compilation
# cache: jax cannot read back a program compiled for compile-only devices. Each test on the next free
# worker (--dist load): the files are few, their tests compile for seconds each.
test-tpu test-gpu: test-%: $(VENV)/.installed-%
	JAX_PLATFORMS=cpu SUBSTRAX_TEST_CACHE=off $(PY) -m pytest -q -n $(WORKERS) --dist load tests/test_$*_*.py

# Style: ruff's rules and its formatter (pyproject.toml's [tool.ruff]), over the code and its tests.
LINT_PATHS := substrax tests benchmarks examples
lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)

# The documentation site (docs/, mkdocs.yml) into build/site, warnings as errors; the docs
# extra is installed into .venv beside the dev one.
.PHONY: docs
DOCS_STAMP := $(VENV)/.installed-docs

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# The parity fuzzer with a larger budget (`make test` runs a fixed-seed sample of it): random
# configurations, one line per draw, every failing one listed at the end as Python code.
# SUBSTRAX_FUZZ_EXAMPLES=N sets the number of draws (default 300; about 5-20 s each on 2 cores).
fuzz: $(STAMP)
	SUBSTRAX_FUZZ=full $(PY) -m pytest -q -s -p no:cacheprovider tests/test_fuzz.py tests/test_fuzz_mesh.py

# The library tests (not the notebooks) against the oldest versions pyproject.toml allows:
# each `name>=X` of its dependencies installed as `name==X`, in a venv of their own.
FLOOR_VENV := .venv-floor
FLOOR_PY := $(FLOOR_VENV)/bin/python
FLOOR_STAMP := $(FLOOR_VENV)/.installed

$(FLOOR_STAMP): pyproject.toml .ci/floor_requirements.py
	rm -rf $(FLOOR_VENV)
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_PY) -m pip install --quiet --upgrade pip
	$(FLOOR_PY) .ci/floor_requirements.py pyproject.toml > $(FLOOR_VENV)/requirements.txt
	$(FLOOR_PY) -m pip install --quiet -r $(FLOOR_VENV)/requirements.txt
	$(FLOOR_PY) -m pip install --quiet --no-deps -e .
	touch $(FLOOR_STAMP)

test-floor: $(FLOOR_STAMP)
	$(FLOOR_PY) -c 'import jax, flax, optax, numpy; print("floor:", "jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__, "numpy", numpy.__version__)'
	$(FLOOR_PY) -m pytest -q -p no:cacheprovider -n $(WORKERS) --dist loadfile --ignore=tests/test_notebooks.py --ignore=tests/test_tpu_notebooks.py

bench: $(STAMP)
	$(PY) benchmarks/train_step.py --quick --json benchmarks/results/train_step_quick.json
	$(PY) benchmarks/collectives.py --quick --json benchmarks/results/collectives_quick.json
	$(PY) benchmarks/layouts.py --quick --json benchmarks/results/layouts_quick.json
	$(PY) benchmarks/accumulation.py --quick --json benchmarks/results/accumulation_quick.json
	$(PY) benchmarks/pipeline.py --quick --json benchmarks/results/pipeline_quick.json
	$(PY) benchmarks/precision.py --quick --json benchmarks/results/precision_quick.json
	$(PY) benchmarks/tensor_parallel.py --quick --json benchmarks/results/tensor_parallel_quick.json
	$(PY) benchmarks/memory.py --quick --json benchmarks/results/memory_quick.json
	$(PY) benchmarks/units.py --quick --json benchmarks/results/units_quick.json
	$(PY) benchmarks/hsdp.py --json benchmarks/results/hsdp_quick.json
	$(PY) benchmarks/plan.py --json benchmarks/results/plan_quick.json
	$(PY) benchmarks/chip.py --quick --json benchmarks/results/chip_quick.json
	$(PY) benchmarks/chip_scanned.py --quick --json benchmarks/results/chip_scanned_quick.json
	$(PY) benchmarks/tinyllama_plan.py --quick --json benchmarks/results/tinyllama_plan_quick.json

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis $(TEST_CACHE)
