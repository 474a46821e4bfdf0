"""Counts the gradient all-reduces of an optimizer step of 3 passes (--accumulation-steps 3) on one
rank, with the engine's accumulating() around the first two passes and without it, and writes what it
saw to the JSON file named by argv[2]. argv[1]: "horovod" (a plain process: hvd.init() needs no
launcher) or "torch" (under torchrun, 1 process: DDP on gloo).

- Horovod: the flat wrapper (FlatHorovodOptimizer: Horovod's allreduce_async_ calls, counted by name)
  and the two-level one (TwoLevelHorovodOptimizer: the starts of its buckets, which on one rank have
  nothing to send to Horovod, counted by bucket). Without accumulating() the second backward must raise.
- DDP: the comm hook's calls per step, the engine's two-level hook (--allreduce hierarchical) and a
  plain all-reduce hook on the flat path, with accumulating() (DDP's no_sync) and without.
Every case also records how far the step's gradients are from the sum of the three passes' gradients
taken in one process without any engine (one rank: the average is the sum itself)."""
import contextlib
import json
import sys
from collections import Counter

import torch

from models import build_model
from train.config import Config
from train.engines import create

PASSES = 3


def batches(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 3, 16, 16, generator=generator), torch.randint(0, 10, (2,), generator=generator))
            for _ in range(PASSES)]


def fresh_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("resnet18", num_classes=10)


def passes(model, data, accumulating) -> None:
    """The step's forward and backward passes, the loss / N as the trainer takes it; the passes but the
    last inside `accumulating()` (a context that does nothing where it is None)."""
    for index, (images, labels) in enumerate(data):
        last = index == len(data) - 1
        with contextlib.nullcontext() if last or accumulating is None else accumulating():
            loss = torch.nn.functional.cross_entropy(model(images), labels) / len(data)
            loss.backward()


def expected_gradients(data) -> list[torch.Tensor]:
    model = fresh_model()
    passes(model, data, None)
    return [p.grad.clone() for p in model.parameters()]


def farthest(model, expected) -> float:
    return max((p.grad - e).abs().max().item() for p, e in zip(model.parameters(), expected))


class Counting:
    """Horovod's module, with its allreduce_async_ calls counted by operation name."""

    def __init__(self, hvd):
        self.hvd, self.names = hvd, Counter()

    def __getattr__(self, name):
        return getattr(self.hvd, name)

    def allreduce_async_(self, tensor, *args, name=None, **kwargs):
        self.names[name] += 1
        return self.hvd.allreduce_async_(tensor, *args, name=name, **kwargs)


def horovod_wrappers(engine) -> dict:
    from train.engines.horovod_allreduce import FlatHorovodOptimizer, TwoLevelHorovodOptimizer
    data, seen = batches(), {}
    expected = expected_gradients(data)
    for kind in ("flat", "two-level"):
        for accumulate in (True, False):
            model = fresh_model()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            if kind == "flat":
                wrapped = FlatHorovodOptimizer(optimizer, engine, model.named_parameters())
                wrapped.hvd = counted = Counting(wrapped.hvd)
                issued = counted.names
                units = len(wrapped._params)
            else:  # small buckets: several of them
                wrapped = TwoLevelHorovodOptimizer(optimizer, engine, engine._two_level_routes(), list(model.parameters()),
                                                   bucket_elements=1 << 20)
                issued, start = Counter(), wrapped._start
                wrapped._start = lambda bucket: (issued.update([bucket.index]), start(bucket))
                units = len(wrapped._buckets)
            case = {"units": units}
            try:
                passes(model, data, wrapped.accumulating if accumulate else None)
                case["during_backward"] = dict(issued)
                wrapped.synchronize()
                case["per_step"] = dict(issued)
                case["farthest"] = farthest(model, expected)
            except RuntimeError as error:
                case["raised"] = str(error)
            seen[f"{kind} {'accumulating' if accumulate else 'plain'}"] = case
    return seen


def ddp_hooks(engine_settings: dict) -> dict:
    """DDP's comm hook calls in a step of one pass (after a first step, in which DDP still rebuilds its
    buckets) and in a step of 3, per all-reduce path, with and without the engine's accumulating()."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    data, seen = batches(), {}
    expected = expected_gradients(data)
    for allreduce in ("flat", "hierarchical"):
        engine = create(Config(engine="torch", allreduce=allreduce, **engine_settings))
        for accumulate in (True, False):
            model = fresh_model()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            calls, phase = Counter(), ["first"]
            if allreduce == "hierarchical":  # the engine's own hook, counted
                hook = engine._two_level_hook
                engine._two_level_hook = lambda state, bucket: (calls.update(phase), hook(state, bucket))[1]
                ddp, optimizer = engine.wrap(model, optimizer)
                del engine._two_level_hook
            else:
                ddp, optimizer = engine.wrap(model, optimizer)
                ddp.register_comm_hook(None, lambda state, bucket: (calls.update(phase), allreduce_hook(state, bucket))[1])
            for phase[0] in ("first", "one pass"):
                passes(ddp, data[:1], None)
                optimizer.zero_grad()
            phase[0] = "step"
            passes(ddp, data, (lambda: engine.accumulating(ddp, optimizer)) if accumulate else None)
            seen[f"{allreduce} {'accumulating' if accumulate else 'plain'}"] = {
                "one_pass_step": calls["one pass"], "per_step": calls["step"], "farthest": farthest(ddp.module, expected)}
        engine.shutdown()
    return seen


def main():
    engine_name, out_file = sys.argv[1], sys.argv[2]
    if engine_name == "horovod":
        engine = create(Config(engine="horovod", allreduce="hierarchical"))
        assert engine.world_size == 1
        seen = horovod_wrappers(engine)
        engine.shutdown()
    else:
        seen = ddp_hooks({})
    with open(out_file, "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    main()
