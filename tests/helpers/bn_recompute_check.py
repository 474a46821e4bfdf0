"""Run under a launcher: every rank keeps 3 batches of its own, recomputes the BN statistics, and
rank 0 writes them and the statistics of all ranks' batches concatenated (each rank can rebuild
every rank's batches from the seeds) to argv[1]."""
import json
import sys

import torch

from train.bnstats import recompute_bn_statistics
from train.config import Config
from train.engines import create
from train.precision import Precision


def batches_of(rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(4 + rank, 3, 6, 6, generator=generator) * (rank + 1) + rank for _ in range(3)]


def main(out: str) -> None:
    engine = create(Config(engine="auto"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 5, 3), torch.nn.BatchNorm2d(5))
    used = recompute_bn_statistics(model, batches_of(engine.rank), engine, Precision("fp32", engine.device))
    if engine.rank == 0:
        with torch.no_grad():
            features = model[0](torch.cat([b for r in range(engine.world_size) for b in batches_of(r)]))
        flat = features.double().transpose(0, 1).reshape(5, -1)
        json.dump({"images": used, "mean": model[1].running_mean.tolist(), "var": model[1].running_var.tolist(),
                   "expected_mean": flat.mean(1).tolist(), "expected_var": flat.var(1).tolist()}, open(out, "w"))
    engine.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
