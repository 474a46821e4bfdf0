"""--ema-decay: an exponential moving average of the weights, the model that is evaluated.

After every optimizer step each averaged tensor moves towards the trained one,
`average += (1 - decay) * (weight - average)`, as one foreach pass on the device (no host read).
Parameters and BatchNorm's running statistics are averaged alike (the statistics belong to the
weights they were gathered under); the batch counters are copied when the average is read
(evaluated or saved), not at every step. The average lives in a plain model of
the same architecture, never wrapped by the engine: it is only evaluated, so every rank keeps its own
copy (the same on every rank, since the weights are), and evaluating it issues no collective.

Its state_dict has the model's keys, so checkpoints keep it under "ema" as a second set of weights,
and --test-only, predict and export read it instead of "model" where it is there
(train/checkpoint.py evaluated_weights).
"""
import torch

from models import build_model


class WeightAverage:
    """The average of `model`'s weights (the engine's unwrapped model), started from them."""

    def __init__(self, model: torch.nn.Module, decay: float, arch: str, num_classes: int, channels_last: bool,
                 blurpool: bool):
        self.decay = decay
        self.model = build_model(arch, num_classes, channels_last=channels_last, blurpool=blurpool)
        self.model.to(next(model.parameters()).device).eval().requires_grad_(False)
        trained, averaged = model.state_dict(), self.model.state_dict()
        if trained.keys() != averaged.keys():  # (the engine's BatchNorm keeps torchvision's names: models/batchnorm.py)
            raise ValueError(f"the trained model's weights are not {arch}'s: {sorted(trained.keys() ^ averaged.keys())[:3]}")
        floats = [name for name, tensor in averaged.items() if tensor.is_floating_point()]
        # the live tensors: an optimizer step and a load_state_dict change them in place
        self.trained = [trained[name] for name in floats]
        self.averaged = [averaged[name] for name in floats]
        self.counters = [(averaged[name], trained[name]) for name in averaged if name not in floats]
        self.restart()

    @classmethod
    def of(cls, cfg, model: torch.nn.Module, num_classes: int) -> "WeightAverage":
        """The average --ema-decay asks for, of the run's model (cfg: the run's settings)."""
        return cls(model, cfg.ema_decay, cfg.arch, num_classes, cfg.channels_last, cfg.blurpool)

    @torch.no_grad()
    def restart(self) -> None:
        """The average set to the trained weights themselves (the start of a run)."""
        torch._foreach_copy_(self.averaged, self.trained)
        self.copy_counters()

    @torch.no_grad()
    def update(self) -> None:
        torch._foreach_lerp_(self.averaged, self.trained, 1.0 - self.decay)

    @torch.no_grad()
    def copy_counters(self) -> None:
        for averaged, trained in self.counters:
            averaged.copy_(trained)

    def evaluated(self) -> torch.nn.Module:
        """The average as a model to evaluate (its batch counters brought up to date)."""
        self.copy_counters()
        return self.model

    def state_dict(self) -> dict:
        return self.evaluated().state_dict()

    def load_state_dict(self, weights: dict | None) -> None:
        """A checkpoint's average; None (a checkpoint of a run without one): the weights themselves."""
        if weights is None:
            self.restart()
        else:
            self.model.load_state_dict(weights)
