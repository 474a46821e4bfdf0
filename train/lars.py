"""LARS with the MLPerf reference semantics (docs/lars.md), for PyTorch.

For every tensor not excluded:
    trust = eta * ||w|| / (||g|| + wd * ||w|| + eps), or 1 when ||w|| or ||g|| is 0
    m     = momentum * m + lr * trust * (g + wd * w)
    w     = w - m
Excluded tensors (a param group with "lars_exclude": True; BatchNorm parameters and biases)
get plain momentum on the raw gradient: m = momentum * m + lr * g, no weight decay.
epsilon 0 means 0. The step runs on whole tensor lists, and norms and trust ratios stay on the
device: no host sync, no branch on a tensor's value. Under fp16 loss scaling the step skips itself on
the device (`_step_supports_amp_scaling`: GradScaler hands it `found_inf` as a tensor instead of
reading it on the host every step); a skipped step leaves weights and momentum exactly as they were.
Precision.step unscales the gradients before (one fused pass that also finds an inf or NaN); a
`grad_scale` handed by another caller is divided out here. To save memory passes, step() scales the
.grad tensors in place into the update; they are not the raw gradients afterwards.

Kernels: a fixed number of multi-tensor calls per param group, none per tensor, each with arguments
CUDA's multi-tensor fast route takes (torch's ATen/native/ForeachUtils.h, `can_use_fast_route`: paired
lists equal in shape, strides, dtype and device; or a Python scalar, a scalar list, or one 0-dim tensor
of the list's dtype and device). The per-tensor factor lr * trust, a device value per tensor, has no
such form, so it is spread over a flat buffer (FlatViews), viewed per tensor in that tensor's shape and
strides, and multiplied in as a list. The trust-ratio group makes five passes over memory (the two
norms in one call, the spread, g + wd*w, the scaling, one fused momentum update: 14 element accesses
per weight) against SGD's one fused pass (5); docs/lars.md counts them.

`compiled=True` (--lars-compile) runs the trust-ratio tensors' update through torch.compile
instead: per tensor one kernel reads w and g for both norms and one reads g, w, m and writes w and
m, which is as few passes as the formula allows (SGD's plus the norms' reads). The first step pays
the compilation (about 20 s for ResNet-50 on a 2-core CPU, 2 s once Inductor's on-disk cache
has it); so it is opt-in, and tests that do not ask for it never compile. The compiled update leaves
.grad as it was; its results equal the eager step's to rounding (fused arithmetic).
"""
import functools
import itertools
import math

import torch


class LARS(torch.optim.Optimizer):
    _step_supports_amp_scaling = True  # skips by itself (amp_arguments)

    def __init__(self, params, lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 0.0,
                 eta: float = 0.001, epsilon: float = 0.0, compiled: bool = False):
        if lr < 0 or momentum < 0 or weight_decay < 0 or eta < 0 or epsilon < 0:
            raise ValueError("LARS hyperparameters must be non-negative")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta,
                        epsilon=epsilon, lars_exclude=False)
        super().__init__(params, defaults)
        self.compiled = compiled
        self._lr = None  # the compiled update's LR, a 0-dim tensor: a Python float would recompile per value
        self._scales = {}  # a group's tensor layouts -> FlatViews holding each tensor's lr * trust

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale, found_inf = amp_arguments(self)
        for group, params in groups_with_gradients(self):
            grads = gradients_in_layout(params)
            if grad_scale is not None:
                torch._foreach_div_(grads, grad_scale)  # (a power of two: exact, as GradScaler's own unscale)
            buffers = momentum_buffers(self, params)
            lr, momentum = group["lr"], group["momentum"]
            if group["lars_exclude"]:
                torch._foreach_mul_(grads, lr)
            elif self.compiled:
                keep = torch.ones((), device=params[0].device) if found_inf is None else 1 - found_inf
                _compiled_update()(params, grads, buffers, self._lr_tensor(lr, params[0].device), momentum,
                                   group["weight_decay"], group["eta"], group["epsilon"], keep)
                continue
            else:
                self._scale_by_trust(params, grads, lr, group["weight_decay"], group["eta"], group["epsilon"])
            # grads now hold lr * trust * (g + wd * w); one pass does m = momentum * m + that; w -= m
            momentum_step(params, grads, buffers, momentum, found_inf)
        return loss

    def _scale_by_trust(self, params, grads, lr: float, wd: float, eta: float, eps: float) -> None:
        """grads <- lr * trust * (g + wd * w), tensor by tensor, trust from each tensor's two norms."""
        norms = torch.stack(torch._foreach_norm(params + grads))  # one call: every ||w||, then every ||g||
        w_norm, g_norm = norms.view(2, -1).unbind()
        trust = torch.where((w_norm > 0) & (g_norm > 0), eta * w_norm / (g_norm + wd * w_norm + eps), 1.0)
        scales = flat_views(self._scales, params, keep=len(self.param_groups))
        scales.spread(trust * lr)
        if wd:
            torch._foreach_add_(grads, params, alpha=wd)
        torch._foreach_mul_(grads, scales.views)

    def _lr_tensor(self, lr: float, device: torch.device) -> torch.Tensor:
        if self._lr is None or self._lr.device != device:
            self._lr = torch.zeros((), dtype=torch.float32, device=device)
        return self._lr.fill_(lr)


class FlatViews:
    """One flat buffer over a list of tensors, and a view of it per tensor in that tensor's shape and
    strides: a list that pairs with the tensors (and with gradients in their layout) on CUDA's
    multi-tensor fast route. `spread(values)` writes each tensor's value over its elements. Made once
    per layout and reused: the buffer holds as many elements as the tensors."""

    def __init__(self, tensors: list[torch.Tensor]):
        numels = [t.numel() for t in tensors]
        # every tensor is a whole number of chunks (ResNets': 64 elements): the values go out chunk by
        # chunk through a small index, then over each chunk's elements in one broadcasting copy
        self.chunk = math.gcd(*numels) or 1
        self.flat = tensors[0].new_empty(sum(numels))
        self.by_chunk = self.flat.new_empty(self.flat.numel() // self.chunk)
        # (made on the device by fills, not copied from the host)
        self.owner = torch.cat([t.new_full((n // self.chunk,), i, dtype=torch.int32)
                                for i, (t, n) in enumerate(zip(tensors, numels))])
        self.views = [self.flat.as_strided(t.shape, t.stride(), offset)
                      for t, offset in zip(tensors, itertools.accumulate(numels, initial=0))]

    def spread(self, values: torch.Tensor) -> None:
        """values[i] (a 1-D device tensor, one value per tensor) into every element of view i."""
        torch.index_select(values.to(self.flat.dtype), 0, self.owner, out=self.by_chunk)
        self.flat.view(-1, self.chunk).copy_(self.by_chunk.unsqueeze(1).expand(-1, self.chunk))


def flat_views(cache: dict, tensors: list[torch.Tensor], keep: int) -> FlatViews:
    """The FlatViews over these tensors from `cache` (keyed by their shapes, strides, dtypes and devices),
    made there the first time; the cache holds the `keep` latest (one per param group: a group whose
    tensors with gradients change from step to step does not pile up buffers)."""
    layout = tuple((t.shape, t.stride(), t.dtype, t.device) for t in tensors)
    if layout not in cache:
        while len(cache) >= keep:
            del cache[next(iter(cache))]  # the oldest
        cache[layout] = FlatViews(tensors)
    return cache[layout]


def decay_param_groups(model: torch.nn.Module) -> list[dict]:
    """Every optimizer's two groups: the weights of convolutions and linear layers, then all BN
    parameters and biases (`lars_exclude`: no weight decay, and for LARS no trust ratio, as in the
    MLPerf reference)."""
    excluded_ids = set()
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._NormBase):
            excluded_ids.update(id(p) for p in module.parameters(recurse=False))
    regular, excluded = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (excluded if id(p) in excluded_ids or name.endswith("bias") else regular).append(p)
    return [{"params": regular, "lars_exclude": False}, {"params": excluded, "lars_exclude": True}]


def amp_arguments(optimizer) -> tuple:
    """(grad_scale, found_inf): the tensors GradScaler.step sets on an optimizer that declares
    `_step_supports_amp_scaling` (its loss scale, None when the gradients were unscaled before, as
    Precision.step does; and 1 where the scaled gradients held an inf or NaN), or (None, None) outside
    fp16 loss scaling."""
    return getattr(optimizer, "grad_scale", None), getattr(optimizer, "found_inf", None)


def groups_with_gradients(optimizer):
    """(param group, its parameters that have a gradient) for each group that has any."""
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        if params:
            yield group, params


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b lie in memory alike (shape, dtype, and strides where a dimension is over 1), as
    CUDA's multi-tensor kernels need of the tensors they walk together."""
    return (a.shape == b.shape and a.dtype == b.dtype
            and all(x == y for n, x, y in zip(a.shape, a.stride(), b.stride()) if n > 1))


def in_layout_of(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`tensor`, or a copy of it laid out as `like` where it is not."""
    return tensor if same_layout(tensor, like) else torch.empty_like(like).copy_(tensor)


def gradients_in_layout(params) -> list[torch.Tensor]:
    """Each parameter's gradient in the parameter's layout. The engines hand them so (autograd, DDP's
    buckets and Horovod's compressor keep a channels_last weight's gradient channels_last); a gradient
    in another layout, from another caller, is copied (its own kernel), since no multi-tensor kernel
    can pair tensors laid out differently."""
    return [in_layout_of(p.grad, p) for p in params]


def momentum_buffers(optimizer, params) -> list[torch.Tensor]:
    """Each parameter's optimizer.state[p]["momentum_buffer"], made at zero on first use and kept in the
    parameter's layout (a loaded state in another layout is laid out again, once)."""
    buffers = []
    for p in params:
        state = optimizer.state[p]
        buffer = state.get("momentum_buffer")
        buffer = torch.zeros_like(p) if buffer is None else in_layout_of(buffer, p)
        state["momentum_buffer"] = buffer
        buffers.append(buffer)
    return buffers


def momentum_step(params, grads, buffers, momentum: float, found_inf: torch.Tensor | None = None, *,
                  lr: float = 1.0, weight_decay: float = 0.0, nesterov: bool = False,
                  grad_scale: torch.Tensor | None = None) -> None:
    """torch's momentum SGD on tensor lists, in one fused pass (torch._fused_sgd_): d = g / grad_scale +
    weight_decay * w; m = momentum * m + d; w -= lr * m (Nesterov: w -= lr * (d + momentum * m));
    nothing at all changes where `found_inf` (a device flag) is 1. The kernel walks the three lists'
    memory together, so each parameter, gradient and buffer must share a layout (gradients_in_layout,
    momentum_buffers). Buffers start at zero, so the first step is m = d. (Never is_first_step: with it
    a skipped first step leaves the buffers uninitialised.)"""
    torch._fused_sgd_(params, grads, buffers if momentum else [], weight_decay=weight_decay, momentum=momentum,
                      lr=lr, dampening=0.0, nesterov=nesterov, maximize=False, is_first_step=False,
                      grad_scale=grad_scale, found_inf=found_inf)


def _update(params, grads, buffers, lr: torch.Tensor, momentum: float, wd: float, eta: float, eps: float,
            keep: torch.Tensor) -> None:
    """The trust-ratio group's step, tensor by tensor, written for torch.compile to fuse: each tensor's
    two norms in one pass, then m = momentum * m + lr * trust * (g + wd * w), w -= m in another; with
    `keep` 0 (fp16 loss scaling found an inf or NaN) both stay as they were."""
    for p, g, m in zip(params, grads, buffers):
        w_norm, g_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(g)
        trust = torch.where((w_norm > 0) & (g_norm > 0), eta * w_norm / (g_norm + wd * w_norm + eps),
                            torch.ones_like(w_norm))
        stepped = m * momentum + (g + wd * p) * (trust * lr)
        m.copy_(torch.where(keep > 0, stepped, m))
        p.sub_(torch.where(keep > 0, m, 0))


@functools.cache
def _compiled_update():
    return torch.compile(_update, fullgraph=True, dynamic=False)
