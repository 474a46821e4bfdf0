"""GPU paths (fp16 with loss scaling, bf16 autocast and channels_last on cuDNN, DALI 'mixed'
decoding, the torch loader's pinned batches): marked `gpu` and skipped without CUDA;
scripts/gpu_check.sh runs them on a GPU node. Their CPU twins are test_bf16_on_cpu_trains,
the fp32 end-to-end tests and test_dali.py's comparison of the two loaders.
The last tests run on a CPU: how scripts/gpu_check.sh reports these tests, refuses a machine without
CUDA, and rehearses the whole check on a bare GPU node's stack (its dry run)."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from helpers import REPO, read_metrics, run_module, run_train
from helpers.gpu import DALI_ABSENT, needs_cuda, require_dali



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


@pytest.mark.gpu
@needs_cuda
def test_a_cuda_trace_counts_the_kernels_each_range_launched(tmp_path):
    """The GPU twin of test_gpu_figures.py's hand-made trace: the bench's real CUDA trace, in which the
    GPU check counts the kernels launched inside the LARS step's "optimizer" range (and the forward's)."""
    sys.path.insert(0, str(REPO / "scripts"))
    import gpu_figures
    done = run_module("train.bench", "train", "--arch", "resnet18", "--image-size", 32, "--batch-size", 8,
                      "--warmup-steps", 1, "--steps", 3, "--report", tmp_path / "bench.json", "--profile",
                      tmp_path / "traces", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    trace = tmp_path / "traces" / "trace-rank0.json.gz"
    lars, forward = (gpu_figures.range_figures(trace, name) for name in ("optimizer", "forward"))
    assert lars["steps"] == forward["steps"] == 2 and lars["kernels_per_step"] > 0, lars
    assert forward["kernels_per_step"] >= 20, forward  # (resnet18: 20 convolutions alone)


def gpu_check(*args, timeout=300, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHON": sys.executable, **env})


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


DEVICE_PYTHON = REPO / ".venv-device" / "bin" / "python"  # a bare GPU node's stack (scripts/test.sh)
MOST_FILES, MOST_BYTES, MOST_DEPTH = 8, 16 * 2 ** 20, 2  # what $OUT may hold: small enough to copy back from a node


@pytest.mark.slow(seconds=120)
@pytest.mark.skipif(not DEVICE_PYTHON.exists(), reason="no .venv-device: scripts/test.sh makes it where Python 3.12 is")
def test_gpu_check_dry_runs_on_a_bare_gpu_nodes_stack(tmp_path, record_property):
    """gpu_check.sh --dry-run on Python 3.12 with torch 2.11 and nothing else of ours: the wheels of
    .whl/ install without network, the gpu tests load (only their files: the others need packages
    such a node lacks), and the figures run on the CPU as on a GPU: DALI's rows say `DALI absent`
    (one per DALI run), Horovod's likewise, the 2-GPU stage as 2 processes; $OUT holds no more than
    a remote node can send back."""
    probe = subprocess.run([str(DEVICE_PYTHON), "-c", "import torch, sys; print(torch.__version__, sys.version_info[:2])"],
                           capture_output=True, text=True, timeout=120)
    assert probe.stdout.startswith("2.11.0") and "(3, 12)" in probe.stdout, probe.stdout + probe.stderr
    out = tmp_path / "out"
    started = time.monotonic()
    result = gpu_check("--dry-run", PYTHON=str(DEVICE_PYTHON), OUT=str(out), timeout=420)
    seconds = time.monotonic() - started
    record_property("dry_run_s", round(seconds, 1))
    print(f"gpu_check.sh --dry-run on .venv-device: {seconds:.0f} s")
    said = (out / "gpu_figures.txt").read_text()
    assert result.returncode == 0, said + result.stderr[-3000:]
    assert said.splitlines()[-1].startswith("gpu_check: dry run ok"), said
    assert "torch 2.11.0" in said and "python 3.12" in said and "mlperf-logging 4.1.68" in said, said
    gpu_files = [path for path in sorted(REPO.glob("tests/test_*.py")) if "mark.gpu" in path.read_text()]
    here = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider",
                           *gpu_files], capture_output=True, text=True, timeout=300, cwd=REPO)
    expected = here.stdout.count("::")  # the gpu tests as this machine's own stack collects them
    assert expected > 0 and f"gpu tests: {expected} collected" in said, said
    rows = {r["run"]: r for r in json.loads((out / "gpu_figures.json").read_text())["runs"]}
    dali_runs = [name for name in rows if name.startswith("dali")]
    dali_rows = [line for line in said.splitlines() if line.startswith("dali")]
    assert len(dali_runs) == len(dali_rows) == 2 and all(line.endswith(f" {DALI_ABSENT}") for line in dali_rows), said
    assert rows["synthetic fp32"]["img_per_s"] > 0 and rows["horovod fp32"]["absent"] == "Horovod absent"
    assert rows["trace fp32"]["lars_step"]["calls_per_step"] > 0, rows["trace fp32"]
    files = [path for path in out.rglob("*") if path.is_file()]
    assert len(files) <= MOST_FILES and not [path for path in out.rglob("*") if not path.is_file() and not path.is_dir()]
    assert all(path.stat().st_size <= MOST_BYTES for path in files), [(p.name, p.stat().st_size) for p in files]
    assert all(len(path.relative_to(out).parts) - 1 <= MOST_DEPTH for path in files), files
    assert (out / "gpu_trace.json.gz").is_file() and (out / "gpu_calibration.yaml").is_file()
