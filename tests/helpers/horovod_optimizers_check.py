"""Run under horovodrun with 2 processes (argv: OUT_DIR): every optimizer and its options through the
Horovod engine's wrap() and step(), against the same optimizer as one process steps it
(train/engines/single.py: precision.backward, then precision.step) but on gradients averaged here by
hand, in lockstep from the same weights and batches: resnet18 at 16 px, a few steps. With 2 ranks the sum of
two numbers has one order, so the two must agree bit for bit. Then one step under torch.profiler, for
the names of the step's ranges. Each rank writes OUT_DIR/rank<r>.json: per configuration the largest
difference of the weights after the steps, how many tensors moved, whether torch.compile
compiled anything, the loss scales; and the profiled ranges.
"""
import copy
import dataclasses
import json
import sys
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from models import build_model
from train.config import Config
from train.engines import create
from train.optim import build_optimizer
from train.precision import Precision

PER_RANK, SIZE, STEPS, CLASSES = 4, 16, 2, 10
BASE = Config(engine="horovod", arch="resnet18", label_smoothing=0.1, weight_decay=5e-5)
OPTIMIZERS = [("lars", dict(optimizer="lars", lr=1.0)),
              ("lars-compile", dict(optimizer="lars", lr=1.0, lars_compile=True)),
              ("sgd", dict(optimizer="sgd", lr=0.05)),
              ("sgd-nesterov", dict(optimizer="sgd", lr=0.05, nesterov=True)),
              ("rmsprop-warmup", dict(optimizer="rmsprop-warmup", lr=0.05, rmsprop_lr_ratio=0.5))]
# every optimizer in fp32 on Horovod's average, and in fp16 loss scaling (TRAINER_ALLOW_CPU_FP16) on
# --fp16-allreduce's wire
CONFIGURATIONS = [(f"{name}-{way}", dict(settings, **extra)) for name, settings in OPTIMIZERS
                  for way, extra in (("fp32", dict(precision="fp32")),
                                     ("fp16-wire", dict(precision="fp16", fp16_allreduce=True)))]


def batches(rank: int):
    """This rank's images and labels for every step."""
    generator = torch.Generator().manual_seed(7 + rank)
    for _ in range(STEPS):
        images = torch.randn(PER_RANK, 3, SIZE, SIZE, generator=generator).contiguous(memory_format=torch.channels_last)
        yield images, torch.randint(0, CLASSES, (PER_RANK,), generator=generator)


def averaged_by_hand(engine, cfg: Config, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The mean over the ranks of each gradient, as docs/allreduce.md says each wire takes it: fp32,
    the sum / p; --fp16-allreduce on p = 2 ranks (k = 0: x 1 into fp16), the fp16 sum back in fp32 / 2.
    (All in one message: one collective per step.)"""
    flat = torch.cat([g.reshape(-1) for g in grads])
    if cfg.fp16_allreduce:
        assert engine.world_size == 2
        mean = engine.all_reduce_sum(flat.half()).float() / 2
    else:
        mean = engine.all_reduce_sum(flat) / engine.world_size
    return [piece.view(g.shape) for piece, g in zip(mean.split([g.numel() for g in grads]), grads)]


def lockstep(engine, cfg: Config) -> dict:
    """The same model trained twice, side by side: by the engine, and by hand as one process steps it
    (train/engines/single.py) but on gradients averaged by hand. The weights' largest difference, how
    many tensors training moved, the loss scales, and whether torch.compile compiled anything."""
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.arch, CLASSES, cfg.zero_init_residual, cfg.channels_last)
    by_hand = copy.deepcopy(model)
    start = [p.detach().clone() for p in model.parameters()]
    model, optimizer = engine.wrap(model, build_optimizer(cfg, model))
    hand_optimizer = build_optimizer(cfg, by_hand)
    precision, hand_precision = Precision(cfg.precision, engine.device), Precision(cfg.precision, engine.device)
    for prec in (precision, hand_precision) if precision.scaler else ():
        # loss-scaled gradients of a few hundred: Horovod 0.28.1's fp16 sum on CPU drops one of the two
        # numbers in about 1 of 2,000 sums between 8,192 and 32,768 (docs/allreduce.md)
        prec.load_state_dict({**prec.state_dict(), "scale": 2.0 ** 8})
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
    counters.clear()  # (a graph compiled by an earlier configuration is not compiled again)
    for step, (images, labels) in enumerate(batches(engine.rank)):
        settings = {"lr": cfg.lr, **({"sgd_share": 0.5} if cfg.optimizer == "rmsprop-warmup" else {})}
        for opt in (optimizer, hand_optimizer):
            for group in opt.param_groups:  # as the loop applies its schedule
                group.update(settings)
        with precision.autocast():
            loss = criterion(model(images), labels)
        engine.step(loss, optimizer, precision)
        optimizer.zero_grad()
        if step == 0:  # (before the hand's first step, which compiles too)
            compiled = counters["stats"]["unique_graphs"] > 0
        with hand_precision.autocast():
            loss = criterion(by_hand(images), labels)
        hand_precision.backward(loss)
        grads = [p.grad for p in by_hand.parameters()]
        for grad, mean in zip(grads, averaged_by_hand(engine, cfg, grads)):
            grad.copy_(mean)
        hand_precision.step(hand_optimizer)
        hand_optimizer.zero_grad()
    weights = [p.detach() for p in engine.unwrap(model).parameters()]
    return {"difference": max((a - b).abs().max().item() for a, b in zip(weights, by_hand.parameters())),
            "moved": sum(not torch.equal(a, s) for a, s in zip(by_hand.parameters(), start)),
            "compiled": compiled,
            "loss_scales": [precision.log_fields().get("loss_scale"), hand_precision.log_fields().get("loss_scale")]}


def profiled_ranges(engine) -> list[str]:
    """The named ranges of one Horovod step, in the order they started."""
    cfg = dataclasses.replace(BASE, optimizer="sgd", lr=0.05)
    model = build_model(cfg.arch, CLASSES, cfg.zero_init_residual, cfg.channels_last)
    model, optimizer = engine.wrap(model, build_optimizer(cfg, model))
    images, labels = next(batches(engine.rank))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        engine.step(torch.nn.functional.cross_entropy(model(images), labels), optimizer, Precision("fp32", engine.device))
    named = [e for e in profile.events() if e.name in ("backward", "all-reduce", "optimizer")]
    return [e.name for e in sorted(named, key=lambda e: e.time_range.start)]


def main():
    out_dir = Path(sys.argv[1])
    engine = create(BASE)
    result = {"rank": engine.rank, "configurations": {}}
    for name, settings in CONFIGURATIONS:
        engine.cfg = dataclasses.replace(BASE, **settings)  # (the engine reads the wire from its settings)
        result["configurations"][name] = lockstep(engine, engine.cfg)
    result["ranges"] = profiled_ranges(engine)
    (out_dir / f"rank{engine.rank}.json").write_text(json.dumps(result))
    engine.shutdown()


if __name__ == "__main__":
    main()
