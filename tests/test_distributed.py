"""Distributed data-parallel training with the real launchers (torchrun, horovodrun) on CPU/gloo."""
import json
import os
import re
import shutil
import signal
import subprocess
import time

import pytest
import torch

from helpers import REPO, child_env, launch, launch_command, read_metrics, run_train
from data.embedded import ensure_embedded
from models import build_model

pytestmark = pytest.mark.multiprocess

SYNTHETIC = ["--loader", "synthetic", "--arch", "resnet18", "--image-size", 32, "--synthetic-images", 160,
             "--synthetic-val-images", 24, "--synthetic-classes", 10, "--log-every", 1, "--eval-every", 0]


def weights(run_dir):
    return torch.load(run_dir / "checkpoint.pt", weights_only=False)["model"]


def initial_weights():
    """The model every run below starts from (seed 0, resnet18, 10 classes), as the trainer builds it."""
    torch.manual_seed(0)
    return build_model("resnet18", 10, zero_init_residual=True, channels_last=True).state_dict()


def worst_relative_change_gap(a: dict, b: dict) -> float:
    """Largest per-tensor ||a - b|| / ||b - start||: how far two runs ended apart, measured against how
    far training moved each tensor (an absolute bound would pass runs that barely moved)."""
    start = initial_weights()
    gaps = [((a[k].double() - b[k].double()).norm() / (b[k].double() - start[k].double()).norm().clamp_min(1e-12)).item()
            for k in b if b[k].is_floating_point() and not torch.equal(b[k], start[k])]
    assert len(gaps) > 50  # most tensors moved
    return max(gaps)


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
    assert worst_relative_change_gap(weights(tmp_path / "run"), single_process_reference) <= 1e-3
    assert len(re.findall(r"train +1/16  step +\d/10 ", result.stdout)) == 5  # a progress line a step, rank 0's alone
    assert '"key": "model_bn_span", "value": 16' in (tmp_path / "run" / "mllog.txt").read_text()
    assert '"key": "global_batch_size", "value": 16' in (tmp_path / "run" / "mllog.txt").read_text()


@pytest.fixture(scope="module")
def two_processes_with_doubled_batch(tmp_path_factory):
    """2 ranks x 16 images, BN over each rank's own 16: the reference for 4 ranks x 8 in BN groups of 2."""
    cwd = tmp_path_factory.mktemp("two")
    result = launch("torch", 2, "-m", "train", "--out-dir", "run", *SYNTHETIC, "--global-batch-size", 32,
                    "--max-steps", 5, cwd=cwd)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return weights(cwd / "run")


FOUR_RANKS = ["-m", "train", "--out-dir", "run", *SYNTHETIC, "--global-batch-size", 32, "--max-steps", 5,
              "--bn-span", 2, "--ranks-per-node", 2]


@pytest.fixture(scope="module", params=["torch", "horovod"])
def four_ranks_flat(request, tmp_path_factory):
    cwd = tmp_path_factory.mktemp(f"four-{request.param}")
    result = launch(request.param, 4, *FOUR_RANKS, "--engine", request.param, cwd=cwd)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return request.param, weights(cwd / "run")


def test_four_ranks_in_two_bn_groups_match_two_processes_with_the_doubled_batch(four_ranks_flat,
                                                                                 two_processes_with_doubled_batch):
    _, four = four_ranks_flat
    assert worst_relative_change_gap(four, two_processes_with_doubled_batch) <= 1e-3


def test_hierarchical_training_ends_where_flat_training_does(four_ranks_flat, tmp_path):
    engine, flat = four_ranks_flat
    result = launch(engine, 4, *FOUR_RANKS, "--allreduce", "hierarchical", "--engine", engine, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    hierarchical = weights(tmp_path / "run")
    keys = [k for k in flat if flat[k].is_floating_point()]
    a, b = (torch.cat([w[k].double().reshape(-1) for k in keys]) for w in (hierarchical, flat))
    assert 0 < (a - b).norm() / b.norm() <= 1e-6  # only the order of the sums differs


@pytest.mark.parametrize("engine", ["torch", "horovod"])
def test_hierarchical_allreduce_equals_flat_on_2_nodes_of_2(engine, tmp_path):
    out = tmp_path / "result.json"
    result = launch(engine, 4, str(REPO / "tests" / "helpers" / "allreduce_check.py"), engine, out, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["worst_relative_difference"] <= 1e-6
    assert figures["local_gap"] > 1e-3  # the averaged gradient really differs from a rank's own


@pytest.fixture(scope="module")
def small_tree(tmp_path_factory):
    """50 training and 29 validation images: a validation size that neither 2 nor 3 ranks divide."""
    tree = tmp_path_factory.mktemp("tree") / "data"
    shutil.copytree(ensure_embedded(seed=5, train_per_class=5, val_per_class=3), tree)
    next(iter(sorted((tree / "val").glob("*/*")))).unlink()
    return tree


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
    evaluated = sorted(i for rank in report["ranks"] for i in rank["val_indices"])
    assert evaluated == list(range(29)) and report["val_images"] == 29  # each validation image once, none padded
    assert sum(rank["val"] for rank in report["ranks"]) == 29  # and the batches the loader yields hold them all


def test_three_ranks_evaluate_every_validation_image_once(small_tree, tmp_path):
    result = launch("torch", 3, "-m", "train", "--data-dir", small_tree, "--out-dir", "run", "--arch", "resnet18",
                    "--image-size", 32, "--batch-size", 8, "--max-steps", 2, "--workers", 0, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    evals = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "eval"]
    assert evals[-1]["eval_images"] == 29
    assert '"key": "global_batch_size", "value": 24' in (tmp_path / "run" / "mllog.txt").read_text()


def test_reported_top1_is_the_saved_models(small_tree, tmp_path):
    """Two ranks with their own BatchNorm statistics (--bn-span 1, 2 images each: statistics far apart):
    the top-1 the run reports is the top-1 of the checkpoint it saved, evaluated alone in one process
    with --test-only."""
    result = launch("torch", 2, "-m", "train", "--data-dir", small_tree, "--out-dir", "run", "--arch", "resnet18",
                    "--image-size", 32, "--batch-size", 2, "--max-steps", 3, "--workers", 0, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    reported = re.findall(r"eval .*(top-1 \S+  top-5 \S+  \(\d+ images)", result.stdout)[-1]  # as the log prints it
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "run").iterdir()}
    alone = run_train("--test-only", "--out-dir", "run", "--workers", 0, cwd=tmp_path)
    assert alone.returncode == 0, alone.stderr
    assert alone.stdout.strip() == reported + ")" and reported.endswith("(29 images")
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "run").iterdir()} == before  # nothing changed


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
                           env=child_env(DEAD_RANK_TOKEN=token))
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
    # 64 steps over 2 epochs of synthetic images (bit-exact resume with the JPEG loader's own state is
    # tests/test_resume.py's): what is tested here is the signal, the marker and the restart by itself
    args = ["--out-dir", "run", "--loader", "synthetic", "--arch", "resnet18", "--image-size", 32, "--synthetic-images",
            512, "--synthetic-val-images", 16, "--synthetic-classes", 10, "--global-batch-size", 16, "--epochs", 2,
            "--log-every", 1]
    whole = run_train(*[a if a != "run" else "whole" for a in args], cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr
    job = subprocess.Popen(launch_command("none", 1, "-m", "train", *args), cwd=tmp_path, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=child_env())
    metrics = tmp_path / "run" / "metrics.jsonl"
    while job.poll() is None and not (metrics.exists() and metrics.read_text().count('"kind": "train"') >= 5):
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)
    _, stderr = job.communicate(timeout=120)
    assert job.returncode == 75, stderr
    assert "preempted at step" in stderr and (tmp_path / "run" / "PREEMPTED").exists()
    stopped_at = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["step"]
    assert 5 <= stopped_at < 64
    again = run_train(*args, cwd=tmp_path)  # the same command, no --resume
    assert again.returncode == 0, again.stderr
    assert "resuming" in again.stdout and not (tmp_path / "run" / "PREEMPTED").exists()
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "run")
    assert all(torch.equal(a[k], b[k]) for k in a)


# each engine with one of the two signals (the handler is the same for both engines)
@pytest.mark.parametrize("engine, signum", [("torch", signal.SIGTERM), ("horovod", signal.SIGUSR1)])
def test_two_ranks_preempted_by_a_signal_to_one_rank_checkpoint_and_resume(engine, signum, tmp_path):
    """The signal reaches rank 1 only: the ranks agree at the next check (the default, every 10 steps),
    rank 0 writes the checkpoint and the marker, every rank stops, and the same command continues."""
    token = f"{engine}-{signum}-{os.getpid()}-{time.time()}"
    args = ["-m", "train", "--out-dir", "run", *SYNTHETIC, "--global-batch-size", 16, "--epochs", 100,
            "--max-steps", 40, "--engine", engine]
    job = subprocess.Popen(launch_command(engine, 2, *args), cwd=tmp_path, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env=child_env(DEAD_RANK_TOKEN=token))
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.time() + 120
        while time.time() < deadline and not (metrics.exists() and metrics.read_text().count('"kind": "train"') >= 3):
            time.sleep(0.2)
        victims = _worker_pids(token, 1)
        assert victims, "rank 1 not found"
        for pid in victims:
            os.kill(pid, signum)
        output, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0, output[-3000:]  # each worker exits 75; the launcher reports its own code
    assert output.count("preempted at step") == 1, output[-3000:]  # printed once, by rank 0
    stopped_at = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["step"]
    assert stopped_at % 10 == 0 and 0 < stopped_at < 40 and (tmp_path / "run" / "PREEMPTED").exists()
    again = launch(engine, 2, *args, cwd=tmp_path)  # the same command
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"resuming run at step {stopped_at}" in again.stdout and not (tmp_path / "run" / "PREEMPTED").exists()
    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["step"] == 40


def _start_and_wait(command, cwd, token, records=3, **popen):
    job = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=child_env(DEAD_RANK_TOKEN=token), **popen)
    metrics, deadline = cwd / "run" / "metrics.jsonl", time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count('"kind": "train"') >= records):
        time.sleep(0.2)
    return job


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_torchrun_itself_checkpoints_once_and_torchrun_reports_1(signum, tmp_path):
    """SIGTERM to torchrun (a scheduler stopping the job), or SIGINT to its whole process group
    (Ctrl-C): torchrun forwards SIGTERM to its workers, they checkpoint and stop, the message comes
    once, and torchrun itself ends with its own code, 1 (as docs/run_directory.md says)."""
    token = f"torchrun-{signum}-{os.getpid()}-{time.time()}"
    args = ["-m", "train", "--out-dir", "run", *SYNTHETIC, "--global-batch-size", 16, "--epochs", 100, "--engine", "torch"]
    job = _start_and_wait(launch_command("torch", 2, *args), tmp_path, token, start_new_session=True)
    try:
        if signum == signal.SIGINT:
            os.killpg(job.pid, signal.SIGINT)
        else:
            job.send_signal(signal.SIGTERM)
        output, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 1, output[-3000:]
    assert output.count("preempted at step") == 1, output[-3000:]
    assert "terminate called" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    assert (tmp_path / "run" / "PREEMPTED").exists() and (tmp_path / "run" / "checkpoint.pt").exists()


def test_ctrl_c_on_one_process_checkpoints_and_exits_75(tmp_path):
    job = _start_and_wait(launch_command("none", 1, "-m", "train", "--out-dir", "run", *SYNTHETIC,
                                         "--global-batch-size", 16, "--epochs", 100), tmp_path, "single")
    job.send_signal(signal.SIGINT)
    output, _ = job.communicate(timeout=120)
    assert job.returncode == 75, output[-3000:]
    assert "Traceback" not in output and output.count("preempted at step") == 1, output[-3000:]
    assert (tmp_path / "run" / "PREEMPTED").exists()


def test_two_ranks_tolerate_as_many_non_finite_steps_as_one_process(tmp_path):
    args = [*SYNTHETIC, "--global-batch-size", 16, "--lr", 1e30, "--max-bad-steps", 4, "--epochs", 3]
    one = run_train("--out-dir", "one", *args, cwd=tmp_path)
    two = launch("torch", 2, "-m", "train", "--out-dir", "two", *args, "--bn-span", 2, "--engine", "torch", cwd=tmp_path)
    assert one.returncode == 3 and two.returncode != 0, two.stderr[-3000:]
    assert "loss was not finite for 4 consecutive steps" in one.stderr + two.stderr
    logged = [sum(m["kind"] == "train" for m in read_metrics(tmp_path / run)) for run in ("one", "two")]
    assert logged[0] == logged[1] >= 4  # the limit counts steps, not steps times ranks


@pytest.mark.parametrize("engine", ["torch", "horovod"])
def test_fp16_wire_and_loss_scaling_on_two_ranks(engine, tmp_path):
    """fp16 on the wire against the exact mean gradient, per element; an overflow on one rank makes
    every rank skip the step (Horovod: all-reduce, synchronise, unscale, check, step; DDP: all-reduce
    in backward), and the ranks stay equal afterwards."""
    result = launch(engine, 2, REPO / "tests" / "helpers" / "fp16_check.py", engine, tmp_path, cwd=tmp_path,
                    env={"TRAINER_ALLOW_CPU_FP16": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        assert rank["fp32_worst"] <= 1e-6  # fp32 on the wire: the exact mean up to fp32 rounding
        assert rank["fp16_differs_from_fp32"] and rank["fp16_excess_over_bound"] <= 0
        for way in ("", "two_level_"):
            assert rank[f"{way}skipped_overflow_step"], (way, rank["rank"])
            assert rank[f"{way}scale_after_overflow"] == rank[f"{way}scale_before"] / 2
            assert rank[f"{way}moved"] and rank[f"{way}finite"]
    assert ranks[0]["weights"] == ranks[1]["weights"]
    assert ranks[0]["two_level_weights"] == ranks[1]["two_level_weights"]
