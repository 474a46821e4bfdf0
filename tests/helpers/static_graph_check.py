"""Run under torchrun with 2 processes (argv: OUT_DIR), TRAINER_COLLECTIVE_TIMEOUT_S a few seconds:
the torch engine's DDP on gloo with its options as a GPU run takes them (ddp_options), static_graph
forced on against off:

- 3 SGD steps of ResNet-18 at 16 px through engine.wrap and engine.step, for each all-reduce (flat,
  and the two-level hook as hierarchical on one node of 2) and each wire (the gradients' own, and
  --fp16-allreduce's fp16): the weights each ends with, static against not;
- one step under torch.profiler: the names of the ranges it records;
- a compiled model (dynamic=False) whose backward takes longer to compile than the timeout: its
  first steps through engine.step with static_graph on. The backward compiles inside backward, within
  the engine's wait on the gradient all-reduce, where the watchdog would end the rank unless the
  compile does not count (train/engines/distributed.py discount_compiles).

Each rank writes OUT_DIR/rank<r>.json."""
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch._dynamo.backends.common import aot_autograd
from functorch.compile import make_boxed_func

from models import build_model
from train.config import Config
from train.engines import create
from train.precision import Precision

# how long the backward's compile takes: more than the timeout and the watchdog's grace after it (half the timeout)
COMPILE_S = 2 * float(os.environ["TRAINER_COLLECTIVE_TIMEOUT_S"])


def batch(rank: int, step: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * rank + step)
    images = torch.randn(4, 3, size, size, generator=generator).contiguous(memory_format=torch.channels_last)
    return images, torch.randint(0, 10, (4,), generator=generator)


def train(engine, model, steps: int) -> tuple:
    """(the DDP model, its weights after `steps` SGD steps of this rank's batches)."""
    precision = Precision("fp32", engine.device)
    model, optimizer = engine.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for step in range(steps):
        images, labels = batch(engine.rank, step)
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        engine.step(loss, optimizer, precision)
        optimizer.zero_grad()
    return model, [p.detach().clone() for p in engine.unwrap(model).parameters()]


def slow_backward_compiler(graph, inputs):
    time.sleep(COMPILE_S)  # a compile longer than TRAINER_COLLECTIVE_TIMEOUT_S
    return make_boxed_func(graph.forward)


def main(out_dir: Path) -> None:
    engine = create(Config(engine="torch", compile=True))
    assert engine.world_size == 2 and engine.local_size == 2
    result = {"rank": engine.rank, "static_vs_not": {}}
    for allreduce in ("flat", "hierarchical"):
        for wire in (False, True):
            weights = {}
            for static in ("off", "on"):
                engine.cfg = dataclasses.replace(engine.cfg, allreduce=allreduce, fp16_allreduce=wire,
                                                 ddp_static_graph=static)
                torch.manual_seed(0)
                ddp, weights[static] = train(engine, build_model("resnet18", 10), steps=3)
                assert ddp.static_graph == (static == "on")
            # per tensor, the largest difference relative to the tensor's largest value
            differs = max(((on - off).abs().max() / off.abs().max().clamp(min=1e-30)).item()
                          for on, off in zip(weights["on"], weights["off"]))
            result["static_vs_not"][f"{allreduce} {'fp16' if wire else 'own'}"] = differs
    engine.cfg = dataclasses.replace(engine.cfg, allreduce="flat", fp16_allreduce=False, ddp_static_graph="on")
    model = build_model("resnet18", 10)
    model, optimizer = engine.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    images, labels = batch(engine.rank, 0)
    loss = torch.nn.functional.cross_entropy(model(images), labels)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as trace:
        engine.step(loss, optimizer, Precision("fp32", engine.device))
    result["ranges"] = sorted({event.name for event in trace.events() if event.name in ("backward", "optimizer")})
    small = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 10))
    small.compile(dynamic=False, backend=aot_autograd(fw_compiler=lambda graph, _: make_boxed_func(graph.forward),
                                                      bw_compiler=slow_backward_compiler))
    started = time.monotonic()
    train(engine, small, steps=3)
    result["compiled_steps_s"] = time.monotonic() - started
    (out_dir / f"rank{engine.rank}.json").write_text(json.dumps(result))
    engine.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
