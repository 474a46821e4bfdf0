"""What runs in DALI's reader processes for `--loader dali`'s training feed (data/dali.py builds the
pipeline around it): the source of encoded files, a batch per call.

No torch here, nor in what this imports (data.sources, data.index, data.shards, data.tree): each
reader process is spawned and imports what it unpickles, and torch with torchvision would cost every
reader some 370 MB of private memory (about 40 MB without). So the epoch's order (torch.randperm, the
torch loader's order) is drawn by the main process and handed over with the pass (PassRecord).

Each sample travels with a row of meta (int64), whose columns are named below: the main process reads
the label, the file and the skips; the pipeline reads the crop size and the evaluation transform's
shorter side, so a crop-size change (progressive resizing) is a value of the pass, not of the graph.
"""
import copy
import os
import pickle
import tempfile
import threading
import time
import weakref

import numpy as np

from data.sources import complete_jpeg, complete_png, first_readable

# meta's columns: the label, the file asked for, how many files from it on were skipped (a bad file's
# place goes to the next readable one), the step served, the crop's side and the evaluation
# transform's shorter side before its centre crop (both px)
LABEL, FILE, SKIPPED, STEP, CROP, SHORT = range(6)
META_COLUMNS = 6


def encoded(source, index: int) -> tuple[np.ndarray, int] | None:
    """(the file's bytes, its label) as DALI takes them, or None when DALI could not decode the file:
    empty, unreadable, not JPEG or PNG, or truncated (a DALI decoder error would stop the whole
    pipeline, so files are checked first)."""
    try:
        payload, label = source.read(index)
    except OSError:
        return None
    if not (complete_jpeg(payload) or complete_png(payload)):
        return None
    return np.frombuffer(payload, dtype=np.uint8), label


class Packed:
    """A long list of small picklable items as one bytes object and its offsets: what each reader
    process gets of a shard split's per-sample list (ImageNet's 1.28M entries pickled one by one come
    to some 150 MB, against several hundred MB as Python objects in every process). A folder split's
    list is numpy arrays already (data/index.py) and travels as it is."""

    def __init__(self, items):
        parts = [pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL) for item in items]
        self.blob, self.ends = b"".join(parts), np.cumsum([len(p) for p in parts], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.ends)

    def __getitem__(self, index: int):
        start = int(self.ends[index - 1]) if index > 0 else 0
        return pickle.loads(memoryview(self.blob)[start:int(self.ends[index])])


def packed(source):
    """A copy of a sample source (FolderSource, ShardSource) with its per-file list packed; the labels
    listed up front for the empty-class check (targets) stay behind."""
    light = copy.copy(source)
    for name in ("samples", "entries"):
        if isinstance(getattr(light, name, None), list):
            setattr(light, name, Packed(getattr(light, name)))
    light.targets = None
    return light


class PassRecord:
    """Which pass of the sampler the readers serve, in a small file that the main process writes and
    the reader processes map (they learn its name at unpickling, while the pipeline is built; the
    file goes once they have it): (DALI's epoch index, first step, end step, crop side, shorter
    side) and then this rank's files of the epoch in order, `steps x batch` dataset indices."""
    _HEAD = 5

    def __init__(self, steps: int, batch: int):
        self.steps, self.batch = steps, batch
        fd, self.path = tempfile.mkstemp(prefix="dali-pass-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        os.ftruncate(fd, (self._HEAD + steps * batch) * 8)
        os.close(fd)
        self._map("r+")
        self.remove = weakref.finalize(self, _remove, self.path)

    def _map(self, mode: str) -> None:
        values = np.memmap(self.path, dtype=np.int64, mode=mode, shape=(self._HEAD + self.steps * self.batch,))
        self.head, self.order = values[:self._HEAD], values[self._HEAD:].reshape(self.steps, self.batch)

    def __getstate__(self):
        return {"path": self.path, "steps": self.steps, "batch": self.batch}

    def __setstate__(self, state):  # in a reader process
        self.__dict__.update(state)
        self._map("r")

    def start(self, pass_index: int, order: np.ndarray, start_step: int, sides: tuple[int, int]) -> None:
        """A new pass: this rank's files of the epoch (steps x batch), read from `start_step` on, and
        its crop geometry (crop side, shorter side: every batch of the pass carries them). DALI asks its
        readers for the pass's first batches at the pass's first run, after this; the pass index is
        written last, so a reader that sees it sees the rest."""
        self.order[:] = order
        self.head[1:] = (start_step, self.steps, *sides)
        self.head[0] = pass_index

    def stop(self) -> None:
        """Every sample not read yet ends the pass."""
        self.head[2] = 0


def end_with(parent: int, every_s: float = 0.5) -> None:
    """End this process once `parent` has ended. DALI's readers wait for tasks on a shared-memory queue
    forever: a trainer killed without its finalisers (SIGKILL) would leave them, and the resource
    tracker whose pipe they hold, running. A thread that polls the parent's pid, not a parent-death
    signal: that signal follows the parent's thread that started the readers, which may end first."""
    def watch():
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(1)  # at once: the main thread may be blocked on the dead parent's queue
    threading.Thread(target=watch, name="end-with-parent", daemon=True).start()


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class TrainReader:
    """The training pipeline's parallel source, run in DALI's reader processes, a batch per call: the
    encoded bytes of this rank's batch at the pass's step (the order in the PassRecord), an
    unreadable file's place taken by the next readable one (first_readable, as the torch loader),
    and meta, one row per sample (the columns above), from which the main process names and counts
    the skipped files and learns which positions of the epoch's order the batch holds, and the
    pipeline takes the pass's crop size. Picklable: it holds the source and the record, no reference
    to the loader."""

    def __init__(self, source, record: PassRecord):
        self.source, self.record = source, record
        self.parent = os.getpid()  # the process that builds the pipeline and so starts the readers

    def __setstate__(self, state):
        self.__dict__.update(state)
        if os.getpid() != self.parent:  # in a reader process
            end_with(self.parent)

    def __call__(self, info):
        pass_index, start_step, end_step, crop, short = self.record.head.tolist()
        step = start_step + info.iteration
        if info.epoch_idx != pass_index or step >= end_step:  # the pass's end, or a task from an earlier pass
            raise StopIteration
        payloads, meta = [], np.empty((self.record.batch, META_COLUMNS), dtype=np.int64)
        for slot, index in enumerate(self.record.order[step].tolist()):
            (payload, label), skipped = first_readable(self.source, index, lambda p: encoded(self.source, p))
            payloads.append(payload)
            meta[slot] = label, index, len(skipped), step, crop, short
        return payloads, meta
