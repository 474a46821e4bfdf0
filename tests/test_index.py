"""The sample index (data/index.py): built once, read by every rank without walking the tree,
rebuilt when the tree changes, and never able to run code."""
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

import data.index
from data.embedded import ensure_embedded
from data.index import load_samples
from data.tree import check_tree, list_samples
from helpers import REPO, child_env, launch
from helpers.read_only import KINDS, as_unprivileged, unwritable


@pytest.fixture
def tree(tmp_path):
    """A small tree last changed an hour ago (an index is not trusted within a second of a change)."""
    root = ensure_embedded(train_per_class=3, val_per_class=2, root=tmp_path / "data")
    backdate(root)
    return root, check_tree(str(root))


def backdate(root):
    hour_ago = time.time() - 3600
    for folder in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        os.utime(folder, (hour_ago, hour_ago))


def walks(monkeypatch) -> list:
    """Record every walk of a tree (list_samples) from now on."""
    calls = []

    def counted(split_dir, classes, **how):
        calls.append(split_dir)
        return list_samples(split_dir, classes, **how)
    monkeypatch.setattr(data.index, "list_samples", counted)
    return calls


def test_built_once_then_read_without_a_walk(tree, monkeypatch):
    root, classes = tree
    calls = walks(monkeypatch)
    first = load_samples(root / "train", classes)
    assert len(calls) == 1 and (root / ".index-train.npz").is_file()
    again = load_samples(root / "train", classes)
    assert len(calls) == 1  # the index, not a walk
    assert list(again) == list(first) == list_samples(root / "train", classes)
    assert again.labels.dtype == np.int32 and len(again) == 30


def test_an_index_of_a_tree_changed_just_before_is_not_trusted(tmp_path, monkeypatch):
    root = ensure_embedded(train_per_class=3, val_per_class=2, root=tmp_path / "fresh")  # folders changed now
    classes = check_tree(str(root))
    calls = walks(monkeypatch)
    load_samples(root / "train", classes)
    load_samples(root / "train", classes)
    assert len(calls) == 2


def test_a_changed_tree_is_noticed_and_listed_again(tree, monkeypatch):
    """By the folders' times, even when they are older than the index (a file server's clock behind
    ours): each change is backdated to an hour ago."""
    root, classes = tree
    load_samples(root / "train", classes)
    calls = walks(monkeypatch)
    some = sorted((root / "train" / classes[0]).iterdir())[0]

    def changed(change, expected):
        time.sleep(0.05)  # another hour_ago than the last one
        change()
        backdate(root)
        before = len(calls)
        samples = load_samples(root / "train", classes)
        assert len(calls) == before + 1 and len(samples) == expected
        assert list(samples) == list_samples(root / "train", classes)
        load_samples(root / "train", classes)
        assert len(calls) == before + 1  # the new index is used
    changed(lambda: shutil.copy(some, some.with_name("added.jpg")), 31)  # a file added to a class folder
    deeper = root / "train" / classes[1] / "deeper"
    changed(lambda: (deeper.mkdir(), shutil.copy(some, deeper / "x.jpg")), 32)  # a new subfolder
    changed(lambda: shutil.copy(some, deeper / "y.jpg"), 33)  # a file added inside the subfolder
    changed(some.unlink, 32)  # a file removed
    changed(lambda: (deeper / "x.jpg").rename(deeper / "z.jpg"), 32)  # renamed: the order may change


def test_read_only_data_keeps_its_index_in_the_cache(tree, monkeypatch, private_cache):
    root, classes = tree
    (root / ".index-train.npz").mkdir()  # where the index would go cannot be written
    calls = walks(monkeypatch)
    load_samples(root / "train", classes)
    assert list((private_cache / "index").glob("*-train.npz"))
    load_samples(root / "train", classes)
    assert len(calls) == 1


def test_an_index_holding_pickled_objects_is_never_unpickled(tree, monkeypatch):
    root, classes = tree
    load_samples(root / "train", classes)
    with np.load(root / ".index-train.npz") as saved:
        arrays = dict(saved)
    arrays["labels"] = np.array([object()] * 30, dtype=object)  # would need pickle to read
    np.savez(root / ".index-train.npz", **arrays)
    calls = walks(monkeypatch)
    samples = load_samples(root / "train", classes)
    assert len(calls) == 1 and samples.labels.dtype == np.int32  # refused, listed again


def test_the_listing_says_how_many_files_it_has_found_on_the_shared_writer_only(tmp_path, monkeypatch, capsys):
    """A few hundred files, a line at every tick (TRAINER_PROGRESS_EVERY_S=0): the shared writer
    (rank 0) prints the count so far, the other ranks print nothing."""
    classes = ["a", "b", "c"]
    for name in classes:
        (tmp_path / "train" / name).mkdir(parents=True)
        for number in range(100):
            (tmp_path / "train" / name / f"{number:03d}.jpg").touch()
    (tmp_path / "train" / "a" / "notes.txt").touch()  # not a sample: not counted
    monkeypatch.setenv("TRAINER_PROGRESS_EVERY_S", "0")
    assert len(load_samples(tmp_path / "train", classes, shared_writer=False)) == 300
    assert capsys.readouterr().out == ""
    assert len(load_samples(tmp_path / "train", classes, relist=True)) == 300
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 300 and lines[-1].startswith(f"indexing {tmp_path / 'train'}: 300 files found ("), lines[-3:]


@pytest.mark.multiprocess
def test_every_rank_reads_the_index_and_none_walks(tree, tmp_path):
    root, classes = tree
    for split in ("train", "val"):
        load_samples(root / split, classes)  # as prepare_imagenet or a first run leaves it
    out = tmp_path / "rank"
    result = launch("torch", 2, REPO / "tests" / "helpers" / "index_check.py", root, out, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    ranks = [json.loads(open(f"{out}.{rank}").read()) for rank in (0, 1)]
    expected = list_samples(root / "train", classes)
    assert all(r["train"] == 30 and r["val"] == 20 and tuple(r["first"]) == expected[0] for r in ranks)


START_UP = """
import json, sys
import torch
from data.loaders import LoaderSettings
from data.torch_loader import TorchLoader
from data.tree import check_tree
from train.config import Config
settings = LoaderSettings.of(Config(data_dir=sys.argv[1], image_size=16, batch_size=4, workers=1, precision="fp32"))
loader = TorchLoader(settings,
                     check_tree(sys.argv[1]), 0, 1, torch.device("cpu"))
print(json.dumps(dict(train=loader.train_images, val=loader.val_images, batch=len(next(loader.val_batches())[1]))))
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_a_read_only_data_folder_starts_with_its_index_in_the_cache(kind, tree, tmp_path, monkeypatch):
    """Start-up on data it may not write, a read-only mount (EROFS) or a folder without write
    permission (EACCES): the loader starts, the index goes to the cache folder, and the next start
    reads it there without a walk."""
    root, classes = tree
    cache = tmp_path / "cache"
    with unwritable(kind, root):
        result = subprocess.run(as_unprivileged([sys.executable, "-c", START_UP, str(root)]), capture_output=True,
                                text=True, env=child_env(TRAINER_CACHE_DIR=str(cache)))
        assert result.returncode == 0, result.stderr[-2000:]
        assert json.loads(result.stdout) == dict(train=30, val=20, batch=4)
        assert not [p.name for p in root.iterdir() if p.name.startswith(".index")]  # nothing written there
        assert [len(list((cache / "index").glob(f"*-{split}.npz"))) for split in ("train", "val")] == [1, 1]
        monkeypatch.setenv("TRAINER_CACHE_DIR", str(cache))
        calls = walks(monkeypatch)
        assert len(load_samples(root / "train", classes)) == 30 and calls == []  # the cache's index
