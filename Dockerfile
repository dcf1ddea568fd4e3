# weightcast: one image for the trainer, the publisher and the clients (`weightcast <command>`),
# with the `demo` extra (transformers) so `follow --rollout` runs the toy RL loop.
# GPU (default): torch from PyPI, a CUDA build. CPU-only image:
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
FROM python:3.11-slim

ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL=""

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 WEIGHTCAST_LOG_FORMAT=json
WORKDIR /app

RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"

COPY pyproject.toml README.md ./
COPY shared ./shared
COPY trainer ./trainer
COPY publisher ./publisher
RUN pip install ".[demo]"

ENTRYPOINT ["weightcast"]
CMD ["--help"]
