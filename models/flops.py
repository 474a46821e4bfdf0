"""Training FLOPs per image, counted by torch.utils.flop_counter (multiply-add = 2 FLOPs).

The model runs on the meta device, so counting ResNet-50 at 224 px costs well under a second
and no memory; results are cached per (arch, image size, classes, BlurPool) in memory and on disk.
The model is the one training builds (models.build_model), so what it runs is what is counted:
with BlurPool, each blur's depthwise 3x3 filter in the forward pass and its input gradient in the
backward pass (the filter is a constant: no gradient of its own is computed, so none is counted).
"""
import functools
import json
import os
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from data.cache import cache_root
from models.resnet import build_model

_COUNT_BATCH = 2  # BatchNorm in training mode wants more than one value per channel


def _cache_file() -> Path:
    return cache_root() / "flops.json"


@functools.lru_cache(maxsize=None)
def _count(arch: str, image_size: int, num_classes: int, blurpool: bool) -> tuple[int, int]:
    """(forward FLOPs, forward+backward FLOPs) per image."""
    key = f"{arch}/{image_size}/{num_classes}/torch-{torch.__version__}" + ("/blurpool" if blurpool else "")
    path = _cache_file()
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if key in cached:
        return tuple(cached[key])
    with torch.device("meta"):
        model = build_model(arch, num_classes=num_classes, blurpool=blurpool)
        images = torch.empty(_COUNT_BATCH, 3, image_size, image_size)
    with FlopCounterMode(display=False) as counter:
        logits = model(images)
    forward = counter.get_total_flops()
    with FlopCounterMode(display=False) as counter:
        model(images).sum().backward()
    total = counter.get_total_flops()
    result = (forward // _COUNT_BATCH, total // _COUNT_BATCH)
    del logits
    try:
        cached[key] = result
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cached, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs a recount
    return result


def train_flops_per_image(arch: str = "resnet50", image_size: int = 224, num_classes: int = 1000,
                          blurpool: bool = False) -> int:
    """Forward + backward FLOPs of one training image (ResNet-50 at 224 px: about 24.3e9), of the
    model with BlurPool's blurs when `blurpool`."""
    return _count(arch, image_size, num_classes, bool(blurpool))[1]


def eval_flops_per_image(arch: str = "resnet50", image_size: int = 224, num_classes: int = 1000,
                         blurpool: bool = False) -> int:
    """Forward-only FLOPs of one evaluated image (one pass: a flipped evaluation runs two)."""
    return _count(arch, image_size, num_classes, bool(blurpool))[0]
