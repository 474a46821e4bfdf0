"""ResNets built on torchvision's definition, so checkpoints are interchangeable.

torchvision's ResNet-50 already puts the stride-2 on the 3x3 conv of each
downsampling bottleneck, which is what "v1.5" means.
"""
import torch
import torchvision

from models import ARCHS


def build_model(arch: str = "resnet50", num_classes: int = 1000, zero_init_residual: bool = False,
                channels_last: bool = False, blurpool: bool = False) -> torch.nn.Module:
    """A freshly initialised model; zero_init_residual zeroes the last BN gamma of every block
    (Goyal et al.: each residual block starts as the identity); blurpool blurs before each strided
    convolution (BlurConv2d)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    model = getattr(torchvision.models, arch)(weights=None, num_classes=num_classes,
                                              zero_init_residual=zero_init_residual)
    if blurpool:
        add_blurpool(model)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


class BlurConv2d(torch.nn.Conv2d):
    """A strided convolution that first low-passes its input with a 3x3 binomial filter ([1, 2, 1]
    outer [1, 2, 1] / 16, per channel, stride 1, zero padding), so that the stride does not alias
    (Zhang 2019, "Making convolutional networks shift-invariant again"; FFCV and Composer use it on
    ResNet-50). A Conv2d itself: its parameters keep their state_dict names, so weights move between
    a model with it and torchvision's without it; the filter is a constant, not saved."""

    @classmethod
    def of(cls, conv: torch.nn.Conv2d) -> "BlurConv2d":
        blurred = cls(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                      conv.dilation, conv.groups, conv.bias is not None, conv.padding_mode,
                      device=conv.weight.device, dtype=conv.weight.dtype)
        blurred.load_state_dict(conv.state_dict())
        return blurred

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        row = torch.tensor([1.0, 2.0, 1.0])
        kernel = (row[:, None] * row[None, :]) / 16
        self.register_buffer("blur", kernel.expand(self.in_channels, 1, 3, 3).clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blurred = torch.nn.functional.conv2d(x, self.blur.to(x.dtype), padding=1, groups=self.in_channels)
        return super().forward(blurred)


def add_blurpool(model: torch.nn.Module) -> torch.nn.Module:
    """Every strided convolution with 16 or more input channels (not the stem's, on the RGB image)
    as a BlurConv2d, in place."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child) is torch.nn.Conv2d and max(child.stride) > 1 and child.in_channels >= 16:
                setattr(parent, name, BlurConv2d.of(child))
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
