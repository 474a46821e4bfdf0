"""The embedded dataset: small, learnable, real JPEG files in the ImageNet folder layout.

Ten classes, each a colour family and a texture (stripes, checks, rings, ...). Both cues
survive random-resized-crop and horizontal flips, so a ResNet learns them in minutes on a CPU,
while jitter in hue, scale, phase and noise keeps held-out accuracy below 1.0 early on.
Generated on first use from a seed into a cache directory; regenerated only when missing or
when GENERATOR_VERSION changes.
"""
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from data.cache import cache_root

GENERATOR_VERSION = 1
TRAIN_PER_CLASS = 100
VAL_PER_CLASS = 30

# (colour family hue in degrees, texture); the folder name is "<colour>_<texture>".
CLASSES = {
    "red_hstripes": (0, "hstripes"),
    "orange_vstripes": (30, "vstripes"),
    "yellow_checker": (58, "checker"),
    "lime_dots": (95, "dots"),
    "green_rings": (135, "rings"),
    "cyan_grid": (180, "grid"),
    "azure_diagonal": (210, "diagonal"),
    "blue_blobs": (240, "blobs"),
    "violet_speckle": (275, "speckle"),
    "magenta_gradient": (315, "gradient"),
}


def _hsv_to_rgb(h: float, s: float, v: float) -> np.ndarray:
    h = (h % 360) / 60.0
    c = v * s
    x = c * (1 - abs(h % 2 - 1))
    r, g, b = [(c, x, 0), (x, c, 0), (0, c, x), (0, x, c), (x, 0, c), (c, 0, x)][int(h) % 6]
    return np.array([r, g, b]) + (v - c)


def _texture(kind: str, h: int, w: int, rng: np.random.Generator) -> np.ndarray:
    """A foreground mask in [0, 1] of shape (h, w)."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    period = rng.uniform(7, 14)
    phase = rng.uniform(0, 2 * np.pi)
    wave = lambda t: 0.5 + 0.5 * np.sin(2 * np.pi * t / period + phase)  # noqa: E731
    if kind == "hstripes":
        return wave(y) > 0.5
    if kind == "vstripes":
        return wave(x) > 0.5
    if kind == "checker":
        return (wave(x) > 0.5) ^ (wave(y) > 0.5)
    if kind == "dots":
        cy, cx = (y + phase) % period - period / 2, (x + phase) % period - period / 2
        return np.hypot(cy, cx) < period / 3.5
    if kind == "rings":
        cy, cx = rng.uniform(0, h), rng.uniform(0, w)
        return wave(np.hypot(y - cy, x - cx)) > 0.5
    if kind == "grid":
        return ((y + phase) % period < 2) | ((x + phase) % period < 2)
    if kind == "diagonal":  # either diagonal, so a flip stays in the class
        return wave((x + y) / 1.41 if rng.random() < 0.5 else (x - y) / 1.41) > 0.5
    if kind == "blobs":
        coarse = rng.random((h // 12 + 2, w // 12 + 2))
        smooth = np.kron(coarse, np.ones((12, 12)))[:h, :w]
        return smooth > 0.5
    if kind == "speckle":
        return rng.random((h, w)) < 0.3
    if kind == "gradient":
        angle = rng.uniform(0, 2 * np.pi)
        t = (x * np.cos(angle) + y * np.sin(angle))
        return (t - t.min()) / max(t.max() - t.min(), 1e-6)
    raise ValueError(kind)


def render(name: str, rng: np.random.Generator) -> Image.Image:
    hue, kind = CLASSES[name]
    h, w = int(rng.integers(40, 97)), int(rng.integers(40, 97))
    mask = _texture(kind, h, w, rng).astype(np.float32)[..., None]
    fg = _hsv_to_rgb(hue + rng.uniform(-12, 12), rng.uniform(0.6, 1.0), rng.uniform(0.6, 1.0))
    bg = _hsv_to_rgb(hue + 180 + rng.uniform(-40, 40), rng.uniform(0.1, 0.5), rng.uniform(0.2, 0.9))
    pixels = mask * fg + (1 - mask) * bg
    pixels = pixels * 255 + rng.normal(0, 12, (h, w, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")


def _write(root: Path, seed: int, train_per_class: int, val_per_class: int) -> None:
    for split, per_class in (("train", train_per_class), ("val", val_per_class)):
        for class_index, name in enumerate(sorted(CLASSES)):
            folder = root / split / name
            folder.mkdir(parents=True)
            rng = np.random.default_rng([seed, GENERATOR_VERSION, class_index, split == "val"])
            for i in range(per_class):
                image = render(name, rng)
                image.save(folder / f"{name}_{i:05d}.JPEG", quality=int(rng.integers(75, 96)))


def ensure_embedded(seed: int = 0, train_per_class: int = TRAIN_PER_CLASS,
                    val_per_class: int = VAL_PER_CLASS, root: Path | None = None) -> Path:
    """Path of the generated ImageFolder tree (with train/ and val/), made if missing.

    Written into a private temporary folder and renamed into place, so concurrent
    ranks or a killed generator never leave a half-written tree behind.
    """
    root = Path(root) if root is not None else cache_root()
    target = root / f"embedded-v{GENERATOR_VERSION}-seed{seed}-{train_per_class}x{val_per_class}"
    if (target / ".complete").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".embedded-", dir=root))
    try:
        _write(staging, seed, train_per_class, val_per_class)
        (staging / ".complete").write_text(f"generator v{GENERATOR_VERSION}\n")
        try:
            os.rename(staging, target)
        except OSError:  # another process finished first, or a stale tree is in the way
            if not (target / ".complete").exists():
                shutil.rmtree(target, ignore_errors=True)
                os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
