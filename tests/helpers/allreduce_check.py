"""Run under a launcher (torchrun / horovodrun) with 4 processes and --ranks-per-node 2:
averages the same rank-dependent gradients with the flat and the hierarchical all-reduce of the
engine and writes the largest relative difference (rank 0) to the file named by argv[2]."""
import json
import sys

import torch

from models import build_model
from train.config import Config
from train.engines import create
from train.lars import LARS, decay_param_groups


def model_and_grads(engine, seed_offset):
    torch.manual_seed(0)
    model = build_model("resnet18", num_classes=10, channels_last=True)
    torch.manual_seed(100 + engine.rank)  # different data on every rank
    images = torch.randn(4, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    return model, images


def main():
    engine_name, out_file = sys.argv[1], sys.argv[2]
    engine = create(Config(engine=engine_name, ranks_per_node=2, allreduce="hierarchical"))
    assert engine.world_size == 4 and engine.local_size == 2 and engine.nodes == 2
    averaged = []
    for path in ("flat", "hierarchical"):
        model, images = model_and_grads(engine, 0)
        optimizer = LARS(decay_param_groups(model), lr=0.1)
        if engine_name == "torch":
            from torch.nn.parallel import DistributedDataParallel
            ddp = DistributedDataParallel(model)
            if path == "hierarchical":
                ddp.register_comm_hook(engine._two_level_state(), engine._two_level_hook)
            ddp(images).square().mean().backward()
        else:
            from train.engines.horovod_allreduce import FlatHorovodOptimizer, TwoLevelHorovodOptimizer
            if path == "flat":
                wrapped = FlatHorovodOptimizer(optimizer, engine, model.named_parameters())
            else:
                wrapped = TwoLevelHorovodOptimizer(optimizer, engine, engine._two_level_routes(),
                                                   list(model.parameters()))
            model(images).square().mean().backward()
            wrapped.synchronize()
        averaged.append([p.grad.detach().clone() for p in model.parameters()])
    worst = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item() for a, b in zip(*averaged))
    # the average must really mix ranks: compare with this rank's own, unaveraged gradient
    model, images = model_and_grads(engine, 0)
    model(images).square().mean().backward()
    local_gap = max((p.grad - a).abs().max().item() for p, a in zip(model.parameters(), averaged[0]))
    if engine.rank == 0:
        with open(out_file, "w") as f:
            json.dump({"worst_relative_difference": worst, "local_gap": local_gap}, f)
    engine.shutdown()


if __name__ == "__main__":
    main()
