"""Run under a launcher with 2 processes (argv: ENGINE OUT_DIR): the engine's fp16 paths on CPU.

1. Gradients sent as fp16 (--fp16-allreduce) against the exact mean of the ranks' own gradients
   (float64), next to the fp32 wire: both ranks' gradients are gathered so the bound is per element.
2. fp16 loss scaling (TRAINER_ALLOW_CPU_FP16=1): rank 1's loss overflows in the first step; every
   rank must skip that step together and halve its scale; the second step moves every rank alike. Once
   over the flat all-reduce, once over the two-level one (its own optimizer wrapper on Horovod).
Each rank writes OUT_DIR/rank<r>.json.
"""
import dataclasses
import json
import sys
from pathlib import Path

import torch

from train.config import Config
from train.engines import create
from train.lars import LARS, decay_param_groups
from train.precision import Precision


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4))


def batch(rank):
    generator = torch.Generator().manual_seed(10 + rank)  # different data on every rank
    return torch.randn(6, 3, 8, 8, generator=generator), torch.randint(0, 4, (6,), generator=generator)


def averaged_gradients(engine, fp16_wire: bool) -> list[torch.Tensor]:
    engine.cfg = dataclasses.replace(engine.cfg, fp16_allreduce=fp16_wire)
    model = small_model()
    model, optimizer = engine.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = batch(engine.rank)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    if hasattr(optimizer, "synchronize"):  # Horovod averages in its optimizer
        optimizer.synchronize()
    return [p.grad.detach().clone() for p in model.parameters()]


def wire_check(engine) -> dict:
    model = small_model()
    x, y = batch(engine.rank)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    local = [p.grad.double() for p in model.parameters()]
    exact = [engine.all_reduce_sum(g.clone()) / engine.world_size for g in local]
    mean_abs = [engine.all_reduce_sum(g.abs()) / engine.world_size for g in local]
    fp32, fp16 = averaged_gradients(engine, False), averaged_gradients(engine, True)
    # fp16 rounds each rank's gradient, the sum and the division: a few units of 2^-11 relative,
    # plus fp16's subnormal spacing (2^-24) for the tiniest values
    excess = max(((b.double() - e).abs() - (2 ** -9 * m + 2 ** -22)).max().item() for b, e, m in zip(fp16, exact, mean_abs))
    return {"fp32_worst": max(((a.double() - e).abs() / m.clamp_min(1e-30)).max().item() for a, e, m in zip(fp32, exact, mean_abs)),
            "fp16_excess_over_bound": excess,
            "fp16_differs_from_fp32": any(not torch.equal(a, b) for a, b in zip(fp32, fp16))}


def loss_scaling_check(engine, allreduce: str = "flat") -> dict:
    engine.cfg = dataclasses.replace(engine.cfg, fp16_allreduce=False, allreduce=allreduce)
    model = small_model()
    model, optimizer = engine.wrap(model, LARS(decay_param_groups(model), lr=0.5, weight_decay=1e-4))
    precision = Precision("fp16", engine.device)
    x, y = batch(engine.rank)

    def step(poison: bool):
        with precision.autocast():
            loss = torch.nn.functional.cross_entropy(model(x), y)
        engine.step(loss * float("inf") if poison else loss, optimizer, precision)
        optimizer.zero_grad()

    start = [p.detach().clone() for p in model.parameters()]
    scale_before = precision.scaler.get_scale()
    step(poison=engine.rank == 1)
    skipped = all(torch.equal(a, p) for a, p in zip(start, model.parameters()))
    scale_after = precision.scaler.get_scale()
    step(poison=False)
    moved = [p.detach() for p in model.parameters()]
    return {"skipped_overflow_step": skipped, "scale_before": scale_before, "scale_after_overflow": scale_after,
            "moved": not all(torch.equal(a, p) for a, p in zip(start, moved)),
            "finite": all(bool(p.isfinite().all()) for p in moved),
            "weights": [p.tolist() for p in moved]}


def main():
    engine_name, out_dir = sys.argv[1], Path(sys.argv[2])
    engine = create(Config(engine=engine_name, precision="fp16"))
    result = {"rank": engine.rank, **wire_check(engine), **loss_scaling_check(engine)}
    # the two-level all-reduce wraps the optimizer (Horovod: TwoLevelHorovodOptimizer), which must hand
    # the scaler's scale and overflow flag on to the optimizer that skips on the device
    engine.cfg = dataclasses.replace(engine.cfg, allreduce="hierarchical")
    result.update({f"two_level_{key}": value for key, value in loss_scaling_check(engine, "hierarchical").items()})
    (out_dir / f"rank{engine.rank}.json").write_text(json.dumps(result))
    engine.shutdown()


if __name__ == "__main__":
    main()
