"""The DALI loader's training feed, read in DALI's reader processes: the same files and labels per rank,
epoch and first step as the torch loader (the shared sampler), unreadable files skipped and counted
once per epoch, and one pipeline for the whole run, whatever the crop size; batches that are DALI's
own buffers and stay intact while it runs on."""
import gc
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from data.dali import DaliLoader
from data.shards import write_shards
from data.torch_loader import TorchLoader
from data.tree import DataError, check_tree
from train.config import Config

STD_255 = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255
BAD = {"empty.jpg", "text.jpg", "truncated.jpg"}


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """24 training images (8 per class) of smooth gradients in varied sizes, so that DALI's resize and
    torchvision's stay close, each of its own steepness, so that a wrong file shows; 3 validation images."""
    root = tmp_path_factory.mktemp("feed")
    rng = np.random.default_rng(1)
    for split, count in (("train", 8), ("val", 1)):
        for blue, cls in ((220, "a"), (30, "b"), (120, "c")):
            (root / split / cls).mkdir(parents=True)
            for i in range(count):
                h, w = rng.integers(40, 90, 2)
                y, x = np.mgrid[0:h, 0:w]
                steep = (i + 1) / count  # each image its own gradient
                pixels = np.stack([x / w * 255 * steep, y / h * 255 * (1 - steep), np.full((h, w), blue)], -1)
                Image.fromarray(pixels.astype(np.uint8)).save(root / split / cls / f"{cls}{i}.jpg", quality=95)
    return root


@pytest.fixture(scope="module")
def bad_tree(tree, tmp_path_factory):
    """The tree with three unreadable training files (24 + 3 = 27 = 9 batches of 3: every position is
    read). Two are neighbours, so the search from the first passes the second too: the second is met
    twice an epoch and counted once."""
    root = tmp_path_factory.mktemp("bad") / "tree"
    shutil.copytree(tree, root)
    (root / "train" / "a" / "empty.jpg").write_bytes(b"")
    (root / "train" / "a" / "text.jpg").write_text("not an image")
    whole = (root / "train" / "c" / "c0.jpg").read_bytes()
    (root / "train" / "c" / "truncated.jpg").write_bytes(whole[: len(whole) // 2])
    return root


def pair(root, rank=0, world=1, batch_size=2):
    """The DALI loader (one reader process) and the torch loader for the same rank."""
    cfg = Config(data_dir=str(root), image_size=32, batch_size=batch_size, workers=1)
    classes, cpu = check_tree(str(root)), torch.device("cpu")
    return DaliLoader(cfg, classes, rank, world, cpu), TorchLoader(cfg, classes, rank, world, cpu)


def batches(loader, epoch, start_step=0, augment=True):
    """(images, labels, batch sizes, each batch's positions in the epoch's order as the loader says them)."""
    out, positions = [], []
    for images, labels in loader.train_batches(epoch, start_step, augment):
        out.append((images, labels))
        positions.append(list(loader.last_positions))
    return torch.cat([x for x, _ in out]), torch.cat([y for _, y in out]), [len(y) for _, y in out], positions


def assert_same_files(dali, torch_loader, epoch, start_step=0):
    """Labels equal, and pixels (the evaluation transform) within DALI-vs-torchvision resampling."""
    images, labels, sizes, positions = batches(dali, epoch, start_step, augment=False)
    reference, reference_labels, reference_sizes, reference_positions = batches(torch_loader, epoch, start_step,
                                                                                augment=False)
    assert labels.tolist() == reference_labels.tolist() and sizes == reference_sizes
    assert images.shape == reference.shape  # (the crop size: the torch loader's current one)
    assert positions == reference_positions  # what the run's sample ledger counts
    levels = (images - reference).abs() * STD_255  # back to 0-255 pixel levels
    assert levels.flatten(1).mean(1).max() < 5 and levels.max() < 20, float(levels.flatten(1).mean(1).max())
    return labels


def test_each_rank_reads_the_torch_loaders_files_from_any_step(tree):
    seen = {}
    for rank in (0, 1):
        dali, torch_loader = pair(tree, rank, 2)
        assert dali.steps_per_epoch == 24 // 4
        for start_step in (0, 2, 5):  # a fresh epoch, and resumed ones: one pipeline for all of them
            seen[rank, start_step] = assert_same_files(dali, torch_loader, epoch=1, start_step=start_step)
            assert len(seen[rank, start_step]) == (6 - start_step) * 2
        assert dali.builds == 1
    assert seen[0, 0].tolist() != seen[1, 0].tolist()  # the two ranks' halves, not one rank's files twice


def test_epochs_differ_and_the_pipeline_is_built_once(tree):
    dali, torch_loader = pair(tree, batch_size=4)
    orders = [assert_same_files(dali, torch_loader, epoch) for epoch in (0, 1, 2)]
    assert len({tuple(order.tolist()) for order in orders}) == 3
    assert dali.builds == 1  # the evaluation transform's pipeline, for all three epochs
    for epoch in (3, 4):
        assert batches(dali, epoch)[1].tolist() == batches(torch_loader, epoch)[1].tolist()
    assert dali.builds == 2 and dali.passes[True][1].count == 2  # plus the training transform's, once


def test_an_epoch_left_unfinished_does_not_leak_into_the_next(tree):
    dali, torch_loader = pair(tree)
    first = dali.train_batches(0)
    next(first)  # the loop stopped after one step
    assert batches(dali, 1)[1].tolist() == batches(torch_loader, 1)[1].tolist()
    assert next(first, None) is None  # the old epoch's batches are gone
    assert dali.builds == 1


def test_unreadable_files_are_skipped_and_counted_once_per_epoch(bad_tree):
    dali, torch_loader = pair(bad_tree, batch_size=3)
    for epoch in (0, 1):
        for loader in (dali, torch_loader):  # the same replacements, so the same labels
            _, labels, sizes, _ = batches(loader, epoch)
            assert sizes == [3] * 9
            skipped, names = loader.take_skipped()
            assert skipped == 3 and {Path(n).name for n in names} == BAD, (loader, epoch)
            if loader is dali:
                dali_labels = labels
        assert dali_labels.tolist() == labels.tolist()


def test_batch_size_control_rebuilds_for_the_new_batch(tree):
    dali, torch_loader = pair(tree, batch_size=4)
    batches(dali, 0)
    for loader in (dali, torch_loader):
        loader.set_batch_size(3)
    _, labels, sizes, _ = batches(dali, 1)
    assert sizes == [3] * 8 and labels.tolist() == batches(torch_loader, 1)[1].tolist()
    assert dali.builds == 2


def test_shards_feed_the_same_files(tree, tmp_path):
    write_shards(tree, tmp_path / "shards", shard_size=10)
    dali, _ = pair(tmp_path / "shards", 1, 2)
    _, torch_loader = pair(tree, 1, 2)
    assert_same_files(dali, torch_loader, epoch=2, start_step=1)


def test_a_split_without_one_readable_file_is_a_data_error(tmp_path):
    for split in ("train", "val"):
        for cls in ("a", "b"):
            (tmp_path / split / cls).mkdir(parents=True)
            for i in range(2):
                (tmp_path / split / cls / f"{i}.jpg").write_bytes(b"")
    dali, _ = pair(tmp_path)
    with pytest.raises(DataError, match="no readable training image at all"):
        next(dali.train_batches(0))


def _children(pid: int) -> list[int]:
    tasks = Path(f"/proc/{pid}/task")
    return [int(child) for task in tasks.iterdir() for child in (task / "children").read_text().split()]


def _reader_processes() -> set[int]:
    """This process's DALI reader processes (spawned: `spawn_main` in their command line)."""
    return {pid for pid in _children(os.getpid())
            if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")}


def test_a_crop_size_change_keeps_the_pipeline_and_its_readers(tree):
    """Progressive resizing: the crop size is an input of each pass, not of the graph, so a change
    builds no pipeline and spawns no reader, and the batches after it have the new size: random
    crops, and the evaluation transform of the training files, pixel for pixel the torch loader's."""
    dali, torch_loader = pair(tree, batch_size=4)
    assert batches(dali, 0)[0].shape[1:] == (3, 32, 32)
    readers = _reader_processes()
    for loader in (dali, torch_loader):
        loader.set_image_size(48)
    images, labels, _, _ = batches(dali, 1)
    assert images.shape[1:] == (3, 48, 48) and labels.tolist() == batches(torch_loader, 1)[1].tolist()
    assert dali.builds == 1 and not _reader_processes() - readers
    for size in (48, 40):  # the evaluation transform's pipeline: built once, for both sizes
        for loader in (dali, torch_loader):
            loader.set_image_size(size)
        assert_same_files(dali, torch_loader, epoch=2)
    assert torch_loader.train_size == 40 and dali.builds == 2


def test_a_batch_stays_as_dali_wrote_it_while_dali_runs_on(tree):
    """The loop's batch is DALI's own output buffer (no copy): DALI must not reuse it while the batch
    is held, however many batches it makes meanwhile."""
    dali, _ = pair(tree, batch_size=4)
    epoch = dali.train_batches(0)
    first, _ = next(epoch)
    kept = first.clone()
    for _ in epoch:
        pass
    batches(dali, 1)
    assert torch.equal(first, kept)


def test_the_reader_processes_do_not_load_torch(tree):
    """Each reader is a spawned process that imports what it unpickles; torch there would cost every
    reader some 370 MB. Its mapped libraries say whether it was imported."""
    dali, torch_loader = pair(tree, batch_size=4)
    assert batches(dali, 0)[1].tolist() == batches(torch_loader, 0)[1].tolist()
    readers = sorted(_reader_processes())
    assert len(readers) == 1  # --workers 1 (pair)
    maps = Path(f"/proc/{readers[0]}/maps").read_text()
    assert "libdali" in maps and "libtorch" not in maps
    dali.close()  # (Horovod Elastic replaces the loader when the workers change)
    gc.collect()
    deadline = time.time() + 30
    while readers[0] in _children(os.getpid()) and time.time() < deadline:
        time.sleep(0.1)
    assert readers[0] not in _children(os.getpid())
