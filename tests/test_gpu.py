"""GPU paths (fp16 with loss scaling, bf16 autocast and channels_last on cuDNN): marked `gpu` and
skipped without CUDA; scripts/gpu_check.sh runs them where a GPU is lent. Their CPU twins are
test_bf16_on_cpu_trains and the fp32 end-to-end tests."""
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
