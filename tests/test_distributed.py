"""Distributed data-parallel training with the real launchers (torchrun, horovodrun) on CPU/gloo."""
import json
import os
import signal
import subprocess
import time

import pytest
import torch

from conftest import REPO, launch, launch_command, read_metrics, run_train
from data.embedded import ensure_embedded

SYNTHETIC = ["--loader", "synthetic", "--arch", "resnet18", "--image-size", 32, "--synthetic-images", 160,
             "--synthetic-val-images", 24, "--synthetic-classes", 10, "--log-every", 1, "--eval-every", 0]


def weights(run_dir):
    return torch.load(run_dir / "checkpoint.pt", weights_only=False)["model"]


@pytest.fixture(scope="module")
def single_process_reference(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("reference")
    result = run_train("--out-dir", "run", *SYNTHETIC, "--global-batch-size", 16, "--max-steps", 5, cwd=cwd)
    assert result.returncode == 0, result.stderr
    return weights(cwd / "run")


@pytest.mark.parametrize("engine", ["torch", "horovod"])
def test_two_ranks_with_bn_span_2_match_one_process_with_the_global_batch(engine, single_process_reference, tmp_path):
    result = launch(engine, 2, "-m", "train", "--out-dir", "run", *SYNTHETIC, "--global-batch-size", 16,
                    "--max-steps", 5, "--bn-span", 2, "--engine", engine, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    distributed = weights(tmp_path / "run")
    worst = max((distributed[k].float() - single_process_reference[k].float()).abs().max().item()
                for k in single_process_reference)
    assert worst <= 1e-4
    assert '"key": "model_bn_span", "value": 16' in (tmp_path / "run" / "mllog.txt").read_text()
    assert '"key": "global_batch_size", "value": 16' in (tmp_path / "run" / "mllog.txt").read_text()


@pytest.mark.parametrize("engine", ["torch", "horovod"])
def test_hierarchical_allreduce_equals_flat_on_2_nodes_of_2(engine, tmp_path):
    out = tmp_path / "result.json"
    result = launch(engine, 4, str(REPO / "tests" / "helpers" / "allreduce_check.py"), engine, out, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["worst_relative_difference"] <= 1e-6
    assert figures["local_gap"] > 1e-3  # the averaged gradient really differs from a rank's own


@pytest.mark.parametrize("engine", ["torch", "horovod"])
def test_hierarchical_training_runs_end_to_end(engine, tmp_path):
    result = launch(engine, 4, "-m", "train", "--out-dir", "run", *SYNTHETIC, "--global-batch-size", 16,
                    "--max-steps", 2, "--allreduce", "hierarchical", "--ranks-per-node", 2, "--engine", engine, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert [m["step"] for m in read_metrics(tmp_path / "run") if m["kind"] == "train"] == [1, 2]


@pytest.fixture(scope="module")
def small_tree():
    return ensure_embedded(seed=5, train_per_class=5, val_per_class=3)  # 50 train, 30 val images


@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_sharding_reads_every_image_once_per_epoch(nproc, small_tree, tmp_path):
    out = tmp_path / "shards.json"
    result = launch("torch", nproc, str(REPO / "tests" / "helpers" / "sharding_check.py"), small_tree, out, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    global_batch = 4 * nproc
    for epoch in ("0", "1"):
        read = [i for rank in report["ranks"] for i in rank["train"][epoch]]
        assert len(read) == len(set(read)) == (50 // global_batch) * global_batch  # disjoint, one partial batch dropped
        assert 50 - len(read) < global_batch
    assert report["ranks"][0]["train"]["0"] != report["ranks"][0]["train"]["1"]  # reshuffled per epoch
    assert sum(rank["val"] for rank in report["ranks"]) == report["val_images"] == 30


def test_three_ranks_evaluate_every_validation_image_once(tmp_path):
    result = launch("torch", 3, "-m", "train", "--out-dir", "run", "--arch", "resnet18", "--batch-size", 8,
                    "--global-batch-size", 0, "--max-steps", 2, "--workers", 0, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    evals = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "eval"]
    assert evals[-1]["eval_images"] == 300
    assert '"key": "global_batch_size", "value": 24' in (tmp_path / "run" / "mllog.txt").read_text()


def _worker_pids(token: str, rank: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = open(f"/proc/{entry}/environ", "rb").read().split(b"\0")
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
        except OSError:
            continue
        if f"DEAD_RANK_TOKEN={token}".encode() in environ and b"train" in cmdline and (
                f"RANK={rank}".encode() in environ or f"HOROVOD_RANK={rank}".encode() in environ) and \
                b"torch.distributed.run" not in cmdline and b"horovodrun" not in cmdline:
            pids.append(int(entry))
    return pids


@pytest.mark.parametrize("engine", ["torch", "horovod"])
def test_a_killed_rank_ends_the_whole_job_quickly(engine, tmp_path):
    token = f"{engine}-{os.getpid()}-{time.time()}"
    command = launch_command(engine, 2, "-m", "train", "--out-dir", "run", *SYNTHETIC, "--global-batch-size", 16,
                             "--epochs", 1000, "--engine", engine)
    job = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env={**os.environ, "PYTHONPATH": str(REPO), "DEAD_RANK_TOKEN": token})
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not ((tmp_path / "run" / "metrics.jsonl").exists()
                                              and (tmp_path / "run" / "metrics.jsonl").stat().st_size > 0):
            time.sleep(0.5)
        victims = _worker_pids(token, 1)
        assert victims, "rank 1 not found"
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        killed_at = time.time()
        code = job.wait(timeout=90)
        assert code != 0 and time.time() - killed_at < 60
    finally:
        if job.poll() is None:
            job.kill()


def test_preempted_run_resumes_by_itself_and_matches_an_uninterrupted_one(tmp_path):
    args = ["--out-dir", "run", "--arch", "resnet18", "--epochs", 2, "--workers", 1, "--log-every", 1]
    whole = run_train(*[a if a != "run" else "whole" for a in args], cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr
    job = subprocess.Popen(launch_command("none", 1, "-m", "train", *args), cwd=tmp_path, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    metrics = tmp_path / "run" / "metrics.jsonl"
    while job.poll() is None and not (metrics.exists() and metrics.read_text().count('"kind": "train"') >= 5):
        time.sleep(0.2)
    job.send_signal(signal.SIGUSR1)
    _, stderr = job.communicate(timeout=120)
    assert job.returncode == 75, stderr
    assert "preempted at step" in stderr and (tmp_path / "run" / "PREEMPTED").exists()
    stopped_at = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["step"]
    assert 5 <= stopped_at < 30
    again = run_train(*args, cwd=tmp_path)  # the same command, no --resume
    assert again.returncode == 0, again.stderr
    assert "resuming" in again.stdout and not (tmp_path / "run" / "PREEMPTED").exists()
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "run")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_two_ranks_tolerate_as_many_non_finite_steps_as_one_process(tmp_path):
    args = [*SYNTHETIC, "--global-batch-size", 16, "--lr", 1e30, "--max-bad-steps", 4, "--epochs", 3]
    one = run_train("--out-dir", "one", *args, cwd=tmp_path)
    two = launch("torch", 2, "-m", "train", "--out-dir", "two", *args, "--bn-span", 2, "--engine", "torch", cwd=tmp_path)
    assert one.returncode == 3 and two.returncode != 0, two.stderr[-3000:]
    assert "loss was not finite for 4 consecutive steps" in one.stderr + two.stderr
    logged = [sum(m["kind"] == "train" for m in read_metrics(tmp_path / run)) for run in ("one", "two")]
    assert logged[0] == logged[1] >= 4  # the limit counts steps, not steps times ranks


@pytest.mark.parametrize("engine", ["torch", "horovod"])
def test_fp16_gradient_allreduce_stays_close_to_fp32(engine, single_process_reference, tmp_path):
    result = launch(engine, 2, "-m", "train", "--out-dir", "run", *SYNTHETIC, "--global-batch-size", 16,
                    "--max-steps", 5, "--bn-span", 2, "--fp16-allreduce", "--engine", engine, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    compressed = weights(tmp_path / "run")
    worst = max((compressed[k].float() - single_process_reference[k].float()).abs().max().item()
                for k in single_process_reference)
    assert 0 < worst <= 1e-2  # fp16 rounding shows, but only as rounding
