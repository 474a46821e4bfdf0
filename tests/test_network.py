"""The network settings on one host (their multi-node twins: tests/test_multinode*.py): TRAINER_IFACE
handed to every library or refused with the host's interfaces, TRAINER_COLLECTIVE_TIMEOUT_S's
watchdog naming who stopped answering and its backstop in every library (every torch process group's:
tests/test_wire.py), and the nodes taken from the ranks' host names."""
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import types

import pytest
import torch

from helpers import REPO, child_env, run_train, stand_in_for_horovod
from train.config import Config
from train.engines.network import collective_timeout, set_library_timeouts, use_interface
from train.engines.watchdog import unreachable
from train.engines.distributed import DistributedEngine
from train.engines.topology import node_summary
from train.errors import UsageError


def test_an_interface_is_handed_to_every_library():
    env = {"TRAINER_IFACE": "lo"}
    assert use_interface(env) == "lo"
    assert env["GLOO_SOCKET_IFNAME"] == "lo" and env["HOROVOD_GLOO_IFACE"] == "lo" and env["TP_SOCKET_IFNAME"] == "lo"
    assert env["NCCL_SOCKET_IFNAME"] == "=lo"  # exactly lo, not every name starting with it
    assert env["OMPI_MCA_btl_tcp_if_include"] == "lo"


def test_the_settings_go_to_the_environment_of_the_moment(monkeypatch):
    """Not to the one there was at import: a test that stands a dict in for os.environ must not leak
    the settings into its worker's real environment (they reached later launches: a 330 s gloo timeout)."""
    real = os.environ
    monkeypatch.delenv("HOROVOD_GLOO_TIMEOUT_SECONDS", raising=False)
    monkeypatch.setattr(os, "environ", {"TRAINER_IFACE": "lo"})
    assert use_interface() == "lo" and set_library_timeouts(20) == 50
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo" and os.environ["HOROVOD_GLOO_TIMEOUT_SECONDS"] == "50"
    assert "HOROVOD_GLOO_TIMEOUT_SECONDS" not in real and real.get("GLOO_SOCKET_IFNAME") != "lo"


HUNG_COLLECTIVE_BOUNDS = ("HOROVOD_GLOO_TIMEOUT_SECONDS", "HOROVOD_STALL_CHECK_TIME_SECONDS",
                          "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def test_every_library_gets_the_backstop():
    env = {}
    assert set_library_timeouts(300, env) == 330
    assert env == {"HOROVOD_GLOO_TIMEOUT_SECONDS": "330", "HOROVOD_STALL_CHECK_TIME_SECONDS": "60",
                   "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "330", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    env = {}
    set_library_timeouts(20, env)  # Horovod never shuts down on a shutdown time below its check time
    assert env["HOROVOD_STALL_CHECK_TIME_SECONDS"] == env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] == "50"


def test_the_users_own_settings_are_kept():
    env = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "600", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    set_library_timeouts(300, env)
    assert env["HOROVOD_STALL_CHECK_TIME_SECONDS"] == env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] == "600"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


def test_horovod_has_its_bounds_before_init(monkeypatch):
    """Horovod reads them in hvd.init() only (a stand-in for horovod.torch records them there)."""
    from train.engines import horovod as horovod_engine
    seen = {}
    hvd = types.SimpleNamespace(nccl_built=lambda: 0, rank=lambda: 0, size=lambda: 1, local_rank=lambda: 0,
                                allgather_object=lambda obj: [obj],
                                init=lambda: seen.update({k: os.environ.get(k) for k in HUNG_COLLECTIVE_BOUNDS}))
    stand_in_for_horovod(monkeypatch, hvd)
    environ = {k: v for k, v in os.environ.items() if k not in HUNG_COLLECTIVE_BOUNDS}
    monkeypatch.setattr(os, "environ", {**environ, "OMP_NUM_THREADS": "1", "TRAINER_COLLECTIVE_TIMEOUT_S": "40"})
    monkeypatch.setattr(horovod_engine, "local_device", lambda local_rank: torch.device("cpu"))
    horovod_engine.Horovod(Config(engine="horovod"))
    assert seen == {"HOROVOD_GLOO_TIMEOUT_SECONDS": "70", "HOROVOD_STALL_CHECK_TIME_SECONDS": "60",
                    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "70", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}


def test_no_interface_named_changes_nothing():
    env = {"PATH": "/bin"}
    assert use_interface(env) is None and env == {"PATH": "/bin"}


def test_an_interface_this_host_lacks_is_refused_listing_the_ones_it_has():
    with pytest.raises(UsageError) as refused:
        use_interface({"TRAINER_IFACE": "nosuch0"})
    assert str(refused.value).startswith(f"TRAINER_IFACE=nosuch0: {socket.gethostname()} has no network interface nosuch0; it has lo")


def test_an_interface_without_an_address_is_refused():
    """(gloo would abort: 'Unable to find address for: ...')"""
    made = subprocess.run(["ip", "link", "add", "noaddr0", "type", "veth", "peer", "name", "noaddr1"], capture_output=True)
    if made.returncode:
        pytest.skip(f"cannot make an interface here: {made.stderr.decode().strip()}")
    try:
        with pytest.raises(UsageError, match="TRAINER_IFACE=noaddr0: noaddr0 on .* has no IPv4 address"):
            use_interface({"TRAINER_IFACE": "noaddr0"})
    finally:
        subprocess.run(["ip", "link", "del", "noaddr0"])


def test_the_trainer_refuses_it_in_one_line_with_status_2(tmp_path):
    result = run_train("--out-dir", "run", "--loader", "synthetic", cwd=tmp_path, env={"TRAINER_IFACE": "nosuch0"})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: TRAINER_IFACE=nosuch0: {socket.gethostname()} has no network interface nosuch0; "
        f"it has {', '.join(name for _, name in socket.if_nameindex())}"]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", ["0", "-5", "soon"])
def test_a_timeout_that_is_not_a_positive_number_is_refused(value):
    with pytest.raises(UsageError, match=f"TRAINER_COLLECTIVE_TIMEOUT_S={value} is not a positive number"):
        collective_timeout({"TRAINER_COLLECTIVE_TIMEOUT_S": value})
    assert collective_timeout({}) == 300


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_watchdog_finds_the_ranks_that_do_not_answer():
    alive = socket.create_server(("127.0.0.1", 0))
    peers = [(0, "a", "127.0.0.1", closed_port()),  # (this rank: never tried)
             (1, "a", *alive.getsockname()), (2, "b", "127.0.0.1", closed_port()), (3, "b", "127.0.0.1", closed_port())]
    assert unreachable(0, peers) == [(2, "b"), (3, "b")]


WAITS = {
    "asleep": "time.sleep(30)",
    # a C call that keeps Python's lock the whole time, as Horovod's enqueue does while its background
    # thread waits on a dead link: no thread of the rank's runs until it returns
    "holding Python's lock": "import ctypes; ctypes.PyDLL(None).sleep(30)",
}


@pytest.mark.parametrize("how", WAITS)
def test_a_wait_longer_than_the_timeout_ends_the_rank_naming_who_stopped_answering(how):
    script = textwrap.dedent(f"""
        import time
        from train.engines.watchdog import Watchdog
        watchdog = Watchdog(1.0, "127.0.0.1")
        watchdog.meet(0, [(0, "here", "127.0.0.1", watchdog.port), (1, "there", "127.0.0.1", {closed_port()})])
        with watchdog.waiting("the gradient all-reduce"):
            pass  # a finished wait is no concern, however long the one before the next
        time.sleep(2)
        with watchdog.waiting("the gradient all-reduce"):
            {WAITS[how]}
    """)
    started = time.monotonic()
    ended = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=child_env(), capture_output=True, text=True,
                           timeout=60)
    assert time.monotonic() - started < 15
    assert ended.returncode == -signal.SIGKILL  # (ended from outside: the rank itself may not run)
    assert ended.stderr.strip().splitlines() == [
        f"error: rank 0 on {socket.gethostname()}: there (rank 1) stopped answering: the gradient all-reduce waited "
        "1 s (TRAINER_COLLECTIVE_TIMEOUT_S); ending this rank"]


def test_the_watcher_ends_with_its_rank():
    script = textwrap.dedent("""
        from train.engines.watchdog import Watchdog
        print(Watchdog(1.0, "127.0.0.1")._watcher.pid)
    """)
    watcher = int(subprocess.run([sys.executable, "-c", script], cwd=REPO, env=child_env(), capture_output=True,
                                 text=True, timeout=60, check=True).stdout)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and os.path.exists(f"/proc/{watcher}") and "Z" not in proc_state(watcher):
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{watcher}") or "Z" in proc_state(watcher)


def proc_state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_the_nodes_are_the_host_names():
    assert node_summary(["a", "a", "b", "b"]) == ("2 node(s) x 2 rank(s): ", {"nodes": 2, "ranks_per_node": 2})
    assert node_summary(["a", "a", "a", "b"]) == ("2 node(s) (3+1 ranks): ",
                                                  {"nodes": 2, "ranks_per_node": 0, "ranks_on_nodes": [3, 1]})


class Placed(DistributedEngine):
    def __init__(self, hosts, allreduce="hierarchical"):
        self.rank, self.world_size, self.cfg, self.hosts = 0, len(hosts), Config(allreduce=allreduce), hosts
        self._layout(self.cfg, hosts.count(hosts[0]))


def test_two_level_all_reduces_want_each_nodes_ranks_numbered_together():
    Placed(["a", "a", "b", "b"])._check_nodes_are_lines()
    with pytest.raises(UsageError, match="rank 1 runs on b, not a; launch the ranks node by node"):
        Placed(["a", "b", "a", "b"])._check_nodes_are_lines()  # mpirun --map-by node
