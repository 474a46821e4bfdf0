"""Bad files in a dataset: decoded when they are valid images in another format, otherwise skipped
and counted (with names), never a crash and never a silent label shift."""
import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import read_metrics, run_train
from data.embedded import ensure_embedded
from data.decode import BadImage, load_rgb
from data.sources import FolderSource
from data.tree import check_tree
from data.torch_loader import TorchLoader, TrainCrop, train_item
from train.config import Config


@pytest.fixture(scope="module")
def bad_tree(tmp_path_factory):
    """Three classes from the embedded data plus every kind of bad or odd file."""
    root = tmp_path_factory.mktemp("bad")
    source = ensure_embedded()
    for split, keep in (("train", 6), ("val", 3)):
        for cls in ("blue_blobs", "red_hstripes", "yellow_checker"):
            (root / split / cls).mkdir(parents=True)
            for f in sorted((source / split / cls).iterdir())[:keep]:
                shutil.copy(f, root / split / cls / f.name)
        (root / split / "zz_empty").mkdir()  # an empty class folder keeps its index
    rgb = Image.open(sorted((source / "train" / "red_hstripes").iterdir())[0]).convert("RGB")
    odd = root / "train" / "red_hstripes"
    rgb.save(odd / "png_inside.JPEG", format="PNG")                    # a PNG with a .JPEG name
    rgb.convert("CMYK").save(odd / "cmyk.JPEG", format="JPEG")          # CMYK JPEG
    rgb.convert("L").save(odd / "gray.JPEG", format="JPEG")             # grayscale
    bad = root / "train" / "blue_blobs"
    whole = (sorted((source / "train" / "blue_blobs").iterdir())[0]).read_bytes()
    (bad / "truncated.JPEG").write_bytes(whole[: len(whole) // 2])
    (bad / "empty.JPEG").write_bytes(b"")
    (bad / "notes.JPEG").write_text("this is not an image")
    os.symlink(root / "nowhere.JPEG", bad / "unreadable.JPEG")
    (root / "val" / "yellow_checker" / "zero.JPEG").write_bytes(b"")
    return root


BAD_NAMES = {"truncated.JPEG", "empty.JPEG", "notes.JPEG", "unreadable.JPEG"}


def test_valid_images_in_other_formats_decode_as_rgb(bad_tree):
    odd = bad_tree / "train" / "red_hstripes"
    for name in ("png_inside.JPEG", "cmyk.JPEG", "gray.JPEG"):
        image = load_rgb(str(odd / name))
        assert image.mode == "RGB" and image.size[0] > 10
    red = np.asarray(load_rgb(str(odd / "cmyk.JPEG")), dtype=np.float32)
    reference = np.asarray(load_rgb(str(odd / "png_inside.JPEG")), dtype=np.float32)
    assert np.abs(red - reference).mean() < 20  # CMYK converted to the same colours, not garbage
    for name in BAD_NAMES:
        with pytest.raises(BadImage):
            load_rgb(str(bad_tree / "train" / "blue_blobs" / name))


def test_bad_files_are_replaced_by_the_next_readable_file_with_its_own_label(bad_tree):
    classes = check_tree(str(bad_tree))
    assert classes[-1] == "zz_empty" and len(classes) == 4
    source = FolderSource(bad_tree / "train", classes)
    crop = TrainCrop(16, (0.08, 1.0), (3 / 4, 4 / 3))
    skipped_seen = set()
    for index, (path, label) in enumerate(source.samples):
        image, got_label, skipped = train_item(source, index, 0, crop)
        assert image.shape == (3, 16, 16) and image.dtype == torch.uint8
        skipped_seen.update(os.path.basename(p) for p in skipped)
        used = index + len(skipped)
        assert got_label == source.samples[used % len(source.samples)][1]  # the label of the file used
        if os.path.basename(path) in BAD_NAMES:
            assert skipped and skipped[0] == path
        else:
            assert not skipped
    assert skipped_seen == BAD_NAMES


def test_loader_keeps_batch_sizes_counts_skips_and_evaluates_each_good_image_once(bad_tree):
    cfg = Config(data_dir=str(bad_tree), image_size=32, batch_size=4, workers=0)
    loader = TorchLoader(cfg, check_tree(str(bad_tree)), 0, 1, torch.device("cpu"))
    assert loader.empty_classes == ["zz_empty"]
    sizes = [len(labels) for _, labels in loader.train_batches(epoch=0)]
    assert sizes == [4] * loader.steps_per_epoch
    count, examples = loader.take_skipped()
    assert count >= 1 and examples and all(os.path.basename(e) in BAD_NAMES for e in examples)
    val = list(loader.val_batches())
    assert sum(len(labels) for _, labels in val) == loader.val_images - 1  # the zero-byte file is not evaluated
    assert all(images.is_contiguous(memory_format=torch.channels_last) for images, _ in val)  # the short batch too
    assert loader.take_skipped()[0] == 1


def test_training_on_a_tree_with_bad_files_finishes_and_names_each_once_and_counts_it_every_time(bad_tree, tmp_path):
    result = run_train("--data-dir", bad_tree, "--out-dir", "run", "--arch", "resnet18", "--image-size", 32,
                       "--batch-size", 4, "--epochs", 2, "--eval-every", 1, "--workers", 1, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "zz_empty" in result.stdout
    metrics = read_metrics(tmp_path / "run")
    epochs = [m["skipped_images"] for m in metrics if m["kind"] == "epoch"]
    assert len(epochs) == 2 and all(count >= 3 for count in epochs), epochs  # counted in every epoch
    # named once a run: the training warnings name each bad file skipped once in all, the two
    # evaluations' one zero-byte file once
    said = [line for line in result.stdout.splitlines() if "unreadable training image(s)" in line]
    assert sum(int(line.split("skipped ")[1].split()[0]) for line in said) == max(epochs) <= len(BAD_NAMES), said
    named = [name for line in said for name in line.split("e.g. ")[1].split(" (")[0].split(", ")]
    assert len(named) == len(set(named)) and {os.path.basename(name) for name in named} <= BAD_NAMES
    validation = [line for line in result.stdout.splitlines() if "unreadable validation image(s)" in line]
    assert len(validation) == 1 and "zero.JPEG" in validation[0], validation
    evals = [m for m in metrics if m["kind"] == "eval"]
    assert len(evals) == 2 and all(e["eval_images"] == 9 and e["skipped_images"] == 1 for e in evals)


@pytest.mark.slow
def test_an_epochs_skipped_count_is_carried_across_a_resume(bad_tree, tmp_path):
    command = ["--data-dir", bad_tree, "--arch", "resnet18", "--image-size", 32, "--batch-size", 4,
               "--epochs", 1, "--eval-every", 0, "--workers", 1, "--seed", 3]
    whole = run_train(*command, "--out-dir", "whole", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr
    (expected,) = [m["skipped_images"] for m in read_metrics(tmp_path / "whole") if m["kind"] == "epoch"]
    first = run_train(*command, "--out-dir", "split", "--max-steps", 4, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    second = run_train(*command, "--out-dir", "split", "--resume", "--max-steps", 0, cwd=tmp_path)
    assert second.returncode == 0 and "resuming split at step 4" in second.stdout, second.stderr
    before, after = [m["skipped_images"] for m in read_metrics(tmp_path / "split") if m["kind"] == "epoch"]
    # what makes this test mean something: files were skipped before the stop (a count that started
    # again at the resume would say fewer)
    assert before > 0 and after == expected, (before, after, expected)
    # and the resumed segment names no file the first one named
    said = [line for line in (first.stdout + second.stdout).splitlines() if "unreadable training" in line]
    named = [name for line in said for name in line.split("e.g. ")[1].split(" (")[0].split(", ")]
    assert len(named) == len(set(named)), said


SKIP_BAD = {"a4_empty.JPEG", "a5_text.JPEG", "a6_truncated.JPEG", "b9_broken.JPEG"}


@pytest.fixture(scope="module")
def skip_tree(tmp_path_factory):
    """16 training files, 4 unreadable: three in a row (each one's search for a replacement passes the
    next), and the very last one (its search wraps round to the first file)."""
    root = tmp_path_factory.mktemp("skips")
    rng = np.random.default_rng(5)
    for split, names in (("train", {"a": ["a0", "a1", "a2", "a3", "a7"], "b": [f"b{i}" for i in range(7)]}),
                         ("val", {"a": ["a0"], "b": ["b0"]})):
        for cls, stems in names.items():
            (root / split / cls).mkdir(parents=True)
            for stem in stems:
                pixels = rng.integers(0, 256, (24, 24, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / cls / f"{stem}.JPEG")
    a, b = root / "train" / "a", root / "train" / "b"
    (a / "a4_empty.JPEG").write_bytes(b"")
    (a / "a5_text.JPEG").write_text("not an image")
    whole = (a / "a0.JPEG").read_bytes()
    (a / "a6_truncated.JPEG").write_bytes(whole[: len(whole) // 2])
    os.symlink(root / "nowhere.JPEG", b / "b9_broken.JPEG")
    return root


def expected_labels(loader) -> list[int]:
    """Per sampled index, the label of the first readable file from it on: the replacement rule."""
    samples = loader.train_source.samples
    labels = []
    for batch in loader.sampler:
        for index, _ in batch:
            position = index
            while os.path.basename(samples[position][0]) in SKIP_BAD:
                position = (position + 1) % len(samples)
            labels.append(samples[position][1])
    return labels


def check_one_count_per_file(loader, batches, batch_size):
    count, names = loader.take_skipped()
    assert count == len(SKIP_BAD)  # each unreadable file once, however many searches passed it
    assert len(names) == len(set(names)) and {os.path.basename(n) for n in names} <= SKIP_BAD
    assert [len(y) for _, y in batches] == [batch_size] * (16 // batch_size)
    assert torch.cat([y for _, y in batches]).tolist() == expected_labels(loader)


@pytest.mark.parametrize("batch_size", [4, 16])
def test_the_torch_loader_counts_each_unreadable_file_once_per_epoch(skip_tree, batch_size):
    classes = check_tree(str(skip_tree))
    runs = {}
    for workers in (1, 3):
        loader = TorchLoader(Config(data_dir=str(skip_tree), image_size=16, batch_size=batch_size, workers=workers),
                             classes, 0, 1, torch.device("cpu"))
        assert loader.train_images == 16
        for epoch in (0, 1):
            runs[workers, epoch] = list(loader.train_batches(epoch))
            check_one_count_per_file(loader, runs[workers, epoch], batch_size)
    for epoch in (0, 1):  # the replacements do not depend on the number of threads
        for (xa, ya), (xb, yb) in zip(runs[1, epoch], runs[3, epoch], strict=True):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_the_dali_loader_counts_each_unreadable_file_once_per_epoch(skip_tree):
    from data.dali import DaliLoader
    loader = DaliLoader(Config(data_dir=str(skip_tree), image_size=16, batch_size=4, workers=1),
                        check_tree(str(skip_tree)), 0, 1, torch.device("cpu"))
    for epoch in (0, 1):
        batches = list(loader.train_batches(epoch))  # sets the sampler's epoch for expected_labels too
        check_one_count_per_file(loader, batches, 4)
