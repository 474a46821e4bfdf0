"""The network between the ranks: which interface the collectives take, and how long a rank waits for
the others before it ends (docs/cluster.md).

TRAINER_IFACE=NAME names the interface once for every library: the trainer sets gloo's, NCCL's,
Horovod's and Open MPI's own variables from it in its own processes, before any of them starts. A
name that this host lacks is refused before any collective, with the host's interfaces listed.

TRAINER_COLLECTIVE_TIMEOUT_S (default 300) bounds a wait on the other ranks. A watchdog
(train/engines/watchdog.py, a process of the rank's own) ends a rank that has been inside a collective
(a step's gradient all-reduce, or an agreement on the host) for longer, with one line saying which
ranks stopped answering: each rank listens on a TCP port of its collectives' address, and the watchdog
tries to reach every other rank's at that moment. The libraries' own timeouts are set a little longer,
as a backstop for the waits outside (start-up) and for what the host does not wait on (NCCL runs
collectives on the GPU while the host goes on): every process group's, gloo's, Horovod's stall inspector.

A rank that refuses to start under torchrun tells the others through the rendezvous store: torchrun's
agents do not stop each other's workers, so the ranks on other nodes would wait for it until the
start-up timeout (tell_refusal, watch_refusals).
"""
import fcntl
import os
import socket
import struct
import sys
import threading
import time

from train.errors import UsageError

DEFAULT_TIMEOUT_S = 300
BACKSTOP_S = 30  # the libraries' timeouts: the watchdog's, and this much more


def collective_timeout(env=None) -> float:
    env = os.environ if env is None else env  # (read when called: a test may replace os.environ)
    value = env.get("TRAINER_COLLECTIVE_TIMEOUT_S", str(DEFAULT_TIMEOUT_S))
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1
    if seconds <= 0:
        raise UsageError(f"TRAINER_COLLECTIVE_TIMEOUT_S={value} is not a positive number of seconds; "
                         f"set it above the longest step (default {DEFAULT_TIMEOUT_S})")
    return seconds


def use_interface(env=None) -> str | None:
    """TRAINER_IFACE, checked against this host's interfaces and handed to every library (in `env`,
    this process's environment); None when unset."""
    env = os.environ if env is None else env
    name = env.get("TRAINER_IFACE", "")
    if not name:
        return None
    present = [found for _, found in socket.if_nameindex()]
    if name not in present:
        raise UsageError(f"TRAINER_IFACE={name}: {socket.gethostname()} has no network interface {name}; "
                         f"it has {', '.join(present)}")
    try:
        interface_address(name)
    except OSError:
        raise UsageError(f"TRAINER_IFACE={name}: {name} on {socket.gethostname()} has no IPv4 address; "
                         f"name one that has (of {', '.join(present)})") from None
    env["GLOO_SOCKET_IFNAME"] = name  # torch.distributed's gloo
    env["TP_SOCKET_IFNAME"] = name  # torch's tensorpipe (RPC)
    env["NCCL_SOCKET_IFNAME"] = "=" + name  # exactly this one (NCCL reads a prefix otherwise)
    env["HOROVOD_GLOO_IFACE"] = name  # Horovod over gloo (horovodrun --network-interface sets the same)
    env["OMPI_MCA_btl_tcp_if_include"] = name  # Open MPI's TCP transport, read at MPI_Init
    return name


def set_library_timeouts(seconds: float, env=None) -> float:
    """The libraries' own timeouts (the backstop), in seconds, set before the libraries start (a value
    already in the environment is kept): torch's is returned, for every process group the engine makes;
    Horovod reads its variables in hvd.init(). What ends a hung collective where: docs/cluster.md.
    - gloo under Horovod (its process sets take the global context's timeout);
    - Horovod's stall inspector, which shuts Horovod down when some ranks have submitted an operation
      and others have not for that long; it looks every HOROVOD_STALL_CHECK_TIME_SECONDS (default 60;
      at most the shutdown time: Horovod 0.28.1 never shuts down on a shutdown time below it);
    - torch's NCCL process groups: TORCH_NCCL_ASYNC_ERROR_HANDLING=3, a collective past its group's
      timeout ends the process (without aborting the communicator first, which can hang itself). That
      is torch's default; set, it also outranks a deprecated NCCL_ASYNC_ERROR_HANDLING=0 left in the
      environment, which would leave the job hanging."""
    env = os.environ if env is None else env
    backstop = seconds + BACKSTOP_S
    env.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", str(int(backstop)))
    check = env.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", str(int(min(60, backstop))))
    env.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", str(max(int(backstop), int(check) if check.isdigit() else 0)))
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    return backstop


def interface_address(name: str | None) -> str:
    """This host's IPv4 address for the collectives: the interface's, else the host name's."""
    if name:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            return socket.inet_ntoa(packed[20:24])
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _under_torchrun(env) -> bool:
    return "TORCHELASTIC_RUN_ID" in env and "MASTER_ADDR" in env and "MASTER_PORT" in env


def _refusal_key(env) -> str:
    return f"trainer/refused/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"  # (a restart is a new meeting)


def _store(env, host: bool):
    import datetime
    from torch.distributed import TCPStore
    return TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=host, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=30))


def tell_refusal(line: str, env=None) -> None:
    """Under torchrun: this rank's refusal to start, posted where the other ranks wait to meet (the
    agent's store, or rank 0's own when the agents share none: then this rank, if rank 0, hosts it
    for a few seconds). Best effort: without it the others end at the start-up timeout."""
    env = os.environ if env is None else env
    if not _under_torchrun(env):
        return
    host = env.get("RANK") == "0" and env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    try:
        _store(env, host).set(_refusal_key(env), line)
        if host:
            time.sleep(5)  # the store lives in this process: time for the others to read it
    except Exception:  # noqa: BLE001 (no store to reach: the timeout still ends the others)
        pass


def watch_refusals(rank: int, env=None) -> threading.Event | None:
    """Under torchrun, while this rank waits to meet the others: ends it, with one line, when another
    rank posts its refusal to start (tell_refusal). Set the returned event once the ranks have met."""
    env = os.environ if env is None else env
    if not _under_torchrun(env):
        return None
    met = threading.Event()

    def watch():
        try:
            store, key = _store(env, False), _refusal_key(env)
            while not met.wait(0.5):
                if store.check([key]):
                    refused = store.get(key).decode()
                    print(f"error: rank {rank} on {socket.gethostname()}: not starting, another rank refused: {refused}",
                          file=sys.stderr, flush=True)
                    os._exit(2)
        except Exception:  # noqa: BLE001 (the store went away: the meeting itself fails or goes on)
            return
    threading.Thread(target=watch, name="refusal-watch", daemon=True).start()
    return met
