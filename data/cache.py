"""The trainer's cache folder: the generated embedded dataset, FLOP counts. TRAINER_CACHE_DIR names
it (the tests give each session its own); otherwise $XDG_CACHE_HOME/resnet-trainer or
~/.cache/resnet-trainer."""
import os
from pathlib import Path


def cache_root() -> Path:
    root = os.environ.get("TRAINER_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "resnet-trainer"
