"""What a training step of a model holds in GPU memory (docs/planner.md): the largest batch that fits
a GPU. A fact about the model, read by the trainer (the default per-GPU batch) and the planner.
Imports no torch until a model is built."""
import functools

# GPU memory of a training step (docs/planner.md): the activations kept for backward, per image at
# 224 px in fp16 (each convolution's output and each BatchNorm's output, on which ReLU runs in
# place: 22.6 M values), the model state per parameter (fp32 weight, gradient and momentum, fp16
# copies of weight and gradient), and a reserve for the CUDA context, cuDNN workspaces and the
# allocator's slack (assumed).
ACTIVATION_BYTES_PER_IMAGE = 45e6
STATE_BYTES_PER_PARAM = 16
MEMORY_RESERVE_BYTES = 2e9


@functools.lru_cache(maxsize=None)
def parameter_count(arch: str) -> int:
    """Parameters of the model, built on the meta device (no memory, no time)."""
    import torch
    from models import build_model
    with torch.device("meta"):
        return sum(p.numel() for p in build_model(arch).parameters())


def fitting_batch(memory_bytes: float, params: int, image_size: int, precision: str = "fp16") -> int:
    """The largest batch whose training step fits in `memory_bytes`: activations scale with the pixels,
    and fp32 keeps them at twice the bytes of fp16 and bf16."""
    per_image = ACTIVATION_BYTES_PER_IMAGE * (image_size / 224) ** 2 * (2 if precision == "fp32" else 1)
    free = memory_bytes - MEMORY_RESERVE_BYTES - params * STATE_BYTES_PER_PARAM
    return max(0, int(free // per_image))


def fitting_multiple(memory_bytes: float, params: int, image_size: int, precision: str, multiple: int,
                     limit: int) -> int:
    """The largest multiple of `multiple` up to `limit` that fitting_batch allows (0: not one such batch)."""
    fits = min(fitting_batch(memory_bytes, params, image_size, precision), limit)
    return fits - fits % multiple
