#!/usr/bin/env bash
# GPU checks, for a machine with one CUDA GPU: the tests marked `gpu`, then one-GPU ResNet-50
# training throughput (synthetic loader, 224 px, bf16 at per-GPU batches 16, 32, 64, 128, 256 and
# fp16 at 256: the planner's calibration, also written as gpu_calibration.yaml in the form of
# train/plan/calibration.yaml's `measured:` list), the torch loader with pinned memory feeding the
# same training step on generated JPEGs (against the synthetic loader at that batch), and the
# LARS step against SGD (scripts/bench/lars_step.py on the GPU, eager and compiled).
# Uses the machine's own python3 and torch (PYTHON=... for another). Packages it lacks come from
# .whl/ (scripts/gpu_wheels.sh fills it where PyPI is reachable), installed without network.
# Writes to ${OUT:-gpu_figures}/: gpu_figures.txt (one line per gpu test with its outcome, then
# the figures), gpu_calibration.yaml, gpu_tests.xml and gpu_tests.log (pytest's). Under 10 minutes.
# A gpu test skipped because DALI is not installed is reported as `DALI absent`, never as a pass;
# any other skip fails the check, since CUDA is there.
# Exit: 0 all passed; 1 a gpu test failed or was skipped, or a timed run failed;
#       2 nothing checked: no CUDA GPU visible, no torch, or mlperf-logging neither there nor in .whl/.
#   bash scripts/gpu_check.sh --report JUNIT.xml   only the per-test report of a pytest JUnit file
set -uo pipefail
PY=${PYTHON:-python3}
DALI_ABSENT="DALI absent"  # the skip reason of tests/test_gpu.py's DALI tests

report_tests() {  # JUNIT.xml: one line per test; fails on a failure, a skip other than DALI's, or no test run
    "$PY" - "$1" "$DALI_ABSENT" <<'PYEOF'
import sys
import xml.etree.ElementTree as ET

junit, dali_absent = sys.argv[1:]
try:
    cases = list(ET.parse(junit).getroot().iter("testcase"))
except (OSError, ET.ParseError) as err:
    print(f"gpu tests: no pytest report ({err}): pytest did not finish")
    sys.exit(1)
counts = {"passed": 0, dali_absent: 0, "skipped": 0, "failed": 0}
for case in cases:
    failure = next((e for e in case if e.tag in ("failure", "error")), None)
    skipped = case.find("skipped")
    if failure is not None:
        kind, outcome = "failed", "FAILED: " + (failure.get("message") or failure.tag).splitlines()[0][:200]
    elif skipped is not None and (skipped.get("message") or "").strip() == dali_absent:
        kind = outcome = dali_absent
    elif skipped is not None:
        kind, outcome = "skipped", f"SKIPPED: {skipped.get('message')} (not allowed: CUDA is there)"
    else:
        kind = outcome = "passed"
    counts[kind] += 1
    print(f"gpu test {case.get('classname')}::{case.get('name')}: {outcome} ({float(case.get('time') or 0):.1f} s)")
good = counts["failed"] == counts["skipped"] == 0 and counts["passed"] > 0
print("gpu tests: " + ", ".join(f"{n} {kind}" for kind, n in counts.items())
      + ("" if good else " -> FAIL" + ("" if counts["passed"] else " (no gpu test passed)")))
sys.exit(0 if good else 1)
PYEOF
}

if [ "${1:-}" = --report ]; then
    report_tests "${2:?usage: gpu_check.sh --report JUNIT.xml}"
    exit
fi

cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-gpu_figures}
mkdir -p "$OUT"
figures="$OUT/gpu_figures.txt"
DEADLINE=$((SECONDS + 570))  # the whole check stays under 10 minutes, whatever hangs
budget() { local left=$((DEADLINE - SECONDS)); left=$((left < $1 ? left : $1)); echo $((left > 1 ? left : 1)); }
note() { echo "$*" | tee -a "$figures"; }
fail_setup() { echo "error: $*" | tee -a "$figures" >&2; exit 2; }
echo "# gpu_check $(date -u +%FT%TZ)" | tee "$figures"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# Without CUDA every gpu test would be skipped: say so and stop, rather than report a pass.
timeout 150 "$PY" -c "
import sys
try:
    import torch
except ImportError:
    sys.exit(3)
sys.exit(0 if torch.cuda.is_available() else 4)"
case $? in
    0) ;;
    3) fail_setup "$PY has no torch" ;;
    4) fail_setup "no CUDA GPU visible" ;;
    *) fail_setup "$PY could not say whether CUDA is there" ;;
esac

# The wheels whose distribution this python lacks, installed into /tmp/site without network and
# put on PYTHONPATH (the tests' child processes keep it after the repository).
shopt -s nullglob
wheels=(.whl/*.whl)
mapfile -t missing < <(timeout 60 "$PY" - "${wheels[@]}" <<'PYEOF'
import sys
from importlib import metadata
for wheel in sys.argv[1:]:
    try:
        metadata.version(wheel.rsplit("/", 1)[-1].split("-")[0])
    except metadata.PackageNotFoundError:
        print(wheel)
PYEOF
)
if [ "${#missing[@]}" -gt 0 ]; then
    timeout 180 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "${missing[@]}" || fail_setup "could not install ${missing[*]} into /tmp/site"
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
timeout 60 "$PY" -c "import mlperf_logging" 2>/dev/null \
    || fail_setup "mlperf_logging is missing: run scripts/gpu_wheels.sh where PyPI is reachable and carry .whl"

timeout 120 "$PY" - <<'PYEOF' | tee -a "$figures"
import importlib
from importlib import metadata
import torch

def version(module, dist=None):
    try:
        loaded = importlib.import_module(module)
    except ModuleNotFoundError:
        return "absent"
    except Exception as err:  # installed, but it does not load here
        return f"broken ({type(err).__name__}: {err})"
    return metadata.version(dist) if dist else getattr(loaded, "__version__", "present")

print(f"torch {torch.__version__} | {torch.cuda.get_device_name(0)} | mlperf-logging {version('mlperf_logging', 'mlperf-logging')}"
      f" | nvImageCodec {version('nvidia.nvimgcodec')} | DALI {version('nvidia.dali')}")
PYEOF

# The gpu tests, one line each in the figures from pytest's JUnit report.
junit="$OUT/gpu_tests.xml"
rm -f "$junit"
timeout -k 10 "$(budget 240)" "$PY" -m pytest -m gpu -rA -p no:cacheprovider --junitxml="$junit" tests \
    >"$OUT/gpu_tests.log" 2>&1
pytest_rc=$?
report_tests "$junit" | tee -a "$figures"
tests_rc=${PIPESTATUS[0]}
if [ "$pytest_rc" -ne 0 ]; then
    note "pytest exited $pytest_rc$(case $pytest_rc in 124 | 137) echo ' (timed out)' ;; esac); its output: $OUT/gpu_tests.log"
    tests_rc=1
fi

runs=$(mktemp -d)
runs_rc=0
calibration="$OUT/gpu_calibration.yaml"
gpu_name=$(timeout 60 "$PY" -c "
import torch
name = torch.cuda.get_device_name(0).lower()
print(next((g for g in ('h200', 'h100', 'a100', 'v100') if g in name), 'unknown'))")
echo "measured:  # scripts/gpu_check.sh $(date -u +%F) on $gpu_name; into train/plan/calibration.yaml" >"$calibration"

steady_rate() {  # RUN_DIR: training images/s after the first logging window (cuDNN autotuning, warm-up)
    timeout 60 "$PY" - "$1" <<'PYEOF'
import json, sys
from pathlib import Path
windows = [json.loads(l) for l in (Path(sys.argv[1]) / "metrics.jsonl").read_text().splitlines()]
windows = [w for w in windows if w["kind"] == "train"]
first, last = windows[0], windows[-1]
print(f"{(last['images'] - first['images']) / (last['seconds'] - first['seconds']):.0f}")
PYEOF
}

timed_run() {  # LABEL LIMIT TRAIN-ARGS...: a short training run; prints its steady images/s into $rate
    local label=$1 limit run="$runs/run$RANDOM"
    limit=$(budget "$2")
    shift 2
    rate=""
    if [ "$limit" -lt 30 ]; then
        note "$label: not run, the 10-minute budget is spent"
        runs_rc=1
        return
    fi
    # -k: the trainer takes SIGTERM as preemption and checkpoints first; don't wait for that long
    timeout -k 10 "$limit" "$PY" -m train --out-dir "$run" --arch resnet50 --image-size 224 --global-batch-size 0 \
        --eval-every 0 --log-every 20 "$@" >"$run.log" 2>&1
    local rc=$?
    if [ "$rc" -ne 0 ]; then
        note "$label: run failed (exit $rc), last lines:"
        tail -n 3 "$run.log" | tee -a "$figures"
        runs_rc=1
        return
    fi
    rate=$(steady_rate "$run") || runs_rc=1
}

# one-GPU throughput by per-GPU batch: what the planner's compute model needs
declare -A synthetic_rate
for case in bf16:16 bf16:32 bf16:64 bf16:128 bf16:256 fp16:256; do
    precision=${case%%:*} batch=${case##*:}
    timed_run "resnet50 224px $precision batch $batch" 120 --loader synthetic --batch-size "$batch" \
        --precision "$precision" --synthetic-images 10000000 --max-steps 120 --workers 0
    [ -n "$rate" ] || continue
    note "resnet50 224px $precision batch $batch: $rate img/s"
    synthetic_rate[$case]=$rate
    if [ "$precision" = bf16 ]; then
        echo "  - {gpu: $gpu_name, per_gpu_batch: $batch, img_per_s: $rate, source: \"gpu_check $(date -u +%F), bf16\"}" \
            >>"$calibration"
    fi
done

# the torch loader (worker threads, pinned uint8 batches normalised on the GPU) feeding the same step
tree="$runs/jpegs"
if timeout "$(budget 90)" "$PY" -c "
import sys; from pathlib import Path
sys.path.insert(0, 'scripts/bench')
from loader import make_tree
make_tree(Path('$tree'), 3072)" >"$runs/tree.log" 2>&1; then
    timed_run "torch loader bf16 batch 256" 150 --loader torch --data-dir "$tree" --batch-size 256 \
        --precision bf16 --epochs 4 --workers "$(nproc)"
    if [ -n "$rate" ]; then
        note "torch loader ($(nproc) threads, pinned memory) bf16 batch 256: $rate img/s, $(awk -v a="$rate" \
            -v b="${synthetic_rate[bf16:256]:-0}" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "?" }') x synthetic"
    fi
else
    note "torch loader: could not make the JPEG tree: $(tail -n 1 "$runs/tree.log")"
    runs_rc=1
fi

# the LARS step against SGD on the GPU, eager and compiled (its compile time printed)
limit=$(budget 150)
if timeout -k 10 "$limit" "$PY" scripts/bench/lars_step.py --device cuda >"$runs/lars.log" 2>&1; then
    grep -v "^W" "$runs/lars.log" | tail -n 3 | tee -a "$figures"
else
    note "lars_step on the GPU failed or timed out ($limit s): $(tail -n 1 "$runs/lars.log")"
    runs_rc=1
fi
rm -rf "$runs"

if [ "$tests_rc" -ne 0 ] || [ "$runs_rc" -ne 0 ]; then
    note "gpu_check: FAIL (tests $([ "$tests_rc" -eq 0 ] && echo ok || echo failed), timed runs $([ "$runs_rc" -eq 0 ] && echo ok || echo failed)) after ${SECONDS} s"
    exit 1
fi
note "gpu_check: ok after ${SECONDS} s"
