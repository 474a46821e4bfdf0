"""`--loader dali` on a GPU: nvJPEG decoding ('mixed', with the hardware JPEG decoder's share), batches
that are DALI's own buffers seen by torch (no copy; bf16 one cast of DALI's fp16), taken without the
host waiting for the GPU, NCHW or channels_last as the run asks, and a crop-size change without a new
pipeline. Marked `gpu`, skipped without CUDA, and with the reason "DALI absent" where DALI is not
installed (scripts/gpu_check.sh reports that skip as such). Their CPU twins are in tests/test_dali.py
and tests/test_dali_feed.py; the rate DALI sustains is the GPU check's figure, not a pass criterion."""
import pytest
import torch

from helpers.gpu import needs_cuda, require_dali

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def gpu_loader(tmp_path, **settings):
    """The DALI loader on GPU 0 over the embedded dataset's JPEGs (40 training, 30 validation), batch 8;
    skipped as `DALI absent` where DALI is not installed (an installed DALI that fails to load fails)."""
    require_dali()
    from data.dali import DaliLoader
    from data.embedded import ensure_embedded
    from data.tree import check_tree
    from train.config import Config
    root = ensure_embedded(train_per_class=4, val_per_class=3, root=tmp_path)
    cfg = Config(data_dir=str(root), batch_size=8, workers=2, **{"image_size": 64, **settings})
    return DaliLoader(cfg, check_tree(str(root)), 0, 1, torch.device("cuda", 0))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
def test_dali_batches_are_its_own_buffers_taken_without_a_wait(tmp_path, precision):
    """After the first batch (the pipeline's build), a batch costs torch's allocator only its labels
    (fp16, fp32: the images are DALI's buffer) or its labels and one batch-sized buffer (bf16: the
    cast), and taking it never makes the host wait for the GPU (torch's sync check raises if it does)."""
    dali = gpu_loader(tmp_path, precision=precision)
    assert dali.decode_device == "mixed"
    epoch = dali.train_batches(epoch=0)
    first = next(epoch)
    allocated = torch.cuda.memory_stats()["allocated_bytes.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        images, labels = next(epoch)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    allocated = torch.cuda.memory_stats()["allocated_bytes.all.allocated"] - allocated
    batch_bytes = images.numel() * images.element_size()
    assert images.is_cuda and labels.is_cuda and images.dtype == DTYPES[precision]
    assert images.shape == first[0].shape == (8, 3, 64, 64) and images.is_contiguous(memory_format=torch.channels_last)
    assert (batch_bytes <= allocated < 2 * batch_bytes) if precision == "bf16" else allocated < batch_bytes
    assert bool(torch.isfinite(images.float()).all()) and images.float().abs().max() < 5  # normalised pixels
    assert 0 <= int(labels.min()) and int(labels.max()) < 10
    dali.close()


@pytest.mark.gpu
@needs_cuda
def test_dali_on_the_gpu_follows_the_layout_and_a_crop_size_change(tmp_path):
    """channels_last off: NCHW contiguous batches; progressive resizing's new size with the same
    pipeline (one build for the training transform); evaluation at its own size."""
    dali = gpu_loader(tmp_path, precision="fp16", channels_last=False)
    sizes = {tuple(images.shape[1:]) for images, _ in dali.train_batches(epoch=0)}
    dali.set_image_size(96)
    later = list(dali.train_batches(epoch=1))
    assert sizes == {(3, 64, 64)} and {tuple(images.shape[1:]) for images, _ in later} == {(3, 96, 96)}
    assert all(images.is_contiguous() and images.is_cuda for images, _ in later) and dali.builds == 1
    evaluated = list(dali.val_batches())
    assert sum(len(labels) for _, labels in evaluated) == 30
    assert {tuple(images.shape[1:]) for images, _ in evaluated} == {(3, 64, 64)}
    dali.close()
