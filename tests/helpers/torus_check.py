"""Run under a launcher (torchrun / horovodrun) with 4 or 6 processes and --ranks-per-node 2
(argv: ENGINE OUT_DIR ROWS[,ROWS...]): averages the same rank-dependent gradients of a tiny model
through engine.wrap() with --allreduce flat, hierarchical, and torus with each --torus-rows given,
and writes OUT_DIR/rank<r>.json: the largest per-tensor relative difference of each torus result
from flat and from hierarchical; for every path, its largest error against the exact mean (float64)
in units of fp32's rounding bound; for every torus run, the collectives this rank issued during
the averaging, in order, with the ranks of each one's group and every wait (recorded by a stand-in
for torch.distributed / horovod.torch on the engine). On 4 processes (2 x 2) also a few LARS steps of
the trainer's resnet18 in float64, flat against torus: where fp32 training drifts apart by whatever
rounding the steps amplify (docs/allreduce.md, "Torus against flat"), float64 must agree to its own
rounding."""
import dataclasses
import json
import sys
from pathlib import Path

import torch

from models import build_model
from train.config import Config
from train.engines import create
from train.lars import LARS, decay_param_groups
from train.precision import Precision

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
        process_set = kwargs.get("process_set")  # (none: the global set, the flat all-reduce's)
        return list(process_set.ranks) if process_set is not None else list(range(self._inner.size()))

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


def exact_mean_and_bound(local: list[torch.Tensor], engine) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The exact mean of every rank's gradients (float64 sums), and fp32's rounding bound for an average
    of p values summed in any order: (p - 1) x 2^-24 x the mean of their magnitudes."""
    flat = torch.cat([g.double().reshape(-1) for g in local])
    sums = engine.all_reduce_sum(torch.stack([flat, flat.abs()])) / engine.world_size
    mean, bound = sums[0], (engine.world_size - 1) * 2.0 ** -24 * sums[1]
    sizes = [g.numel() for g in local]
    return ([t.view(g.shape) for t, g in zip(mean.split(sizes), local)],
            [t.view(g.shape) for t, g in zip(bound.split(sizes), local)])


def in_rounding_units(averaged: list[torch.Tensor], exact: list[torch.Tensor], bound: list[torch.Tensor]) -> float:
    """The averaged gradients' largest error against the exact mean in units of the rounding bound
    (<= 1: the exact mean but for the rounding of the sums)."""
    return max(((a.double() - e).abs() / b.clamp_min(1e-300)).max().item() for a, e, b in zip(averaged, exact, bound))


def trained(engine, dtype: torch.dtype, steps: int = 2, **settings) -> list[torch.Tensor]:
    """The trainer's resnet18 at 16 px after a few LARS steps (LR 2) on this rank's own batches."""
    engine.cfg = dataclasses.replace(engine.cfg, **settings)
    torch.manual_seed(0)
    model = build_model("resnet18", 10, channels_last=True).to(dtype)
    model, optimizer = engine.wrap(model, LARS(decay_param_groups(model), lr=2.0, momentum=0.9, weight_decay=5e-5))
    generator = torch.Generator().manual_seed(100 + engine.rank)
    for _ in range(steps):
        images = torch.randn(4, 3, 16, 16, generator=generator, dtype=dtype).contiguous(memory_format=torch.channels_last)
        labels = torch.randint(0, 10, (4,), generator=generator)
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        engine.step(loss, optimizer, Precision("fp32", engine.device))
        optimizer.zero_grad()
    return [p.detach().clone() for p in engine.unwrap(model).parameters()]


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
    # this rank's own, unaveraged gradient: the average must really mix ranks, and stay within rounding of
    # the exact mean
    model = tiny_model()
    images = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(100 + engine.rank))
    model(images).square().mean().backward()
    local = [p.grad for p in model.parameters()]
    exact, bound = exact_mean_and_bound(local, engine)
    flat, _ = averaged_gradients(engine, recorder, allreduce="flat")
    hierarchical, _ = averaged_gradients(engine, recorder, allreduce="hierarchical")
    result = {"rank": engine.rank, "hierarchical_vs_flat": worst(hierarchical, flat), "torus": {},
              "local_gap": worst(local, flat),
              "rounding_units": {"flat": in_rounding_units(flat, exact, bound),
                                 "hierarchical": in_rounding_units(hierarchical, exact, bound)}}
    for rows in rows_list:
        torus, events = averaged_gradients(engine, recorder, allreduce="torus", torus_rows=rows)
        result["torus"][rows] = {"vs_flat": worst(torus, flat), "vs_hierarchical": worst(torus, hierarchical),
                                 "events": events}
        result["rounding_units"][f"torus {rows}"] = in_rounding_units(torus, exact, bound)
    if engine.world_size == 4:
        flat, torus = (trained(engine, torch.float64, allreduce=way, torus_rows=2) for way in ("flat", "torus"))
        result["float64_training_torus_vs_flat"] = worst(torus, flat)
    (out_dir / f"rank{engine.rank}.json").write_text(json.dumps(result))
    engine.shutdown()


if __name__ == "__main__":
    main()
