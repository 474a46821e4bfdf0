"""An interrupted run, resumed, ends with bit-identical weights to an uninterrupted one (CPU)."""
import torch

from conftest import run_train

RUN = ["--arch", "resnet18", "--epochs", 2, "--workers", 2, "--log-every", 4]


def weights(run_dir):
    return torch.load(run_dir / "checkpoint.pt", weights_only=False)


def test_resume_mid_epoch_is_bit_identical(tmp_path):
    whole = run_train("--out-dir", "whole", *RUN, cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr
    # stop in the middle of epoch 2 (15 steps per epoch), then continue with no step limit
    first = run_train("--out-dir", "parts", *RUN, "--max-steps", 20, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert weights(tmp_path / "parts")["step"] == 20
    second = run_train("--out-dir", "parts", "--resume", "--max-steps", 0, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert "resuming" in second.stdout
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "parts")
    assert a["step"] == b["step"] == 30
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for key, state in a["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"], b["optimizer"]["state"][key]["momentum_buffer"])
