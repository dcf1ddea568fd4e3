# The two commands of README.md, `make up` and `make test`. Each creates or reuses .venv,
# installs weightcast there with every extra (torch from $(TORCH_SPEC): the CPU wheel on a
# CPU machine of this kind) and makes sure a redis-server binary exists.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: up test test-fast lint setup

up: setup
	$(BIN)/weightcast up

test: lint
	$(BIN)/pytest

# Unit and integration tiers only (no trainer or publisher processes): about a minute.
test-fast: setup
	$(BIN)/pytest tests/unit tests/integration -m "not slow"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python scripts/check_imports.py

setup: $(VENV)/.installed
	@./scripts/ensure-redis.sh

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

# tests/docker alone: what Compose makes of compose.yaml, then the real stack on CPU (a Docker
# Engine; minutes). `make test` runs them too. They never install or fetch anything unless
# WEIGHTCAST_DOCKER_INSTALL=1 (CI: docker.io, debootstrap, Compose v2 when missing).
.PHONY: test-docker
test-docker: setup
	$(BIN)/pytest tests/docker
