"""GPU paths (fp16 with loss scaling, bf16 autocast and channels_last on cuDNN, DALI 'mixed'
decoding, the torch loader's pinned batches): marked `gpu` and skipped without CUDA;
scripts/gpu_check.sh runs them where a GPU is lent. Their CPU twins are test_bf16_on_cpu_trains,
the fp32 end-to-end tests and test_dali.py's comparison of the two loaders.
The last tests run on a CPU: how scripts/gpu_check.sh reports these tests and refuses a machine without CUDA."""
import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import REPO, read_metrics, run_train

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DALI_ABSENT = "DALI absent"  # scripts/gpu_check.sh reports this skip as such, and fails on any other


def require_dali():
    """Skip with DALI_ABSENT where DALI is not installed; an installed DALI that fails to load fails."""
    try:
        import nvidia.dali  # noqa: F401
    except ModuleNotFoundError as err:
        if err.name not in ("nvidia", "nvidia.dali"):
            raise
        pytest.skip(DALI_ABSENT)


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
@pytest.mark.parametrize("optimizer", ["lars", "sgd", "rmsprop-warmup"])
def test_fp16_loss_scaler_skips_overflowing_steps_on_the_device(optimizer):
    """The GPU twin of tests/test_host_reads.py's: the step unscales and skips by itself, and neither
    the step nor the scaler's update waits for the GPU (torch's sync debug mode raises if one does)."""
    from types import SimpleNamespace
    from train.optim import OPTIMIZERS
    from train.precision import Precision
    device = torch.device("cuda")
    precision = Precision("fp16", device)
    model = torch.nn.Linear(4, 4).to(device)
    settings = SimpleNamespace(momentum=0.9, weight_decay=1e-4, nesterov=False, lars_eta=0.001, lars_epsilon=0.0,
                               lars_compile=False, rmsprop_alpha=0.99, rmsprop_epsilon=1e-8, rmsprop_lr_ratio=0.01)
    opt = OPTIMIZERS[optimizer](settings, model, 0.1)
    before = [p.detach().clone() for p in model.parameters()]
    torch.cuda.set_sync_debug_mode("error")
    try:
        precision.backward(model(torch.ones(2, 4, device=device)).sum() * float("inf"))
        precision.step(opt)  # overflow: skipped, on the device
        opt.zero_grad()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert precision.scaler.get_scale() < 65536.0
    precision.backward(model(torch.ones(2, 4, device=device)).sum())
    precision.step(opt)
    assert not any(torch.equal(a, p) for a, p in zip(before, model.parameters()))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("precision, decode", [("auto", "auto"), ("fp16", "auto"), ("auto", "cpu")])
def test_dali_mixed_decoding_and_the_pinned_torch_loader_agree_on_gpu(tmp_path, precision, decode):
    """The GPU twin of test_dali.py's CPU comparison: nvJPEG ('mixed') against the torch loader's
    pinned uint8 batches, both normalised on the GPU."""
    require_dali()
    from data.dali import DaliLoader
    from data.embedded import ensure_embedded
    from data.tree import check_tree
    from data.torch_loader import TorchLoader
    from train.config import Config
    root = ensure_embedded(train_per_class=4, val_per_class=3, root=tmp_path)
    cfg = Config(data_dir=str(root), image_size=64, batch_size=8, workers=2, precision=precision, dali_decode=decode)
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


def gpu_check(*args, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), *map(str, args)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHON": sys.executable, **env})


FAKE_GPU_TESTS = f"""
import pytest
def test_ran(): pass
@pytest.mark.parametrize("precision", ["auto", "fp16"])
def test_dali(precision): pytest.skip({DALI_ABSENT!r})
"""


@pytest.mark.parametrize("extra, verdict", [
    ("", 0),
    ("def test_no_gpu(): pytest.skip('needs a CUDA GPU')", 1),
    ("def test_broken(): assert 1 == 2", 1),
])
def test_gpu_check_reports_dali_absent_and_fails_on_other_skips(tmp_path, extra, verdict):
    """A real pytest JUnit report, read the way gpu_check.sh reads the gpu tests' one."""
    (tmp_path / "test_fake.py").write_text(FAKE_GPU_TESTS + extra + "\n")
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml", "junit.xml"],
                   cwd=tmp_path, capture_output=True, timeout=120)
    result = gpu_check("--report", tmp_path / "junit.xml")
    lines = result.stdout.splitlines()
    assert result.returncode == verdict, result.stdout + result.stderr
    assert "gpu test test_fake::test_ran: passed" in result.stdout
    assert sum(line.startswith("gpu test test_fake::test_dali[") and f": {DALI_ABSENT} (" in line
               for line in lines) == 2
    if "skip" in extra:
        assert "gpu test test_fake::test_no_gpu: SKIPPED: needs a CUDA GPU" in result.stdout
    if "assert" in extra:
        assert "gpu test test_fake::test_broken: FAILED" in result.stdout
    assert lines[-1].startswith("gpu tests: ") and lines[-1].endswith("-> FAIL") == bool(verdict)


def test_gpu_check_fails_without_a_report_or_a_test_that_ran(tmp_path):
    assert gpu_check("--report", tmp_path / "missing.xml").returncode == 1
    (tmp_path / "test_fake.py").write_text(FAKE_GPU_TESTS)
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml", "junit.xml",
                    "-k", "dali"], cwd=tmp_path, capture_output=True, timeout=120)
    result = gpu_check("--report", tmp_path / "junit.xml")
    assert result.returncode == 1 and "no gpu test passed" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_gpu_check_refuses_a_machine_without_cuda(tmp_path):
    result = gpu_check(OUT=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: no CUDA GPU visible"
    assert (tmp_path / "gpu_figures.txt").read_text().splitlines()[-1] == "error: no CUDA GPU visible"


DEVICE_PYTHON = REPO / ".venv-device" / "bin" / "python"  # the lent machine's stack (scripts/setup.sh)


@pytest.mark.slow(seconds=40)
@pytest.mark.skipif(not DEVICE_PYTHON.exists(), reason="no .venv-device: scripts/setup.sh makes it where Python 3.12 is")
def test_gpu_check_dry_runs_on_the_lent_machines_stack(tmp_path):
    """gpu_check.sh --dry-run on Python 3.12 with torch 2.11 and nothing else of ours: the wheels it
    carries (.whl/) install without network, the gpu tests load (only their files: the others need
    packages that machine lacks), and the figures' runs train on the CPU."""
    probe = subprocess.run([str(DEVICE_PYTHON), "-c", "import torch, sys; print(torch.__version__, sys.version_info[:2])"],
                           capture_output=True, text=True, timeout=120)
    assert probe.stdout.startswith("2.11.0") and "(3, 12)" in probe.stdout, probe.stdout + probe.stderr
    result = gpu_check("--dry-run", PYTHON=str(DEVICE_PYTHON), OUT=str(tmp_path))
    said = (tmp_path / "gpu_figures.txt").read_text()
    assert result.returncode == 0, said + result.stderr[-3000:]
    assert "torch 2.11.0" in said and "python 3.12" in said and "mlperf-logging 4.1.68" in said, said
    here = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider",
                           REPO / "tests" / "test_gpu.py", REPO / "tests" / "test_ghost_bn.py"], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    expected = here.stdout.count("::")  # the gpu tests as this machine's own stack collects them
    assert expected > 0 and f"gpu tests: {expected} collected" in said, said
    runs = json.loads((tmp_path / "figures" / "gpu_figures.json").read_text())["runs"]
    assert [r["run"] for r in runs] == ["synthetic bf16", "synthetic fp32"] and all(r["img_per_s"] > 0 for r in runs)
    assert said.splitlines()[-1].startswith("gpu_check: dry run ok")
