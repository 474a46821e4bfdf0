"""`python -m train --preset NAME --show-recipe`: a run's recipe without training it.

One JSON object: `config`, the resolved settings (batch, LR and warmup as the run would choose
them for this launcher's rank count; the per-rank batch and accumulation steps as a CPU chooses them, at
most 256 per rank), `train_images` and `train_images_source` (the training-set
size the epochs are counted over, and where it comes from), and `epochs`, one entry per epoch:
`epoch` (from 1), `global_batch`, `accumulation_steps` (its batches per optimizer step), `lr_first` and `lr_last` (the LR of the epoch's first and last
optimizer step), `image_size` (its training crop size), `augment`, and for a blended optimizer `sgd_share` (its momentum-SGD share at the
epoch's first step). The settings pass the checks a run's start-up makes of them; those of the
machine (device, rank count against --bn-span, the run directory) are left to the run.
"""
import json
from pathlib import Path

from data import embedded
from data.sources import open_split
from data.tree import check_tree
from train.config import Config, to_dict
from train.errors import UsageError
from train.engines import detect_launch
from train.batches import batch_sizes, epoch_split
from train.rules import DEFAULT_PER_RANK_BATCH, lr_and_warmup
from train.schedule import EpochClock, EpochPlan, batch_phases, build_lr_schedule
from train.startup import check_batch_phases, resolved

IMAGENET_TRAIN_IMAGES = 1_281_167
EMBEDDED_TRAIN_IMAGES = embedded.TRAIN_PER_CLASS * len(embedded.CLASSES)  # the run's default data, not generated here


def training_set(cfg: Config) -> tuple[int, str]:
    """The training images the run would count (its data: --data-dir, the embedded dataset, or
    synthetic), and where the count comes from."""
    if cfg.loader == "synthetic":
        return cfg.synthetic_images, "--synthetic-images"
    if cfg.data_dir:  # the run's own listing: its index, or a listing that leaves the index for the run
        return len(open_split(Path(cfg.data_dir), "train", check_tree(cfg.data_dir))), f"--data-dir {cfg.data_dir}"
    if max(batch for _, batch in batch_phases(cfg)) <= EMBEDDED_TRAIN_IMAGES:
        return EMBEDDED_TRAIN_IMAGES, "the embedded dataset (no --data-dir)"
    # a run on the embedded dataset would refuse this batch: the recipe is one for ImageNet
    return IMAGENET_TRAIN_IMAGES, (f"ImageNet's training set (no --data-dir, and the embedded dataset's "
                                   f"{EMBEDDED_TRAIN_IMAGES} images are fewer than a global batch)")


def recipe(cfg: Config) -> dict:
    world_size = detect_launch().world_size
    # (a GPU's batch comes from its memory model at run time; here a CPU's: DEFAULT_PER_RANK_BATCH)
    batch_size, global_batch, steps = batch_sizes(cfg.batch_size, cfg.global_batch_size, world_size,
                                                  accumulation_steps=cfg.accumulation_steps)
    lr, warmup, _ = lr_and_warmup(cfg, global_batch)
    cfg = resolved(cfg, batch_size=batch_size, global_batch_size=global_batch, accumulation_steps=steps, lr=lr,
                   warmup_epochs=warmup, show_recipe=False, largest_batch=max(batch_size, DEFAULT_PER_RANK_BATCH))
    train_images, source = training_set(cfg)
    check_batch_phases(cfg, world_size, train_images)
    try:
        clock = EpochClock.of(cfg, train_images)
    except ValueError as err:
        raise UsageError(str(err)) from None
    schedule, plan = build_lr_schedule(cfg, clock), EpochPlan.of(cfg, clock)
    epochs = []
    for epoch in range(cfg.epochs):
        first, last = clock.first_step(epoch) + 1, clock.first_step(epoch + 1)
        entry = {"epoch": epoch + 1, "global_batch": clock.global_batch(epoch),
                 "accumulation_steps": epoch_split(cfg, epoch)[2], "lr_first": schedule.lr(first),
                 "lr_last": schedule.lr(last), "image_size": plan.image_size(epoch),
                 "augment": plan.augment(epoch)}
        settings = schedule.step_settings(first)
        if "sgd_share" in settings:
            entry["sgd_share"] = settings["sgd_share"]
        epochs.append(entry)
    return {"config": to_dict(cfg), "train_images": train_images, "train_images_source": source, "epochs": epochs}


def show_recipe(cfg: Config) -> None:
    print(json.dumps(recipe(cfg), allow_nan=False))  # strict JSON: a NaN or an infinity is an error, not output
