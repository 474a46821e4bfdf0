"""A real Slurm on this machine (slurmctld + slurmd + munged, started here) runs the project's sbatch script."""
import os
import subprocess
import sys
import time

import pytest

from helpers import REPO, compliance, read_metrics

SBATCH = REPO / "scripts" / "slurm" / "train.sbatch"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    state = tmp_path_factory.mktemp("slurm")
    started = subprocess.run(["bash", str(REPO / "scripts" / "slurm" / "local_cluster.sh"), "start", str(state)],
                             capture_output=True, text=True, timeout=600)
    assert started.returncode == 0, started.stdout + started.stderr
    env = {**os.environ, "SLURM_CONF": str(state / "slurm.conf"), "PYTHON": sys.executable, "PYTHONPATH": str(REPO)}
    yield env
    subprocess.run(["bash", str(REPO / "scripts" / "slurm" / "local_cluster.sh"), "stop", str(state)], timeout=60)


def job_state(env, job_id: str) -> dict:
    shown = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True).stdout
    return dict(field.split("=", 1) for field in shown.split() if "=" in field)


def test_sbatch_two_tasks_on_the_embedded_dataset(slurm, tmp_path):
    env = {**slurm, "OUT_DIR": str(tmp_path / "run"), "EXTRA_ARGS": "--arch resnet18 --max-steps 3 --workers 0"}
    job = subprocess.run(["sbatch", "-N", "1", "-n", "2", "--wait", "--chdir", str(tmp_path), str(SBATCH)],
                         env=env, capture_output=True, text=True, timeout=600)
    log = "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert job.returncode == 0, job.stdout + job.stderr + log
    assert "2 task(s)" in log and "2 rank(s) x batch 32" in log
    run_dir = tmp_path / "run"
    assert {p.name for p in run_dir.iterdir()} >= {"mllog.txt", "metrics.jsonl", "checkpoint.pt", "config.yaml"}
    evals = [m for m in read_metrics(run_dir) if m["kind"] == "eval"]
    assert evals[-1]["eval_images"] == 300 and evals[-1]["step"] == 3
    checked = compliance(run_dir / "mllog.txt", tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_time_limit_warning_checkpoints_requeues_and_resumes(slurm, tmp_path):
    env = {**slurm, "OUT_DIR": str(tmp_path / "run"),
           "EXTRA_ARGS": "--arch resnet18 --epochs 2 --workers 0 --log-every 1 --stop-check-every 1"}
    submitted = subprocess.run(["sbatch", "--parsable", "-N", "1", "-n", "2", "--chdir", str(tmp_path), str(SBATCH)],
                               env=env, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count('"kind": "train"') >= 3):
        time.sleep(0.5)
    # what Slurm does before the time limit (--signal=B:USR1@120): USR1 to the batch shell
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], env=env, check=True, timeout=60)
    released = False
    while time.time() < deadline:
        state = job_state(env, job_id)
        second_attempt = "(restart 1)" in "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
        # the first attempt ends killed by its own requeue (briefly FAILED); wait for the second one's end
        if second_attempt and state.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
            break
        if state.get("JobState") == "PENDING" and state.get("Restarts") == "1" and not released:
            # Slurm holds a requeued job back for about two minutes; let it start sooner, but not within
            # the second its old credential was revoked in (slurmd would refuse the new one)
            time.sleep(3)
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=env, timeout=60)
            released = True
        time.sleep(0.5)
    log = "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert state.get("JobState") == "COMPLETED" and state.get("Restarts") == "1", (state, log)
    assert "requeueing" in log and "resuming" in log and "(restart 1)" in log
    steps = [m["step"] for m in read_metrics(tmp_path / "run") if m["kind"] == "train"]
    assert steps[-1] == 30 and len(steps) == len(set(steps)) == 30  # every step once, across the two attempts
