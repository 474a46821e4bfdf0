"""Horovod over gloo, MPI or NCCL, launched by horovodrun or mpirun; under horovodrun's elastic mode,
train/elastic.py. The gradients are averaged by an optimizer wrapper of our own that holds the run's
optimizer as it was built and overlaps the all-reduce with backward: flat (FlatHorovodOptimizer: one
Horovod all-reduce per gradient, as hvd.DistributedOptimizer issues them) or two-level, hierarchical
and torus (TwoLevelHorovodOptimizer, over the routes of train/engines/topology.py). On CPU every wait
on Horovod polls and sleeps (horovod_result) instead of spinning; on CUDA Horovod completes its
operations asynchronously (docs/gpu.md, "What the host waits for").
"""
import os

import torch
from torch.profiler import record_function

from train.engines.horovod_allreduce import FlatHorovodOptimizer, TwoLevelHorovodOptimizer, horovod_result
from train.engines.launch import local_device
from train.engines.network import collective_timeout, set_library_timeouts
from train.engines.distributed import DistributedEngine
from train.engines.wire import choose as choose_wire
from train.errors import UsageError


class Horovod(DistributedEngine):
    """Horovod: the gradient all-reduce overlapped with backward (an optimizer wrapper), gloo/MPI/NCCL."""
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
        elif not self.elastic:
            # read by hvd.init(): an operation on the GPU completes once it is queued, and the torch stream
            # waits for its event on the GPU, so synchronize() no longer holds the host until the GPU has
            # summed. (Elastic: Horovod looks for NCCL's errors only while its own thread waits for the GPU)
            os.environ.setdefault("HOROVOD_ENABLE_ASYNC_COMPLETION", "1")
        if cfg.allreduce == "hierarchical" and torch.cuda.is_available() and hvd.nccl_built():
            # read by hvd.init() only; Horovod ignores it on one node and without MPI (wrap() then takes
            # the two-level optimizer: horovod_hierarchical)
            os.environ["HOROVOD_HIERARCHICAL_ALLREDUCE"] = "1"
        if not self.elastic:  # (elastic: Horovod's own timeouts drive its recovery; left as they are)
            # gloo's and the stall inspector's, as a backstop (train/engines/network.py); read by hvd.init()
            set_library_timeouts(collective_timeout())
        hvd.init()
        self.rejoin()
        self.warning = nccl_warning(hvd.nccl_built(), self.device)

    def rejoin(self) -> None:
        """Rank, size and layout from Horovod, after hvd.init() (again, under Horovod Elastic). No
        collective there: a worker joining an elastic run must not issue one before the state sync."""
        hvd = self.hvd
        self.rank, self.world_size = hvd.rank(), hvd.size()
        self.device = local_device(hvd.local_rank())
        if self.elastic:  # (the hosts are not known without a collective)
            self._layout(self.cfg, hvd.local_size())
        else:
            self._meet(self.cfg, hvd.allgather_object)
        self._groups = {}

    def _group(self, ranks):
        """The process set of these ranks. Process sets are added collectively by every rank, once each."""
        key = tuple(ranks)
        if len(key) == self.world_size:
            return self.hvd.global_process_set
        if key not in self._groups:
            self._groups[key] = self.hvd.add_process_set(list(key))
        return self._groups[key]

    def _wire(self):
        """--fp16-allreduce's wire (train/engines/wire.py): Horovod refuses bf16 tensors, so a bf16
        run sends fp32."""
        return choose_wire(self.cfg, self.device, sends_bf16=False)

    @property
    def wire_note(self) -> str | None:
        return self._wire().note

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
                self.broadcast_tensors(model.state_dict())
            # as an object: hvd.broadcast_optimizer_state would take a zero-gradient step, and LARS's
            # weight decay would then move the weights
            optimizer.load_state_dict(hvd.broadcast_object(optimizer.state_dict(), root_rank=0))
        native = horovod_hierarchical(hvd.nccl_built(), hvd.mpi_enabled(), self.device.type,
                                      self.world_size // hvd.local_size())
        if self.cfg.allreduce == "torus" or (self.cfg.allreduce == "hierarchical" and not native):
            return model, TwoLevelHorovodOptimizer(optimizer, self, self._two_level_routes(), list(model.parameters()))
        # flat, or hierarchical as Horovod's own HOROVOD_HIERARCHICAL_ALLREDUCE (set before hvd.init())
        return model, FlatHorovodOptimizer(optimizer, self, model.named_parameters())

    def step(self, loss, optimizer, precision) -> None:
        """All-reduce, synchronise, then unscale and check: every rank sees the same averaged
        gradients, so an overflow on one rank skips the step on all of them together. The three
        parts are named ranges of a profiler trace."""
        with self._waiting("the gradient all-reduce"):
            with record_function("backward"):
                precision.backward(loss)
            with record_function("all-reduce"):
                optimizer.synchronize()
            with record_function("optimizer"), optimizer.skip_synchronize():
                precision.step(optimizer)

    def accumulating(self, model, optimizer):
        return optimizer.accumulating()  # (the wrappers' gradient hooks issue nothing until the step's last pass)

    def unwrap(self, model):
        return model

    def broadcast_tensors(self, tensors: dict, root: int = 0) -> None:
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
        with self._waiting("a sum of metrics"):
            return self.hvd.allreduce(tensor, op=self.hvd.Sum, name="metrics")

    def any(self, flag: bool) -> bool:
        with self._waiting("an agreement"):
            return bool(self.hvd.allreduce(torch.tensor([int(flag)]), op=self.hvd.Max, name="stop_flag").item())

    def max_over_ranks(self, values: list[int]) -> list[int]:
        with self._waiting("an agreement"):  # (a host tensor: no GPU sync)
            return self.hvd.allreduce(torch.tensor(values, dtype=torch.int64), op=self.hvd.Max, name="agreement").tolist()

    def broadcast_object(self, obj):
        with self._waiting("a broadcast"):
            return self.hvd.broadcast_object(obj, root_rank=0)

    def gather_object(self, obj) -> list:
        with self._waiting("an all-gather"):
            return self.hvd.allgather_object(obj)

    def barrier(self):
        with self._waiting("a barrier"):
            self.hvd.barrier()

    def shutdown(self):
        # every rank first: a rank whose own operations are done (say, rank 0 after its last all-gather of
        # the two-level all-reduce) would otherwise shut Horovod down under ranks still waiting on theirs
        self.hvd.barrier()
        self.hvd.shutdown()


def nccl_warning(nccl_built, device: torch.device) -> str:
    """A line for a GPU run whose Horovod was built without NCCL, else "": its all-reduces of GPU
    tensors then go through host memory. (Horovod takes NCCL only when the build sees a GPU or is
    told the GPUs' architectures.)"""
    if device.type != "cuda" or nccl_built:
        return ""
    return ("Horovod was built without NCCL (horovod.torch.nccl_built() is false): the gradient all-reduces of this "
            "GPU run go through host memory, many times slower; rebuild it with scripts/setup.sh on a node that sees "
            "the GPUs, or with TRAINER_GPUS set where it does not (docs/gpu.md)")


def horovod_hierarchical(nccl_built, mpi_enabled: bool, device_type: str, nodes: int) -> bool:
    """Whether Horovod runs --allreduce hierarchical itself (HOROVOD_HIERARCHICAL_ALLREDUCE: NCCL inside
    the node, MPI across nodes), rather than TwoLevelHorovodOptimizer: with NCCL built, under MPI, on
    CUDA, over more than one node (Horovod's nodes: its local size, the real hosts). Elsewhere Horovod
    ignores the variable: one node, or gloo (its NCCL hierarchical all-reduce is an MPI operation)."""
    return bool(nccl_built) and bool(mpi_enabled) and device_type == "cuda" and nodes > 1


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
