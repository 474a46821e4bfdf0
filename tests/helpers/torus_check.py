"""Run under a launcher (torchrun / horovodrun) with 4 or 6 processes and --ranks-per-node 2
(argv: ENGINE OUT_DIR ROWS[,ROWS...]): averages the same rank-dependent gradients of a tiny model
through engine.wrap() with --allreduce flat, hierarchical, and torus with each --torus-rows given,
and writes OUT_DIR/rank<r>.json: the largest per-tensor relative difference of each torus result
from flat and from hierarchical, and, for every torus run, the collectives this rank issued during
the averaging, in order, with the ranks of each one's group and every wait (recorded by a stand-in
for torch.distributed / horovod.torch on the engine)."""
import dataclasses
import json
import sys
from pathlib import Path

import torch

from train.config import Config
from train.engines import create

COLLECTIVES = {"all_to_all_single": "all_to_all", "reduce_scatter_single": "reduce_scatter",
               "reduce_scatter_tensor": "reduce_scatter",
               "all_reduce": "all_reduce", "all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
               "allreduce_async": "all_reduce", "allreduce_async_": "all_reduce",
               "allgather_async": "all_gather"}  # Horovod's async calls


class Recorder:
    """Stands in for the engine's torch.distributed or horovod.torch module: forwards every call and
    records each collective (its kind, its group's ranks) and each wait (torch.distributed: each
    work waited on or chained on; Horovod: each synchronize), while `events` is a list."""

    def __init__(self, inner, engine_name: str):
        self._inner, self._engine_name, self.events = inner, engine_name, None

    def _ranks(self, kwargs) -> list[int]:
        if self._engine_name == "torch":
            return list(self._inner.get_process_group_ranks(kwargs["group"]))
        return list(kwargs["process_set"].ranks)

    def __getattr__(self, name):
        value = getattr(self._inner, name)
        if self.events is None:
            return value
        if name in COLLECTIVES:
            def issue(*args, **kwargs):
                self.events.append([COLLECTIVES[name], self._ranks(kwargs)])
                work = value(*args, **kwargs)
                return Waited(work, self.events) if kwargs.get("async_op") else work
            return issue
        if name == "synchronize":  # Horovod's wait
            def wait(handle):
                self.events.append(["wait"])
                return value(handle)
            return wait
        return value


class Waited:
    """A collective's work: waiting on it, or chaining on its future (the DDP hook does not wait, it
    chains the next step on the step's futures), is recorded as its wait."""

    def __init__(self, work, events):
        self.work, self.events = work, events

    def wait(self):
        self.events.append(["wait"])
        return self.work.wait()

    def get_future(self):
        self.events.append(["wait"])
        return self.work.get_future()


def tiny_model():
    torch.manual_seed(0)
    # 285 gradient elements: odd, so the torus halves differ in size and need padding
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 5))


def averaged_gradients(engine, recorder, **settings) -> tuple[list[torch.Tensor], list]:
    engine.cfg = dataclasses.replace(engine.cfg, **settings)
    model = tiny_model()
    model, optimizer = engine.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    recorder.events = []
    images = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(100 + engine.rank))  # per rank
    model(images).square().mean().backward()
    if hasattr(optimizer, "synchronize"):  # Horovod averages in its optimizer
        optimizer.synchronize()
    events, recorder.events = recorder.events, None
    return [p.grad.detach().clone() for p in model.parameters()], events


def worst(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Largest per-element difference relative to the tensor's scale (its largest magnitude)."""
    return max(((x - y).abs().max() / y.abs().max().clamp_min(1e-12)).item() for x, y in zip(a, b))


def main():
    engine_name, out_dir, rows_list = sys.argv[1], Path(sys.argv[2]), [int(r) for r in sys.argv[3].split(",")]
    engine = create(Config(engine=engine_name, ranks_per_node=2))
    recorder = Recorder(engine.dist if engine_name == "torch" else engine.hvd, engine_name)
    if engine_name == "torch":
        engine.dist = recorder
    else:
        engine.hvd = recorder
    flat, _ = averaged_gradients(engine, recorder, allreduce="flat")
    hierarchical, _ = averaged_gradients(engine, recorder, allreduce="hierarchical")
    result = {"rank": engine.rank, "hierarchical_vs_flat": worst(hierarchical, flat), "torus": {}}
    for rows in rows_list:
        torus, events = averaged_gradients(engine, recorder, allreduce="torus", torus_rows=rows)
        result["torus"][rows] = {"vs_flat": worst(torus, flat), "vs_hierarchical": worst(torus, hierarchical),
                                 "events": events}
    # the average must really mix ranks: compare with this rank's own, unaveraged gradient
    model = tiny_model()
    images = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(100 + engine.rank))
    model(images).square().mean().backward()
    result["local_gap"] = worst([p.grad for p in model.parameters()], flat)
    (out_dir / f"rank{engine.rank}.json").write_text(json.dumps(result))
    engine.shutdown()


if __name__ == "__main__":
    main()
