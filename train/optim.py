"""Optimizers by name (`--optimizer`): each is built from the run's settings and the model by one
registered factory. A new optimizer is a class (or torch's own) plus a factory registered here."""
import torch

from train.lars import LARS, lars_param_groups

OPTIMIZERS = {}  # --optimizer NAME -> factory(cfg, model, lr) -> torch.optim.Optimizer


def register(name: str):
    def add(factory):
        OPTIMIZERS[name] = factory
        return factory
    return add


def build_optimizer(cfg, model: torch.nn.Module) -> torch.optim.Optimizer:
    return OPTIMIZERS[cfg.optimizer](cfg, model, cfg.lr)


@register("lars")
def lars(cfg, model, lr):
    """MLPerf LARS: BatchNorm parameters and biases excluded from trust ratio and weight decay."""
    return LARS(lars_param_groups(model), lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                eta=cfg.lars_eta, epsilon=cfg.lars_epsilon, compiled=cfg.lars_compile)


def decay_groups(cfg, model) -> list[dict]:
    """Weight decay on the weights of convolutions and linear layers, none on BN parameters and biases."""
    regular, excluded = lars_param_groups(model)
    regular["weight_decay"], excluded["weight_decay"] = cfg.weight_decay, 0.0
    return [regular, excluded]


@register("sgd")
def sgd(cfg, model, lr):
    """Momentum SGD, weight decay on the weights of convolutions and linear layers only."""
    return torch.optim.SGD(decay_groups(cfg, model), lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov, foreach=True)


@register("rmsprop-warmup")
def rmsprop_warmup(cfg, model, lr):
    """Akiba et al.'s RMSprop warm-up: RMSprop blended into momentum SGD, the SGD share set by the
    schedule at every step (schedule.SgdShareRamp); weight decay as for SGD."""
    return RMSpropWarmup(decay_groups(cfg, model), lr=lr, momentum=cfg.momentum, alpha=cfg.rmsprop_alpha,
                         eps=cfg.rmsprop_epsilon, rms_lr_ratio=cfg.rmsprop_lr_ratio)


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

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            if group["weight_decay"]:
                grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
            states = [self.state[p] for p in params]
            for p, state in zip(params, states):
                if not state:
                    state["square_avg"], state["momentum_buffer"] = torch.zeros_like(p), torch.zeros_like(p)
            squares, buffers = [s["square_avg"] for s in states], [s["momentum_buffer"] for s in states]
            torch._foreach_mul_(squares, group["alpha"])
            torch._foreach_addcmul_(squares, grads, grads, value=1 - group["alpha"])
            rms = torch._foreach_add(torch._foreach_sqrt(squares), group["eps"])
            share = group["sgd_share"]
            directions = torch._foreach_div(grads, rms)
            torch._foreach_mul_(directions, (1 - share) * group["rms_lr_ratio"])
            torch._foreach_add_(directions, grads, alpha=share)
            torch._foreach_mul_(buffers, group["momentum"])
            torch._foreach_add_(buffers, directions)
            torch._foreach_add_(params, buffers, alpha=-group["lr"])
        return loss
