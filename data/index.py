"""A split's sample list, built once per dataset and read by every rank after that.

Listing ImageNet's training split means walking 1,281,167 files; with thousands of ranks on a
shared filesystem that is thousands of walks at once, and the list itself, as Python strings, costs
hundreds of MB per rank. The index holds the same list (data/tree.py list_samples: its order is the
trainer's sample order) as three numpy arrays in one .npz: the paths relative to the split as one
UTF-8 blob, their offsets into it, and the labels, about 50 MB for ImageNet. It is read with
allow_pickle=False, so loading it runs no code.

Which rank writes it: rank 0 writes it beside the split; every rank may write it to its node's cache
folder (node-local disks: each node keeps its own, written whole under a temporary name and renamed,
so a node's ranks writing at once leave one complete file). A cache can hold an index that no longer
fits the tree and still passes the check below (a tree replaced by one whose folders carry the same
times, as tar and rsync -a make them); so the ranks compare digests of their lists at start-up
(train/startup.py agree_on_samples), and list the folders again when they differ.

It is keyed by the directories the walk went through (each class folder and any subfolder) and
their modification times: adding, removing or renaming a file changes its folder's time, so a
changed tree is noticed with one stat per folder (about 1,000 for ImageNet, not 1.3 million) and the
index is built again; so is an index built within a second of a folder's last change. It lives beside the split (`<root>/.index-<split>.npz`), or, where the data
is read-only, in the trainer's cache folder; scripts/prepare_imagenet.py writes it once, otherwise
the first run that lists the split does.
"""
import contextlib
import hashlib
import os
import time
from pathlib import Path

import numpy as np

from data.cache import cache_root
from data.progress import Progress
from data.tree import list_samples

VERSION = 1
RACY_NS = 1_000_000_000


class SampleIndex:
    """(path, label) of every sample of a split, as a read-only sequence over numpy arrays."""

    def __init__(self, split_dir: Path, blob: np.ndarray, offsets: np.ndarray, labels: np.ndarray):
        self.split_dir, self.blob, self.offsets, self.labels = str(split_dir), blob, offsets, labels

    def __len__(self) -> int:
        return len(self.labels)

    def path(self, index: int) -> str:
        start, end = self.offsets[index], self.offsets[index + 1]
        return os.path.join(self.split_dir, self.blob[start:end].tobytes().decode("utf-8"))

    def digest(self) -> str:
        """What the list is, path by path and label by label (not where the split lies)."""
        digest = hashlib.sha256()
        for array in (self.blob, self.offsets, self.labels):
            digest.update(np.ascontiguousarray(array).tobytes())
        return digest.hexdigest()

    def __getitem__(self, index: int) -> tuple[str, int]:
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        index %= len(self)
        return self.path(index), int(self.labels[index])

    @classmethod
    def of(cls, split_dir: Path, samples: list[tuple[str, int]]) -> "SampleIndex":
        encoded = [os.path.relpath(path, split_dir).encode("utf-8") for path, _ in samples]
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(e) for e in encoded], out=offsets[1:])
        blob = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        return cls(split_dir, blob, offsets, np.array([label for _, label in samples], dtype=np.int32))


def load_samples(split_dir: Path, classes: list[str], shared_writer: bool = True, relist: bool = False) -> SampleIndex:
    """The split's samples from its index when the index matches the tree, else listed (and the
    index written for the next run: beside the split only by the `shared_writer`, rank 0, which also
    prints how many files the listing has found, every few seconds). `relist`: list the tree whatever
    index there is."""
    split_dir = Path(split_dir)
    for path in [] if relist else _index_paths(split_dir):
        index = _read(path, split_dir, classes)
        if index is not None:
            return index
    # only the shared writer (rank 0) says how far the walk is: one line per wait, not one per rank
    progress = Progress(f"indexing {split_dir}", unit="files found", enabled=shared_writer)
    samples = list_samples(split_dir, classes, progress=progress)
    index = SampleIndex.of(split_dir, samples)
    _write(index, split_dir, classes, _walked_dirs(split_dir, samples), shared_writer)
    return index


def _index_paths(split_dir: Path) -> list[Path]:
    key = hashlib.sha256(str(split_dir.resolve()).encode()).hexdigest()[:16]
    return [split_dir.parent / f".index-{split_dir.name}.npz", cache_root() / "index" / f"{key}-{split_dir.name}.npz"]


def _walked_dirs(split_dir: Path, samples) -> list[str]:
    """Every folder that holds a sample or a class (relative to the split), sorted."""
    found = {os.path.relpath(os.path.dirname(path), split_dir) for path, _ in samples}
    found.update(entry.name for entry in os.scandir(split_dir) if entry.is_dir())
    return sorted(found)


def _stamp(split_dir: Path, classes: list[str], dirs: list[str]) -> tuple[str, int]:
    """What the index was built from (the classes and the walked folders with their times), and the
    newest of those times."""
    digest, newest = hashlib.sha256(f"{VERSION}\n{classes}\n".encode()), 0
    for name in dirs:
        try:
            mtime = os.stat(split_dir / name).st_mtime_ns
        except OSError:  # a folder gone: the stamp differs
            mtime = -1
        digest.update(f"{name}\t{mtime}\n".encode())
        newest = max(newest, mtime)
    return digest.hexdigest(), newest


def _read(path: Path, split_dir: Path, classes: list[str]) -> SampleIndex | None:
    try:
        with np.load(path, allow_pickle=False) as saved:
            dirs = bytes(saved["dirs"]).decode("utf-8").split("\n") if saved["dirs"].size else []
            stamp, newest = _stamp(split_dir, classes, dirs)
            # a folder changed within a second of the listing may have changed again in the same
            # clock tick, unseen: such an index is not trusted (git's "racily clean" rule)
            if str(saved["stamp"]) != stamp or newest >= int(saved["built_ns"]) - RACY_NS:
                return None
            return SampleIndex(split_dir, saved["blob"], saved["offsets"], saved["labels"])
    except (OSError, ValueError, KeyError):  # absent, unreadable, or not an index of ours
        return None


def _write(index: SampleIndex, split_dir: Path, classes: list[str], dirs: list[str], shared_writer: bool) -> None:
    """Beside the split if it is writable (by the shared writer only), else in the cache folder; a
    write that fails only costs the next run a listing. Written under a temporary name and renamed:
    readers see all or nothing."""
    arrays = dict(blob=index.blob, offsets=index.offsets, labels=index.labels,
                  dirs=np.frombuffer("\n".join(dirs).encode("utf-8"), dtype=np.uint8),
                  stamp=np.array(_stamp(split_dir, classes, dirs)[0]), built_ns=np.array(time.time_ns()))
    beside, cached = _index_paths(split_dir)
    if not shared_writer and os.access(split_dir.parent, os.W_OK):
        return  # the shared writer writes beside the split: the others would only write it again
    for path in (beside, cached):
        staging = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(staging, "wb") as f:
                np.savez(f, **arrays)
            os.replace(staging, path)
            return
        except OSError:  # read-only (EROFS) or not ours (EACCES): the next place
            with contextlib.suppress(OSError):  # on a read-only mount even removing a file never made fails
                staging.unlink(missing_ok=True)
