"""A real Slurm on this machine (slurmctld + slurmd + munged, started here) runs the project's sbatch script."""
import os
import subprocess
import sys
import time

import pytest
import torch

from helpers import REPO, compliance, read_metrics

pytestmark = pytest.mark.multiprocess

SBATCH = REPO / "scripts" / "slurm" / "train.sbatch"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    state = tmp_path_factory.mktemp("slurm")
    # started from a shell set for CPU runs (OMP_NUM_THREADS=1): the node must still get every processor
    started = subprocess.run(["bash", str(REPO / "scripts" / "slurm" / "local_cluster.sh"), "start", str(state)],
                             capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert started.returncode == 0, started.stdout + started.stderr
    env = {**os.environ, "SLURM_CONF": str(state / "slurm.conf"), "PYTHON": sys.executable, "PYTHONPATH": str(REPO)}
    yield env
    subprocess.run(["bash", str(REPO / "scripts" / "slurm" / "local_cluster.sh"), "stop", str(state)], timeout=60)


def job_state(env, job_id: str) -> dict:
    shown = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True).stdout
    return dict(field.split("=", 1) for field in shown.split() if "=" in field)


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")


def wait_for_requeued_end(env, job_id: str, deadline: float, second_attempt_began=lambda: True) -> dict:
    """The job's state once its second attempt (Restarts=1) has ended, or at the deadline. The first
    attempt ends killed by its own requeue (briefly FAILED): `second_attempt_began` tells that apart
    where Restarts alone does not yet."""
    released = False
    while time.time() < deadline:
        state = job_state(env, job_id)
        if state.get("Restarts") == "1" and state.get("JobState") in ENDED and second_attempt_began():
            break
        if state.get("JobState") == "PENDING" and state.get("Restarts") == "1" and not released:
            # Slurm holds a requeued job back for about two minutes; let it start sooner, but not within
            # the second its old credential was revoked in (slurmd would refuse the new one)
            time.sleep(3)
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=env, timeout=60)
            released = True
        time.sleep(0.5)
    return state


def test_the_node_has_the_machines_processors_and_a_job_it_can_never_hold_is_refused_at_once(slurm, tmp_path):
    cpus = len(os.sched_getaffinity(0))  # what local_cluster.sh counts: the processors it may run on
    shown = subprocess.run(["sinfo", "-h", "-o", "%c"], env=slurm, capture_output=True, text=True, timeout=60)
    assert shown.stdout.split() == [str(cpus)], shown.stdout + shown.stderr
    try:
        refused = subprocess.run(["sbatch", "-N", "1", "-n", str(cpus + 1), "--wait", "--chdir", str(tmp_path),
                                  "--wrap", "true"], env=slurm, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pending = subprocess.run(["squeue", "-h", "-o", "job %i %T, reason %r"], env=slurm, capture_output=True,
                                 text=True, timeout=60).stdout
        subprocess.run(["scancel", "--state", "PENDING"], env=slurm, timeout=60)
        pytest.fail(f"an impossible job was left pending (sbatch --wait still waiting after 30 s): {pending.strip()}")
    assert refused.returncode == 1
    assert refused.stderr == "sbatch: error: Batch job submission failed: More processors requested than permitted\n"


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
    state = wait_for_requeued_end(env, job_id, deadline, lambda: "(restart 1)" in "".join(
        p.read_text() for p in tmp_path.glob("slurm-*.out")))
    log = "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert state.get("JobState") == "COMPLETED" and state.get("Restarts") == "1", (state, log)
    assert "requeueing" in log and "resuming" in log and "(restart 1)" in log
    steps = [m["step"] for m in read_metrics(tmp_path / "run") if m["kind"] == "train"]
    assert steps[-1] == 30 and len(steps) == len(set(steps)) == 30  # every step once, across the two attempts


def test_a_requeued_job_continues_from_its_step_checkpoint_and_finishes(slurm, tmp_path):
    """`scontrol requeue` of a running 2-task job (what a node failure with --requeue does): Slurm ends
    the tasks; the job starts again under the same id and the same command continues the run from its
    latest checkpoint (restart is resume), to the run's last step."""
    run_dir = tmp_path / "run"
    # 256 images at global batch 8: 32 steps per epoch, 64 in all; a checkpoint every 4 steps
    env = {**slurm, "OUT_DIR": str(run_dir),
           "EXTRA_ARGS": "--loader synthetic --arch resnet18 --image-size 16 --synthetic-images 256 "
                         "--synthetic-val-images 12 --synthetic-classes 10 --global-batch-size 8 --epochs 2 "
                         "--eval-every 0 --log-every 1 --workers 0 --checkpoint-every-steps 4"}
    submitted = subprocess.run(["sbatch", "--parsable", "-N", "1", "-n", "2", "--chdir", str(tmp_path), str(SBATCH)],
                               env=env, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    try:
        saved = run_dir / "checkpoint.pt"
        deadline = time.time() + 300
        while time.time() < deadline and not saved.exists() and job_state(env, job_id).get("JobState") in (
                "PENDING", "CONFIGURING", "RUNNING", None):
            time.sleep(0.1)
        first = torch.load(saved, weights_only=True)
        assert 0 < first["step"] < 32 and not first["finished"], first["step"]  # mid-epoch, the run going on
        requeued = subprocess.run(["scontrol", "requeue", job_id], env=env, capture_output=True, text=True, timeout=60)
        assert requeued.returncode == 0, requeued.stderr
        state = wait_for_requeued_end(env, job_id, deadline)
    finally:
        if job_state(env, job_id).get("JobState") not in ENDED:
            subprocess.run(["scancel", job_id], env=env, timeout=60)
    log = "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert state.get("JobState") == "COMPLETED" and state.get("Restarts") == "1", (state, log[-4000:])
    assert "(restart 1)" in log
    records = read_metrics(run_dir)
    resumes = [r for r in records if r["kind"] == "resume"]
    assert len(resumes) == 1 and first["step"] <= resumes[0]["step"] < 64, (resumes, first["step"])
    assert f"resuming {run_dir} at step {resumes[0]['step']}" in log
    steps = [r["step"] for r in records if r["kind"] == "train"]
    assert set(steps) == set(range(1, 65)) and steps[-1] == 64  # every step trained, to the run's last
    final = torch.load(saved, weights_only=True)
    assert final["step"] == 64 and final["finished"]
