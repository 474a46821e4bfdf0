"""The one way a batch reaches the run's device (docs/gpu.md, "Transfers").

A copy from pageable host memory to a GPU is a blocking copy: torch waits for the device before it
returns, which stops the host from queueing the next step's kernels exactly as `.item()` does (and
`torch.cuda.set_sync_debug_mode("error")` raises at it). Every batch, label and index tensor that the
step, the evaluation or the BatchNorm recomputation takes from the host therefore goes through
`to_device`: pinned host memory, copied with `non_blocking=True`, queued on the current stream.
Nothing else in those paths may move host data to the device (tests/test_transfers.py checks it).
"""
import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device` without the host waiting for it: a host tensor is pinned (unless it is
    already) and its copy queued on the current stream; a tensor already there is returned as it is
    (on a CPU-only run every batch is). To the host it is an ordinary copy, which waits: its
    reader needs the values."""
    device = torch.device(device)
    if device.type == "cpu":
        return tensor.to(device)
    if tensor.device.type == "cpu" and device.type == "cuda" and not tensor.is_pinned():
        tensor = tensor.pin_memory()  # (a host memcpy into the caching host allocator's memory: no device wait)
    return tensor.to(device, non_blocking=True)
