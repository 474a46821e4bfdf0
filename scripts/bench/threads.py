"""The compute threads' rule (--threads 0, train/startup.py compute_threads) against every thread count
from 1 to the cores: the default run (the `smoke` preset: ResNet-50 at 32 px on the embedded dataset,
the torch loader's --workers decoding beside the training thread) for a few steps per count, in fresh
processes, the counts taking turns. Throughput is the images / seconds of the steps after the first
logging window. `--load N` keeps N busy processes running beside the runs, as a shared machine would.
Last line: `threads: RATIO (goal >= 0.9)` = median img/s with the rule / the best count's median img/s.
"""
import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def img_per_s(threads: int, steps: int, window: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the trainer's rule decides
        env["PYTHONPATH"] = str(REPO)
        subprocess.run([sys.executable, "-m", "train", "--out-dir", f"{tmp}/run", "--max-steps", str(steps),
                        "--log-every", str(window), "--eval-every", "0", "--threads", str(threads), "--no-tensorboard"],
                       cwd=tmp, env=env, check=True, capture_output=True, text=True)
        records = [json.loads(line) for line in Path(tmp, "run", "metrics.jsonl").read_text().splitlines()]
        train = [r for r in records if r["kind"] == "train"]
        first, last = train[0], train[-1]
        return (last["images"] - first["images"]) / (last["seconds"] - first["seconds"])


def busy() -> None:
    while True:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--window", type=int, default=10, help="--log-every; the first window is left out")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--load", type=int, default=0, help="busy processes beside the runs")
    args = parser.parse_args()
    loaders = [multiprocessing.Process(target=busy, daemon=True) for _ in range(args.load)]
    for p in loaders:
        p.start()
    cores = len(os.sched_getaffinity(0))
    counts = [0, *range(1, cores + 1)]  # 0: the rule
    speeds = {count: [] for count in counts}
    try:
        for _ in range(args.repeats):
            for count in counts:
                speeds[count].append(img_per_s(count, args.steps, args.window))
            print(", ".join(f"{count or 'rule'}: {speeds[count][-1]:.1f}" for count in counts), "img/s", flush=True)
    finally:
        for p in loaders:
            p.terminate()
    medians = {count: statistics.median(values) for count, values in speeds.items()}
    best = max((c for c in counts if c), key=medians.get)
    print(f"load: {args.load} busy process(es) on {cores} core(s); medians: "
          + ", ".join(f"{count or 'rule'} {medians[count]:.1f}" for count in counts) + f" img/s; best {best} thread(s)")
    print(f"threads: {medians[0] / medians[best]:.3f} (goal >= 0.9)")


if __name__ == "__main__":
    main()
