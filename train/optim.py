"""Optimizers by name (`--optimizer`): each is built from the run's settings and the model by one
registered factory. A new optimizer is a class plus a factory registered here.

Every optimizer here declares `_step_supports_amp_scaling`: under fp16 loss scaling it skips an
overflowing step on the device (train/lars.py amp_arguments), so that GradScaler never reads its
found-inf flag on the host (a wait for the GPU in every step); Precision.step has the scaler unscale
the gradients first, and a loss scale handed by another caller is divided out here.

Their steps run on whole tensor lists, in calls CUDA's multi-tensor fast route takes (train/lars.py,
docs/lars.md), none per tensor: SGD is one fused pass per group (momentum_step); the RMSprop warm-up
eleven multi-tensor calls per group (twelve with weight decay), and under fp16 loss scaling a copy of
the gradients into a flat buffer and one fill there.
"""
import torch

from train.config import CHOICES
from train.lars import (LARS, amp_arguments, decay_param_groups, flat_views, gradients_in_layout, groups_with_gradients,
                        in_layout_of, momentum_buffers, momentum_step)

OPTIMIZERS = {}  # --optimizer NAME -> factory(cfg, model, lr) -> torch.optim.Optimizer


def register(name: str):
    """Registers a factory under one of the names --optimizer lists (train/config.py, where --help
    reads them without loading torch)."""
    if name not in CHOICES["optimizer"]:
        raise ValueError(f"optimizer {name!r} is not one of --optimizer's choices; add it to them in train/config.py")

    def add(factory):
        OPTIMIZERS[name] = factory
        return factory
    return add


def build_optimizer(cfg, model: torch.nn.Module) -> torch.optim.Optimizer:
    return OPTIMIZERS[cfg.optimizer](cfg, model, cfg.lr)


@register("lars")
def lars(cfg, model, lr):
    """MLPerf LARS: BatchNorm parameters and biases excluded from trust ratio and weight decay."""
    return LARS(decay_param_groups(model), lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                eta=cfg.lars_eta, epsilon=cfg.lars_epsilon, compiled=cfg.lars_compile)


def groups_with_weight_decay(cfg, model) -> list[dict]:
    """Weight decay on the weights of convolutions and linear layers, none on BN parameters and biases."""
    regular, excluded = decay_param_groups(model)
    regular["weight_decay"], excluded["weight_decay"] = cfg.weight_decay, 0.0
    return [regular, excluded]


@register("sgd")
def sgd(cfg, model, lr):
    """Momentum SGD, weight decay on the weights of convolutions and linear layers only."""
    return SGD(groups_with_weight_decay(cfg, model), lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov)


class SGD(torch.optim.SGD):
    """torch's momentum SGD (its settings, arithmetic and state_dict), stepped by one fused pass per group
    that also unscales and skips on the device under fp16 loss scaling. (torch's own fused SGD leaves a
    skipped first step's momentum uninitialised, so it is not used as it is.)"""
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        grad_scale, found_inf = amp_arguments(self)
        for group, params in groups_with_gradients(self):
            momentum_step(params, gradients_in_layout(params), momentum_buffers(self, params), group["momentum"],
                          found_inf, lr=group["lr"], weight_decay=group["weight_decay"], nesterov=group["nesterov"],
                          grad_scale=grad_scale)
        return loss


@register("rmsprop-warmup")
def rmsprop_warmup(cfg, model, lr):
    """Akiba et al.'s RMSprop warm-up: RMSprop blended into momentum SGD, the SGD share set by the
    schedule at every step (schedule.SgdShareRamp); weight decay as for SGD."""
    return RMSpropWarmup(groups_with_weight_decay(cfg, model), lr=lr, momentum=cfg.momentum,
                         alpha=cfg.rmsprop_alpha, eps=cfg.rmsprop_epsilon, rms_lr_ratio=cfg.rmsprop_lr_ratio)


class RMSpropWarmup(torch.optim.Optimizer):
    """One momentum buffer fed by a blend of the two updates, share s = the group's `sgd_share`:

        g = grad + wd * w;  v = alpha * v + (1 - alpha) * g**2
        d = s * g + (1 - s) * rms_lr_ratio * g / (sqrt(v) + eps)
        buf = momentum * buf + d;  w = w - lr * buf

    At s = 1 this is torch's SGD (momentum, weight decay); at s = 0 torch's RMSprop with momentum and
    learning rate lr * rms_lr_ratio. v is kept up to date at every share, so the blend moves smoothly."""

    def __init__(self, params, lr: float, momentum: float = 0.9, alpha: float = 0.99, eps: float = 1e-8,
                 rms_lr_ratio: float = 1.0, weight_decay: float = 0.0, sgd_share: float = 0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, alpha=alpha, eps=eps, rms_lr_ratio=rms_lr_ratio,
                                      weight_decay=weight_decay, sgd_share=sgd_share))
        self._zeroable = {}  # a group's tensor layouts -> FlatViews: its gradients, zeroed on a skipped step

    _step_supports_amp_scaling = True  # skips by itself (see the module's docstring)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        grad_scale, found_inf = amp_arguments(self)
        for group, params in groups_with_gradients(self):
            grads = gradients_in_layout(params)
            if grad_scale is not None:
                grads = torch._foreach_div(grads, grad_scale)  # (a power of two: exact, as GradScaler's own unscale)
            if group["weight_decay"]:
                grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
            alpha, momentum, lr = group["alpha"], group["momentum"], group["lr"]
            if found_inf is not None:
                # a skipped step (found_inf 1) changes nothing: zero gradients (no inf or NaN left in them:
                # copied into one flat buffer and zeroed there in one kernel) with factors that keep every
                # state as it is, chosen on the device
                zeroable = flat_views(self._zeroable, params, keep=len(self.param_groups))
                torch._foreach_copy_(zeroable.views, grads)
                zeroable.flat.masked_fill_(found_inf > 0, 0.0)
                grads = zeroable.views
                keep = found_inf == 0
                alpha, momentum = torch.where(keep, alpha, 1.0), torch.where(keep, momentum, 1.0)
                lr = torch.where(keep, lr, 0.0)
            states = [self.state[p] for p in params]
            for p, state in zip(params, states):
                for key in ("square_avg", "momentum_buffer"):  # in the parameter's layout, as the gradients
                    state[key] = in_layout_of(state[key], p) if key in state else torch.zeros_like(p)
            squares, buffers = [s["square_avg"] for s in states], [s["momentum_buffer"] for s in states]
            torch._foreach_mul_(squares, alpha)
            torch._foreach_addcmul_(squares, grads, grads, value=1 - group["alpha"])
            rms = torch._foreach_add(torch._foreach_sqrt(squares), group["eps"])
            share = group["sgd_share"]
            directions = torch._foreach_div(grads, rms)
            torch._foreach_mul_(directions, (1 - share) * group["rms_lr_ratio"])
            torch._foreach_add_(directions, grads, alpha=share)
            torch._foreach_mul_(buffers, momentum)
            torch._foreach_add_(buffers, directions)
            torch._foreach_sub_(params, torch._foreach_mul(buffers, lr))  # (lr a float, or a tensor: the same rounding)
        return loss
