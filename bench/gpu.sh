#!/bin/bash
# bench/gpu.sh --out DIR [--dry]: the GPU machine's benchmarks, on that machine as it is
# (Python 3.12, its own torch 2.11+cu130, no network, no .venv, no redis-server).
#
# It installs, into a private folder, what the machine lacks: weightcast itself (pip install of
# this tree, built by the setuptools wheel in .whl/), the wheels that
# bench/gpu-bundle.sh fetched into .whl/ (pip --no-index --target), and redis-server from
# Debian's packages in .whl/ (dpkg -x). Then bench/gpu.py runs the steps, each with a time
# limit, each step's JSON written into DIR as soon as that step ends.
#
# --dry: the same steps on tiny shapes and the CPU, with this checkout's .venv (or $PYTHON)
# and the redis-server on PATH (nothing to install but weightcast itself); a test runs it.
#
#   bash bench/gpu-bundle.sh                          # here, once: fetch .whl/ (< 64 MiB)
#   bash bench/gpu.sh --out bench-gpu                 # there, carrying .whl
#   bash bench/gpu.sh --dry --out /tmp/gpu-dry        # anywhere
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DRY=""
OUT=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry) DRY=1; shift ;;
        --out) OUT="${2:?--out needs a folder}"; shift 2 ;;
        *) echo "bench/gpu.sh: unknown argument $1 (usage: bench/gpu.sh --out DIR [--dry])" >&2; exit 2 ;;
    esac
done
if [ -z "$OUT" ]; then
    echo "bench/gpu.sh: --out DIR is required (each step's JSON is written there)" >&2
    exit 2
fi
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
PRIVATE="$(mktemp -d "${TMPDIR:-/tmp}/weightcast-gpu.XXXXXX")"
trap 'rm -rf "$PRIVATE"' EXIT

mkdir -p "$PRIVATE/site" "$PRIVATE/bin"
# weightcast, installed from this tree as a user installs it (its dependencies are there or in
# .whl/). The build runs in a copy, so that this checkout gets no build/ or egg-info.
install_weightcast() {
    mkdir "$PRIVATE/src"
    cp -r "$ROOT"/{pyproject.toml,README.md,shared,trainer,publisher} "$PRIVATE/src/"
    "$PY" -m pip install -q --no-deps --no-compile --no-cache-dir --target "$PRIVATE/site" "$@" \
        "$PRIVATE/src"
}

if [ -n "$DRY" ]; then
    PY="${PYTHON:-$ROOT/.venv/bin/python}"
    install_weightcast
else
    PY=python3
    if ! ls "$ROOT"/.whl/*.whl >/dev/null 2>&1 || ! ls "$ROOT"/.whl/*.deb >/dev/null 2>&1; then
        echo "bench/gpu.sh: no wheels or .debs in .whl/: run bash bench/gpu-bundle.sh before, and carry .whl" >&2
        exit 2
    fi
    start=$(date +%s)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$PRIVATE/site" $(ls "$ROOT"/.whl/*.whl | grep -v /setuptools-)
    install_weightcast --no-index --find-links "$ROOT/.whl"
    for deb in "$ROOT"/.whl/*.deb; do
        dpkg -x "$deb" "$PRIVATE/redis"
    done
    # Only redis-server sees the unpacked libraries (jemalloc, lzf); it runs under its own name.
    cat > "$PRIVATE/bin/redis-server" <<WRAPPER
#!/bin/sh
LD_LIBRARY_PATH="$PRIVATE/redis/usr/lib/x86_64-linux-gnu\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$PRIVATE/redis/usr/bin/redis-server" "\$@"
WRAPPER
    chmod +x "$PRIVATE/bin/redis-server"
    export PATH="$PRIVATE/bin:$PATH"
    echo "installed in $(( $(date +%s) - start )) s"
fi
export PYTHONPATH="$PRIVATE/site${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - "$PRIVATE/" <<'CHECK'
import sys, weightcast, weightcast_publisher, weightcast_trainer
for package in (weightcast, weightcast_trainer, weightcast_publisher):
    if not package.__file__.startswith(sys.argv[1]):
        sys.exit(f"{package.__name__} imported from {package.__file__}")
CHECK
redis-server --version
status=0
"$PY" "$ROOT/bench/gpu.py" --out "$OUT" ${DRY:+--dry} || status=$?
exit $status
