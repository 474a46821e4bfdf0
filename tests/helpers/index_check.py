"""Run under a launcher after the dataset's index exists: every rank builds its loader with the tree
walk forbidden (data.index.list_samples raises), and writes its sample count and first sample."""
import json
import sys

import torch

import data.index
from data.torch_loader import TorchLoader
from data.tree import check_tree
from train.engines import detect_launch


def forbidden(*args, **kwargs):
    raise AssertionError("a rank walked the tree although the index exists")


def main(root: str, out: str) -> None:
    data.index.list_samples = forbidden
    rank = detect_launch().rank
    loader = TorchLoader(_settings(root), check_tree(root), rank, 2, torch.device("cpu"))
    json.dump({"train": len(loader.train_source), "val": len(loader.val_source),
               "first": loader.train_source.samples[0]}, open(f"{out}.{rank}", "w"))


def _settings(root):
    from data import LoaderSettings
    from train.config import Config
    return LoaderSettings.of(Config(data_dir=root, batch_size=4, workers=0, precision="fp32"))


if __name__ == "__main__":
    main(*sys.argv[1:])
