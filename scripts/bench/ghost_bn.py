"""The trainer's step with ghost BatchNorm (--bn-group-size: two groups per batch) over its step with
plain BatchNorm2d, one rank.

Each variant is the trainer's own Training (train/loop.py), built by start-up from a Config with
synthetic data, stepped with Training.train_step on one fixed batch: forward, backward, LARS step.
The variants take steps in rounds, one step each, back to back, a different one first in each round
(so a change of the machine's load touches all of a round alike), each step timed alone (on CUDA:
synchronised); the first --warmup rounds are dropped. The ratio is the median over the rounds of a
variant's step time over the plain step's in the same round; the medians of the step times and
their ratio are printed too. With --previous (the default) a third variant runs the implementation
models/batchnorm.py had before its fused kernels, kept here only, so one run gives the old ratio
beside the new under the same load. --span puts a 1-rank BatchNorm span on the ghost variants: the
span's all-reduce (the torch engine's, over a 1-rank process group) runs in every layer, both ways.
--device cuda (the default where there is a GPU): ResNet-50 at 224 px, batch 256.
Last line: `ghost_bn_step_ratio: RATIO (goal <= 1.10)`, the previous implementation's ratio beside it.
"""
import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import torch

from models.batchnorm import GroupBatchNorm2d
from train.config import Config
from train.loop import Training
from train.startup import prepare


class PreviousGroupBatchNorm2d(GroupBatchNorm2d):
    """The forward GroupBatchNorm2d had before the fused kernels: fp32 arithmetic over the whole
    activation, gradients by autograd through it and through the all-reduce."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        n, channels = x.shape[:2]
        size = min(self.ghost, n) if self.ghost else n
        xf = x.float().reshape(n // size, size, *x.shape[1:])
        local = torch.cat([xf.sum(dim=(1, 3, 4)), (xf * xf).sum(dim=(1, 3, 4))], dim=1)
        total = self.all_reduce(local) if self.all_reduce is not None else local
        count = size * x.shape[2] * x.shape[3] * self.span
        mean = total[:, :channels] / count
        var = (total[:, channels:] / count - mean * mean).clamp_min(0)
        with torch.no_grad():
            self.running_mean.lerp_(mean.mean(dim=0), self.momentum)
            self.running_var.lerp_((var * count / max(count - 1, 1)).mean(dim=0), self.momentum)
            self.num_batches_tracked += 1
        inv_std = torch.rsqrt(var + self.eps)
        scale = (self.weight * inv_std)[:, None, :, None, None]
        shift = (self.bias - mean * self.weight * inv_std)[:, None, :, None, None]
        return (xf * scale + shift).reshape(x.shape).to(x.dtype)


def span_all_reduce(device: torch.device, scratch: Path):
    """The torch engine's BatchNorm all-reduce over a 1-rank process group."""
    import torch.distributed as dist
    from train.engines.torch_distributed import TorchDistributed
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{scratch / 'store'}",
                            rank=0, world_size=1)
    return TorchDistributed._differentiable_sum(dist.group.WORLD)


def training(cfg: Config, out_dir: Path, bn_class=None, all_reduce=None) -> Training:
    setup = prepare(dataclasses.replace(cfg, out_dir=str(out_dir)))
    setup.lock.release()  # (nothing else uses the directory)
    run = Training(setup)
    for module in run.model.modules():
        if isinstance(module, GroupBatchNorm2d):
            if bn_class:
                module.__class__ = bn_class
            if all_reduce:
                module.all_reduce = all_reduce
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu",
                        help="the trainer's device (CUDA when there is one; CUDA_VISIBLE_DEVICES= for the CPU)")
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--image-size", type=int, help="default: 64 on CPU, 224 on CUDA")
    parser.add_argument("--batch-size", type=int, help="default: 32 on CPU, the trainer's default (256) on CUDA")
    parser.add_argument("--groups", type=int, default=2, help="ghost groups per batch")
    parser.add_argument("--threads", type=int, default=2, help="compute threads (CPU)")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--steps", type=int, default=15, help="timed rounds (a step of each variant)")
    parser.add_argument("--warmup", type=int, default=3, help="rounds dropped first")
    parser.add_argument("--span", action="store_true", help="a 1-rank BatchNorm span on the ghost variants")
    parser.add_argument("--previous", action=argparse.BooleanOptionalAction, default=True,
                        help="also time the previous implementation")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    batch = args.batch_size or (256 if cuda else 32)
    size = args.image_size or (224 if cuda else 64)
    if batch % args.groups:
        parser.error(f"--groups {args.groups} does not divide the batch of {batch}")
    cfg = Config(loader="synthetic", arch=args.arch, image_size=size, batch_size=batch, synthetic_images=batch,
                 synthetic_classes=1000, epochs=1, eval_every=0, precision=args.precision, threads=args.threads)
    ghost = dataclasses.replace(cfg, bn_group_size=batch // args.groups)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        all_reduce = span_all_reduce(torch.device(args.device), tmp) if args.span else None
        variants = {"plain": training(cfg, tmp / "plain"),
                    "ghost": training(ghost, tmp / "ghost", all_reduce=all_reduce)}
        if args.previous:
            variants["previous"] = training(ghost, tmp / "previous", PreviousGroupBatchNorm2d, all_reduce)
        device = variants["plain"].engine.device
        if device.type != args.device:
            raise SystemExit(f"--device {args.device}, but the trainer runs on {device.type}; "
                             "CUDA_VISIBLE_DEVICES= hides the GPUs from it")
        torch.manual_seed(0)
        images = torch.randn(batch, 3, size, size, device=device).contiguous(memory_format=torch.channels_last)
        labels = torch.randint(0, 1000, (batch,), device=device)

        def timed_step(run: Training) -> float:
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            run.train_step([(images, labels)])
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter() - start

        times = {name: [] for name in variants}
        names = list(variants)
        for step in range(args.warmup + args.steps):
            for name in names[step % len(names):] + names[:step % len(names)]:  # each first in turn
                seconds = timed_step(variants[name])
                if step >= args.warmup:
                    times[name].append(seconds)
        for run in variants.values():
            run.writer.join()
            run.log.close()
    medians = {name: statistics.median(t) for name, t in times.items()}
    ratios = {name: statistics.median(a / b for a, b in zip(t, times["plain"])) for name, t in times.items()}
    print(f"{args.arch} {size}px batch {batch} in {args.groups} ghost groups{', 1-rank span' if args.span else ''}, "
          f"{args.precision}, channels_last, {device}, {torch.get_num_threads()} threads, {args.steps} steps each")
    print("median step: " + "   ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in medians.items()) +
          f"; ratio of the medians {medians['ghost'] / medians['plain']:.3f}")
    previous = f"; previous implementation {ratios['previous']:.3f}" if args.previous else ""
    print(f"ghost_bn_step_ratio: {ratios['ghost']:.3f} (goal <= 1.10){previous}")


if __name__ == "__main__":
    main()
