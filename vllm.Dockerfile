# A vLLM inference node: vLLM's OpenAI server image with weightcast's core install added, so
# that the `weightcast` weight-transfer backend (registered through weightcast's
# vllm.general_plugins entry point) loads in every vLLM process. compose.yaml's `vllm` profile
# builds it; see docs/operations.md and docs/vllm.md.
#
# Build argument: VLLM_IMAGE, the vLLM image to start from (Python 3.11+ with pip).
ARG VLLM_IMAGE=vllm/vllm-openai:v0.33.0
FROM ${VLLM_IMAGE}
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_BREAK_SYSTEM_PACKAGES=1 \
    PYTHONUNBUFFERED=1
# The core install's dependencies (redis, safetensors, xxhash; vLLM's own torch meets
# weightcast's uncapped torch requirement), then weightcast without dependencies, so vLLM's
# pinned packages stay as they are.
COPY pyproject.toml scripts/pyproject_requirements.py /tmp/deps/
RUN python3 /tmp/deps/pyproject_requirements.py /tmp/deps/pyproject.toml >/tmp/deps/core.txt \
 && python3 -m pip install -r /tmp/deps/core.txt
COPY pyproject.toml README.md /opt/weightcast/
COPY shared /opt/weightcast/shared
COPY trainer /opt/weightcast/trainer
COPY publisher /opt/weightcast/publisher
RUN python3 -m pip install --no-deps /opt/weightcast \
 && python3 -c "from importlib.metadata import entry_points as e; \
assert 'weightcast' in e(group='vllm.general_plugins').names, \
'weightcast registers no vllm.general_plugins entry point'"
ENTRYPOINT ["vllm", "serve"]
