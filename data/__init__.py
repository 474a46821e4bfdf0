"""How bytes become batches.

Every loader hands the training loop the same thing: (images, labels) already on the device,
normalised float, channels_last when asked, sharded by global rank, and in an order fixed by
(seed, epoch) so that a resumed run sees exactly the batches an uninterrupted one would.

data/ is a leaf package: it imports nothing from train/, and its modules import each other
without a cycle (tree <- shards <- loaders <- torch_loader, dali <- this file).
"""
import torch

from data.dali import DaliLoader
from data.loaders import Loader, LoaderSettings, SyntheticLoader
from data.torch_loader import TorchLoader
from data.tree import DataError, check_tree

LOADERS = {"torch": TorchLoader, "dali": DaliLoader, "synthetic": SyntheticLoader}  # --loader NAME


def build_loader(name: str, settings: LoaderSettings, rank: int, world_size: int, device: torch.device) -> Loader:
    if name not in LOADERS:
        raise DataError(f"unknown --loader {name!r}; choose {', '.join(LOADERS)}")
    if name == "synthetic":
        return SyntheticLoader(settings, rank, world_size, device)
    return LOADERS[name](settings, check_tree(settings.data_dir), rank, world_size, device)


__all__ = ["LOADERS", "DataError", "Loader", "LoaderSettings", "build_loader"]
