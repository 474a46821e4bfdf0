"""The trainer's steady-state images/s divided by a bare loop's, measured in the same process.

The trainer runs `python -m train`'s loop with --loader synthetic (data generated on the device
per step) and everything else it does: LR schedule, loss bookkeeping, logging points. The bare
loop is forward, backward and LARS step on one fixed synthetic batch, same model, batch and
threads. The two alternate; each trainer measurement drops its first logging window (warm-up).
Last line: `trainer_overhead: RATIO (goal >= 0.97)`.
"""
import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from models import build_model
from train.config import Config
from train.lars import LARS, decay_param_groups
from train.loop import run
from train.rundir import RunDir


def trainer_images_per_s(args, out_dir: Path) -> float:
    cfg = Config(loader="synthetic", arch=args.arch, image_size=args.image_size, batch_size=args.batch_size,
                 synthetic_images=args.batch_size * (args.steps + args.window), synthetic_classes=1000,
                 epochs=1, max_steps=args.steps + args.window, log_every=args.window, eval_every=0,
                 out_dir=str(out_dir), precision="fp32", lr=5.0, warmup_epochs=0.1)
    run(cfg)
    windows = [json.loads(line) for line in RunDir(out_dir).metrics.read_text().splitlines()]
    windows = [w for w in windows if w["kind"] == "train"]
    first, last = windows[0], windows[-1]  # from the end of the first window to the end
    return (last["images"] - first["images"]) / (last["seconds"] - first["seconds"])


def bare_images_per_s(args) -> float:
    torch.manual_seed(0)
    model = build_model(args.arch, 1000, zero_init_residual=True, channels_last=True)
    optimizer = LARS(decay_param_groups(model), lr=5.0, momentum=0.9, weight_decay=5e-5)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size).contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (args.batch_size,))

    def step():
        loss = criterion(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(args.window):
        step()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    return args.steps * args.batch_size / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20, help="measured steps per run")
    parser.add_argument("--window", type=int, default=5, help="warm-up steps (the trainer's logging window)")
    parser.add_argument("--repeats", type=int, default=3, help="trainer/bare pairs")
    args = parser.parse_args()
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            trainer = trainer_images_per_s(args, Path(tmp) / f"run{i}")
            bare = bare_images_per_s(args)
            ratios.append(trainer / bare)
            print(f"pair {i + 1}: trainer {trainer:.1f} img/s, bare loop {bare:.1f} img/s, ratio {trainer / bare:.3f}")
    print(f"{args.arch} {args.image_size}px batch {args.batch_size}, {torch.get_num_threads()} threads, "
          f"median of {args.repeats} pairs")
    print(f"trainer_overhead: {statistics.median(ratios):.3f} (goal >= 0.97)")


if __name__ == "__main__":
    main()
