"""Run under torchrun with N processes: one epoch of the real torch loader's training sampler and
the validation set, per rank; rank 0 writes what every rank read to the file named by argv[2]."""
import json
import sys

import torch.distributed as dist

from data.tree import check_tree
from data.torch_loader import TorchLoader
from train.config import Config
from train.engines import create


def main():
    data_dir, out_file = sys.argv[1], sys.argv[2]
    engine = create(Config(engine="torch"))
    cfg = Config(data_dir=data_dir, image_size=16, batch_size=4, workers=0, seed=3)
    loader = TorchLoader(cfg, check_tree(data_dir), engine.rank, engine.world_size, engine.device)
    train = {epoch: [i for batch in _epoch(loader, epoch) for i, _ in batch] for epoch in (0, 1)}
    val = sum(len(labels) for _, labels in loader.val_batches())
    everyone = [None] * engine.world_size
    val_indices = [i for batch in loader.eval_batches for i in batch]
    dist.all_gather_object(everyone, {"train": train, "val": val, "val_indices": val_indices})
    if engine.rank == 0:
        with open(out_file, "w") as f:
            json.dump({"ranks": everyone, "train_images": loader.train_images, "val_images": loader.val_images,
                       "steps_per_epoch": loader.steps_per_epoch}, f)
    engine.shutdown()


def _epoch(loader, epoch):
    loader.sampler.epoch, loader.sampler.start_step = epoch, 0
    return iter(loader.sampler)


if __name__ == "__main__":
    main()
