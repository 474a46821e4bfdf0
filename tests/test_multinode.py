"""The trainer across two nodes of the cluster on this machine (scripts/cluster.sh): every launcher
reaching the other node as on a real cluster, the nodes taken from the host names, the collectives on
the data network when TRAINER_IFACE names it, and a bad interface refused (docs/cluster.md)."""
import json
import os
import subprocess
import time

import pytest
import torch

from tests.helpers import REPO
from tests.helpers.cluster import PYTHON, cluster_up

pytestmark = [pytest.mark.cluster, pytest.mark.multiprocess]

TINY = ["--loader", "synthetic", "--arch", "resnet18", "--image-size", 16, "--synthetic-images", 256,
        "--synthetic-val-images", 16, "--synthetic-classes", 10, "--global-batch-size", 16, "--max-steps", 3,
        "--eval-every", 0, "--log-every", 1]
DATA = {"TRAINER_IFACE": "data0"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # up from a shell set for CPU runs (OMP_NUM_THREADS=1): the Slurm nodes must still get every processor
    with cluster_up(tmp_path_factory.mktemp("multinode"), 2, "--slurm", env={**os.environ, "OMP_NUM_THREADS": "1"}) as made:
        yield made


def records(run_dir, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == kind]


def final_weights(run_dir) -> torch.Tensor:
    saved = torch.load(run_dir / "checkpoint.pt", weights_only=False)["model"]
    return torch.cat([t.double().reshape(-1) for t in saved.values() if t.is_floating_point()])


def torchrun(cluster, tmp_path, *args, env=None, timeout=300) -> tuple[list[int], list[str]]:
    """Agents on node1 and node2 (2 workers each): (exit codes, logs)."""
    agents = cluster.torchrun(tmp_path, *args, env=env)
    codes = [agent.wait(timeout=timeout) for agent in agents]
    return codes, [(tmp_path / f"{node}.log").read_text() for node in ("node1", "node2")]


def data_bytes(cluster) -> dict:
    """node2's bytes through each interface (received + sent), as node2 counts them."""
    return {name: sum(pair) for name, pair in cluster.interface_bytes("node2").items()}


def check_topology(run_dir):
    topology = records(run_dir, "topology")
    assert len(topology) == 1
    assert topology[0]["nodes"] == 2 and topology[0]["ranks_per_node"] == 2
    assert topology[0]["hosts"] == ["node1", "node1", "node2", "node2"]
    assert records(run_dir, "replicas")[-1]["differing_from_rank0"] == 0


def check_on_data_network(before: dict, after: dict, steps: int):
    """The gradients of `steps` steps went over data0: ResNet-18's 11.2 M fp32 values are 45 MB, and
    a flat or two-level all-reduce moves at least that much in and out of a node of 2 ranks per step;
    the management network carried the launch only."""
    moved = {name: after[name] - before[name] for name in after}
    assert moved["data0"] > steps * 45e6, moved
    assert moved["mgmt0"] < moved["data0"] / 10, moved


@pytest.fixture(scope="module")
def horovod_flat(cluster):
    """horovodrun with gloo, flat all-reduce, the collectives on data0: the reference of the two-level runs."""
    run_dir = cluster.shared / "horovod-flat"
    before = data_bytes(cluster)
    done = cluster.horovodrun("--out-dir", run_dir, *TINY, env=DATA)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run_dir, done, before, data_bytes(cluster)


def test_horovodrun_with_gloo_reaches_the_other_node(horovod_flat):
    run_dir, done, before, after = horovod_flat
    assert "2 node(s) x 2 rank(s): 4 rank(s) x batch 4 = global batch 16" in done.stdout
    check_topology(run_dir)
    check_on_data_network(before, after, steps=3)


@pytest.mark.parametrize("allreduce", ["hierarchical", "torus"])
def test_two_level_all_reduces_take_the_nodes_from_the_host_names(cluster, horovod_flat, allreduce):
    run_dir = cluster.shared / f"horovod-{allreduce}"
    done = cluster.horovodrun("--out-dir", run_dir, *TINY, "--allreduce", allreduce, env=DATA)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    check_topology(run_dir)
    a, b = final_weights(run_dir), final_weights(horovod_flat[0])
    assert 0 < (a - b).norm() / b.norm() <= 1e-6  # only the order of the sums differs


def test_torchrun_meets_at_node1_and_trains_over_the_data_network(cluster, tmp_path):
    run_dir = cluster.shared / "torchrun"
    before = data_bytes(cluster)
    codes, logs = torchrun(cluster, tmp_path, "--out-dir", run_dir, *TINY, "--allreduce", "hierarchical", env=DATA)
    assert codes == [0, 0], logs
    after = data_bytes(cluster)
    assert "2 node(s) x 2 rank(s): 4 rank(s) x batch 4" in logs[0]
    check_topology(run_dir)
    check_on_data_network(before, after, steps=3)


def test_mpirun_starts_the_ranks_on_both_nodes(cluster):
    run_dir = cluster.shared / "mpirun"
    done = cluster.run("node1", "mpirun", "--allow-run-as-root", "-np", 4, "-H", "node1:2,node2:2",
                       "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS", "-x", "TRAINER_IFACE",
                       PYTHON, "-m", "train", "--engine", "horovod", "--out-dir", run_dir, *TINY, env=DATA, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    check_topology(run_dir)


SBATCH = REPO / "scripts" / "slurm" / "train.sbatch"


def slurm_conf(cluster) -> str:
    return cluster.exports.split("SLURM_CONF=")[1].split()[0]


def sbatch(cluster, folder, *args, env=None, timeout=300):
    """`sbatch -N 2 --ntasks-per-node 2 --wait train.sbatch` submitted on node1: (result, the job's log)."""
    folder.mkdir(parents=True, exist_ok=True)
    env = {"SLURM_CONF": slurm_conf(cluster), "PYTHON": PYTHON, "OUT_DIR": str(folder / "run"),
           "EXTRA_ARGS": " ".join(map(str, args)), **(env or {})}
    done = cluster.run("node1", "sbatch", "-N", 2, "--ntasks-per-node", 2, "--wait", SBATCH, cwd=folder, env=env,
                       timeout=timeout)
    return done, "".join(p.read_text() for p in folder.glob("slurm-*.out"))


def test_slurm_nodes_have_the_machines_processors_though_up_ran_with_omp_num_threads_1(cluster):
    cpus = len(os.sched_getaffinity(0))  # what the script counts: the processors it may run on
    shown = cluster.run("node1", "sinfo", "-h", "-N", "-o", "%N %c", env={"SLURM_CONF": slurm_conf(cluster)}, timeout=60)
    assert shown.stdout.splitlines() == [f"node1 {cpus}", f"node2 {cpus}"], shown.stdout + shown.stderr
    assert f"# Slurm: node[1-2], {cpus} CPU(s) each" in cluster.exports.splitlines()


def test_a_job_the_nodes_can_never_hold_is_refused_in_one_line_at_once(cluster):
    """One task a node more than a node's CPUs: sbatch --wait says why and ends, not pending for ever."""
    env = {"SLURM_CONF": slurm_conf(cluster)}
    too_many = len(os.sched_getaffinity(0)) + 1
    try:
        refused = cluster.run("node1", "sbatch", "-N", 2, "--ntasks-per-node", too_many, "--wait", "--wrap", "true",
                              env=env, timeout=30)
    except subprocess.TimeoutExpired:
        pending = cluster.run("node1", "squeue", "-h", "-o", "job %i %T, reason %r", env=env, timeout=60).stdout
        cluster.run("node1", "scancel", "--state", "PENDING", env=env, timeout=60)
        pytest.fail(f"an impossible job was left pending (sbatch --wait still waiting after 30 s): {pending.strip()}")
    assert refused.returncode == 1
    assert refused.stderr == "sbatch: error: Batch job submission failed: More processors requested than permitted\n"


def test_sbatch_runs_across_two_nodes(cluster):
    assert f"export SLURM_CONF={cluster.folder}/slurm/slurm.conf" in cluster.exports.splitlines()
    folder = cluster.shared / "sbatch"
    done, log = sbatch(cluster, folder, *TINY, env=DATA)
    assert done.returncode == 0, done.stdout + done.stderr + log
    assert "2 node(s), 4 task(s)" in log and "2 node(s) x 2 rank(s): 4 rank(s) x batch 4" in log
    check_topology(folder / "run")


@pytest.fixture
def only_on_node1(cluster):
    """An interface that node1 has and node2 lacks."""
    made = cluster.run("node1", "sh", "-c", "ip link add extra0 type veth peer name extra1 && "
                       "ip addr add 198.19.254.1/32 dev extra0 && ip link set extra0 up")
    assert made.returncode == 0, made.stderr
    yield "extra0"
    cluster.run("node1", "ip", "link", "del", "extra0")


REFUSED = "error: TRAINER_IFACE=extra0: node2 has no network interface extra0; it has lo, mgmt0, data0"
# * node2's two ranks refuse at once, each in one line; but the launcher ends a node's other ranks when
# the first exits, and on a busy machine the second may be ended before it has looked (seen under sbatch
# and torchrun): one line or two, never more


def test_an_interface_a_node_lacks_is_refused_under_horovodrun(cluster, only_on_node1):
    done = cluster.horovodrun("--out-dir", cluster.shared / "no-iface-hvd", *TINY, env={"TRAINER_IFACE": only_on_node1},
                      timeout=180)
    assert done.returncode != 0
    output = done.stdout + done.stderr
    assert output.count(REFUSED) in (1, 2), output[-3000:]  # one line from each of node2's ranks that got to check *
    assert not (cluster.shared / "no-iface-hvd").exists()


def test_an_interface_a_node_lacks_is_refused_under_torchrun(cluster, only_on_node1, tmp_path):
    """node2's ranks refuse; torchrun's agents do not stop each other, so the refusal goes through the
    rendezvous store to node1's ranks, which stop too: long before the start-up timeout (300 + 30 s)."""
    started = time.monotonic()
    codes, logs = torchrun(cluster, tmp_path, "--out-dir", cluster.shared / "no-iface-torch", *TINY,
                           env={"TRAINER_IFACE": only_on_node1}, timeout=300)
    took = time.monotonic() - started
    assert codes[1] != 0 and codes[0] != 0, logs
    assert took < 90, took
    assert logs[1].count(REFUSED) in (1, 2), logs[1][-3000:]  # *
    told = "not starting, another rank refused: TRAINER_IFACE=extra0: node2 has no network interface extra0"
    assert told in logs[0], logs[0][-3000:]  # (node1's agent stops its other rank when the first ends)
    assert not (cluster.shared / "no-iface-torch").exists()


def read_only_on_every_node(cluster, folder) -> None:
    """The data folder mounted read-only on each node (as a shared dataset often is)."""
    for node in ("node1", "node2"):
        done = cluster.run(node, "sh", "-c", f"mount --bind {folder} {folder} && mount -o remount,bind,ro {folder}")
        assert done.returncode == 0, done.stderr


def test_a_stale_index_in_one_nodes_cache_does_not_give_it_another_sample_list(cluster, tmp_path):
    """node2's cache holds an index of the read-only tree that passes the index's own check (the
    folders' times) but lacks an image, as when the tree was replaced by one whose folders carry the
    same times; node1's cache holds none. Both ranks must train on the folder's real list."""
    import os
    import shutil
    import numpy as np
    from data.embedded import ensure_embedded
    root = cluster.shared / "stale"
    shutil.copytree(ensure_embedded(train_per_class=3, val_per_class=2, root=tmp_path / "src"), root)
    when = time.time() - 3600
    folders = [root, *(p for p in root.rglob("*") if p.is_dir())]
    removed = sorted((root / "train").glob("*/*"))[0]
    kept = tmp_path / "kept"
    shutil.move(removed, kept)
    for folder in folders:
        os.utime(folder, (when, when))
    read_only_on_every_node(cluster, root)
    # node2 indexes the tree without that image: into its own cache (the tree is read-only)
    listed = cluster.run("node2", PYTHON, "-c", f"from data.index import load_samples; from data.tree import check_tree; "
                         f"print(len(load_samples(__import__('pathlib').Path('{root}/train'), check_tree('{root}'))))")
    assert listed.returncode == 0 and listed.stdout.strip() == "29", listed.stderr
    shutil.move(kept, removed)  # the image is back, and the folders' times are as the index recorded them
    for folder in folders:
        os.utime(folder, (when, when))
    caches = list((cluster.folder / "nodes" / "node2" / "cache").rglob("*-train.npz"))
    assert len(caches) == 1 and not list((cluster.folder / "nodes" / "node1" / "cache").rglob("*-train.npz"))

    run_dir = cluster.shared / "stale-run"
    agents = cluster.torchrun(tmp_path, "--out-dir", run_dir, "--data-dir", root, "--arch", "resnet18", "--image-size", 32,
                              "--workers", 0, "--global-batch-size", 8, "--max-steps", 2, "--eval-every", 0, per_node=1)
    codes = [agent.wait(timeout=300) for agent in agents]
    logs = (tmp_path / "node1.log").read_text()
    assert codes == [0, 0], logs[-3000:]
    assert "30 train / 20 val images" in logs
    assert "rank(s) 1 on node2 read another sample list" in logs
    with np.load(caches[0], allow_pickle=False) as index:  # node2's cache now lists the folder as it is
        assert len(index["labels"]) == 30


def test_an_interface_a_node_lacks_is_refused_under_mpirun_and_sbatch(cluster, only_on_node1):
    done = cluster.run("node1", "mpirun", "--allow-run-as-root", "-np", 4, "-H", "node1:2,node2:2", "-x", "PYTHONPATH",
                       "-x", "OMP_NUM_THREADS", "-x", "TRAINER_IFACE", PYTHON, "-m", "train", "--engine", "horovod",
                       "--out-dir", cluster.shared / "no-iface-mpi", *TINY, env={"TRAINER_IFACE": only_on_node1}, timeout=180)
    assert done.returncode == 2  # mpirun passes on the first failed rank's status
    assert (done.stdout + done.stderr).count(REFUSED) >= 1, (done.stdout + done.stderr)[-3000:]
    folder = cluster.shared / "no-iface-sbatch"
    done, log = sbatch(cluster, folder, *TINY, env={"TRAINER_IFACE": only_on_node1}, timeout=180)
    assert done.returncode != 0
    assert log.count(REFUSED) in (1, 2), log[-3000:]  # * (srun --kill-on-bad-exit ends node1's ranks)
    assert not (folder / "run").exists()
