#!/usr/bin/env bash
# Creates .venv with the pinned stack and the project installed in it. Idempotent: a second
# run only checks a stamp. VENV=path picks another location, PYTHON=python3.x another interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_PINS=(torch==2.14.1 torchvision==0.29.1)

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
stamp="$VENV/.setup-$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-16)"
if [ -f "$stamp" ]; then
    exit 0
fi
echo "setup: installing into $VENV (torch ${TORCH_PINS[*]}, mlperf-logging, project)" >&2
"$VENV/bin/python" -m pip install -q --upgrade pip
if ! "$VENV/bin/python" -c "import torch, torchvision, sys; sys.exit(torch.__version__.split('+')[0] != '2.14.1')" 2>/dev/null; then
    "$VENV/bin/python" -m pip install -q "${TORCH_PINS[@]}"
fi
"$VENV/bin/python" -m pip install -q -e '.[test]'
rm -f "$VENV"/.setup-*
touch "$stamp"
