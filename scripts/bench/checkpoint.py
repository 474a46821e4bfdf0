"""What a checkpoint costs the training steps it overlaps: the trainer itself (`python -m train`'s
loop, --loader synthetic, ResNet-50 at 64 px, batch 32, fp32 on the CPU) with --checkpoint-every-steps
and --log-every 1, so that metrics.jsonl times every step and every checkpoint (its copy to host
memory on the training thread, then its write in the background).

A step overlaps a checkpoint when its time span meets [copy start, write end]; the first steps
(warm-up) are left out. RATIO = the slowest overlapping step / the median step that overlaps none,
in the same run. A synchronous write would add the whole write to one step.
With --repeats N the run is made N times, each in a fresh process, and the last line gives the
median of the N ratios, with the machine's load average before and after (other work on the cores
shows in the ratio). Last line: `checkpoint_stall: RATIO (goal <= 1.5)`.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from train.config import Config  # noqa: E402
from train.loop import run  # noqa: E402
from train.rundir import RunDir  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=8, help="--checkpoint-every-steps")
    parser.add_argument("--warmup", type=int, default=4, help="first steps left out")
    parser.add_argument("--repeats", type=int, default=1, help="runs; the last line gives the median ratio")
    args = parser.parse_args()
    if args.repeats == 1:
        print(f"checkpoint_stall: {one_run(args):.3f} (goal <= 1.5)")
        return
    load_before, ratios = os.getloadavg()[0], []
    for _ in range(args.repeats):  # each run in a fresh process, as a real run starts (no warm allocator or caches)
        argv = [f"--{name.replace('_', '-')}={value}" for name, value in vars(args).items() if name != "repeats"]
        done = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, check=True)
        print("\n".join(line for line in done.stdout.splitlines() if line.startswith(("checkpoint at", args.arch))))
        ratios.append(float(done.stdout.split("checkpoint_stall: ")[-1].split()[0]))
    print(f"ratios: {', '.join(f'{r:.3f}' for r in ratios)}; load average (1 min) {load_before:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after")
    print(f"checkpoint_stall: {statistics.median(ratios):.3f} (goal <= 1.5)")


def one_run(args) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Config(loader="synthetic", arch=args.arch, image_size=args.image_size, batch_size=args.batch_size,
                     synthetic_images=args.batch_size * (args.steps + 1), synthetic_classes=1000, epochs=1,
                     max_steps=args.steps, log_every=1, eval_every=0, checkpoint_every_steps=args.every,
                     out_dir=str(Path(tmp) / "run"), precision="fp32", lr=5.0, warmup_epochs=0.1)
        run(cfg)
        records = [json.loads(line) for line in RunDir(Path(tmp) / "run").metrics.read_text().splitlines()]
    # each step's span: it ended when it was logged and lasted batch / img_per_s
    steps = {r["step"]: (r["time"] - args.batch_size / r["img_per_s"], r["time"])
             for r in records if r["kind"] == "train" and r["step"] > args.warmup}
    writes = [(c["started"] - c["copy_s"], c["started"] + c["write_s"], c)
              for c in records if c["kind"] == "checkpoint" and c["step"] < args.steps]  # (the last one waits)
    overlapping = {step for step, (start, end) in steps.items() for first, last, _ in writes if start < last and end > first}
    durations = {step: end - start for step, (start, end) in steps.items()}
    plain = statistics.median(d for step, d in durations.items() if step not in overlapping)
    for first, last, c in writes:
        hit = sorted(step for step in overlapping if steps[step][0] < last and steps[step][1] > first)
        print(f"checkpoint at step {c['step']}: copy {c['copy_s']:.3f} s, background write {c['write_s']:.3f} s, "
              f"overlapping steps {hit}: {', '.join(f'{durations[s]:.3f}' for s in hit)} s")
    slowest = max(durations[step] for step in overlapping)
    noise = max(d for step, d in durations.items() if step not in overlapping)  # what a busy machine adds alone
    print(f"{args.arch} {args.image_size}px batch {args.batch_size}, {torch.get_num_threads()} threads, "
          f"{len(steps)} steps: median step without a checkpoint {plain:.3f} s (slowest {noise:.3f} s), "
          f"slowest with one {slowest:.3f} s")
    return slowest / plain


if __name__ == "__main__":
    main()
