"""The gradient all-reduces on Horovod, as optimizer wrappers that hold the run's optimizer as it was
built: flat (FlatHorovodOptimizer, Horovod's own all-reduce of each gradient) and two-level,
hierarchical and torus (TwoLevelHorovodOptimizer, over process sets along the routes of
train/engines/topology.py); both start during backward (docs/allreduce.md). And how a wait on Horovod
waits (horovod_result).
"""
import contextlib
import time

import torch

from train.engines.wire import into_wire, split_average


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


class HorovodOptimizer:
    """What Horovod's optimizer wrappers share: they hold the run's optimizer as it was built (its class,
    settings, state and state_dict) and average its gradients, started during backward, before its
    step; everything else is the held optimizer's. (hvd.DistributedOptimizer instead calls the
    optimizer's class again with the param groups alone: a constructor that needs more fails, and what
    an optimizer keeps outside its groups, such as LARS's compiled update, is lost.)"""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self._skip_synchronize = False
        self._accumulating = False

    def __getattr__(self, name):  # param_groups, state, state_dict(), zero_grad(), ...
        return getattr(self.optimizer, name)

    def synchronize(self) -> None:
        """Average the gradients over the ranks, in place."""
        raise NotImplementedError

    def step(self, closure=None):
        if not self._skip_synchronize:
            self.synchronize()
        # fp16: GradScaler hands the loss scale and the overflow flag to the optimizer it is given (this
        # wrapper) as attributes; the held optimizer unscales and skips with them (train/optim.py)
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
    def accumulating(self):
        """Backward passes whose gradients add up for a later step (--accumulation-steps): the gradient
        hooks issue nothing during them; the step's last pass issues the sums as usual."""
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    @contextlib.contextmanager
    def skip_synchronize(self):
        """As Horovod's DistributedOptimizer: step() without averaging again (fp16 loss scaling)."""
        self._skip_synchronize = True
        try:
            yield
        finally:
            self._skip_synchronize = False


class FlatHorovodOptimizer(HorovodOptimizer):
    """The flat all-reduce as hvd.DistributedOptimizer issues it: one all-reduce over every rank per
    gradient, named by its parameter, issued from the parameter's post-accumulate-grad hook as backward
    completes the gradient (Horovod's thread fuses those ready at once into one message); synchronize()
    issues any backward did not (a parameter without a gradient sends zeros and keeps None) and waits
    for all. Without --fp16-allreduce, Horovod's average in place in the gradient's memory (the fp32
    sum, then x 1/p); with it, the gradient x 2^-k into a kept fp16 message, summed, and back / p/2^k
    (train/engines/wire.py), with the rank count of the step (Horovod Elastic changes it)."""

    def __init__(self, optimizer, engine: "Horovod", named_parameters):
        super().__init__(optimizer)
        self.engine, self.hvd, self.wire = engine, engine.hvd, engine._wire().dtype
        names = {id(p): name for name, p in named_parameters}
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        # Horovod matches operations across ranks by name
        self._params = [(f"flat.{names.get(id(p), index)}", p) for index, p in enumerate(params)]
        self._messages = [None] * len(params)  # the fp16 wire's, made at the first step and kept
        self._flight = {}  # parameter index -> (handle, message, divisor: None when averaged in place)
        for index, (_, p) in enumerate(self._params):
            p.register_post_accumulate_grad_hook(lambda _, index=index: self._gradient_ready(index))

    def _gradient_ready(self, index: int) -> None:
        """The parameter's gradient is complete (its post-accumulate-grad hook, during backward): its
        all-reduce goes out. Only that, as for the two-level one (below): the same on every rank."""
        if self._accumulating:
            return
        if index in self._flight:
            raise RuntimeError("a gradient was computed again before optimizer.synchronize(): the all-reduce "
                               "averages one backward pass per step")
        self._issue(index)

    def _issue(self, index: int) -> None:
        """The parameter's gradient (zeros where it has none) into its message, and the all-reduce issued."""
        name, p = self._params[index]
        hvd, grad = self.hvd, p.grad if p.grad is not None else torch.zeros_like(p)
        if self.wire is None:
            message, divisor = _memory_vector(grad), None
            if message is None:  # (a layout with gaps: a contiguous copy goes and comes back)
                message, divisor = grad.contiguous(), 1.0
            handle = hvd.allreduce_async_(message, op=hvd.Average, name=name)
        else:
            factor, divisor = split_average(self.engine.world_size)
            if self._messages[index] is None:
                self._messages[index] = grad.new_empty(grad.shape, dtype=self.wire)
            message = self._messages[index]
            into_wire(grad, factor, message)
            handle = hvd.allreduce_async_(message, op=hvd.Sum, name=name)
        self._flight[index] = (handle, message, divisor)

    def synchronize(self) -> None:
        """Average the gradients over all ranks, in place: issue what backward did not, then wait for
        every all-reduce in the order issued (on CPU asleep: horovod_result)."""
        for index in range(len(self._params)):
            if index not in self._flight:
                self._issue(index)
        try:
            for index, (handle, message, divisor) in self._flight.items():
                horovod_result(self.hvd, handle, self.engine.device)
                grad = self._params[index][1].grad
                if grad is not None and divisor is not None:  # divided once back in the gradient's type
                    grad.copy_(message.view(grad.shape)).div_(divisor)
        finally:
            self._flight.clear()  # (after a failure too: Horovod Elastic rolls back and steps again)

    def load_state_dict(self, state: dict) -> None:
        """The held optimizer's state (a resume, or Horovod Elastic's rollback and state sync), and
        nothing left of a step that failed: no operation in flight, no gradient to add to."""
        self._flight.clear()
        self.optimizer.zero_grad()
        self.optimizer.load_state_dict(state)


def _memory_vector(tensor: torch.Tensor) -> torch.Tensor | None:
    """A contiguous or channels_last tensor's memory as a 1-D view, in memory order: an elementwise
    sum over ranks lines up, since every rank's gradient has its parameter's layout; None otherwise."""
    if tensor.is_contiguous():
        return tensor.view(-1)
    if tensor.dim() == 4 and tensor.is_contiguous(memory_format=torch.channels_last):
        return tensor.permute(0, 2, 3, 1).view(-1)
    return None


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


class TwoLevelHorovodOptimizer(HorovodOptimizer):
    """Holds an optimizer: its gradients are averaged over Horovod process sets along `routes`
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

    def __init__(self, optimizer, engine: "Horovod", routes: list[tuple[tuple, tuple]], params=None,
                 bucket_elements: int = _TWO_LEVEL_BUCKET):
        super().__init__(optimizer)
        self.engine, self.routes, self.hvd = engine, routes, engine.hvd
        # --fp16-allreduce's wire (None: the gradients' type), and the average split around the sums
        # (x 2^-k into the message, / p / 2^k out of it: wire.py), on every wire alike
        self.wire, (self.factor, self.divisor) = engine._wire().dtype, split_average(engine.world_size)
        mine = [p for group in optimizer.param_groups for p in group["params"]]
        known = {id(p) for p in mine}
        in_model_order = [p for p in params or () if id(p) in known]
        ordered = list({id(p): p for p in in_model_order + mine}.values())  # each once, the model's order first
        self._buckets = _buckets([p for p in reversed(ordered) if p.requires_grad], bucket_elements)
        for bucket in self._buckets:
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(lambda _, bucket=bucket: self._gradient_ready(bucket))

    def _gradient_ready(self, bucket: _Bucket) -> None:
        """A parameter's gradient is complete (its post-accumulate-grad hook, during backward): issue its
        bucket's first step once all the bucket's gradients are. Only that: what a rank issues during
        backward must not depend on timing (say, on which steps have completed), because Horovod names
        an operation issued without a name by a per-process counter of operations (BatchNorm's span
        all-reduces in backward are such): ranks that issued different counts would wait for ever."""
        if self._accumulating:
            return
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
