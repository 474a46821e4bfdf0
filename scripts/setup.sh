#!/usr/bin/env bash
# Installs the trainer's stack, for the machine it runs on (a laptop, a GPU node, a cluster's login
# node, a container): in .venv, torch 2.14.1 + torchvision 0.29.1 in a build the GPUs here run, DALI,
# mlperf-logging, the project (editable, with its test extra) and Horovod built from source; as root
# from the system's packages, Open MPI when Horovod's MPI build finds no mpicxx and an ssh client when
# horovodrun (which starts ranks on other hosts over ssh) finds none. Never a daemon, a system service
# or a second interpreter: what only the tests need is installed by scripts/test.sh.
# Idempotent: a second run checks a stamp and Horovod's build, and returns.
#
#   bash scripts/setup.sh           install
#   bash scripts/setup.sh --print   print the commands it would run here and run none (no venv made)
#
# The GPUs decide the builds. CUDA 13 builds have no kernels below compute capability 7.5, so where any
# target GPU is below it (V100: 7.0) torch and torchvision come from PyTorch's CUDA 12.6 index and DALI
# is its CUDA 12 build; 7.5 and up (T4, A100, H100), or no GPU, take the default builds (PyPI's torch,
# DALI for CUDA 13). Below 7.0 (P100) no build of torch 2.14.1 runs, nor the container's: one line,
# exit 2. Horovod is built with NCCL for the
# target GPUs' architectures (scripts/install_horovod.sh).
# Settings (environment):
#   TRAINER_GPUS=7.0|8.0,9.0|cpu  the compute capabilities to build for; default: those nvidia-smi lists
#                                 here, else cpu. A login node or an image build names its target GPUs.
#   TRAINER_WHEELHOUSE=DIR  install from a folder of wheels, without network (an air-gapped node). Fill it
#                           where PyPI is reachable, with the node's Python version:
#                             python -m pip download -d DIR torch==2.14.1 torchvision==0.29.1 \
#                                 nvidia-dali-cuda130 '.[test]' setuptools cmake   (a V100: the torch pair
#                                 with --index-url https://download.pytorch.org/whl/cu126, nvidia-dali-cuda120)
#                             python -m pip download -d DIR --no-deps --no-binary :all: horovod==0.28.1
#   VENV=path|none      where to install; none = into $PYTHON itself (a container's interpreter)
#   PYTHON=python3.x    the interpreter that makes the venv, or is used with VENV=none
#   TORCH=pinned|keep   keep = use the interpreter's own torch (NGC containers)
#   DALI_PACKAGE=nvidia-dali-cuda130|nvidia-dali-cuda120|none   default: the one the GPUs need
#   SKIP_HOROVOD=1      no Horovod build (it takes a few minutes the first time)
#   SKIP_MPI=1          no Open MPI from the system's packages (Horovod is then built with gloo only)
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source-path=SCRIPTDIR source=gpu_targets.sh
source scripts/gpu_targets.sh
PRINT=""
case "${1:-}" in
    "") ;;
    --print) PRINT=1 ;;
    *) echo "error: unknown argument '$1' (bash scripts/setup.sh [--print])" >&2; exit 2 ;;
esac
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH=${TORCH:-pinned}
TORCH_VERSION=2.14.1
TORCH_PINS=("torch==$TORCH_VERSION" torchvision==0.29.1)
LEGACY_INDEX=https://download.pytorch.org/whl/cu126  # PyTorch's CUDA 12.6 builds: the last with Volta kernels

run() {  # the command, or with --print its line
    if [ -n "$PRINT" ]; then
        echo "$*"
    else
        "$@"
    fi
}

gpus=$(gpu_targets) || exit 2
torch_index=""
if [ "$gpus" != cpu ] && any_below "$gpus" 7.0 && [ "$TORCH" = pinned ]; then
    echo "error: GPU compute capability ${gpus%%,*} is below 7.0: no build of torch $TORCH_VERSION has kernels for it, nor has the container route (the Dockerfile builds for 7.0, 8.0 and 9.0); run on GPUs of compute capability 7.0 (V100) or newer" >&2
    exit 2
fi
if [ "$gpus" != cpu ] && any_below "$gpus" 7.5; then
    torch_index=$LEGACY_INDEX
    DALI_PACKAGE=${DALI_PACKAGE:-nvidia-dali-cuda120}
fi
DALI_PACKAGE=${DALI_PACKAGE:-nvidia-dali-cuda130}

pip_from=()  # where pip installs from: PyPI, or the wheelhouse alone
if [ -n "${TRAINER_WHEELHOUSE:-}" ]; then
    if [ ! -d "$TRAINER_WHEELHOUSE" ]; then
        echo "error: TRAINER_WHEELHOUSE=$TRAINER_WHEELHOUSE is not a folder: name the folder of wheels to install from" >&2
        exit 2
    fi
    pip_from=(--no-index --find-links "$TRAINER_WHEELHOUSE")
    export TRAINER_WHEELHOUSE  # Horovod's sdist and build tools come from there too
fi
torch_from=("${pip_from[@]}")
if [ -z "${TRAINER_WHEELHOUSE:-}" ] && [ -n "$torch_index" ]; then
    torch_from=(--index-url "$torch_index")
fi

echo "setup: GPUs: ${gpus/#cpu/none (cpu)}; torch $TORCH_VERSION from ${torch_index:-PyPI}, DALI: $DALI_PACKAGE${TRAINER_WHEELHOUSE:+ (all from $TRAINER_WHEELHOUSE)}" >&2
if [ "$VENV" = none ]; then
    py=$PYTHON
    stamp=""
else
    [ -x "$VENV/bin/python" ] || run "$PYTHON" -m venv "$VENV"
    py="$VENV/bin/python"
    stamp="$VENV/.setup-$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-16)-$TORCH-${torch_index##*/}-$DALI_PACKAGE"
fi

# the pinned torch in the build the GPUs need (a CUDA 12 build where the legacy index is chosen)
torch_fits() {
    "$py" -c "import sys, torch, torchvision
sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION' or ('$torch_index' != '' and not (torch.version.cuda or '').startswith('12.')))" 2>/dev/null
}

if [ -z "$stamp" ] || [ ! -f "$stamp" ]; then
    echo "setup: installing into ${VENV/#none/$py} (torch: $TORCH, DALI: $DALI_PACKAGE, mlperf-logging, project)" >&2
    [ -n "${TRAINER_WHEELHOUSE:-}" ] || run "$py" -m pip install -q --upgrade pip
    if [ "$TORCH" = pinned ] && ! torch_fits; then
        run "$py" -m pip install -q "${torch_from[@]}" "${TORCH_PINS[@]}"
    fi
    if [ "$DALI_PACKAGE" != none ]; then
        # two DALI builds in one environment share the nvidia.dali package: only the chosen one stays
        for other in nvidia-dali-cuda130 nvidia-dali-cuda120; do
            if [ "$other" != "$DALI_PACKAGE" ] && "$py" -m pip show -q "$other" >/dev/null 2>&1; then
                run "$py" -m pip uninstall -q -y "$other"
            fi
        done
        run "$py" -m pip install -q "${pip_from[@]}" "$DALI_PACKAGE"
    fi
    run "$py" -m pip install -q "${pip_from[@]}" -e '.[test]'
    if [ -n "$stamp" ] && [ -z "$PRINT" ]; then
        rm -f "$VENV"/.setup-*
        touch "$stamp"
    fi
fi
# Open MPI (mpirun, and mpicxx for Horovod's MPI build) and an ssh client (horovodrun reaches other
# hosts through it): the system's packages, as root, when missing
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    missing=()
    [ -n "${SKIP_MPI:-}" ] || command -v mpicxx >/dev/null || missing+=(openmpi-bin libopenmpi-dev)
    command -v ssh >/dev/null || missing+=(openssh-client)
    if [ ${#missing[@]} -gt 0 ]; then
        echo "setup: installing ${missing[*]}" >&2
        if [ -n "$PRINT" ]; then
            echo "apt-get update -qq"
            echo "DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends ${missing[*]}"
        else
            apt-get update -qq >/dev/null
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
        fi
    fi
fi
if [ -z "${SKIP_HOROVOD:-}" ]; then
    PYTHON="$py" TRAINER_GPUS="$gpus" bash scripts/install_horovod.sh ${PRINT:+--print}
fi
