"""The collective watchdog (TRAINER_COLLECTIVE_TIMEOUT_S, docs/cluster.md): ends a rank whose wait on
the other ranks has lasted longer than the timeout, with one line saying which ranks stopped answering.

It watches from a process of its own, started with the rank, because a rank stuck in a collective may
hold Python's lock the whole time: Horovod's enqueue blocks inside C++ without letting go of it while
its background thread waits on a dead link, and a watchdog thread then never runs again. The rank marks
each wait in a page of shared memory (no system call); the watcher reads it once a second, and when a
wait is older than the timeout it tries every rank's liveness port (a listening socket of the rank's
that the kernel answers, whatever the rank is doing), prints the line on the rank's stderr, waits a
little (so that a launcher which ends every rank when one ends does not cut off the other side's line),
and kills the rank. It ends itself when the rank ends.

This file imports the standard library only: it runs as a script (python -S this-file), without torch.
"""
import contextlib
import json
import mmap
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

PROBE_S = 3.0  # how long a reachable rank may take to accept a connection
GRACE_S = 10.0  # how long the watcher waits, after the line, before it ends the rank
_PAGE = struct.Struct("d120s")  # since (CLOCK_MONOTONIC, 0: not waiting), what the rank waits for


class Watchdog:
    """The rank's side. `waiting(what)` marks a wait on the other ranks; `meet(rank, peers)` says,
    once the ranks have met (again, under Horovod Elastic), who this rank is and whom the watcher
    tries when it fires: peers are (rank, host, address, port)."""

    def __init__(self, seconds: float, address: str):
        self._depth = 0
        # the liveness port: accepting a connection is all it does (the kernel does it, in the backlog)
        self.listener = socket.create_server((address, 0), backlog=128)
        self.port = self.listener.getsockname()[1]
        fd = os.memfd_create("trainer-watchdog")
        os.ftruncate(fd, mmap.PAGESIZE)
        self._page = mmap.mmap(fd, mmap.PAGESIZE)
        # its own session: a signal to the rank's process group (a launcher's) leaves it to end with the rank;
        # none of the rank's environment: nothing that looks for the rank's processes by it finds this one
        bare = {name: os.environ[name] for name in ("PATH", "LD_LIBRARY_PATH") if name in os.environ}
        self._watcher = subprocess.Popen([sys.executable, "-S", __file__, str(fd), repr(seconds), str(os.getpid())],
                                         stdin=subprocess.PIPE, pass_fds=(fd,), start_new_session=True, env=bare)
        os.close(fd)

    def meet(self, rank: int, peers) -> None:
        """To the watcher, one line on its stdin."""
        with contextlib.suppress(OSError):  # (a watcher gone: nothing to tell)
            self._watcher.stdin.write(json.dumps({"rank": rank, "host": socket.gethostname(),
                                                  "peers": [list(p) for p in peers]}).encode() + b"\n")
            self._watcher.stdin.flush()

    @contextlib.contextmanager
    def waiting(self, what: str):
        """A wait on the other ranks: only the outermost counts."""
        self._depth += 1
        if self._depth == 1:
            self._page[:_PAGE.size] = _PAGE.pack(time.monotonic(), what.encode()[:120])
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._page[:8] = struct.pack("d", 0.0)

    def compiling(self, started: bool) -> None:
        """A compile of this rank's own (torch.compile's, told by train/engines/distributed.py) is work, not
        a wait on the others: a wait under way stops counting when it starts (started), and counts
        again from its end. (It may be told from autograd's thread, while the rank's thread waits in
        backward, inside the wait.)"""
        if self._depth:
            self._page[:8] = struct.pack("d", 0.0 if started else time.monotonic())


def unreachable(rank: int, peers) -> list[tuple[int, str]]:
    """(rank, host) of the other ranks whose liveness port does not accept a connection now."""
    def reached(peer) -> bool:
        try:
            socket.create_connection(tuple(peer[2:]), timeout=PROBE_S).close()
            return True
        except OSError:
            return False
    others = [p for p in peers if p[0] != rank]
    if not others:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(others))) as pool:
        answers = list(pool.map(reached, others))
    return [(p[0], p[1]) for p, ok in zip(others, answers) if not ok]


def ending_line(rank: int, host: str, lost: list[tuple[int, str]], what: str, seconds: float) -> str:
    if lost:
        hosts = sorted({h for _, h in lost})
        ranks = ", ".join(str(r) for r, _ in lost)
        who = f"{', '.join(hosts)} (rank{'s' if len(lost) > 1 else ''} {ranks}) stopped answering"
    else:
        who = "the other ranks stopped answering (all still reachable: a rank stuck, or a step longer than the timeout)"
    return (f"error: rank {rank} on {host}: {who}: {what} waited {seconds:g} s (TRAINER_COLLECTIVE_TIMEOUT_S); "
            "ending this rank")


def watch(fd: int, seconds: float, parent: int) -> None:
    """The watcher's loop: until the rank ends (its stdin closes, or it is no longer this one's parent)."""
    page = mmap.mmap(fd, mmap.PAGESIZE)
    told = {"rank": "?", "host": socket.gethostname(), "peers": []}
    pending = b""
    while True:
        readable, _, _ = select.select([sys.stdin.buffer], [], [], min(1.0, seconds / 10))
        if readable:
            chunk = os.read(sys.stdin.fileno(), 65536)
            if not chunk:
                return  # the rank closed it: it ended
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                told = json.loads(line)
        if os.getppid() != parent:
            return
        since, what = _PAGE.unpack(page[:_PAGE.size])
        if since and time.monotonic() - since > seconds and _PAGE.unpack(page[:_PAGE.size])[0] == since:
            lost = unreachable(told["rank"], told["peers"])
            print(ending_line(told["rank"], told["host"], lost, what.rstrip(b"\0").decode(errors="replace"), seconds),
                  file=sys.stderr, flush=True)
            # the ranks on the other side of a dead link reach their own timeout about now: a launcher that
            # ends every rank when one ends (horovodrun) would cut their line off, so end a little later
            time.sleep(min(GRACE_S, seconds / 2))
            if os.getppid() == parent:
                os.kill(parent, signal.SIGKILL)
            return


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a Ctrl-C is the rank's to handle; the watcher ends with it)
    watch(int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]))
