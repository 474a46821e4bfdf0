"""The torch loader's parts on real files: region decoding against PIL, the random-resized-crop rule,
and batches that do not depend on the number of worker threads."""
import io
import math
import random
import threading

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import RandomResizedCrop
from torchvision.transforms import v2 as T

import data.decode as decode
from data.decode import BadImage, Encoded
from data.embedded import ensure_embedded
from data.tree import check_tree
from data.torch_loader import EvalCrop, TorchLoader, TrainCrop, crop_box
from train.config import Config


def photo(h=203, w=301, seed=0) -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    pixels = np.stack([x, y, x + y], -1) % 256 + rng.normal(0, 12, (h, w, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def encode(image: Image.Image, fmt="JPEG", **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


VARIANTS = {"4:2:0": lambda im: encode(im), "4:4:4": lambda im: encode(im, subsampling=0),
            "progressive": lambda im: encode(im, progressive=True), "grayscale": lambda im: encode(im.convert("L")),
            "cmyk": lambda im: encode(im.convert("CMYK")), "png": lambda im: encode(im, "PNG")}


@pytest.mark.parametrize("variant", VARIANTS)
def test_regions_are_the_pixels_pil_decodes(variant):
    payload = VARIANTS[variant](photo())
    reference = torch.from_numpy(np.array(Image.open(io.BytesIO(payload)).convert("RGB")))
    image = Encoded(payload, variant)
    assert (image.height, image.width) == (203, 301)
    if variant != "png":  # JPEGs take the region decoder where it is installed (it comes with DALI)
        assert (image.stream is not None) == bool(decode._nvimgcodec())
    for top, left, h, w in [(0, 0, 203, 301), (17, 33, 100, 151), (1, 2, 50, 60), (101, 150, 102, 151), (0, 9, 203, 7)]:
        assert torch.equal(image.region(top, left, h, w), reference[top:top + h, left:left + w]), (top, left, h, w)


def test_unreadable_bytes_raise_bad_image():
    whole = encode(photo())
    for payload in (b"", b"not an image at all", whole[: len(whole) // 2], encode(photo(), "PNG")[:300]):
        with pytest.raises(BadImage):
            Encoded(payload, "bad").region()


def test_crop_box_follows_torchvisions_rule():
    rng = random.Random(0)
    boxes = [crop_box(300, 400, (0.08, 1.0), (3 / 4, 4 / 3), rng) for _ in range(2000)]
    for top, left, h, w in boxes:
        assert 0 <= top and top + h <= 300 and 0 <= left and left + w <= 400
    areas = [h * w / 120_000 for _, _, h, w in boxes]
    aspects = [w / h for _, _, h, w in boxes]
    assert min(areas) > 0.07 and max(areas) <= 1.0 and 0.35 < np.mean(areas) < 0.55
    assert min(aspects) > 0.7 and max(aspects) < 1.45
    # impossible draws fall back to the centre, clamped to the ratio range (torchvision's fallback)
    assert crop_box(100, 400, (1.0, 1.0), (1.0, 1.0), rng) == (0, 150, 100, 100)
    assert crop_box(100, 100, (1.0, 1.0), (1.0, 1.0), rng) == (0, 0, 100, 100)
    # torchvision's RandomResizedCrop over as many draws: the same mean area and log-aspect
    torch.manual_seed(0)
    theirs = [RandomResizedCrop.get_params(torch.empty(0, 300, 400), (0.08, 1.0), (3 / 4, 4 / 3)) for _ in range(2000)]
    assert abs(np.mean([h * w / 120_000 for _, _, h, w in theirs]) - np.mean(areas)) < 0.03
    assert abs(np.mean([math.log(w / h) for _, _, h, w in theirs]) - np.mean(np.log(aspects))) < 0.03


def test_train_crop_resizes_the_region_and_mirrors_half_the_time():
    payload = encode(photo(), quality=95)
    reference = torch.from_numpy(np.array(Image.open(io.BytesIO(payload)).convert("RGB"))).permute(2, 0, 1)
    crop = TrainCrop(48, (0.08, 1.0), (3 / 4, 4 / 3))
    flips = 0
    for seed in range(40):
        out = crop(Encoded(payload, "x"), seed)
        assert out.shape == (3, 48, 48) and out.dtype == torch.uint8
        assert torch.equal(out, crop(Encoded(payload, "x"), seed))  # the seed decides everything
        top, left, h, w = crop_box(203, 301, crop.scale, crop.ratio, random.Random(seed))
        expected = T.functional.resize(reference[:, top:top + h, left:left + w], [48, 48], antialias=True)
        error = (out.float() - expected.float()).abs().mean()
        mirrored = (out.float() - expected.flip(-1).float()).abs().mean()
        assert min(error, mirrored) < 1.0
        flips += bool(mirrored < error)
    assert 8 < flips < 32


def test_eval_crop_is_resize_then_centre_crop():
    payload = encode(photo(), quality=95)
    reference = torch.from_numpy(np.array(Image.open(io.BytesIO(payload)).convert("RGB"))).permute(2, 0, 1)
    expected = T.functional.center_crop(T.functional.resize(reference, [round(32 / 0.875)], antialias=True), [32])
    assert torch.equal(EvalCrop(32)(Encoded(payload, "x")), expected)


def test_batches_do_not_depend_on_the_number_of_threads_and_leave_torch_threads_alone(tmp_path):
    root = ensure_embedded(train_per_class=4, val_per_class=2, root=tmp_path)
    classes = check_tree(str(root))
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads_before)  # set explicitly, as a trainer may: process-wide from now on
    runs = []
    for workers in (1, 3):
        loader = TorchLoader(Config(data_dir=str(root), image_size=24, batch_size=8, workers=workers), classes, 0, 1,
                             torch.device("cpu"))
        runs.append((list(loader.train_batches(epoch=2, start_step=1)), list(loader.val_batches())))
    (train_a, val_a), (train_b, val_b) = runs
    assert len(train_a) == 40 // 8 - 1 and sum(len(y) for _, y in val_a) == 20
    for (xa, ya), (xb, yb) in zip(train_a + val_a, train_b + val_b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert torch.get_num_threads() == threads_before  # the threads' one-thread setting stays theirs


def test_stopping_early_drops_the_work_queued_for_later_batches(tmp_path):
    root = ensure_embedded(train_per_class=4, val_per_class=2, root=tmp_path)
    loader = TorchLoader(Config(data_dir=str(root), image_size=24, batch_size=4, workers=1), check_tree(str(root)), 0, 1,
                         torch.device("cpu"))
    calls, gate, fill = [], threading.Event(), loader._train_slot

    def gated_fill(*args):  # the one thread finishes batch 1, then waits inside batch 2's first slot
        calls.append(args[1])
        if len(calls) > 4:
            gate.wait(10)
        return fill(*args)
    loader._train_slot = gated_fill
    batches = loader.train_batches(epoch=0)
    images, _ = next(batches)  # batch 3 is queued by now: two batches are always in flight
    batches.close()  # what the loop does at --max-steps
    gate.set()
    loader.pool.submit(lambda: None).result(timeout=10)  # all queued before it has run or been dropped
    assert images.shape == (4, 3, 24, 24) and len(calls) == 5


def test_without_nvimgcodec_pil_decodes_the_same_regions(monkeypatch):
    monkeypatch.setattr(decode._local, "codec", False, raising=False)  # as on a machine without it
    payload = encode(photo())
    reference = torch.from_numpy(np.array(Image.open(io.BytesIO(payload)).convert("RGB")))
    image = Encoded(payload, "jpeg")
    assert image.stream is None and (image.height, image.width) == (203, 301)
    assert torch.equal(image.region(17, 33, 100, 151), reference[17:117, 33:184])
    out = TrainCrop(32, (0.08, 1.0), (3 / 4, 4 / 3))(image, seed=5)
    assert out.shape == (3, 32, 32) and out.dtype == torch.uint8


def test_a_closed_loader_lets_its_reader_threads_go(tmp_path):
    # Horovod Elastic replaces the loader when the workers change: the old one's threads must not stay
    root = ensure_embedded(train_per_class=4, val_per_class=2, root=tmp_path)
    before = set(threading.enumerate())  # (earlier tests' loaders keep theirs)
    loader = TorchLoader(Config(data_dir=str(root), image_size=24, batch_size=4, workers=2), check_tree(str(root)), 0, 1,
                         torch.device("cpu"))
    next(iter(loader.train_batches(epoch=0)))
    readers = [t for t in set(threading.enumerate()) - before if t.name.startswith("loader")]
    assert readers
    loader.close()
    assert not any(t.is_alive() for t in readers)
