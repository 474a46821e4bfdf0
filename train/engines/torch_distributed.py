"""torch.distributed: NCCL on GPUs, gloo on CPUs; DDP with gradient bucketing, and the two-level
all-reduces (hierarchical, torus) as one DDP communication hook over the routes of
train/engines/topology.py. Launched by torchrun, Slurm's srun, or mpirun with MASTER_ADDR set.
"""
import datetime
import inspect
import os
import weakref

import torch
from torch.profiler import record_function

from train.batches import accumulates
from train.engines.launch import detect_launch, local_device
from train.engines.network import collective_timeout, set_library_timeouts, watch_refusals
from train.engines.distributed import DistributedEngine
from train.engines.wire import choose as choose_wire, into_wire, split_average
from train.errors import UsageError


class TorchDistributed(DistributedEngine):
    """torch.distributed: NCCL on GPUs, gloo on CPUs; DDP with gradient bucketing."""
    name = "torch"
    elastic = False  # (torchrun's elastic restarts start new processes: restart is resume)
    warning = ""

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
        self.device = local_device(local_rank)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        # the backstop; the watchdog (train/engines/network.py) ends a wait at TRAINER_COLLECTIVE_TIMEOUT_S.
        # Every group gets it: new_group's own default is torch's (30 minutes on gloo, 10 on NCCL)
        self._timeout = timeout = datetime.timedelta(seconds=set_library_timeouts(collective_timeout()))
        watch = watch_refusals(self.rank)  # a rank on another node may refuse to start (torchrun)
        dist.init_process_group(backend, rank=self.rank, world_size=self.world_size, timeout=timeout,
                                device_id=self.device if backend == "nccl" else None)
        # host-side control messages (stop flags) travel over gloo: no GPU sync
        self.control = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None
        self._meet(cfg, self._gather_object)
        if watch:
            watch.set()
        self._groups = {}

    def _group(self, ranks):
        """The process group of these ranks, created on first use. Every rank must ask for every group
        in the same order (a torch.distributed rule): callers walk whole lists of groups."""
        key = tuple(ranks)
        if key not in self._groups:
            self._groups[key] = self.dist.new_group(list(key), timeout=self._timeout)
        return self._groups[key]

    def _wire(self):
        """--fp16-allreduce's wire (train/engines/wire.py): torch.distributed sends bf16 too."""
        return choose_wire(self.cfg, self.device, sends_bf16=True)

    @property
    def wire_note(self) -> str | None:
        return self._wire().note

    @staticmethod
    def _differentiable_sum(group):
        import torch.distributed._functional_collectives as functional  # differentiable: backward sums too
        return lambda t: functional.wait_tensor(functional.all_reduce(t, "sum", group))  # done before it is read

    def wrap(self, model, optimizer):
        from torch.nn.parallel import DistributedDataParallel
        if self.cfg.init_from_seed:
            self._check_same_model(model)
        options = ddp_options(self.cfg, self.device, inspect.signature(DistributedDataParallel).parameters)
        ddp = DistributedDataParallel(model, **options)
        wire = self._wire().dtype
        if self.cfg.allreduce != "flat":
            ddp.register_comm_hook(self._two_level_state(), self._two_level_hook)
        elif wire is not None:  # (otherwise DDP's own: divided by the rank count before the fp32 sum)
            ddp.register_comm_hook((wire, *split_average(self.world_size)), self._half_wire_hook)
        state = [optimizer.state_dict()]
        self.dist.broadcast_object_list(state, src=0, group=self.control)
        optimizer.load_state_dict(state[0])
        return ddp, optimizer

    def step(self, loss, optimizer, precision) -> None:
        """Backward (DDP averages the gradients during it, bucket by bucket) and the optimizer step, each
        a named range of a profiler trace."""
        with self._waiting("the gradient all-reduce"):
            with record_function("backward"):
                precision.backward(loss)
            with record_function("optimizer"):
                precision.step(optimizer)

    def accumulating(self, model, optimizer):
        return model.no_sync()  # (DDP: the forward pass inside it too, or the next backward all-reduces)

    def unwrap(self, model):
        return model.module

    def _half_wire_hook(self, state: tuple, bucket):
        """The flat all-reduce of one gradient bucket on --fp16-allreduce's wire, as a DDP comm hook
        (state: the wire type, and split_average's factor and divisor): the bucket x 2^-k into the wire
        type, summed over every rank, back into the bucket and divided by p / 2^k (wire.py says why)."""
        dtype, factor, divisor = state
        flat = bucket.buffer()
        message = flat.new_empty(flat.shape, dtype=dtype)
        into_wire(flat, factor, message)
        summed = self.dist.all_reduce(message, async_op=True).get_future()
        return summed.then(lambda done: flat.copy_(done.value()[0]).div_(divisor))

    def _two_level_state(self) -> "_TwoLevelHookState":
        """The hook's state: the routes, whose groups carry step 1, and a second group for every line and
        column, for steps 2 and 3 (every rank creates every group, in the same order); the wire."""
        routes = self._two_level_routes()
        _, lines, columns = self._two_level_grid()
        for ranks in lines + columns:
            if len(ranks) > 1 and ("later", ranks) not in self._groups:
                self._groups[("later", ranks)] = self.dist.new_group(list(ranks), timeout=self._timeout)

        def groups(which: int, later: bool) -> list:
            """Per route, the group of its scatter (0) or reduce (1) ranks: step 1's, or the second one."""
            keys = [("later", route[which]) if later else route[which] for route in routes]
            return [self._groups[key] if len(route[which]) > 1 else None for key, route in zip(keys, routes)]
        return _TwoLevelHookState(routes, [groups(0, False), groups(1, True), groups(0, True)], self._wire().dtype,
                                  split_average(self.world_size))

    def _two_level_hook(self, state: "_TwoLevelHookState", bucket):
        """Two-level all-reduce of one gradient bucket, as a DDP comm hook (state: _two_level_state).
        The bucket is cut into one part per route (torus: two halves), each padded to a multiple of its
        scatter group; each step (reduce-scatter, all-reduce of the shard, all-gather) is issued for
        every part before any is chained on, so the torus's two directions are in flight together.
        Nothing waits here: step 1 is issued now, steps 2 and 3 by callbacks when the step before has
        completed (step 2 also after the previous bucket's step 3 was issued: _TwoLevelHookState), and
        the returned future completes with the averaged bucket, so backward goes on meanwhile. The
        average is split around the sums (x 2^-k into the parts, / p / 2^k at the end: wire.py), on
        --fp16-allreduce's wire as on fp32.
        The reduce-scatter is an all-to-all of the part's chunks and a sum of the chunks received:
        gloo's reduce-scatter gives no future to chain on (Work::getFuture not implemented)."""
        flat = bucket.buffer()
        parts = flat.tensor_split(len(state.routes))
        padded, inboxes, shards = state.scratch(bucket.index(), parts, state.wire or flat.dtype)
        for whole, part in zip(padded, parts):
            into_wire(part, state.factor, whole[:part.numel()])  # the padding stays zero: sums of zeros
        all_gather = getattr(self.dist, "all_gather_single", None) or self.dist.all_gather_into_tensor
        dist, first, divisor = self.dist, state.step_groups[0], state.divisor
        # the callbacks below reach the groups through a weak reference: gloo's thread lets go of them when
        # it likes, and what it lets go of last is destroyed there (a process group's destructor on that
        # thread, as the interpreter ends, aborts the process: docs/stress.md)
        groups_of = weakref.ref(state)
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
            result.set_result(flat.div_(divisor))  # after the wire's parts are back in the gradients' type

        def gather() -> None:
            gathered = together(lambda i, group: all_gather(padded[i], shards[i], group=group, async_op=True),
                                groups_of().step_groups[2])
            issued.set_result(None)  # the next bucket's step 2 may be issued now
            _when_done(gathered, finish, result)

        def reduce() -> None:
            for inbox, shard in zip(inboxes, shards):
                if inbox is not None:  # every scatter rank's chunk of this rank's shard: their sum
                    torch.sum(inbox.view(-1, shard.numel()), 0, out=shard)
            reduced = together(lambda i, group: dist.all_reduce(shards[i], group=group, async_op=True),
                               groups_of().step_groups[1])
            _when_done(reduced, gather, result, issued)

        scattered = together(lambda i, group: dist.all_to_all_single(inboxes[i], padded[i], group=group, async_op=True),
                             first)
        _when_done([*scattered, previous], reduce, result, issued)
        return result

    def all_reduce_sum(self, tensor):
        with self._waiting("a sum of metrics"):
            self.dist.all_reduce(tensor)
        return tensor

    def any(self, flag: bool) -> bool:
        return self.max_over_ranks([int(flag)])[0] > 0

    def max_over_ranks(self, values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64)  # on the host, over gloo: no GPU sync
        with self._waiting("an agreement"):
            self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.control)
        return t.tolist()

    def broadcast_object(self, obj):
        box = [obj]
        with self._waiting("a broadcast"):
            self.dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather_object(self, obj) -> list:
        with self._waiting("an all-gather"):
            return self._gather_object(obj)

    def _gather_object(self, obj) -> list:
        everyone = [None] * self.world_size
        self.dist.all_gather_object(everyone, obj, group=self.control)
        return everyone

    def barrier(self):
        with self._waiting("a barrier"):
            self.dist.barrier(group=self.control)

    def shutdown(self):
        self.dist.destroy_process_group()


def ddp_options(cfg, device: torch.device, accepted) -> dict:
    """DistributedDataParallel's keyword arguments for this run (`accepted`: the names this torch's DDP
    takes; docs/allreduce.md says why each):
    - no per-step broadcast of BN buffers: each rank keeps its own running statistics, as the
      single-process run would (DDP still copies rank 0's parameters and buffers at construction,
      unless --init-from-seed, where the ranks' own models were checked to agree instead);
    - gradients as views into DDP's buckets (no copy into them);
    - static_graph (--ddp-static-graph; auto: on GPUs): every step uses the same parameters the same
      way, without control flow that depends on the step. Off wherever the run accumulates gradients
      (--accumulation-steps above 1 in some phase): DDP's static graph cannot be combined with
      no_sync, with which the passes before a step's last skip the all-reduce;
    - DDP's own bucket sizes: up to 1 MiB for the first bucket (the last layers' gradients, ready first,
      so the first all-reduce starts early), up to 25 MiB for the others."""
    options = {"device_ids": [device.index] if device.type == "cuda" else None, "gradient_as_bucket_view": True,
               "static_graph": (cfg.ddp_static_graph == "on" or (cfg.ddp_static_graph == "auto" and device.type == "cuda"))
               and not accumulates(cfg)}
    options["forward_sync_buffers" if "forward_sync_buffers" in accepted else "broadcast_buffers"] = False
    if cfg.init_from_seed and "init_sync" in accepted:
        options["init_sync"] = False
    return options


class _TwoLevelHookState:
    """The DDP hook's state for the two-level all-reduce: this rank's routes and, per step, each route's
    group (None: one rank, nothing to exchange). A gloo group's collectives must be issued in the same
    order on every rank, and completion callbacks fire in whatever order collectives complete, on
    gloo's threads. So step 1 goes on the groups the hook's thread uses (in bucket order, as DDP calls
    the hook on every rank; BatchNorm's span groups share them from the same thread), and steps 2 and
    3 on a second group per line and column, issued in one order on every rank: bucket i's step 2
    waits for `issued`, which completes once bucket i-1's step 3 has been issued.
    `wire`: --fp16-allreduce's wire type (None: the gradients' own); `average`: split_average's
    factor before the sums and divisor after them."""

    def __init__(self, routes: list[tuple[tuple, tuple]], step_groups: list[list], wire: torch.dtype | None,
                 average: tuple[float, float]):
        self.routes, self.step_groups, self.wire = routes, step_groups, wire
        self.factor, self.divisor = average
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
