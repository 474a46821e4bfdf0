"""scripts/prepare_imagenet.py on a miniature ILSVRC2012: three classes, official archive layout."""
import hashlib
import io
import os
import re
import subprocess
import sys
import tarfile

import numpy as np
import pytest
from PIL import Image
from scipy.io import savemat

from helpers import REPO
from data.tree import check_tree

SCRIPT = REPO / "scripts" / "prepare_imagenet.py"
WNIDS = ["n01440764", "n01443537", "n01484850"]


def jpeg(colour, mode="RGB", fmt="JPEG") -> bytes:
    image = Image.new("RGB", (40, 30), colour)
    out = io.BytesIO()
    image.convert(mode).save(out, format=fmt)
    return out.getvalue()


def add(tar, name, payload):
    info = tarfile.TarInfo(name)
    info.size = len(payload)
    tar.addfile(info, io.BytesIO(payload))


COLOURS = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30), (30, 200, 200)]


def write_archives(root, wnids, truth, trained=None):
    """The three official files in root: a devkit whose leaf classes are wnids (ILSVRC ids 1, 2, ...),
    a training archive of the classes in trained (all by default), and validation image k (1-based)
    of ILSVRC id truth[k-1]."""
    trained = wnids if trained is None else trained
    colour_of = dict(zip(wnids, COLOURS))
    with tarfile.open(root / "ILSVRC2012_img_train.tar", "w") as train:
        for wnid in trained:
            inner = io.BytesIO()
            with tarfile.open(fileobj=inner, mode="w") as class_tar:
                for i in range(4):
                    add(class_tar, f"{wnid}_{i}.JPEG", jpeg(colour_of[wnid]))
                if wnid == wnids[0]:
                    add(class_tar, f"{wnid}_cmyk.JPEG", jpeg(colour_of[wnid], mode="CMYK"))
                    add(class_tar, f"{wnid}_png.JPEG", jpeg(colour_of[wnid], fmt="PNG"))
            add(train, f"{wnid}.tar", inner.getvalue())
    with tarfile.open(root / "ILSVRC2012_img_val.tar", "w") as val:
        for k, class_id in enumerate(truth, start=1):
            add(val, f"ILSVRC2012_val_{k:08d}.JPEG", jpeg(COLOURS[class_id - 1]))
    synsets = np.zeros(len(wnids) + 1, dtype=[("ILSVRC2012_ID", "O"), ("WNID", "O"), ("words", "O"), ("num_children", "O")])
    for i, wnid in enumerate(wnids):
        synsets[i] = (i + 1, wnid, f"class {i}", 0)
    synsets[-1] = (1001, "n00001740", "entity", 3)  # an inner node of the hierarchy: not a class
    mat = io.BytesIO()
    savemat(mat, {"synsets": synsets})
    with tarfile.open(root / "ILSVRC2012_devkit_t12.tar.gz", "w:gz") as devkit:
        add(devkit, "ILSVRC2012_devkit_t12/data/meta.mat", mat.getvalue())
        add(devkit, "ILSVRC2012_devkit_t12/data/ILSVRC2012_validation_ground_truth.txt",
            "".join(f"{t}\n" for t in truth).encode())
    return root


@pytest.fixture()
def archives(tmp_path):
    return write_archives(tmp_path, WNIDS, truth=[2, 1, 3, 3, 1, 2])


def prepare(archives, out, *extra, env=None):
    return subprocess.run([sys.executable, str(SCRIPT), "--train-tar", str(archives / "ILSVRC2012_img_train.tar"),
                           "--val-tar", str(archives / "ILSVRC2012_img_val.tar"),
                           "--devkit", str(archives / "ILSVRC2012_devkit_t12.tar.gz"), "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=300, env=env)


def test_counts_that_differ_from_ilsvrc2012_are_an_error(archives):
    result = prepare(archives, archives / "out")
    assert result.returncode == 2 and "counts differ" in result.stderr and "--allow-partial" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (archives / "out").exists()


@pytest.mark.slow
def test_miniature_ilsvrc_becomes_an_imagefolder_tree_with_manifest_and_shards(archives, monkeypatch):
    out = archives / "out"
    result = prepare(archives, out, "--allow-partial", "--shards", "--shard-size", "4")
    assert result.returncode == 0, result.stderr
    assert "train 14 (official 1,281,167)" in result.stderr and "classes 3 (official 1,000)" in result.stderr
    assert check_tree(str(out)) == WNIDS
    assert [len(list((out / "train" / w).iterdir())) for w in WNIDS] == [6, 4, 4]
    # validation images sit in the class of their ground-truth id
    assert sorted(p.name for p in (out / "val" / WNIDS[0]).iterdir()) == ["ILSVRC2012_val_00000002.JPEG", "ILSVRC2012_val_00000005.JPEG"]
    assert sorted(p.name for p in (out / "val" / WNIDS[2]).iterdir()) == ["ILSVRC2012_val_00000003.JPEG", "ILSVRC2012_val_00000004.JPEG"]
    for name in (f"{WNIDS[0]}_cmyk.JPEG", f"{WNIDS[0]}_png.JPEG"):
        with Image.open(out / "train" / WNIDS[0] / name) as image:
            assert image.format == "JPEG" and image.mode == "RGB"
            assert abs(np.asarray(image, dtype=float)[..., 0].mean() - 200) < 10
    manifest = (out / "manifest.tsv").read_text().splitlines()
    assert manifest[0].split("\t") == ["split", "path", "bytes", "sha256", "note"] and len(manifest) == 1 + 14 + 6
    for line in manifest[1:]:
        split, path, size, sha, note = line.split("\t")
        payload = (out / path).read_bytes()
        assert int(size) == len(payload) and sha == hashlib.sha256(payload).hexdigest()
    assert sum("converted" in line for line in manifest) == 2
    assert check_tree(str(out / "shards")) == WNIDS and len(list((out / "shards" / "train").glob("*.tar"))) == 4
    # the sample index of both splits is written and trusted: a run lists neither split again
    import data.index

    def no_walk(*args, **kwargs):
        raise AssertionError("walked the tree")
    monkeypatch.setattr(data.index, "list_samples", no_walk)
    assert [len(data.index.load_samples(out / split, WNIDS)) for split in ("train", "val")] == [14, 6]


def test_each_long_step_says_how_many_files_are_done_of_how_many_with_an_eta(archives):
    """A line at every file here (TRAINER_PROGRESS_EVERY_S=0): 14 training images extracted, 6
    validation images placed, both splits indexed, and shards written."""
    result = prepare(archives, archives / "out", "--allow-partial", "--shards", "--shard-size", "8",
                     env={**os.environ, "TRAINER_PROGRESS_EVERY_S": "0"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()

    def counted(what, total, unit="files"):
        pattern = rf"{re.escape(what)}: (\d+)/{total} {unit} \([\d.,]+/s, ETA \d+:\d\d\)"
        return [int(m[1]) for line in lines if (m := re.fullmatch(pattern, line))]
    assert counted(f"counting the images of {archives / 'ILSVRC2012_img_train.tar'}", 3, "class archives") == [1, 2, 3], lines
    assert counted("extracting training images", 14) == list(range(1, 15)), lines
    assert counted("placing validation images", 6) == list(range(1, 7)), lines
    assert counted("writing train shards", 14) == list(range(1, 15)) and counted("writing val shards", 6), lines
    assert any(line.startswith(f"indexing {archives / 'out' / 'train'}: 14 files found (") for line in lines), lines


@pytest.mark.slow
def test_an_interrupted_preparation_resumes_without_redoing_finished_classes(archives):
    out = archives / "out"
    assert prepare(archives, out, "--allow-partial").returncode == 0
    kept = (out / "train" / WNIDS[0] / f"{WNIDS[0]}_0.JPEG").stat().st_mtime_ns
    # as if killed while writing the last class: its folder is half-written and not yet in place
    (out / "train" / WNIDS[2]).rename(out / "train" / f"{WNIDS[2]}.partial")
    (out / "train" / f"{WNIDS[2]}.partial" / f"{WNIDS[2]}_3.JPEG").unlink()
    (out / ".manifests" / f"train-{WNIDS[2]}.tsv").unlink()
    result = prepare(archives, out, "--allow-partial")
    assert result.returncode == 0, result.stderr
    assert "resumed: 2 finished class(es) kept" in result.stdout
    assert (out / "train" / WNIDS[0] / f"{WNIDS[0]}_0.JPEG").stat().st_mtime_ns == kept
    assert len(list((out / "train" / WNIDS[2]).iterdir())) == 4 and not (out / "train" / f"{WNIDS[2]}.partial").exists()
    assert len((out / "manifest.tsv").read_text().splitlines()) == 1 + 14 + 6


@pytest.mark.slow
def test_validation_images_of_classes_without_training_data_are_left_out_and_counted(tmp_path):
    # a devkit of five classes, training archives of the first three, validation images of all five
    wnids = WNIDS + ["n01491361", "n01494475"]
    write_archives(tmp_path, wnids, truth=[2, 4, 1, 5, 3, 4, 1], trained=WNIDS)
    out = tmp_path / "out"
    result = prepare(tmp_path, out, "--allow-partial")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert "prepared 14 training and 4 validation images of 3 classes" in result.stdout
    assert "3 validation images of 2 classes without training data left out" in result.stdout
    assert check_tree(str(out)) == WNIDS
    assert sorted(p.name for p in (out / "val" / WNIDS[0]).iterdir()) == ["ILSVRC2012_val_00000003.JPEG", "ILSVRC2012_val_00000007.JPEG"]
    assert [p.name for p in (out / "val" / WNIDS[1]).iterdir()] == ["ILSVRC2012_val_00000001.JPEG"]
    assert [p.name for p in (out / "val" / WNIDS[2]).iterdir()] == ["ILSVRC2012_val_00000005.JPEG"]
    assert not list(out.rglob("*.partial"))
    assert len((out / "manifest.tsv").read_text().splitlines()) == 1 + 14 + 4
    again = prepare(tmp_path, out, "--allow-partial")  # a resumed run reports the same
    assert again.returncode == 0 and "3 validation images of 2 classes without training data left out" in again.stdout


@pytest.mark.parametrize("flag", ["--train-tar", "--val-tar", "--devkit"])
def test_a_file_that_is_not_a_tar_archive_is_named_in_one_error_line(archives, flag):
    notes = archives / "notes.txt"
    notes.write_text("not an archive\n")
    files = {"--train-tar": archives / "ILSVRC2012_img_train.tar", "--val-tar": archives / "ILSVRC2012_img_val.tar",
             "--devkit": archives / "ILSVRC2012_devkit_t12.tar.gz", flag: notes}
    result = subprocess.run([sys.executable, str(SCRIPT), *[str(a) for pair in files.items() for a in pair],
                             "--out", str(archives / "out"), "--allow-partial"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert f"{notes} is not a tar archive" in result.stderr
