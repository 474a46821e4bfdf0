"""No host reads in the training step: a read of a tensor's value (.item(), .tolist(), .cpu(),
.numpy(), bool/float/int of a tensor) makes the CPU wait for the GPU, and the next step's kernels are
not queued in time. A CPU cannot see the wait, so the reads are counted instead
(tests/helpers/host_reads.py): a run of 14 steps must make exactly the reads of a run of 4 (logging
and evaluation out of the way), in every precision, with DALI, with ghost BatchNorm and with gradient
accumulation (--accumulation-steps).

fp16's loss scaling is where a read hid: GradScaler reads its overflow flag every step unless the
optimizer unscales and skips by itself, which ours do, with the same results as the scaler's own
skip (the first tests)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import REPO, child_env
from train.lars import LARS, decay_param_groups
from train.optim import SGD, RMSpropWarmup, groups_with_weight_decay

OPTIMIZERS = {
    "lars": lambda model: LARS(decay_param_groups(model), lr=0.5, momentum=0.9, weight_decay=1e-4),
    "sgd": lambda model: SGD(groups_with_weight_decay(_Settings, model), lr=0.1, momentum=0.9),
    "sgd-nesterov": lambda model: SGD(groups_with_weight_decay(_Settings, model), lr=0.1, momentum=0.9, nesterov=True),
    "rmsprop-warmup": lambda model: RMSpropWarmup(groups_with_weight_decay(_Settings, model), lr=0.1, momentum=0.9,
                                                  rms_lr_ratio=0.01, sgd_share=0.3),
}


class _Settings:
    weight_decay = 1e-4


def _model(channels_last: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4))
    return model.to(memory_format=torch.channels_last) if channels_last else model


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_optimizers_skip_on_the_device_as_the_scaler_would(name, channels_last):
    """Each optimizer under fp16 loss scaling, stepping by itself (grad_scale and found_inf on the
    device), against the same optimizer left to GradScaler (which unscales, reads the flag on the host
    and skips the step): the same weights, optimizer state and loss scale after normal steps and after
    an overflowing one, which changes nothing at all."""
    runs = []
    for on_device in (True, False):
        model = _model(channels_last)
        optimizer = OPTIMIZERS[name](model)
        if not on_device:
            optimizer._step_supports_amp_scaling = False  # GradScaler's own unscale_ and host-side skip
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        generator = torch.Generator().manual_seed(1)
        history = []
        for step in range(5):
            x, y = torch.randn(6, 3, 8, 8, generator=generator), torch.randint(0, 4, (6,), generator=generator)
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss * (float("inf") if step == 2 else 1.0)).backward()
            before = [t.clone() for t in _everything(model, optimizer)]
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            after = _everything(model, optimizer)
            if step == 2:  # the overflowing step: weights and state as they were, the scale halved
                assert all(torch.equal(a, b) for a, b in zip(before, after)), name
            history.append(([t.clone() for t in after], scaler.get_scale()))
        runs.append(history)
    on_device, by_scaler = runs
    assert [scale for _, scale in on_device] == [2.0 ** 10, 2.0 ** 10, 2.0 ** 9, 2.0 ** 9, 2.0 ** 9]
    for (mine, my_scale), (theirs, their_scale) in zip(on_device, by_scaler):
        assert my_scale == their_scale
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _everything(model, optimizer) -> list[torch.Tensor]:
    """The weights and every tensor of the optimizer's state."""
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return [p.detach() for p in model.parameters()] + state


# Each case: the flags of a short run, and its environment. (bf16 at 24 px: the trainer refuses CPU bf16
# at 16, where torch's convolution gradient is broken; train/precision.py)
SHORT = ["--arch", "resnet18", "--image-size", 16, "--batch-size", 4, "--log-every", 1000, "--eval-every", 0, "--epochs", 1]
SYNTHETIC = ["--loader", "synthetic", "--synthetic-images", 256, "--synthetic-val-images", 16, "--synthetic-classes", 10]
CASES = {
    "fp32": (SYNTHETIC + ["--precision", "fp32"], {}),
    "bf16": (SYNTHETIC + ["--precision", "bf16", "--image-size", 24], {}),
    "fp16": (SYNTHETIC + ["--precision", "fp16"], {"TRAINER_ALLOW_CPU_FP16": "1"}),
    "dali": (["--loader", "dali", "--workers", 1], {}),
    "ghost BatchNorm": (SYNTHETIC + ["--bn-group-size", 2], {}),
    "accumulation, fp16": (SYNTHETIC + ["--accumulation-steps", 2, "--precision", "fp16"], {"TRAINER_ALLOW_CPU_FP16": "1"}),
    "epoch-cutting methods": (SYNTHETIC + ["--ema-decay", 0.9, "--blurpool", "--lr-schedule", "cosine",
                                           "--resolution-schedule", "16:24:0:1:8", "--eval-flip"], {}),
}


def host_reads(tmp_path, steps: int, flags: list, env: dict) -> dict:
    out = tmp_path / f"reads{steps}.json"
    done = subprocess.run([sys.executable, str(REPO / "tests" / "helpers" / "host_reads.py"), out,
                           *map(str, ["--out-dir", tmp_path / f"run{steps}", "--max-steps", steps, *SHORT, *flags])],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600, env=child_env(**env))
    assert done.returncode == 0 and json.loads(out.read_text())["exit"] == 0, done.stdout + done.stderr
    return json.loads(out.read_text())["reads"]


@pytest.mark.slow(seconds=20)
@pytest.mark.parametrize("case", CASES)
def test_a_training_step_makes_no_host_reads(tmp_path, case):
    flags, env = CASES[case]
    if case == "dali":
        pytest.importorskip("nvidia.dali")
    four, fourteen = (host_reads(tmp_path, steps, flags, env) for steps in (4, 14))
    assert four, "no read counted at all: the counter is not counting (the run's end reads its figures)"
    per_step = {where: (fourteen.get(where, 0) - four.get(where, 0)) / 10 for where in {*four, *fourteen}}
    assert not any(per_step.values()), f"host reads per step ({case}): " + \
        ", ".join(f"{where}: {n:g}" for where, n in per_step.items() if n)
