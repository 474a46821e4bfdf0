# The GPUs a set-up builds for. Sourced by scripts/setup.sh and scripts/install_horovod.sh.
#
#   TRAINER_GPUS=7.0 | 8.0,9.0 | cpu   the compute capabilities to build for, or cpu for none. Unset:
#       those of the GPUs `nvidia-smi --query-gpu=compute_cap` lists here, else cpu. A login node or an
#       image build sees no GPU: it names the GPUs the environment is for.

# Prints the target capabilities, comma-separated, ascending, without repeats ("7.0,9.0"), or "cpu".
# A list that is not capabilities: one line on stderr and status 2.
gpu_targets() {
    local listed cap caps=()
    if [ -n "${TRAINER_GPUS:-}" ]; then
        if [ "$TRAINER_GPUS" = cpu ]; then
            echo cpu
            return 0
        fi
        listed=${TRAINER_GPUS//,/$'\n'}
    elif command -v nvidia-smi >/dev/null; then
        # no driver or no GPU (a login node with the tools installed): nothing listed, a CPU set-up
        listed=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null) || listed=""
    else
        listed=""
    fi
    for cap in $listed; do
        if [[ ! $cap =~ ^[0-9]+\.[0-9]$ ]]; then
            echo "error: '$cap' is not a GPU compute capability (TRAINER_GPUS takes e.g. 7.0 or 8.0,9.0, or cpu)" >&2
            return 2
        fi
        caps+=("$cap")
    done
    if [ ${#caps[@]} -eq 0 ]; then
        echo cpu
        return 0
    fi
    printf '%s\n' "${caps[@]}" | sort -u -V | paste -sd, -
}

# "7.0,8.6,9.0" -> "70,86,90": the form of CUDA's sm_XY and of HOROVOD_BUILD_CUDA_CC_LIST
cuda_arches() {
    echo "${1//./}"
}

# Status 0 when any capability in the list ("7.0,9.0") is below MAJOR.MINOR (given as "7.5").
any_below() {
    local cap floor=${2//./}
    for cap in ${1//,/ }; do
        [ "${cap//./}" -lt "$floor" ] && return 0
    done
    return 1
}
