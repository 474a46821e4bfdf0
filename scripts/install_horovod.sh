#!/usr/bin/env bash
# Builds and installs Horovod 0.28.1 with PyTorch support from its PyPI sdist, patched to C++20
# (torch >= 2.13 headers need it; Horovod hard-codes C++14) and to keep its collectives on the
# network interface named (PATCHES below). Idempotent: does nothing when this build of ours already
# imports, with MPI where mpicxx is, and with NCCL where GPUs are targeted. The built wheel is cached
# per (python, torch, build settings) so a rebuild on the same machine is a copy.
#
#   bash scripts/install_horovod.sh           build (when needed) and install
#   bash scripts/install_horovod.sh --print   print the build's environment and commands, run none
#
# Builds: gloo always; MPI when mpicxx is on PATH. GPU operations over NCCL, compiled for the target
# GPUs' architectures, when GPUs are targeted: TRAINER_GPUS (scripts/gpu_targets.sh; scripts/setup.sh
# passes its choice), else the GPUs nvidia-smi lists; 7.0 -> HOROVOD_BUILD_CUDA_CC_LIST=70 and so on.
# An installed build without NCCL is rebuilt then. No GPU targeted (a CPU machine): gloo/MPI only,
# unless HOROVOD_GPU_OPERATIONS=NCCL is set.
# Environment: PYTHON (default .venv/bin/python); HOROVOD_* build variables set by hand win;
# TRAINER_WHEELHOUSE=DIR: the sdist and build tools from that folder, without network;
# TRAINER_TICKER_EVERY_S: seconds between the build's "... so far" lines (default 20; scripts/ticker.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source-path=SCRIPTDIR source=ticker.sh
source scripts/ticker.sh
# shellcheck source-path=SCRIPTDIR source=gpu_targets.sh
source scripts/gpu_targets.sh
PRINT=""
case "${1:-}" in
    "") ;;
    --print) PRINT=1 ;;
    *) echo "error: unknown argument '$1' (bash scripts/install_horovod.sh [--print])" >&2; exit 2 ;;
esac
PY=${PYTHON:-.venv/bin/python}
VERSION=0.28.1
gpus=$(gpu_targets) || exit 2
pip_from=()
[ -z "${TRAINER_WHEELHOUSE:-}" ] || pip_from=(--no-index --find-links "$TRAINER_WHEELHOUSE")

# Our patches to the sdist; the number goes up when they change, and an older build is replaced:
#  1. C++20 (above).
#  2. Process sets over gloo take HOROVOD_GLOO_IFACE as the global context does: Horovod's own code
#     leaves their interface empty, so gloo takes the host name's address, and every collective (all
#     run on process sets, the global one included) goes over that network whatever the setting.
PATCHES=2
# done when this build of ours imports, with MPI wherever Open MPI's compiler is there (mpirun needs it)
# and with NCCL where GPUs are targeted (without it, GPU all-reduces would go through host memory)
want_nccl=$([ "$gpus" != cpu ] && echo 1 || echo 0)
if "$PY" -c "import horovod, horovod.torch as h, shutil, sys, pathlib
stamp = pathlib.Path(horovod.__file__).parents[1] / 'trainer-patches'
sys.exit(not (h.mpi_built() or not shutil.which('mpicxx')) or not (h.nccl_built() or not $want_nccl)
         or not stamp.exists() or stamp.read_text().strip() != '$PATCHES')" 2>/dev/null; then
    [ -z "$PRINT" ] || echo "install_horovod: Horovod $VERSION is built as needed here: nothing to do" >&2
    exit 0
fi

export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
if [ -z "${HOROVOD_WITH_MPI:-}${HOROVOD_WITHOUT_MPI:-}" ]; then
    if command -v mpicxx >/dev/null; then export HOROVOD_WITH_MPI=1; else export HOROVOD_WITHOUT_MPI=1; fi
fi
if [ "$gpus" != cpu ]; then
    export HOROVOD_GPU_OPERATIONS=${HOROVOD_GPU_OPERATIONS:-NCCL}
    export HOROVOD_BUILD_CUDA_CC_LIST=${HOROVOD_BUILD_CUDA_CC_LIST:-$(cuda_arches "$gpus")}
fi
# A CUDA build of torch makes Horovod's CMake look for the CUDA toolkit; point it there and
# compile its few kernels only for the arches asked for (V100 = 70 needs a CUDA 12 toolkit).
if [ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ]; then export CUDA_HOME=/usr/local/cuda; fi
if [ -n "${CUDA_HOME:-}" ]; then
    export HOROVOD_CUDA_HOME=${HOROVOD_CUDA_HOME:-$CUDA_HOME} PATH="$CUDA_HOME/bin:$PATH"
    export HOROVOD_BUILD_CUDA_CC_LIST=${HOROVOD_BUILD_CUDA_CC_LIST:-80,90}
fi
# every processor (nproc alone obeys OMP_NUM_THREADS, which a CPU-run shell may set to 1)
MAKEFLAGS="-j$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"
export MAKEFLAGS HOROVOD_BUILD_ARCH_FLAGS=${HOROVOD_BUILD_ARCH_FLAGS:-}
if [ -n "$PRINT" ]; then
    echo "install_horovod: the build's environment and commands" >&2
    env | grep -E '^HOROVOD_|^CUDA_HOME=' | sort
    echo "$PY -m pip download -q --no-deps --no-binary :all: ${pip_from[*]}${pip_from[*]:+ }horovod==$VERSION -d WORK"
    echo "$PY -m pip wheel -q --no-build-isolation --no-deps WORK/horovod-$VERSION -w WORK/wheel"
    echo "$PY -m pip install -q --no-deps --force-reinstall WORK/wheel/horovod-$VERSION-*.whl"
    exit 0
fi

key=$("$PY" -c "import sys, torch; print(f'py{sys.version_info[0]}{sys.version_info[1]}-torch{torch.__version__}')" | tr '+' '_')
flavour=$( (env | grep -E '^HOROVOD_(WITH|WITHOUT|GPU|BUILD_CUDA)' | sort; echo "patches $PATCHES") | sha1sum | cut -c1-8)
cache="${TRAINER_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/resnet-trainer}/wheels/horovod-$VERSION-$key-$flavour"
if ! ls "$cache"/horovod-*.whl >/dev/null 2>&1; then
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    echo "install_horovod: building Horovod $VERSION ($key; first set-up only, usually 5-8 min)" >&2
    "$PY" -m pip download -q --no-deps --no-binary :all: "${pip_from[@]}" "horovod==$VERSION" -d "$work"
    tar -xzf "$work/horovod-$VERSION.tar.gz" -C "$work"
    src="$work/horovod-$VERSION"
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 20)/' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
    sed -i 's/"-std=c++17" GLOO_CMAKE/"-std=c++20" GLOO_CMAKE/; s/set(CMAKE_CXX_STANDARD 17)\\n/set(CMAKE_CXX_STANDARD 20)\\n/' "$src/CMakeLists.txt"
    grep -q 'CMAKE_CXX_STANDARD 20' "$src/horovod/torch/CMakeLists.txt" || { echo "install_horovod: patch did not apply" >&2; exit 1; }
    context="$src/horovod/common/gloo/gloo_context.cc"
    "$PY" - "$context" <<'PATCH'
import sys
path = sys.argv[1]
text = open(path).read()
head, sep, tail = text.partition("void GlooContext::InitializeForProcessSet(")
assert sep and "device_attr.iface = gloo_iface_;" in tail, "install_horovod: the process-set patch did not apply"
open(path, "w").write(head + sep + tail.replace("device_attr.iface = gloo_iface_;",
                                                "device_attr.iface = global_context.gloo_iface_;\n  gloo_iface_ = global_context.gloo_iface_;", 1))
PATCH
    "$PY" -m pip install -q "${pip_from[@]}" cmake 2>/dev/null || true  # a recent CMake if the system one is old
    # pip says nothing for minutes while it compiles: a line every 20 s says it is still going
    with_ticker "install_horovod: building Horovod $VERSION from source (first set-up only; usually 5-8 min)" \
        "$PY" -m pip wheel -q --no-build-isolation --no-deps "$src" -w "$work/wheel"
    mkdir -p "$cache"
    cp "$work"/wheel/horovod-*.whl "$cache/"
fi
"$PY" -m pip install -q --no-deps --force-reinstall "$cache"/horovod-*.whl
"$PY" -m pip install -q "${pip_from[@]}" cffi cloudpickle psutil pyyaml packaging  # Horovod's and horovodrun's own needs
"$PY" -c "import horovod.torch" || { echo "install_horovod: horovod.torch does not import after the build" >&2; exit 1; }
echo "$PATCHES" > "$("$PY" -c 'import horovod, pathlib; print(pathlib.Path(horovod.__file__).parents[1])')/trainer-patches"
echo "install_horovod: $("$PY" -c 'import horovod; print(horovod.__version__)') installed" >&2
