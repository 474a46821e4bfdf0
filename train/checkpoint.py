"""Checkpoints: written atomically (a temporary file, fsync, rename, fsync of the folder), in the
background when asked, and read back as plain data only.

A crash or a full disk leaves the previous checkpoint.pt untouched. Loading uses
`torch.load(weights_only=True)`: tensors, numbers, strings, lists and dicts, nothing else, so a file
planted in a shared run directory cannot run code as the user (docs/checkpoints.md).
"""
import errno
import os
import pickle
import re
import threading
import time
from pathlib import Path

import torch

from train.config import UsageError


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


def host_copy(value):
    """The state as it is now, in host memory: every tensor copied (CPU tensors cloned, since a
    state_dict's tensors are the live weights), so training can go on while a thread writes it."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: host_copy(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(host_copy(item) for item in value)
    return value


class Writer:
    """Writes checkpoints in a background thread, at most one in flight: `start` waits for the
    previous write first. A failed write is raised by the next `wait` (or `start`) as OSError, with
    the step it was for in `failed_step`."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: OSError | None = None
        self.failed_step = None
        self.last: dict | None = None  # the last finished write: step, copy_s, write_s, start time

    def start(self, path: Path, state: dict, step: int, copy_s: float) -> None:
        self.wait()
        started = time.time()

        def write():
            try:
                save(path, state)
                self.last = {"step": step, "copy_s": round(copy_s, 4), "write_s": round(time.time() - started, 4),
                             "started": round(started, 4)}
            except OSError as err:
                self._error, self.failed_step = err, step
        self._thread = threading.Thread(target=write, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def join(self) -> None:
        """Until no write is in flight, its failure left for whoever reports it (a run that is already
        stopping on another error)."""
        if self._thread is not None:
            self._thread.join()

    def wait(self) -> None:
        """Until no write is in flight; raises the failure of the last one, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


# loading: plain data only ----------------------------------------------------------------------
def load(path: Path, device: torch.device, what_to_do: str = "") -> dict:
    """A checkpoint written by this trainer, on `device`. Anything else (not a torch file, truncated,
    a pickle naming code, not a checkpoint's dict) is a UsageError of one line naming the file."""
    state = _read(path, device, what_to_do)
    if not isinstance(state.get("model"), dict) or "step" not in state:
        raise _refused(path, "it is not a checkpoint of this trainer (no model and step)", what_to_do)
    return state


def peek(path: Path, what_to_do: str = "") -> dict:
    """A checkpoint's small entries (step, epoch, finished, ...) without reading its tensors."""
    state = _read(path, torch.device("cpu"), what_to_do, mmap=True)
    if not isinstance(state.get("model"), dict) or "step" not in state:
        raise _refused(path, "it is not a checkpoint of this trainer (no model and step)", what_to_do)
    return {key: value for key, value in state.items() if not isinstance(value, dict)}


def load_weights(path: Path, what_to_do: str) -> dict:
    """A model's weights from a checkpoint of this trainer or from a bare state_dict (torchvision's
    .pth files), on the CPU."""
    state = _read(path, torch.device("cpu"), what_to_do, mmap=True)
    weights = state["model"] if isinstance(state.get("model"), dict) else state
    if not weights or not all(isinstance(key, str) and isinstance(value, torch.Tensor) for key, value in weights.items()):
        raise _refused(path, "it holds neither a checkpoint nor a state_dict of tensors", what_to_do)
    return weights


def _read(path: Path, device: torch.device, what_to_do: str, mmap: bool = False) -> dict:
    try:
        state = torch.load(path, map_location=device, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:  # weights_only's refusal: a global it does not allow
        named = re.search(r"GLOBAL (\S+)", str(err))
        why = f"it names {named.group(1)}" if named else "it is not a torch checkpoint"
        raise _refused(path, f"{why}, which is not plain data; refused, nothing in it was run", what_to_do) from None
    except OSError as err:
        raise _refused(path, f"it cannot be read ({err.strerror or err})", what_to_do) from None
    except Exception as err:  # torch's readers fail in many ways on a truncated file or one of another kind
        reason = str(err).strip().split(". ")[0].splitlines()[0][:100] if str(err).strip() else type(err).__name__
        raise _refused(path, f"it is truncated or not a torch checkpoint ({reason})", what_to_do) from None
    if not isinstance(state, dict):
        raise _refused(path, f"it holds a {type(state).__name__}, not a checkpoint's dict", what_to_do)
    return state


def _refused(path: Path, why: str, what_to_do: str) -> UsageError:
    return UsageError(f"cannot load {path}: {why}; "
                      f"{what_to_do or 'restore it from a copy you trust or move it away to start afresh'}")
