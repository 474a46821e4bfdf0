"""Horovod Elastic with the real horovodrun: three workers, each on a host alias of this machine (Horovod
takes a failed worker's whole host out of the job), a discovery script that reads a hosts file. A killed
worker costs the steps since the last commit; a worker that joins gets the state; too few workers end
the job instead of hanging. And in one process (the quick tier's): the elastic path trains as the plain
one does."""
import json
import os
import signal
import socket
import subprocess

import psutil
import pytest
import torch

from helpers import BIN, descendants, kill_tree, process_env, read_metrics, run_train, start, wait_until
from train import checkpoint, runlock

# 72 images at global batch 12: 6 steps per epoch, 3 epochs; a commit every 2 steps
RUN = ["-m", "train", "--out-dir", "run", "--loader", "synthetic", "--arch", "resnet18", "--image-size", 16,
       "--synthetic-images", 72, "--synthetic-val-images", 12, "--synthetic-classes", 10, "--global-batch-size", 12,
       "--epochs", 3, "--eval-every", 0, "--log-every", 1, "--commit-every", 2]


def host_aliases() -> list[str]:
    """Names that all mean this machine to Horovod (it runs a worker locally, without ssh, when the name
    resolves to one of this machine's addresses): localhost, 127.0.0.1, the host name, then the
    machine's other IPv4 addresses."""
    names = ["localhost", "127.0.0.1", socket.gethostname()]
    for addresses in psutil.net_if_addrs().values():
        names += [a.address for a in addresses if a.family == socket.AF_INET and a.address not in names]
    return names


def write_hosts(tmp_path, hosts: list[str]) -> None:
    """The hosts file the discovery script prints, replaced whole (the script, run every second, never
    reads it half-written: an empty answer would take every host out of the job)."""
    (tmp_path / "hosts.new").write_text("".join(f"{host}:1\n" for host in hosts))
    os.replace(tmp_path / "hosts.new", tmp_path / "hosts")


def elastic_job(tmp_path, hosts: list[str], *extra, min_np=2, elastic_timeout=30):
    """horovodrun under elastic: the hosts file and discovery script, and the job in the background."""
    write_hosts(tmp_path, hosts)
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {tmp_path / 'hosts'}\n")
    script.chmod(0o755)
    command = [BIN / "horovodrun", "-np", len(hosts), "--min-np", min_np, "--max-np", 3, "--host-discovery-script",
               script, "--elastic-timeout", elastic_timeout, BIN / "python", *RUN, *extra]
    return start(command, tmp_path, tmp_path / "job.log", env={"OMP_NUM_THREADS": "1"})


def worker(job, variable: str, value: str) -> int:
    """The pid of the trainer that horovodrun started with `variable` = `value` in its environment
    (HOROVOD_HOSTNAME: its host; HOROVOD_RANK: the rank it started as), 0 while there is none."""
    for pid in descendants(job.pid):
        if process_env(pid).get(variable) == value and trainer(pid):
            return pid
    return 0


def trainer(pid: int) -> bool:
    """`python -m train ...` itself, not a process it started (its checkpoint writer runs train/...py)."""
    try:
        command = psutil.Process(pid).cmdline()
    except psutil.Error:
        return False
    return any(command[i:i + 2] == ["-m", "train"] for i in range(len(command)))


def ended(job, timeout: float, tmp_path) -> int:
    """The job's exit code; a job still running after `timeout` seconds fails the test with what it
    printed last and what is still alive."""
    try:
        return job.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        alive = [" ".join(psutil.Process(pid).cmdline())[:160] for pid in descendants(job.pid) if psutil.pid_exists(pid)]
        pytest.fail(f"the job still runs after {timeout} s; alive: {alive}\n" + (tmp_path / "job.log").read_text()[-4000:])


def trained_to(run_dir, step: int):
    path = run_dir / "metrics.jsonl"
    return path.exists() and any(r.get("kind") == "train" and r["step"] >= step for r in read_metrics(run_dir))


def lock_holder(run_dir) -> int | None:
    """The process number the run directory's lock names (None without a lock)."""
    try:
        return json.loads((run_dir / runlock.LOCK_NAME).read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


def each_position_once(count: int) -> dict:
    return {"count": count, "sum": count * (count - 1) // 2, "sum_sq": sum(p * p for p in range(count))}


@pytest.mark.multiprocess
@pytest.mark.alone
@pytest.mark.parametrize("killed", [1, 0])
def test_a_killed_worker_costs_the_steps_since_the_commit_and_the_run_finishes_with_two(killed, tmp_path):
    """Rank 1, or rank 0: then another worker becomes rank 0 and goes on with the logs and the
    checkpoints."""
    job = elastic_job(tmp_path, host_aliases()[:3], "--checkpoint-every-steps", 4)
    try:
        wait_until(lambda: trained_to(tmp_path / "run", 9), 240, "step 9", alive=[job])
        holder = lock_holder(tmp_path / "run")
        assert holder == worker(job, "HOROVOD_RANK", "0")  # the run directory's lock: rank 0's
        os.kill(wait_until(lambda: worker(job, "HOROVOD_RANK", str(killed)), 10, f"rank {killed}"), signal.SIGKILL)
        if killed == 0:  # the job keeps its lock: the new rank 0 takes it over
            new = wait_until(lambda: lock_holder(tmp_path / "run") not in (None, holder) and lock_holder(tmp_path / "run"),
                             120, "the lock taken over by the new rank 0", alive=[job])
            assert new in descendants(job.pid)
        assert job.wait(timeout=300) == 0, (tmp_path / "job.log").read_text()[-3000:]
    finally:
        kill_tree(job)
    assert not (tmp_path / "run" / runlock.LOCK_NAME).exists()  # released at the end by whoever is rank 0
    records = read_metrics(tmp_path / "run")
    change = next(r for r in records if r["kind"] == "workers")
    assert change["ranks"] == 2 and change["batch_size"] == 6 and change["step"] % 2 == 0 and change["step"] >= 8
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert [r["step"] for r in epochs][-3:] == [6, 12, 18]
    for record in epochs[-3:]:  # each image once per epoch, the rolled-back steps not counted twice
        assert record["samples"] == each_position_once(72), record
    assert records[-1]["kind"] == "replicas" and records[-1]["ranks"] == 2 and records[-1]["differing_from_rank0"] == 0
    saved = checkpoint.peek(tmp_path / "run" / "checkpoint.pt")  # the last checkpoint is the end's, by whoever is rank 0
    assert saved["step"] == 18 and saved["finished"] == "epochs"


@pytest.mark.multiprocess
@pytest.mark.alone
def test_a_lost_worker_leaves_the_per_rank_batch_as_it_was_and_the_survivor_accumulates_more(tmp_path):
    """2 workers x batch 3 x 2 accumulated = global batch 12; one killed: 1 worker x batch 3 x 4 (the
    count divides), the same global batch and the same split of it into batches."""
    job = elastic_job(tmp_path, host_aliases()[:2], "--batch-size", 3, min_np=1)
    try:
        wait_until(lambda: trained_to(tmp_path / "run", 5), 240, "step 5", alive=[job])
        os.kill(wait_until(lambda: worker(job, "HOROVOD_RANK", "1"), 10, "rank 1"), signal.SIGKILL)
        assert ended(job, 300, tmp_path) == 0, (tmp_path / "job.log").read_text()[-3000:]
    finally:
        kill_tree(job)
    log = (tmp_path / "job.log").read_text()
    assert "2 rank(s) x batch 3 x 2 accumulated = global batch 12" in log, log[-3000:]
    records = read_metrics(tmp_path / "run")
    change = next(r for r in records if r["kind"] == "workers")
    assert (change["ranks"], change["batch_size"], change["accumulation_steps"]) == (1, 3, 4), change
    assert "workers changed: 1 rank(s) x batch 3 x 4 accumulated" in log
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert [r["step"] for r in epochs][-3:] == [6, 12, 18]
    for record in epochs[-3:]:  # each image once per epoch over both shares
        assert record["samples"] == each_position_once(72), record


@pytest.mark.multiprocess
@pytest.mark.alone
def test_a_worker_that_joins_later_gets_the_state(tmp_path):
    aliases = host_aliases()
    if len(aliases) < 3:
        pytest.skip("this machine has fewer than three names for itself")
    job = elastic_job(tmp_path, aliases[:2])
    try:
        wait_until(lambda: trained_to(tmp_path / "run", 4), 240, "step 4", alive=[job])
        write_hosts(tmp_path, aliases[:3])
        assert job.wait(timeout=300) == 0, (tmp_path / "job.log").read_text()[-3000:]
    finally:
        kill_tree(job)
    records = read_metrics(tmp_path / "run")
    change = next(r for r in records if r["kind"] == "workers")
    assert change["ranks"] == 3 and change["batch_size"] == 4
    for record in [r for r in records if r["kind"] == "epoch"][-3:]:
        assert record["samples"] == each_position_once(72), record
    assert records[-1]["kind"] == "replicas" and records[-1]["ranks"] == 3 and records[-1]["differing_from_rank0"] == 0


@pytest.mark.multiprocess
@pytest.mark.alone
def test_fewer_workers_than_min_np_end_the_job_instead_of_hanging(tmp_path):
    hosts = host_aliases()[:3]
    job = elastic_job(tmp_path, hosts, "--checkpoint-every-steps", 2, min_np=3, elastic_timeout=10)
    try:
        wait_until(lambda: (tmp_path / "run" / "checkpoint.pt").exists(), 240, "a checkpoint", alive=[job])
        os.kill(wait_until(lambda: worker(job, "HOROVOD_HOSTNAME", hosts[2]), 10, "the third worker"), signal.SIGKILL)
        code = ended(job, 180, tmp_path)  # after --elastic-timeout (10 s) Horovod gives up waiting for a third host
    finally:
        kill_tree(job)
    assert code != 0 and "at least 3 Horovod processes" in (tmp_path / "job.log").read_text()
    saved = checkpoint.peek(tmp_path / "run" / "checkpoint.pt")  # what a new job continues from
    assert saved["step"] >= 2 and saved["step"] % 2 == 0


@pytest.mark.multiprocess
def test_every_worker_checks_the_run_directory_and_a_refusal_ends_the_job(tmp_path):
    """No collective agrees on start-up checks under Horovod Elastic (a joining worker must not issue
    one), so each worker reads the run directory itself: a folder holding another run's settings is
    refused by all three, and the job ends there. Were rank 0 alone to refuse, the other two would go
    on as a new job without it, into that folder."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("arch: resnet34\nglobal_batch_size: 12\n")
    job = elastic_job(tmp_path, host_aliases()[:3])
    try:
        code = job.wait(timeout=180)
    finally:
        kill_tree(job)
    log = (tmp_path / "job.log").read_text()
    assert code != 0 and log.count("holds a run with other settings (arch 'resnet34' there, 'resnet18' here)") == 3, log[-3000:]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.yaml"]


def test_one_elastic_process_trains_as_a_plain_horovod_process_does(tmp_path):
    """HOROVOD_ELASTIC=1 without horovodrun: the epochs run under hvd.elastic.run (train/elastic.py), with
    the state synced at the start and committed every 2 steps; the weights and the optimizer's state end
    bit for bit where the plain run's do, every image is counted once, and the commits leave nothing in
    the run directory."""
    args = [*RUN[4:], "--epochs", 1]  # without "-m train --out-dir run"; 6 steps, a commit every 2
    for name, env in (("plain", {}), ("elastic", {"HOROVOD_ELASTIC": "1"})):
        result = run_train("--out-dir", name, *args, "--engine", "horovod", cwd=tmp_path, env=env)
        assert result.returncode == 0, result.stderr
    plain, elastic = (torch.load(tmp_path / name / "checkpoint.pt", weights_only=False) for name in ("plain", "elastic"))
    assert elastic["step"] == plain["step"] == 6
    for key, tensor in plain["model"].items():
        assert torch.equal(elastic["model"][key], tensor), key
    for key, state in plain["optimizer"]["state"].items():
        assert all(torch.equal(elastic["optimizer"]["state"][key][k], v) for k, v in state.items() if torch.is_tensor(v))
    epochs = {name: [r["samples"] for r in read_metrics(tmp_path / name) if r["kind"] == "epoch"] for name in ("plain", "elastic")}
    assert epochs["elastic"] == epochs["plain"] == [each_position_once(72)]
    assert sorted(p.name for p in (tmp_path / "elastic").iterdir()) == sorted(p.name for p in (tmp_path / "plain").iterdir())


def test_a_restored_commit_stays_the_commit_while_training_goes_on():
    """After a failure every worker restores the last commit, and a second failure before the next
    commit restores it again: training on from the first restore (an optimizer updates the tensors it
    loaded in place, as on the CPU) must not change what the second one restores."""
    from types import SimpleNamespace

    from horovod import torch as hvd

    from train.elastic import TrainingState

    class Checkpoints:  # what TrainingState uses of the run's checkpoints (train/saving.py)
        def __init__(self):
            self.weights = {"w": torch.ones(3)}

        def state_dict(self, samples=None):
            return {"model": self.weights, "samples": (0, 0, 0) if samples is None else samples}

        def load_state_dict(self, state):
            self.weights = state["model"]

    checkpoints = Checkpoints()
    state = TrainingState(checkpoints, SimpleNamespace(hvd=hvd))
    checkpoints.weights["w"] += 5  # training went on after the commit
    state.restore()
    assert torch.equal(checkpoints.weights["w"], torch.ones(3))
    checkpoints.weights["w"] += 7  # in place, on the restored tensors
    state.restore()
    assert torch.equal(checkpoints.weights["w"], torch.ones(3))
