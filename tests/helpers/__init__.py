"""Helpers the tests share: the real CLI and launchers run as a user would, the run's metrics, and the
real MLPerf compliance checker. The scripts beside this file run as child processes of the tests
(under real launchers), not as imports."""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_train(*args, cwd, timeout=600, env=None) -> subprocess.CompletedProcess:
    """`python -m train ARGS` in a fresh process, as a user would run it."""
    return subprocess.run([sys.executable, "-m", "train", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=child_env(**(env or {})))


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def compliance(mllog: Path, cwd: Path) -> subprocess.CompletedProcess:
    """The real mlperf_logging compliance checker, called as the scorer calls it (it writes
    compliance_checker.log into cwd)."""
    from train.score import run_checker
    return run_checker(Path(mllog).resolve(), cwd=cwd, log_output=None)


BIN = Path(sys.executable).parent


def child_env(**extra) -> dict:
    """This environment, with the checkout first on PYTHONPATH (what was there stays after it)."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def launch_command(launcher: str, nproc: int, *args) -> list[str]:
    """The real launcher's command line: torchrun ("torch"), horovodrun with gloo ("horovod") or MPI
    ("horovod-mpi"), Open MPI's mpirun ("mpirun"), or a plain process ("none")."""
    args = list(map(str, args))
    if launcher == "torch":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                "--master-port", str(29400 + os.getpid() % 500), *args]
    if launcher in ("horovod", "horovod-mpi"):
        return [str(BIN / "horovodrun"), "-np", str(nproc), "-H", f"localhost:{nproc}",
                "--gloo" if launcher == "horovod" else "--mpi", sys.executable, *args]
    if launcher == "mpirun":
        return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(nproc), sys.executable, *args]
    assert nproc == 1
    return [sys.executable, *args]


def launch(launcher: str, nproc: int, *args, cwd, timeout=600, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(launch_command(launcher, nproc, *args), cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=child_env(**(env or {})))
