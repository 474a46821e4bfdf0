"""A lost rank costs minutes, never the run, under the real torchrun: a worker killed with SIGKILL is
restarted by torchrun (--max-restarts) and the run continues from its step checkpoint, ending bit for
bit where an uninterrupted run ends; an agent lost for good (3 -> 2 ranks, c10d rendezvous) leaves a
run that finishes on the survivors with the same global batch, each image of the epoch trained once; a
run started again on half its ranks keeps its per-rank batch, accumulating two batches per step, and its
trajectory."""
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from helpers import child_env, free_port, kill_tree, read_metrics, start, torchrun_workers, wait_until

pytestmark = pytest.mark.multiprocess

# torchrun as docs/multinode.md says to run it with restarts: torch 2.14's agents share their rendezvous store with
# the workers and keep it across restarts, where a restarted gloo group reads the last attempt's addresses
# and never connects, unless the agents run with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (the trainer refuses
# --max-restarts without it: test_restarts_without_an_own_store_are_refused)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
OWN_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
TINY = ["--loader", "synthetic", "--arch", "resnet18", "--image-size", 16, "--synthetic-val-images", 12,
        "--synthetic-classes", 10, "--eval-every", 0, "--log-every", 4]


def mid_epoch_checkpoint(run_dir, steps_per_epoch: int):
    """The step of the checkpoint in run_dir, once one taken inside an epoch is on disk."""
    saved = run_dir / "checkpoint.pt"
    if not saved.exists():
        return None
    # (written by an atomic rename: never half a file; mapped, not read: polled while the ranks train)
    step = torch.load(saved, weights_only=True, mmap=True)["step"]
    return step if step % steps_per_epoch else None


def finish(proc: subprocess.Popen, log, timeout: float) -> str:
    """Waits for a launcher to end by itself; returns its output."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running after {timeout} s:\n{log.read_text()[-4000:]}") from None
    return log.read_text()


def assert_same_weights(a: dict, b: dict) -> None:
    """Model (parameters and buffers: BatchNorm's running statistics, its batch count) and optimizer
    momentum bit for bit."""
    assert a["step"] == b["step"]
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    for key, state in a["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"], b["optimizer"]["state"][key]["momentum_buffer"]), key


def test_a_worker_killed_mid_epoch_is_restarted_by_torchrun_and_ends_bit_identical(tmp_path):
    # 128 images at global batch 8 over 2 ranks: 16 steps per epoch, 32 in all; a checkpoint every 4 steps
    every = 4
    def command(out_dir):
        return [*TORCHRUN, "--standalone", "--nnodes", 1, "--nproc-per-node", 2, "--max-restarts", 1,
                "--monitor-interval", 0.1, "-m", "train", "--out-dir", out_dir, *TINY, "--synthetic-images", 128,
                "--global-batch-size", 8, "--epochs", 2, "--checkpoint-every-steps", every]

    procs = []
    try:
        whole = start(command("whole"), tmp_path, tmp_path / "whole.log", env=OWN_STORE)
        procs.append(whole)
        out = finish(whole, tmp_path / "whole.log", 120)
        assert whole.returncode == 0, out[-4000:]

        job = start(command("run"), tmp_path, tmp_path / "run.log", env=OWN_STORE)
        procs.append(job)
        killed_after = wait_until(lambda: mid_epoch_checkpoint(tmp_path / "run", 16), 120,
                                  "a step checkpoint inside an epoch", alive=[job])
        workers = torchrun_workers(job.pid)
        assert sorted(workers) == [0, 1], workers  # the agent's two workers, not the agent itself
        victim = workers[1]
        os.kill(victim, signal.SIGKILL)
        out = finish(job, tmp_path / "run.log", 150)
        assert job.returncode == 0, out[-4000:]
    finally:
        for proc in procs:
            kill_tree(proc)

    records = read_metrics(tmp_path / "run")
    resumes = [r for r in records if r["kind"] == "resume"]
    # one restart, by torchrun (this test started the job once), from a step checkpoint inside an epoch
    assert len(resumes) == 1, resumes
    resumed_at = resumes[0]["step"]
    assert resumed_at >= killed_after and resumed_at % every == 0 and resumed_at % 16, (resumed_at, killed_after)
    assert f"resuming run at step {resumed_at}" in out
    print(f"rank 1 killed after the checkpoint of step {killed_after}; torchrun's restart resumed at step {resumed_at}")
    a = torch.load(tmp_path / "whole" / "checkpoint.pt", weights_only=True)
    b = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert a["step"] == 32 and a["finished"] and b["finished"]
    assert_same_weights(a, b)


def each_position_once(count: int) -> dict:
    """An epoch's sample ledger when its positions 0 .. count-1 were each trained exactly once."""
    return {"count": count, "sum": sum(range(count)), "sum_sq": sum(p * p for p in range(count))}


def listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_an_agent_lost_for_good_leaves_two_ranks_that_finish_with_the_global_batch_and_each_image_once(tmp_path):
    # 288 images, 8 per rank on 3 ranks (global batch 24: 12 steps per epoch, 24 in all); after the loss,
    # the same command on 2 ranks: the run's global batch is kept, 12 per rank
    port, every, per_epoch = free_port(), 3, 288
    agent = [*TORCHRUN, "--nnodes", "2:3", "--nproc-per-node", 1, "--rdzv-backend", "c10d", "--rdzv-endpoint",
             f"localhost:{port}", "--rdzv-id", f"elastic-{port}", "--rdzv-conf", "last_call_timeout=8",
             "--max-restarts", 1, "--monitor-interval", 0.1,
             "-m", "train", "--out-dir", tmp_path / "run", *TINY, "--synthetic-images", per_epoch,
             "--batch-size", 8, "--epochs", 2, "--checkpoint-every-steps", every]
    logs = [tmp_path / f"agent{i}.log" for i in range(3)]
    agents = []
    try:
        # the first agent hosts the rendezvous store (and must outlive the run); the other two join it
        agents.append(start(agent, tmp_path, logs[0], env=OWN_STORE))
        wait_until(lambda: listening(port), 60, "the rendezvous store", alive=agents)
        agents += [start(agent, tmp_path, log, env=OWN_STORE) for log in logs[1:]]
        workers = wait_until(lambda: [torchrun_workers(a.pid) for a in agents] if all(
            torchrun_workers(a.pid) for a in agents) else None, 120, "a worker under each agent", alive=agents)
        killed_after = wait_until(lambda: mid_epoch_checkpoint(tmp_path / "run", 12), 120,
                                  "a step checkpoint inside an epoch", alive=agents)
        assert "3 rank(s) x batch 8 = global batch 24" in "".join(log.read_text() for log in logs)
        lost_rank = next(iter(workers[2]))
        kill_tree(agents[2])  # the agent and its worker: a node gone for good
        killed = time.time()
        outs = [finish(a, log, 120) for a, log in zip(agents[:2], logs[:2])]
        ended = time.time()
        assert [a.returncode for a in agents[:2]] == [0, 0], "\n".join(out[-3000:] for out in outs)
    finally:
        for proc in agents:
            kill_tree(proc)

    both = "".join(outs)
    # the global batch kept; 24 is no whole number of 2 ranks x the run's batch 8: the per-rank batch follows
    assert "2 rank(s) x batch 12 = global batch 24" in both and "accumulated" not in both
    records = read_metrics(tmp_path / "run")
    resumes = [r for r in records if r["kind"] == "resume"]
    resumed_at = resumes[0]["step"] if len(resumes) == 1 else None
    assert resumed_at and resumed_at >= killed_after and resumed_at % every == 0 and resumed_at % 12, resumes
    assert [r["ranks"] for r in records if r["kind"] == "replicas"] == [2]
    final = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert final["step"] == 24 and final["finished"]
    epochs = [r for r in records if r["kind"] == "epoch" and r["epoch"] in (1.0, 2.0)]
    assert [r["step"] for r in epochs] == [12, 24], epochs
    # each epoch's positions trained exactly once over the two segments (3 ranks, then 2)
    for record in epochs:
        assert record.get("samples") == each_position_once(per_epoch), record
    print(f"agent of rank {lost_rank} killed after the checkpoint of step {killed_after}; "
          f"resumed on 2 ranks at step {resumes[0]['step']}; the job ended {ended - killed:.0f} s after the kill")


def test_restarts_without_an_own_store_are_refused(tmp_path):
    """torchrun --max-restarts sharing its store with the workers: one line naming the fix, exit 2, before
    anything is made (a restart would otherwise fail to connect, or wait in the rendezvous)."""
    job = subprocess.run([*map(str, TORCHRUN), "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "-m",
                          "train", "--out-dir", "run", *map(str, TINY), "--synthetic-images", "64"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**child_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"})
    assert job.returncode != 0
    errors = [line for line in job.stderr.splitlines() if line.startswith("error:")]
    # (said once per attempt: torchrun restarts the workers it was told to restart, and they refuse again)
    assert errors and set(errors) == {"error: torchrun --max-restarts needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in "
                                      "torchrun's environment (with this torch its restarted workers cannot connect "
                                      "through the store it shares)"}
    assert "exitcode  : 2" in job.stderr
    assert not (tmp_path / "run").exists()
