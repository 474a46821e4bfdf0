"""Mixed precision: autocast for the forward pass, dynamic loss scaling for fp16.

fp16 (V100 TensorCores) needs a GradScaler, which skips steps whose gradients overflowed;
bf16 has fp32's range and needs none, on CUDA and on CPU.
"""
import contextlib
import os

import torch

from train.errors import UsageError


PRECISIONS = ("auto", "fp32", "bf16", "fp16")  # --precision NAME


def resolve(name: str, device: torch.device) -> str:
    if name == "auto":
        if device.type != "cuda":
            return "fp32"
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    if name == "fp16" and device.type != "cuda" and not os.environ.get("TRAINER_ALLOW_CPU_FP16"):
        # CPU autocast does run fp16, slowly and to no purpose but tests of the loss-scaling path
        raise UsageError("--precision fp16 needs a CUDA GPU (loss scaling for TensorCores); use bf16 or fp32 on CPU")
    return name


class Precision:
    def __init__(self, name: str, device: torch.device):
        self.name = resolve(name, device)
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
        """The optimizer step, on gradients the engine has averaged: with fp16 the scaler unscales
        them, skips the step when they hold inf/NaN and adapts its scale."""
        if self.scaler is None:
            optimizer.step()
            return
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
