"""Engines: who the ranks are and how they talk. The loop sees only the `Engine` protocol below and
never asks which engine it has.

`none` is one process (single.py); `torch` is torch.distributed (torch_distributed.py: DDP; launched
by torchrun, Slurm's srun, or mpirun with MASTER_ADDR); `horovod` is Horovod (horovod.py: horovodrun,
or mpirun). `auto` picks one from the launcher's environment (launch.py). A new engine is one more
module and one more entry in ENGINES. A new all-reduce algorithm is one more name in --allreduce's
choices (train/config.py) and a branch of each engine's wrap(); the two-level ones (hierarchical,
torus) are routes over a grid of ranks (topology.py), run by one DDP hook and one Horovod optimizer
wrapper (docs/allreduce.md).
"""
import contextlib
import os
from typing import Protocol, runtime_checkable

import torch

from train.engines.horovod import Horovod
from train.engines.launch import Launch, choose_engine, detect_launch
from train.engines.network import tell_refusal, use_interface
from train.engines.single import SingleProcess
from train.engines.torch_distributed import TorchDistributed
from train.errors import UsageError

__all__ = ["ENGINES", "Engine", "Launch", "create", "detect_launch", "tell_refusal", "use_interface"]


@runtime_checkable
class Engine(Protocol):
    name: str
    rank: int
    world_size: int
    local_rank: int
    local_size: int
    device: torch.device
    elastic: bool  # the rank count may change while the process runs (Horovod Elastic)
    hosts: list[str] | None  # every rank's host name in rank order: the nodes (None: not known, Horovod Elastic)
    wire_note: str | None  # one line for the run's output on --fp16-allreduce's wire (train/engines/wire.py)
    warning: str  # a line for the run's warnings about how the ranks talk ("" when there is none)

    def sync_batchnorm(self, model: torch.nn.Module, span: int, ghost: int = 0) -> torch.nn.Module:
        """BatchNorm statistics over groups of `span` consecutive ranks and, with `ghost` G > 0, over
        groups of G consecutive images inside each rank's batch (group i of the span's ranks together).
        span 1 and ghost 0: the model as it is (plain BatchNorm2d)."""

    def wrap(self, model: torch.nn.Module, optimizer) -> tuple:
        """(model, optimizer) whose gradients are averaged over the ranks (overlapped with backward),
        with rank 0's parameters and optimizer state on every rank (--init-from-seed: the ranks'
        own parameters, checked to be alike, UsageError on every rank if not; under Horovod Elastic
        nothing is sent here: the elastic state's sync does it)."""

    def step(self, loss: torch.Tensor, optimizer, precision) -> None:
        """Backward, gradient averaging, the loss scaler's unscale-and-check, the optimizer step."""

    def accumulating(self, model: torch.nn.Module, optimizer) -> "contextlib.AbstractContextManager":
        """A context for a forward and backward pass whose gradients are added to the next ones without
        being averaged (--accumulation-steps: every pass of an optimizer step but the last); BatchNorm's
        span sums still run in it."""

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model inside the engine's wrapper."""

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Summed over the ranks (metrics, at logging points)."""

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on any: host-side agreement, no device sync."""

    def max_over_ranks(self, values: list[int]) -> list[int]:
        """The largest of each value over the ranks, on every rank: host-side, no device sync (the
        ranks' agreements, train/stopping.py)."""

    def broadcast_object(self, obj):
        """Rank 0's value on every rank."""

    def gather_object(self, obj) -> list:
        """Every rank's value on every rank (set-up checks)."""

    def barrier(self) -> None: ...

    def shutdown(self) -> None: ...


ENGINES = {engine.name: engine for engine in (SingleProcess, TorchDistributed, Horovod)}  # --engine NAME -> class


def create(cfg, env=os.environ):
    launch = detect_launch(env)
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        # the restarted workers would read the last attempt's addresses from torchrun's store and never connect
        raise UsageError("torchrun --max-restarts needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment "
                         "(with this torch its restarted workers cannot connect through the store it shares)")
    engine = ENGINES[choose_engine(cfg.engine, launch, env)](cfg, launch)
    if launch.distributed and engine.world_size != launch.world_size and not engine.elastic:
        raise UsageError(f"{launch.launcher} started {launch.world_size} ranks, but --engine {engine.name} sees "
                         f"{engine.world_size}; use the launcher's engine (--engine auto)")
    return engine
