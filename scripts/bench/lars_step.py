"""LARS step time / torch.optim.SGD(momentum=0.9, foreach=True) step time on ResNet-50's parameters.

Both optimizers step the same parameters with the same gradients, alternately, many times;
the gradients are restored before every timed step (LARS scales them in place). Prints the
median of each and their ratio; the last line is `lars_step: RATIO (goal <= 1.3)`.
"""
import argparse
import statistics
import time

import torch

from models import build_model
from train.lars import LARS, lars_param_groups


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
    lars = LARS(lars_param_groups(model), lr=5.0, momentum=0.9, weight_decay=5e-5)
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True)

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

    for _ in range(3):  # warm-up: momentum buffers allocated, caches hot
        timed_step(lars), timed_step(sgd)
    lars_times, sgd_times = [], []
    for _ in range(args.steps):
        lars_times.append(timed_step(lars))
        sgd_times.append(timed_step(sgd))
    ratios = [a / b for a, b in zip(lars_times, sgd_times)]
    print(f"device {device}, {sum(p.numel() for p in params):,} parameters, {torch.get_num_threads()} threads")
    print(f"LARS step median {statistics.median(lars_times) * 1e3:.2f} ms, "
          f"SGD(momentum, foreach) median {statistics.median(sgd_times) * 1e3:.2f} ms")
    print(f"lars_step: {statistics.median(ratios):.3f} (goal <= 1.3)")


if __name__ == "__main__":
    main()
