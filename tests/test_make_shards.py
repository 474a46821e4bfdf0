"""scripts/make_shards.py on messy trees: the shards hold the samples the trainer lists for the tree,
unreadable files behave the same in both, class names survive, and a rewrite replaces the whole set."""
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import data.shards as shards_module
from helpers import REPO
from helpers.read_only import KINDS, as_unprivileged, unwritable
from data.sources import FolderSource
from data.tree import check_tree
from data.shards import ShardSamples, write_shards
from data.torch_loader import TorchLoader
from train.config import Config


def image(path: Path, seed: int, mode="RGB", fmt="JPEG") -> None:
    """A tiny noisy picture (distinct bytes per seed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (12, 16, 3), dtype=np.uint8)
    Image.fromarray(pixels).convert(mode).save(path, format=fmt)


def clean_tree(root: Path, classes=("a", "b"), train_per_class=5) -> Path:
    for label, cls in enumerate(classes):
        for i in range(train_per_class):
            image(root / "train" / cls / f"{i}.JPEG", seed=label * 100 + i)
        image(root / "val" / cls / "0.JPEG", seed=label * 100 + 99)
    return root


def make_shards(src, out, shard_size, **run) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "make_shards.py"), "--src", str(src), "--out", str(out),
                           "--shard-size", str(shard_size)], capture_output=True, text=True, **run)


def refused(result: subprocess.CompletedProcess) -> bool:
    """make_shards' answer to bad input: one line, exit 2."""
    return result.returncode == 2 and result.stderr.startswith("error: ") and len(result.stderr.splitlines()) == 1


@pytest.fixture(scope="module")
def messy_tree(tmp_path_factory):
    """Every odd thing a real ImageFolder tree holds: 12 training samples (2 unreadable), 4 validation (1 unreadable)."""
    root = clean_tree(tmp_path_factory.mktemp("messy"), train_per_class=2)  # a/0, a/1, b/0, b/1
    a = root / "train" / "a"
    os.symlink(root / "nowhere.JPEG", a / "broken.JPEG")       # a broken link: listed, unreadable
    image(a / "sub" / "nested.JPEG", seed=7)                     # a nested folder: its images are samples
    (a / "readme.txt").write_text("not a sample")                # no image extension: not a sample
    (a / "zero.JPEG").write_bytes(b"")                           # zero bytes: listed, unreadable
    image(a / "png.JPEG", seed=8, fmt="PNG")                     # a PNG under a .JPEG name
    image(a / "gray.JPEG", seed=9, mode="L")
    image(a / "cmyk.JPEG", seed=10, mode="CMYK")
    image(root / "train" / "b" / "2.JPEG", seed=11)
    image(root / "train" / "b" / "3.JPEG", seed=12)
    image(root / "val" / "b" / "1.JPEG", seed=13)
    (root / "val" / "a" / "zero.JPEG").write_bytes(b"")
    return root


def file_bytes(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError:
        return b""  # what the shards store for a file that cannot be read


def test_shards_of_a_messy_tree_hold_exactly_the_samples_the_trainer_lists(messy_tree, tmp_path):
    result = make_shards(messy_tree, tmp_path / "shards", 5)
    assert result.returncode == 0, result.stderr
    assert "1 file(s) could not be read" in result.stdout and "broken.JPEG" in result.stdout
    classes = check_tree(str(messy_tree))
    assert check_tree(str(tmp_path / "shards")) == classes
    for split, count in (("train", 12), ("val", 4)):
        folder, packed = FolderSource(messy_tree / split, classes), ShardSamples(tmp_path / "shards" / split)
        assert len(folder) == len(packed) == count
        assert [packed.read(i) for i in range(count)] == [(file_bytes(path), label) for path, label in folder.samples]
    names = [Path(path).name for path, _ in FolderSource(messy_tree / "train", classes).samples]
    assert "nested.JPEG" in names and "readme.txt" not in names and "broken.JPEG" in names
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith((".partial", ".old"))]


def test_the_torch_loader_skips_the_same_files_in_the_tree_and_in_its_shards(messy_tree, tmp_path):
    write_shards(messy_tree, tmp_path / "shards", 5)
    runs = []
    for root in (messy_tree, tmp_path / "shards"):
        loader = TorchLoader(Config(data_dir=str(root), image_size=16, batch_size=4, workers=1, seed=3),
                             check_tree(str(root)), 0, 1, torch.device("cpu"))
        train = list(loader.train_batches(epoch=0))
        train_skipped = loader.take_skipped()[0]
        val = list(loader.val_batches())
        runs.append((train, train_skipped, val, loader.take_skipped()[0]))
    (train_a, skipped_a, val_a, val_skipped_a), (train_b, skipped_b, val_b, val_skipped_b) = runs
    assert (skipped_a, val_skipped_a) == (skipped_b, val_skipped_b) == (2, 1)  # broken + zero bytes; zero bytes
    assert len(train_a) == 3 and sum(len(y) for _, y in val_a) == 3
    for (xa, ya), (xb, yb) in zip(train_a + val_a, train_b + val_b, strict=True):
        assert torch.equal(ya, yb) and torch.equal(xa, xb)


def test_class_names_with_spaces_and_non_ascii_survive_shards(tmp_path):
    tree = clean_tree(tmp_path / "tree", classes=("n001 cat", "café", "日本", "n002"), train_per_class=2)
    write_shards(tree, tmp_path / "shards", 3)
    classes = check_tree(str(tree))
    assert classes == sorted(["n001 cat", "café", "日本", "n002"])
    assert check_tree(str(tmp_path / "shards")) == classes
    assert (tmp_path / "shards" / "classes.txt").read_bytes() == "".join(f"{c}\n" for c in classes).encode("utf-8")
    for split in ("train", "val"):
        packed = ShardSamples(tmp_path / "shards" / split)
        assert [packed.read(i)[1] for i in range(len(packed))] == FolderSource(tree / split, classes).targets.tolist()
    loader = TorchLoader(Config(data_dir=str(tmp_path / "shards"), image_size=16, batch_size=2, workers=1),
                         check_tree(str(tmp_path / "shards")), 0, 1, torch.device("cpu"))
    assert loader.num_classes == 4


@pytest.mark.slow
def test_rewriting_replaces_the_whole_set_of_shards(tmp_path):
    tree = clean_tree(tmp_path / "tree", train_per_class=7)  # 14 training images
    assert make_shards(tree, tmp_path / "shards", 3).returncode == 0
    assert len(list((tmp_path / "shards" / "train").glob("*.tar"))) == 5
    result = make_shards(tree, tmp_path / "shards", 8)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "shards" / "train").iterdir()) == \
        ["class_counts.json", *(f"shard-00000{i}.{ext}" for i in (0, 1) for ext in ("idx", "names", "tar"))]
    assert len(ShardSamples(tmp_path / "shards" / "train")) == 14
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shards", "tree"]  # no sibling left behind


def test_a_failed_rewrite_keeps_the_old_set_and_leaves_no_partial_files(tmp_path, monkeypatch):
    tree = clean_tree(tmp_path / "tree", train_per_class=7)
    write_shards(tree, tmp_path / "shards", 3)
    before = {p: p.read_bytes() for p in (tmp_path / "shards").rglob("*") if p.is_file()}
    written = []

    def failing_member(tar, name, payload):  # the disk fills up in the middle of the second shard
        written.append(name)
        if len(written) > 10:
            raise OSError("No space left on device")
        return member(tar, name, payload)
    member = shards_module._member
    monkeypatch.setattr(shards_module, "_member", failing_member)
    with pytest.raises(OSError):
        write_shards(tree, tmp_path / "shards", 4)
    assert {p: p.read_bytes() for p in (tmp_path / "shards").rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shards", "tree"]


def test_a_folder_holding_more_than_shards_is_refused(tmp_path):
    tree = clean_tree(tmp_path / "tree")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    for out in (tmp_path / "out", tree):
        result = make_shards(tree, out, 4)
        assert result.returncode == 2 and result.stderr.startswith("error: ") and len(result.stderr.splitlines()) == 1
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine" and len(list(tree.rglob("*.JPEG"))) == 12


def test_a_rewrite_stopped_between_the_two_renames_puts_the_old_set_back(tmp_path, monkeypatch):
    tree = clean_tree(tmp_path / "tree", train_per_class=7)
    write_shards(tree, tmp_path / "shards", 3)
    before = {p: p.read_bytes() for p in (tmp_path / "shards").rglob("*") if p.is_file()}
    renames, replace = [], os.replace

    def replace_failing_second(src, dst):  # the old set moved aside, then the new one cannot move in
        renames.append(dst)
        if len(renames) == 2:
            raise OSError("interrupted")
        replace(src, dst)
    monkeypatch.setattr(os, "replace", replace_failing_second)
    with pytest.raises(OSError):
        write_shards(tree, tmp_path / "shards", 4)
    monkeypatch.undo()
    assert {p: p.read_bytes() for p in (tmp_path / "shards").rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shards", "tree"]


def test_skipped_files_of_shards_are_named_by_their_source_file(messy_tree, tmp_path):
    write_shards(messy_tree, tmp_path / "shards", 5)
    names = {}
    for root in (messy_tree, tmp_path / "shards"):
        loader = TorchLoader(Config(data_dir=str(root), image_size=16, batch_size=4, workers=1, seed=3),
                             check_tree(str(root)), 0, 1, torch.device("cpu"))
        list(loader.train_batches(epoch=0))
        names[root] = loader.take_skipped()[1]
    from_tree, from_shards = names[messy_tree], names[tmp_path / "shards"]
    assert sorted(Path(n).name for n in from_tree) == ["broken.JPEG", "zero.JPEG"]
    assert len(from_shards) == 2
    for name in from_shards:  # the tree's path, then the shard that holds it
        source, shard = name.split(" (in ")
        assert source in from_tree and shard.startswith("shard-") and shard.endswith(".tar)")


def test_source_and_output_folders_are_checked_first(tmp_path):
    tree = clean_tree(tmp_path / "tree")
    missing = make_shards(tmp_path / "none", tmp_path / "out", 4)
    assert refused(missing) and "--src" in missing.stderr and "--data-dir" not in missing.stderr
    before = sorted(tree.rglob("*"))
    for out in (tree, tree / "train" / "shards", tree / "val", tree / "val" / "x" / "y"):
        result = make_shards(tree, out, 4)
        assert refused(result) and "--out" in result.stderr, (out, result.stderr)
    link = tmp_path / "link"
    link.symlink_to(tree / "train")
    assert refused(make_shards(tree, link / "shards", 4))  # inside train/ through a link
    assert sorted(tree.rglob("*")) == before and not (tmp_path / "out").exists()
    beside = make_shards(tree, tree / "shards", 4)  # prepare_imagenet.py's layout: outside the splits
    assert beside.returncode == 0, beside.stderr
    assert check_tree(str(tree)) == ["a", "b"] and check_tree(str(tree / "shards")) == ["a", "b"]


@pytest.mark.parametrize("kind", KINDS)
def test_an_output_folder_that_cannot_be_written_is_one_line(kind, tmp_path):
    """A read-only mount (EROFS) or a folder without write permission (EACCES), as --out, as a folder
    inside it, and as the folder the new set would be written beside."""
    tree = clean_tree(tmp_path / "tree")
    locked = tmp_path / "locked"
    (locked / "inside").mkdir(parents=True)
    command = [sys.executable, str(REPO / "scripts" / "make_shards.py"), "--src", str(tree), "--shard-size", "4"]
    with unwritable(kind, locked):
        for out in (locked / "shards", locked / "deeper" / "shards", locked / "inside"):
            result = subprocess.run(as_unprivileged([*command, "--out", str(out)]), capture_output=True, text=True)
            assert refused(result) and str(out.parent) in result.stderr, (out, result.stderr)
        if kind == "read-only mount":  # the mount point itself: the new set could never be renamed into place
            assert refused(make_shards(tree, locked, 4))
    assert [p.name for p in locked.rglob("*")] == ["inside"] and sorted(p.name for p in tmp_path.iterdir()) == ["locked", "tree"]


def test_a_class_without_training_images_is_said_by_make_shards_and_found_in_the_shards(tmp_path):
    tree = clean_tree(tmp_path / "tree", classes=("a", "b", "c"), train_per_class=4)
    for name in os.listdir(tree / "train" / "b"):
        os.unlink(tree / "train" / "b" / name)  # b keeps its folder (and index), without a training image
    result = make_shards(tree, tmp_path / "shards", 5)
    assert result.returncode == 0, result.stderr
    assert ("warning: 1 class folder(s) hold no training images and are written as classes without samples: b"
            in result.stdout.splitlines()), result.stdout
    for root in (tree, tmp_path / "shards"):  # the trainer's loader finds it in both (and warns: test_bad_data)
        loader = TorchLoader(Config(data_dir=str(root), image_size=16, batch_size=4, workers=1),
                             check_tree(str(root)), 0, 1, torch.device("cpu"))
        assert loader.empty_classes == ["b"], root
    full = make_shards(clean_tree(tmp_path / "full"), tmp_path / "full_shards", 5)
    assert full.returncode == 0 and "warning" not in full.stdout, full.stdout


def test_make_shards_says_how_many_files_are_written_of_how_many_with_an_eta(tmp_path):
    """A line at every file here (TRAINER_PROGRESS_EVERY_S=0); by default one every 5 s at most."""
    tree = clean_tree(tmp_path / "tree", train_per_class=5)  # 10 training and 2 validation images
    result = make_shards(tree, tmp_path / "shards", 4, env={**os.environ, "TRAINER_PROGRESS_EVERY_S": "0"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for split, total in (("train", 10), ("val", 2)):
        written = [int(m[1]) for line in lines if (m := re.fullmatch(
            rf"writing {split} shards: (\d+)/{total} files \([\d.,]+/s, ETA \d+:\d\d\)", line))]
        assert written == list(range(1, total + 1)), lines
        assert any(line.startswith(f"listing {tree / split}: {total} files found (") for line in lines), lines
