"""One process: no launcher, nothing to exchange. Every collective of the Engine protocol is the
identity (a sum over one rank is the value itself)."""
import contextlib
import socket

import torch
from torch.profiler import record_function

from models.batchnorm import convert_batchnorm
from train.engines.launch import local_device
from train.engines.wire import NOT_ON_ONE_PROCESS


class SingleProcess:
    name = "none"
    elastic = False
    warning = ""

    def __init__(self, cfg, launch=None):
        self.wire_note = NOT_ON_ONE_PROCESS if cfg.fp16_allreduce else None  # (for the run's output)
        self.rank, self.world_size, self.local_rank, self.local_size = 0, 1, 0, 1
        self.hosts = [socket.gethostname()]
        self.device = local_device(0)

    def sync_batchnorm(self, model, span: int, ghost: int = 0):
        return convert_batchnorm(model, None, 1, ghost) if ghost else model

    def wrap(self, model, optimizer):
        return model, optimizer

    def step(self, loss, optimizer, precision) -> None:
        """Backward and the optimizer step, each a named range of a profiler trace (one process has no
        all-reduce to wait for)."""
        with record_function("backward"):
            precision.backward(loss)
        with record_function("optimizer"):
            precision.step(optimizer)

    def accumulating(self, model, optimizer):
        return contextlib.nullcontext()  # (nothing averaged: the gradients simply add up)

    def unwrap(self, model):
        return model

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def any(self, flag: bool) -> bool:
        return flag

    def max_over_ranks(self, values: list[int]) -> list[int]:
        return list(values)

    def broadcast_object(self, obj):
        return obj

    def gather_object(self, obj) -> list:
        return [obj]

    def barrier(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
