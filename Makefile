# The README's two commands: `make run` (train + generate on the embedded default) and `make test`.
# Each creates .venv and installs what it needs; torch==2.13.0 is installed unless a torch is present.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.mmpipe-installed

.PHONY: setup lock run run-u2g test lint typecheck unit e2e clean

# constraints.txt holds the versions of the last `make lock`, so a new release cannot turn a clean
# checkout red; `make CONSTRAINTS= setup` resolves the newest versions pyproject.toml's ranges allow.
CONSTRAINTS ?= constraints.txt
PIP_C := $(if $(CONSTRAINTS),-c $(CONSTRAINTS))

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(PIP_C) "torch==2.13.0"
	$(BIN)/pip install -q $(PIP_C) -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

# Re-resolve every dependency in a fresh venv and pin what it got. torch (pinned above; its CUDA build
# pins its own triton and nvidia-* wheels) and xformers (pinned in pyproject's dev extra) stay out.
LOCK_VENV := build/lock-venv
lock:
	rm -rf $(LOCK_VENV)
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/pip install -q "torch==2.13.0"
	$(LOCK_VENV)/bin/pip install -q -e ".[dev]"
	{ sed -n '/^#/p' constraints.txt; \
	  $(LOCK_VENV)/bin/pip freeze --exclude-editable | grep -v -i -E '^((torch|triton|xformers)==|nvidia-)'; \
	} >constraints.txt.new
	mv constraints.txt.new constraints.txt
	rm -rf $(LOCK_VENV)

# Expanded once (a `?=` variable would call date at every use: one run directory per command)
ifndef RUN_DIR
RUN_DIR := runs/default-$(shell date +%Y%m%d-%H%M%S)
endif

run: $(STAMP)
	$(BIN)/mmpipe train run_dir=$(RUN_DIR) launch.nproc=0 placement=auto
	$(BIN)/mmpipe generate ckpt=$(RUN_DIR) prompt="a red circle moving left"
	$(BIN)/mmpipe eval $(RUN_DIR)
	$(BIN)/mmpipe report $(RUN_DIR)

# Understand-then-generate, visible (issue 31): u2g_tiny sees a still and reads "make it move <dir>"
ifndef U2G_DIR
U2G_DIR := runs/u2g-$(shell date +%Y%m%d-%H%M%S)
endif
# 14-15 min on the 2-core CPU with calibration, eval and report; shape 91.7 % (RESULTS, issue 31)
U2G_STEPS ?= 10000

# the LLM at a tenth of the DiT's rate: at the full rate it merges "left" and "right" (RESULTS, issue 31)
run-u2g: $(STAMP)
	$(BIN)/mmpipe train model=u2g_tiny run_dir=$(U2G_DIR) launch.nproc=0 placement=auto \
		train.steps=$(U2G_STEPS) 'train.lr_scale={llm:0.1}'
	$(BIN)/mmpipe eval $(U2G_DIR)
	$(BIN)/mmpipe report $(U2G_DIR)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy cannot follow the package-dir mapping (stages/ -> mmpipe.stages), so it checks a real
# install of the package into build/typecheck.
typecheck: $(STAMP)
	rm -rf build/typecheck build/lib  # setuptools never empties build/lib: a stale module there would mask a missing package
	$(BIN)/pip install -q --no-deps --no-build-isolation --target build/typecheck .
	cd build/typecheck && ../../$(BIN)/mypy --config-file ../../pyproject.toml -p mmpipe

# Two pytest workers (pytest-xdist; each takes its share of the cores, tests/conftest.py), then the
# tests that compare measured times, alone: another worker's load would skew what they measure.
PYTEST_WORKERS ?= 2

test: lint typecheck
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) -m "not serial" tests
	$(BIN)/python -m pytest -q -m serial tests

clean:
	rm -rf build runs .pytest_cache .mypy_cache .ruff_cache
