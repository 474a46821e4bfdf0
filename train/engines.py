"""Engines: who the ranks are and how they talk. The loop sees only this interface.

    rank, world_size, local_rank, device
    wrap(model, optimizer) -> (model, optimizer)   gradient averaging, initial broadcast
    all_reduce_sum(tensor) -> tensor               metrics, at logging points only
    barrier(), shutdown()

This file holds the single-process engine; the distributed ones plug in beside it.
"""
import torch

from train.config import UsageError


class SingleProcess:
    name = "none"
    rank, world_size, local_rank, local_size = 0, 1, 0, 1

    def __init__(self):
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")

    def wrap(self, model, optimizer):
        return model, optimizer

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def barrier(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


ENGINES = {"none": SingleProcess}


def create(name: str):
    if name == "auto":
        name = "none"
    if name not in ENGINES:
        raise UsageError(f"unknown --engine {name!r}; choose one of auto, {', '.join(ENGINES)}")
    return ENGINES[name]()
