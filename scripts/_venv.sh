# Shared by scripts/serve and scripts/test: make .venv and install the project into it.
# Usage: . scripts/_venv.sh "EXTRAS"   (EXTRAS like "[test]" or "")
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

apt_install() {
    # Debian packages, installed only when missing.
    local missing=()
    for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
    if ((${#missing[@]})); then
        echo "installing Debian packages: ${missing[*]}" >&2
        as_root apt-get update -qq
        DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
}

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    if ! "$PY" -m venv --help >/dev/null 2>&1 || ! "$PY" -c 'import ensurepip' >/dev/null 2>&1; then
        apt_install python3-venv
    fi
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q -e ".${1:-}"
