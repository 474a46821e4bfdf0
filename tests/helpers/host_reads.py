"""Run `python -m train ARGS` in this process and count its host reads on the training thread
(argv: OUT.json ARGS...): every call of Tensor.item, tolist, cpu, numpy, and bool/float/int/index of
a tensor made by the main thread, by the line of the trainer's code (train/, models/, data/) nearest
to it on the stack. On a GPU each of these waits for the device; on a CPU they cost nothing, so
counting them is how a CPU sees what would stop a GPU (tests/test_host_reads.py).

Writes {"exit": code, "reads": {"file:line": count}} to OUT.json."""
import collections
import json
import sys
import threading
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[2]
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
OURS = tuple(str(REPO / package) for package in ("train", "models", "data"))


def count_reads(counts: collections.Counter) -> None:
    """Wrap each reading method of torch.Tensor so that the training thread's calls are counted."""
    training_thread = threading.get_ident()

    def wrapped(name, original):
        def read(self, *args, **kwargs):
            if threading.get_ident() == training_thread:
                counts[_caller(name)] += 1
            return original(self, *args, **kwargs)
        return read
    for name in READS:
        setattr(torch.Tensor, name, wrapped(name, getattr(torch.Tensor, name)))


def _caller(name: str) -> str:
    """The innermost frame of the trainer's own code that led to the read, with the method read."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename.startswith(OURS):
            return f"{Path(frame.filename).relative_to(REPO)}:{frame.lineno} {name}"
    return f"elsewhere {name}"


class ScalarReads(TorchDispatchMode):
    """Counts device-to-host scalar reads (.item(), bool(tensor), ...) at the dispatcher, in this
    process, while it is entered: on a GPU each would wait for the device."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default):
            self.reads += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    out, argv = Path(sys.argv[1]), sys.argv[2:]
    counts = collections.Counter()
    count_reads(counts)
    from train.__main__ import main as train
    code = train(argv)
    out.write_text(json.dumps({"exit": code, "reads": dict(counts)}))


if __name__ == "__main__":
    main()
