#!/usr/bin/env bash
# The README's test command: the trainer's set-up (scripts/setup.sh), then what only the tests need,
# then the whole test suite. Each step is idempotent: a second run installs nothing.
# What only the tests need, beyond the trainer's stack:
#  - the cluster on one machine (scripts/cluster.sh), as root from Debian's packages: ip, nsenter, an ssh
#    client, Slurm and munge (cluster.sh --slurm, scripts/slurm/local_cluster.sh), and openssh-server
#    unpacked to /opt/trainer-openssh, not installed: its package would start an sshd on the machine
#    itself; each emulated node runs its own from there. SKIP_CLUSTER=1 leaves it out.
#  - a bare GPU node's stack in .venv-device (Python 3.12 with torch 2.11, numpy and PyYAML, none of this
#    project's other packages) and the offline node's wheels folder .whl/ (scripts/gpu_wheels.sh):
#    tests/test_gpu.py runs `gpu_check.sh --dry-run` on them, so a check that cannot start on such a
#    node fails here first. SKIP_DEVICE_STACK=1 leaves it out (about 1 minute and 4.7 GB the first time).
#
#   bash scripts/test.sh            set up, then the whole suite
#   bash scripts/test.sh --quick    the quick tier (no multi-process or slow tests; tests/conftest.py)
#   bash scripts/test.sh --print    the commands the set-ups would run here and the pytest command; runs none
# Other arguments go to pytest (e.g. scripts/test.sh -k lars).
set -euo pipefail
cd "$(dirname "$0")/.."
PRINT=""
if [ "${1:-}" = --print ]; then
    PRINT=1
    shift
fi

run() {  # the command, or with --print its line
    if [ -n "$PRINT" ]; then
        echo "$*"
    else
        "$@"
    fi
}

bash scripts/setup.sh ${PRINT:+--print}

if [ -z "${SKIP_CLUSTER:-}" ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    missing=()
    command -v ip >/dev/null || missing+=(iproute2)
    command -v nsenter >/dev/null || missing+=(util-linux)
    command -v ssh >/dev/null || missing+=(openssh-client)
    command -v slurmctld >/dev/null || missing+=(slurm-wlm)
    command -v munged >/dev/null || missing+=(munge)
    [ -e /usr/lib/x86_64-linux-gnu/libwrap.so.0 ] || [ -e /lib/x86_64-linux-gnu/libwrap.so.0 ] || missing+=(libwrap0)
    if [ ${#missing[@]} -gt 0 ] || [ ! -x /opt/trainer-openssh/usr/sbin/sshd ]; then
        echo "test: the cluster's tools (${missing[*]:-} openssh-server unpacked to /opt/trainer-openssh)" >&2
        if [ -n "$PRINT" ]; then
            echo "apt-get update -qq"
            [ ${#missing[@]} -eq 0 ] || echo "DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends ${missing[*]}"
            echo "apt-get download -qq openssh-server"
            echo "dpkg-deb -x openssh-server_*.deb /opt/trainer-openssh"
        else
            apt-get update -qq >/dev/null
            [ ${#missing[@]} -eq 0 ] || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
            debs=$(mktemp -d)
            (cd "$debs" && apt-get download -qq openssh-server 2>/dev/null)
            mkdir -p /opt/trainer-openssh
            dpkg-deb -x "$debs"/openssh-server_*.deb /opt/trainer-openssh
            rm -rf "$debs"
        fi
    fi
fi

if [ -z "${SKIP_DEVICE_STACK:-}" ]; then
    py312=""  # (pyenv's shim is on PATH whether or not it can run 3.12: each candidate is tried)
    for candidate in python3.12 "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/3.12*/bin/python3.12; do
        if "$candidate" -c "import sys; sys.exit(sys.version_info[:2] != (3, 12))" 2>/dev/null; then
            py312=$candidate
            break
        fi
    done
    if [ -n "$py312" ]; then
        [ -x .venv-device/bin/python ] || run "$py312" -m venv .venv-device
        if ! .venv-device/bin/python -c "import torch, numpy, yaml, sys; sys.exit(torch.__version__.split('+')[0] != '2.11.0')" 2>/dev/null; then
            echo "test: a bare GPU node's stack in .venv-device (Python 3.12, torch 2.11.0)" >&2
            run .venv-device/bin/python -m pip install -q torch==2.11.0 numpy pyyaml
        fi
        if [ -n "$PRINT" ]; then
            echo "PYTHON=.venv/bin/python bash scripts/gpu_wheels.sh"
        else
            PYTHON=.venv/bin/python bash scripts/gpu_wheels.sh >/dev/null || echo "test: .whl/ could not be filled (PyPI?): the gpu_check dry run will say what is missing" >&2
        fi
    else
        echo "test: no Python 3.12 here: the dry run of scripts/gpu_check.sh on a bare GPU node's stack is skipped" >&2
    fi
fi

# the test files run on parallel workers, one file to a worker (pytest-xdist), in the order
# tests/conftest.py gives them (most work first; not xdist's own, by test count): most tests wait on the
# processes they start, so two workers keep a 2-core machine busy; TEST_WORKERS=0 runs them one by one
# (the machine's processors: nproc alone obeys OMP_NUM_THREADS, which a CPU-run shell may set to 1)
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
workers=${TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}
if [ -n "$PRINT" ]; then
    echo ".venv/bin/python -m pytest -ra -n $workers --dist loadfile --no-loadscope-reorder $*"
    exit 0
fi
exec .venv/bin/python -m pytest -ra -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
