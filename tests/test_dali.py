"""The DALI pipeline (CPU operators here; the same pipeline runs device='mixed' on a GPU) against
the torchvision pipeline on the same real JPEG files."""
import io
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import read_metrics, run_train
from data.dali import DaliLoader, crop_sides
from data.embedded import ensure_embedded
from data.loaders import eval_geometry
from data.transfer import to_device
from data.tree import check_tree
from data.torch_loader import TorchLoader
from train.config import Config

STD_255 = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255
# the two loaders' evaluation batches differ by the resamplers' own rounding only: at most one level
# of 255 in a pixel (DALI resamples in float, torch's uint8 antialiasing in fixed point; docs/settings.md)
RESAMPLING_LEVELS = 1 + 1e-3


@pytest.fixture(scope="module")
def smooth_tree(tmp_path_factory):
    """Gradients of varied sizes, so resampling differences stay small and alignment errors show."""
    root = tmp_path_factory.mktemp("smooth")
    rng = np.random.default_rng(0)
    for split, count in (("train", 6), ("val", 5)):
        for blue, cls in ((200, "a"), (40, "b"), (120, "c")):
            (root / split / cls).mkdir(parents=True)
            for i in range(count):
                h, w = rng.integers(40, 100, 2)
                y, x = np.mgrid[0:h, 0:w]
                pixels = np.stack([x / w * 255, y / h * 255, np.full((h, w), blue)], axis=-1).astype(np.uint8)
                Image.fromarray(pixels).save(root / split / cls / f"{cls}{i}.jpg", quality=95)
    return root


def loaders(root, image_size=32, **overrides):
    cfg = Config(data_dir=str(root), image_size=image_size, batch_size=4, workers=1, **overrides)
    classes = check_tree(str(root))
    cpu = torch.device("cpu")
    return DaliLoader(cfg, classes, 0, 1, cpu), TorchLoader(Config(**{**cfg.__dict__, "workers": 0}), classes, 0, 1, cpu)


def test_eval_crops_and_labels_agree_with_torchvision(smooth_tree):
    dali, torch_loader = loaders(smooth_tree)
    pairs = list(zip(dali.val_batches(), torch_loader.val_batches(), strict=True))
    assert sum(len(b[1]) for b, _ in pairs) == 15
    for (a, labels_a), (b, labels_b) in pairs:
        assert torch.equal(labels_a, labels_b)
        assert a.shape == b.shape and a.is_contiguous(memory_format=torch.channels_last)
        levels = (a - b).abs() * STD_255  # back to 0-255 pixel levels
        assert levels.max() <= RESAMPLING_LEVELS and levels.mean() < 0.5


def test_training_batches_follow_the_shared_sampler(smooth_tree):
    dali, torch_loader = loaders(smooth_tree)
    epoch = list(dali.train_batches(epoch=1))
    assert len(epoch) == dali.steps_per_epoch == 18 // 4
    torch_loader.sampler.epoch = 1  # the torch loader's order for the same epoch: the same sampler
    files = [i for batch in torch_loader.sampler for i, _ in batch]
    expected = [dali.train_source.samples[i][1] for i in files]
    assert torch.cat([labels for _, labels in epoch]).tolist() == expected
    images = epoch[0][0]
    assert images.shape == (4, 3, 32, 32) and images.dtype == torch.float32 and -3 < images.mean() < 3


def test_dali_skips_files_it_cannot_decode(smooth_tree, tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(smooth_tree, tree)
    (tree / "train" / "a" / "empty.jpg").write_bytes(b"")
    (tree / "train" / "a" / "text.jpg").write_text("not an image")
    whole = (tree / "train" / "b" / "b0.jpg").read_bytes()
    (tree / "train" / "b" / "truncated.jpg").write_bytes(whole[: len(whole) // 2])
    (tree / "val" / "b" / "empty.jpg").write_bytes(b"")
    (tree / "val" / "c" / "truncated.jpg").write_bytes(whole[: len(whole) // 3])
    dali, _ = loaders(tree)
    labels = [len(y) for _, y in dali.train_batches(epoch=0)]
    assert labels == [4] * dali.steps_per_epoch
    val = sum(len(y) for _, y in dali.val_batches())
    assert val == 15
    skipped, names = dali.take_skipped()
    assert skipped >= 2 and {Path(n).name for n in names} <= {"empty.jpg", "text.jpg", "truncated.jpg"}


@pytest.mark.slow
def test_training_with_the_dali_loader(tmp_path):
    result = run_train("--out-dir", "run", "--loader", "dali", "--arch", "resnet18", "--max-steps", 3,
                       "--workers", 2, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    evals = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "eval"]
    assert evals[-1]["eval_images"] == 300 and Path(tmp_path / "run" / "checkpoint.pt").exists()


def test_crop_area_and_aspect_settings_reach_both_pipelines(tmp_path):
    # square images, crop area and aspect pinned to 1: every training crop is the whole image, maybe mirrored
    for split in ("train", "val"):
        for cls, blue in (("a", 30), ("b", 220)):
            (tmp_path / split / cls).mkdir(parents=True)
            for i in range(4):
                y, x = np.mgrid[0:64, 0:64]
                pixels = np.stack([x * 4, y * 4 * (i + 1) % 256, np.full((64, 64), blue)], -1).astype(np.uint8)
                Image.fromarray(pixels).save(tmp_path / split / cls / f"{i}.png")
    dali, torch_loader = loaders(tmp_path, crop_min_scale=1.0, crop_max_scale=1.0, crop_min_aspect=1.0, crop_max_aspect=1.0)
    whole = {}
    for loader in (dali, torch_loader):
        loader.sampler.epoch = 0
        order = [i for batch in loader.sampler for i, _ in batch]
        crops = torch.cat([images for images, _ in loader.train_batches(epoch=0)])
        for crop, index in zip(crops, order, strict=True):
            path = loader.train_source.name(index)
            reference = torch.tensor(np.asarray(Image.open(path).convert("RGB").resize((32, 32), Image.BILINEAR)),
                                     dtype=torch.float32).permute(2, 0, 1)
            pixels = crop * STD_255[0] + torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1) * 255
            error = min((pixels - reference).abs().mean(), (pixels - reference.flip(-1)).abs().mean())
            assert error < 6, (loader, path, float(error))
        whole[type(loader).__name__] = len(order)
    assert whole == {"DaliLoader": 8, "TorchLoader": 8}


def test_without_augmentation_both_loaders_give_the_evaluation_transform_of_the_training_files(smooth_tree):
    """A recipe that switches augmentation off (schedule.augment) gets resize + centre crop, no flip."""
    from data.decode import Encoded
    from data.torch_loader import EvalCrop
    mean_255 = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1) * 255
    for loader in loaders(smooth_tree):
        loader.sampler.epoch, loader.sampler.start_step = 1, 0
        order = [i for batch in loader.sampler for i, _ in batch]
        batches = list(loader.train_batches(epoch=1, augment=False))
        images, labels = torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])
        assert labels.tolist() == [loader.train_source.samples[i][1] for i in order]
        for image, index in zip(images, order, strict=True):
            payload, _ = loader.train_source.read(index)
            expected = (EvalCrop(32)(Encoded(payload, "x")).float() - mean_255) / STD_255[0]
            levels = (image - expected).abs() * STD_255[0]
            if isinstance(loader, TorchLoader):  # the same transform: equal up to float rounding
                assert levels.max() < 1e-3, float(levels.max())
            else:  # DALI's own resampler: as close as its evaluation crops are to the torch loader's
                assert levels.max() <= RESAMPLING_LEVELS and levels.mean() < 0.5, float(levels.max())


def eval_levels(dali, torch_loader) -> torch.Tensor:
    """Per image, the largest difference between the two loaders' evaluation batches, in levels of 255."""
    worst = []
    for (a, labels_a), (b, labels_b) in zip(dali.val_batches(), torch_loader.val_batches(), strict=True):
        assert torch.equal(labels_a, labels_b)
        worst += ((a - b).abs() * STD_255).amax(dim=(1, 2, 3)).tolist()
    return torch.tensor(worst)


@pytest.mark.parametrize("size", [32, 224])
def test_both_loaders_evaluate_real_jpegs_alike(size, tmp_path):
    """The embedded dataset's JPEGs (sharp textures, 40-96 px: shrunk for the smoke preset's 32, enlarged
    for 224), where a crop half a pixel off shows at once: every image within the resamplers' rounding."""
    root = ensure_embedded(train_per_class=1, val_per_class=3, root=tmp_path)
    worst = eval_levels(*loaders(root, image_size=size))
    assert len(worst) == 30 and worst.max() <= RESAMPLING_LEVELS, worst.tolist()


def test_the_torch_loaders_boxes_are_torchvisions_and_dali_computes_the_same(tmp_path):
    """Geometry, exact: eval_geometry is torchvision's Resize + CenterCrop, the torch loader crops with
    it, and DALI's graph computes the same boxes from each JPEG's header (sizes with odd and even
    margins, both orientations)."""
    from nvidia.dali import fn, pipeline_def, types
    from torchvision.transforms import v2 as T
    from data.decode import Encoded
    from data.torch_loader import EvalCrop
    shapes = [(h, w) for h in (37, 38, 40, 43, 70, 97) for w in (37, 39, 44, 61, 96)]
    payloads = []
    for h, w in shapes:
        out = io.BytesIO()
        Image.fromarray(np.random.default_rng(h * w).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(out, "JPEG")
        payloads.append(np.frombuffer(out.getvalue(), dtype=np.uint8))
    tree = tiny_tree(tmp_path)
    for size in (32, 33, 224):
        dali = loaders(tree, image_size=size)[0]
        sides = [np.array(crop_sides(size), dtype=np.int64)] * len(payloads)  # per sample, as the pipeline gets them

        @pipeline_def(batch_size=len(payloads), num_threads=1, device_id=None)
        def boxes():
            jpegs, crop_and_short = fn.external_source(source=lambda: (payloads, sides), num_outputs=2, batch=True,
                                                       dtype=[types.UINT8, types.INT64])
            return dali._eval_geometry(jpegs, crop_and_short[0], crop_and_short[1])
        pipe = boxes()
        pipe.build()
        computed = [tuple(int(np.asarray(out.at(i))) for out in pipe.run()) for i in range(len(shapes))]
        assert computed == [eval_geometry(h, w, size) for h, w in shapes]
        reference = T.Compose([T.Resize(round(size / 0.875), antialias=True), T.CenterCrop(size)])
        for payload in payloads:
            image = Encoded(payload.tobytes(), "x")
            assert torch.equal(EvalCrop(size)(image), reference(image.region().permute(2, 0, 1)))


def tiny_tree(tmp_path):
    """The smallest tree a loader opens."""
    for split in ("train", "val"):
        for cls in ("a", "b"):
            (tmp_path / "tree" / split / cls).mkdir(parents=True)
            for i in range(2):
                Image.new("RGB", (8, 8)).save(tmp_path / "tree" / split / cls / f"{i}.jpg")
    return tmp_path / "tree"


def test_both_loaders_read_jpegs_as_stored_without_exif_rotation(tmp_path):
    """A JPEG whose EXIF says "rotate 90 degrees" is read as stored by both, as PIL and torchvision
    read it: DALI's decoders would rotate it."""
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to display
    y, x = np.mgrid[0:48, 0:64]
    for split in ("train", "val"):
        for cls, blue in (("a", 40), ("b", 200)):
            (tmp_path / split / cls).mkdir(parents=True)
            for i in range(2):
                pixels = np.stack([x * 4, (y * 5 + i * 30) % 256, np.full_like(x, blue)], -1).astype(np.uint8)
                Image.fromarray(pixels).save(tmp_path / split / cls / f"{i}.jpg", quality=95, exif=exif)
    dali, torch_loader = loaders(tmp_path, crop_min_scale=1.0, crop_max_scale=1.0, crop_min_aspect=4 / 3,
                                 crop_max_aspect=4 / 3)
    assert eval_levels(dali, torch_loader).max() <= RESAMPLING_LEVELS
    for loader in (dali, torch_loader):  # training: the crop is the whole image as stored, maybe mirrored
        crops = torch.cat([images for images, _ in loader.train_batches(epoch=0)])
        across = (crops[:, 1, 0, :] - crops[:, 1, -1, :]).abs().mean()  # green changes down the stored image
        assert across > 1, (loader, float(across))


def test_eval_image_size_sets_both_loaders_evaluation_crops_and_leaves_training_at_image_size(smooth_tree):
    """--eval-image-size 48 over --image-size 32: validation batches at 48 (the evaluation transform at
    48, as both loaders compute it), training batches and augmentation-off batches still at 32."""
    from data.decode import Encoded
    from data.torch_loader import EvalCrop
    mean_255 = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1) * 255
    dali, torch_loader = loaders(smooth_tree, eval_image_size=48)
    for loader in (dali, torch_loader):
        val = list(loader.val_batches())
        assert {tuple(x.shape[1:]) for x, _ in val} == {(3, 48, 48)}
        assert {tuple(x.shape[1:]) for x, _ in loader.train_batches(epoch=0)} == {(3, 32, 32)}
        assert {tuple(x.shape[1:]) for x, _ in loader.train_batches(epoch=0, augment=False)} == {(3, 32, 32)}
        first = val[0][0][0]
        payload, _ = loader.val_source.read(loader.eval_batches[0][0])
        expected = (EvalCrop(48)(Encoded(payload, "x")).float() - mean_255) / STD_255[0]
        assert ((first - expected).abs() * STD_255[0]).max() <= RESAMPLING_LEVELS
    assert eval_levels(dali, torch_loader).max() <= RESAMPLING_LEVELS


# DALI on a GPU, as far as DALI's CPU operators show it ---------------------------------------------
@pytest.mark.parametrize("precision, channels_last", [("fp32", False), ("fp16", True), ("bf16", True), ("bf16", False)])
def test_batches_come_in_the_runs_precision_and_layout(smooth_tree, precision, channels_last):
    """fp16 and bf16 runs get half-precision batches (bf16 as DALI's fp16 cast once: DALI has no bf16),
    fp32 runs fp32; channels_last strides only when the run asks for them, else NCHW contiguous. The
    values are the fp32 batches' rounded to the type (bf16 after fp16: rounded twice)."""
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    tolerance = {"fp32": (0, 0), "fp16": (2 ** -10, 2 ** -14), "bf16": (2 ** -7, 2 ** -10)}[precision]  # rtol, atol
    dali = loaders(smooth_tree, precision=precision, channels_last=channels_last)[0]
    reference = loaders(smooth_tree)[0]  # fp32, channels_last

    def right_kind(images, size=32):
        layout = torch.channels_last if channels_last else torch.contiguous_format
        return (images.dtype == dtype and images.shape[1:] == (3, size, size)
                and images.is_contiguous(memory_format=layout))
    pairs = list(zip(dali.val_batches(), reference.val_batches(), strict=True))
    for (images, labels), (expected, expected_labels) in pairs:
        assert right_kind(images) and torch.equal(labels, expected_labels)
        torch.testing.assert_close(images.float(), expected, rtol=tolerance[0], atol=tolerance[1])
    assert all(right_kind(images) for images, _ in dali.train_batches(epoch=0))


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_dalis_images_reach_torch_without_a_copy_and_bf16_with_one_cast(smooth_tree, precision):
    """The batch the loop gets is DALI's output buffer itself (DLPack), in DALI's fp16 for fp16 runs and
    fp32 for fp32 runs; a bf16 run's batch is the one cast of DALI's fp16 (a new buffer)."""
    from nvidia.dali import types
    dali = loaders(smooth_tree, precision=precision)[0]
    payloads = [np.fromfile(dali.val_source.name(i), dtype=np.uint8) for i in range(4)]
    meta = [np.array([0, i, 0, 0, *crop_sides(32)], dtype=np.int64) for i in range(4)]
    pipe = dali._pipeline(lambda: (payloads, meta), 4, 0, augment=False)
    pipe.build()
    images, _ = pipe.run()
    written, batch = images.as_tensor(), dali._images(images)
    assert written.dtype == (types.FLOAT if precision == "fp32" else types.FLOAT16)
    assert batch.shape == (4, 3, 32, 32) and batch.dtype == {"fp32": torch.float32, "fp16": torch.float16,
                                                            "bf16": torch.bfloat16}[precision]
    assert (batch.data_ptr() == written.data_ptr()) == (precision != "bf16")


def test_evaluation_files_are_read_off_the_main_thread(smooth_tree):
    """The main thread only hands DALI the evaluation files that the reader threads read."""
    dali = loaders(smooth_tree)[0]
    readers, read = [], dali.val_source.read

    def reading(index):
        readers.append(threading.current_thread())
        return read(index)
    dali.val_source.read = reading
    evaluated = sum(len(labels) for _, labels in dali.val_batches())
    assert evaluated == len(readers) == 15
    assert threading.main_thread() not in readers
    assert {thread.name.rpartition("_")[0] for thread in readers} == {"dali-eval-reader"}


def test_labels_reach_the_device_through_to_device(smooth_tree, monkeypatch):
    """Every batch's labels, training and evaluation, pass data/transfer.py's to_device (the one way
    host data reaches the device: pinned, non_blocking)."""
    import data.dali
    passed = []

    def passing(tensor, device):
        passed.append(tensor)
        return to_device(tensor, device)
    monkeypatch.setattr(data.dali, "to_device", passing)
    dali = loaders(smooth_tree)[0]
    labels = [y for _, y in dali.val_batches()] + [y for _, y in dali.train_batches(epoch=0)]
    assert len(labels) == len(passed) == 4 + 18 // 4 and all(a is b for a, b in zip(labels, passed))


@pytest.mark.parametrize("workers, decode, threads", [(4, "auto", 6), (8, "auto", 8), (4, "cpu", 4)])
def test_on_a_gpu_nvjpeg_gets_enough_dali_threads(smooth_tree, workers, decode, threads):
    """With nvJPEG decoding, DALI's CPU threads per GPU are at least GPU_DECODE_THREADS, NVIDIA's MLPerf
    setting (--workers' default is 4), more if --workers asks; decoding on the CPU, --workers. (The
    loader touches no GPU before its first batch.)"""
    cfg = Config(data_dir=str(smooth_tree), image_size=32, batch_size=4, workers=workers, dali_decode=decode)
    dali = DaliLoader(cfg, check_tree(str(smooth_tree)), 0, 1, torch.device("cuda", 0))
    assert dali.decode_device == ("cpu" if decode == "cpu" else "mixed")
    assert dali.pipeline_kwargs["num_threads"] == threads
