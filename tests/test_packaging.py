"""The shell around the trainer: scripts pass shellcheck, the Dockerfile passes hadolint (which
runs ShellCheck on its RUN lines), installs only through scripts that CI runs too, and builds the
trainer and the GPU check for V100, A100 and H100 nodes with the torch the tests run; pyproject.toml's
oldest torch is one a test tier runs."""
import re
import subprocess
import sys
from pathlib import Path

import torch

from helpers import REPO

BIN = Path(sys.executable).parent
SCRIPTS = sorted([*REPO.glob("scripts/**/*.sh"), *REPO.glob("scripts/**/*.sbatch"), REPO / ".ci" / "run"])


def test_shell_scripts_pass_shellcheck():
    assert len(SCRIPTS) >= 6
    result = subprocess.run([str(BIN / "shellcheck"), "--shell=bash", *map(str, SCRIPTS)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_dockerfile_passes_hadolint():
    result = subprocess.run([str(BIN / "hadolint"), str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def dockerfile_settings():
    """The Dockerfile's ENV settings, {name: value}."""
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    settings = {}
    for line in re.findall(r"^ENV (.+)$", text, re.M):
        settings.update(re.findall(r"(\w+)=(\S*)", line))
    return settings


def test_dockerfile_installs_only_through_tested_scripts():
    dockerfile = (REPO / "Dockerfile").read_text()
    runs = re.findall(r"^RUN (.+)$", dockerfile, re.M)
    assert runs, "the image installs nothing?"
    for command in runs:
        scripts = re.findall(r"scripts/[\w/]+\.sh", command)
        assert scripts and command == f"bash {scripts[0]}", command
        assert (REPO / scripts[0]).is_file()
    # CI runs the same script: the test command sets up through it
    assert "bash scripts/setup.sh" in (REPO / "scripts" / "test.sh").read_text()
    assert "install_horovod.sh" in (REPO / "scripts" / "setup.sh").read_text()


def test_dockerfile_copies_the_trainer_and_the_gpu_check():
    """Every COPY source exists, and the image holds what `bash scripts/gpu_check.sh` runs: the gpu
    tests with their helpers and pytest settings, the figures script and the packages it imports."""
    copies = [line.split()[:-1] for line in re.findall(r"^COPY (.+)$", (REPO / "Dockerfile").read_text(), re.M)]
    copied = {source.rstrip("/") for sources in copies for source in sources}
    assert copied and all((REPO / source).exists() for source in copied), sorted(copied)
    check = (REPO / "scripts" / "gpu_check.sh").read_text()
    named = set(re.findall(r"\b((?:scripts|tests)/[\w.]+)", check))
    assert {"scripts/gpu_figures.py", "tests/test_"} <= named, named
    needed = {path.split("/")[0] for path in named} | {"train", "models", "data", "pyproject.toml"}
    assert needed <= copied, f"the image lacks {sorted(needed - copied)}"


def test_image_set_up_builds_for_v100_a100_h100_without_the_test_lab(tmp_path):
    """scripts/setup.sh with the Dockerfile's settings, as an image build runs it (no GPU visible, a
    python with none of the stack), in its print mode: the torch the suite runs, in PyTorch's CUDA
    12.6 build (the one with V100 kernels), DALI for CUDA 12, Horovod with NCCL for 7.0, 8.0 and 9.0;
    none of the test suite's cluster (Slurm, munge, an sshd) and no second interpreter."""
    assert "--print" in (REPO / "scripts" / "setup.sh").read_text(), "setup.sh has no print mode to check it with"
    settings = dockerfile_settings()
    assert "7.0" in settings["TRAINER_GPUS"].split(","), settings  # the V100s of the clusters the image is for
    fake = tmp_path / "bin"
    fake.mkdir()
    for tool in ("python", "nvidia-smi"):  # an image build: no torch yet, no GPU visible
        (fake / tool).write_text("#!/bin/sh\nexit 1\n")
        (fake / tool).chmod(0o755)
    env = {"PATH": f"{fake}:/usr/bin:/bin", "HOME": str(tmp_path), **settings, "PYTHON": "python",
           "TRAINER_CACHE_DIR": str(tmp_path / "cache")}
    result = subprocess.run(["bash", "scripts/setup.sh", "--print"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=60)
    said = result.stdout + result.stderr
    assert result.returncode == 0, said
    suite_torch = torch.__version__.split("+")[0]
    assert re.search(rf"pip install .*--index-url https://download\.pytorch\.org/whl/cu126 torch=={suite_torch} ",
                     result.stdout), said
    assert re.search(r"pip install .*nvidia-dali-cuda120$", result.stdout, re.M), said
    assert "HOROVOD_GPU_OPERATIONS=NCCL" in result.stdout.splitlines(), said
    cc_list = settings["TRAINER_GPUS"].replace(".", "")
    assert f"HOROVOD_BUILD_CUDA_CC_LIST={cc_list}" in result.stdout.splitlines() and "70" in cc_list.split(","), said
    lab = [word for word in ("slurm", "munge", "openssh-server", "sshd", "/opt/trainer-openssh", ".venv-device",
                             "gpu_wheels") if word in said]
    assert not lab, f"the image's set-up installs the test suite's {lab}:\n{said}"


def test_pyproject_torch_floor_is_the_oldest_torch_a_tier_runs():
    """pyproject.toml's lowest torch is the lowest the test command installs (the suite runs the
    pinned one; the GPU check's dry run a bare GPU node's older one), and the README says so."""
    floors = dict(re.findall(r'^\s*"(torch|torchvision)>=(\d+\.\d+)",', (REPO / "pyproject.toml").read_text(), re.M))
    installed = set()
    for script in REPO.glob("scripts/*.sh"):
        text = script.read_text()
        installed |= set(re.findall(r"\btorch==(\d+\.\d+)\.\d+", text))
        installed |= set(re.findall(r"\b\w*TORCH\w*(?:=|:-)(\d+\.\d+)\.\d+", text))  # TORCH_VERSION=, ${NODE_TORCH:-...}
    assert len(installed) >= 2, installed  # the suite's torch and the bare GPU node's
    oldest = min(installed, key=lambda version: tuple(map(int, version.split("."))))
    assert floors.get("torch") == oldest, (floors, sorted(installed))
    # torchvision 0.N+15 is torch 2.N's
    assert floors.get("torchvision") == f"0.{int(oldest.split('.')[1]) + 15}", floors
    assert re.search(rf"oldest torch[^.]*\b{re.escape(oldest)}\b", (REPO / "README.md").read_text()), \
        f"README.md does not name {oldest} as the oldest torch"
