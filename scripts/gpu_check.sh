#!/usr/bin/env bash
# The GPU check: one command for a GPU node (one GPU or more, no network needed) that ends within 5
# minutes: the tests marked `gpu`, then scripts/gpu_figures.py (docs/gpu.md, "The GPU check"): training
# images/s on synthetic data in the default precision, fp16 and fp32, each run under the sync check
# (torch.cuda.set_sync_debug_mode("error") after its third step: a step that waits for the GPU fails
# its run and names the line); a profiler trace of a few ResNet-50 steps and the LARS step's kernel
# count from it; DALI's training rate and its feed alone (`DALI absent` without DALI); where two GPUs
# are visible, a 2-GPU stage under torchrun (scaling and its trace); --compile against eager;
# Horovod's asynchronous completion (`Horovod absent` without Horovod); the planner's images/s beside
# the measured; published anchors. Each figure is printed as it is measured.
# Uses the node's own python3 and torch (PYTHON=... for another). The packages it lacks come from
# .whl/, the wheels folder for nodes without network (an air-gapped cluster's), copied to the node with
# the checkout (scripts/gpu_wheels.sh fills it where PyPI is reachable), and are installed without
# network into the check's temporary folder.
# The runs, their JPEGs and the installed wheels live in a temporary folder removed at the end; the
# output folder ${OUT:-gpu_figures}/ gets at most these 6 files, small enough to copy back from a
# remote node: gpu_figures.txt (what the check printed: one line per gpu test with its outcome, then
# the figures), gpu_figures.json, gpu_calibration.yaml (the default precision's point, in the form of
# train/plan/calibration.yaml's `measured:` list), gpu_tests.xml and gpu_tests.log (pytest's), and
# gpu_trace.json.gz (the kept profiler trace: the 2-GPU stage's rank 0, else one GPU's).
# A gpu test skipped because DALI is not installed is reported as `DALI absent`, never as a pass;
# any other skip fails the check, since CUDA is there.
# Exit: 0 all passed; 1 a gpu test failed or was skipped, or a run failed (its sync check included);
#       2 nothing checked: no CUDA GPU visible, no torch, or mlperf-logging neither there nor in .whl/.
#   bash scripts/gpu_check.sh --report JUNIT.xml   only the per-test report of a pytest JUnit file
#   bash scripts/gpu_check.sh --dry-run            on a machine without a GPU, that the check can run on
#       this python's stack: the same set-up and .whl/ installs, the gpu tests collected (not run), and
#       the figures' runs on the CPU at toy sizes (the DALI and Horovod runs as on a GPU: absent where
#       they are; the 2-GPU stage as 2 CPU processes; --compile left out: it takes minutes on a CPU).
#       tests/test_gpu.py runs it on .venv-device (Python 3.12, torch 2.11 with CUDA 13, numpy, PyYAML:
#       a bare GPU node's stack, made by scripts/test.sh)
set -uo pipefail
PY=${PYTHON:-python3}
DALI_ABSENT="DALI absent"  # the skip reason of tests/test_gpu.py's DALI tests
BUDGET_S=300

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
mkdir -p "$OUT" || exit 2
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || exit 2
trap 'rm -rf "$WORK"' EXIT
# torch.compile's kernel caches stay where torch keeps them (a second check compiles from them); what else
# the runs and launchers leave in temporary folders goes with the check's folder
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-${TMPDIR:-/tmp}/torchinductor_$(id -un)}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-${HOME:-/tmp}/.triton/cache}
mkdir "$WORK/tmp" && export TMPDIR="$WORK/tmp"
figures="$OUT/gpu_figures.txt"
DEADLINE=$((SECONDS + BUDGET_S - 5))  # the whole check, whatever hangs; 5 s for the last lines
budget() { local left=$((DEADLINE - SECONDS)); left=$((left < $1 ? left : $1)); echo $((left > 1 ? left : 1)); }
note() { echo "$*" | tee -a "$figures"; }
fail_setup() { echo "error: $*" | tee -a "$figures" >&2; exit 2; }
echo "# gpu_check $(date -u +%FT%TZ)$([ -n "$DRY_RUN" ] && echo ' (dry run)')" | tee "$figures"
rm -f "$OUT/gpu_figures.json" "$OUT/gpu_calibration.yaml" "$OUT/gpu_tests.xml" "$OUT/gpu_tests.log" "$OUT/gpu_trace.json.gz"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# Without CUDA every gpu test would be skipped: say so and stop, rather than report a pass.
timeout "$(budget 60)" "$PY" -c "
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

# The wheels whose distribution this python lacks, installed without network into the temporary
# folder and put on PYTHONPATH (the tests' child processes keep it after the repository).
shopt -s nullglob
wheels=(.whl/*.whl)
mapfile -t missing < <(timeout "$(budget 60)" "$PY" - "${wheels[@]}" <<'PYEOF'
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
    timeout "$(budget 90)" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --disable-pip-version-check --target "$WORK/site" "${missing[@]}" \
        || fail_setup "could not install ${missing[*]} without network"
    export PYTHONPATH="$PYTHONPATH:$WORK/site"
fi
timeout "$(budget 60)" "$PY" -c "import mlperf_logging" 2>/dev/null \
    || fail_setup "mlperf_logging is missing: run scripts/gpu_wheels.sh where PyPI is reachable and bring .whl/ with the checkout"

timeout "$(budget 60)" "$PY" - 2>>"$WORK/versions.log" <<'PYEOF' | tee -a "$figures"
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
      f" | nvImageCodec {version('nvidia.nvimgcodec')} | DALI {version('nvidia.dali')} | Horovod {version('horovod')}")
PYEOF

# only the files that hold gpu tests: the others import what a GPU node need not have (psutil, onnx,
# tensorboard), and a module that fails to import stops pytest before any test runs
mapfile -t gpu_files < <(grep -l "mark.gpu" tests/test_*.py)
tests_rc=0
if [ -n "$DRY_RUN" ]; then  # without a GPU: the tests load
    timeout "$(budget 60)" "$PY" -m pytest -m gpu --collect-only -q -p no:cacheprovider "${gpu_files[@]}" \
        >"$OUT/gpu_tests.log" 2>&1
    collected_rc=$?
    collected=$(grep -cE '::' "$OUT/gpu_tests.log")
    note "gpu tests: $collected collected (dry run: not run), pytest exit $collected_rc"
    if [ "$collected_rc" -ne 0 ] || [ "$collected" -eq 0 ]; then tests_rc=1; fi
else  # the gpu tests, one line each in the figures from pytest's JUnit report
    junit="$OUT/gpu_tests.xml"
    timeout -k 5 "$(budget 100)" "$PY" -m pytest -m gpu -rA -p no:cacheprovider --junitxml="$junit" \
        --basetemp="$WORK/pytest" "${gpu_files[@]}" >"$OUT/gpu_tests.log" 2>&1
    pytest_rc=$?
    report_tests "$junit" | tee -a "$figures"
    tests_rc=${PIPESTATUS[0]}
    if [ "$pytest_rc" -ne 0 ]; then
        note "pytest exited $pytest_rc$(case $pytest_rc in 124 | 137) echo ' (timed out)' ;; esac); its output: $OUT/gpu_tests.log"
        tests_rc=1
    fi
fi

# the figures, one process, printed as measured; stopped in time for the last lines
if [ -n "$DRY_RUN" ]; then  # toy sizes on the CPU, the same runs but --compile (minutes of compiling on a CPU)
    sizes=(--arch resnet18 --image-size 24 --steps 8 --batch-size 4 --jpegs 64 --two-ranks --skip compile)
else
    sizes=()
fi
figures_left=$(budget 300)
runs_rc=1
if [ "$figures_left" -lt 30 ]; then
    note "gpu figures: not run, the check's $BUDGET_S s are spent"
else
    timeout -k 5 "$figures_left" "$PY" scripts/gpu_figures.py --work "$WORK/figures" --json "$OUT/gpu_figures.json" \
        --trace "$OUT/gpu_trace.json.gz" --calibration "$OUT/gpu_calibration.yaml" --deadline-s $((figures_left - 10)) \
        "${sizes[@]}" 2>"$WORK/figures.log" | tee -a "$figures"
    runs_rc=${PIPESTATUS[0]}
    if [ "$runs_rc" -ne 0 ]; then  # what went wrong, in the table (the log goes with the temporary folder)
        note "gpu figures: exit $runs_rc$(case $runs_rc in 124 | 137) echo ' (timed out)' ;; esac); the end of their log:"
        tail -n 20 "$WORK/figures.log" | sed 's/^/    /' | tee -a "$figures"
    fi
fi

what=$([ -n "$DRY_RUN" ] && echo "dry run " || echo "")
if [ "$tests_rc" -ne 0 ] || [ "$runs_rc" -ne 0 ]; then
    note "gpu_check: ${what}FAIL (tests $([ "$tests_rc" -eq 0 ] && echo ok || echo "failed: $OUT/gpu_tests.log"), figures $([ "$runs_rc" -eq 0 ] && echo ok || echo failed)) after ${SECONDS} s"
    exit 1
fi
note "gpu_check: ${what}ok after ${SECONDS} s$([ -n "$DRY_RUN" ] && echo ' (no GPU: nothing was measured)')"
