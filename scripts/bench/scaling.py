"""Weak-scaling efficiency on this machine: 2 ranks x 1 thread against 1 rank x 1 thread, the same
per-rank batch, ResNet-50 at a small image size, synthetic data; for each engine, flat and
hierarchical all-reduce. efficiency = (2-rank images/s) / (2 x 1-rank images/s).
Then the all-reduce algorithms side by side: 4 ranks x 1 thread as a 2 x 2 grid (--ranks-per-node 2,
--torus-rows 2), flat, hierarchical and torus, each as images/s relative to flat in the same run
(--four-ranks 0 skips it; with more ranks than cores they compete for the CPU, so the figures show
the algorithms' overheads on this machine, not a network's).
Runs the real launchers (torchrun, horovodrun). Last line: `scaling: MIN_FLAT (goal >= 0.90)`.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def steady_images_per_s(run_dir: Path) -> float:
    windows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    windows = [w for w in windows if w["kind"] == "train"]
    first, last = windows[0], windows[-1]  # the first window holds start-up
    return (last["images"] - first["images"]) / (last["seconds"] - first["seconds"])


def run(engine: str, nproc: int, allreduce: str, args, out: Path, ranks_per_node: int = 1) -> float:
    train = ["-m", "train", "--out-dir", str(out), "--engine", engine, "--loader", "synthetic", "--arch", args.arch,
             "--image-size", str(args.image_size), "--batch-size", str(args.batch_size), "--global-batch-size", "0",
             "--synthetic-images", str(args.batch_size * nproc * (args.steps + 2)), "--max-steps", str(args.steps),
             "--log-every", str(args.window), "--eval-every", "0", "--precision", "fp32",
             "--allreduce", allreduce, "--ranks-per-node", str(ranks_per_node), "--torus-rows", str(ranks_per_node),
             "--bn-span", str(args.bn_span if nproc % args.bn_span == 0 else 1)]
    if engine == "torch":
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), *train]
    elif engine == "horovod":
        command = [str(BIN / "horovodrun"), "-np", str(nproc), "-H", f"localhost:{nproc}", "--gloo", sys.executable, *train]
    else:
        command = [sys.executable, *train]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return steady_images_per_s(out)


def compare_on_four_ranks(args, tmp: Path) -> None:
    """4 ranks x 1 thread as 2 x 2: each algorithm's images/s relative to flat's, per engine; with
    --repeats R, R rounds of flat, hierarchical, torus in turn, each ratio against its own round's
    flat (this machine's speed drifts more between minutes than within one), and their median."""
    import statistics
    for engine in args.engines.split(","):
        ratios = {"hierarchical": [], "torus": []}
        for repeat in range(args.repeats):
            flat = run(engine, 4, "flat", args, tmp / f"four-{engine}-flat-{repeat}", ranks_per_node=2)
            for allreduce in ratios:
                rate = run(engine, 4, allreduce, args, tmp / f"four-{engine}-{allreduce}-{repeat}", ranks_per_node=2)
                ratios[allreduce].append(rate / flat)
            print(f"4 ranks x 1 thread (2 x 2), {engine:7s} round {repeat + 1}: flat {flat:.1f} img/s, "
                  + ", ".join(f"{name} {r[-1]:.3f} x flat" for name, r in ratios.items()), flush=True)
        for name, r in ratios.items():
            print(f"4 ranks x 1 thread (2 x 2), {engine:7s} {name:12s}: {statistics.median(r):.3f} x flat "
                  f"(median of {len(r)})")


def weak_scaling(args, tmp: Path) -> list[float]:
    """1 rank, then 2 ranks per engine and all-reduce: prints each; returns the flat efficiencies."""
    single = run("none", 1, "flat", args, tmp / "single")
    print(f"1 rank x 1 thread: {single:.1f} img/s")
    flat = []
    for engine in ("torch", "horovod"):
        for allreduce in ("flat", "hierarchical"):
            rate = run(engine, 2, allreduce, args, tmp / f"{engine}-{allreduce}")
            efficiency = rate / (2 * single)
            if allreduce == "flat":
                flat.append(efficiency)
            print(f"2 ranks x 1 thread, {engine:7s} {allreduce:12s}: {rate:.1f} img/s, efficiency {efficiency:.3f}")
    return flat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=48, help="per rank")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--window", type=int, default=3, help="steps per logging window; the first is warm-up")
    parser.add_argument("--four-ranks", type=int, default=1, help="1: also compare the all-reduce algorithms on 2 x 2 ranks")
    parser.add_argument("--two-ranks", type=int, default=1, help="0: skip the weak-scaling part (and its last line)")
    parser.add_argument("--engines", default="torch,horovod", help="the engines of the 4-rank comparison")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of the 4-rank comparison (median)")
    parser.add_argument("--bn-span", type=int, default=1, help="BatchNorm statistics over this many ranks (1: each its own)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        flat = weak_scaling(args, Path(tmp)) if args.two_ranks else []
        if args.four_ranks:
            compare_on_four_ranks(args, Path(tmp))
    print(f"{args.arch} {args.image_size}px, batch {args.batch_size} per rank, {args.steps} steps, bn span {args.bn_span}")
    if flat:
        print(f"scaling: {min(flat):.3f} (goal >= 0.90)")


if __name__ == "__main__":
    main()
