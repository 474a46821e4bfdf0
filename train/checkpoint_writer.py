"""The checkpoint writer process (train/checkpoint.py `_WriterProcess`): plain Python, no torch, started
with `python -S` so that it starts in a few hundredths of a second.

The writer process's program. A request: (path, pieces, arena number, arena size), the arena's memfd
with it; a piece is bytes or (offset in the arena, length). The file is written as save() writes it:
a temporary file in the same folder, fsync, rename, fsync of the folder; the temporary file is removed
on failure. The reply: ("done", end time) or ("failed", errno, message, end time).

Arguments: the socket's descriptor, the trainer's pid, the niceness to run at.
"""
import errno
import mmap
import os
import pickle
import signal
import socket
import struct
import sys
import time

HEADER = struct.Struct("!Q")
# Written and synced a chunk at a time: the writeback of the file's pages is then done by this process,
# at its priority, a chunk at a time, rather than all at once by the kernel's flusher threads at the
# final fsync (at the trainer's priority, in a burst that slowed the step it fell in by ~0.2 s).
CHUNK = 16 << 20


def receive(sock):
    header, fds, _, _ = socket.recv_fds(sock, HEADER.size, 1)
    data = bytearray(header)
    while len(data) < HEADER.size or len(data) < HEADER.size + HEADER.unpack(data[:HEADER.size])[0]:
        chunk = sock.recv(1 << 20)
        if not chunk:
            return None, fds
        data += chunk
    return pickle.loads(data[HEADER.size:]), fds


def temporary(path: str, pid: int) -> str:
    """The temporary file that process `pid` writes `path` into, beside it (the trainer's thread writer
    names its own so too, and the next start of a run removes what a killed writer left)."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.{pid}.tmp")


def write(path, pieces, arena):
    folder = os.path.dirname(path)
    tmp = temporary(path, os.getpid())
    try:
        with open(tmp, "wb") as f:
            unsynced = 0
            for piece in pieces:
                data = piece if isinstance(piece, bytes) else arena[piece[0]:piece[0] + piece[1]]
                for start in range(0, len(data), CHUNK):
                    f.write(data[start:start + CHUNK])
                    unsynced += min(CHUNK, len(data) - start)
                    if unsynced >= CHUNK:  # the disk writes now, from this process (see below)
                        f.flush()
                        os.fdatasync(f.fileno())
                        unsynced = 0
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        directory = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        return ("done", time.time())
    except OSError as err:
        return ("failed", err.errno or errno.EIO, err.strerror or str(err), time.time())
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def main(sock_fd: int, trainer_pid: int, niceness: int) -> None:
    for stop in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):  # the trainer's last write comes
        signal.signal(stop, signal.SIG_IGN)
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: end with the trainer
    except (ImportError, OSError, AttributeError):
        pass
    if os.getppid() != trainer_pid:  # it ended before the line above
        os._exit(0)
    try:
        os.nice(niceness)
    except OSError:
        pass
    serve(socket.socket(fileno=sock_fd))


def serve(sock) -> None:
    """Writes each request's file and replies, until the trainer closes the socket."""
    maps = {}
    while True:
        request, fds = receive(sock)
        if request is None:
            break
        path, pieces, number, size = request
        for old in [n for n in maps if n != number]:
            maps.pop(old).close()
        for fd in fds:
            if number not in maps:
                maps[number] = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            os.close(fd)
        arena = memoryview(maps[number]) if number is not None else None
        reply = write(path, pieces, arena)
        if arena is not None:
            arena.release()
        message = pickle.dumps(reply)
        sock.sendall(HEADER.pack(len(message)) + message)


if __name__ == "__main__":
    main(*map(int, sys.argv[1:4]))
