"""How bytes become batches.

Every loader hands the training loop the same thing: (images, labels) already on the device,
normalised float, channels_last when asked, sharded by global rank, and in an order fixed by
(seed, epoch) so that a resumed run sees exactly the batches an uninterrupted one would.

data/ is a leaf package: it imports nothing from train/, and its modules import each other
without a cycle (tree <- index, shards <- sources <- loaders <- torch_loader, dali <- this file).
The names below are imported on first use, not here: DALI's reader processes import
data.sources and data.dali_reader, which need no torch, and importing this package must not
bring it in (data/dali_reader.py).
"""
import importlib

_NAMES = {"DataError": "data.tree", "check_tree": "data.tree", "Loader": "data.loaders",
          "LoaderSettings": "data.loaders", "SyntheticLoader": "data.loaders", "TorchLoader": "data.torch_loader",
          "DaliLoader": "data.dali"}
_LOADERS = {"torch": "TorchLoader", "dali": "DaliLoader", "synthetic": "SyntheticLoader"}  # --loader NAME
LOADER_NAMES = tuple(_LOADERS)  # (without torch: train/config.py lists them for --help)


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    if name == "LOADERS":  # --loader NAME -> its class
        return {key: __getattr__(cls) for key, cls in _LOADERS.items()}
    raise AttributeError(f"module 'data' has no attribute {name!r}")


def build_loader(name: str, settings, rank: int, world_size: int, device):
    """The loader called `name` for these LoaderSettings on this rank."""
    from data.tree import DataError, check_tree
    if name not in _LOADERS:
        raise DataError(f"unknown --loader {name!r}; choose {', '.join(_LOADERS)}")
    loader = __getattr__(_LOADERS[name])
    if name == "synthetic":
        return loader(settings, rank, world_size, device)
    return loader(settings, check_tree(settings.data_dir), rank, world_size, device)


__all__ = ["LOADERS", "LOADER_NAMES", "DataError", "Loader", "LoaderSettings", "build_loader"]
