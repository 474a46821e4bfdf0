"""Which launcher started the ranks, and which engine serves it: the order of precedence on
hand-written environments, then real launches (horovodrun with MPI and with gloo, mpirun) with
--engine auto, and bad multi-rank input refused before any run directory exists."""
import re

import pytest

from helpers import REPO, launch, read_metrics
from train.errors import UsageError
from train.engines import launch as launch_detection
from train.engines.launch import Launch, choose_engine, detect_launch

pytestmark = pytest.mark.multiprocess

# a Slurm batch step's own variables: mpirun inside sbatch inherits them (the orted daemons it
# starts through srun add a step of one task per node)
SBATCH = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_LOCALID": "0"}


@pytest.mark.parametrize("env, expected", [
    ({}, Launch("none")),
    ({"HOROVOD_RANK": "1", "HOROVOD_SIZE": "4", "HOROVOD_HOSTNAME": "n1"}, Launch("horovodrun", 1, 4)),
    ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3"}, Launch("torchrun", 3, 8)),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}, Launch("mpirun", 1, 2)),  # Open MPI, horovodrun --mpi
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", **SBATCH}, Launch("mpirun", 5, 8)),  # inside sbatch
    ({"PMI_RANK": "2", "PMI_SIZE": "4"}, Launch("mpirun", 2, 4)),  # MPICH / Intel MPI
    ({"PMI_RANK": "1", "PMI_SIZE": "2", **SBATCH}, Launch("mpirun", 1, 2)),  # MPICH's mpirun inside sbatch
    ({"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2"}, Launch("srun", 1, 2)),
    ({"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4", "PMI_RANK": "3", "PMI_SIZE": "4"}, Launch("srun", 3, 4)),  # --mpi=pmi2
    ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"}, Launch("none")),  # srun of one task
    ({"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"}, Launch("torchrun", 1, 2)),
    ({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2", "RANK": "0", "WORLD_SIZE": "2"}, Launch("horovodrun", 0, 2)),
    ({"RANK": "0", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, Launch("torchrun", 0, 2)),
])
def test_launch_detection_follows_the_stated_precedence(env, expected):
    assert detect_launch(env) == expected


def test_engine_choice_for_each_launcher(monkeypatch):
    monkeypatch.setattr(launch_detection, "_horovod_with_mpi", lambda: True)
    assert [choose_engine("auto", launch, {}) for launch in (
        Launch("none"), Launch("horovodrun", 0, 2), Launch("torchrun", 0, 2), Launch("srun", 0, 2),
        Launch("mpirun", 0, 2), Launch("mpirun", 0, 1))] == ["none", "horovod", "torch", "torch", "horovod", "none"]
    assert choose_engine("torch", Launch("mpirun", 0, 2), {}) == "torch"  # a flag wins over the launcher
    monkeypatch.setattr(launch_detection, "_horovod_with_mpi", lambda: False)
    assert choose_engine("auto", Launch("mpirun", 0, 2), {"MASTER_ADDR": "node1"}) == "torch"
    with pytest.raises(UsageError, match="Horovod with MPI is not installed"):
        choose_engine("auto", Launch("mpirun", 0, 2), {})
    with pytest.raises(UsageError, match="each would train alone"):
        choose_engine("none", Launch("torchrun", 0, 2), {})


SYNTHETIC = ["--loader", "synthetic", "--arch", "resnet18", "--image-size", 32, "--synthetic-images", 160,
             "--synthetic-val-images", 24, "--synthetic-classes", 10, "--log-every", 1, "--eval-every", 0]


@pytest.mark.parametrize("launcher", ["horovod-mpi", "horovod", "mpirun"])
def test_real_launches_train_as_one_job(launcher, tmp_path):
    result = launch(launcher, 2, "-m", "train", "--out-dir", "run", *SYNTHETIC, "--batch-size", 8, "--max-steps", 3,
                    "--engine", "auto", cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 rank(s) x batch 8 = global batch 16" in result.stdout
    mllog = (tmp_path / "run" / "mllog.txt").read_text()
    assert re.search(r'"key": "global_batch_size", "value": 16,', mllog)  # twice the per-rank batch
    replicas = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "replicas"]
    assert replicas == [{**replicas[0], "ranks": 2, "differing_from_rank0": 0}]  # the ranks end with equal models


def _refused(tmp_path, *args, match, env=None):
    result = launch("mpirun", 2, "-m", "train", "--out-dir", "run", *SYNTHETIC, "--max-steps", 1, *args,
                    cwd=tmp_path, env=env)
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, output[-3000:]
    assert len(errors) == 1 and match in errors[0], output[-3000:]  # printed once, by rank 0
    assert not (tmp_path / "run").exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("args, match", [
    (["--bn-span", 3], "--bn-span 3 does not divide the 2 rank(s)"),
    (["--ranks-per-node", 3], "2 ranks do not split into nodes of 3"),
    (["--global-batch-size", 15], "--global-batch-size 15 does not divide over 2 ranks"),
    (["--batch-size", 8, "--global-batch-size", 24], "--global-batch-size 24 is not a whole number of 2 rank(s) x --batch-size 8"),
    (["--engine", "torch"], "--engine torch under mpirun needs MASTER_ADDR"),
])
def test_bad_input_with_two_ranks_leaves_nothing(tmp_path, args, match):
    _refused(tmp_path, *args, match=match)


def test_missing_dali_with_two_ranks_leaves_nothing(tmp_path):
    shadow = tmp_path / "shadow" / "nvidia"  # a plain `nvidia` package hides the installed nvidia.dali
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("")
    _refused(tmp_path, "--loader", "dali", match="--loader dali needs NVIDIA DALI",
             env={"PYTHONPATH": f"{shadow.parent}:{REPO}"})


def test_mpirun_without_an_engine_for_it_leaves_nothing(tmp_path):
    shadow = tmp_path / "shadow" / "horovod"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('Horovod is not installed (test)')\n")
    _refused(tmp_path, match="mpirun started 2 ranks, but Horovod with MPI is not installed",
             env={"PYTHONPATH": f"{shadow.parent}:{REPO}"})
