"""Training-pipeline images/s on a few hundred generated ImageNet-like JPEGs (about 500x375, ~100 KB),
using both cores: the project's fastest CPU path divided by a plain torchvision ImageFolder + PIL
DataLoader (RandomResizedCrop(224) + flip + ToTensor + Normalize, same number of workers), measured
in the same run. Also prints the decode-only ceiling (full decode of the same files, one core).
Also timed, for the record of why the torch loader uses threads: the same per-sample work in
DataLoader worker processes. Last line: `loader: RATIO (goal >= 2.0)`.
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torchvision
from PIL import Image
from torchvision import transforms as T

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from data.dali import DaliLoader  # noqa: E402
from data.tree import check_tree  # noqa: E402
from data.torch_loader import TorchLoader, train_item  # noqa: E402
from train.config import Config  # noqa: E402


def make_tree(root: Path, images: int) -> Path:
    rng = np.random.default_rng(0)
    for split, count in (("train", images), ("val", 8)):
        for i in range(count):
            folder = root / split / f"class{i % 8}"
            folder.mkdir(parents=True, exist_ok=True)
            h, w = (375, 500) if rng.random() < 0.7 else (500, 375)
            y, x = np.mgrid[0:h, 0:w]
            base = np.stack([x * 255 / w, y * 255 / h, (x + y) * 127 / (w + h)], -1)
            pixels = base + rng.normal(0, 24, (h, w, 3))  # texture: ~100 KB at quality 90, like a photo
            Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(folder / f"{i:05d}.JPEG", quality=90)
    return root


def rate(batches, images_per_batch: int, epochs: int = 2) -> float:
    """Images/s over whole epochs after one warm-up epoch."""
    for _ in batches(0):
        pass
    start, count = time.perf_counter(), 0
    for epoch in range(1, epochs + 1):
        for _ in batches(epoch):
            count += images_per_batch
    return count / (time.perf_counter() - start)


class _InProcesses(torch.utils.data.Dataset):
    """The torch loader's per-sample work (region decode, crop, flip) in DataLoader worker processes."""

    def __init__(self, loader):
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader.train_source)

    def __getitem__(self, key):
        pixels, label, _ = train_item(self.loader.train_source, *key, self.loader.train_crop)
        return pixels, label


def in_processes(loader: TorchLoader, workers: int):
    data = torch.utils.data.DataLoader(_InProcesses(loader), batch_sampler=loader.sampler, num_workers=workers,
                                       persistent_workers=True)

    def batches(epoch):
        loader.sampler.epoch = epoch
        for images, labels in data:
            yield torch.addcmul(loader.train_maker.shift, images.contiguous(memory_format=torch.channels_last), loader.train_maker.scale), labels
    return batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=384)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = make_tree(Path(tmp), args.images)
        size_kb = np.mean([p.stat().st_size for p in (root / "train").rglob("*.JPEG")]) / 1024
        baseline_set = torchvision.datasets.ImageFolder(str(root / "train"), T.Compose([
            T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(),
            T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])]))
        baseline = torch.utils.data.DataLoader(baseline_set, batch_size=args.batch_size, shuffle=True, drop_last=True,
                                               num_workers=args.workers, persistent_workers=True)
        cfg = Config(data_dir=str(root), image_size=224, batch_size=args.batch_size, workers=args.workers)
        classes = check_tree(str(root))
        cpu = torch.device("cpu")
        candidates = {"dali-cpu": DaliLoader(cfg, classes, 0, 1, cpu), "torch": TorchLoader(cfg, classes, 0, 1, cpu)}
        references = {"torch-in-processes": in_processes(TorchLoader(cfg, classes, 0, 1, cpu), args.workers)}

        files = sorted((root / "train").rglob("*.JPEG"))
        start = time.perf_counter()
        for f in files:
            with Image.open(f) as image:
                image.load()
        ceiling = len(files) / (time.perf_counter() - start)

        runs = {"baseline": lambda epoch: baseline, **{name: loader.train_batches for name, loader in candidates.items()},
                **references}
        results = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, batches in runs.items():
                results[name].append(rate(batches, args.batch_size))
        medians = {name: statistics.median(values) for name, values in results.items()}
        print(f"{args.images} JPEGs, about {size_kb:.0f} KB, {args.workers} workers/threads, batch {args.batch_size}")
        for name, value in medians.items():
            print(f"{name:18s} {value:8.1f} img/s (median of {args.repeats})")
        print(f"decode-only ceiling (PIL, one core): {ceiling:.1f} img/s")
        best = max(candidates, key=medians.get)
        print(f"fastest project path: {best}")
        print(f"loader: {medians[best] / medians['baseline']:.2f} (goal >= 2.0)")


if __name__ == "__main__":
    main()
