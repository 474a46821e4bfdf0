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
                eta=cfg.lars_eta, epsilon=cfg.lars_epsilon)


@register("sgd")
def sgd(cfg, model, lr):
    """Momentum SGD, weight decay on the weights of convolutions and linear layers only."""
    regular, excluded = lars_param_groups(model)
    regular["weight_decay"], excluded["weight_decay"] = cfg.weight_decay, 0.0
    return torch.optim.SGD([regular, excluded], lr=lr, momentum=cfg.momentum, foreach=True)
