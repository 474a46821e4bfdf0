"""What is trained: torchvision's ResNets (ResNet-50 is v1.5), their FLOP counts, and what a
training step of them holds in GPU memory.

The names below are imported on first use: models.memory needs no torch, and the planner's --help
(which imports it) must not load torch through this package."""
import importlib

_NAMES = {"ARCHS": "models.resnet", "build_model": "models.resnet", "first_misfit": "models.resnet",
          "train_flops_per_image": "models.flops", "eval_flops_per_image": "models.flops"}


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")


__all__ = list(_NAMES)
