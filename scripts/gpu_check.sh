#!/usr/bin/env bash
# GPU checks, for a machine with one CUDA GPU, in one command that ends within 8 minutes: the tests
# marked `gpu`, then scripts/gpu_figures.py: one-GPU ResNet-50 training images/s at the default
# per-GPU batch for bf16 (from compute capability 8.0), fp16 and fp32/TF32, on synthetic data and
# through DALI decoding generated JPEGs; --compile in its default mode for the default precision (step
# time against eager, compile time); every run's steps under torch.cuda.set_sync_debug_mode("error")
# from the third on (a step that waits for the GPU fails its run and names the line); peak memory per
# image; the ghost BatchNorm step against plain BatchNorm; the planner's images/s beside the measured;
# published anchors. A table on stdout and in gpu_figures.txt, the figures in gpu_figures.json.
# Uses the machine's own python3 and torch (PYTHON=... for another). Packages it lacks come from
# .whl/ (scripts/gpu_wheels.sh fills it where PyPI is reachable), installed without network.
# Writes to ${OUT:-gpu_figures}/: gpu_figures.txt (one line per gpu test with its outcome, then the
# figures), gpu_figures.json, gpu_calibration.yaml (the default precision's point, in the form of
# train/plan/calibration.yaml's `measured:` list), gpu_tests.xml and gpu_tests.log (pytest's).
# A gpu test skipped because DALI is not installed is reported as `DALI absent`, never as a pass;
# any other skip fails the check, since CUDA is there.
# Exit: 0 all passed; 1 a gpu test failed or was skipped, or a run failed (its sync check included);
#       2 nothing checked: no CUDA GPU visible, no torch, or mlperf-logging neither there nor in .whl/.
#   bash scripts/gpu_check.sh --report JUNIT.xml   only the per-test report of a pytest JUnit file
#   bash scripts/gpu_check.sh --dry-run            on a machine without a GPU, that the check can run on
#       this python's stack: the same set-up and .whl/ installs, the gpu tests collected (not run), and
#       the figures' runs on the CPU at toy sizes (tests/test_gpu.py runs it on the lent machine's stack,
#       .venv-device: Python 3.12, torch 2.11, made by scripts/setup.sh)
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
DRY_RUN=$([ "${1:-}" = --dry-run ] && echo 1 || echo "")

cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-gpu_figures}
mkdir -p "$OUT"
figures="$OUT/gpu_figures.txt"
DEADLINE=$((SECONDS + 470))  # the whole check stays under 8 minutes, whatever hangs
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
sys.exit(0 if torch.cuda.is_available() or '$DRY_RUN' else 4)"
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
import sys
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

device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU (dry run)"
print(f"torch {torch.__version__} | {device} | python {sys.version.split()[0]} | mlperf-logging {version('mlperf_logging', 'mlperf-logging')}"
      f" | nvImageCodec {version('nvidia.nvimgcodec')} | DALI {version('nvidia.dali')}")
PYEOF

# only the files that hold gpu tests: the others import what this machine need not have (psutil, onnx,
# tensorboard), and a module that fails to import stops pytest before any test runs
mapfile -t gpu_files < <(grep -l "mark.gpu" tests/test_*.py)
if [ -n "$DRY_RUN" ]; then  # what can be checked without a GPU: the tests load, the figures' runs run
    timeout 150 "$PY" -m pytest -m gpu --collect-only -q -p no:cacheprovider "${gpu_files[@]}" >"$OUT/gpu_tests.log" 2>&1
    collected_rc=$?
    collected=$(grep -cE '::' "$OUT/gpu_tests.log")
    note "gpu tests: $collected collected (dry run: not run), pytest exit $collected_rc"
    timeout -k 10 "$(budget 300)" "$PY" scripts/gpu_figures.py --out "$OUT/figures" --arch resnet18 --image-size 24 \
        --steps 4 --batch-size 4 --skip compile,ghost-bn,dali --deadline-s 240 >"$OUT/gpu_figures.log" 2>&1
    runs_rc=$?
    grep -v '^{' "$OUT/gpu_figures.log" | tail -n 30 | tee -a "$figures"
    if [ "$collected_rc" -ne 0 ] || [ "$collected" -eq 0 ] || [ "$runs_rc" -ne 0 ]; then
        note "gpu_check: dry run FAIL (tests $([ "$collected_rc" -eq 0 ] && echo collected || echo "not collected: $OUT/gpu_tests.log"), figures $([ "$runs_rc" -eq 0 ] && echo ok || echo "failed: $OUT/gpu_figures.log")) after ${SECONDS} s"
        exit 1
    fi
    note "gpu_check: dry run ok after ${SECONDS} s (no GPU: nothing was measured)"
    exit 0
fi

# The gpu tests, one line each in the figures from pytest's JUnit report.
junit="$OUT/gpu_tests.xml"
rm -f "$junit"
timeout -k 10 "$(budget 150)" "$PY" -m pytest -m gpu -rA -p no:cacheprovider --junitxml="$junit" "${gpu_files[@]}" \
    >"$OUT/gpu_tests.log" 2>&1
pytest_rc=$?
report_tests "$junit" | tee -a "$figures"
tests_rc=${PIPESTATUS[0]}
if [ "$pytest_rc" -ne 0 ]; then
    note "pytest exited $pytest_rc$(case $pytest_rc in 124 | 137) echo ' (timed out)' ;; esac); its output: $OUT/gpu_tests.log"
    tests_rc=1
fi

# the figures: every run in one process (scripts/gpu_figures.py), stopped in time for the summary
runs_rc=0
figures_left=$(budget 400)
if [ "$figures_left" -lt 60 ]; then
    note "gpu figures: not run, the 8-minute budget is spent"
    runs_rc=1
else
    timeout -k 10 "$figures_left" "$PY" scripts/gpu_figures.py --out "$OUT/figures" --deadline-s $((figures_left - 60)) \
        >"$OUT/gpu_figures.log" 2>&1
    runs_rc=$?
    grep -v '^{' "$OUT/gpu_figures.log" | tail -n 30 | tee -a "$figures"
    cp "$OUT/figures/gpu_figures.json" "$OUT/gpu_figures.json" 2>/dev/null || { note "gpu figures: no JSON written"; runs_rc=1; }
fi
"$PY" - "$OUT/gpu_figures.json" >"$OUT/gpu_calibration.yaml" 2>/dev/null <<'PYEOF'
import json, sys, datetime
figures = json.load(open(sys.argv[1]))
gpu = next((g for g in ("h200", "h100", "a100", "v100") if g in figures["gpu"].lower()), "unknown")
run = next(r for r in figures["runs"] if r["run"] == "synthetic " + figures["default_precision"] and "img_per_s" in r)
print(f"measured:  # scripts/gpu_check.sh {datetime.date.today()} on {figures['gpu']}; into train/plan/calibration.yaml")
print(f"  - {{gpu: {gpu}, per_gpu_batch: {run['batch']}, img_per_s: {run['img_per_s']}, "
      f"source: \"gpu_check {datetime.date.today()}, {figures['default_precision']}\"}}")
PYEOF

if [ "$tests_rc" -ne 0 ] || [ "$runs_rc" -ne 0 ]; then
    note "gpu_check: FAIL (tests $([ "$tests_rc" -eq 0 ] && echo ok || echo failed), figures $([ "$runs_rc" -eq 0 ] && echo ok || echo "failed: $OUT/gpu_figures.log")) after ${SECONDS} s"
    exit 1
fi
note "gpu_check: ok after ${SECONDS} s"
