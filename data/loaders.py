"""What every loader shares (the settings it is given, the sampler, the Loader interface; the sample
sources are data/sources.py) and the synthetic loader. The file loaders are data/torch_loader.py and data/dali.py;
data/__init__.py chooses one by name.

A Loader knows its sizes and yields device batches; the loop never asks which one it has.
"""
import hashlib
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from data.sharding import TrainBatchSampler, eval_batches
from data.synthetic import ImageBank
from data.sources import open_split
from data.tree import DataError

@dataclass(frozen=True)
class LoaderSettings:
    """What a loader is told: the few settings of the run that shape its batches, under the run's
    settings' names and with no defaults here (the run's settings hold them: `of`), and two things
    the caller says of this loader (the last two fields)."""
    data_dir: str
    batch_size: int  # per rank
    accumulation_steps: int  # batches per optimizer step (0: 1)
    image_size: int  # of training crops
    eval_image_size: int  # of evaluation crops (0: image_size)
    workers: int
    seed: int
    channels_last: bool
    precision: str  # the run's resolved precision (fp32 | bf16 | fp16): DALI hands out fp16 for fp16
    dali_decode: str  # --loader dali: where JPEGs are decoded (auto: on the GPU where there is one)
    crop_min_scale: float
    crop_max_scale: float
    crop_min_aspect: float
    crop_max_aspect: float
    synthetic_images: int
    synthetic_val_images: int
    synthetic_classes: int
    evaluate_only: bool  # --test-only: the training split is not read, so its size is not checked
    relist: bool  # list the folders again, trusting no index (the ranks' lists differed: data/index.py)

    @classmethod
    def of(cls, settings, *, evaluate_only: bool = False, relist: bool = False, **changes) -> "LoaderSettings":
        """The loader's settings out of the run's (any object that has them as attributes, each of
        them: an AttributeError names one it lacks), with `changes` over them."""
        taken = {name: getattr(settings, name) for name in RUN_SETTINGS if name not in changes}
        return cls(**taken, **changes, evaluate_only=evaluate_only, relist=relist)


# the fields of LoaderSettings that are the run's settings (the others are what the caller says)
RUN_SETTINGS = tuple(f.name for f in fields(LoaderSettings) if f.name not in ("evaluate_only", "relist"))


IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
EVAL_CROP_FRACTION = 0.875  # resize the shorter side to size/0.875, then centre crop


def eval_size(cfg) -> int:
    """The evaluation crop size of a loader's settings (LoaderSettings, or the run's config)."""
    return cfg.eval_image_size or cfg.image_size


def eval_geometry(height: int, width: int, size: int) -> tuple[int, int, int, int]:
    """The evaluation transform's boxes for a height x width image, torchvision's Resize(round(size /
    0.875)) + CenterCrop(size): the resized (height, width), the shorter side round(size / 0.875) and
    the longer one truncated, then the top-left corner of the centred crop, half of each margin rounded
    half to even. Both loaders use these boxes (data/dali.py computes them in its graph)."""
    shorter, short = min(height, width), round(size / EVAL_CROP_FRACTION)
    height, width = short * height // shorter, short * width // shorter  # int(short * long / shorter)
    return height, width, round((height - size) / 2), round((width - size) / 2)


class Loader:
    """Sizes plus two iterators of device batches, and a tally of unreadable files skipped."""
    empty_classes: list[str] = []
    class_names: list[str] | None = None  # the class folders' names, index by index (None: synthetic data)
    sample_list_digest = ""  # what this rank trains and evaluates on: the same on every rank (train/startup.py)
    # the positions in the epoch's global order of the training batch handed out last (the loop's
    # ledger: each position once per epoch, whatever the rank count)
    last_positions: range = range(0)
    # this rank's evaluation batch size: every evaluation batch is padded to it (train/evaluate.py), so
    # the model sees one shape; 0: batches are taken as they come
    eval_batch_size: int = 0

    def __init__(self, num_classes, train_images, val_images, steps_per_epoch, train_size):
        self.num_classes, self.train_images, self.train_size = num_classes, train_images, train_size
        self.val_images, self.steps_per_epoch = val_images, steps_per_epoch  # optimizer steps
        self.skipped, self.skipped_names = 0, []

    def _note_skipped(self, names, counted: set) -> None:
        """Count the unreadable files among `names` that are not in `counted` yet, and keep their names.
        `counted` lives for one pass (a training epoch, an evaluation): the search for a readable
        replacement passes the same bad files again when their neighbours are sampled."""
        new = [name for name in dict.fromkeys(names) if name not in counted]
        counted.update(new)
        self.skipped += len(new)
        self.skipped_names += new

    def take_skipped(self) -> tuple[int, list[str]]:
        """Files skipped since the last call: how many (each once a pass), and their names."""
        report = (self.skipped, self.skipped_names)
        self.skipped, self.skipped_names = 0, []
        return report

    def train_batches(self, epoch: int, start_step: int = 0, augment: bool = True):
        """This rank's batches of the epoch from optimizer step `start_step` on (--accumulation-steps of
        them per step); without `augment`, each training image gets the evaluation transform (resize
        and centre crop) instead of a random crop and flip."""
        raise NotImplementedError

    def val_batches(self):
        raise NotImplementedError

    def set_batch_size(self, per_rank: int, accumulation: int = 1) -> None:
        """Batch-size control: this rank's training batch and the batches per optimizer step (and so the
        steps per epoch) from the next train_batches on. Every image still appears once per epoch."""
        raise NotImplementedError

    @property
    def batch_split(self) -> tuple[int, int]:
        """The per-rank batch and the batches per optimizer step it runs at now (set_batch_size's)."""
        return self.sampler.batch_size, self.sampler.accumulation

    def set_image_size(self, size: int) -> None:
        """Progressive resizing: this rank's training crops are `size` px from the next train_batches on
        (the evaluation keeps its own size)."""
        self.train_size = size

    def close(self) -> None:
        """Let go of the reader threads or processes (a loader replaced during a run: Horovod Elastic's
        new rank count). The loader is not used again."""


class FileLoader(Loader):
    """A loader of real files (the torch and DALI loaders): both splits' samples, the training
    sampler shared by every reader, this rank's evaluation batches, and the empty class folders."""

    def __init__(self, cfg, classes: list[str], rank: int, world_size: int):
        root = Path(cfg.data_dir)
        self.train_source, self.val_source = (open_split(root, split, classes, rank == 0, getattr(cfg, "relist", False)) for split in ("train", "val"))
        digest = hashlib.sha256(f"{self.train_source.digest()} {self.val_source.digest()}".encode())
        self.sample_list_digest = digest.hexdigest()[:32]
        accumulation = max(cfg.accumulation_steps, 1)
        self.sampler = TrainBatchSampler(len(self.train_source), cfg.batch_size, rank, world_size, cfg.seed, accumulation)
        self.class_names = list(classes)  # (a run records them: --test-only compares a --data-dir's with them)
        if not self.sampler.steps and not cfg.evaluate_only:
            raise DataError(f"{root / 'train'} has {len(self.train_source)} images, fewer than one global batch of "
                            f"{self.sampler.global_batch * accumulation}; lower --batch-size")
        super().__init__(len(classes), len(self.train_source), len(self.val_source), self.sampler.steps, cfg.image_size)
        self.eval_batches = eval_batches(len(self.val_source), cfg.batch_size, rank, world_size)
        self.eval_batch_size = cfg.batch_size
        counts = self.train_source.class_counts()  # (None: shards written without their counts)
        if counts is not None:
            self.empty_classes = [name for name, count in zip(classes, counts) if count == 0]

    def set_batch_size(self, per_rank: int, accumulation: int = 1) -> None:
        self.sampler.resize(per_rank, accumulation)
        self.steps_per_epoch = self.sampler.steps


_VAL_STREAM = 1 << 45  # validation samples are indexed apart from any training index


class SyntheticLoader(Loader):
    """Random images from (seed, global sample index), gathered on the device from a bank per crop
    size (data/synthetic.py)."""

    def __init__(self, cfg, rank, world_size, device):
        self.cfg, self.rank, self.world_size, self.device = cfg, rank, world_size, device
        self.sampler = TrainBatchSampler(cfg.synthetic_images, cfg.batch_size, rank, world_size, cfg.seed,
                                         max(cfg.accumulation_steps, 1))  # (its positions; the order is the index)
        self.eval_batch_size = cfg.batch_size
        if not self.sampler.steps and not cfg.evaluate_only:
            raise DataError(f"--synthetic-images {cfg.synthetic_images} is fewer than one global batch of "
                            f"{self.sampler.global_batch * self.sampler.accumulation}")
        super().__init__(cfg.synthetic_classes, cfg.synthetic_images, cfg.synthetic_val_images, self.sampler.steps,
                         cfg.image_size)
        described = f"synthetic {cfg.synthetic_images} {cfg.synthetic_val_images} {cfg.synthetic_classes} {cfg.seed} {cfg.image_size}"
        described += f" {eval_size(cfg)}" if eval_size(cfg) != cfg.image_size else ""
        self.sample_list_digest = hashlib.sha256(described.encode()).hexdigest()[:32]
        self.banks = {}
        self.set_image_size(cfg.image_size)

    def set_image_size(self, size: int) -> None:
        """The training crops at `size` px: their bank made now, before the epoch's steps; only the
        training and evaluation sizes' banks are kept."""
        super().set_image_size(size)
        sizes = {size, eval_size(self.cfg)}
        self.banks = {s: self.banks.get(s) or ImageBank(self.cfg.seed, s, self.device, self.cfg.channels_last)
                      for s in sorted(sizes)}

    def set_batch_size(self, per_rank: int, accumulation: int = 1) -> None:
        self.sampler.resize(per_rank, accumulation)
        self.steps_per_epoch = self.sampler.steps

    def train_batches(self, epoch, start_step=0, augment=True):  # random tensors: nothing to augment
        sampler = self.sampler
        for batch in range(start_step * sampler.accumulation, sampler.steps * sampler.accumulation):
            self.last_positions = sampler.positions(batch)
            indices = torch.arange(self.last_positions.start, self.last_positions.stop) + epoch * self.train_images
            yield self.banks[self.train_size].batch(indices, self.cfg.seed, self.num_classes)

    def val_batches(self):
        bank = self.banks[eval_size(self.cfg)]
        for batch in eval_batches(self.val_images, self.cfg.batch_size, self.rank, self.world_size):
            yield bank.batch(torch.tensor(batch) + _VAL_STREAM, self.cfg.seed, self.num_classes)
