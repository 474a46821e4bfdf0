"""Checkpoints read back as plain data only: `torch.load(weights_only=True)` takes tensors, numbers,
strings, lists and dicts, nothing else, so a file planted in a shared run directory cannot run code as
the user (docs/checkpoints.md). Reads this trainer's checkpoints (`load`, `peek`) and the weights out of
other scripts' checkpoints too (`load_weights`, for --init-from)."""
import argparse
import pickle
import re
from pathlib import Path

import torch

from train.errors import UsageError


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



def evaluated_weights(state: dict, raw: bool = False) -> dict:
    """The weights a checkpoint's run evaluated: the average of the weights under "ema" when the run
    kept one (--ema-decay), else the trained weights under "model"; with `raw` (--raw-weights) the
    trained weights whatever the run kept."""
    return state["ema"] if isinstance(state.get("ema"), dict) and not raw else state["model"]


# Where other scripts' checkpoints keep the weights (the first found wins): this trainer's and torchvision's
# reference scripts' `model`, timm's and Lightning's `state_dict`, and the names common in tutorials
WEIGHT_KEYS = ("model", "state_dict", "model_state_dict", "model_state", "net")
# What wrappers put before every name: DDP's and DataParallel's `module.`, torch.compile's `_orig_mod.`
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def load_weights(path: Path, what_to_do: str) -> tuple[dict, list[str]]:
    """A model's weights, on the CPU, from a checkpoint of this trainer (the weights it evaluated: with
    --ema-decay, the average) or of another script (the weights under one of WEIGHT_KEYS, nested or not),
    or a bare state_dict (torchvision's .pth files); names without a wrapper's prefix. Also says how they
    were found (e.g. "under 'state_dict'")."""
    with torch.serialization.safe_globals([argparse.Namespace]):  # torchvision's and timm's scripts save their flags as one
        state = _read(path, torch.device("cpu"), what_to_do, mmap=True)
    found = []
    if isinstance(state, dict) and _is_state_dict(state.get("ema")):  # --ema-decay: what the run evaluated,
        state, found = state["ema"], ["the average under 'ema'"]  # as --test-only, predict and export take
    while not _is_state_dict(state):
        key = next((key for key in WEIGHT_KEYS if isinstance(state.get(key), dict)), None)
        if key is None:
            raise _refused(path, "it holds neither a checkpoint nor a state_dict of tensors", what_to_do)
        state = state[key]
        found.append(f"under {key!r}")
    while prefix := next((p for p in WRAPPER_PREFIXES if all(name.startswith(p) for name in state)), None):
        state = {name[len(prefix):]: tensor for name, tensor in state.items()}
        found.append(f"{prefix!r} dropped")
    return state, found


def _is_state_dict(value) -> bool:
    return (isinstance(value, dict) and bool(value)
            and all(isinstance(key, str) and isinstance(item, torch.Tensor) for key, item in value.items()))


def _read(path: Path, device: torch.device, what_to_do: str, mmap: bool = False) -> dict:
    try:
        state = torch.load(path, map_location=device, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:  # weights_only's refusal: a global it does not allow
        global_name = re.search(r"GLOBAL (\S+)", str(err))
        why = f"it names {global_name.group(1)}" if global_name else "it is not a torch checkpoint"
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
    refusal = UsageError(f"cannot load {path}: {why}; "
                         f"{what_to_do or 'restore it from a copy you trust or move it away to start afresh'}")
    refusal.why = why  # (for to_resume's line)
    return refusal
