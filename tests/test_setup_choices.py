"""What the set-up installs, read from `bash scripts/setup.sh --print` and `bash scripts/test.sh --print`
(the commands they would run, none run): the torch and DALI builds and Horovod's GPU build that the
GPUs decide (a stand-in `nvidia-smi` lists their compute capabilities, as on a V100, A100 or H100 node),
installs from a local wheelhouse, and that the trainer's set-up never asks for a daemon, a system
service or a second interpreter, which only the test command's set-up brings.

The scripts run from a copy of the checkout's scripts in a temporary folder (no .venv, no
.venv-device there), as root (a stand-in `id`) with a PATH of this machine's commands less the ones a
test takes away; a stand-in `apt-get` records any call."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO

CU126 = "--index-url https://download.pytorch.org/whl/cu126"
SYSTEM_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
# the test lab's tools: the trainer's set-up must not install them even when they are missing
LAB_TOOLS = ("slurmctld", "munged", "ip", "nsenter")
STAND_INS = ("nvidia-smi", "id", "apt-get", "mpicxx", "ssh", "python3", "python3.12")  # never this machine's own


def stand_in(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)


def nvidia_smi(*capabilities: str) -> str:
    """A stand-in nvidia-smi's script: one GPU's compute capability per line, as
    `nvidia-smi --query-gpu=compute_cap --format=csv,noheader` prints them."""
    return "case \"$*\" in *compute_cap*) printf '%s\\n' " + " ".join(capabilities) + " ;; *) exit 9 ;; esac"


def checkout(tmp_path: Path, hide=(), gpus=None, python312=False) -> tuple[Path, dict]:
    """A copy of the set-up scripts and pyproject.toml in tmp_path/checkout, and the environment to run
    them in: root, no nvidia-smi unless `gpus` (its stand-in's script), Open MPI's compiler and an ssh
    client there and the commands in `hide` missing, a stand-in Python 3.12 with `python312`."""
    tree = tmp_path / "checkout"
    (tree / "scripts").mkdir(parents=True)
    for script in ("setup.sh", "test.sh", "install_horovod.sh", "gpu_targets.sh", "ticker.sh"):
        shutil.copy(REPO / "scripts" / script, tree / "scripts")
    shutil.copy(REPO / "pyproject.toml", tree)
    system = tmp_path / "system"  # this machine's commands less the hidden ones (and any real nvidia-smi)
    system.mkdir()
    for folder in SYSTEM_DIRS:
        for command in Path(folder).glob("*") if Path(folder).is_dir() else ():
            if command.name in (*hide, *STAND_INS) or (system / command.name).exists():
                continue
            (system / command.name).symlink_to(command)
    fakes = tmp_path / "fakes"
    fakes.mkdir()
    stand_in(fakes, "id", 'echo 0')
    # a set-up that ran anything for real would stop at once: no package manager, no interpreter for a venv
    stand_in(fakes, "apt-get", f'echo "$*" >> "{tmp_path}/apt-get-calls"; exit 1')
    stand_in(fakes, "python3", "exit 1")
    for command in ("mpicxx", "ssh"):  # looked for, never run, by --print
        if command not in hide:
            stand_in(fakes, command, "exit 9")
    if gpus is not None:
        stand_in(fakes, "nvidia-smi", gpus)
    if python312:
        stand_in(fakes, "python3.12", "exit 0")
    env = {"PATH": f"{fakes}:{system}", "HOME": str(tmp_path / "home"), "LANG": "C.UTF-8", "PIP_NO_INDEX": "1"}
    return tree, env


def printed(tmp_path: Path, *args, script="setup.sh", hide=(), gpus=None, python312=False,
            **settings) -> subprocess.CompletedProcess:
    """`bash scripts/SCRIPT --print ARGS` in checkout()'s copy and environment, with `settings` added;
    checks that it ran no apt-get and made no venv."""
    tree, env = checkout(tmp_path, hide, gpus, python312)
    result = subprocess.run(["bash", str(tree / "scripts" / script), "--print", *args], capture_output=True,
                            text=True, timeout=60, env={**env, **settings})
    assert not (tmp_path / "apt-get-calls").exists(), "--print ran apt-get"  # (a stand-in that fails)
    assert not (tree / ".venv").exists() and not (tree / ".venv-device").exists(), "--print made a venv"
    return result


def pip_line(output: str, package: str) -> str:
    """The one `pip install` line that installs `package`."""
    lines = [line for line in output.splitlines() if " -m pip install " in line and package in line.split()]
    assert len(lines) == 1, (package, output)
    return lines[0]


def horovod_environment(output: str) -> dict:
    return dict(line.split("=", 1) for line in output.splitlines() if re.match(r"HOROVOD_\w+=", line))


@pytest.mark.parametrize("gpu, capabilities, legacy, dali, cuda_arches", [
    ("V100", ["7.0"], True, "nvidia-dali-cuda120", "70"),
    ("A100", ["8.0"], False, "nvidia-dali-cuda130", "80"),
    ("H100", ["9.0", "9.0", "9.0", "9.0"], False, "nvidia-dali-cuda130", "90"),
    ("V100 and H100", ["9.0", "7.0", "9.0"], True, "nvidia-dali-cuda120", "70,90"),
])
def test_the_gpus_nvidia_smi_lists_decide_torch_dali_and_horovods_build(tmp_path, gpu, capabilities, legacy, dali,
                                                                         cuda_arches):
    result = printed(tmp_path, gpus=nvidia_smi(*capabilities))
    assert result.returncode == 0, result.stderr
    torch = pip_line(result.stdout, "torch==2.14.1")
    assert "torchvision==0.29.1" in torch.split()
    # below 7.5 only PyTorch's CUDA 12.6 build has kernels; PyPI's default (CUDA 13) for the others
    assert (CU126 in torch) == legacy, torch
    assert "--index-url" not in result.stdout.replace(torch, "")
    pip_line(result.stdout, dali)
    assert "nvidia-dali-cuda1" not in result.stdout.replace(pip_line(result.stdout, dali), "")
    build = horovod_environment(result.stdout)
    assert build.get("HOROVOD_GPU_OPERATIONS") == "NCCL", result.stdout
    assert build.get("HOROVOD_BUILD_CUDA_CC_LIST") == cuda_arches, result.stdout
    assert re.search(r"-m pip wheel .*horovod-0\.28\.1", result.stdout)


def test_a_login_node_names_its_target_gpus(tmp_path):
    """No nvidia-smi (a login node, an image build): TRAINER_GPUS=7.0 gives the V100's builds."""
    result = printed(tmp_path, TRAINER_GPUS="7.0")
    assert result.returncode == 0, result.stderr
    assert CU126 in pip_line(result.stdout, "torch==2.14.1")
    pip_line(result.stdout, "nvidia-dali-cuda120")
    build = horovod_environment(result.stdout)
    assert build["HOROVOD_GPU_OPERATIONS"] == "NCCL" and build["HOROVOD_BUILD_CUDA_CC_LIST"] == "70"


@pytest.mark.parametrize("gpus", [None, "echo 'NVIDIA-SMI has failed: no driver' >&2; exit 9"],
                         ids=["no nvidia-smi", "nvidia-smi without a driver"])
def test_a_cpu_machine_keeps_the_default_builds_and_horovod_without_nccl(tmp_path, gpus):
    result = printed(tmp_path, gpus=gpus)
    assert result.returncode == 0, result.stderr
    torch = pip_line(result.stdout, "torch==2.14.1")
    assert "--index-url" not in torch
    pip_line(result.stdout, "nvidia-dali-cuda130")
    assert "HOROVOD_GPU_OPERATIONS" not in horovod_environment(result.stdout), result.stdout
    assert horovod_environment(result.stdout)["HOROVOD_WITH_GLOO"] == "1"


@pytest.mark.parametrize("settings, message", [
    ({"TRAINER_GPUS": "8.0,6.0"}, "container"),
    ({"TRAINER_GPUS": "volta"}, "TRAINER_GPUS"),
    ({"TRAINER_WHEELHOUSE": "/nonexistent/wheels"}, "TRAINER_WHEELHOUSE"),
])
def test_bad_targets_are_one_line_and_exit_2_with_nothing_installed(tmp_path, settings, message):
    result = printed(tmp_path, **settings)
    assert result.returncode == 2 and result.stdout == "", result
    assert len(result.stderr.splitlines()) == 1 and message in result.stderr, result.stderr


def test_a_p100_is_refused_with_the_container_route(tmp_path):
    result = printed(tmp_path, gpus=nvidia_smi("6.0"))
    assert result.returncode == 2 and result.stdout == "", result
    assert result.stderr.count("\n") == 1 and "6.0" in result.stderr and "Dockerfile" in result.stderr, result.stderr


def test_the_settings_given_win_over_the_choice(tmp_path):
    result = printed(tmp_path, gpus=nvidia_smi("7.0"), TORCH="keep", DALI_PACKAGE="nvidia-dali-cuda130",
                     HOROVOD_BUILD_CUDA_CC_LIST="70,80")
    assert result.returncode == 0, result.stderr
    assert "torch==" not in result.stdout  # the interpreter's own torch is kept
    pip_line(result.stdout, "nvidia-dali-cuda130")
    assert horovod_environment(result.stdout)["HOROVOD_BUILD_CUDA_CC_LIST"] == "70,80"


def test_an_offline_node_installs_from_its_wheelhouse_alone(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    result = printed(tmp_path, gpus=nvidia_smi("7.0"), TRAINER_WHEELHOUSE=str(wheels))
    assert result.returncode == 0, result.stderr
    pips = [line for line in result.stdout.splitlines() if re.search(r" -m pip (install|download) ", line)]
    assert len(pips) >= 5, result.stdout  # torch, DALI, the project, Horovod's sdist and wheel
    for line in pips:
        if "--force-reinstall" in line:  # the wheel just built
            continue
        assert f"--no-index --find-links {wheels}" in line, line
    assert "--index-url" not in result.stdout and "--upgrade pip" not in result.stdout


def test_the_trainers_set_up_asks_for_no_daemon_service_or_second_interpreter(tmp_path):
    """As root, with Slurm, munge, ip and nsenter missing (a compute node whose Slurm is managed
    centrally): nothing from the package manager, no sshd, no .venv-device or wheels folder."""
    result = printed(tmp_path, hide=LAB_TOOLS, gpus=nvidia_smi("8.0"))
    assert result.returncode == 0, result.stderr
    everything = (result.stdout + result.stderr).lower()
    for word in ("apt-get", "slurm", "munge", "sshd", "openssh-server", "iproute2", "util-linux",
                 ".venv-device", "gpu_wheels", "python3.12", "/opt/"):
        assert word not in everything, (word, result.stdout, result.stderr)
    assert len(re.findall(r" -m venv ", result.stdout)) == 1  # the trainer's .venv, one interpreter


def test_the_trainers_set_up_asks_only_for_open_mpi_and_an_ssh_client(tmp_path):
    result = printed(tmp_path, hide=(*LAB_TOOLS, "mpicxx", "ssh"))
    assert result.returncode == 0, result.stderr
    installs = [line for line in result.stdout.splitlines() if "apt-get install" in line]
    assert len(installs) == 1, result.stdout
    assert installs[0].split("--no-install-recommends")[1].split() == ["openmpi-bin", "libopenmpi-dev",
                                                                      "openssh-client"]


def test_the_test_command_brings_the_lab_and_the_bare_gpu_stack(tmp_path):
    result = printed(tmp_path, "-k", "lars", script="test.sh", hide=LAB_TOOLS, gpus=nvidia_smi("8.0"),
                     python312=True)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    setup_ends = max(i for i, line in enumerate(lines) if "horovod" in line)
    lab = "\n".join(lines[setup_ends + 1:])
    installs = [line for line in lab.splitlines() if "apt-get install" in line]
    assert len(installs) == 1 and {"slurm-wlm", "munge", "iproute2", "util-linux"} <= set(installs[0].split()), lab
    assert "apt-get download -qq openssh-server" in lab and "/opt/trainer-openssh" in lab
    assert "python3.12 -m venv .venv-device" in lab
    assert ".venv-device/bin/python -m pip install -q torch==2.11.0 numpy pyyaml" in lab
    assert "bash scripts/gpu_wheels.sh" in lab
    assert lines[-1].startswith(".venv/bin/python -m pytest ") and lines[-1].endswith(" -k lars"), lines[-1]
    # the trainer's part is setup.sh's own
    assert CU126 not in result.stdout and "nvidia-dali-cuda130" in result.stdout


def test_install_horovod_rebuilds_a_build_without_nccl_where_gpus_are_targeted(tmp_path):
    """An installed Horovod of ours (MPI, our patches) without NCCL: kept on a CPU machine, rebuilt
    with NCCL for a GPU target. A stand-in horovod package answers the build's questions."""
    patches = re.search(r"^PATCHES=(\d+)", (REPO / "scripts" / "install_horovod.sh").read_text(), re.M).group(1)
    site = tmp_path / "site"
    (site / "horovod" / "torch").mkdir(parents=True)
    (site / "horovod" / "__init__.py").write_text("")
    (site / "horovod" / "torch" / "__init__.py").write_text("def mpi_built(): return True\n"
                                                            "def nccl_built(): return False\n")
    (site / "trainer-patches").write_text(patches + "\n")
    tree, env = checkout(tmp_path)
    env = {**env, "PYTHONPATH": str(site), "PYTHON": sys.executable}

    def install(gpus):
        return subprocess.run(["bash", str(tree / "scripts" / "install_horovod.sh"), "--print"], capture_output=True,
                              text=True, timeout=60, env={**env, "TRAINER_GPUS": gpus})

    cpu = install("cpu")
    assert cpu.returncode == 0 and cpu.stdout == "" and "nothing to do" in cpu.stderr, cpu
    gpu = install("7.0,8.0")
    assert gpu.returncode == 0, gpu.stderr
    build = horovod_environment(gpu.stdout)
    assert build["HOROVOD_GPU_OPERATIONS"] == "NCCL" and build["HOROVOD_BUILD_CUDA_CC_LIST"] == "70,80", gpu.stdout
    assert re.search(r"-m pip wheel .*horovod-0\.28\.1", gpu.stdout)
    # with NCCL built in, the same target is satisfied
    (site / "horovod" / "torch" / "__init__.py").write_text("def mpi_built(): return True\n"
                                                            "def nccl_built(): return True\n")
    again = install("7.0,8.0")
    assert again.returncode == 0 and again.stdout == "" and "nothing to do" in again.stderr, again
