"""Checkpoints: written atomically (a temporary file, fsync, rename, fsync of the folder), in the
background when asked; read back as plain data only by train/checkpoint_read.py (`load`, `peek`,
`load_weights`, also answered here).

A crash or a full disk leaves the previous checkpoint.pt untouched.

Background writes cost the training steps they overlap as little as we can make them:
train/host_memory.py's `host_copy` copies the state into host memory that stays mapped and is reused from one checkpoint to the next (no
fresh allocation, so no page faults on the training thread), and that memory is a memfd that a
long-lived writer process maps too. The file is laid out on the training thread (torch.save's pickle
and zip headers, with the tensors' data left where it lies) and `Writer` hands it to that process,
which writes, syncs and renames it at a low CPU priority: it shares neither the trainer's interpreter
lock nor, when the cores are busy, much of their time. Where there is no memfd (not Linux) or no
process can be started, the state is copied into fresh memory and written by a thread of the
trainer, as before.

--keep-checkpoints keeps finished checkpoints under other names (`keep_copies`) as copies of their
own; a resume reads the newest intact one of them when checkpoint.pt cannot be read (RunDir.to_resume).
"""
import errno
import fcntl
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import torch

from train import checkpoint_writer
from train.checkpoint_read import evaluated_weights, load, load_weights, peek  # noqa: F401 (callers read them here too)
from train.host_memory import HOST_MEMORY, Arena, Layout
from train.rundir import RunDir


def save(path: Path, state: dict) -> None:
    path = Path(path)
    tmp = _temporary(path, os.getpid())
    try:
        with open(tmp, "wb") as f:
            try:
                torch.save(state, f)
            except RuntimeError as err:  # torch's zip writer turns a failed write (a full disk) into this
                raise (err.__context__ if isinstance(err.__context__, OSError) else OSError(errno.EIO, str(err))) from err
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _sync_folder(path.parent)


def _sync_folder(path: Path) -> None:
    """The folder's entries (a rename into it) on disk."""
    folder = os.open(path, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def _temporary(path: Path, pid: int) -> Path:
    """The temporary file a process writes `path` into (a killed writer's is removed by the next start
    of the run: `.checkpoint.pt.*.tmp`), named as the writer process names its own."""
    return Path(checkpoint_writer.temporary(str(path), pid))


# kept copies (--keep-checkpoints) --------------------------------------------------------------
def keep_copies(folder: Path, saved: dict, keep: int) -> None:
    """Keeps the finished folder/checkpoint.pt, whose entries are `saved`, under the names it earns:
    checkpoint-epochNNN.pt when it ends epoch NNN (then the copies of all but the last `keep` epochs
    are removed), checkpoint-best.pt when it holds the best weights evaluated so far. Each is a file of
    its own (a copy-on-write clone where the file system has them, else a copy in the kernel), made
    atomically: damage done to checkpoint.pt in place (a truncation, a `>` redirect) never reaches it."""
    run_dir = RunDir(folder)
    copies = []
    if saved["step_in_epoch"] == 0 and saved["epoch"] > 0:
        copies.append(run_dir.epoch_copy(saved["epoch"]))
    if saved.get("best_step") == saved["step"]:
        copies.append(run_dir.path / run_dir.BEST_COPY)
    for copy in copies:
        _copy(run_dir.checkpoint, copy)
    if copies:
        _sync_folder(folder)
    for _, older in run_dir.epoch_copies()[:-keep]:
        older.unlink(missing_ok=True)


FICLONE = 0x40049409  # linux/fs.h: make the target share the source's blocks, copy-on-write


def _copy(source: Path, target: Path) -> None:
    """target as a file of its own with source's bytes, replaced atomically and synced: a clone on file
    systems that have them (btrfs, XFS, bcachefs: no data written), else an in-kernel copy."""
    tmp = _temporary(target, os.getpid())  # (a killed run's is removed by its next start, as checkpoint.pt's)
    try:
        with open(source, "rb") as original, open(tmp, "wb") as copy:
            try:
                fcntl.ioctl(copy.fileno(), FICLONE, original.fileno())
            except OSError:  # no clones on this file system (ext4, tmpfs, NFS, ...): its bytes, copied by the kernel
                _copy_in_kernel(original.fileno(), copy.fileno(), os.fstat(original.fileno()).st_size)
            os.fsync(copy.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _copy_in_kernel(source: int, target: int, size: int) -> None:
    while size > 0:  # copy_file_range may copy less than asked
        copied = os.copy_file_range(source, target, size)
        if copied == 0:
            raise OSError(errno.EIO, "the checkpoint got shorter while it was copied")
        size -= copied


# background writes ------------------------------------------------------------------------------
class Writer:
    """Writes checkpoints in the background, at most one in flight: `start` waits for the previous
    write first. A failed write is raised by the next `wait` (or `start`) as OSError, with the step it
    was for in `failed_step`; so is a writer process that ended before its write was done.

    The state handed to `start` belongs to the writer until the write is done. A state made by
    `host_copy` is laid out as torch.save would write it (on the caller's thread: the pickle and the
    zip's headers, without copying the tensors' data) and written by the writer process
    (started at the first such write, and again after one ended); any other state by a thread of this
    process, as torch.save."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: OSError | None = None
        self.failed_step = None
        self.last: dict | None = None  # the last finished write: step, copy_s, write_s, start time
        self._process: _WriterProcess | None = None
        self._in_flight: tuple | None = None  # the write the process is doing: path, state, step, copy_s, start
        self._copying: threading.Thread | None = None  # keep_copies of the last finished write
        self.copy_failure: str | None = None  # why its copies could not be made, for the caller to say

    def start(self, path: Path, state: dict, step: int, copy_s: float) -> None:
        self.wait()
        started = time.time()
        shared, arena = HOST_MEMORY.holding(state)
        process = self._writer_process() if shared else None
        if process is not None:
            try:
                pieces = Layout.of(state, arena)
            except RuntimeError as err:  # torch.save's own failures, as save() reports them
                raise OSError(errno.EIO, f"the checkpoint could not be laid out ({err})") from err
            self._in_flight = (Path(path), state, step, copy_s, started)
            try:
                process.send(os.path.abspath(path), pieces, arena)
            except OSError:  # it ended since: the reply's absence says so
                pass
            return

        def write():
            try:
                save(path, state)
                self.last = _written(step, copy_s, started, time.time())
            except OSError as err:
                self._error, self.failed_step = err, step
        self._thread = threading.Thread(target=write, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def keep_copies(self, folder: Path, saved: dict, keep: int) -> None:
        """keep_copies of the finished folder/checkpoint.pt, in a thread: a copy of ResNet-50's 200 MB
        takes the calling thread 0.4 to 1 s on ext4 here. Done before the next write starts; a failure
        is left in `copy_failure`."""
        self.join()

        def copy():
            try:
                keep_copies(folder, saved, keep)
            except OSError as err:
                self.copy_failure = (f"could not keep a copy of checkpoint.pt at step {saved['step']} "
                                     f"({err.strerror or err}); checkpoint.pt itself is on disk")
        self._copying = threading.Thread(target=copy, name="checkpoint-copies", daemon=True)
        self._copying.start()

    def join(self) -> None:
        """Until no write (or copy) is in flight, its failure left for whoever reports it (a run that is
        already stopping on another error)."""
        if self._copying is not None:
            self._copying.join()
            self._copying = None
        if self._thread is not None:
            self._thread.join()
        if self._in_flight is not None:
            path, _, step, copy_s, started = self._in_flight
            reply = self._process.receive()
            self._in_flight = None  # (its host copy is free again)
            if reply is None:
                self._error, self.failed_step = self._process.ended(path), step
                self._process = None
            elif reply[0] == "done":
                self.last = _written(step, copy_s, started, reply[1])
            else:
                self._error, self.failed_step = OSError(reply[1], reply[2]), step

    def wait(self) -> None:
        """Until no write is in flight; raises the failure of the last one, if it failed."""
        self.join()
        self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _writer_process(self) -> "_WriterProcess | None":
        """The writer process, started now if there is none or it has ended; None if none can start
        (the write then runs in a thread)."""
        if self._process is not None and self._process.alive():
            return self._process
        try:
            self._process = _WriterProcess()
        except OSError:
            self._process = None
        return self._process


def _written(step: int, copy_s: float, started: float, ended: float) -> dict:
    """A finished write as the log's checkpoint record takes it."""
    return {"step": step, "copy_s": round(copy_s, 4), "write_s": round(ended - started, 4), "started": round(started, 4)}


class _WriterProcess:
    """A child process (train/checkpoint_writer.py, plain Python: it starts in a few hundredths of a second)
    that writes the files it is sent, one at a time, from pieces of bytes and of an arena whose memfd
    comes with each request over a Unix socket. It runs at a low CPU priority (_WRITE_NICE), ignores
    the signals that ask the trainer to stop (the trainer then writes its last checkpoint through it)
    and is killed when the trainer's process ends (Linux's parent-death signal, which follows the thread
    that started it: the trainer's main thread), so that no write of a dead run lands later."""

    def __init__(self):
        ours, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-S", str(_WRITER), str(theirs.fileno()), str(os.getpid()), str(_WRITE_NICE)],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.sock = ours
        self._finalizer = weakref.finalize(self, _WriterProcess._stop, ours, self.proc)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, path: str, pieces: list, arena: "Arena | None") -> None:
        message = pickle.dumps((path, pieces, arena and arena.number, arena and arena.size),
                               protocol=pickle.HIGHEST_PROTOCOL)
        socket.send_fds(self.sock, [_HEADER.pack(len(message))], [arena.fd] if arena is not None else [])
        self.sock.sendall(message)

    def receive(self):
        """The reply to the request in flight, None if the process ended first. (Replies are the
        writer's own, over a socketpair only the two processes hold.)"""
        data = b""
        try:
            while len(data) < _HEADER.size or len(data) < _HEADER.size + _HEADER.unpack(data[:_HEADER.size])[0]:
                chunk = self.sock.recv(1 << 16)
                if not chunk:
                    return None
                data += chunk
        except OSError:
            return None
        return pickle.loads(data[_HEADER.size:])

    def ended(self, path: Path) -> OSError:
        """The failure of the write the process was doing when it ended; its temporary file removed."""
        self._finalizer()
        _temporary(path, self.proc.pid).unlink(missing_ok=True)
        code = self.proc.returncode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit status {code}"
        return OSError(errno.EIO, f"the checkpoint writer process ended ({how}) before the write was done")

    @staticmethod
    def _stop(sock: socket.socket, proc: subprocess.Popen) -> None:
        sock.close()  # the process ends when it reads the end of its socket
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


_HEADER = checkpoint_writer.HEADER  # a message's length, before it
_WRITER = Path(__file__).with_name("checkpoint_writer.py")  # the writer process's program
_WRITE_NICE = 10  # the writer process's: a write overlaps a few steps and takes a small share of a core from each
