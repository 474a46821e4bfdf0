"""The layout of a dataset on disk, shared by the loaders and the shard writer: an ImageNet-style
tree (train/<class>/*, val/<class>/*) or a folder of tar shards with classes.txt; its check, its
class names and the one listing of its samples."""
import os
from pathlib import Path

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class DataError(ValueError):
    """The data given cannot be used; the message says what to do."""


def write_classes(out: Path, classes: list[str]) -> None:
    (Path(out) / "classes.txt").write_text("".join(f"{name}\n" for name in classes), encoding="utf-8", newline="\n")


def read_classes(root: Path) -> list[str]:
    """The class names of classes.txt, one per line (names may hold spaces)."""
    text = (Path(root) / "classes.txt").read_bytes().decode("utf-8")  # bytes: no newline translation
    return [name for name in text.split("\n") if name]


def is_shard_tree(data_dir) -> bool:
    return (Path(data_dir) / "classes.txt").is_file() and any(Path(data_dir, "train").glob("*.tar"))


def _classes(split_dir: Path) -> list[str]:
    return sorted(entry.name for entry in os.scandir(split_dir) if entry.is_dir())


def check_tree(data_dir: str) -> list[str]:
    """The sorted class names of an ImageNet-layout tree (or of tar shards with classes.txt),
    or a DataError saying what is wrong."""
    root = Path(data_dir)
    if not root.is_dir():
        raise DataError(f"data directory {root} does not exist; pass --data-dir with train/<class>/*.jpg and val/<class>/*.jpg")
    if is_shard_tree(root):
        if not any((root / "val").glob("*.tar")):
            raise DataError(f"{root} has training shards but no val/*.tar; write both splits with scripts/make_shards.py")
        return read_classes(root)
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise DataError(f"data directory {root} has no {split}/ folder; expected {split}/<class>/*.jpg")
    train_classes, val_classes = _classes(root / "train"), _classes(root / "val")
    if not train_classes:
        raise DataError(f"{root / 'train'} holds no class folders; expected train/<class>/*.jpg")
    if train_classes != val_classes:
        only_train = sorted(set(train_classes) - set(val_classes))[:3]
        only_val = sorted(set(val_classes) - set(train_classes))[:3]
        raise DataError(f"train and val classes differ in {root} (only in train: {only_train}, only in val: {only_val}); "
                        "both splits need the same class folders")
    for split in ("train", "val"):
        if not any(name.lower().endswith(IMAGE_EXTENSIONS)
                   for cls in train_classes for name in os.listdir(root / split / cls)):
            raise DataError(f"{root / split} holds no images; expected {split}/<class>/*.jpg")
    return train_classes


def list_samples(split_dir: Path, classes: list[str], progress=None) -> list[tuple[str, int]]:
    """(path, label) of every sample of one split of an ImageFolder tree, in the order the trainer
    indexes them; the shard writer (data/shards.py) lists a tree with this too, so shards hold the
    same samples. torchvision's ImageFolder rule: class by class, each class folder walked with its
    subfolders (symlinks followed), names sorted, every file with an image extension. A file that
    turns out unreadable (a broken link, zero bytes) stays a sample: the loaders skip and count it.
    `progress` (data/progress.py Progress): ticked with the samples found so far."""
    import torchvision  # here, not above: DALI's reader processes import this module without torch

    found = 0

    def is_sample(path: str) -> bool:  # torchvision's own extension test, counted
        nonlocal found
        if not path.lower().endswith(IMAGE_EXTENSIONS):
            return False
        found += 1
        if progress is not None:
            progress.tick(found)
        return True
    if progress is not None:
        progress.restart()  # the rate is the walk's, without the import above
    class_to_idx = {c: i for i, c in enumerate(classes)}
    return torchvision.datasets.folder.make_dataset(str(split_dir), class_to_idx, is_valid_file=is_sample,
                                                    allow_empty=True)
