"""ResNets built on torchvision's definition, so checkpoints are interchangeable.

torchvision's ResNet-50 already puts the stride-2 on the 3x3 conv of each
downsampling bottleneck, which is what "v1.5" means.
"""
import torch
import torchvision

ARCHS = (
    "resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
    "resnext50_32x4d", "resnext101_32x8d", "resnext101_64x4d",
    "wide_resnet50_2", "wide_resnet101_2",
)


def build_model(arch: str = "resnet50", num_classes: int = 1000,
                zero_init_residual: bool = False, channels_last: bool = False) -> torch.nn.Module:
    """A freshly initialised model; zero_init_residual zeroes the last BN gamma of every block
    (Goyal et al.: each residual block starts as the identity)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    model = getattr(torchvision.models, arch)(weights=None, num_classes=num_classes,
                                              zero_init_residual=zero_init_residual)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def first_misfit(weights: dict, arch: str, num_classes: int) -> str | None:
    """The first tensor name of `weights` (a state_dict) that the model `arch` with `num_classes`
    classes lacks, does not have or has in another shape; None when every tensor fits. Shapes only:
    nothing is allocated."""
    with torch.device("meta"):
        expected = build_model(arch, num_classes).state_dict()
    names = [*expected, *(name for name in weights if name not in expected)]
    return next((name for name in names if name not in weights or name not in expected
                 or tuple(expected[name].shape) != tuple(weights[name].shape)), None)
