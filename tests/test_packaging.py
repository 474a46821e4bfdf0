"""The shell around the trainer: scripts pass shellcheck, the Dockerfile passes hadolint (which
runs ShellCheck on its RUN lines) and installs only through scripts that CI runs too."""
import re
import subprocess
import sys
from pathlib import Path

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


def test_dockerfile_installs_only_through_tested_scripts():
    dockerfile = (REPO / "Dockerfile").read_text()
    runs = re.findall(r"^RUN (.+)$", dockerfile, re.M)
    assert runs, "the image installs nothing?"
    for command in runs:
        scripts = re.findall(r"scripts/[\w/]+\.sh", command)
        assert scripts and command == f"bash {scripts[0]}", command
        assert (REPO / scripts[0]).is_file()
    # the settings it gives those scripts: NGC's torch, DALI and Horovod for CUDA 12 with NCCL + MPI
    for setting in ("TORCH=keep", "DALI_PACKAGE=nvidia-dali-cuda120", "HOROVOD_GPU_OPERATIONS=NCCL",
                    "HOROVOD_WITH_MPI=1", "70"):
        assert setting in dockerfile
    # CI runs the same script: the test command sets up through it
    assert "bash scripts/setup.sh" in (REPO / "scripts" / "test.sh").read_text()
    assert "install_horovod.sh" in (REPO / "scripts" / "setup.sh").read_text()
