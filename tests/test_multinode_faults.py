"""Faults across the nodes of the cluster on this machine (docs/cluster.md): a node whose processes all
die mid-epoch ends the job, and the same command started again resumes bit-exactly; a data link
taken down ends every rank on every node within TRAINER_COLLECTIVE_TIMEOUT_S, each saying who stopped
answering, and the launchers with them. node1 hosts the rendezvous and the horovodrun driver and is
never the one lost."""
import time

import pytest
import torch

from tests.helpers.cluster import cluster_up
from train import checkpoint

pytestmark = [pytest.mark.cluster, pytest.mark.multiprocess]

# 256 images at global batch 16: 16 steps an epoch; a step checkpoint every 4
RUN = ["--loader", "synthetic", "--arch", "resnet18", "--image-size", 16, "--synthetic-images", 256,
       "--synthetic-val-images", 16, "--synthetic-classes", 10, "--global-batch-size", 16, "--max-steps", 12,
       "--eval-every", 0, "--log-every", 1, "--checkpoint-every-steps", 4]
DATA = {"TRAINER_IFACE": "data0"}
ENDS_WITHIN_S = 60  # a dead node's job ends this soon on node1 (measured: docs/cluster.md)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with cluster_up(tmp_path_factory.mktemp("faults"), 2) as made:
        yield made


def launched(cluster, launcher: str, folder, *args, per_node=2, env=None) -> list:
    """The job's launcher processes on this machine: horovodrun (on node1), or the torchrun agents."""
    if launcher == "horovod":
        hosts = f"node1:{per_node},node2:{per_node}"
        return [cluster.start("node1", *cluster.horovodrun_command(*args, hosts=hosts), log=folder / "node1.log", env=env)]
    return cluster.torchrun(folder, *args, per_node=per_node, env=env)


def wait_all(processes, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in processes]


def same_training(a, b) -> None:
    a, b = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert a["step"] == b["step"]
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key


def wait_for_step_checkpoint(saved, processes, timeout=240) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and all(p.poll() is None for p in processes):
        if saved.exists():
            return checkpoint.peek(saved)
        time.sleep(0.05)
    raise AssertionError("no step checkpoint was written")


@pytest.mark.parametrize("launcher", ["torch", "horovod"])
def test_a_dead_node_ends_the_job_and_the_same_command_resumes_bit_exactly(cluster, launcher, tmp_path):
    """One rank a node: a sum of two gradients is the same whichever comes first. (With more ranks the
    resumed run agrees to rounding only: DDP's first buckets after a resume sum them in another
    order; docs/cluster.md.)"""
    whole_dir, run_dir = cluster.shared / f"whole-{launcher}", cluster.shared / f"killed-{launcher}"
    whole = launched(cluster, launcher, tmp_path, "--out-dir", whole_dir, *RUN, per_node=1, env=DATA)
    assert wait_all(whole, 300) == [0] * len(whole)

    (tmp_path / "first").mkdir()
    job = launched(cluster, launcher, tmp_path / "first", "--out-dir", run_dir, *RUN, per_node=1, env=DATA)
    at = wait_for_step_checkpoint(run_dir / "checkpoint.pt", job)
    cluster.kill_node("node2")
    killed = time.monotonic()
    codes = wait_all(job[:1], ENDS_WITHIN_S)  # node1's launcher
    print(f"{launcher}: node1's launcher ended {time.monotonic() - killed:.1f} s after node2 died (step {at['step']})")
    assert codes[0] != 0

    (tmp_path / "again").mkdir()
    again = launched(cluster, launcher, tmp_path / "again", "--out-dir", run_dir, *RUN, per_node=1, env=DATA)
    assert wait_all(again, 300) == [0] * len(again)
    resumed = (tmp_path / "again" / "node1.log").read_text()
    step = checkpoint.peek(run_dir / "checkpoint.pt")
    assert step["step"] == 12
    assert f"resuming {run_dir} at step " in resumed
    same_training(whole_dir / "checkpoint.pt", run_dir / "checkpoint.pt")


TIMEOUT_S = 20
WIND_DOWN_S = 150


@pytest.mark.parametrize("launcher", ["torch", "horovod"])
def test_a_dead_data_link_ends_every_rank_within_the_timeout(cluster, launcher, tmp_path):
    run_dir = cluster.shared / f"cut-{launcher}"
    env = {**DATA, "TRAINER_COLLECTIVE_TIMEOUT_S": str(TIMEOUT_S)}
    job = launched(cluster, launcher, tmp_path, "--out-dir", run_dir, *RUN, "--max-steps", 2000, env=env)
    try:
        wait_for_step_checkpoint(run_dir / "checkpoint.pt", job)
        cluster.link("node2", "down")
        cut = time.monotonic()
        codes = wait_all(job, TIMEOUT_S + WIND_DOWN_S)
        ended = time.monotonic() - cut
    finally:
        cluster.link("node2", "up")
        for process in job:
            process.kill()
    print(f"{launcher}: every launcher ended {ended:.1f} s after the link went down")
    assert all(code != 0 for code in codes)
    logs = "".join(path.read_text() for path in tmp_path.glob("node*.log"))
    lines = [line for line in logs.splitlines() if "stopped answering" in line]
    # every rank says it, each from its own side (a launcher that ends every rank when one ends waits that long)
    for rank, node, other in [(0, "node1", "node2 (ranks 2, 3)"), (1, "node1", "node2 (ranks 2, 3)"),
                              (2, "node2", "node1 (ranks 0, 1)"), (3, "node2", "node1 (ranks 0, 1)")]:
        assert any(f"rank {rank} on {node}: {other} stopped answering" in line for line in lines), logs[-4000:]
    # nothing of the job left on either node within the bound: their sshd only
    deadline = time.monotonic() + TIMEOUT_S + WIND_DOWN_S - ended
    while len(cluster.processes()) > 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert len(cluster.processes()) == 2, [open(f"/proc/{pid}/cmdline").read() for pid in cluster.processes()]


def each_position_once(count: int) -> dict:
    """An epoch's sample ledger when its positions 0 .. count-1 were each trained exactly once."""
    return {"count": count, "sum": sum(range(count)), "sum_sq": sum(p * p for p in range(count))}


def records(run_dir, kind: str) -> list[dict]:
    import json
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"no {what} within {timeout} s")


def test_torchrun_loses_node2_for_good_finishes_on_node1_and_takes_it_back(cluster, tmp_path):
    """--nnodes 1:2: node2 dies for good mid-epoch; node1's agent restarts its worker alone from the last
    step checkpoint (the global batch kept); node2 comes back and joins at the next restart. Every
    image of every epoch is trained once across the segments."""
    from tests.helpers.cluster import PYTHON
    run_dir, per_epoch = cluster.shared / "elastic-torch", 256
    def agent(node):
        return cluster.start(node, PYTHON, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", 1,
                             "--rdzv-backend", "c10d", "--rdzv-endpoint", "node1:29400", "--rdzv-id", "elastic",
                             "--rdzv-conf", "last_call_timeout=5", "--max-restarts", 3, "--monitor-interval", 0.5,
                             "-m", "train", "--out-dir", run_dir, *RUN, "--synthetic-images", per_epoch,
                             "--global-batch-size", 8, "--max-steps", 0, "--epochs", 3, "--checkpoint-every-steps", 4,
                             log=tmp_path / f"{node}-{time.monotonic_ns()}.log",
                             env={**DATA, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    node1 = agent("node1")
    node2 = agent("node2")
    try:
        wait_for(lambda: records(run_dir, "topology") if (run_dir / "metrics.jsonl").exists() else None, 180,
                 "start on two nodes")
        at = wait_for_step_checkpoint(run_dir / "checkpoint.pt", [node1])
        cluster.kill_node("node2")
        wait_for(lambda: len(records(run_dir, "resume")) >= 1, 180, "resume on node1 alone")
        alone = records(run_dir, "topology")[-1]
        node2 = agent("node2")  # the node is back
        assert node1.wait(timeout=300) == 0
        assert node2.wait(timeout=60) == 0
    finally:
        for process in (node1, node2):
            process.kill()
    logs = "".join(path.read_text() for path in tmp_path.glob("node*.log"))
    assert alone["hosts"] == ["node1"], alone
    assert records(run_dir, "topology")[-1]["hosts"] == ["node1", "node2"]  # it joined again
    resumes = records(run_dir, "resume")
    assert len(resumes) == 2 and resumes[0]["step"] >= at["step"], resumes
    # (node1 alone keeps the per-rank batch of 4 and accumulates 2: 1 x 4 divides the global batch of 8)
    assert "1 rank(s) x batch 4 x 2 accumulated = global batch 8" in logs
    epochs = [r for r in records(run_dir, "epoch") if r["epoch"] in (1.0, 2.0, 3.0)]
    assert [r["step"] for r in epochs] == [32, 64, 96], epochs
    for record in epochs:
        assert record.get("samples") == each_position_once(per_epoch), record


@pytest.fixture(scope="module")
def three_nodes(tmp_path_factory):
    with cluster_up(tmp_path_factory.mktemp("three"), 3) as made:
        yield made


def test_horovod_elastic_on_three_nodes_loses_node3_goes_on_with_two_and_takes_it_back(three_nodes, tmp_path):
    """Every process of node3 killed: node1 and node2 roll back to the last commit and go on with the
    global batch over 2 ranks; after its cooldown node3 (still in the discovery list) joins again and
    gets the state. Every image of every epoch is trained once."""
    from tests.helpers.cluster import BIN, PYTHON
    cluster, run_dir, per_epoch = three_nodes, three_nodes.shared / "elastic-horovod", 144
    hosts = cluster.shared / "hosts"
    hosts.write_text("node1:1\nnode2:1\nnode3:1\n")
    discover = cluster.shared / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    job = cluster.start("node1", BIN / "horovodrun", "-np", 3, "--min-np", 2, "--max-np", 3, "--host-discovery-script",
                        discover, "--elastic-timeout", 60, "--blacklist-cooldown-range", 1, 2, "--disable-cache",
                        PYTHON, "-m", "train", "--out-dir", run_dir, "--loader", "synthetic", "--arch", "resnet18",
                        "--image-size", 32, "--synthetic-images", per_epoch, "--synthetic-val-images", 12,
                        "--synthetic-classes", 10, "--global-batch-size", 12, "--epochs", 6, "--eval-every", 0,
                        "--log-every", 1, "--commit-every", 2, log=tmp_path / "job.log", env=DATA)
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").exists() and records(run_dir, "train"), 240, "training on three")
        cluster.kill_node("node3")
        assert job.wait(timeout=400) == 0, (tmp_path / "job.log").read_text()[-4000:]
    finally:
        job.kill()
    changes = [r["ranks"] for r in records(run_dir, "workers")]
    assert changes[:2] == [2, 3], changes  # down to two, then node3 back
    epochs = [r for r in records(run_dir, "epoch") if r["epoch"] == int(r["epoch"])]
    assert [r["step"] for r in epochs] == [12 * e for e in range(1, 7)], epochs
    for record in epochs:  # the rolled-back steps not counted twice
        assert record["samples"] == each_position_once(per_epoch), record
    final = records(run_dir, "replicas")[-1]
    assert final["ranks"] == 3 and final["differing_from_rank0"] == 0
