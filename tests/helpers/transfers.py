"""Count the transfers to the device that the training thread makes outside `data.transfer.to_device`
(docs/gpu.md, "Transfers"): `.to(...)`/`.cuda()` with a device, `copy_` (or `tensor[index] = value`) from
host data, `new_tensor`,
and `torch.tensor`/`as_tensor`/`asarray` with a device argument. Each is counted by the line of the
trainer's code (train/, models/, data/) nearest to it on the stack, with that line's function.

On a GPU such a call copies from host memory and, unless it comes from pinned memory with
`non_blocking=True`, waits for the device; on a CPU nothing is copied, so the calls are counted
instead (tests/test_transfers.py). A `copy_` is counted when its source lives on the host and its
destination does not (a GPU), or when its source was made on this thread from host data
(`torch.tensor`, `as_tensor`, `asarray`, `from_numpy` without a device), which a CPU can see.

As a script (argv: OUT.json ARGS...): run `python -m train ARGS` in this process and write
{"exit": code, "transfers": {"path:line function": count}} to OUT.json. In a test: `with
counting_transfers() as counts:`.
"""
import collections
import contextlib
import json
import sys
import threading
import weakref
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
OURS = tuple(str(REPO / package) + "/" for package in ("train", "models", "data"))
TRANSFER = str(REPO / "data" / "transfer.py")
FROM_HOST_DATA = ("tensor", "as_tensor", "asarray")  # factories whose values are read from host memory


@contextlib.contextmanager
def counting_transfers():
    """Within the block, count this thread's transfers outside to_device into a Counter (yielded):
    "path:line function" -> calls. torch's methods are as they were after it."""
    counts, host_made = collections.Counter(), _HostMade()
    thread = threading.get_ident()
    saved = []

    def replace(owner, name, make):
        original = getattr(owner, name)
        saved.append((owner, name, original))
        setattr(owner, name, make(original))

    def count(name):
        if threading.get_ident() == thread:
            where = _caller()
            if where:
                counts[f"{where} ({name})"] += 1

    def to(original):
        def wrapped(self, *args, **kwargs):
            if kwargs.get("device") is not None or any(_names_a_device(a) for a in args):
                count("to")
            return original(self, *args, **kwargs)
        return wrapped

    def always(name):
        def make(original):
            def wrapped(*args, **kwargs):
                count(name)
                return original(*args, **kwargs)
            return wrapped
        return make

    def copy(original):
        def wrapped(self, src, *args, **kwargs):
            if _from_host(self, src, host_made):
                count("copy_")
            return original(self, src, *args, **kwargs)
        return wrapped

    def setitem(original):  # (tensor[index] = value copies in C++, past the Python copy_)
        def wrapped(self, index, value):
            if _from_host(self, value, host_made):
                count("__setitem__")
            return original(self, index, value)
        return wrapped

    def foreach_copy(original):
        def wrapped(dsts, srcs, *args, **kwargs):
            if any(_from_host(d, s, host_made) for d, s in zip(dsts, srcs)):
                count("_foreach_copy_")
            return original(dsts, srcs, *args, **kwargs)
        return wrapped

    def factory(name):
        def make(original):
            def wrapped(*args, **kwargs):
                made = original(*args, **kwargs)
                if kwargs.get("device") is not None:
                    count(name)
                elif threading.get_ident() == thread and isinstance(made, torch.Tensor):
                    host_made.add(made)
                return made
            return wrapped
        return make

    def from_numpy(original):
        def wrapped(array):
            made = original(array)
            host_made.add(made)
            return made
        return wrapped

    replace(torch.Tensor, "to", to)
    replace(torch.Tensor, "cuda", always("cuda"))
    replace(torch.Tensor, "new_tensor", always("new_tensor"))
    replace(torch.Tensor, "copy_", copy)
    replace(torch.Tensor, "__setitem__", setitem)
    replace(torch, "_foreach_copy_", foreach_copy)
    replace(torch, "from_numpy", from_numpy)
    for name in FROM_HOST_DATA:
        replace(torch, name, factory(name))
    try:
        yield counts
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


class _HostMade:
    """The tensors made from host data on the counting thread, held weakly (by identity: a tensor's
    == compares values)."""

    def __init__(self):
        self.refs = {}

    def add(self, tensor: torch.Tensor) -> None:
        key = id(tensor)
        self.refs[key] = weakref.ref(tensor, lambda _: self.refs.pop(key, None))

    def __contains__(self, tensor: torch.Tensor) -> bool:
        ref = self.refs.get(id(tensor))
        return ref is not None and ref() is tensor


def _names_a_device(arg) -> bool:
    """Whether a positional argument of Tensor.to gives the device: a device, a device's name or
    ordinal, or another tensor (whose device the result takes). A dtype or memory format does not."""
    return isinstance(arg, (torch.device, str, torch.Tensor)) or (isinstance(arg, int) and not isinstance(arg, bool))


def _from_host(destination, source, host_made) -> bool:
    if not isinstance(source, torch.Tensor):
        return False
    on_host = source.device.type == "cpu"
    return (on_host and destination.device.type != "cpu") or source in host_made


def _caller() -> str | None:
    """"path:line function" of the innermost frame of the trainer's code on the stack; None when the
    call comes through data/transfer.py (to_device, the sanctioned way) or from no code of ours."""
    frame, found = sys._getframe(2), None
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename == TRANSFER:
            return None
        if found is None and filename.startswith(OURS) and filename != __file__:
            found = f"{Path(filename).relative_to(REPO)}:{frame.f_lineno} {frame.f_code.co_qualname}"
        frame = frame.f_back
    return found


def main() -> None:
    out, argv = Path(sys.argv[1]), sys.argv[2:]
    with counting_transfers() as counts:
        from train.__main__ import main as train
        code = train(argv)
    out.write_text(json.dumps({"exit": code, "transfers": dict(counts)}))


if __name__ == "__main__":
    main()
