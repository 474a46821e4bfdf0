"""What is trained: torchvision's ResNets (ResNet-50 is v1.5), their FLOP counts, and what a training
step of them holds in GPU memory (models/memory.py, which the planner imports where it needs it).

ARCHS, the names --arch takes, is here without torch: train/config.py lists them for a --help that
loads no torch. The rest is imported on first use (models/resnet.py, models/flops.py).
"""
import importlib

ARCHS = (
    "resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
    "resnext50_32x4d", "resnext101_32x8d", "resnext101_64x4d",
    "wide_resnet50_2", "wide_resnet101_2",
)
_NAMES = {"build_model": "models.resnet", "first_misfit": "models.resnet",
          "train_flops_per_image": "models.flops", "eval_flops_per_image": "models.flops"}


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")


__all__ = ["ARCHS", "build_model", "first_misfit", "train_flops_per_image", "eval_flops_per_image"]
