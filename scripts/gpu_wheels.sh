#!/usr/bin/env bash
# Fills .whl/ with the wheels that the lent GPU machine lacks, for scripts/gpu_check.sh there.
# Run it here, where PyPI is reachable: that machine has no network, its python3 is 3.12 on
# x86-64 with torch 2.11 (CUDA 13), numpy, pandas, pyyaml and scipy (all that mlperf-logging requires),
# but no mlperf-logging and no nvImageCodec; torchvision, pillow and pytest it is not said to have.
# .whl/ is git-ignored, so the call must carry it. `gpu_check.sh --dry-run` on .venv-device (that stack,
# made by scripts/setup.sh) shows the check runs there with what .whl/ brings.
#   mlperf-logging           required: the trainer writes its MLLOG with it
#   torchvision, pillow      required: the models are torchvision's (0.26.0 is torch 2.11's)
#   pytest (+ its packages)  required: the check runs the gpu tests
#   nvidia-nvimgcodec-cu13   optional (data/decode.py falls back to PIL): kept only within the budget
# DALI (hundreds of MB installed) never fits the 64 MiB that may travel; its GPU tests report `DALI absent`.
# Idempotent: a wheel already in .whl/ is not fetched again, other versions of it are removed
# (two versions of one package stop the whole install there).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
BUDGET_MIB=${BUDGET_MIB:-40}  # for .whl/; the working tree and .whl/ together must stay under 64 MiB
# torchvision, pillow and pytest: the check's runs and tests need them, and the stack above does not say
# they are there (a wheel of what the machine has is not installed: gpu_check.sh installs what is missing)
REQUIRED=(mlperf-logging==4.1.68 torchvision==0.26.0 pillow==13.0.0 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1
          packaging==26.3 pygments==2.21.0)
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
    timeout 600 "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
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
if [ "$total" -gt $((BUDGET_MIB * 1048576)) ]; then
    for wheel in "${OPTIONAL[@]}"; do
        name=${wheel%%==*}
        name=${name//-/_}
        echo "gpu_wheels: dropping ${name,,} to keep .whl/ under $BUDGET_MIB MiB" >&2
        rm -f .whl/"${name,,}"-*.whl
    done
    wheels=(.whl/*.whl)
    total=$(bytes "${wheels[@]}")
fi

# what travels: tracked and untracked-not-ignored files, shared/ if there is one, and the carried .whl/
mapfile -d '' files < <(git ls-files -co --exclude-standard -z)
tree=$(bytes "${files[@]}")
if [ -d shared ] && git check-ignore -q shared; then tree=$((tree + $(du -sb shared | cut -f1))); fi
printf '%s\n' "${wheels[@]}"
echo ".whl: $(mib "$total") in ${#wheels[@]} wheels; with the working tree $(mib $((tree + total))) travel (limit 64 MiB)"
if [ $((tree + total)) -gt $((64 * 1048576)) ]; then
    echo "error: the working tree and .whl/ together are over 64 MiB" >&2
    exit 1
fi
