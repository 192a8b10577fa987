#!/usr/bin/env bash
# ensure_apt.sh BINARY PACKAGE: install PACKAGE with apt-get (as root) when BINARY is not on PATH.
set -euo pipefail
bin="$1" pkg="$2"
command -v "$bin" >/dev/null 2>&1 && exit 0
if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    echo "$0: '$bin' is missing; install the Debian package '$pkg' (apt-get install $pkg)" >&2
    exit 1
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$pkg"
