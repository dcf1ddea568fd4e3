# The weightcast image. compose.yaml builds it; see docs/operations.md.
#
# Two targets, sharing every layer up to the trainer's and publisher's dependencies:
#   demo  (default, last)  `pip install .[demo]`: trainer, publisher, clients, and transformers
#                          for `follow --rollout`, the rollout producer of the demo loop
#   lean                   `pip install .[trainer,publisher]`: the same without transformers
# The vLLM inference image is vllm.Dockerfile: it has another base, which the classic builder
# (it builds every stage before the target) would pull for every build of this file.
#
# Build arguments:
#   BASE_IMAGE       a Python 3.11+ image with pip (default python:3.11-slim)
#   TORCH_SPEC       the torch requirement, installed first and alone (default torch==2.13.0)
#   TORCH_INDEX_URL  the index torch comes from; empty means PyPI (a CUDA build on x86_64).
#                    compose.yaml passes https://download.pytorch.org/whl/cpu unless told not to.
#
# No `# syntax=` line, RUN --mount or heredocs: this builds with the builder inside the
# engine (nothing pulled from Docker Hub for the frontend), the classic builder included.
ARG BASE_IMAGE=python:3.11-slim

# The requirement lists, from pyproject.toml alone. The stages below copy the lists, not
# pyproject.toml, so an edit elsewhere in it (tool settings, test markers) rebuilds nothing.
FROM ${BASE_IMAGE} AS requirements
COPY pyproject.toml scripts/pyproject_requirements.py /tmp/deps/
RUN cd /tmp/deps \
 && python pyproject_requirements.py pyproject.toml trainer,publisher >lean.txt \
 && python pyproject_requirements.py pyproject.toml demo >demo.txt

FROM ${BASE_IMAGE} AS deps
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 \
    WEIGHTCAST_LOG_FORMAT=json
WORKDIR /app
# torch alone first: the largest layer, rebuilt only when TORCH_SPEC or TORCH_INDEX_URL change.
RUN python -m pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"
# Then the dependencies, without the project, so that a source edit reinstalls nothing but
# the project. torch already satisfies the requirements on it.
COPY --from=requirements /tmp/deps/lean.txt /tmp/deps/
RUN python -m pip install -r /tmp/deps/lean.txt

# Only what `pip install .` reads.
FROM scratch AS source
COPY pyproject.toml README.md /app/
COPY shared /app/shared
COPY trainer /app/trainer
COPY publisher /app/publisher

FROM deps AS lean
COPY --from=source /app /app
RUN python -m pip install --no-deps . && python -m pip check
ENTRYPOINT ["weightcast"]
CMD ["--help"]

FROM deps AS demo
COPY --from=requirements /tmp/deps/demo.txt /tmp/deps/
RUN python -m pip install -r /tmp/deps/demo.txt
COPY --from=source /app /app
RUN python -m pip install --no-deps . && python -m pip check
ENTRYPOINT ["weightcast"]
CMD ["--help"]
