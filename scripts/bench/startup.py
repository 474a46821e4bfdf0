"""Loader start-up at ImageNet scale: building the torch loader without a sample index (today's walk
of the tree, which also writes the index) against with one, in the same run.

The tree is 1,281,167 + 50,000 empty .JPEG files in 1,000 classes, made once in a temporary folder
and reused (`--root`); a loader only lists files at start-up, so empty files cost what real ones
do. Cold and warm alternate, three of each; the medians are compared. Memory: what the file list
adds to the process (tracemalloc, which sees numpy's arrays too), with the index, and what the
plain list of (path, label) tuples of a walk costs. Last line:
`startup: RATIO (goal <= 0.25) cold S s, warm S s, file list M MB per rank (goal <= 100), ...`.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from data import LoaderSettings  # noqa: E402
from data.index import _index_paths  # noqa: E402
from data.sources import FolderSource  # noqa: E402
from data.torch_loader import TorchLoader  # noqa: E402
from data.tree import check_tree, list_samples  # noqa: E402
from train.config import Config  # noqa: E402

TRAIN, VAL, CLASSES = 1_281_167, 50_000, 1000


def make_tree(root: Path) -> None:
    """ImageNet's shape: names like n01440764/n01440764_10026.JPEG; skipped when already made."""
    done = root / ".complete"
    if done.is_file():
        return
    for split, total in (("train", TRAIN), ("val", VAL)):
        for c in range(CLASSES):
            wnid = f"n{1440764 + c * 7919:08d}"
            folder = root / split / wnid
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(total // CLASSES + (c < total % CLASSES)):
                open(folder / f"{wnid}_{i}.JPEG", "wb").close()
        print(f"made {split}: {total:,} files", flush=True)
    done.touch()


def build(root: Path) -> float:
    """Seconds to construct the loader, every start-up check included."""
    start = time.perf_counter()
    loader = TorchLoader(LoaderSettings.of(Config(data_dir=str(root), batch_size=256, workers=1, precision="fp32")), check_tree(str(root)), 0, 1,
                         torch.device("cpu"))
    seconds = time.perf_counter() - start
    loader.pool.shutdown()
    return seconds


def held_bytes(make) -> int:
    """Bytes that what make() returns holds on to (tracemalloc slows allocation: never timed with it)."""
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    kept = make()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del kept
    return held


def forget_index(root: Path) -> None:
    for split in ("train", "val"):
        for path in _index_paths(root / split):
            path.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "resnet-trainer-startup-tree"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    root = Path(args.root)
    make_tree(root)
    time.sleep(1.1)  # an index of folders changed in the last second is not trusted
    cold, warm = [], []
    for _ in range(args.repeats):
        forget_index(root)
        cold.append(build(root))
        warm.append(build(root))
    classes = check_tree(str(root))
    held = sum(held_bytes(lambda: FolderSource(root / split, classes)) for split in ("train", "val"))
    as_list = sum(held_bytes(lambda: list_samples(root / split, classes)) for split in ("train", "val"))
    cold_s, warm_s = statistics.median(cold), statistics.median(warm)
    print(f"cold (walk + index written): {', '.join(f'{s:.2f}' for s in cold)} s; warm (index read): "
          f"{', '.join(f'{s:.3f}' for s in warm)} s")
    print(f"startup: {warm_s / cold_s:.3f} (goal <= 0.25) cold {cold_s:.2f} s, warm {warm_s:.3f} s, file list "
          f"{held / 1e6:.0f} MB per rank (goal <= 100), a walk's list of tuples {as_list / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
