#!/usr/bin/env bash
# Stand-ins for the base images of compose.yaml when Docker Hub cannot be reached: one Debian
# bookworm rootfs (debootstrap, the host's apt mirror) with python3 3.11, python3-venv and
# redis-server, imported as $PYTHON_IMAGE (a venv on PATH, as python:3.11-slim has pip on
# PATH), and $REDIS_IMAGE on top of it (an entrypoint that turns protected mode off when no
# config file is given, as the official redis image does). Images already present are kept.
#
#   scripts/docker-base-images.sh            # local/python:3.11 and local/redis:7
#   PYTHON_IMAGE=... REDIS_IMAGE=... WORK=/tmp/x scripts/docker-base-images.sh
# Needs root, debootstrap and a running Docker Engine. The host's extra CAs
# (/usr/local/share/ca-certificates) go into the image: a TLS-intercepting proxy in front of
# PyPI needs them.
set -euo pipefail
PYTHON_IMAGE=${PYTHON_IMAGE:-local/python:3.11}
REDIS_IMAGE=${REDIS_IMAGE:-local/redis:7}
WORK=${WORK:-${TMPDIR:-/tmp}/weightcast-base-images}
DOCKER=${DOCKER:-docker}
SUITE=bookworm

have() { "$DOCKER" image inspect "$1" >/dev/null 2>&1; }

mirror() {
    local m=""
    [ -f /etc/apt/sources.list.d/debian.sources ] &&
        m=$(awk '$1 == "URIs:" { print $2; exit }' /etc/apt/sources.list.d/debian.sources)
    [ -z "$m" ] && [ -f /etc/apt/sources.list ] &&
        m=$(awk '$1 == "deb" { print $2; exit }' /etc/apt/sources.list)
    echo "${m:-http://deb.debian.org/debian}"
}

python_image() {
    local r=$WORK/rootfs
    rm -rf "$r"
    mkdir -p "$WORK"
    debootstrap --variant=minbase --include=ca-certificates,python3,python3-venv,redis-server \
        "$SUITE" "$r" "$(mirror)" >"$WORK/debootstrap.log" 2>&1 ||
        { tail -20 "$WORK/debootstrap.log" >&2; return 1; }
    if [ -f /etc/apt/sources.list.d/debian.sources ]; then
        rm -f "$r/etc/apt/sources.list"
        cp /etc/apt/sources.list.d/debian.sources "$r/etc/apt/sources.list.d/"
    fi
    cp /usr/local/share/ca-certificates/*.crt "$r/usr/local/share/ca-certificates/" 2>/dev/null || true
    chroot "$r" update-ca-certificates >/dev/null
    chroot "$r" python3 -m venv /opt/venv
    cat >"$r/usr/local/bin/docker-entrypoint.sh" <<'EOS'
#!/bin/sh
# As the official redis image does: with no config file given, turn protected mode off so
# that other containers can connect.
set -e
if [ "${1#-}" != "$1" ]; then set -- redis-server "$@"; fi
if [ "$1" = redis-server ]; then
  case "$2" in *.conf) ;; *) shift; set -- redis-server --protected-mode no "$@" ;; esac
fi
exec "$@"
EOS
    chmod 0755 "$r/usr/local/bin/docker-entrypoint.sh"
    mkdir -p "$r/data" && chroot "$r" chown redis:redis /data
    rm -rf "$r"/var/cache/apt/archives/*.deb "$r"/var/cache/apt/*.bin "$r"/var/lib/apt/lists/*
    mkdir -p "$r/var/lib/apt/lists/partial"
    tar -C "$r" --numeric-owner -c . | "$DOCKER" import \
        -c 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        -c 'ENV VIRTUAL_ENV=/opt/venv LANG=C.UTF-8 PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_DEFAULT_TIMEOUT=180' \
        -c 'CMD ["python3"]' - "$PYTHON_IMAGE" >/dev/null
    rm -rf "$r"
}

redis_image() {
    mkdir -p "$WORK/redis"
    printf '%s\n' "FROM $PYTHON_IMAGE" 'WORKDIR /data' 'VOLUME /data' 'USER redis' 'EXPOSE 6379' \
        'ENTRYPOINT ["docker-entrypoint.sh"]' 'CMD ["redis-server"]' >"$WORK/redis/Dockerfile"
    "$DOCKER" build -q -t "$REDIS_IMAGE" "$WORK/redis" >/dev/null
}

have "$PYTHON_IMAGE" || python_image
have "$REDIS_IMAGE" || redis_image
echo "PYTHON_IMAGE=$PYTHON_IMAGE"
echo "REDIS_IMAGE=$REDIS_IMAGE"
