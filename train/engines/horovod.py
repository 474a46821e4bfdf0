"""Horovod: DistributedOptimizer (the gradient all-reduce overlapped with backward) over gloo, MPI or
NCCL, launched by horovodrun or mpirun; under horovodrun's elastic mode, train/elastic.py. The
two-level all-reduces (hierarchical, torus) are an optimizer wrapper of our own
(TwoLevelHorovodOptimizer) over the routes of train/engines/topology.py, and on CPU every wait on
Horovod polls and sleeps (horovod_result) instead of spinning.
"""
import contextlib
import os
import time

import torch

from train.engines.launch import local_device
from train.engines.network import collective_timeout, set_library_timeouts
from train.engines.topology import Topology
from train.engines.wire import choose as choose_wire, into_wire, split_average
from train.errors import UsageError


class Horovod(Topology):
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
        if not self.elastic:  # (elastic: Horovod's own timeouts drive its recovery; left as they are)
            # gloo's and the stall inspector's, as a backstop (train/engines/network.py); read by hvd.init()
            set_library_timeouts(collective_timeout())
        hvd.init()
        self.rejoin()

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
        # flat, or hierarchical as Horovod's own HOROVOD_HIERARCHICAL_ALLREDUCE (set before hvd.init()).
        # fp16 wire: a sum, the average split around it by the compressor; otherwise Horovod's average
        # (the fp32 sum, then a division)
        half = self._wire().dtype is not None
        compression = _contiguous(_HalfWire(self) if half else hvd.Compression.none)
        distributed = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                               compression=compression, op=hvd.Sum if half else hvd.Average)
        # Horovod's optimizer is a new one over the same parameters, with empty state: a resumed run's
        # momentum (and a broadcast one) would be lost without this
        distributed.load_state_dict(optimizer.state_dict())
        return model, distributed

    def step(self, loss, optimizer, precision) -> None:
        """All-reduce, synchronise, then unscale and check: every rank sees the same averaged
        gradients, so an overflow on one rank skips the step on all of them together."""
        with self._waiting("the gradient all-reduce"):
            precision.backward(loss)
            optimizer.synchronize()
            with optimizer.skip_synchronize():
                precision.step(optimizer)

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


def horovod_hierarchical(nccl_built, mpi_enabled: bool, device_type: str, nodes: int) -> bool:
    """Whether Horovod runs --allreduce hierarchical itself (HOROVOD_HIERARCHICAL_ALLREDUCE: NCCL inside
    the node, MPI across nodes), rather than TwoLevelHorovodOptimizer: with NCCL built, under MPI, on
    CUDA, over more than one node (Horovod's nodes: its local size, the real hosts). Elsewhere Horovod
    ignores the variable: one node, or gloo (its NCCL hierarchical all-reduce is an MPI operation)."""
    return bool(nccl_built) and bool(mpi_enabled) and device_type == "cuda" and nodes > 1


class _HalfWire:
    """A Horovod compressor for the fp16 wire, with op Sum: the gradient x 2^-k rounded once into fp16,
    and the sum back in the gradient's type divided by p / 2^k (train/engines/wire.py). The rank count
    is the engine's at the time (it changes between steps under Horovod Elastic)."""

    def __init__(self, engine: "Horovod"):
        self.engine = engine

    def compress(self, tensor):
        factor, divisor = split_average(self.engine.world_size)
        message = tensor.new_empty(tensor.shape, dtype=torch.float16)
        into_wire(tensor, factor, message)
        return message, (tensor.dtype, divisor)

    @staticmethod
    def decompress(tensor, ctx):
        dtype, divisor = ctx
        return tensor.to(dtype).div_(divisor)


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
        # --fp16-allreduce's wire (None: the gradients' type), and the average split around the sums
        # (x 2^-k into the message, / p / 2^k out of it: wire.py), on every wire alike
        self.wire, (self.factor, self.divisor) = engine._wire().dtype, split_average(engine.world_size)
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
        # fp16: GradScaler hands the loss scale and the overflow flag to the optimizer it is given (this
        # wrapper) as attributes; the wrapped optimizer unscales and skips with them (train/optim.py)
        handed = {name: vars(self).pop(name) for name in ("grad_scale", "found_inf") if name in vars(self)}
        for name, value in handed.items():
            setattr(self.optimizer, name, value)
        try:
            return self.optimizer.step(closure)
        finally:
            for name, value in handed.items():
                delattr(self.optimizer, name)
                setattr(self, name, value)  # (GradScaler deletes them from the wrapper afterwards)

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
        """The bucket's gradients x 2^-k into its message (in the wire's type), each part into its padded
        buffer (the padding stays zero: sums of zeros): issue step 1."""
        bucket.buffers(self.routes, self.wire or bucket.params[0].dtype)
        offset = 0
        for p in bucket.params:
            into = bucket.flat[offset:offset + p.numel()].view(p.shape)
            if p.grad is None:
                into.zero_()
            else:
                into_wire(p.grad, self.factor, into)
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
                if p.grad is not None:  # divided once the message is back in the gradient's type
                    p.grad.copy_(bucket.flat[offset:offset + p.numel()].view(p.shape)).div_(self.divisor)
                offset += p.numel()
            bucket.step, bucket.flight = len(_STEPS), []
