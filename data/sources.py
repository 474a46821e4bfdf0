"""Where a split's samples come from, as (bytes, label) by index: a folder tree (through its index,
data/index.py) or tar shards; the search for a readable file; the checks that an image is complete.
No torch here: DALI's reader processes unpickle these and would otherwise each import torch (some
370 MB of private memory per process)."""
from pathlib import Path

import numpy as np

from data.index import load_samples
from data.shards import ShardSamples
from data.tree import DataError, is_shard_tree

JPEG_START, JPEG_END, PNG_START = b"\xff\xd8", b"\xff\xd9", b"\x89PNG"


def complete_jpeg(payload: bytes) -> bool:
    """A JPEG that still ends with its EOI marker (entropy-coded data never contains one)."""
    return payload[:2] == JPEG_START and JPEG_END in payload[-1024:]


def complete_png(payload: bytes) -> bool:
    return payload[:4] == PNG_START and b"IEND" in payload[-16:]


class FolderSource:
    """The (image, label) samples of one split of an ImageFolder tree, from its index (data/index.py)."""

    def __init__(self, split_dir: Path, classes: list[str], shared_writer: bool = True, relist: bool = False):
        self.samples = load_samples(split_dir, classes, shared_writer, relist)
        self.targets = self.samples.labels
        self.num_classes = len(classes)

    def class_counts(self) -> list[int] | None:
        """Samples per class."""
        return np.bincount(self.targets, minlength=self.num_classes).tolist()

    def digest(self) -> str:
        return self.samples.digest()

    def __len__(self) -> int:
        return len(self.samples)

    def read(self, index: int) -> tuple[bytes, int]:
        path, label = self.samples[index]
        with open(path, "rb") as f:
            return f.read(), label

    def name(self, index: int) -> str:
        return self.samples.path(index)


class ShardSource(ShardSamples):
    """The (image, label) samples of one split's tar shards (their labels live inside the shards:
    the class counts come from class_counts.json)."""

    def digest(self) -> str:
        import hashlib
        import json
        listed = [(Path(tar).name, sample) for tar, sample in self.entries]
        return hashlib.sha256(json.dumps(listed, sort_keys=True).encode()).hexdigest()


def first_readable(source, index: int, attempt):
    """(attempt(position), names skipped) for the first position from `index` on (wrapping round the
    split) whose file `attempt` can use; `attempt` returns None for an unreadable file. A skipped
    file's neighbour takes its place with its own label, so a batch keeps its size."""
    skipped = []
    for offset in range(len(source)):
        position = (index + offset) % len(source)
        value = attempt(position)
        if value is not None:
            return value, skipped
        skipped.append(source.name(position))
    raise DataError("no readable training image at all")


def open_split(root: Path, split: str, classes: list[str], shared_writer: bool = True, relist: bool = False):
    """The samples of one split: tar shards when the folder holds them, else an ImageFolder tree
    (its index written beside it by the `shared_writer` only; `relist`: trust no index)."""
    if is_shard_tree(root):
        return ShardSource(root / split)
    return FolderSource(root / split, classes, shared_writer, relist)
