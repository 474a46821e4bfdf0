"""Checkpoints written atomically: a temporary file, fsync, rename, fsync of the folder.

A crash or a full disk leaves the previous checkpoint.pt untouched.
"""
import errno
import os
from pathlib import Path

import torch


def save(path: Path, state: dict) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            try:
                torch.save(state, f)
            except RuntimeError as err:  # torch's zip writer turns a failed write (a full disk) into this
                raise (err.__context__ if isinstance(err.__context__, OSError) else OSError(errno.EIO, str(err))) from err
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def load(path: Path, device: torch.device) -> dict:
    return torch.load(path, map_location=device, weights_only=False)


def peek(path: Path) -> dict:
    """A checkpoint's small entries (step, epoch, finished, ...) without reading its tensors."""
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    return {key: value for key, value in state.items() if not isinstance(value, dict)}
