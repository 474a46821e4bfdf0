#!/usr/bin/env bash
# Creates .venv with the pinned stack and the project installed in it, then Horovod (built from
# source, a few minutes the first time; SKIP_HOROVOD=1 skips it). Idempotent: a second run only
# checks a stamp and that Horovod imports. VENV=path picks another location, PYTHON=python3.x
# another interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_PINS=(torch==2.14.1 torchvision==0.29.1)

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
stamp="$VENV/.setup-$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
    echo "setup: installing into $VENV (torch ${TORCH_PINS[*]}, mlperf-logging, project)" >&2
    "$VENV/bin/python" -m pip install -q --upgrade pip
    if ! "$VENV/bin/python" -c "import torch, torchvision, sys; sys.exit(torch.__version__.split('+')[0] != '2.14.1')" 2>/dev/null; then
        "$VENV/bin/python" -m pip install -q "${TORCH_PINS[@]}"
    fi
    "$VENV/bin/python" -m pip install -q -e '.[test]'
    rm -f "$VENV"/.setup-*
    touch "$stamp"
fi
if [ -z "${SKIP_HOROVOD:-}" ]; then
    PYTHON="$VENV/bin/python" bash scripts/install_horovod.sh
fi
