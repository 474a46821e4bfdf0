"""scripts/gpu_figures.py (the figures of scripts/gpu_check.sh) on a CPU: its sync check, with
torch.cuda's sync debug mode stood in for by one that fails a host read while it says "error" (a CPU
has no such mode), lets a run through that reads only at its logging points and stops one whose step
reads, naming the line; and its table and JSON from two tiny runs."""
import json
import subprocess
import sys

import pytest
import torch

from helpers import REPO, child_env

sys.path.insert(0, str(REPO / "scripts"))
import gpu_figures  # noqa: E402

TINY = ["--arch", "resnet18", "--image-size", "16", "--batch-size", "4", "--log-every", "4", "--loader", "synthetic",
        "--synthetic-images", "256", "--synthetic-classes", "10", "--max-steps", "9"]


@pytest.fixture
def sync_debug_mode(monkeypatch):
    """torch.cuda.set_sync_debug_mode as the GPU has it, for the host reads a CPU can see: in "error"
    mode a read of a tensor's value raises as a synchronising CUDA call would."""
    mode = {"now": 0}
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda value: mode.update(now=value))
    original = torch.Tensor.item

    def item(self):
        if mode["now"] == "error":
            raise RuntimeError("called a synchronizing CUDA operation")
        return original(self)
    monkeypatch.setattr(torch.Tensor, "item", item)
    return mode


@pytest.mark.slow(seconds=15)
def test_the_sync_check_passes_a_clean_step_and_names_a_read_in_it(tmp_path, sync_debug_mode, monkeypatch):
    clean = gpu_figures.train(tmp_path / "clean", TINY, sync_check=True)
    assert "failed" not in clean and clean["img_per_s"] > 0 and clean["batch"] == 4, clean
    assert sync_debug_mode["now"] == 0  # left as it was found
    from train import meters
    monkeypatch.setattr(meters.LossMeter, "add", lambda self, loss: setattr(self, "total", self.total + loss.item()))
    reading = gpu_figures.train(tmp_path / "reading", TINY, sync_check=True)
    assert reading["failed"].startswith("synchronised at train/loop.py:"), reading  # (the step's loss, read)
    assert "synchronizing CUDA operation" in reading["failed"]


@pytest.mark.slow(seconds=30)
def test_the_table_and_json_of_a_small_run(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_figures.py"), "--out", tmp_path, "--arch",
                           "resnet18", "--image-size", "24", "--steps", "8", "--batch-size", "4",
                           "--skip", "compile,ghost-bn,dali"], capture_output=True, text=True, timeout=600,
                          env=child_env(), cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    figures = json.loads((tmp_path / "gpu_figures.json").read_text())
    assert [r["run"] for r in figures["runs"]] == ["synthetic bf16", "synthetic fp32"]
    assert all(r["img_per_s"] > 0 and r["batch"] == 4 for r in figures["runs"])
    assert figures["default_precision"] == "fp32" and figures["planner"]["measured_img_s"] > 0
    lines = done.stdout.splitlines()
    assert any(line.startswith("synthetic fp32") and "sync not checked (no GPU) / synthetic" in line for line in lines)
    assert sum(line.startswith("published: ") for line in lines) == 2
