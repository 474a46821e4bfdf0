"""LARS with the MLPerf reference semantics (docs/lars.md), for PyTorch.

For every tensor not excluded:
    trust = eta * ||w|| / (||g|| + wd * ||w|| + eps), or 1 when ||w|| or ||g|| is 0
    m     = momentum * m + lr * trust * (g + wd * w)
    w     = w - m
Excluded tensors (a param group with "lars_exclude": True; BatchNorm parameters and biases)
get plain momentum on the raw gradient: m = momentum * m + lr * g, no weight decay.
epsilon 0 means 0. The step runs on whole tensor lists (torch._foreach_*), and norms and
trust ratios stay on the device: no host sync, no branch on a tensor's value. Under fp16 loss
scaling the step unscales the gradients and skips itself on the device (`_step_supports_amp_scaling`:
GradScaler then hands it `grad_scale` and `found_inf` as tensors instead of reading found_inf on the
host every step); a skipped step leaves weights and momentum exactly as they were.
To save memory passes, step() scales the .grad tensors in place into the update; they are
not the raw gradients afterwards.

Cost: five passes over the weights (two norms, g + wd*w, the scaling, one fused momentum
update) against SGD's three. Each pass is memory-bound, so on a CPU a step costs about twice
SGD's (scripts/bench/lars_step.py).

`compiled=True` (--lars-compile) runs the trust-ratio tensors' update through torch.compile
instead: per tensor one kernel reads w and g for both norms and one reads g, w, m and writes w and
m, which is as few passes as the formula allows (SGD's plus the norms' reads). The first step pays
the compilation (about 20 s for ResNet-50 on a 2-core CPU, 2 s once Inductor's on-disk cache
has it); so it is opt-in, and tests that do not ask for it never compile. The compiled update leaves
.grad as it was; its results equal the eager step's to rounding (fused arithmetic).
"""
import functools

import torch


class LARS(torch.optim.Optimizer):
    _step_supports_amp_scaling = True  # unscales and skips by itself (amp_arguments)

    def __init__(self, params, lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 0.0,
                 eta: float = 0.001, epsilon: float = 0.0, compiled: bool = False):
        if lr < 0 or momentum < 0 or weight_decay < 0 or eta < 0 or epsilon < 0:
            raise ValueError("LARS hyperparameters must be non-negative")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta,
                        epsilon=epsilon, lars_exclude=False)
        super().__init__(params, defaults)
        self.compiled = compiled
        self._lr = None  # the compiled update's LR, a 0-dim tensor: a Python float would recompile per value

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale, found_inf = amp_arguments(self)
        for group, params in groups_with_gradients(self):
            grads = [p.grad for p in params]
            if grad_scale is not None:
                torch._foreach_div_(grads, grad_scale)  # (a power of two: exact, as GradScaler's own unscale)
            buffers = [self._momentum_buffer(p) for p in params]
            lr, momentum = group["lr"], group["momentum"]
            if group["lars_exclude"]:
                torch._foreach_mul_(grads, lr)
            elif self.compiled:
                keep = torch.ones((), device=params[0].device) if found_inf is None else 1 - found_inf
                _compiled_update()(params, grads, buffers, self._lr_tensor(lr, params[0].device), momentum,
                                   group["weight_decay"], group["eta"], group["epsilon"], keep)
                continue
            else:
                wd, eta, eps = group["weight_decay"], group["eta"], group["epsilon"]
                w_norm = torch.stack(torch._foreach_norm(params))
                g_norm = torch.stack(torch._foreach_norm(grads))
                trust = torch.where((w_norm > 0) & (g_norm > 0),
                                    eta * w_norm / (g_norm + wd * w_norm + eps),
                                    torch.ones_like(w_norm))
                if wd:
                    torch._foreach_add_(grads, params, alpha=wd)
                torch._foreach_mul_(grads, (trust * lr).unbind())
            # grads now hold lr * trust * (g + wd * w); one pass does m = momentum * m + that; w -= m
            momentum_step(params, grads, buffers, momentum, found_inf)
        return loss

    def _lr_tensor(self, lr: float, device: torch.device) -> torch.Tensor:
        if self._lr is None or self._lr.device != device:
            self._lr = torch.zeros((), dtype=torch.float32, device=device)
        return self._lr.fill_(lr)

    def _momentum_buffer(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["momentum_buffer"]


def lars_param_groups(model: torch.nn.Module) -> list[dict]:
    """Two groups: weights of convolutions and linear layers, then all BN parameters and biases
    (excluded from trust ratio and weight decay, as in the MLPerf reference)."""
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
    `_step_supports_amp_scaling` (its loss scale, and 1 where the scaled gradients held an inf or NaN),
    or (None, None) outside fp16 loss scaling."""
    return getattr(optimizer, "grad_scale", None), getattr(optimizer, "found_inf", None)


def groups_with_gradients(optimizer):
    """(param group, its parameters that have a gradient) for each group that has any."""
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        if params:
            yield group, params


def momentum_step(params, grads, buffers, momentum: float, found_inf: torch.Tensor | None = None, *,
                  lr: float = 1.0, weight_decay: float = 0.0, nesterov: bool = False,
                  grad_scale: torch.Tensor | None = None) -> None:
    """torch's momentum SGD on tensor lists: d = g / grad_scale + weight_decay * w; m = momentum * m + d;
    w -= lr * m (Nesterov: w -= lr * (d + momentum * m)); nothing at all changes where `found_inf` (a
    device flag) is 1. Buffers start at zero, so the first step is m = d."""
    if hasattr(torch, "_fused_sgd_") and all(p.stride() == g.stride() == b.stride()
                                             for p, g, b in zip(params, grads, buffers)):
        # one pass over params, grads and buffers, unscaled and skipped by the kernel itself; it walks raw
        # memory, so only when all three share a layout (a channels_last weight with a contiguous grad
        # would not). (Never is_first_step: with it a skipped first step leaves the buffers uninitialised.)
        torch._fused_sgd_(params, grads, buffers if momentum else [], weight_decay=weight_decay, momentum=momentum,
                          lr=lr, dampening=0.0, nesterov=nesterov, maximize=False, is_first_step=False,
                          grad_scale=grad_scale, found_inf=found_inf)
        return
    if grad_scale is not None:
        grads = torch._foreach_div(grads, grad_scale)
    if weight_decay:
        grads = torch._foreach_add(grads, params, alpha=weight_decay)
    if found_inf is None:
        torch._foreach_mul_(buffers, momentum)
        torch._foreach_add_(buffers, grads)
        torch._foreach_add_(params, torch._foreach_add(grads, buffers, alpha=momentum) if nesterov else buffers,
                            alpha=-lr)
        return
    skip = found_inf > 0  # layouts differ (rare): tensor by tensor, the skip as a choice on the device
    for p, d, b in zip(params, grads, buffers):
        b.copy_(torch.where(skip, b, b * momentum + d))
        p.sub_(torch.where(skip, 0, (d + momentum * b if nesterov else b) * lr))


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
