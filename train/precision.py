"""Mixed precision: which one a run takes, autocast for the forward pass, dynamic loss scaling for fp16.

`--precision auto` follows the GPU's compute capability (docs/precision.md): bf16 from 8.0 up
(Ampere, Hopper: bf16 TensorCores), fp16 with loss scaling below (V100, T4: TensorCores for fp16
only; bf16 runs there, emulated and slow), fp32 on a CPU. The capability is asked of
torch.cuda.get_device_capability, not of torch.cuda.is_bf16_supported(), which says yes on sm 7.x too
(it counts emulation).

fp16 needs a GradScaler, which skips steps whose gradients overflowed: it unscales and checks the
gradients in one pass, and the optimizers (train/optim.py) skip on the device, so no step reads the
found-inf flag on the host. bf16 has fp32's range and needs none, on CUDA and on CPU.
"""
import contextlib
import os

import torch

from train.errors import UsageError

BF16_CAPABILITY = (8, 0)  # bf16 TensorCores from Ampere (sm 8.0) on


def capability(device: torch.device) -> tuple[int, int]:
    """The GPU's compute capability (major, minor)."""
    return tuple(torch.cuda.get_device_capability(device))


def resolve(name: str, device: torch.device) -> str:
    """The precision a run takes: `name` (auto: by the device), checked against the device."""
    if name == "fp16" and device.type != "cuda" and not os.environ.get("TRAINER_ALLOW_CPU_FP16"):
        # CPU autocast does run fp16, slowly and to no purpose but tests of the loss-scaling path
        raise UsageError("--precision fp16 needs a CUDA GPU (loss scaling for TensorCores); use bf16 or fp32 on CPU")
    if name != "auto":
        return name
    if device.type != "cuda":
        return "fp32"
    return "bf16" if capability(device) >= BF16_CAPABILITY else "fp16"


# torch's CPU bf16 convolution (oneDNN) leaves the weight gradient of a stride-2 convolution over a
# 1x1 input partly unwritten: whatever the memory held, NaN at times (docs/precision.md). A ResNet's
# layer4 sees 1x1 inputs at crops of 16 px and below.
CPU_BF16_SMALLEST_CROP = 17


def check_crop(name: str, device: torch.device, smallest_crop: int) -> None:
    """Refuse bf16 on a CPU where the training crops would meet the broken convolution gradient
    (TRAINER_ALLOW_BROKEN_CPU_BF16=1 lets it run: scripts/stress.py shows what it does)."""
    if os.environ.get("TRAINER_ALLOW_BROKEN_CPU_BF16"):
        return
    if resolve(name, device) == "bf16" and device.type != "cuda" and smallest_crop < CPU_BF16_SMALLEST_CROP:
        raise UsageError(f"bf16 on a CPU cannot train {smallest_crop} px crops: torch's CPU bf16 convolution "
                         "gives garbage weight gradients for a stride-2 convolution over a 1x1 input (ResNet's "
                         "layer4 at 16 px and below); train at 24 px or more, or use --precision fp32")


def explain(name: str, device: torch.device) -> tuple[str, str]:
    """(where the run's precision comes from, for the header; a warning line or ""): the GPU, its
    compute capability and the rule, or the CPU."""
    chosen = resolve(name, device)
    if device.type != "cuda":
        return f"{chosen} on cpu", ""
    major, minor = capability(device)
    gpu = f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}"
    below = (major, minor) < BF16_CAPABILITY
    if name == "auto":
        rule = "no bf16 TensorCores below 8.0: fp16 with loss scaling" if below else "bf16 TensorCores from 8.0 up"
        return f"{chosen} on {gpu}: {rule})", ""
    warning = (f"--precision bf16 on {torch.cuda.get_device_name(device)} (compute capability {major}.{minor}): bf16 "
               "is emulated there without TensorCores, much slower than fp16; --precision auto takes fp16 with loss "
               "scaling") if chosen == "bf16" and below else ""
    return f"{chosen} on {gpu}, as asked)", warning


class Precision:
    def __init__(self, name: str, device: torch.device):
        self.name = resolve(name, device)
        self.source, self.warning = explain(name, device)
        self.device_type = device.type
        self.dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(self.name)
        self.scaler = torch.amp.GradScaler(device.type) if self.name == "fp16" else None

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer step, on gradients the engine has averaged. With fp16 the scaler first unscales
        the gradients and checks them for inf/NaN in one fused pass (unscale_), then hands the optimizer
        the overflow flag as a device tensor and no scale (the optimizers of train/optim.py skip the step
        on the device; another optimizer gets a host read of the flag), then adapts its scale. Left to
        step() alone, the scaler would check in a pass of its own and the optimizer divide in another."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.unscale_(optimizer)
        self.scaler.step(optimizer)
        self.scaler.update()

    def log_fields(self) -> dict:
        """The loss scale, for the logs of fp16 runs (a host read: at logging points only)."""
        return {"loss_scale": self.scaler.get_scale()} if self.scaler else {}

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler and state:
            self.scaler.load_state_dict(state)
