"""Run under a launcher (torchrun / horovodrun) with 4 processes as 2 x 2 (argv: ENGINE OUT_DIR):
averages rank-dependent gradients of a small model cut into many buckets with --allreduce torus
(--torus-rows 2), and writes OUT_DIR/rank<r>.json: the largest per-tensor relative difference from
the plain average, and the events of each run, in order.

torch: a stand-in for torch.distributed on the engine (Gate) holds back the completion of the
collectives issued until, on even ranks, the last bucket's hook has returned, and on odd ranks the
first's; then they complete, on even ranks last-issued first. So the hook's callbacks fire in
different orders on different ranks, and on odd ranks they issue bucket 0's later steps while the
hooks still issue the later buckets' first. A hook that waited would fail (waiting on a held
collective is an error); one that issued a group's collectives in completion order, or later steps
on the groups of the first, would mismatch them across ranks. Events: each hook call and return
(with whether its future was done), each collective issued, the gate's opening.

horovod: a stand-in for horovod.torch records each operation issued (its step and bucket, from its
name) and, through hooks of its own, each gradient ready; its poll() says done on even ranks and not
yet on odd ones, as completions may differ (what a rank issues during backward must not depend on
them: Horovod names an unnamed operation by a per-process count of operations).
"""
import json
import sys
from pathlib import Path

import torch

from train.config import Config
from train.engines import create
from train.engines.horovod import TwoLevelHorovodOptimizer

SIZES = [16, 40, 24, 56, 8, 32, 5]  # unequal layers: buckets of unequal sizes
DDP_BUCKET_MB = 1024 / 2 ** 20  # DDP buckets of 1 KiB: about one parameter each
HOROVOD_BUCKET_ELEMENTS = 600
GATED = {"all_to_all_single": "all_to_all", "all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
         "all_gather_single": "all_gather", "reduce_scatter_single": "reduce_scatter",
         "reduce_scatter_tensor": "reduce_scatter"}  # torch.distributed's collectives, by kind


def small_model():
    torch.manual_seed(0)
    layers = []
    for a, b in zip(SIZES, SIZES[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def images(rank: int) -> torch.Tensor:
    return torch.randn(8, SIZES[0], generator=torch.Generator().manual_seed(100 + rank))


def plain_average(engine) -> list[torch.Tensor]:
    """This rank's gradients summed over the ranks one tensor at a time, divided by the rank count."""
    model = small_model()
    model(images(engine.rank)).square().mean().backward()
    return [engine.all_reduce_sum(p.grad.clone()) / engine.world_size for p in model.parameters()]


def worst(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((x - y).abs().max() / y.abs().max().clamp_min(1e-12)).item() for x, y in zip(a, b))


class Gate:
    """Stands in for torch.distributed: forwards every call; an asynchronous collective's future,
    asked for while the gate is closed, completes only after open() (see the module's docstring)."""

    def __init__(self, inner, rank: int):
        self._inner, self.rank, self.is_open, self.held, self.events = inner, rank, False, [], []

    def __getattr__(self, name):
        value = getattr(self._inner, name)
        if name not in GATED:
            return value

        def issue(*args, **kwargs):
            self.events.append(["issue", GATED[name]])
            work = value(*args, **kwargs)
            return Held(work, self) if kwargs.get("async_op") else work
        return issue

    def open(self) -> None:
        """Every held collective has been issued by every rank (no hook waits), so each completes; then
        their futures complete, on even ranks in reverse order of issue."""
        self.events.append(["open"])
        self.is_open = True
        for real, _ in self.held:
            real.wait()
        for real, gated in self.held[::-1] if self.rank % 2 == 0 else self.held:
            gated.set_result(real.value())


class Held:
    def __init__(self, work, gate: Gate):
        self.work, self.gate = work, gate

    def wait(self):
        if not self.gate.is_open:
            raise AssertionError("the hook waited on a collective")
        return self.work.wait()

    def get_future(self):
        if self.gate.is_open:
            return self.work.get_future()
        gated = torch.futures.Future()
        self.gate.held.append((self.work.get_future(), gated))
        return gated


def torch_run(engine) -> dict:
    from torch.nn.parallel import DistributedDataParallel
    reference = plain_average(engine)
    gate = engine.dist = Gate(engine.dist, engine.rank)
    model = small_model()
    ddp = DistributedDataParallel(model, bucket_cap_mb=DDP_BUCKET_MB, gradient_as_bucket_view=True)

    def hook(state, bucket):
        gate.events.append(["hook", bucket.index()])
        future = engine._two_level_hook(state, bucket)
        gate.events.append(["returned", bucket.index(), future.done()])
        # even ranks hold every bucket's collectives until the last hook, odd ranks only the first's:
        # there, steps 2 and 3 of bucket 0 go out while the later hooks issue their step 1
        if not gate.is_open and (bucket.is_last() if engine.rank % 2 == 0 else True):
            gate.open()
        return future
    ddp.register_comm_hook(engine._two_level_state(), hook)
    gate.is_open = True  # a first step, not held: DDP keeps one bucket until it has seen backward's order
    ddp(images(engine.rank)).square().mean().backward()
    ddp.zero_grad(set_to_none=False)
    gate.is_open, gate.events = False, []
    ddp(images(engine.rank)).square().mean().backward()
    return {"vs_plain": worst([p.grad for p in model.parameters()], reference), "events": gate.events}


class Recorder:
    """Stands in for horovod.torch: forwards every call, records each operation issued and each
    gradient ready while `events` is a list, and answers poll() during backward as completions may
    differ between ranks: done on even ranks, not yet on odd ones (only code that asked would see it)."""

    def __init__(self, inner, rank: int):
        self._inner, self.rank, self.events = inner, rank, None

    def __getattr__(self, name):
        value = getattr(self._inner, name)
        if self.events is None:
            return value
        if name in ("allreduce_async", "allreduce_async_", "allgather_async"):
            def issue(*args, **kwargs):
                _, step, _, bucket, _ = kwargs["name"].split(".")  # twolevel.STEP.psID.BUCKET.PART
                self.events.append(["issue", step, int(bucket)])
                return value(*args, **kwargs)
            return issue
        if name == "poll":  # during backward; once synchronize() waits, the real answer
            return lambda handle: value(handle) if ["synchronize"] in self.events else self.rank % 2 == 0
        return value


def horovod_run(engine, recorder: Recorder) -> dict:
    reference = plain_average(engine)
    model = small_model()
    optimizer = TwoLevelHorovodOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), engine,
                                         engine._two_level_routes(), list(model.parameters()),
                                         bucket_elements=HOROVOD_BUCKET_ELEMENTS)
    for i, p in enumerate(model.parameters()):  # after the optimizer's hooks: they run first
        p.register_post_accumulate_grad_hook(lambda _, i=i: recorder.events.append(["ready", i]))
    recorder.events = []
    model(images(engine.rank)).square().mean().backward()
    recorder.events.append(["synchronize"])
    optimizer.synchronize()
    events, recorder.events = recorder.events, None
    return {"vs_plain": worst([p.grad for p in model.parameters()], reference), "events": events}


def main():
    engine_name, out_dir = sys.argv[1], Path(sys.argv[2])
    engine = create(Config(engine=engine_name, ranks_per_node=2, allreduce="torus", torus_rows=2))
    assert engine.world_size == 4
    if engine_name == "torch":
        result = {"torch": torch_run(engine)}
    else:
        recorder = engine.hvd = Recorder(engine.hvd, engine.rank)
        result = {"horovod": horovod_run(engine, recorder)}
    (out_dir / f"rank{engine.rank}.json").write_text(json.dumps({"rank": engine.rank, **result}))
    engine.shutdown()


if __name__ == "__main__":
    main()
