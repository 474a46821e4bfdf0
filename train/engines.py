"""Engines: who the ranks are and how they talk. The loop sees only the `Engine` protocol below and
never asks which engine it has.

`none` is one process; `torch` is torch.distributed (DDP; launched by torchrun, Slurm's srun, or
mpirun with MASTER_ADDR); `horovod` is Horovod (horovodrun, or mpirun). `auto` picks one from the
launcher's environment (detect_launch). A new all-reduce algorithm is one more name in ALLREDUCE
and a branch of each engine's wrap(); the two-level ones (hierarchical, torus) are routes over a grid
of ranks (two_level_routes), run by one DDP hook and one Horovod optimizer wrapper
(docs/allreduce.md).
"""
import contextlib
import datetime
import inspect
import os
import socket
import time
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from models.batchnorm import convert_batchnorm
from train.config import UsageError

ALLREDUCE = ("flat", "hierarchical", "torus")  # --allreduce NAME


@runtime_checkable
class Engine(Protocol):
    name: str
    rank: int
    world_size: int
    local_rank: int
    local_size: int
    device: torch.device
    elastic: bool  # the rank count may change while the process runs (Horovod Elastic)

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
    elastic = False

    def __init__(self, cfg, launch=None):
        self.rank, self.world_size, self.local_rank, self.local_size = 0, 1, 0, 1
        self.device = _device(0)

    def sync_batchnorm(self, model, span: int, ghost: int = 0):
        return convert_batchnorm(model, None, 1, ghost) if ghost else model

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


def torus_grid(world_size: int, rows: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """The ranks as a grid: lines of `rows` consecutive ranks, and columns of the ranks at the same
    position in each line. With rows = ranks per node, lines are nodes and columns join the ranks
    with the same local rank."""
    lines = [tuple(range(start, start + rows)) for start in range(0, world_size, rows)]
    columns = [tuple(range(position, world_size, rows)) for position in range(rows)]
    return lines, columns


def two_level_routes(allreduce: str, rank: int, world_size: int, rows: int) -> list[tuple[tuple, tuple]]:
    """This rank's routes, one per part of each gradient bucket: (scatter ranks, reduce ranks) =
    reduce-scatter among the scatter ranks, all-reduce of each shard among the reduce ranks, all-gather
    among the scatter ranks. hierarchical: the whole bucket rows-first (lines are nodes). torus: the
    first half rows-first, the second half columns-first, so that both directions carry traffic at once."""
    lines, columns = torus_grid(world_size, rows)
    line, column = lines[rank // rows], columns[rank % rows]
    if allreduce == "torus":
        return [(line, column), (column, line)]
    return [(line, column)]


def check_bn_span(span: int, world_size: int) -> None:
    if span < 1 or world_size % span:
        raise UsageError(f"--bn-span {span} does not divide the {world_size} rank(s) of this launch; "
                         "choose a divisor of the rank count (1 on one process)")


class _Topology:
    """Node layout: consecutive ranks share a node. ranks_per_node 0 = measured from host names."""

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
            from train.startup import agreed_error  # lazily: train.startup imports this module
            raise agreed_error(UsageError(
                "--init-from-seed: the ranks built different initial models from --seed (another torch "
                "version or code on some rank?); drop --init-from-seed to start from rank 0's model"))


class TorchDistributed(_Topology):
    """torch.distributed: NCCL on GPUs, gloo on CPUs; DDP with gradient bucketing."""
    name = "torch"
    elastic = False  # (torchrun's elastic restarts start new processes: restart is resume)

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
        self._layout(cfg, hostnames.count(hostnames[self.rank]))
        self._groups = {}

    def _group(self, ranks):
        """The process group of these ranks, created on first use. Every rank must ask for every group
        in the same order (a torch.distributed rule): callers walk whole lists of groups."""
        key = tuple(ranks)
        if key not in self._groups:
            self._groups[key] = self.dist.new_group(list(key))
        return self._groups[key]

    @staticmethod
    def _differentiable_sum(group):
        import torch.distributed._functional_collectives as functional  # differentiable: backward sums too
        return lambda t: functional.all_reduce(t, "sum", group)

    def wrap(self, model, optimizer):
        from torch.nn.parallel import DistributedDataParallel
        options = inspect.signature(DistributedDataParallel).parameters
        # no per-step broadcast of BN buffers: each rank keeps its own running statistics, as the
        # single-process run would (DDP still copies rank 0's parameters and buffers at construction,
        # unless --init-from-seed, where the ranks' own models are checked to agree instead)
        kwargs = {"forward_sync_buffers": False} if "forward_sync_buffers" in options else {"broadcast_buffers": False}
        if self.cfg.init_from_seed:
            self._check_same_model(model)
            if "init_sync" in options:
                kwargs["init_sync"] = False
        ddp = DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                                      gradient_as_bucket_view=True, **kwargs)
        if self.cfg.allreduce != "flat":
            ddp.register_comm_hook(self._two_level_state(), self._two_level_hook)
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

    def _two_level_state(self) -> "_TwoLevelHookState":
        """The hook's state: the routes, whose groups carry step 1, and a second group for every line and
        column, for steps 2 and 3 (every rank creates every group, in the same order)."""
        routes = self._two_level_routes()
        _, lines, columns = self._two_level_grid()
        for ranks in lines + columns:
            if len(ranks) > 1 and ("later", ranks) not in self._groups:
                self._groups[("later", ranks)] = self.dist.new_group(list(ranks))

        def groups(which: int, later: bool) -> list:
            """Per route, the group of its scatter (0) or reduce (1) ranks: step 1's, or the second one."""
            keys = [("later", route[which]) if later else route[which] for route in routes]
            return [self._groups[key] if len(route[which]) > 1 else None for key, route in zip(keys, routes)]
        return _TwoLevelHookState(routes, [groups(0, False), groups(1, True), groups(0, True)])

    def _two_level_hook(self, state: "_TwoLevelHookState", bucket):
        """Two-level all-reduce of one gradient bucket, as a DDP comm hook (state: _two_level_state).
        The bucket is cut into one part per route (torus: two halves), each padded to a multiple of its
        scatter group; each step (reduce-scatter, all-reduce of the shard, all-gather) is issued for
        every part before any is chained on, so the torus's two directions are in flight together.
        Nothing waits here: step 1 is issued now, steps 2 and 3 by callbacks when the step before has
        completed (step 2 also after the previous bucket's step 3 was issued: _TwoLevelHookState), and
        the returned future completes with the averaged bucket, so backward goes on meanwhile.
        The reduce-scatter is an all-to-all of the part's chunks and a sum of the chunks received:
        gloo's reduce-scatter gives no future to chain on (Work::getFuture not implemented)."""
        flat = bucket.buffer()
        parts = flat.tensor_split(len(state.routes))
        padded, inboxes, shards = state.scratch(bucket.index(), parts,
                                                torch.float16 if self.cfg.fp16_allreduce else flat.dtype)
        for whole, part in zip(padded, parts):
            whole[:part.numel()].copy_(part)  # the padding stays zero: sums of zeros
        all_gather = getattr(self.dist, "all_gather_single", None) or self.dist.all_gather_into_tensor
        dist, (first, second, third) = self.dist, state.step_groups
        result = torch.futures.Future(devices=[flat.device] if flat.is_cuda else None)
        previous, state.issued = state.issued, torch.futures.Future()
        issued = state.issued

        def together(issue, groups) -> list:
            """One step for every part (issue(part index, group)), all issued before any is chained on:
            their futures. A one-rank group (None) has nothing to exchange."""
            works = [issue(i, group) for i, group in enumerate(groups) if group]
            return [work.get_future() for work in works]

        def finish() -> None:
            for whole, part in zip(padded, parts):
                part.copy_(whole[:part.numel()])
            result.set_result(flat.div_(self.world_size))  # after --fp16-allreduce's parts are back in fp32

        def gather() -> None:
            gathered = together(lambda i, group: all_gather(padded[i], shards[i], group=group, async_op=True), third)
            issued.set_result(None)  # the next bucket's step 2 may be issued now
            _when_done(gathered, finish, result)

        def reduce() -> None:
            for inbox, shard in zip(inboxes, shards):
                if inbox is not None:  # every scatter rank's chunk of this rank's shard: their sum
                    torch.sum(inbox.view(-1, shard.numel()), 0, out=shard)
            reduced = together(lambda i, group: dist.all_reduce(shards[i], group=group, async_op=True), second)
            _when_done(reduced, gather, result, issued)

        scattered = together(lambda i, group: dist.all_to_all_single(inboxes[i], padded[i], group=group, async_op=True),
                             first)
        _when_done([*scattered, previous], reduce, result, issued)
        return result

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


class _TwoLevelHookState:
    """The DDP hook's state for the two-level all-reduce: this rank's routes and, per step, each route's
    group (None: one rank, nothing to exchange). A gloo group's collectives must be issued in the same
    order on every rank, and completion callbacks fire in whatever order collectives complete, on
    gloo's threads. So step 1 goes on the groups the hook's thread uses (in bucket order, as DDP calls
    the hook on every rank; BatchNorm's span groups share them from the same thread), and steps 2 and
    3 on a second group per line and column, issued in one order on every rank: bucket i's step 2
    waits for `issued`, which completes once bucket i-1's step 3 has been issued."""

    def __init__(self, routes: list[tuple[tuple, tuple]], step_groups: list[list]):
        self.routes, self.step_groups = routes, step_groups
        self.issued = torch.futures.Future()
        self.issued.set_result(None)  # no bucket before the first
        self._scratch = {}

    def scratch(self, index: int, parts: list[torch.Tensor], dtype: torch.dtype) -> tuple[list, list, list]:
        """Bucket `index`'s buffers, per part: the part padded to a multiple of its scatter group, the
        inbox of its all-to-all (None: one rank) and this rank's shard. Kept from step to step: fresh
        buffers every step cost the CPU more (page faults) than the copies into them; made again when
        DDP rebuilds its buckets (after the first step, in the order gradients became ready)."""
        key = ([part.numel() for part in parts], dtype, parts[0].device)
        if index not in self._scratch or self._scratch[index][0] != key:
            padded = [parts[0].new_zeros(part.numel() + (-part.numel()) % len(scatter), dtype=dtype)
                      for part, (scatter, _) in zip(parts, self.routes)]
            inboxes = [None if len(scatter) == 1 else torch.empty_like(whole)
                       for whole, (scatter, _) in zip(padded, self.routes)]
            shards = [whole if inbox is None else whole.new_empty(whole.numel() // len(scatter))
                      for whole, inbox, (scatter, _) in zip(padded, inboxes, self.routes)]
            self._scratch[index] = (key, (padded, inboxes, shards))
        return self._scratch[index][1]


def _when_done(futures: list, then, *waiting) -> None:
    """Calls then() once every future has completed, from the thread that completes the last (no
    thread blocks). A failed collective's error, or then()'s, goes to the futures in `waiting` that are
    not done yet: nothing else would ever complete them."""
    def run(all_done) -> None:
        try:
            for future in all_done.value():
                future.wait()  # raises a failed collective's error; on CUDA, orders this stream after it
            then()
        except Exception as err:  # handed on to the futures that DDP and the later buckets wait on
            for future in waiting:
                if not future.done():
                    future.set_exception(err)
    torch.futures.collect_all(futures).then(run)


class Horovod(_Topology):
    """Horovod: DistributedOptimizer (gradient all-reduce overlapped with backward), gloo/MPI/NCCL."""
    name = "horovod"

    def __init__(self, cfg, launch=None):
        try:
            import horovod.torch as hvd
        except ImportError as err:
            raise UsageError(f"--engine horovod needs Horovod with PyTorch support ({err}); "
                             "run scripts/install_horovod.sh")
        self.hvd, self.cfg = hvd, cfg
        # under horovodrun's elastic mode (--min-np/--max-np/--host-discovery-script): train/elastic.py
        self.elastic = os.environ.get("HOROVOD_ELASTIC") == "1"
        if self.elastic and (cfg.allreduce != "flat" or cfg.bn_span != 1 or cfg.bn_group_size):
            raise UsageError("Horovod Elastic changes the rank count during the run: it takes --allreduce flat, "
                             "--bn-span 1 and no --bn-group-size (use torchrun's elastic restarts for the others)")
        if self.elastic:
            # a joining worker starts with an empty response cache while the others' caches survive
            # hvd.shutdown()/init(): their fused gradient all-reduces then disagree (gloo aborts)
            os.environ.setdefault("HOROVOD_CACHE_CAPACITY", "0")
        else:
            os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")  # BN groups and node sets are added after init
        if not torch.cuda.is_available():
            # Horovod's background thread wakes every cycle; on CPU-only hosts its default 1 ms cycle
            # takes cycles from the compute threads (scripts/bench/scaling.py: 0.57 -> 0.8 efficiency)
            os.environ.setdefault("HOROVOD_CYCLE_TIME", "20")
        if cfg.allreduce == "hierarchical" and torch.cuda.is_available() and hvd.nccl_built():
            # read by hvd.init() only; Horovod ignores it on one node and without MPI (wrap() then takes
            # the two-level optimizer: horovod_hierarchical)
            os.environ["HOROVOD_HIERARCHICAL_ALLREDUCE"] = "1"
        hvd.init()
        self.rejoin()

    def rejoin(self) -> None:
        """Rank, size and layout from Horovod, after hvd.init() (again, under Horovod Elastic). No
        collective there: a worker joining an elastic run must not issue one before the state sync."""
        hvd = self.hvd
        self.rank, self.world_size = hvd.rank(), hvd.size()
        self.device = _device(hvd.local_rank())
        host = socket.gethostname()
        self._layout(self.cfg, hvd.local_size() if self.elastic else hvd.allgather_object(host).count(host))
        self._groups = {}

    def _group(self, ranks):
        """The process set of these ranks. Process sets are added collectively by every rank, once each."""
        key = tuple(ranks)
        if len(key) == self.world_size:
            return self.hvd.global_process_set
        if key not in self._groups:
            self._groups[key] = self.hvd.add_process_set(list(key))
        return self._groups[key]

    def _differentiable_sum(self, process_set):
        hvd, device = self.hvd, self.device
        if device.type == "cpu":  # asleep while it waits (horovod_result; docs/allreduce.md has the figures)
            return lambda t: _HorovodSum.apply(t, hvd, process_set, device)
        return lambda t: hvd.allreduce(t, op=hvd.Sum, process_set=process_set)  # autograd-aware: backward sums too

    def wrap(self, model, optimizer):
        hvd = self.hvd
        if not self.elastic:  # (elastic: no collective before the elastic function, whose state sync broadcasts)
            if self.cfg.init_from_seed:
                self._check_same_model(model)  # instead of broadcasting rank 0's model
            else:
                self._broadcast_tensors(model.state_dict())
            # as an object: hvd.broadcast_optimizer_state would take a zero-gradient step, and LARS's
            # weight decay would then move the weights
            optimizer.load_state_dict(hvd.broadcast_object(optimizer.state_dict(), root_rank=0))
        native = horovod_hierarchical(hvd.nccl_built(), hvd.mpi_enabled(), self.device.type,
                                      self.world_size // hvd.local_size())
        if self.cfg.allreduce == "torus" or (self.cfg.allreduce == "hierarchical" and not native):
            return model, TwoLevelHorovodOptimizer(optimizer, self, self._two_level_routes(), list(model.parameters()))
        # flat, or hierarchical as Horovod's own HOROVOD_HIERARCHICAL_ALLREDUCE (set before hvd.init())
        compression = _contiguous(hvd.Compression.fp16 if self.cfg.fp16_allreduce else hvd.Compression.none)
        distributed = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                               compression=compression, op=hvd.Average)
        # Horovod's optimizer is a new one over the same parameters, with empty state: a resumed run's
        # momentum (and a broadcast one) would be lost without this
        distributed.load_state_dict(optimizer.state_dict())
        return model, distributed

    def step(self, loss, optimizer, precision) -> None:
        """All-reduce, synchronise, then unscale and check: every rank sees the same averaged
        gradients, so an overflow on one rank skips the step on all of them together."""
        precision.backward(loss)
        optimizer.synchronize()
        with optimizer.skip_synchronize():
            precision.step(optimizer)

    def unwrap(self, model):
        return model

    def _broadcast_tensors(self, tensors: dict, root: int = 0) -> None:
        """Rank `root`'s values into every rank's tensors; Horovod wants contiguous buffers (not channels_last)."""
        pending = []
        for name, t in tensors.items():
            buffer = t.contiguous()
            pending.append((t, buffer, self.hvd.broadcast_async_(buffer, root_rank=root, name=f"broadcast.{name}")))
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
        # every rank first: a rank whose own operations are done (say, rank 0 after its last all-gather of
        # the two-level all-reduce) would otherwise shut Horovod down under ranks still waiting on theirs
        self.hvd.barrier()
        self.hvd.shutdown()


def horovod_hierarchical(nccl_built, mpi_enabled: bool, device_type: str, nodes: int) -> bool:
    """Whether Horovod runs --allreduce hierarchical itself (HOROVOD_HIERARCHICAL_ALLREDUCE: NCCL inside
    the node, MPI across nodes), rather than TwoLevelHorovodOptimizer: with NCCL built, under MPI, on
    CUDA, over more than one node (Horovod's nodes: its local size, the real hosts). Elsewhere Horovod
    ignores the variable: one node, or gloo (its NCCL hierarchical all-reduce is an MPI operation)."""
    return bool(nccl_built) and bool(mpi_enabled) and device_type == "cuda" and nodes > 1


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


_TWO_LEVEL_BUCKET = 1 << 22  # elements per Horovod bucket: bounded messages
_STEPS = ("sum", "reduce", "gather")  # the two-level steps on Horovod, in order
_POLL_SLEEP_S = 0.002  # between polls while an operation is waited for on CPU (horovod_result)


def horovod_result(hvd, handle, device: torch.device):
    """The result of a Horovod operation in flight. Horovod's synchronize() waits by spinning (a yield in
    a loop): on a CPU host with more ranks than cores, the ranks that wait take the cores from those
    still computing (scripts/bench/scaling.py, 4 ranks on 2 cores: the two-level all-reduce at 0.58 x
    flat so). On CPU, then, poll and sleep until the operation is done (a failed one is done too:
    synchronize() raises its error). Poll only says when to look, never what to issue. A GPU host
    keeps Horovod's wait."""
    if device.type == "cpu":
        while not hvd.poll(handle):
            time.sleep(_POLL_SLEEP_S)
    return hvd.synchronize(handle)


class _HorovodSum(torch.autograd.Function):
    """The sum over a process set, as hvd.allreduce with op Sum (its gradient: the same sum of the
    gradients), waited for by horovod_result: BatchNorm's span sums, two per layer in every step."""

    @staticmethod
    def forward(ctx, tensor, hvd, process_set, device):
        ctx.sum = lambda t: horovod_result(hvd, hvd.allreduce_async(t.contiguous(), op=hvd.Sum,
                                                                   process_set=process_set), device)
        return ctx.sum(tensor)

    @staticmethod
    def backward(ctx, grad):
        return ctx.sum(grad), None, None, None


class _Bucket:
    """Parameters whose gradients travel together, and how far their two-level all-reduce has gone:
    `step` indexes _STEPS (None: not started; len(_STEPS): done), `flight` holds that step's handle
    per part (a one-rank set's part: the tensor itself, nothing to exchange)."""

    def __init__(self, index: int, params: list):
        self.index, self.params, self.ready = index, params, 0
        self.step, self.flight, self.flat = None, [], None

    def buffers(self, routes: list[tuple[tuple, tuple]], dtype: torch.dtype) -> None:
        """`flat`: the bucket's gradients as one message, cut into `parts`, one per route; `padded`: each
        part padded to a multiple of its scatter set, where steps 1 and 2 run in place. Made once and
        kept: fresh buffers every step cost the CPU more (page faults) than the copies into them."""
        if self.flat is None or self.flat.dtype != dtype:
            first = self.params[0]
            self.flat = first.new_empty(sum(p.numel() for p in self.params), dtype=dtype)
            self.parts = self.flat.tensor_split(len(routes))
            self.padded = [first.new_zeros(part.numel() + (-part.numel()) % len(scatter), dtype=dtype)
                           for part, (scatter, _) in zip(self.parts, routes)]


def _buckets(params, limit: int) -> list[_Bucket]:
    """Consecutive parameters in buckets of at most `limit` elements (a larger parameter alone)."""
    buckets, current, size = [], [], 0
    for p in params:
        if current and size + p.numel() > limit:
            buckets.append(_Bucket(len(buckets), current))
            current, size = [], 0
        current.append(p)
        size += p.numel()
    if current:
        buckets.append(_Bucket(len(buckets), current))
    return buckets


class TwoLevelHorovodOptimizer:
    """Wraps an optimizer: gradients are averaged over Horovod process sets along `routes`
    (two_level_routes): hierarchical sums inside the node, all-reduces each local rank's shard across
    nodes among the ranks with the same local rank (inter-node traffic 1/ranks-per-node of the
    gradients) and all-gathers the shards inside the node; torus does the same over the lines and
    columns of its grid, the first half of every bucket rows-first and the second half columns-first,
    both in flight at once.
    As Horovod's DistributedOptimizer, it starts during backward: the parameters (in the order of
    `params`, the model's, else the optimizer's) fall into buckets in reverse order, as DDP's, and a
    bucket's first step is issued when its last gradient is ready; synchronize() does the rest.
    The first sum is an all-reduce, not Horovod's reducescatter: on gloo with process sets, 0.28.1's
    reducescatter returned wrong shards now and then (tests caught it)."""

    def __init__(self, optimizer, engine: Horovod, routes: list[tuple[tuple, tuple]], params=None,
                 bucket_elements: int = _TWO_LEVEL_BUCKET):
        self.optimizer, self.engine, self.routes, self.hvd = optimizer, engine, routes, engine.hvd
        self._skip_synchronize = False
        mine = [p for group in optimizer.param_groups for p in group["params"]]
        known = {id(p) for p in mine}
        in_model_order = [p for p in params or () if id(p) in known]
        ordered = list({id(p): p for p in in_model_order + mine}.values())  # each once, the model's order first
        self._buckets = _buckets([p for p in reversed(ordered) if p.requires_grad], bucket_elements)
        for bucket in self._buckets:
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(lambda _, bucket=bucket: self._gradient_ready(bucket))

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

    def _gradient_ready(self, bucket: _Bucket) -> None:
        """A parameter's gradient is complete (its post-accumulate-grad hook, during backward): issue its
        bucket's first step once all the bucket's gradients are. Only that: what a rank issues during
        backward must not depend on timing (say, on which steps have completed), because Horovod names
        an operation issued without a name by a per-process counter of operations (BatchNorm's span
        all-reduces in backward are such): ranks that issued different counts would wait for ever."""
        if bucket.step is not None:
            raise RuntimeError("a gradient was computed again before optimizer.synchronize(): the two-level "
                               "all-reduce averages one backward pass per step")
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._start(bucket)

    def synchronize(self) -> None:
        """Average the gradients over all ranks, in place. Start the buckets backward has not (a parameter
        without a gradient sends zeros), then take every bucket through its remaining steps: one step of
        every bucket, in bucket order, before the next step, so that Horovod's thread runs one bucket's
        next step while this one waits for the following bucket's (on CPU asleep: horovod_result)."""
        for bucket in self._buckets:
            if bucket.step is None:
                self._start(bucket)
        for step in range(len(_STEPS)):
            for bucket in self._buckets:
                if bucket.step == step:
                    self._next(bucket)
        for bucket in self._buckets:
            bucket.step, bucket.ready = None, 0

    def _start(self, bucket: _Bucket) -> None:
        """The bucket's gradients into its message (fp16 with --fp16-allreduce), each part into its padded
        buffer (the padding stays zero: sums of zeros): issue step 1."""
        bucket.buffers(self.routes, torch.float16 if self.engine.cfg.fp16_allreduce else bucket.params[0].dtype)
        offset = 0
        for p in bucket.params:
            into = bucket.flat[offset:offset + p.numel()].view(p.shape)
            if p.grad is None:
                into.zero_()
            else:
                into.copy_(p.grad)
            offset += p.numel()
        for whole, part in zip(bucket.padded, bucket.parts):
            whole[:part.numel()].copy_(part)
        self._issue(bucket, 0, bucket.padded)

    def _issue(self, bucket: _Bucket, step: int, tensors: list[torch.Tensor]) -> None:
        """Issue step `step` for every part of the bucket, all before any is waited on (Horovod's thread
        runs them). A one-rank set has nothing to exchange. Names carry the set's id, the bucket and the
        part: Horovod matches operations across ranks by name."""
        hvd, name = self.hvd, _STEPS[step]
        bucket.step, bucket.flight = step, []
        for part, (tensor, route) in enumerate(zip(tensors, self.routes)):
            ranks = route[1] if name == "reduce" else route[0]
            if len(ranks) == 1:
                bucket.flight.append(tensor)
                continue
            group = self.engine._group(ranks)  # created by _two_level_routes on every rank
            tag = f"twolevel.{name}.ps{group.process_set_id}.{bucket.index}.{part}"
            bucket.flight.append(hvd.allgather_async(tensor, process_set=group, name=tag) if name == "gather" else
                                 hvd.allreduce_async_(tensor, op=hvd.Sum, process_set=group, name=tag))

    def _next(self, bucket: _Bucket) -> None:
        """Take the results of the bucket's step in flight (waiting for them if need be) and issue its
        next step, or write the averaged gradients back after the last."""
        results = [handle if isinstance(handle, torch.Tensor) else horovod_result(self.hvd, handle, self.engine.device)
                   for handle in bucket.flight]
        if bucket.step == 0:  # the sum over the scatter set, in place: this rank's shard of it goes on
            rank = self.engine.rank
            self._issue(bucket, 1, [total.view(len(scatter), -1)[scatter.index(rank)]
                                    for total, (scatter, _) in zip(results, self.routes)])
        elif bucket.step == 1:
            self._issue(bucket, 2, results)
        else:
            for part, gathered in zip(bucket.parts, results):
                part.copy_(gathered[:part.numel()])
            offset = 0
            for p in bucket.params:
                if p.grad is not None:  # divided after --fp16-allreduce's message is back in the gradient's type
                    p.grad.copy_(bucket.flat[offset:offset + p.numel()].view(p.shape)).div_(self.engine.world_size)
                offset += p.numel()
            bucket.step, bucket.flight = len(_STEPS), []


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
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        # the restarted workers would read the last attempt's addresses from torchrun's store and never connect
        raise UsageError("torchrun --max-restarts needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment "
                         "(with this torch its restarted workers cannot connect through the store it shares)")
    engine = ENGINES[choose_engine(cfg.engine, launch, env)](cfg, launch)
    if launch.distributed and engine.world_size != launch.world_size and not engine.elastic:
        raise UsageError(f"{launch.launcher} started {launch.world_size} ranks, but --engine {engine.name} sees "
                         f"{engine.world_size}; use the launcher's engine (--engine auto)")
    return engine
