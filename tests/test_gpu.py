"""GPU paths (fp16 with loss scaling, bf16 autocast and channels_last on cuDNN, DALI 'mixed'
decoding, the torch loader's pinned batches): marked `gpu` and skipped without CUDA;
scripts/gpu_check.sh runs them where a GPU is lent. Their CPU twins are test_bf16_on_cpu_trains,
the fp32 end-to-end tests and test_dali.py's comparison of the two loaders."""
import pytest
import torch

from conftest import read_metrics, run_train

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_channels_last_on_gpu(tmp_path, precision):
    result = run_train("--out-dir", "run", "--precision", precision, "--max-steps", 20, "--log-every", 5, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    train = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "train"]
    assert len(train) == 4 and train[-1]["loss"] < train[0]["loss"]
    assert f'"value": "{precision}"' in (tmp_path / "run" / "mllog.txt").read_text()


@pytest.mark.gpu
@needs_cuda
def test_fp16_loss_scaler_skips_overflowing_steps():
    from train.precision import Precision
    device = torch.device("cuda")
    precision = Precision("fp16", device)
    w = torch.nn.Parameter(torch.ones(4, device=device))
    opt = torch.optim.SGD([w], lr=1.0)
    precision.backward_and_step((w * float("inf")).sum(), opt)  # overflow: the step must be skipped
    assert torch.equal(w.detach(), torch.ones(4, device=device))
    assert precision.scaler.get_scale() < 65536.0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("precision", ["auto", "fp16"])
def test_dali_mixed_decoding_and_the_pinned_torch_loader_agree_on_gpu(tmp_path, precision):
    """The GPU twin of test_dali.py's CPU comparison: nvJPEG ('mixed') against the torch loader's
    pinned uint8 batches, both normalised on the GPU."""
    pytest.importorskip("nvidia.dali")
    from data.dali import DaliLoader
    from data.embedded import ensure_embedded
    from data.loaders import check_tree
    from data.torch_loader import TorchLoader
    from train.config import Config
    root = ensure_embedded(train_per_class=4, val_per_class=3, root=tmp_path)
    cfg = Config(data_dir=str(root), image_size=64, batch_size=8, workers=2, precision=precision)
    device = torch.device("cuda", 0)
    dali, torch_loader = (kind(cfg, check_tree(str(root)), 0, 1, device) for kind in (DaliLoader, TorchLoader))
    std_255 = torch.tensor([0.229, 0.224, 0.225], device=device).view(1, 3, 1, 1) * 255
    pairs = list(zip(dali.val_batches(), torch_loader.val_batches()))
    assert sum(len(labels) for (_, labels), _ in pairs) == 30
    for (a, labels_a), (b, labels_b) in pairs:
        assert a.is_cuda and b.is_cuda and a.is_contiguous(memory_format=torch.channels_last)
        assert a.dtype == (torch.float16 if precision == "fp16" else torch.float32)  # DALI has no bf16
        assert torch.equal(labels_a, labels_b)
        levels = (a.float() - b).abs() * std_255
        assert levels.mean() < 6 and levels.max() < 40  # nvJPEG's IDCT and upsampling differ slightly from libjpeg's
    images, labels = next(iter(dali.train_batches(epoch=0)))
    assert images.shape == (8, 3, 64, 64) and images.is_cuda and labels.is_cuda
