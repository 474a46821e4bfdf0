#!/usr/bin/env bash
# GPU checks, for a machine with one CUDA GPU: the tests marked `gpu`, then one-GPU ResNet-50
# training throughput (synthetic loader, 224 px, bf16 and fp16, batch 128 and 256).
# Figures go to ${OUT:-gpu_figures}/gpu_figures.txt. Budget: well under 8 minutes on an H200.
# Uses the machine's python3 (its own torch); mlperf-logging is installed from .whl/ if missing.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
OUT=${OUT:-gpu_figures}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ! "$PY" -c "import mlperf_logging" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
figures="$OUT/gpu_figures.txt"
{
    echo "# gpu_check $(date -u +%FT%TZ)"
    "$PY" -c "import torch; print('torch', torch.__version__, '|', torch.cuda.get_device_name(0))"
} | tee "$figures"

timeout 240 "$PY" -m pytest -q -m gpu tests 2>&1 | tail -n 5 | tee -a "$figures"
tests_rc=${PIPESTATUS[0]}

runs=$(mktemp -d)
for precision in bf16 fp16; do
    for batch in 128 256; do
        timeout 150 "$PY" -m train --out-dir "$runs/$precision-$batch" --loader synthetic --arch resnet50 \
            --image-size 224 --batch-size "$batch" --global-batch-size 0 --precision "$precision" \
            --synthetic-images 10000000 --max-steps 120 --log-every 20 --eval-every 0 --workers 0 \
            >"$runs/$precision-$batch.log" 2>&1 || { echo "run $precision batch $batch failed:"; tail -n 3 "$runs/$precision-$batch.log"; }
        "$PY" - "$runs/$precision-$batch" "$precision" "$batch" <<'PYEOF' | tee -a "$figures"
import json, sys
from pathlib import Path
run_dir, precision, batch = sys.argv[1:]
windows = [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
windows = [w for w in windows if w["kind"] == "train"]
first, last = windows[0], windows[-1]  # the first window holds cuDNN autotuning and warm-up
rate = (last["images"] - first["images"]) / (last["seconds"] - first["seconds"])
print(f"resnet50 224px {precision} batch {batch}: {rate:.0f} img/s (steps {first['step']}-{last['step']})")
PYEOF
    done
done
exit "$tests_rc"
