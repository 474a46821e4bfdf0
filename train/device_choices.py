"""What the device decides when the flags leave it open (docs/gpu.md): the input pipeline, and the
per-GPU batch. (The precision follows the GPU's compute capability: train/precision.py.)

- The loader: on a GPU, DALI decoding on the GPU (nvJPEG) where DALI's CUDA build is installed: the
  torch loader's decoding threads deliver a couple of thousand images/s per node, an eighth of what
  eight V100s train on and a thirtieth of eight H100s'. Without it, the torch loader, with one line
  saying why. On a CPU the torch loader.
- The per-GPU batch: the largest multiple of 16 up to 512 whose training step fits in the GPU's
  memory, by the memory model (models/memory.py); on a CPU 256. (MLPerf's H100 and H200 submissions
  train 400 per GPU.) A multiple of 16: the batch is a dimension of the classifier's matrix products
  (the one its weight gradient sums over), and with the pixels the rows of every convolution's
  implicit matrix product, where fp16 and bf16 TensorCores run best on multiples of 8 elements
  (16 bytes; NVIDIA's matrix multiplication guide); 16 keeps that for half the batch too (two ghost
  BatchNorm groups), and gives up at most 15 images of what fits. The step is fitted into 85% of the
  GPU's memory: the memory model counts what backward keeps, not the copies torch's kernels make on
  the way nor the input pipeline's buffers (DALI's are not torch's), and a first step that runs out
  of memory costs a user more than a batch a little smaller than it could be. With it a V100-16GB
  takes 256 in fp16, NVIDIA's own choice there; an A100, H100 or H200 takes 512.

Before any of it, the GPU itself: one the installed torch build has no kernels for is refused at start
(check_kernels), rather than failing at its first kernel with CUDA's "no kernel image is available for
execution on the device" (a V100 under torch's CUDA 13 builds, which compile for 7.5 and up).
"""
import importlib.metadata
import importlib.util
import re
import socket

import torch

from train.errors import UsageError
from train.rules import DEFAULT_PER_RANK_BATCH

GPU_BATCH_LIMIT = 512  # the largest default per-GPU batch (module docstring)
GPU_BATCH_MULTIPLE = 16
GPU_MEMORY_SHARE = 0.85  # of the GPU's memory, the default batch's step is fitted into (module docstring)
DALI_PACKAGE = "nvidia-dali-cuda130"  # what scripts/setup.sh and the Dockerfile install (-cuda120 on CUDA 12 stacks)


# how a torch build's architectures read (torch.cuda.get_arch_list()): sm_90 (machine code), sm_90a (machine
# code for 9.0 alone), compute_90 (PTX)
ARCH_ENTRY = re.compile(r"(sm|compute)_(\d+)(\d)([a-z]?)$")
SETUP_ROUTE = ("run scripts/setup.sh on this node (it installs a torch build for its GPUs: PyTorch's CUDA 12.6 "
               "build below compute capability 7.5), or use the container (Dockerfile)")


def has_kernels_for(capability: tuple[int, int], arch_list: list[str]) -> bool:
    """Whether a torch build compiled for `arch_list` runs on a GPU of this compute capability. Machine
    code runs on its own major version at its minor or above (sm_80's on 8.6 and 8.9), an `a` build
    (sm_90a) on its own capability alone; PTX (compute_90) on its capability and every one above, which
    the driver compiles it for (NVIDIA's CUDA compatibility guide). A build that lists nothing runs."""
    if not arch_list:
        return True
    for entry in arch_list:
        parsed = ARCH_ENTRY.match(entry)
        if not parsed:
            continue
        kind, major, minor, variant = parsed.group(1), int(parsed.group(2)), int(parsed.group(3)), parsed.group(4)
        if kind == "compute" and capability >= (major, minor):
            return True
        if kind == "sm" and (capability == (major, minor) or (
                variant != "a" and capability[0] == major and capability[1] >= minor)):
            return True
    return False


def check_kernels(device: torch.device) -> None:
    """Refuses (UsageError) a GPU the installed torch build has no kernels for, naming the GPU, its
    compute capability, the build's architectures and what to do."""
    if device.type != "cuda" or torch.version.hip:  # (ROCm builds name gfx targets)
        return
    arch_list = torch.cuda.get_arch_list()
    major, minor = torch.cuda.get_device_capability(device)
    if has_kernels_for((major, minor), arch_list):
        return
    index = torch.cuda.current_device() if device.index is None else device.index
    raise UsageError(f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}, GPU {index} of "
                     f"{socket.gethostname()}): torch {torch.__version__} has no kernels for it (built for "
                     f"{', '.join(arch_list)}); {SETUP_ROUTE}")


def dali_cuda_build() -> str:
    """"" when DALI's CUDA build is installed and loads, else why not."""
    if importlib.util.find_spec("nvidia") is None or importlib.util.find_spec("nvidia.dali") is None:
        return f"DALI is not installed (pip install {DALI_PACKAGE})"
    builds = [d.metadata["Name"] for d in importlib.metadata.distributions()
              if (d.metadata["Name"] or "").lower().startswith("nvidia-dali-cuda")]
    if not builds:
        return f"the installed DALI is not a CUDA build (pip install {DALI_PACKAGE})"
    try:
        import nvidia.dali  # noqa: F401
    except Exception as err:  # installed, but it does not load here
        return f"DALI ({builds[0]}) does not load: {type(err).__name__}: {err}"
    return ""


def choose_loader(requested: str, decode: str, device: torch.device, why_no_dali=dali_cuda_build) -> tuple[str, str]:
    """(the loader, a warning line or ""): `--loader auto` by the device; `--dali-decode gpu` needs one."""
    if decode == "gpu" and device.type != "cuda":
        raise UsageError("--dali-decode gpu needs a CUDA GPU; use --dali-decode cpu (or auto) here")
    if requested != "auto":
        return requested, ""
    if device.type != "cuda":
        return "torch", ""
    missing = why_no_dali()
    if missing:
        return "torch", (f"the torch loader feeds this GPU ({missing}): its decoding threads deliver a few thousand "
                         "images/s per node, less than GPUs train on; DALI decodes on the GPU")
    return "dali", ""


def dali_decodes_on_gpu(decode: str, device: torch.device) -> bool:
    """--dali-decode: auto decodes on the GPU where there is one."""
    return device.type == "cuda" and decode != "cpu"


def loader_summary(loader: str, decode: str, workers: int, device: torch.device) -> str:
    """The loader as the run's header names it: `torch, 4 threads`, `dali, decode on CPU, 4 threads`,
    `dali, decode on GPU`, `synthetic`."""
    threads = f"{workers} thread{'' if workers == 1 else 's'}"
    if loader == "dali":
        return "dali, decode on GPU" if dali_decodes_on_gpu(decode, device) else f"dali, decode on CPU, {threads}"
    return f"torch, {threads}" if loader == "torch" else loader


def default_batch(device: torch.device, precision: str, image_size: int, arch: str) -> tuple[int, str]:
    """(the per-rank batch when neither --batch-size nor --global-batch-size is given, and for the header
    why): on a GPU the largest multiple of 16 up to 512 that fits its memory, on a CPU 256."""
    if device.type != "cuda":
        return DEFAULT_PER_RANK_BATCH, ""
    from models.memory import fitting_multiple, parameter_count
    memory = torch.cuda.get_device_properties(device).total_memory
    batch = fitting_multiple(memory * GPU_MEMORY_SHARE, parameter_count(arch), image_size, precision,
                             GPU_BATCH_MULTIPLE, GPU_BATCH_LIMIT)
    share = f"{GPU_MEMORY_SHARE:.0%} of its {memory / 2 ** 30:.0f} GiB"
    if not batch:
        raise UsageError(f"not {GPU_BATCH_MULTIPLE} images of {image_size} px fit {share} by the memory model "
                         "(docs/planner.md); give --batch-size")
    return batch, (f"batch {batch} per GPU: the largest multiple of {GPU_BATCH_MULTIPLE} up to {GPU_BATCH_LIMIT} whose "
                   f"{precision} step fits {share}")
