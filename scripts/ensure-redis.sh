#!/bin/sh
# Make sure a redis-server binary is on PATH: the tests and `weightcast up` start their own
# private servers on free loopback ports. Installs Debian's package when it is missing.
set -eu
if command -v redis-server >/dev/null 2>&1; then
    exit 0
fi
echo "redis-server not found: installing Debian's redis-server package" >&2
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get install -y -q redis-server >/dev/null \
    || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q redis-server >/dev/null; }
command -v redis-server >/dev/null 2>&1 || {
    echo "could not install redis-server; install it yourself (Redis >= 6.2)" >&2
    exit 1
}
