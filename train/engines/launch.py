"""Who started this process: the launcher's variables give the rank and the rank count
(detect_launch), the launcher gives the engine (choose_engine), the local rank gives the device."""
import os
from dataclasses import dataclass

import torch

from train.device_choices import check_kernels
from train.engines.network import tell_refusal
from train.errors import UsageError


def local_device(local_rank: int) -> torch.device:
    """This rank's device: its GPU (local rank modulo the GPUs visible), checked to be one the installed
    torch has kernels for, before any library starts on it; else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    try:
        check_kernels(device)
    except UsageError as err:
        tell_refusal(f"{err}")  # torchrun: the ranks of the other nodes would wait for this one
        raise
    return device


@dataclass(frozen=True)
class Launch:
    """Who started this process: the launcher, this process's rank, and how many ranks it started."""
    launcher: str
    rank: int = 0
    world_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def detect_launch(env=os.environ) -> Launch:
    """The launch, from the launcher's variables, in this order of precedence:
    Horovod's (horovodrun with gloo), torchrun's, MPI's (mpirun of Open MPI, MPICH or Intel MPI,
    and horovodrun with MPI, alone or inside an sbatch job, where SLURM_* is set too), an srun
    step's (also `srun --mpi=pmi2`, which sets PMI_* to the step's own rank and size)."""
    def number(name, default=0):
        return int(env.get(name, default))
    if "HOROVOD_RANK" in env:
        return Launch("horovodrun", number("HOROVOD_RANK"), number("HOROVOD_SIZE", 1))
    if "RANK" in env and "WORLD_SIZE" in env:
        return Launch("torchrun", number("RANK"), number("WORLD_SIZE"))
    if "OMPI_COMM_WORLD_SIZE" in env:
        return Launch("mpirun", number("OMPI_COMM_WORLD_RANK"), number("OMPI_COMM_WORLD_SIZE"))
    srun_step = "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env
    if "PMI_SIZE" in env and not (srun_step and env["PMI_SIZE"] == env["SLURM_STEP_NUM_TASKS"]
                                  and env.get("PMI_RANK") == env["SLURM_PROCID"]):
        return Launch("mpirun", number("PMI_RANK"), number("PMI_SIZE"))
    if srun_step and number("SLURM_STEP_NUM_TASKS", 1) > 1:
        return Launch("srun", number("SLURM_PROCID"), number("SLURM_STEP_NUM_TASKS"))
    return Launch("none")


def _horovod_with_mpi() -> bool:
    try:
        import horovod.torch as hvd
    except ImportError:
        return False
    return hvd.mpi_built()


def choose_engine(requested: str, launch: Launch, env=os.environ) -> str:
    """The engine for `--engine` (auto: the launcher's own), or a UsageError when none can serve the launch."""
    if requested != "auto":
        if requested == "none" and launch.distributed:
            raise UsageError(f"--engine none, but {launch.launcher} started {launch.world_size} ranks: each would "
                             "train alone; drop --engine none or launch one process")
        return requested
    if launch.launcher in ("horovodrun",):
        return "horovod"
    if launch.launcher in ("torchrun", "srun"):
        return "torch"
    if launch.launcher == "mpirun" and launch.distributed:
        if _horovod_with_mpi():
            return "horovod"
        if "MASTER_ADDR" in env:
            return "torch"
        raise UsageError(f"mpirun started {launch.world_size} ranks, but Horovod with MPI is not installed (install "
                         "Open MPI, then run scripts/install_horovod.sh) and MASTER_ADDR is not set for --engine torch")
    return "none"
