"""`python -m train --preset NAME --show-recipe`: a run's recipe without training it.

One JSON object: `config`, the resolved settings (batch, LR and warmup as the run would choose
them for this launcher's rank count), and `epochs`, one entry per epoch: `epoch` (from 1),
`global_batch`, `lr_first` and `lr_last` (the LR of the epoch's first and last optimizer step),
`augment`, and for a blended optimizer `sgd_share` (its momentum-SGD share at the epoch's first
step). Steps per epoch come from --data-dir's training images when given, else from ImageNet's.
"""
import dataclasses
import json
from pathlib import Path

from data.sources import open_split
from data.tree import check_tree
from train.config import Config, UsageError, to_dict
from train.engines import detect_launch
from train.rules import batch_sizes, lr_and_warmup
from train.schedule import EpochClock, build_schedule

IMAGENET_TRAIN_IMAGES = 1_281_167


def recipe(cfg: Config) -> dict:
    batch_size, global_batch = batch_sizes(cfg.batch_size, cfg.global_batch_size, detect_launch().world_size)
    cfg = dataclasses.replace(cfg, batch_size=batch_size, global_batch_size=global_batch)
    lr, warmup, _ = lr_and_warmup(cfg, global_batch)
    cfg = dataclasses.replace(cfg, lr=lr, warmup_epochs=warmup, show_recipe=False)
    train_images = len(open_split(Path(cfg.data_dir), "train", check_tree(cfg.data_dir))) if cfg.data_dir \
        else IMAGENET_TRAIN_IMAGES
    try:
        clock = EpochClock.of(cfg, train_images)
    except ValueError as err:
        raise UsageError(str(err)) from None
    schedule = build_schedule(cfg, clock)
    epochs = []
    for epoch in range(cfg.epochs):
        first, last = clock.first_step(epoch) + 1, clock.first_step(epoch + 1)
        entry = {"epoch": epoch + 1, "global_batch": clock.global_batch(epoch), "lr_first": schedule.lr(first),
                 "lr_last": schedule.lr(last), "augment": schedule.augment(epoch)}
        settings = schedule.step_settings(first)
        if "sgd_share" in settings:
            entry["sgd_share"] = settings["sgd_share"]
        epochs.append(entry)
    return {"config": to_dict(cfg), "train_images": train_images, "epochs": epochs}


def show_recipe(cfg: Config) -> None:
    print(json.dumps(recipe(cfg)))
