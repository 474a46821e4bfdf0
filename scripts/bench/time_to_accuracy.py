"""Epochs to a fixed top-1 with and without each epoch-cutting method (docs/time_to_accuracy.md).

Each method is one set of flags on top of a baseline (the smoke preset's recipe: LARS, warmup and
polynomial decay, label smoothing, here on ResNet-18 at 32 px so that a run takes a minute on two
cores). Every (dataset, method, seed) is one real `python -m train` run that evaluates after every
epoch; its epochs to the target are those of its first evaluation at or above it. Reported per
method: the median over the seeds of the epochs to the target (a run that never gets there counts
as one epoch more than the run has), the median final top-1, and the median seconds to the target
(wall time, evaluations included: a machine busy with other work stretches it, not the epochs).

Two datasets: the embedded one (ten colour-and-texture classes, data/embedded.py) and scikit-learn's
handwritten digits (1,797 8x8 greyscale images, ten classes), written here as 48x48 JPEGs in the
ImageNet folder layout, every fifth image of each class held out for validation. (It needs
scikit-learn: `pip install scikit-learn`; the trainer does not.)

    python scripts/bench/time_to_accuracy.py --out /tmp/tta [--datasets embedded,digits]
        [--methods baseline,cosine,...] [--seeds 0,1,2] [--epochs 8] [--table FILE.md]

Last line: `time_to_accuracy: RATIO (goal < 1)`, the median epochs to the target with all of FFCV's
methods together over the baseline's, on the first dataset.
"""
import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BASE = ["--preset", "smoke", "--arch", "resnet18", "--image-size", 32, "--eval-every", 1, "--log-every", 1000,
        "--no-save-checkpoints", "--workers", 2]
# method -> the flags it adds (train 32 px; the evaluation's size and the ramp in multiples of 8)
METHODS = {
    "baseline": [],
    "cosine": ["--lr-schedule", "cosine"],
    "linear": ["--lr-schedule", "linear"],
    "blurpool": ["--blurpool"],
    "ema": ["--ema-decay", 0.97],
    "eval-image-size": ["--eval-image-size", 40],
    "eval-flip": ["--eval-flip"],
    "resolution-schedule": ["--resolution-schedule", "{ramp}"],
    "ffcv": ["--lr-schedule", "linear", "--blurpool", "--resolution-schedule", "{ramp}", "--eval-image-size", 40,
             "--eval-flip"],
}
TARGETS = {"embedded": 0.95, "digits": 0.90}


def ramp(epochs: int) -> str:
    """FFCV's shape at this length: 24 px for the first half, 32 px over the last fifth, steps of 8."""
    return f"24:32:{epochs // 2}:{epochs - max(1, epochs // 5)}:8"


def digits_tree(root: Path) -> Path:
    """scikit-learn's digits as 48x48 greyscale JPEGs (as RGB) in train/<digit>/ and val/<digit>/."""
    if (root / "done").is_file():
        return root
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits
    digits = load_digits()
    seen = {}
    for image, label in zip(digits.images, digits.target):
        seen[label] = seen.get(label, -1) + 1
        split = "val" if seen[label] % 5 == 4 else "train"
        folder = root / split / f"digit{label}"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = (image / 16 * 255).astype(np.uint8)
        Image.fromarray(pixels).resize((48, 48), Image.BICUBIC).convert("RGB").save(folder / f"{seen[label]:03d}.jpg",
                                                                                     quality=95)
    (root / "done").write_text("")
    return root


def one_run(out: Path, data_dir: str, method: str, seed: int, epochs: int) -> dict:
    """The evaluations of one run (top-1 and seconds since its start, per epoch), kept in out."""
    done = out / "evals.json"
    if done.is_file():
        return json.loads(done.read_text())
    flags = [str(f).format(ramp=ramp(epochs)) for f in METHODS[method]]
    command = [sys.executable, "-m", "train", *map(str, BASE), "--epochs", str(epochs), "--seed", str(seed),
               "--out-dir", str(out / "run"), *(["--data-dir", data_dir] if data_dir else []), *flags]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"time_to_accuracy: {' '.join(command)} failed: {result.stderr.strip().splitlines()[-1:]}")
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    started = min(r["time"] for r in records)
    evals = [{"epoch": r["epoch"], "top1": r["top1"], "seconds": round(r["time"] - started, 2)}
             for r in records if r["kind"] == "eval"]
    done.write_text(json.dumps(evals))
    return evals


def to_target(evals: list[dict], target: float, epochs: int) -> tuple[int, float | None]:
    """(epochs to the target, seconds to it): the first evaluation at or above it; epochs + 1 and None
    when none is."""
    first = next((e for e in evals if e["top1"] >= target), None)
    return (first["epoch"], first["seconds"]) if first else (epochs + 1, None)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, metavar="DIR",
                   help="folder for the runs (a run already there is read, not run again)")
    p.add_argument("--datasets", default="embedded,digits", metavar="NAME,...",
                   help=f"datasets, comma-separated, of {', '.join(TARGETS)}; the headline ratio is the first's "
                        "(default: %(default)s)")
    p.add_argument("--methods", default=",".join(METHODS), metavar="NAME,...",
                   help=f"methods, comma-separated, of {', '.join(METHODS)} (default: all)")
    p.add_argument("--seeds", default="0,1,2", metavar="N,...",
                   help="seeds, comma-separated: one run per dataset, method and seed (default: %(default)s)")
    p.add_argument("--epochs", type=int, default=8, metavar="N",
                   help="epochs of each run; one more counts as never reaching the target (default: %(default)s)")
    p.add_argument("--table", metavar="FILE", help="also write the markdown table to this file")
    return p


def main() -> None:
    args = parser().parse_args()
    out, seeds = Path(args.out), [int(s) for s in args.seeds.split(",")]
    lines, headline = [], {}
    for dataset in args.datasets.split(","):
        data_dir = "" if dataset == "embedded" else str(digits_tree(out / "digits-tree"))
        target = TARGETS[dataset]
        lines += [f"{dataset}: epochs to top-1 {target} (median of {len(seeds)} seeds; runs of {args.epochs} epochs, "
                  f"{args.epochs + 1} = not reached)", "",
                  "| method | epochs to target | per seed | final top-1 | seconds to target |", "|---|---|---|---|---|"]
        for method in args.methods.split(","):
            runs = [one_run(out / dataset / method / f"seed{seed}", data_dir, method, seed, args.epochs) for seed in seeds]
            reached = [to_target(evals, target, args.epochs) for evals in runs]
            epochs = statistics.median(e for e, _ in reached)
            seconds = [s for _, s in reached if s is not None]
            headline.setdefault(dataset, {})[method] = epochs
            lines.append(f"| {method} | {epochs:g} | {', '.join(str(e) for e, _ in reached)} | "
                         f"{statistics.median(evals[-1]['top1'] for evals in runs):.4f} | "
                         f"{statistics.median(seconds) if len(seconds) == len(runs) else 'n/a'} |")
            print(lines[-1], flush=True)
        lines.append("")
    if args.table:
        Path(args.table).write_text("\n".join(lines))
    print("\n".join(lines))
    first = headline[args.datasets.split(",")[0]]
    if "ffcv" in first and "baseline" in first:
        print(f"time_to_accuracy: {first['ffcv'] / first['baseline']:.2f} (goal < 1)")


if __name__ == "__main__":
    main()
