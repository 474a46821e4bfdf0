"""LARS with the MLPerf reference semantics (docs/lars.md), for PyTorch.

For every tensor not excluded:
    trust = eta * ||w|| / (||g|| + wd * ||w|| + eps), or 1 when ||w|| or ||g|| is 0
    m     = momentum * m + lr * trust * (g + wd * w)
    w     = w - m
Excluded tensors (a param group with "lars_exclude": True; BatchNorm parameters and biases)
get plain momentum on the raw gradient: m = momentum * m + lr * g, no weight decay.
epsilon 0 means 0. The step runs on whole tensor lists (torch._foreach_*), and norms and
trust ratios stay on the device: no host sync, no branch on a tensor's value.
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
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            buffers = [self._momentum_buffer(p) for p in params]
            lr, momentum = group["lr"], group["momentum"]
            if group["lars_exclude"]:
                torch._foreach_mul_(grads, lr)
            elif self.compiled:
                _compiled_update()(params, grads, buffers, self._lr_tensor(lr, params[0].device), momentum,
                                   group["weight_decay"], group["eta"], group["epsilon"])
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
            _momentum_step(params, grads, buffers, momentum)
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


def _momentum_step(params, updates, buffers, momentum: float) -> None:
    if momentum == 0:
        torch._foreach_copy_(buffers, updates)
        torch._foreach_sub_(params, updates)
    elif hasattr(torch, "_fused_sgd_") and all(p.stride() == u.stride() == b.stride()
                                               for p, u, b in zip(params, updates, buffers)):
        # one pass over params, updates and buffers; the fused kernel walks raw memory, so only
        # when all three share a layout (a channels_last weight with a contiguous grad would not)
        torch._fused_sgd_(params, updates, buffers, weight_decay=0.0, momentum=momentum, lr=1.0, dampening=0.0,
                          nesterov=False, maximize=False, is_first_step=False)
    else:
        torch._foreach_mul_(buffers, momentum)
        torch._foreach_add_(buffers, updates)
        torch._foreach_sub_(params, buffers)


def _update(params, grads, buffers, lr: torch.Tensor, momentum: float, wd: float, eta: float, eps: float) -> None:
    """The trust-ratio group's step, tensor by tensor, written for torch.compile to fuse: each tensor's
    two norms in one pass, then m = momentum * m + lr * trust * (g + wd * w), w -= m in another."""
    for p, g, m in zip(params, grads, buffers):
        w_norm, g_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(g)
        trust = torch.where((w_norm > 0) & (g_norm > 0), eta * w_norm / (g_norm + wd * w_norm + eps),
                            torch.ones_like(w_norm))
        m.mul_(momentum).add_((g + wd * p) * (trust * lr))
        p.sub_(m)


@functools.cache
def _compiled_update():
    return torch.compile(_update, fullgraph=True, dynamic=False)
