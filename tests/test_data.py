import hashlib
from pathlib import Path

import pytest
import torch
from PIL import Image

import data.embedded as embedded
from data.tree import check_tree
from data.torch_loader import TorchLoader
from data.sharding import TrainBatchSampler, eval_batches
from data.synthetic import ImageBank
from helpers import loader_settings


def digest(root: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.JPEG")):
        h.update(str(f.relative_to(root)).encode()); h.update(f.read_bytes())
    return h.hexdigest()


def test_embedded_dataset_is_real_jpegs_in_imagenet_layout_and_deterministic(tmp_path):
    a = embedded.ensure_embedded(seed=3, train_per_class=4, val_per_class=2, root=tmp_path / "a")
    b = embedded.ensure_embedded(seed=3, train_per_class=4, val_per_class=2, root=tmp_path / "b")
    assert digest(a) == digest(b)
    assert check_tree(str(a)) == sorted(embedded.CLASSES)
    files = sorted((a / "train").rglob("*.JPEG"))
    assert len(files) == 4 * len(embedded.CLASSES) and len(list((a / "val").rglob("*.JPEG"))) == 2 * len(embedded.CLASSES)
    sizes = set()
    for f in files:
        with Image.open(f) as im:
            assert im.format == "JPEG" and im.mode == "RGB"
            sizes.add(im.size)
    assert len(sizes) > 10  # varied sizes, as real photos are
    c = embedded.ensure_embedded(seed=4, train_per_class=4, val_per_class=2, root=tmp_path / "a")
    assert digest(c) != digest(a)


def test_embedded_dataset_is_reused_and_regenerated_on_version_change(tmp_path, monkeypatch):
    first = embedded.ensure_embedded(train_per_class=2, val_per_class=1, root=tmp_path)
    stamp = (first / "train").stat().st_mtime_ns
    assert embedded.ensure_embedded(train_per_class=2, val_per_class=1, root=tmp_path) == first
    assert (first / "train").stat().st_mtime_ns == stamp
    monkeypatch.setattr(embedded, "GENERATOR_VERSION", embedded.GENERATOR_VERSION + 1)
    second = embedded.ensure_embedded(train_per_class=2, val_per_class=1, root=tmp_path)
    assert second != first and (second / ".complete").exists()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_train_sharding_covers_each_sample_once_per_epoch(world):
    n, b = 103, 4
    samplers = [TrainBatchSampler(n, b, rank, world, seed=7) for rank in range(world)]
    for epoch in (0, 1):
        seen = []
        for s in samplers:
            s.epoch = epoch
            seen += [i for batch in s for i, _ in batch]
        global_batch = b * world
        assert len(seen) == (n // global_batch) * global_batch  # only the last partial global batch is dropped
        assert len(set(seen)) == len(seen)


def test_global_batches_do_not_depend_on_rank_count():
    one = TrainBatchSampler(64, 8, 0, 1, seed=1)
    two = [TrainBatchSampler(64, 4, r, 2, seed=1) for r in range(2)]
    for step_one, step_r0, step_r1 in zip(one, two[0], two[1], strict=True):
        assert step_one == step_r0 + step_r1  # same files, same augmentation seeds


def test_resumed_sampler_continues_the_same_order():
    full = list(TrainBatchSampler(50, 5, seed=2))
    later = TrainBatchSampler(50, 5, seed=2)
    later.start_step = 4
    assert list(later) == full[4:]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_eval_sharding_counts_every_image_exactly_once(world):
    seen = [i for r in range(world) for batch in eval_batches(101, 8, r, world) for i in batch]
    assert sorted(seen) == list(range(101))


def test_synthetic_samples_depend_only_on_global_index():
    bank = ImageBank(5, 16, torch.device("cpu"), channels_last=False)
    whole_x, whole_y = bank.batch(torch.arange(100, 108), 5, 1000)
    a_x, a_y = bank.batch(torch.arange(100, 104), 5, 1000)
    b_x, b_y = ImageBank(5, 16, torch.device("cpu"), channels_last=False).batch(torch.arange(104, 108), 5, 1000)
    assert torch.equal(whole_x, torch.cat([a_x, b_x])) and torch.equal(whole_y, torch.cat([a_y, b_y]))
    assert whole_x.shape == (8, 3, 16, 16) and whole_y.min() >= 0 and whole_y.max() < 1000
    assert abs(whole_x.mean().item()) < 0.05 and abs(whole_x.std().item() - 1) < 0.05
    assert len({tuple(x.flatten()[:4].tolist()) for x in whole_x}) > 4 and len(set(whole_y.tolist())) > 4  # (varied)
    other_x, other_y = ImageBank(6, 16, torch.device("cpu"), channels_last=False).batch(torch.arange(100, 108), 6, 1000)
    assert not torch.equal(other_x, whole_x) and not torch.equal(other_y, whole_y)
    # channels_last: the same images, in that layout
    last_x, last_y = ImageBank(5, 16, torch.device("cpu"), channels_last=True).batch(torch.arange(100, 108), 5, 1000)
    assert last_x.is_contiguous(memory_format=torch.channels_last) and torch.equal(last_y, whole_y)
    assert last_x.shape == whole_x.shape and abs(last_x.std().item() - 1) < 0.05


def synthetic_loader(world: int, rank: int, **changes):
    from data.loaders import SyntheticLoader
    settings = dict(loader="synthetic", image_size=16, batch_size=8 // world, synthetic_images=64,
                    synthetic_val_images=20, synthetic_classes=10, seed=3) | changes
    return SyntheticLoader(loader_settings(**settings), rank, world, torch.device("cpu"))


def test_synthetic_batches_are_the_same_global_batches_on_any_rank_count():
    """Training: each step's global batch is rank 0's half then rank 1's. Evaluation: every validation
    sample once over the ranks (rank r takes r, r + world, ...), the same as on one rank, and none of
    them a training sample."""
    one, two = synthetic_loader(1, 0), [synthetic_loader(2, rank) for rank in (0, 1)]
    for epoch in (0, 1):
        for whole, *halves in zip(one.train_batches(epoch), *(loader.train_batches(epoch) for loader in two), strict=True):
            for part in (0, 1):  # images, labels
                assert torch.equal(whole[part], torch.cat([half[part] for half in halves]))
    first, later = next(iter(one.train_batches(0))), next(iter(one.train_batches(1)))
    assert not torch.equal(first[0], later[0])  # (an epoch's samples are its own)
    val_one = [torch.cat(parts) for parts in zip(*one.val_batches())]
    val_two = [[torch.cat(parts) for parts in zip(*loader.val_batches())] for loader in two]
    for part in (0, 1):
        interleaved = torch.stack([val_two[0][part], val_two[1][part]], 1).flatten(0, 1)  # 10 each: 0, 1, 2, ...
        assert torch.equal(val_one[part], interleaved)
    assert not torch.equal(val_one[0][:8], first[0])


def test_a_synthetic_batch_costs_a_gather_not_a_pass_per_pixel():
    """The elements that a batch's operations write, counted at the dispatcher (views write none): the
    gather of the batch's images, and a few per sample; not dozens of passes over every pixel."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Written(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.elements = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not func.is_view:
                self.elements += sum(t.numel() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
            return out

    loader = synthetic_loader(1, 0, image_size=32, channels_last=True)
    for batches in (loader.train_batches(0), loader.val_batches()):
        with Written() as written:
            images, labels = next(iter(batches))
        assert images.shape == (8, 3, 32, 32) and images.is_contiguous(memory_format=torch.channels_last)
        assert images.numel() <= written.elements < 1.2 * images.numel(), (written.elements, images.numel())


def test_torch_loader_batches_labels_and_deterministic_augmentation(tmp_path):
    root = embedded.ensure_embedded(train_per_class=6, val_per_class=3, root=tmp_path)
    settings = loader_settings(data_dir=str(root), image_size=32, batch_size=8, workers=0)
    loader = TorchLoader(settings, check_tree(str(root)), 0, 1, torch.device("cpu"))
    assert check_tree(str(root)) == sorted(embedded.CLASSES)
    folders = [Path(path).parent.name for path, _ in loader.train_source.samples]
    assert [sorted(embedded.CLASSES).index(f) for f in folders] == list(loader.train_source.targets)
    assert loader.steps_per_epoch == 60 // 8
    images, labels = next(iter(loader.train_batches(epoch=0)))
    assert images.shape == (8, 3, 32, 32) and images.dtype == torch.float32
    assert images.is_contiguous(memory_format=torch.channels_last)
    assert -3 < images.mean().item() < 3
    again, _ = next(iter(loader.train_batches(epoch=0)))
    other_epoch, _ = next(iter(loader.train_batches(epoch=1)))
    assert torch.equal(images, again) and not torch.equal(images, other_epoch)
    # val: every image exactly once, with the label of its folder
    val_labels = torch.cat([y for _, y in loader.val_batches()])
    assert val_labels.tolist() == loader.val_source.targets.tolist()


def test_synthetic_evaluation_batches_take_the_eval_image_size():
    from data.loaders import SyntheticLoader
    settings = loader_settings(image_size=32, eval_image_size=40, batch_size=4, synthetic_images=8,
                               synthetic_val_images=8, synthetic_classes=3)
    loader = SyntheticLoader(settings, 0, 1, torch.device("cpu"))
    assert {tuple(x.shape) for x, _ in loader.val_batches()} == {(4, 3, 40, 40)}
    assert {tuple(x.shape) for x, _ in loader.train_batches(0)} == {(4, 3, 32, 32)}


def test_loader_settings_have_no_defaults_of_their_own_and_take_the_runs_names():
    """A default here could differ silently from the run's (train/config.py): every field is required,
    each one the run's settings fill is a Config setting of the same type, and `of` takes them all
    from the run's settings, naming one they lack."""
    from dataclasses import MISSING, fields
    from types import SimpleNamespace

    from data.loaders import RUN_SETTINGS, LoaderSettings
    from train.config import Config
    defaulted = [f.name for f in fields(LoaderSettings) if f.default is not MISSING or f.default_factory is not MISSING]
    assert defaulted == []
    assert set(RUN_SETTINGS) == {f.name for f in fields(LoaderSettings)} - {"evaluate_only", "relist"}
    config_types, own_types = {f.name: f.type for f in fields(Config)}, {f.name: f.type for f in fields(LoaderSettings)}
    assert [name for name in RUN_SETTINGS if config_types.get(name) is not own_types[name]] == []
    run = Config(data_dir="/data", batch_size=7, workers=3, image_size=40, crop_min_scale=0.25, synthetic_classes=5)
    settings = LoaderSettings.of(run, precision="bf16", relist=True)
    assert (settings.data_dir, settings.batch_size, settings.workers, settings.image_size, settings.crop_min_scale,
            settings.synthetic_classes, settings.precision, settings.relist, settings.evaluate_only) == \
        ("/data", 7, 3, 40, 0.25, 5, "bf16", True, False)
    lacking = SimpleNamespace(**{name: getattr(run, name) for name in RUN_SETTINGS if name != "crop_max_aspect"})
    with pytest.raises(AttributeError, match="crop_max_aspect"):
        LoaderSettings.of(lacking)
