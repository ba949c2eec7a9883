# Sourced by demo.sh and test.sh: a virtual environment in .venv with the project installed, and a
# redis-server binary. On a fresh Debian machine, as root, it installs what is missing with apt-get.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
missing=()
"$PYTHON" -c 'import ensurepip, venv' 2>/dev/null || missing+=(python3-venv)
command -v redis-server >/dev/null || missing+=(redis-server)
if ((${#missing[@]})); then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        echo "installing ${missing[*]} with apt-get"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    else
        echo "error: please install ${missing[*]} (e.g. sudo apt-get install ${missing[*]})" >&2
        exit 1
    fi
fi

if [[ ! -x .venv/bin/python ]]; then
    "$PYTHON" -m venv .venv
fi
extras=${FLEET_EXTRAS:-}
stamp=".venv/.installed${extras:+-$extras}"
if [[ ! -f $stamp || pyproject.toml -nt $stamp ]]; then
    echo "installing the project into .venv"
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e ".${extras:+[$extras]}"
    touch "$stamp"
fi
