"""Engines: who the ranks are and how they talk. The loop sees only the `Engine` protocol below and
never asks which engine it has.

`none` is one process; `torch` is torch.distributed (DDP; launched by torchrun, Slurm's srun, or
mpirun with MASTER_ADDR); `horovod` is Horovod (horovodrun, or mpirun). `auto` picks one from the
launcher's environment (detect_launch). A new all-reduce algorithm is one more name in ALLREDUCE
and a branch of each engine's wrap().
"""
import contextlib
import datetime
import inspect
import os
import socket
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from models.batchnorm import convert_batchnorm
from train.config import UsageError

ALLREDUCE = ("flat", "hierarchical")  # --allreduce NAME


@runtime_checkable
class Engine(Protocol):
    name: str
    rank: int
    world_size: int
    local_rank: int
    local_size: int
    device: torch.device

    def sync_batchnorm(self, model: torch.nn.Module, span: int) -> torch.nn.Module:
        """BatchNorm statistics over groups of `span` consecutive ranks."""

    def wrap(self, model: torch.nn.Module, optimizer) -> tuple:
        """(model, optimizer) whose gradients are averaged over the ranks (overlapped with backward),
        with rank 0's parameters and optimizer state on every rank."""

    def step(self, loss: torch.Tensor, optimizer, precision) -> None:
        """Backward, gradient averaging, the loss scaler's unscale-and-check, the optimizer step."""

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model inside the engine's wrapper."""

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Summed over the ranks (metrics, at logging points)."""

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on any: host-side agreement, no device sync."""

    def broadcast_object(self, obj):
        """Rank 0's value on every rank."""

    def gather_object(self, obj) -> list:
        """Every rank's value on every rank (set-up checks)."""

    def barrier(self) -> None: ...

    def shutdown(self) -> None: ...


COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=int(os.environ.get("TRAINER_COLLECTIVE_TIMEOUT_S", "300")))


def _device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class SingleProcess:
    name = "none"

    def __init__(self, cfg, launch=None):
        self.rank, self.world_size, self.local_rank, self.local_size = 0, 1, 0, 1
        self.device = _device(0)

    def sync_batchnorm(self, model, span: int):
        return model

    def wrap(self, model, optimizer):
        return model, optimizer

    def step(self, loss, optimizer, precision) -> None:
        precision.backward(loss)
        precision.step(optimizer)

    def unwrap(self, model):
        return model

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def any(self, flag: bool) -> bool:
        return flag

    def broadcast_object(self, obj):
        return obj

    def gather_object(self, obj) -> list:
        return [obj]

    def barrier(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def check_bn_span(span: int, world_size: int) -> None:
    if span < 1 or world_size % span:
        raise UsageError(f"--bn-span {span} does not divide the {world_size} rank(s) of this launch; "
                         "choose a divisor of the rank count (1 on one process)")


class _Topology:
    """Node layout: consecutive ranks share a node. ranks_per_node 0 = measured from host names."""

    def _layout(self, cfg, hostnames: list[str]) -> None:
        if cfg.ranks_per_node:
            self.local_size = cfg.ranks_per_node
        else:
            self.local_size = hostnames.count(hostnames[self.rank])
        if self.world_size % self.local_size:
            raise UsageError(f"{self.world_size} ranks do not split into nodes of {self.local_size}; "
                             "set --ranks-per-node to a divisor of the rank count")
        self.node = self.rank // self.local_size
        self.local_rank = self.rank % self.local_size
        self.nodes = self.world_size // self.local_size
        if self.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # ranks sharing a host share its cores; oversubscribed threads cost more than they give
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // hostnames.count(hostnames[self.rank])))

    def _bn_groups(self, span: int) -> list[list[int]]:
        check_bn_span(span, self.world_size)
        return [list(range(start, start + span)) for start in range(0, self.world_size, span)]


class TorchDistributed(_Topology):
    """torch.distributed: NCCL on GPUs, gloo on CPUs; DDP with gradient bucketing."""
    name = "torch"

    def __init__(self, cfg, launch=None):
        import torch.distributed as dist
        self.dist, self.cfg = dist, cfg
        env = os.environ
        launch = launch or detect_launch(env)
        if launch.launcher == "none":
            raise UsageError("--engine torch needs a launcher: torchrun, srun, or mpirun with MASTER_ADDR set")
        self.rank, self.world_size = launch.rank, launch.world_size
        local_rank = int(env.get("LOCAL_RANK", env.get("OMPI_COMM_WORLD_LOCAL_RANK", env.get("SLURM_LOCALID", 0))))
        if launch.launcher == "srun":
            env.setdefault("MASTER_ADDR", env.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1"))
            env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
        elif "MASTER_ADDR" not in env:
            raise UsageError(f"--engine torch under {launch.launcher} needs MASTER_ADDR (and MASTER_PORT) in the "
                             "environment of every rank")
        env.setdefault("MASTER_PORT", "29500")
        self.device = _device(local_rank)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=self.rank, world_size=self.world_size, timeout=COLLECTIVE_TIMEOUT,
                                device_id=self.device if backend == "nccl" else None)
        # host-side control messages (stop flags) travel over gloo: no GPU sync
        self.control = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT) if backend == "nccl" else None
        hostnames = [None] * self.world_size
        dist.all_gather_object(hostnames, socket.gethostname(), group=self.control)
        self._layout(cfg, hostnames)
        # every rank creates every group, in the same order (a torch.distributed rule)
        self.intra = self.inter = None
        for node in range(self.nodes):
            group = dist.new_group(list(range(node * self.local_size, (node + 1) * self.local_size)))
            if node == self.node:
                self.intra = group
        for local in range(self.local_size):
            group = dist.new_group(list(range(local, self.world_size, self.local_size)))
            if local == self.local_rank:
                self.inter = group

    def sync_batchnorm(self, model, span: int):
        if span == 1:
            return model
        import torch.distributed._functional_collectives as functional  # differentiable: backward sums too
        mine = None
        for ranks in self._bn_groups(span):
            group = self.dist.new_group(ranks)
            if self.rank in ranks:
                mine = group
        return convert_batchnorm(model, lambda t: functional.all_reduce(t, "sum", mine), span)

    def wrap(self, model, optimizer):
        from torch.nn.parallel import DistributedDataParallel
        # DDP broadcasts rank 0's parameters and buffers at construction
        # no per-step broadcast of BN buffers: each rank keeps its own running statistics, as the
        # single-process run would (DDP still copies rank 0's parameters and buffers at construction)
        no_buffer_sync = ({"forward_sync_buffers": False}
                          if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                          else {"broadcast_buffers": False})
        ddp = DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                                      gradient_as_bucket_view=True, **no_buffer_sync)
        if self.cfg.allreduce == "hierarchical":
            ddp.register_comm_hook(None, self._hierarchical_hook)
        elif self.cfg.fp16_allreduce:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        state = [optimizer.state_dict()]
        self.dist.broadcast_object_list(state, src=0, group=self.control)
        optimizer.load_state_dict(state[0])
        return ddp, optimizer

    def step(self, loss, optimizer, precision) -> None:
        precision.backward(loss)  # DDP averages the gradients during backward
        precision.step(optimizer)

    def unwrap(self, model):
        return model.module

    def _hierarchical_hook(self, _state, bucket):
        """Two-level all-reduce of one gradient bucket: reduce-scatter inside the node, all-reduce of
        each shard among the ranks holding the same shard on other nodes, all-gather inside the node."""
        flat = bucket.buffer()
        wire = flat.to(torch.float16) if self.cfg.fp16_allreduce else flat
        padded = torch.nn.functional.pad(wire, (0, (-wire.numel()) % self.local_size))
        shard = torch.empty(padded.numel() // self.local_size, dtype=padded.dtype, device=padded.device)
        reduce_scatter = getattr(self.dist, "reduce_scatter_single", None) or self.dist.reduce_scatter_tensor
        all_gather = getattr(self.dist, "all_gather_single", None) or self.dist.all_gather_into_tensor
        reduce_scatter(shard, padded, group=self.intra)
        if self.nodes > 1:
            self.dist.all_reduce(shard, group=self.inter)
        all_gather(padded, shard, group=self.intra)
        flat.copy_(padded[:flat.numel()]).div_(self.world_size)
        future = torch.futures.Future()
        future.set_result(flat)
        return future

    def all_reduce_sum(self, tensor):
        self.dist.all_reduce(tensor)
        return tensor

    def any(self, flag: bool) -> bool:
        t = torch.tensor([int(flag)])
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.control)
        return bool(t.item())

    def broadcast_object(self, obj):
        box = [obj]
        self.dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather_object(self, obj) -> list:
        everyone = [None] * self.world_size
        self.dist.all_gather_object(everyone, obj, group=self.control)
        return everyone

    def barrier(self):
        self.dist.barrier(group=self.control)

    def shutdown(self):
        self.dist.destroy_process_group()


class Horovod(_Topology):
    """Horovod: DistributedOptimizer (gradient all-reduce overlapped with backward), gloo/MPI/NCCL."""
    name = "horovod"

    def __init__(self, cfg, launch=None):
        try:
            import horovod.torch as hvd
        except ImportError as err:
            raise UsageError(f"--engine horovod needs Horovod with PyTorch support ({err}); run scripts/install_horovod.sh")
        self.hvd, self.cfg = hvd, cfg
        os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")  # BN groups and node sets are added after init
        if not torch.cuda.is_available():
            # Horovod's background thread wakes every cycle; on CPU-only hosts its default 1 ms cycle
            # takes cycles from the compute threads (scripts/bench/scaling.py: 0.57 -> 0.8 efficiency)
            os.environ.setdefault("HOROVOD_CYCLE_TIME", "20")
        hvd.init()
        self.rank, self.world_size = hvd.rank(), hvd.size()
        self.device = _device(hvd.local_rank())
        hostnames = hvd.allgather_object(socket.gethostname())
        self._layout(cfg, hostnames)
        self._process_sets = {}

    def _process_set(self, ranks: list[int]):
        """Process sets are added collectively by every rank, once each."""
        key = tuple(ranks)
        if len(key) == self.world_size:
            return self.hvd.global_process_set
        if key not in self._process_sets:
            self._process_sets[key] = self.hvd.add_process_set(list(ranks))
        return self._process_sets[key]

    def sync_batchnorm(self, model, span: int):
        if span == 1:
            return model
        groups = [self._process_set(ranks) for ranks in self._bn_groups(span)]
        mine = groups[self.rank // span]
        hvd = self.hvd
        return convert_batchnorm(model, lambda t: hvd.allreduce(t, op=hvd.Sum, process_set=mine), span)

    def wrap(self, model, optimizer):
        hvd = self.hvd
        self._broadcast_tensors(model.state_dict())
        # as an object: hvd.broadcast_optimizer_state would take a zero-gradient step, and LARS's
        # weight decay would then move the weights
        optimizer.load_state_dict(hvd.broadcast_object(optimizer.state_dict(), root_rank=0))
        if self.cfg.allreduce == "hierarchical":
            return model, HierarchicalHorovodOptimizer(optimizer, self)
        compression = _contiguous(hvd.Compression.fp16 if self.cfg.fp16_allreduce else hvd.Compression.none)
        return model, hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                               compression=compression, op=hvd.Average)

    def step(self, loss, optimizer, precision) -> None:
        """All-reduce, synchronise, then unscale and check: every rank sees the same averaged
        gradients, so an overflow on one rank skips the step on all of them together."""
        precision.backward(loss)
        optimizer.synchronize()
        with optimizer.skip_synchronize():
            precision.step(optimizer)

    def unwrap(self, model):
        return model

    def _broadcast_tensors(self, tensors: dict) -> None:
        """Rank 0's values into every rank's tensors; Horovod wants contiguous buffers (not channels_last)."""
        pending = []
        for name, t in tensors.items():
            buffer = t.contiguous()
            pending.append((t, buffer, self.hvd.broadcast_async_(buffer, root_rank=0, name=f"broadcast.{name}")))
        for t, buffer, handle in pending:
            self.hvd.synchronize(handle)
            if buffer is not t:
                t.copy_(buffer)

    def all_reduce_sum(self, tensor):
        return self.hvd.allreduce(tensor, op=self.hvd.Sum, name="metrics")

    def any(self, flag: bool) -> bool:
        return bool(self.hvd.allreduce(torch.tensor([int(flag)]), op=self.hvd.Max, name="stop_flag").item())

    def broadcast_object(self, obj):
        return self.hvd.broadcast_object(obj, root_rank=0)

    def gather_object(self, obj) -> list:
        return self.hvd.allgather_object(obj)

    def barrier(self):
        self.hvd.barrier()

    def shutdown(self):
        self.hvd.shutdown()


def _contiguous(compression):
    """A Horovod compressor that first makes gradients contiguous: channels_last weights have
    channels_last gradients, and Horovod's collectives take contiguous tensors only."""
    class Contiguous:
        @staticmethod
        def compress(tensor):
            channels_last = tensor.dim() == 4 and not tensor.is_contiguous()
            compressed, ctx = compression.compress(tensor.contiguous())
            return compressed, (ctx, channels_last)

        @staticmethod
        def decompress(tensor, ctx):
            inner, channels_last = ctx
            tensor = compression.decompress(tensor, inner)
            # back to the parameter's layout, which fused optimizer kernels assume
            return tensor.contiguous(memory_format=torch.channels_last) if channels_last else tensor
    return Contiguous


_HIERARCHICAL_CHUNK = 1 << 22  # elements per two-level all-reduce message


class HierarchicalHorovodOptimizer:
    """Wraps an optimizer: before step(), gradients are averaged in two levels over process sets:
    summed inside the node, each local rank's shard all-reduced across nodes among the ranks with
    the same local rank (inter-node traffic 1/ranks-per-node of the gradients), shards all-gathered
    inside the node. The node sum is an all-reduce, not Horovod's reducescatter: on gloo with
    process sets, 0.28.1's reducescatter returned wrong shards now and then (tests caught it).
    Horovod's own HOROVOD_HIERARCHICAL_ALLREDUCE needs MPI + NCCL; this works on gloo too."""

    def __init__(self, optimizer, engine: Horovod):
        self.optimizer, self.engine = optimizer, engine
        hvd, e = engine.hvd, engine
        intra = [e._process_set(list(range(n * e.local_size, (n + 1) * e.local_size))) for n in range(e.nodes)]
        inter = [e._process_set(list(range(r, e.world_size, e.local_size))) for r in range(e.local_size)]
        self.intra, self.inter, self.hvd = intra[e.node], inter[e.local_rank], hvd
        self._skip_synchronize = False

    def __getattr__(self, name):  # param_groups, state, state_dict(), zero_grad(), ...
        return getattr(self.optimizer, name)

    def step(self, closure=None):
        if not self._skip_synchronize:
            self.synchronize()
        return self.optimizer.step(closure)

    @contextlib.contextmanager
    def skip_synchronize(self):
        """As Horovod's DistributedOptimizer: step() without averaging again (fp16 loss scaling)."""
        self._skip_synchronize = True
        try:
            yield
        finally:
            self._skip_synchronize = False

    def synchronize(self) -> None:
        """Average the gradients over all ranks, in place."""
        e, hvd = self.engine, self.hvd
        grads = [p.grad for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        wire = flat.to(torch.float16) if e.cfg.fp16_allreduce else flat
        pieces = []
        for i, chunk in enumerate(wire.split(_HIERARCHICAL_CHUNK)):  # bounded messages
            padded = torch.nn.functional.pad(chunk, (0, (-chunk.numel()) % e.local_size))
            # names unique per process set: Horovod matches operations across sets by name
            node_sum = hvd.allreduce(padded, op=hvd.Sum, process_set=self.intra, name=f"hier.sum.n{e.node}.{i}")
            shard = node_sum.view(e.local_size, -1)[e.local_rank].clone()
            if e.nodes > 1:
                shard = hvd.allreduce(shard, op=hvd.Sum, process_set=self.inter, name=f"hier.ar.l{e.local_rank}.{i}")
            pieces.append(hvd.allgather(shard, process_set=self.intra, name=f"hier.ag.n{e.node}.{i}")[:chunk.numel()])
        whole = torch.cat(pieces).to(flat.dtype).div_(e.world_size)
        offset = 0
        for g in grads:
            g.copy_(whole[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


@dataclass(frozen=True)
class Launch:
    """Who started this process: the launcher, this process's rank, and how many ranks it started."""
    launcher: str
    rank: int = 0
    world_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def detect_launch(env=os.environ) -> Launch:
    """The launch, from the launcher's variables, in this order of precedence:
    Horovod's (horovodrun with gloo), torchrun's, MPI's (mpirun of Open MPI, MPICH or Intel MPI,
    and horovodrun with MPI, alone or inside an sbatch job, where SLURM_* is set too), an srun
    step's (also `srun --mpi=pmi2`, which sets PMI_* to the step's own rank and size)."""
    def number(name, default=0):
        return int(env.get(name, default))
    if "HOROVOD_RANK" in env:
        return Launch("horovodrun", number("HOROVOD_RANK"), number("HOROVOD_SIZE", 1))
    if "RANK" in env and "WORLD_SIZE" in env:
        return Launch("torchrun", number("RANK"), number("WORLD_SIZE"))
    if "OMPI_COMM_WORLD_SIZE" in env:
        return Launch("mpirun", number("OMPI_COMM_WORLD_RANK"), number("OMPI_COMM_WORLD_SIZE"))
    srun_step = "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env
    if "PMI_SIZE" in env and not (srun_step and env["PMI_SIZE"] == env["SLURM_STEP_NUM_TASKS"]
                                  and env.get("PMI_RANK") == env["SLURM_PROCID"]):
        return Launch("mpirun", number("PMI_RANK"), number("PMI_SIZE"))
    if srun_step and number("SLURM_STEP_NUM_TASKS", 1) > 1:
        return Launch("srun", number("SLURM_PROCID"), number("SLURM_STEP_NUM_TASKS"))
    return Launch("none")


def _horovod_with_mpi() -> bool:
    try:
        import horovod.torch as hvd
    except ImportError:
        return False
    return hvd.mpi_built()


def choose_engine(requested: str, launch: Launch, env=os.environ) -> str:
    """The engine for `--engine` (auto: the launcher's own), or a UsageError when none can serve the launch."""
    if requested != "auto":
        if requested == "none" and launch.distributed:
            raise UsageError(f"--engine none, but {launch.launcher} started {launch.world_size} ranks: each would "
                             "train alone; drop --engine none or launch one process")
        return requested
    if launch.launcher in ("horovodrun",):
        return "horovod"
    if launch.launcher in ("torchrun", "srun"):
        return "torch"
    if launch.launcher == "mpirun" and launch.distributed:
        if _horovod_with_mpi():
            return "horovod"
        if "MASTER_ADDR" in env:
            return "torch"
        raise UsageError(f"mpirun started {launch.world_size} ranks, but Horovod with MPI is not installed (install "
                         "Open MPI, then run scripts/install_horovod.sh) and MASTER_ADDR is not set for --engine torch")
    return "none"


ENGINES = {"none": SingleProcess, "torch": TorchDistributed, "horovod": Horovod}


def create(cfg, env=os.environ):
    launch = detect_launch(env)
    engine = ENGINES[choose_engine(cfg.engine, launch, env)](cfg, launch)
    if launch.distributed and engine.world_size != launch.world_size:
        raise UsageError(f"{launch.launcher} started {launch.world_size} ranks, but --engine {engine.name} sees "
                         f"{engine.world_size}; use the launcher's engine (--engine auto)")
    return engine
