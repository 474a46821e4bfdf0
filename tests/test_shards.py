"""Tar shards: written deterministically, read back sample for sample by the torch loader and by DALI."""
import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import REPO, read_metrics, run_train
from data.embedded import ensure_embedded
from data.sources import FolderSource
from data.tree import check_tree
from data.torch_loader import TorchLoader
from data.shards import ShardSamples, write_shards
from train.config import Config


@pytest.fixture(scope="module")
def tree():
    return ensure_embedded(seed=9, train_per_class=7, val_per_class=3)  # 70 train, 30 val


@pytest.fixture(scope="module")
def shards(tree, tmp_path_factory):
    out = tmp_path_factory.mktemp("shards")
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "make_shards.py"), "--src", str(tree), "--out", str(out),
                             "--shard-size", "16"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return out


def test_shards_round_trip_every_sample_and_label(tree, shards):
    classes = check_tree(str(tree))
    assert check_tree(str(shards)) == classes
    for split in ("train", "val"):
        folder, packed = FolderSource(tree / split, classes), ShardSamples(shards / split)
        assert len(packed) == len(folder) and len(packed.tars) == -(-len(folder) // 16)
        for i, (path, label) in enumerate(folder.samples):
            payload, packed_label = packed.read(i)
            assert payload == open(path, "rb").read() and packed_label == label


def test_shard_writing_is_deterministic_and_the_index_is_dalis(tree, shards, tmp_path):
    write_shards(tree, tmp_path / "again", shard_size=16)
    digest = lambda root: [hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*.*"))]  # noqa: E731
    assert digest(shards) == digest(tmp_path / "again")
    wds2idx = Path(sys.executable).parent / "wds2idx"  # DALI's own index tool
    subprocess.run([str(wds2idx), str(shards / "train" / "shard-000000.tar"), str(tmp_path / "dali.idx")],
                   check=True, capture_output=True)
    assert (tmp_path / "dali.idx").read_text() == (shards / "train" / "shard-000000.idx").read_text()


def test_dali_reads_the_shards_with_their_labels(tree, shards):
    from nvidia.dali import fn, pipeline_def
    tars = sorted((shards / "val").glob("*.tar"))

    @pipeline_def(batch_size=30, num_threads=1, device_id=None)
    def read_all():
        jpg, cls = fn.readers.webdataset(paths=[str(t) for t in tars], index_paths=[str(t.with_suffix(".idx")) for t in tars],
                                         ext=["jpg", "cls"])
        return fn.decoders.image(jpg, device="cpu"), cls

    pipe = read_all()
    pipe.build()
    images, labels = pipe.run()
    folder = FolderSource(tree / "val", check_tree(str(tree)))
    assert [int(bytes(labels.at(i))) for i in range(30)] == folder.targets.tolist()
    assert all(images.at(i).shape[2] == 3 for i in range(30))


def test_torch_loader_gives_the_same_batches_from_shards_and_from_the_tree(tree, shards):
    cfg = Config(image_size=32, batch_size=8, workers=0, seed=4)
    from_tree = TorchLoader(Config(**{**cfg.__dict__, "data_dir": str(tree)}), check_tree(str(tree)), 0, 1, torch.device("cpu"))
    from_shards = TorchLoader(Config(**{**cfg.__dict__, "data_dir": str(shards)}), check_tree(str(shards)), 0, 1, torch.device("cpu"))
    for (a, la), (b, lb) in zip(from_tree.val_batches(), from_shards.val_batches(), strict=True):
        assert torch.equal(la, lb) and torch.equal(a, b)
    for (a, la), (b, lb) in zip(from_tree.train_batches(1), from_shards.train_batches(1), strict=True):
        assert torch.equal(la, lb) and torch.equal(a, b)  # same files, same seeds, same crops


def test_training_reads_shards(shards, tmp_path):
    result = run_train("--data-dir", shards, "--out-dir", "run", "--arch", "resnet18", "--image-size", 32,
                       "--batch-size", 8, "--max-steps", 3, "--workers", 1, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    evals = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "eval"]
    assert evals[-1]["eval_images"] == 30


def test_make_shards_refuses_a_missing_tree(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "make_shards.py"), "--src", str(tmp_path / "none"),
                             "--out", str(tmp_path / "out")], capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.startswith("error: ") and not (tmp_path / "out").exists()
