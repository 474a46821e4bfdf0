#!/usr/bin/env bash
# Installs everything the trainer and its tests need. Idempotent: a second run checks a stamp and
# that Horovod imports, and returns.
#
#   bash scripts/setup.sh                 .venv with torch 2.14.1 + torchvision 0.29.1, DALI for
#                                         CUDA 13, mlperf-logging, the project (editable), Horovod
# Settings (environment):
#   VENV=path|none      where to install; none = into $PYTHON itself (a container's interpreter)
#   PYTHON=python3.x    the interpreter that makes the venv, or is used with VENV=none
#   TORCH=pinned|keep   keep = use the interpreter's own torch (NGC containers)
#   DALI_PACKAGE=nvidia-dali-cuda130|nvidia-dali-cuda120|none
#   SKIP_HOROVOD=1      no Horovod build (it takes a few minutes the first time)
#   SKIP_MPI=1          no Open MPI from Debian (Horovod is then built with gloo only)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH=${TORCH:-pinned}
DALI_PACKAGE=${DALI_PACKAGE:-nvidia-dali-cuda130}
TORCH_PINS=(torch==2.14.1 torchvision==0.29.1)

if [ "$VENV" = none ]; then
    py=$PYTHON
    stamp=""
else
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    py="$VENV/bin/python"
    stamp="$VENV/.setup-$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-16)-$TORCH-$DALI_PACKAGE"
fi

if [ -z "$stamp" ] || [ ! -f "$stamp" ]; then
    echo "setup: installing into ${VENV/#none/$py} (torch: $TORCH, DALI: $DALI_PACKAGE, mlperf-logging, project)" >&2
    "$py" -m pip install -q --upgrade pip
    if [ "$TORCH" = pinned ] && ! "$py" -c "import torch, torchvision, sys; sys.exit(torch.__version__.split('+')[0] != '2.14.1')" 2>/dev/null; then
        "$py" -m pip install -q "${TORCH_PINS[@]}"
    fi
    if [ "$DALI_PACKAGE" != none ]; then
        "$py" -m pip install -q "$DALI_PACKAGE"
    fi
    "$py" -m pip install -q -e '.[test]'
    if [ -n "$stamp" ]; then
        rm -f "$VENV"/.setup-*
        touch "$stamp"
    fi
fi
# Open MPI (mpirun, and mpicxx for Horovod's MPI build): Debian's packages, as root, when missing
if [ -z "${SKIP_MPI:-}" ] && ! command -v mpicxx >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "setup: installing Open MPI (openmpi-bin, libopenmpi-dev)" >&2
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends openmpi-bin libopenmpi-dev >/dev/null
fi
if [ -z "${SKIP_HOROVOD:-}" ]; then
    PYTHON="$py" bash scripts/install_horovod.sh
fi
# The cluster on one machine (scripts/cluster.sh): ip, nsenter, tc, an ssh client, Slurm and munge from Debian, and
# openssh-server unpacked to /opt/trainer-openssh, not installed: its package would start an sshd on
# the machine itself. Each emulated node runs its own from there.
if [ -z "${SKIP_CLUSTER:-}" ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    missing=()
    command -v ip >/dev/null || missing+=(iproute2)
    command -v nsenter >/dev/null || missing+=(util-linux)
    command -v ssh >/dev/null || missing+=(openssh-client)
    command -v slurmctld >/dev/null || missing+=(slurm-wlm)  # (cluster.sh --slurm, scripts/slurm/local_cluster.sh)
    command -v munged >/dev/null || missing+=(munge)
    [ -e /usr/lib/x86_64-linux-gnu/libwrap.so.0 ] || [ -e /lib/x86_64-linux-gnu/libwrap.so.0 ] || missing+=(libwrap0)
    if [ ${#missing[@]} -gt 0 ] || [ ! -x /opt/trainer-openssh/usr/sbin/sshd ]; then
        echo "setup: cluster tools (${missing[*]:-} openssh-server unpacked to /opt/trainer-openssh)" >&2
        apt-get update -qq >/dev/null
        [ ${#missing[@]} -eq 0 ] || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
        debs=$(mktemp -d)
        (cd "$debs" && apt-get download -qq openssh-server 2>/dev/null)
        mkdir -p /opt/trainer-openssh
        dpkg-deb -x "$debs"/openssh-server_*.deb /opt/trainer-openssh
        rm -rf "$debs"
    fi
fi
# A bare GPU node's stack (an offline node whose Python 3.12 has torch 2.11, numpy and pyyaml and none of
# this project's other packages) in .venv-device, and the wheels scripts/gpu_check.sh carries there in .whl/: tests/test_gpu.py
# runs `gpu_check.sh --dry-run` on them, so a check that cannot start on that machine fails here first.
# SKIP_DEVICE_STACK=1 leaves it out (about 1 minute and 4.7 GB the first time).
if [ -z "${SKIP_DEVICE_STACK:-}" ]; then
    py312=""  # (pyenv's shim is on PATH whether or not it can run 3.12: each candidate is tried)
    for candidate in python3.12 "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/3.12*/bin/python3.12; do
        if "$candidate" -c "import sys; sys.exit(sys.version_info[:2] != (3, 12))" 2>/dev/null; then
            py312=$candidate
            break
        fi
    done
    if [ -n "$py312" ]; then
        [ -x .venv-device/bin/python ] || "$py312" -m venv .venv-device
        if ! .venv-device/bin/python -c "import torch, numpy, yaml, sys; sys.exit(torch.__version__.split('+')[0] != '2.11.0')" 2>/dev/null; then
            echo "setup: a bare GPU node's stack in .venv-device (Python 3.12, torch 2.11.0)" >&2
            .venv-device/bin/python -m pip install -q torch==2.11.0 numpy pyyaml
        fi
        PYTHON="$py" bash scripts/gpu_wheels.sh >/dev/null || echo "setup: .whl/ could not be filled (PyPI?): the gpu_check dry run will say what is missing" >&2
    else
        echo "setup: no Python 3.12 here: the dry run of scripts/gpu_check.sh on a bare GPU node's stack is skipped" >&2
    fi
fi
