"""Training FLOPs per image, counted by torch.utils.flop_counter (multiply-add = 2 FLOPs).

The model runs on the meta device, so counting ResNet-50 at 224 px costs well under a second
and no memory; results are cached per (arch, image size, classes) in memory and on disk.
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
def _count(arch: str, image_size: int, num_classes: int) -> tuple[int, int]:
    """(forward FLOPs, forward+backward FLOPs) per image."""
    key = f"{arch}/{image_size}/{num_classes}/torch-{torch.__version__}"
    path = _cache_file()
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if key in cached:
        return tuple(cached[key])
    with torch.device("meta"):
        model = build_model(arch, num_classes=num_classes)
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


def train_flops_per_image(arch: str = "resnet50", image_size: int = 224, num_classes: int = 1000) -> int:
    """Forward + backward FLOPs of one training image (ResNet-50 at 224 px: about 24.3e9)."""
    return _count(arch, image_size, num_classes)[1]


def eval_flops_per_image(arch: str = "resnet50", image_size: int = 224, num_classes: int = 1000) -> int:
    """Forward-only FLOPs of one evaluated image."""
    return _count(arch, image_size, num_classes)[0]
