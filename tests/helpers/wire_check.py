"""Run under a launcher with 4 processes (argv: ENGINE OUT_DIR; torchrun or horovodrun --gloo): the
--fp16-allreduce wire of every all-reduce of the engine (flat, and as 2 nodes of 2 ranks hierarchical
and torus), in a bf16 run and in an fp32 run, through engine.wrap(), against the exact mean (float64)
of the gradients each rank sends:

- bf16 run: gradients of about 1e-20 and 1e20 (fp16 would flush the first to zero, and overflow on the
  second);
- fp32 run (the fp16 wire): gradients of up to 3e4 (four of them sum past fp16's 65504) and of about
  1e-4 (subnormal in fp16 once divided by the rank count before the sum).

Then (torch.distributed) the timeouts of the process groups this rank belongs to, as torch reports
them: the world's, the two-level all-reduces' and a BatchNorm span group's. Each rank writes OUT_DIR/rank<r>.json.
"""
import dataclasses
import json
import sys
from pathlib import Path

import torch

from train.config import Config
from train.engines import create

ELEMENTS = 16  # per kind of gradient; the kinds alternate, so both torus halves carry both


class Gradients(torch.nn.Module):
    """One parameter whose gradient is the input: (weight * x).sum()."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(2 * ELEMENTS))

    def forward(self, x):
        return (self.weight * x).sum()


def sent(kinds: tuple[float, float], rank: int) -> torch.Tensor:
    """This rank's gradients (float64): the two kinds alternating, a little different on every rank and
    element, none above the kind's magnitude."""
    i = torch.arange(ELEMENTS, dtype=torch.float64)
    spread = 1 - 0.03 * ((i + rank) % 5)
    return torch.stack([kinds[0] * spread, kinds[1] * spread.flip(0)], 1).reshape(-1)


def averaged(engine, precision: str, allreduce: str, kinds: tuple[float, float]) -> tuple[torch.Tensor, str | None]:
    engine.cfg = dataclasses.replace(engine.cfg, precision=precision, allreduce=allreduce, fp16_allreduce=True)
    model = Gradients()
    model, optimizer = engine.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model(sent(kinds, engine.rank).float()).backward()
    if hasattr(optimizer, "synchronize"):  # Horovod averages in its optimizer
        optimizer.synchronize()
    return engine.unwrap(model).weight.grad.detach().double(), engine.wire_note


CASES = {"bf16": ("bf16", (1e-20, 1e20)), "fp16": ("fp32", (3e4, 1e-4))}  # wire: (precision, kinds)


def main():
    engine_name, out_dir = sys.argv[1], Path(sys.argv[2])
    engine = create(Config(engine=engine_name, ranks_per_node=2))
    assert engine.world_size == 4 and engine.nodes == 2
    result = {"rank": engine.rank, "cases": {}}
    for wire, (precision, kinds) in CASES.items():
        exact = sum(sent(kinds, rank).float().double() for rank in range(engine.world_size)) / engine.world_size
        for allreduce in ("flat", "hierarchical", "torus"):
            got, note = averaged(engine, precision, allreduce, kinds)
            error = ((got - exact).abs() / exact.abs()).view(ELEMENTS, 2).amax(0)  # per kind
            result["cases"][f"{wire} {allreduce}"] = {"finite": bool(got.isfinite().all()), "note": note,
                                                       "relative_error": error.tolist()}
    if engine_name == "torch":
        engine.sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm2d(2)), span=4)  # a span group of its own
        dist = engine.dist
        everyone = [dist.group.WORLD, *engine._groups.values()]
        mine = [group for group in everyone if group != dist.GroupMember.NON_GROUP_MEMBER]
        result["groups"] = len(mine)
        result["group_timeouts_s"] = sorted({group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                                             for group in mine})
    (out_dir / f"rank{engine.rank}.json").write_text(json.dumps(result))
    engine.shutdown()


if __name__ == "__main__":
    main()
