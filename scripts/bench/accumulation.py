"""Images/s of an optimizer step that accumulates the gradients of N batches (--accumulation-steps 4)
over the images/s of a plain step (N = 1) at the same per-rank batch, one rank.

Each variant is the trainer's own Training (train/loop.py), built by start-up from a Config with
synthetic data, stepped with Training.train_step: the plain one on one fixed batch, the accumulating
one on N fixed batches of the same size (N - 1 forward and backward passes whose gradients add up,
then the last pass, the engine's step and the update; BatchNorm's running statistics once per step).
A step of N batches trains N times the images, so the same images/s means the accumulating step
costs nothing beyond its passes: what it may add is the loss division per pass, the running
statistics' bookkeeping and the update's share, which a plain step pays once per batch.

After --warmup untimed steps of each, --repeats blocks (3: the figure is their median); in a block
the variants take --steps steps in turn, one step each, a different one first each time (a change of
the machine's load touches both alike), each step timed alone (on CUDA: synchronised). A block's
images/s of a variant is its images over its summed step times; the block's ratio is the accumulating
variant's images/s over the plain one's. --quick: resnet18 at 32 px, batch 8, 2 steps a block: a
smoke check that the script runs, not a measurement.
--device cuda (the default where there is a GPU): ResNet-50 at 224 px, batch 256, the run's precision.
--report FILE: the figures as JSON. Last line: `accumulation_ratio: RATIO (goal >= 0.97)`.
"""
import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from train.config import Config
from train.loop import Training
from train.startup import prepare


def training(cfg: Config, out_dir: Path) -> Training:
    setup = prepare(dataclasses.replace(cfg, out_dir=str(out_dir)))
    setup.lock.release()  # (nothing else uses the directory)
    return Training(setup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu",
                        help="the trainer's device (CUDA when there is one; CUDA_VISIBLE_DEVICES= for the CPU)")
    parser.add_argument("--arch", help="default: resnet50 (resnet18 with --quick)")
    parser.add_argument("--image-size", type=int, help="default: 64 on CPU, 224 on CUDA (32 with --quick)")
    parser.add_argument("--batch-size", type=int, help="per-rank batch of both variants; default: 32 on CPU, 256 on "
                                                       "CUDA (8 with --quick)")
    parser.add_argument("--accumulation-steps", type=int, default=4,
                        help="N, the accumulating variant's batches per step")
    parser.add_argument("--threads", type=int, default=2, help="compute threads (CPU)")
    parser.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16", "fp16"),
                        help="as python -m train's (auto: bf16 from A100 on, fp16 on V100, fp32 on CPU)")
    parser.add_argument("--steps", type=int, help="timed steps of each variant per block (default 10; 2 with --quick)")
    parser.add_argument("--warmup", type=int, help="untimed steps of each variant first (default 3; 1 with --quick)")
    parser.add_argument("--repeats", type=int, default=3, help="blocks; the ratio is their median")
    parser.add_argument("--quick", action="store_true",
                        help="the smallest run: resnet18, 32 px, batch 8, 2 steps a block")
    parser.add_argument("--report", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    arch = args.arch or ("resnet18" if args.quick else "resnet50")
    size = args.image_size or (32 if args.quick else 224 if cuda else 64)
    batch = args.batch_size or (8 if args.quick else 256 if cuda else 32)
    steps = args.steps or (2 if args.quick else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    n = args.accumulation_steps
    if n < 2 or batch < 1 or steps < 1 or args.repeats < 1:
        parser.error("--accumulation-steps must be 2 or more, and --batch-size, --steps and --repeats 1 or more")
    plain = Config(loader="synthetic", arch=arch, image_size=size, batch_size=batch, synthetic_images=batch * n,
                   synthetic_val_images=0, synthetic_classes=1000, epochs=1, eval_every=0, precision=args.precision,
                   threads=args.threads, save_checkpoints=False, tensorboard=False)
    accumulating = dataclasses.replace(plain, accumulation_steps=n)
    with tempfile.TemporaryDirectory() as tmp:
        variants = {"plain": training(plain, Path(tmp) / "plain"),
                    "accumulated": training(accumulating, Path(tmp) / "accumulated")}
        device = variants["plain"].engine.device
        if device.type != args.device:
            raise SystemExit(f"--device {args.device}, but the trainer runs on {device.type}; "
                             "CUDA_VISIBLE_DEVICES= hides the GPUs from it")
        if variants["accumulated"].cfg.accumulation_steps != n:
            raise SystemExit(f"the accumulating variant resolved to {variants['accumulated'].cfg.accumulation_steps} "
                             f"accumulation steps, not {n}")
        torch.manual_seed(0)
        batches = [(torch.randn(batch, 3, size, size, device=device).contiguous(memory_format=torch.channels_last),
                    torch.randint(0, 1000, (batch,), device=device)) for _ in range(n)]
        step_batches = {"plain": batches[:1], "accumulated": batches}

        def timed_step(name: str) -> float:
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            variants[name].train_step(step_batches[name])
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter() - start

        names = list(variants)
        for _ in range(warmup):
            for name in names:
                timed_step(name)
        blocks = []  # per block: {variant: images/s}
        for _ in range(args.repeats):
            seconds = dict.fromkeys(names, 0.0)
            for step in range(steps):
                for name in names[step % 2:] + names[:step % 2]:  # each first in turn
                    seconds[name] += timed_step(name)
            blocks.append({name: steps * batch * len(step_batches[name]) / seconds[name] for name in names})
        for run in variants.values():
            run.writer.join()
            run.log.close()
        precision = variants["plain"].precision.name
    ratios = [block["accumulated"] / block["plain"] for block in blocks]
    rates = {name: statistics.median(block[name] for block in blocks) for name in names}
    ratio = statistics.median(ratios)
    where = torch.cuda.get_device_name(device) if cuda else f"cpu, {torch.get_num_threads()} threads"
    print(f"{arch} at {size} px, batch {batch} per rank, {precision} on {where}; {args.repeats} block(s) of "
          f"{steps} steps each after {warmup} warm-up")
    print(f"images/s (median of the blocks): plain {rates['plain']:.1f}, x {n} accumulated {rates['accumulated']:.1f}"
          f"   (blocks' ratios {', '.join(f'{r:.3f}' for r in ratios)})")
    if args.report:
        Path(args.report).write_text(json.dumps({
            "arch": arch, "image_size": size, "batch_size": batch, "accumulation_steps": n, "precision": precision,
            "device": where, "steps": steps, "warmup": warmup, "repeats": args.repeats,
            "images_per_s_plain": round(rates["plain"], 2), "images_per_s_accumulated": round(rates["accumulated"], 2),
            "ratios": [round(r, 4) for r in ratios], "ratio": round(ratio, 4)}, indent=2) + "\n")
        print(f"report: {args.report}")
    print(f"accumulation_ratio: {ratio:.3f} (goal >= 0.97)")


if __name__ == "__main__":
    main()
