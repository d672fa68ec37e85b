# The README's two commands: `make run` (train + generate on the embedded default) and `make test`.
# Each creates .venv and installs what it needs; torch==2.13.0 is installed unless a torch is present.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.mmpipe-installed

.PHONY: setup run test lint typecheck unit e2e clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

RUN_DIR ?= runs/default-$(shell date +%Y%m%d-%H%M%S)

run: $(STAMP)
	$(BIN)/mmpipe train run_dir=$(RUN_DIR)
	$(BIN)/mmpipe generate ckpt=$(RUN_DIR) prompt="a red circle moving left"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy cannot follow the package-dir mapping (stages/ -> mmpipe.stages), so it checks a real
# install of the package into build/typecheck.
typecheck: $(STAMP)
	rm -rf build/typecheck build/lib  # setuptools never empties build/lib: a stale module there would mask a missing package
	$(BIN)/pip install -q --no-deps --no-build-isolation --target build/typecheck .
	cd build/typecheck && ../../$(BIN)/mypy --config-file ../../pyproject.toml -p mmpipe

test: lint typecheck
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf build runs .pytest_cache .mypy_cache .ruff_cache
