"""Checkpoints: written atomically (a temporary file, fsync, rename, fsync of the folder), in the
background when asked, and read back as plain data only.

A crash or a full disk leaves the previous checkpoint.pt untouched. Loading uses
`torch.load(weights_only=True)`: tensors, numbers, strings, lists and dicts, nothing else, so a file
planted in a shared run directory cannot run code as the user (docs/checkpoints.md).

Background writes cost the training steps they overlap as little as we can make them: `host_copy`
copies the state into host memory that stays mapped and is reused from one checkpoint to the next (no
fresh allocation, so no page faults on the training thread), and that memory is a memfd that a
long-lived writer process maps too. The file is laid out on the training thread (torch.save's pickle
and zip headers, with the tensors' data left where it lies) and `Writer` hands it to that process,
which writes, syncs and renames it at a low CPU priority: it shares neither the trainer's interpreter
lock nor, when the cores are busy, much of their time. Where there is no memfd (not Linux) or no
process can be started, the state is copied into fresh memory and written by a thread of the
trainer, as before.

--keep-checkpoints keeps finished checkpoints under other names (`keep_copies`) as hard links, and
--init-from reads the weights out of other scripts' checkpoints too (`load_weights`).
"""
import argparse
import errno
import mmap
import os
import pickle
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import numpy
import torch

from train import checkpoint_writer
from train.config import UsageError

try:
    from torch.utils.serialization import config as _serialization_config
except ImportError:  # (an older torch: its files always carry checksums)
    _serialization_config = None


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
EPOCH_COPY = re.compile(r"checkpoint-epoch(\d+)\.pt")  # checkpoint-epoch003.pt: the checkpoint at the end of epoch 3
BEST_COPY = "checkpoint-best.pt"


def keep_copies(folder: Path, saved: dict, keep: int) -> None:
    """Keeps the finished folder/checkpoint.pt, whose entries are `saved`, under the names it earns:
    checkpoint-epochNNN.pt when it ends epoch NNN (then the copies of all but the last `keep` epochs
    are removed), checkpoint-best.pt when it holds the best weights evaluated so far. Each is a hard link
    to the file (no second write; a copy where the filesystem has no hard links), made atomically."""
    latest = folder / "checkpoint.pt"
    names = []
    if saved["step_in_epoch"] == 0 and saved["epoch"] > 0:
        names.append(f"checkpoint-epoch{saved['epoch']:03d}.pt")
    if saved.get("best_step") == saved["step"]:
        names.append(BEST_COPY)
    made = [_link_or_copy(latest, folder / name) for name in names
            if not ((folder / name).exists() and os.path.samefile(latest, folder / name))]
    if made:
        _sync_folder(folder)
    epochs = sorted((int(match.group(1)), path) for path in folder.iterdir()
                    if (match := EPOCH_COPY.fullmatch(path.name)))
    for _, older in epochs[:-keep]:
        older.unlink(missing_ok=True)


def to_evaluate(run_dir: Path, name: str) -> Path:
    """The checkpoint --test-only evaluates: --checkpoint's file (a name in the run directory, such as
    checkpoint-best.pt, or a path), else the run's checkpoint.pt."""
    if not name:
        if not (run_dir / "checkpoint.pt").is_file():
            raise UsageError(f"{run_dir} holds no checkpoint.pt to evaluate; check --out-dir")
        return run_dir / "checkpoint.pt"
    found = next((path for path in (run_dir / name, Path(name)) if path.is_file()), None)
    if found is None:
        kept = sorted(path.name for path in run_dir.glob("checkpoint*.pt"))
        raise UsageError(f"--checkpoint {name} is neither a file in {run_dir} nor a path; "
                         f"{run_dir} holds {', '.join(kept) or 'no checkpoint'}")
    return found


def _link_or_copy(source: Path, target: Path) -> Path:
    tmp = _temporary(target, os.getpid())  # (a killed run's is removed by its next start, as checkpoint.pt's)
    tmp.unlink(missing_ok=True)
    try:
        try:
            os.link(source, tmp)
        except OSError:  # a filesystem without hard links (some FUSE and SMB mounts): a copy, synced
            with open(source, "rb") as original, open(tmp, "wb") as copy:
                shutil.copyfileobj(original, copy, 16 << 20)
                copy.flush()
                os.fsync(copy.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


# host copies ------------------------------------------------------------------------------------
def host_copy(value):
    """The state as it is now, in host memory: every tensor copied (CPU tensors too, since a
    state_dict's tensors are the live weights), so training can go on while another process or thread
    writes it. Dicts, lists and tuples are copied around them; other values are kept as they are.

    The copies live in a shared host-memory arena that is reused once no tensor of an earlier copy is
    alive (a checkpoint's copy is alive until its write is done; a copy someone keeps, such as an
    elastic commit, keeps its arena). Without memfd (not Linux), they are fresh CPU tensors."""
    tensors = _tensors_with_data(value)
    places, size = [], 0
    for tensor in tensors:
        places.append(size)
        size += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
    lent = _HOST_MEMORY.lend(size) if tensors else None
    if lent is None:
        return _replace(value, lambda t: t.detach().to("cpu", copy=True))
    copies = {}
    with torch.no_grad():  # (one tensor object made per tensor: each made is work for Python's collector)
        for tensor, place in zip(tensors, places):
            copy = torch.frombuffer(lent, dtype=tensor.dtype, count=tensor.numel(), offset=place)
            copy.as_strided_(tensor.shape, _dense_strides(tensor))
            copy.copy_(tensor)
            copies[id(tensor)] = copy
    del lent  # (the copies hold it: the arena is busy while any of them lives)
    return _replace(value, lambda t: copies.get(id(t)) if id(t) in copies else t.detach().to("cpu", copy=True))


_ALIGN = 64  # bytes: where each tensor of a host copy starts in its arena


def reserve(state) -> None:
    """Pages in now the host memory that host copies of `state` will use (a copy made and let go: its
    arena stays for the next), so that the first checkpoint's copy costs the training step what the
    later ones do rather than ~0.07 s of page faults (ResNet-50)."""
    host_copy(state)


def _tensors_with_data(value) -> list[torch.Tensor]:
    """The tensors of a state, each once, leaving out the empty ones (nothing to copy or write)."""
    found = {}
    _collect(value, found)
    return [t for t in found.values() if t.numel()]


def _collect(value, found: dict) -> None:
    if isinstance(value, torch.Tensor):
        found[id(value)] = value
    elif isinstance(value, dict):
        for item in value.values():
            _collect(item, found)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect(item, found)


def _replace(value, tensor_to):
    """`value` with each tensor t replaced by tensor_to(t), its dicts, lists and tuples rebuilt."""
    if isinstance(value, torch.Tensor):
        return tensor_to(value)
    if isinstance(value, dict):
        return {key: _replace(item, tensor_to) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_replace(item, tensor_to) for item in value)
    return value


def _dense_strides(tensor: torch.Tensor) -> tuple:
    """The strides of a dense copy in the tensor's own layout (channels_last stays channels_last), as
    `.to(copy=True)` would give them."""
    if tensor.is_contiguous():
        return tensor.stride()
    return torch.empty_like(tensor, device="meta").stride()


class _Arena:
    """Host memory for host copies: a memfd (which the writer process maps too, given its descriptor),
    mapped here for as long as the arena lives. A copy's tensors are made from the arena's `lease`, a
    memoryview of the mapping that each of their storages holds (torch.frombuffer keeps its buffer), so
    the arena is free for the next copy exactly when nothing but the arena refers to its lease."""

    def __init__(self, number: int, size: int):
        self.number, self.size = number, size
        self.fd = os.memfd_create("checkpoint-host-copy", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.map = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.lease: memoryview | None = None
        probe = torch.frombuffer(self.map, dtype=torch.uint8, count=1)
        self.address = probe.data_ptr()
        del probe

    def free(self) -> bool:
        # the references to the lease when no tensor holds it: self.lease and getrefcount's argument
        return self.lease is None or sys.getrefcount(self.lease) <= 2

    def lend(self) -> memoryview:
        if self.lease is not None:
            self.lease.release()
        self.lease = memoryview(self.map)
        return self.lease

    def holds(self, tensor: torch.Tensor) -> bool:
        start = tensor.data_ptr()
        return self.address <= start and start + _span(tensor) * tensor.element_size() <= self.address + self.size

    def close(self) -> None:
        if self.lease is not None:
            self.lease.release()
        self.map.close()
        os.close(self.fd)


def _span(tensor: torch.Tensor) -> int:
    """Elements from a tensor's first to its last, inclusive (0 for an empty tensor)."""
    if not tensor.numel():
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))


class _HostMemory:
    """The process's arenas: a host copy takes a free one that is large enough (or a new one); free
    arenas it does not take are let go, so only copies that are alive, and the one being made, hold
    memory."""

    def __init__(self):
        self.arenas: list[_Arena] = []
        self.lock = threading.Lock()
        self.numbers = 0
        self.usable = hasattr(os, "memfd_create")

    def lend(self, size: int) -> memoryview | None:
        """A lease on `size` bytes of an arena, or None without memfd."""
        if not self.usable:
            return None
        with self.lock:
            free = [arena for arena in self.arenas if arena.free()]
            fitting = [arena for arena in free if arena.size >= size]
            chosen = min(fitting, key=lambda arena: arena.size) if fitting else None
            for arena in free:
                if arena is not chosen:
                    self.arenas.remove(arena)
                    arena.close()
            if chosen is None:
                try:
                    chosen = _Arena(self.numbers, -(-size // mmap.PAGESIZE) * mmap.PAGESIZE)
                except OSError:  # no memfd here (or none of this size): fresh private memory instead
                    return None
                self.numbers += 1
                self.arenas.append(chosen)
            return chosen.lend()

    def holding(self, state) -> "tuple[bool, _Arena | None]":
        """(True, the arena) when every non-empty tensor of `state` lies in one arena, (True, None) when
        it has no tensor data, (False, None) otherwise."""
        tensors = _tensors_with_data(state)
        if not tensors:
            return True, None
        with self.lock:
            arena = next((a for a in self.arenas if a.holds(tensors[0])), None)
        if arena is None or not all(t.device.type == "cpu" and arena.holds(t) for t in tensors):
            return False, None
        return True, arena


_HOST_MEMORY = _HostMemory()


class _Layout:
    """The bytes of a torch.save file of a state whose tensors lie in an arena, as pieces: the small
    ones (zip headers, the pickle) as bytes, each tensor's data as (offset in the arena, length), so
    that the writer process can write the file from the arena without torch. torch.save's zip writer
    hands a file object the storages' own memory (a memoryview of it), which is how a piece is known
    to be in the arena; any other memory is copied, so the file is right whatever torch hands over."""

    def __init__(self, arena: "_Arena | None"):
        self.arena, self.pieces, self.small = arena, [], bytearray()

    def write(self, data) -> int:
        data = memoryview(data)
        size = data.nbytes
        start = numpy.frombuffer(data, dtype=numpy.uint8).ctypes.data if size >= _BY_REFERENCE else 0
        if start and self.arena is not None and self.arena.address <= start <= self.arena.address + self.arena.size - size:
            if self.small:
                self.pieces.append(bytes(self.small))
                self.small.clear()
            self.pieces.append((start - self.arena.address, size))
        else:
            self.small += data
        return size

    def flush(self) -> None:
        pass

    @classmethod
    def of(cls, state, arena: "_Arena | None") -> list:
        """The pieces, without the zip's CRC-32 checksums: computing them over ~200 MB would cost the
        training thread 30-40 ms, and torch.load does not check them (a changed byte loads as it is,
        with or without); a truncated file is refused either way, by its missing zip directory."""
        layout = cls(arena)
        settings = getattr(_serialization_config, "save", None)
        crc32 = getattr(settings, "compute_crc32", None)
        if crc32 is not None:
            settings.compute_crc32 = False
        try:
            torch.save(state, layout)
        finally:
            if crc32 is not None:
                settings.compute_crc32 = crc32
        if layout.small:
            layout.pieces.append(bytes(layout.small))
        return layout.pieces


_BY_REFERENCE = 4096  # bytes: smaller pieces are copied into the request


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

    def start(self, path: Path, state: dict, step: int, copy_s: float) -> None:
        self.wait()
        started = time.time()
        shared, arena = _HOST_MEMORY.holding(state)
        process = self._writer_process() if shared else None
        if process is not None:
            try:
                pieces = _Layout.of(state, arena)
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

    def join(self) -> None:
        """Until no write is in flight, its failure left for whoever reports it (a run that is already
        stopping on another error)."""
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

    def send(self, path: str, pieces: list, arena: "_Arena | None") -> None:
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



# loading: plain data only ----------------------------------------------------------------------
def load(path: Path, device: torch.device, what_to_do: str = "") -> dict:
    """A checkpoint written by this trainer, on `device`. Anything else (not a torch file, truncated,
    a pickle naming code, not a checkpoint's dict) is a UsageError of one line naming the file."""
    state = _read(path, device, what_to_do)
    if not isinstance(state.get("model"), dict) or "step" not in state:
        raise _refused(path, "it is not a checkpoint of this trainer (no model and step)", what_to_do)
    return state


def peek(path: Path, what_to_do: str = "") -> dict:
    """A checkpoint's small entries (step, epoch, finished, ...) without reading its tensors."""
    state = _read(path, torch.device("cpu"), what_to_do, mmap=True)
    if not isinstance(state.get("model"), dict) or "step" not in state:
        raise _refused(path, "it is not a checkpoint of this trainer (no model and step)", what_to_do)
    return {key: value for key, value in state.items() if not isinstance(value, dict)}


# Where other scripts' checkpoints keep the weights (the first found wins): this trainer's and torchvision's
# reference scripts' `model`, timm's and Lightning's `state_dict`, and the names common in tutorials
WEIGHT_KEYS = ("model", "state_dict", "model_state_dict", "model_state", "net")
# What wrappers put before every name: DDP's and DataParallel's `module.`, torch.compile's `_orig_mod.`
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def load_weights(path: Path, what_to_do: str) -> tuple[dict, list[str]]:
    """A model's weights, on the CPU, from a checkpoint of this trainer or of another script (the
    weights under one of WEIGHT_KEYS, nested or not), or a bare state_dict (torchvision's .pth files);
    names without a wrapper's prefix. Also says how they were found (e.g. "under 'state_dict'")."""
    with torch.serialization.safe_globals([argparse.Namespace]):  # torchvision's and timm's scripts save their flags as one
        state = _read(path, torch.device("cpu"), what_to_do, mmap=True)
    found = []
    while not _is_state_dict(state):
        key = next((key for key in WEIGHT_KEYS if isinstance(state.get(key), dict)), None)
        if key is None:
            raise _refused(path, "it holds neither a checkpoint nor a state_dict of tensors", what_to_do)
        state = state[key]
        found.append(f"under {key!r}")
    while prefix := next((p for p in WRAPPER_PREFIXES if all(name.startswith(p) for name in state)), None):
        state = {name[len(prefix):]: tensor for name, tensor in state.items()}
        found.append(f"{prefix!r} dropped")
    return state, found


def _is_state_dict(value) -> bool:
    return (isinstance(value, dict) and bool(value)
            and all(isinstance(key, str) and isinstance(item, torch.Tensor) for key, item in value.items()))


def _read(path: Path, device: torch.device, what_to_do: str, mmap: bool = False) -> dict:
    try:
        state = torch.load(path, map_location=device, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:  # weights_only's refusal: a global it does not allow
        named = re.search(r"GLOBAL (\S+)", str(err))
        why = f"it names {named.group(1)}" if named else "it is not a torch checkpoint"
        raise _refused(path, f"{why}, which is not plain data; refused, nothing in it was run", what_to_do) from None
    except OSError as err:
        raise _refused(path, f"it cannot be read ({err.strerror or err})", what_to_do) from None
    except Exception as err:  # torch's readers fail in many ways on a truncated file or one of another kind
        reason = str(err).strip().split(". ")[0].splitlines()[0][:100] if str(err).strip() else type(err).__name__
        raise _refused(path, f"it is truncated or not a torch checkpoint ({reason})", what_to_do) from None
    if not isinstance(state, dict):
        raise _refused(path, f"it holds a {type(state).__name__}, not a checkpoint's dict", what_to_do)
    return state


def _refused(path: Path, why: str, what_to_do: str) -> UsageError:
    return UsageError(f"cannot load {path}: {why}; "
                      f"{what_to_do or 'restore it from a copy you trust or move it away to start afresh'}")
