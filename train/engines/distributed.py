"""What both distributed engines share (TorchDistributed and Horovod are DistributedEngines): the
node layout (consecutive ranks share a node), the BatchNorm span groups, the two-level all-reduces'
process groups over the routes of train/engines/topology.py, the watchdog that bounds every wait on
the other ranks, and the --init-from-seed check. Each engine brings its own `_group` (a process group
or a process set) and `_differentiable_sum`.
"""
import contextlib
import os
import socket

import torch

from models.batchnorm import convert_batchnorm
from train.engines.network import collective_timeout, interface_address
from train.engines.topology import check_bn_span, torus_grid, two_level_routes
from train.engines.watchdog import Watchdog
from train.errors import UsageError, raised_everywhere


def discount_compiles(watchdog: Watchdog) -> None:
    """torch.compile's compiles are the rank's own work, not a wait on the other ranks, and the first
    steps of a compiled run are mostly compiling: the forward compiles before the engine's step, but
    the backward compiles inside backward (torch compiles it when it first runs), within the gradient
    all-reduce's wait; a new input shape compiles both again, and --lars-compile's update compiles in
    the optimizer step. None of that counts towards TRAINER_COLLECTIVE_TIMEOUT_S (docs/compile.md):
    Dynamo tells when compiling starts and ends, for the forward, the backward and the recording of
    CUDA graphs."""
    try:
        from torch._dynamo import callback_handler
    except ImportError:  # (a torch that does not tell: its compiles count as waits)
        return
    # (*_: newer releases pass the callbacks an argument, older ones none)
    callback_handler.register_start_callback(lambda *_: watchdog.compiling(True))
    callback_handler.register_end_callback(lambda *_: watchdog.compiling(False))


class DistributedEngine:
    """Node layout: consecutive ranks share a node. ranks_per_node 0 = measured from host names."""
    watchdog = None
    hosts: list[str] | None = None  # every rank's host name, in rank order (None: not known, under Horovod Elastic)

    def _meet(self, cfg, gather) -> None:
        """Who is where, in one all-gather (`gather`, the engine's): every rank's host name and liveness
        address (train/engines/network.py), then the node layout from the host names."""
        if self.watchdog is None:  # (once per process: Horovod Elastic meets again after a change)
            self.watchdog = Watchdog(collective_timeout(), interface_address(os.environ.get("TRAINER_IFACE")))
            if cfg.compile or cfg.lars_compile:
                discount_compiles(self.watchdog)
        everyone = gather((socket.gethostname(), *self.watchdog.listener.getsockname()[:2]))
        self.hosts = [host for host, _, _ in everyone]
        self.watchdog.meet(self.rank, [(rank, host, address, port) for rank, (host, address, port) in enumerate(everyone)])
        self._layout(cfg, self.hosts.count(self.hosts[self.rank]))
        if cfg.allreduce != "flat" and not cfg.ranks_per_node:
            self._check_nodes_are_lines()

    def _check_nodes_are_lines(self) -> None:
        """The two-level all-reduces take consecutive ranks as a node: the launcher must number them so."""
        placed = [self.hosts[rank - rank % self.local_size] for rank in range(self.world_size)]
        if placed != self.hosts:
            stray = next(rank for rank in range(self.world_size) if placed[rank] != self.hosts[rank])
            raise UsageError(f"--allreduce {self.cfg.allreduce} takes each node's ranks as consecutive numbers, but rank "
                             f"{stray} runs on {self.hosts[stray]}, not {placed[stray]}; launch the ranks node by node "
                             "(mpirun --map-by slot, horovodrun -H in node order) or set --ranks-per-node")

    def _waiting(self, what: str):
        """A wait on the other ranks, bounded by TRAINER_COLLECTIVE_TIMEOUT_S (the watchdog)."""
        return self.watchdog.waiting(what) if self.watchdog else contextlib.nullcontext()

    def _layout(self, cfg, on_this_host: int) -> None:
        """on_this_host: how many ranks share this rank's host."""
        self.on_this_host = on_this_host  # (the cores' share: train/startup.py compute_threads)
        self.local_size = cfg.ranks_per_node or on_this_host
        if self.world_size % self.local_size:
            raise UsageError(f"{self.world_size} ranks do not split into nodes of {self.local_size}; "
                             "set --ranks-per-node to a divisor of the rank count")
        rows = cfg.torus_rows or self.local_size
        if cfg.allreduce == "torus" and (rows < 1 or self.world_size % rows):
            raise UsageError(f"--torus-rows {rows} does not divide the {self.world_size} ranks of this launch; "
                             "choose a divisor of the rank count (0: the ranks per node)")
        self.node = self.rank // self.local_size
        self.local_rank = self.rank % self.local_size
        self.nodes = self.world_size // self.local_size

    def _bn_groups(self, span: int) -> list[list[int]]:
        check_bn_span(span, self.world_size)
        return [list(range(start, start + span)) for start in range(0, self.world_size, span)]

    def _bn_all_reduce(self, span: int):
        """The sum over this rank's BatchNorm span, differentiable (backward sums too); None for span 1.
        Every rank creates every span's group, in the same order."""
        if span == 1:
            return None
        groups = [self._group(ranks) for ranks in self._bn_groups(span)]
        return self._differentiable_sum(groups[self.rank // span])

    def sync_batchnorm(self, model, span: int, ghost: int = 0):
        if span == 1 and not ghost:
            return model  # untouched: plain BatchNorm2d, bit for bit
        return convert_batchnorm(model, self._bn_all_reduce(span), span, ghost)

    def _two_level_grid(self) -> tuple[int, list[tuple[int, ...]], list[tuple[int, ...]]]:
        """(rows, lines, columns) of --allreduce hierarchical (lines are nodes) or torus (lines of
        --torus-rows, 0: the ranks per node)."""
        rows = (self.cfg.torus_rows if self.cfg.allreduce == "torus" else 0) or self.local_size
        return (rows, *torus_grid(self.world_size, rows))

    def _two_level_routes(self) -> list[tuple[tuple, tuple]]:
        """The routes of the two-level all-reduce (_two_level_grid), after every rank has created every
        line's and column's group alike."""
        rows, lines, columns = self._two_level_grid()
        for ranks in lines + columns:
            if len(ranks) > 1:  # a one-rank group has nothing to exchange: its steps are skipped
                self._group(ranks)
        return two_level_routes(self.cfg.allreduce, self.rank, self.world_size, rows)

    def _check_same_model(self, model) -> None:
        """--init-from-seed: every rank built its own model; compare float64 per-tensor sums and sums
        of squares with rank 0's (a few numbers per tensor instead of a broadcast of the model).
        Exact equality: the same seed and code give bit-identical tensors and the same sums."""
        tensors = [t.detach() for t in model.state_dict().values()]
        mine = torch.stack([torch.stack([t.double().sum(), t.double().square().sum()]) for t in tensors]).cpu()
        if self.any(not torch.equal(mine, self.broadcast_object(mine))):
            raise raised_everywhere(UsageError(
                "--init-from-seed: the ranks built different initial models from --seed (another torch "
                "version or code on some rank?); drop --init-from-seed to start from rank 0's model"))
