# The two commands of README.md. Each creates or reuses .venv, installs weightcast there
# (with torch from $(TORCH_SPEC): the CPU wheel on a CPU machine of this kind) and makes
# sure a redis-server binary exists.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: up test lint setup

up: setup
	$(BIN)/weightcast up

test: lint
	$(BIN)/pytest

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

setup: $(VENV)/.installed
	@./scripts/ensure-redis.sh

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@
