"""One job per run directory: a second job on a run directory in use is refused (exit 2, one line naming
the holder's host and process) before it writes anything, whichever starts first; a dead holder's lock
(a killed process here, or a host that stopped refreshing it) never blocks the restart, and a job's own
restart (same Slurm job, same torchrun rendezvous id) takes it over."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from helpers import child_env, read_metrics, run_train
from train import checkpoint, runlock
from train.errors import UsageError

# 128 synthetic images at global batch 8: 16 steps an epoch, a few seconds on a CPU
RUN = ["--loader", "synthetic", "--arch", "resnet18", "--image-size", 16, "--synthetic-images", 128,
       "--synthetic-val-images", 16, "--synthetic-classes", 10, "--global-batch-size", 8, "--epochs", 2,
       "--eval-every", 0, "--log-every", 4]


@pytest.fixture(autouse=True)
def no_job(monkeypatch):
    """The tests say which launcher's job they are in; the suite's own environment says none."""
    for name in ("SLURM_JOB_ID", "SLURM_STEP_ID", "TORCHELASTIC_RUN_ID", "HOROVOD_GLOO_RENDEZVOUS_ADDR",
                 "HOROVOD_GLOO_RENDEZVOUS_PORT"):
        monkeypatch.delenv(name, raising=False)


def lock_of(folder, **fields):
    """A lock file as another job would have left it, its time set `age` seconds back."""
    age = fields.pop("age", 0)
    record = {"host": "node-elsewhere", "boot_id": "other-boot", "pid_ns": "pid:[1]", "pid": 4242, "started": "7",
              "job": None, "since": "2026-12-02 08:00:00 UTC", "token": "theirs", **fields}
    path = folder / runlock.LOCK_NAME
    path.write_text(json.dumps(record) + "\n")
    os.utime(path, (time.time() - age, time.time() - age))
    return path


def test_a_live_holder_on_this_host_is_refused_by_name_and_its_lock_released_at_the_end(tmp_path):
    held = runlock.RunLock.acquire(tmp_path)
    with pytest.raises(UsageError) as refused:
        runlock.RunLock.acquire(tmp_path)
    message = str(refused.value)
    assert f"process {os.getpid()} on {socket.gethostname()}" in message and "\n" not in message
    with pytest.raises(UsageError):
        runlock.check(tmp_path)
    held.release()
    assert not (tmp_path / runlock.LOCK_NAME).exists()
    runlock.RunLock.acquire(tmp_path).release()  # free again


@pytest.mark.parametrize("links", [True, False])
def test_a_lock_is_never_read_empty_while_it_is_taken(tmp_path, monkeypatch, links):
    """A reader that finds the lock file empty takes it for an unknown live job's (a Horovod Elastic
    worker checking the run directory while its rank 0 takes the lock would refuse its own job): the
    lock appears whole. Threads switched as often as the interpreter can; and, on a filesystem without
    hard links, it is still taken once and written."""
    if not links:
        monkeypatch.setattr(os, "link", lambda *_: (_ for _ in ()).throw(PermissionError(1, "no links here")))
    path, empty, done = tmp_path / runlock.LOCK_NAME, [], threading.Event()

    def read_while_taken():
        while not done.is_set():
            if runlock._read(path) == {}:
                empty.append(1)
    reader = threading.Thread(target=read_while_taken)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    reader.start()
    try:
        for _ in range(200):
            held = runlock.RunLock.acquire(tmp_path)
            with pytest.raises(UsageError):  # once, whole or not
                runlock.RunLock.acquire(tmp_path)
            held.release()
    finally:
        done.set()
        reader.join()
        sys.setswitchinterval(switch)
    assert not empty or not links, f"the lock was read empty {len(empty)} times in 200"
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing left aside


def test_a_dead_process_on_this_host_does_not_block(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = runlock._process_start(gone.pid)
    finally:
        gone.kill()
        gone.wait()
    here = runlock._this_machine()
    lock_of(tmp_path, **here, pid=gone.pid, started=started)
    runlock.check(tmp_path)  # no refusal, no wait
    lock = runlock.RunLock.acquire(tmp_path)
    assert json.loads((tmp_path / runlock.LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    # a live process whose number was reused is not the holder either: its start time differs
    lock_of(tmp_path, **here, pid=os.getpid(), started="1")
    runlock.check(tmp_path)


def test_another_hosts_lock_counts_by_its_refresh(tmp_path, monkeypatch):
    path = lock_of(tmp_path, age=runlock.STALE_S + 5)  # its host stopped answering
    runlock.check(tmp_path)
    runlock.RunLock.acquire(tmp_path).release()

    monkeypatch.setattr(runlock, "STALE_S", 3.0)
    path = lock_of(tmp_path)  # fresh, and refreshed while we watch: alive
    refresher = threading.Timer(1.0, lambda: os.utime(path))
    refresher.start()
    said = []
    with pytest.raises(UsageError, match="process 4242 on node-elsewhere"):
        runlock.check(tmp_path, say=said.append)
    refresher.join()
    assert said and "waiting up to" in said[0]
    lock_of(tmp_path, age=1)  # fresh but never refreshed again: stale once STALE_S has passed
    started = time.monotonic()
    runlock.RunLock.acquire(tmp_path, say=lambda line: None).release()
    assert time.monotonic() - started >= 1.5


def test_the_holder_refreshes_its_lock_and_a_new_rank_0_of_the_job_takes_it_over(tmp_path, monkeypatch):
    monkeypatch.setattr(runlock, "REFRESH_S", 0.2)
    first = runlock.RunLock.acquire(tmp_path)
    path = tmp_path / runlock.LOCK_NAME
    os.utime(path, (0, 0))
    time.sleep(1.0)
    assert path.stat().st_mtime > 0  # refreshed
    # another process of the same job (a Horovod Elastic worker that became rank 0): no refusal
    monkeypatch.setattr(runlock, "job_identity", lambda: "horovodrun 198.18.0.1:4000")
    lock_of(tmp_path, job="horovodrun 198.18.0.1:4000", **runlock._this_machine(), pid=os.getpid(),
            started=runlock._process_start(os.getpid()))
    with pytest.raises(UsageError):  # outside an elastic job: a live run of the same job (an allocation's shell) keeps it
        runlock.RunLock.acquire(tmp_path)
    second = runlock.RunLock.acquire(tmp_path, elastic=True)
    first.release()  # no longer its lock: left alone
    assert json.loads(path.read_text())["token"] == second.record["token"]
    second.release()
    assert not path.exists()


@pytest.mark.parametrize("env, job", [({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0"}, "slurm 77.0"),
                                      ({"TORCHELASTIC_RUN_ID": "job7"}, "torchrun job7"),
                                      ({"TORCHELASTIC_RUN_ID": "none"}, None)])
def test_a_requeued_or_restarted_job_takes_over_its_own_lock_at_once(tmp_path, monkeypatch, env, job):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert runlock.job_identity() == job
    monkeypatch.setattr(runlock, "STALE_S", 1.5)
    lock_of(tmp_path, job=job or "slurm 77.0")  # fresh, on another host
    said = []
    runlock.RunLock.acquire(tmp_path, say=said.append).release()
    assert bool(said) == (job is None)  # another job's lock is watched until stale; our own job's is not


@pytest.fixture
def jobs():
    """Trainer processes started by a test, killed at its end however it ends."""
    started = []
    yield started
    for job in started:
        if job.poll() is None:
            job.kill()
        job.communicate()


def _start(jobs, tmp_path, *args):
    job = subprocess.Popen([sys.executable, "-m", "train", *map(str, args)], cwd=tmp_path, env=child_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    jobs.append(job)
    return job


def _starts(mllog):
    return sum('"key": "run_start"' in line for line in mllog.read_text().splitlines())


@pytest.mark.multiprocess
def test_a_second_job_on_a_running_jobs_directory_is_refused_and_writes_nothing(tmp_path, jobs):
    command = ["--out-dir", "run", *RUN, "--epochs", 50, "--checkpoint-every-steps", 2]
    first = _start(jobs, tmp_path, *command)
    run_dir = tmp_path / "run"
    deadline = time.time() + 300
    while not (run_dir / "checkpoint.pt").exists() and time.time() < deadline and first.poll() is None:
        time.sleep(0.05)
    assert first.poll() is None, first.communicate()
    second = run_train(*command, cwd=tmp_path, timeout=240)  # the same command: today it would "resume" the running run
    lines = second.stderr.strip().splitlines()
    assert second.returncode == 2 and len(lines) == 1, second.stderr
    assert f"process {first.pid} on {socket.gethostname()}" in lines[0]
    assert "resuming" not in second.stdout and not list(run_dir.glob("*.lost"))
    assert _starts(run_dir / "mllog.txt") == 1 and not [m for m in read_metrics(run_dir) if m["kind"] == "resume"]

    first.send_signal(signal.SIGKILL)  # a killed job's lock never blocks its restart
    first.communicate()
    assert (run_dir / runlock.LOCK_NAME).exists()
    at = checkpoint.peek(run_dir / "checkpoint.pt")["step"]
    again = run_train(*command, "--max-steps", at + 2, cwd=tmp_path)
    assert again.returncode == 0 and "resuming run at step" in again.stdout, again.stderr
    assert not (run_dir / runlock.LOCK_NAME).exists()  # released at the end


@pytest.mark.multiprocess
def test_two_jobs_started_at_once_on_a_new_directory_one_runs_the_other_is_refused(tmp_path, jobs):
    command = ["--out-dir", "run", *RUN, "--epochs", 50]
    both = [_start(jobs, tmp_path, *command) for _ in range(2)]
    run_dir = tmp_path / "run"
    deadline = time.time() + 240
    while all(job.poll() is None for job in both) and time.time() < deadline:
        time.sleep(0.05)
    refused = next((job for job in both if job.poll() is not None), None)
    assert refused is not None, "both jobs train on one run directory"
    winner = next(job for job in both if job is not refused)
    winner.send_signal(signal.SIGTERM)  # the winner still runs: preempted, it checkpoints and exits 75
    _, err = refused.communicate()
    assert refused.returncode == 2 and winner.wait(timeout=300) == 75, (err, winner.communicate())
    assert f"process {winner.pid} on" in err and len(err.strip().splitlines()) == 1, err
    assert not list(run_dir.glob("*.lost")) and _starts(run_dir / "mllog.txt") == 1
    assert not (run_dir / runlock.LOCK_NAME).exists()  # a preempted job leaves it free for its restart
