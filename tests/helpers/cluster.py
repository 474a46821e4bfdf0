"""A cluster of nodes on this machine for the multi-node tests: scripts/cluster.sh run as a user would
(up, exec, link, down), with `down` guaranteed however a test ends."""
import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, child_env

SCRIPT = REPO / "scripts" / "cluster.sh"
PYTHON = sys.executable  # the checkout's .venv: the same path on every node
BIN = Path(PYTHON).parent


def cluster_script(*args, timeout=300, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, **kwargs)


class Cluster:
    """An `up` cluster at `folder`: node names node1..nodeN, its shared folder, its commands."""

    def __init__(self, folder: Path, nodes: int, exports: str):
        self.folder, self.nodes, self.exports = Path(folder), nodes, exports
        self.shared = self.folder / "shared"

    def command(self, node: str, *command) -> list[str]:
        return ["bash", str(SCRIPT), "exec", str(self.folder), node, "--", *map(str, command)]

    def run(self, node: str, *command, cwd=None, env=None, timeout=600, input=None) -> subprocess.CompletedProcess:
        """COMMAND on NODE, its output captured."""
        return subprocess.run(self.command(node, *command), cwd=cwd or self.shared, env=node_env(env),
                              capture_output=True, text=True, timeout=timeout, input=input)

    def start(self, node: str, *command, log: Path, cwd=None, env=None) -> subprocess.Popen:
        """COMMAND on NODE in a session of its own (to be killed as a group), its output to `log`."""
        with open(log, "w") as out:
            return subprocess.Popen(self.command(node, *command), cwd=cwd or self.shared, env=node_env(env),
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def horovodrun(self, *args, mpi=False, env=None, timeout=300, hosts="node1:2,node2:2"):
        """horovodrun on node1 reaching the nodes over ssh (2 ranks on each by default), training."""
        return self.run("node1", *self.horovodrun_command(*args, mpi=mpi, hosts=hosts), env=env, timeout=timeout)

    @staticmethod
    def horovodrun_command(*args, mpi=False, hosts="node1:2,node2:2") -> list:
        ranks = sum(int(h.split(":")[1]) for h in hosts.split(","))
        # horovodrun's own traffic pinned to the management network, as docs/multinode.md advises; so its
        # HOROVOD_GLOO_IFACE names mgmt0 too, and only the trainer's TRAINER_IFACE moves the collectives
        return [BIN / "horovodrun", "-np", ranks, "-H", hosts, "--disable-cache", "--network-interface", "mgmt0",
                "--mpi" if mpi else "--gloo", PYTHON, "-m", "train", *args]

    def torchrun(self, folder: Path, *args, nodes=("node1", "node2"), per_node=2, env=None) -> list[subprocess.Popen]:
        """One torchrun agent per node, `per_node` workers each, meeting at node1's c10d rendezvous;
        their output goes to folder/NODE.log."""
        return [self.start(node, PYTHON, "-m", "torch.distributed.run", "--nnodes", len(nodes), "--nproc-per-node", per_node,
                           "--rdzv-backend", "c10d", "--rdzv-endpoint", "node1:29400", "--rdzv-id", "job",
                           "-m", "train", *args, log=folder / f"{node}.log", env=env)
                for node in nodes]

    def kill_node(self, node: str) -> None:
        """Every process of NODE killed at once, as when it dies, but its sshd (so that it can serve again)."""
        import signal
        listener = int((self.folder / "nodes" / node / "run" / "sshd.pid").read_text())
        ns = f"tc{cluster_id(self.folder)}n{node[4:]}"
        for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
            if int(pid) != listener:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)

    def link(self, node: str, *how) -> None:
        result = cluster_script("link", self.folder, node, *how)
        assert result.returncode == 0, result.stderr

    def interface_bytes(self, node: str) -> dict:
        """{interface: (rx bytes, tx bytes)} as the node sees them (its /proc/net/dev)."""
        text = self.run(node, "cat", "/proc/net/dev").stdout
        counters = {}
        for line in text.splitlines()[2:]:
            name, fields = line.split(":", 1)
            values = fields.split()
            counters[name.strip()] = (int(values[0]), int(values[8]))
        return counters

    def processes(self) -> list[int]:
        """The pids living in any of the cluster's network namespaces."""
        pids = []
        for ns in namespaces(self.folder):
            listed = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            pids += [int(p) for p in listed]
        return pids


def node_env(extra=None) -> dict:
    """The test's environment for a node: the checkout importable, one compute thread per rank (every
    node sees both cores of this machine), no cache folder of the machine's (each node has its own)."""
    env = child_env(OMP_NUM_THREADS="1", **(extra or {}))
    env.pop("TRAINER_CACHE_DIR", None)  # node-local: the node's own ~/.cache
    return env


def cluster_id(folder: Path) -> str:
    """What the script names a cluster's namespaces and folder after: a digest of its folder."""
    import hashlib
    return hashlib.sha1(str(Path(folder).resolve()).encode()).hexdigest()[:6]


def namespaces(folder: Path) -> list[str]:
    prefix = "tc" + cluster_id(folder)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    return [line.split()[0] for line in listed if line.startswith(prefix)]


@contextlib.contextmanager
def cluster_up(folder: Path, nodes: int, *flags, env=None):
    """A cluster for the length of the block, taken down afterwards whatever happens; the tests are
    skipped, with the script's reason, where this machine cannot make namespaces. `env`: what `up`
    runs with (default: this process's environment)."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        result = cluster_script("up", folder, "--nodes", nodes, *flags, timeout=400, env=env)
        if result.returncode == 2 and "cannot make" in result.stderr:
            pytest.skip(result.stderr.strip())
        assert result.returncode == 0, result.stderr
        yield Cluster(folder, nodes, result.stdout)
    finally:
        cluster_script("down", folder)

