#!/bin/bash
# Fetches into .whl/ what bench/gpu.sh installs on the GPU machine, which has no network:
# the wheels that torchtitan 0.2.0 and weightcast need beyond that machine's image (Python
# 3.12, torch 2.11+cu130, triton, safetensors, transformers, tensorboard, tokenizers, numpy,
# pyarrow, pandas, prometheus-client), setuptools to build weightcast there, and Debian's redis-server with the libraries it
# needs beyond a base image. Checks that the bundle stays under the 64 MiB a run may carry
# (.gitignore keeps .whl/ out of git).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
mkdir -p .whl
for p in torchtitan==0.2.0 torchdata tyro datasets tomli dill multiprocess docstring-parser \
    typeguard shtab redis watchdog xxhash blake3 setuptools; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "$p"
done
(cd .whl && apt-get download -q redis-server redis-tools libjemalloc2 liblzf1 >/dev/null)
bytes=$(du -sb .whl | cut -f1)
echo ".whl/: $(ls .whl | wc -l) files, $(( bytes / 1024 / 1024 )) MiB"
if [ "$bytes" -ge $(( 64 * 1024 * 1024 )) ]; then
    echo "the bundle is over the 64 MiB a run may carry" >&2
    exit 1
fi
