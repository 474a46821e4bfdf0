"""LARS step time / torch.optim.SGD(momentum=0.9, foreach=True) step time on ResNet-50's parameters.

The optimizers (SGD, eager LARS, compiled LARS: --lars-compile) step the same parameters with the
same gradients, in turn, many times; the gradients are restored before every timed step (eager
LARS scales them in place). The compiled step's first call (the compilation; seconds when
Inductor's on-disk cache already has it) is timed apart. Prints each median and the ratios; the
last line is `lars_step: RATIO (goal <= 1.3)` for the compiled step, the eager one's beside it.
"""
import argparse
import statistics
import time

import torch

from models import build_model
from train.lars import LARS, decay_param_groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps of each optimizer")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    model = build_model("resnet50").to(device)
    params = list(model.parameters())
    torch.manual_seed(0)
    grads = [torch.randn_like(p) * 1e-3 for p in params]
    optimizers = {"SGD": torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True),
                  "LARS": LARS(decay_param_groups(model), lr=5.0, momentum=0.9, weight_decay=5e-5),
                  "LARS compiled": LARS(decay_param_groups(model), lr=5.0, momentum=0.9, weight_decay=5e-5,
                                        compiled=True)}

    def timed_step(optimizer) -> float:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    compile_seconds = timed_step(optimizers["LARS compiled"])
    for _ in range(3):  # warm-up: momentum buffers allocated, caches hot
        for optimizer in optimizers.values():
            timed_step(optimizer)
    times = {name: [] for name in optimizers}
    for _ in range(args.steps):
        for name, optimizer in optimizers.items():
            times[name].append(timed_step(optimizer))
    ratio = {name: statistics.median(a / b for a, b in zip(times[name], times["SGD"])) for name in optimizers}
    print(f"device {device}, {sum(p.numel() for p in params):,} parameters, {torch.get_num_threads()} threads; "
          f"compiling the LARS step took {compile_seconds:.1f} s")
    print("   ".join(f"{name} median {statistics.median(t) * 1e3:.2f} ms" for name, t in times.items()))
    print(f"lars_step: {ratio['LARS compiled']:.3f} (goal <= 1.3); eager LARS {ratio['LARS']:.3f}")


if __name__ == "__main__":
    main()
