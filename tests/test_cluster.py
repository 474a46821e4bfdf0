"""scripts/cluster.sh: nodes on this machine with their own host names, networks, disks and sshd, a
shared folder, links that break and shape, and nothing left behind by `down` (docs/cluster.md)."""
import subprocess
import time

import pytest

from tests.helpers import REPO
from tests.helpers.cluster import PYTHON, cluster_script, cluster_id, cluster_up, namespaces

pytestmark = [pytest.mark.cluster]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with cluster_up(tmp_path_factory.mktemp("cluster"), 2) as made:
        yield made


def test_up_prints_the_exports_to_paste(cluster):
    assert f"export CLUSTER={cluster.folder}" in cluster.exports.splitlines()


def test_each_node_has_its_own_name_and_both_networks(cluster):
    for node in ("node1", "node2"):
        shown = cluster.run(node, "sh", "-c", "hostname; ip -o -4 addr show")
        assert shown.returncode == 0, shown.stderr
        lines = shown.stdout.splitlines()
        assert lines[0] == node
        addresses = {line.split()[1]: line.split()[3] for line in lines[1:]}
        assert set(addresses) == {"lo", "mgmt0", "data0"}
        assert addresses["mgmt0"].startswith("198.18.") and addresses["data0"].startswith("198.19.")
        assert addresses["mgmt0"].endswith(f".{node[-1]}/24")
    hosts = cluster.run("node2", "cat", "/etc/hosts").stdout
    assert "node1" in hosts and "node2" in hosts and "node1-data" in hosts


def test_ssh_reaches_the_other_node_by_name(cluster):
    reached = cluster.run("node1", "ssh", "node2", "hostname")
    assert reached.returncode == 0, reached.stderr
    assert reached.stdout.strip() == "node2"


def test_exec_passes_streams_status_folder_and_environment(cluster):
    done = subprocess.run(cluster.command("node2", "sh", "-c", 'cat; echo "$MARK $(pwd)"; echo err >&2; exit 7'),
                          cwd=REPO, input="in\n", capture_output=True, text=True, env={"MARK": "m", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 7
    assert done.stdout == f"in\nm {REPO}\n"
    assert done.stderr == "err\n"


def test_node_local_disks_and_the_shared_folder(cluster):
    for node in ("node1", "node2"):
        wrote = cluster.run(node, "sh", "-c", f"echo {node} > /tmp/who; echo {node} > /root/.cache/who; "
                                              f"echo {node} > {cluster.shared}/{node}")
        assert wrote.returncode == 0, wrote.stderr
    for node in ("node1", "node2"):
        read = cluster.run(node, "sh", "-c", f"cat /tmp/who /root/.cache/who {cluster.shared}/node1 {cluster.shared}/node2")
        assert read.stdout.split() == [node, node, "node1", "node2"]
    # the machine's own /tmp and ~/.cache are not the nodes'
    assert (cluster.folder / "nodes" / "node1" / "tmp" / "who").read_text() == "node1\n"
    # the checkout and its interpreter, at the same paths on every node
    imported = cluster.run("node2", PYTHON, "-c", "import train, socket; print(train.__file__, socket.gethostname())")
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.split() == [str(REPO / "train" / "__init__.py"), "node2"]


def reaches(cluster, node: str, target: str) -> bool:
    probe = cluster.run(node, PYTHON, "-c", f"import socket; socket.create_connection(('{target}', 22), timeout=2)")
    return probe.returncode == 0


def test_a_data_link_breaks_and_mends(cluster):
    assert reaches(cluster, "node1", "node2-data")
    cluster.link("node2", "down")
    try:
        assert not reaches(cluster, "node1", "node2-data")
        assert reaches(cluster, "node1", "node2")  # the management network stays
    finally:
        cluster.link("node2", "up")
    assert reaches(cluster, "node1", "node2-data")


def test_a_shaped_link_delivers_its_rate_both_ways(cluster):
    """8 MB at 40 Mbit/s takes 1.7 s; over an unshaped link it takes a few tens of ms."""
    seconds = {}
    cluster.link("node2", "rate", "40mbit")
    try:
        for direction, command in (("to node2", "head -c 8000000 /dev/zero | ssh node2-data 'cat > /dev/null'"),
                                   ("from node2", "ssh node2-data 'head -c 8000000 /dev/zero' > /dev/null")):
            started = time.monotonic()
            sent = cluster.run("node1", "sh", "-c", command)
            seconds[direction] = time.monotonic() - started
            assert sent.returncode == 0, sent.stderr
    finally:
        cluster.link("node2", "rate", "none")
    assert all(s > 1.2 for s in seconds.values()), seconds


def test_a_second_cluster_runs_beside_and_the_same_folder_is_refused(cluster, tmp_path):
    again = cluster_script("up", cluster.folder, "--nodes", 2)
    assert again.returncode == 2
    assert f"already up at {cluster.folder}" in again.stderr and len(again.stderr.splitlines()) == 1
    with cluster_up(tmp_path / "other", 2) as other:
        assert other.run("node1", "ssh", "node2", "hostname").stdout.strip() == "node2"
        assert cluster.run("node1", "ssh", "node2", "hostname").stdout.strip() == "node2"
        assert set(namespaces(other.folder)).isdisjoint(namespaces(cluster.folder))


def test_down_removes_everything_and_may_run_twice(tmp_path):
    folder = tmp_path / "gone"
    with cluster_up(folder, 2) as made:
        started = made.start("node2", "sleep", "600", log=tmp_path / "sleep.log")
        deadline = time.monotonic() + 30
        while len(made.processes()) < 3 and time.monotonic() < deadline:  # two sshd and the sleep
            time.sleep(0.1)
        assert len(made.processes()) >= 3
    for _ in range(2):
        assert cluster_script("down", folder).returncode == 0
    started.wait(timeout=10)
    assert namespaces(folder) == []
    mounts = open("/proc/self/mountinfo").read()
    assert f"/run/trainer-cluster/{cluster_id(folder)}" not in mounts and str(folder) not in mounts
    assert started.returncode is not None


def test_bad_requests_get_one_line_and_status_2(tmp_path):
    for args, says in ((["up", tmp_path / "x", "--nodes", "0"], "--nodes must be"),
                       (["exec", tmp_path / "none", "node1", "--", "true"], "no cluster is up"),
                       (["up", tmp_path / "y", "--nodes", "2", "--link-rate", "fast"], "tc refused the rate")):
        result = cluster_script(*args)
        assert result.returncode == 2, result.stderr
        assert says in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert namespaces(tmp_path / "y") == []
