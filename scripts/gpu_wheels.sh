#!/usr/bin/env bash
# Fills .whl/, the wheels folder for a GPU node without network (an air-gapped cluster's node), with
# what scripts/gpu_check.sh needs there beyond the node's own stack: Python with torch, numpy and
# PyYAML. Run it where PyPI is reachable, then copy .whl/ to the node with the checkout (it is
# git-ignored: a clone does not bring it); gpu_check.sh installs from it without network.
#   mlperf-logging           required: the trainer writes its MLLOG with it
#   torchvision, pillow      required: the models are torchvision's (the one of the node's torch)
#   pytest (+ its packages)  required: the check runs the gpu tests
#   nvidia-nvimgcodec-cu13   optional (data/decode.py falls back to PIL): kept only within WHEELS_MIB
# DALI (hundreds of MB installed) and Horovod (built against the node's CUDA and MPI) are not among
# them: a node without them has its DALI and Horovod figures and tests reported absent.
# Settings (environment), for the node:
#   NODE_PYTHON=3.12    its Python version (the wheels' tags)
#   NODE_TORCH=2.11.0   its torch version (torchvision follows it: 2.11 -> 0.26)
#   WHEELS_MIB=40       .whl/'s size: the optional wheels are dropped above it
# Idempotent: a wheel already in .whl/ is not fetched again, other versions of it are removed
# (two versions of one package stop the whole install there). scripts/test.sh runs it for the
# dry run of gpu_check.sh on .venv-device, a bare node's stack (tests/test_gpu.py).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
NODE_PYTHON=${NODE_PYTHON:-3.12}
NODE_TORCH=${NODE_TORCH:-2.11.0}
WHEELS_MIB=${WHEELS_MIB:-40}
if [[ ! $NODE_PYTHON =~ ^3\.[0-9]+$ ]]; then
    echo "error: NODE_PYTHON=$NODE_PYTHON is not a Python version such as 3.12" >&2
    exit 2
fi
if [[ ! $NODE_TORCH =~ ^2\.([0-9]+)\.([0-9]+)$ ]]; then
    echo "error: NODE_TORCH=$NODE_TORCH is not a torch version such as 2.11.0" >&2
    exit 2
fi
# torchvision 0.(N+15).P is the one of torch 2.N.P (0.26.0 is torch 2.11.0's)
TORCHVISION=0.$((BASH_REMATCH[1] + 15)).${BASH_REMATCH[2]}
# torchvision, pillow and pytest: the check's runs and tests need them, and a bare node need not have
# them (a wheel of what the node has is not installed: gpu_check.sh installs only what is missing)
REQUIRED=(mlperf-logging==4.1.68 "torchvision==$TORCHVISION" pillow==13.0.0 pytest==9.2.0 pluggy==1.7.0
          iniconfig==2.3.1 packaging==26.3 pygments==2.21.0)
OPTIONAL=(nvidia-nvimgcodec-cu13==0.9.0.20)

if ! git check-ignore -q .whl/x.whl; then
    echo "error: .whl/ is not git-ignored; add /.whl/ to .gitignore" >&2
    exit 1
fi
mkdir -p .whl

fetch() {  # NAME==VERSION
    local name=${1%%==*} version=${1#*==} file old
    file=${name//-/_}  # a wheel's file name spells the project with underscores
    file=${file,,}
    for old in .whl/"$file"-*.whl; do
        [[ -e $old && $old != .whl/"$file-$version"-*.whl ]] && rm -f "$old"
    done
    compgen -G ".whl/$file-$version-*.whl" >/dev/null && return 0
    echo "gpu_wheels: downloading $1" >&2
    timeout 600 "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$NODE_PYTHON" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$1"
}

bytes() { stat -c %s -- "$@" 2>/dev/null | awk '{s += $1} END {print s + 0}'; }
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }

for wheel in "${REQUIRED[@]}"; do
    fetch "$wheel" || { echo "error: could not download $wheel" >&2; exit 1; }
done
for wheel in "${OPTIONAL[@]}"; do
    fetch "$wheel" || echo "gpu_wheels: could not download $wheel; going on without it" >&2
done

shopt -s nullglob
wheels=(.whl/*.whl)
total=$(bytes "${wheels[@]}")
if [ "$total" -gt $((WHEELS_MIB * 1048576)) ]; then
    for wheel in "${OPTIONAL[@]}"; do
        name=${wheel%%==*}
        name=${name//-/_}
        echo "gpu_wheels: dropping ${name,,} to keep .whl/ under $WHEELS_MIB MiB" >&2
        rm -f .whl/"${name,,}"-*.whl
    done
    wheels=(.whl/*.whl)
    total=$(bytes "${wheels[@]}")
fi

# what is copied to the node: the checkout's files (tracked, and untracked but not ignored) and .whl/
mapfile -d '' files < <(git ls-files -co --exclude-standard -z)
tree=$(bytes "${files[@]}")
printf '%s\n' "${wheels[@]}"
echo ".whl: $(mib "$total") in ${#wheels[@]} wheels; with the checkout $(mib $((tree + total))) to copy to the node"
