"""The loaders behind `--loader`: torchvision (ImageFolder trees or tar shards) and synthetic.

A Loader knows its sizes and yields device batches; the loop never asks which one it has.
"""
import os
from pathlib import Path

import torch
import torchvision
from torch.utils.data import DataLoader
from torchvision.transforms import RandomResizedCrop
from torchvision.transforms.v2 import functional as TF

from data.decode import BadImage, Encoded
from data.shards import ShardSamples, is_shard_tree
from data.sharding import TrainBatchSampler, eval_batches
from data.synthetic import synthetic_batch

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
EVAL_CROP_FRACTION = 0.875  # resize the shorter side to size/0.875, then centre crop


class DataError(ValueError):
    """The data given cannot be used; the message says what to do."""


def _classes(split_dir: Path) -> list[str]:
    return sorted(entry.name for entry in os.scandir(split_dir) if entry.is_dir())


def check_tree(data_dir: str) -> list[str]:
    """The sorted class names of an ImageNet-layout tree (or of tar shards with classes.txt),
    or a DataError saying what is wrong."""
    root = Path(data_dir)
    if not root.is_dir():
        raise DataError(f"data directory {root} does not exist; pass --data-dir with train/<class>/*.jpg and val/<class>/*.jpg")
    if is_shard_tree(root):
        if not any((root / "val").glob("*.tar")):
            raise DataError(f"{root} has training shards but no val/*.tar; write both splits with scripts/make_shards.py")
        return (root / "classes.txt").read_text().split()
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise DataError(f"data directory {root} has no {split}/ folder; expected {split}/<class>/*.jpg")
    train_classes, val_classes = _classes(root / "train"), _classes(root / "val")
    if not train_classes:
        raise DataError(f"{root / 'train'} holds no class folders; expected train/<class>/*.jpg")
    if train_classes != val_classes:
        only_train = sorted(set(train_classes) - set(val_classes))[:3]
        only_val = sorted(set(val_classes) - set(train_classes))[:3]
        raise DataError(f"train and val classes differ in {root} (only in train: {only_train}, only in val: {only_val}); "
                        "both splits need the same class folders")
    for split in ("train", "val"):
        if not any(name.lower().endswith(IMAGE_EXTENSIONS)
                   for cls in train_classes for name in os.listdir(root / split / cls)):
            raise DataError(f"{root / split} holds no images; expected {split}/<class>/*.jpg")
    return train_classes


class FolderSource:
    """The (image, label) samples of one split of an ImageFolder tree."""

    def __init__(self, split_dir: Path, classes: list[str]):
        class_to_idx = {c: i for i, c in enumerate(classes)}
        self.samples = torchvision.datasets.folder.make_dataset(str(split_dir), class_to_idx,
                                                                extensions=IMAGE_EXTENSIONS, allow_empty=True)
        self.targets = [label for _, label in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def read(self, index: int) -> tuple[bytes, int]:
        path, label = self.samples[index]
        with open(path, "rb") as f:
            return f.read(), label

    def name(self, index: int) -> str:
        return self.samples[index][0]


class ShardSource(ShardSamples):
    """The (image, label) samples of one split's tar shards."""
    targets = None  # labels live inside the shards; reading them all up front would cost a pass


class TrainCrop:
    """Random-resized crop + horizontal flip, drawn from torch's RNG as torchvision draws them, of an
    Encoded image: only the crop's region is decoded. Returns (size, size, 3) uint8."""

    def __init__(self, size: int, scale: tuple[float, float], ratio: tuple[float, float]):
        self.size, self.scale, self.ratio = size, scale, ratio

    def __call__(self, image: Encoded) -> torch.Tensor:
        shape_only = torch.empty(0, image.height, image.width)
        top, left, height, width = RandomResizedCrop.get_params(shape_only, self.scale, self.ratio)
        crop = image.region(top, left, height, width).permute(2, 0, 1)  # CHW view of HWC: channels_last
        crop = torch.nn.functional.interpolate(crop[None], size=(self.size, self.size), mode="bilinear",
                                               antialias=True)[0]
        if torch.rand(1) < 0.5:
            crop = crop.flip(-1)
        return crop.permute(1, 2, 0)


class EvalCrop:
    """Resize the shorter side to size/0.875, centre crop: (size, size, 3) uint8."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self, image: Encoded) -> torch.Tensor:
        pixels = TF.resize(image.region().permute(2, 0, 1), [round(self.size / EVAL_CROP_FRACTION)], antialias=True)
        return TF.center_crop(pixels, [self.size]).permute(1, 2, 0)


def _decoded(source, index: int, transform):
    """(transform of the image, label), or BadImage when the file cannot be read or decoded."""
    try:
        payload, label = source.read(index)
    except OSError as err:
        raise BadImage(f"{source.name(index)} ({type(err).__name__})") from err
    return transform(Encoded(payload, source.name(index))), label


class _TrainSet(torch.utils.data.Dataset):
    """Training items keyed by (index, augmentation seed).

    Seeding torch's RNG per sample makes augmentation independent of worker count and
    scheduling, which is what lets a resumed run repeat an uninterrupted one bit for bit.
    An unreadable file is skipped and reported, and the next readable file (with its own label)
    takes its place, so every rank's batch keeps its size and no label shifts.
    """

    def __init__(self, source, transform):
        self.source, self.transform = source, transform

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, key):
        index, seed = key
        skipped = []
        for attempt in range(len(self.source)):
            position = (index + attempt) % len(self.source)
            # the CPU generator only: torch.manual_seed would also queue a lazy CUDA/XPU/MTIA seeding,
            # with a formatted stack, on every call in a process that never initialises CUDA
            torch.random.default_generator.manual_seed(seed)
            try:
                image, label = _decoded(self.source, position, self.transform)
            except BadImage:
                skipped.append(self.source.name(position))
                continue
            return image, label, skipped
        raise DataError("no readable training image at all")


class _EvalSet(_TrainSet):
    """Evaluation items; an unreadable file comes back as (None, label, [name]): counted, not evaluated."""

    def __getitem__(self, index):
        try:
            image, label = _decoded(self.source, index, self.transform)
            return image, label, []
        except BadImage:
            return None, -1, [self.source.name(index)]


def open_split(root: Path, split: str, classes: list[str]):
    """The samples of one split: tar shards when the folder holds them, else an ImageFolder tree."""
    return ShardSource(root / split) if is_shard_tree(root) else FolderSource(root / split, classes)


def train_sampler(num_items: int, cfg, rank: int, world_size: int, where: Path) -> TrainBatchSampler:
    sampler = TrainBatchSampler(num_items, cfg.batch_size, rank, world_size, cfg.seed)
    if num_items < sampler.global_batch:
        raise DataError(f"{where} has {num_items} images, fewer than one global batch of {sampler.global_batch}; "
                        "lower --batch-size")
    return sampler


def _collate(items):
    """(uint8 images, labels, paths skipped) from the readable items of a batch."""
    good = [(image, label) for image, label, _ in items if image is not None]
    skipped = [path for _, _, paths in items for path in paths]
    if not good:
        return None, None, skipped
    return torch.stack([image for image, _ in good]), torch.tensor([label for _, label in good]), skipped


class Loader:
    """Sizes plus two iterators of device batches, and a tally of unreadable files skipped."""
    empty_classes: list[str] = []

    def __init__(self, num_classes, train_images, val_images, steps_per_epoch):
        self.num_classes, self.train_images = num_classes, train_images
        self.val_images, self.steps_per_epoch = val_images, steps_per_epoch
        self.skipped, self.skipped_examples = 0, []

    def _note_skipped(self, paths) -> None:
        self.skipped += len(paths)
        room = max(0, 3 - len(self.skipped_examples))
        self.skipped_examples += [p for p in paths if p not in self.skipped_examples][:room]

    def take_skipped(self) -> tuple[int, list[str]]:
        """Files skipped since the last call, and the first few of them by name."""
        report = (self.skipped, self.skipped_examples)
        self.skipped, self.skipped_examples = 0, []
        return report

    def train_batches(self, epoch: int, start_step: int = 0):
        raise NotImplementedError

    def val_batches(self):
        raise NotImplementedError


class TorchLoader(Loader):
    """ImageFolder trees or shards through DataLoader workers: each worker decodes only the crop's region
    (data/decode.py), uint8 NHWC batches travel, normalisation runs on the device."""

    def __init__(self, cfg, classes, rank, world_size, device):
        root = Path(cfg.data_dir)
        size = cfg.image_size
        train_crop = TrainCrop(size, (cfg.crop_min_scale, cfg.crop_max_scale), (cfg.crop_min_aspect, cfg.crop_max_aspect))
        self.train_set = _TrainSet(open_split(root, "train", classes), train_crop)
        self.val_set = _EvalSet(open_split(root, "val", classes), EvalCrop(size))
        self.sampler = train_sampler(len(self.train_set), cfg, rank, world_size, root / "train")
        super().__init__(len(classes), len(self.train_set), len(self.val_set),
                         self.sampler.num_items // self.sampler.global_batch)
        if self.train_set.source.targets is not None:
            counts = torch.bincount(torch.tensor(self.train_set.source.targets, dtype=torch.int64), minlength=len(classes))
            self.empty_classes = [c for c, n in zip(classes, counts.tolist()) if n == 0]
        self.device, self.channels_last = device, cfg.channels_last
        pin = device.type == "cuda"
        workers = dict(num_workers=cfg.workers, persistent_workers=cfg.workers > 0, pin_memory=pin)
        self.train_loader = DataLoader(self.train_set, batch_sampler=self.sampler, collate_fn=_collate, **workers)
        self.val_loader = DataLoader(self.val_set, batch_sampler=eval_batches(len(self.val_set), cfg.batch_size, rank, world_size),
                                     collate_fn=_collate, **workers)
        # (x - mean) / std as x * scale + shift, both whole channels_last images: a 3-vector broadcast
        # along channels_last's innermost dimension does not vectorise on a CPU (3x slower there)
        scale = 1 / (torch.tensor(IMAGENET_STD) * 255)
        shift = -torch.tensor(IMAGENET_MEAN) * 255 * scale
        self.scale, self.shift = (v.view(1, 3, 1, 1).expand(1, 3, size, size).contiguous(memory_format=torch.channels_last)
                                  .to(device) for v in (scale, shift))

    def _on_device(self, batches):
        for images, labels, skipped in batches:
            self._note_skipped(skipped)
            if images is None:
                continue
            # NHWC uint8 as NCHW is channels_last already; the float copy keeps that layout
            images = images.to(self.device, non_blocking=True).permute(0, 3, 1, 2).float()
            images = images.mul_(self.scale).add_(self.shift)
            if not self.channels_last:
                images = images.contiguous()
            yield images, labels.to(self.device, non_blocking=True)

    def train_batches(self, epoch, start_step=0):
        self.sampler.epoch, self.sampler.start_step = epoch, start_step
        return self._on_device(self.train_loader)

    def val_batches(self):
        return self._on_device(self.val_loader)


_VAL_STREAM = 1 << 45  # validation samples are indexed apart from any training index


class SyntheticLoader(Loader):
    """Random tensors from (seed, global sample index), generated on the device."""

    def __init__(self, cfg, rank, world_size, device):
        self.cfg, self.rank, self.world_size, self.device = cfg, rank, world_size, device
        self.global_batch = cfg.batch_size * world_size
        if cfg.synthetic_images < self.global_batch:
            raise DataError(f"--synthetic-images {cfg.synthetic_images} is fewer than one global batch of {self.global_batch}")
        super().__init__(cfg.synthetic_classes, cfg.synthetic_images, cfg.synthetic_val_images,
                         cfg.synthetic_images // self.global_batch)

    def _batch(self, indices: torch.Tensor):
        images, labels = synthetic_batch(indices, self.cfg.seed, self.cfg.image_size, self.num_classes, self.device)
        if self.cfg.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return images, labels

    def train_batches(self, epoch, start_step=0):
        b = self.cfg.batch_size
        for step in range(start_step, self.steps_per_epoch):
            global_index = epoch * self.train_images + step * self.global_batch + self.rank * b
            yield self._batch(torch.arange(global_index, global_index + b))

    def val_batches(self):
        for batch in eval_batches(self.val_images, self.cfg.batch_size, self.rank, self.world_size):
            yield self._batch(torch.tensor(batch) + _VAL_STREAM)


def build_loader(cfg, rank: int, world_size: int, device: torch.device) -> Loader:
    if cfg.loader == "synthetic":
        return SyntheticLoader(cfg, rank, world_size, device)
    if cfg.loader == "torch":
        return TorchLoader(cfg, check_tree(cfg.data_dir), rank, world_size, device)
    if cfg.loader == "dali":
        from data.dali import DaliLoader
        return DaliLoader(cfg, check_tree(cfg.data_dir), rank, world_size, device)
    raise DataError(f"unknown --loader {cfg.loader!r}; choose torch, dali or synthetic")
