"""Checkpoints: written atomically (a temporary file, fsync, rename, fsync of the folder), in the
background when asked, and read back as plain data only.

A crash or a full disk leaves the previous checkpoint.pt untouched. Loading uses
`torch.load(weights_only=True)`: tensors, numbers, strings, lists and dicts, nothing else, so a file
planted in a shared run directory cannot run code as the user (docs/checkpoints.md).

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
own, a resume reads the newest intact one of them when checkpoint.pt cannot be read (`to_resume`), and
--init-from reads the weights out of other scripts' checkpoints too (`load_weights`).
"""
import argparse
import errno
import fcntl
import os
import pickle
import re
import socket
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import torch

from train import checkpoint_writer
from train.errors import UsageError
from train.host_memory import HOST_MEMORY, Arena, Layout



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
    are removed), checkpoint-best.pt when it holds the best weights evaluated so far. Each is a file of
    its own (a copy-on-write clone where the file system has them, else a copy in the kernel), made
    atomically: damage done to checkpoint.pt in place (a truncation, a `>` redirect) never reaches it."""
    latest = folder / "checkpoint.pt"
    names = []
    if saved["step_in_epoch"] == 0 and saved["epoch"] > 0:
        names.append(f"checkpoint-epoch{saved['epoch']:03d}.pt")
    if saved.get("best_step") == saved["step"]:
        names.append(BEST_COPY)
    for name in names:
        _copy(latest, folder / name)
    if names:
        _sync_folder(folder)
    epochs = sorted((int(match.group(1)), path) for path in folder.iterdir()
                    if (match := EPOCH_COPY.fullmatch(path.name)))
    for _, older in epochs[:-keep]:
        older.unlink(missing_ok=True)


def to_resume(run_dir: Path) -> tuple[Path, str]:
    """The checkpoint a resume reads: checkpoint.pt, or where it is missing or cannot be read, the kept
    copy (--keep-checkpoints) of the highest step that can, with a line saying which and why ("" for
    checkpoint.pt). None readable: checkpoint.pt's refusal, naming the copies that failed too."""
    latest = run_dir / "checkpoint.pt"
    try:
        peek(latest)
        return latest, ""
    except UsageError as err:
        refused = err
    intact, broken = [], []
    for copy in sorted(run_dir.glob("checkpoint-*.pt")):
        try:
            intact.append((peek(copy)["step"], copy))
        except UsageError:
            broken.append(copy.name)
    if not intact:
        raise UsageError(f"{refused}; the kept copies {', '.join(broken)} cannot be read either") if broken else refused
    step, newest = max(intact)
    why = refused.why if latest.exists() else "it is missing"
    return newest, (f"{latest} cannot be read ({why}): resuming from {newest.name}, the newest intact "
                    f"checkpoint of the run (step {step})")


def resumable(run_dir: Path) -> bool:
    """Whether the run directory holds a checkpoint to resume from (checkpoint.pt or a kept copy)."""
    return any(run_dir.glob("checkpoint*.pt"))


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


def left_to_continue(run_dir: Path, written: bool) -> str:
    """What a stopped run leaves to continue from, for its last line (`written`: --checkpoints)."""
    off = "" if written else "this run writes no checkpoint (--no-checkpoints); "
    try:
        return f"{off}the last good checkpoint (step {peek(run_dir / 'checkpoint.pt')['step']}) is kept in {run_dir}"
    except (OSError, UsageError):  # none yet (or none readable): the run starts again from step 0
        return f"{off}no checkpoint was written yet in {run_dir}"


def evaluated_weights(state: dict, raw: bool = False) -> dict:
    """The weights a checkpoint's run evaluated: the average of the weights under "ema" when the run
    kept one (--ema-decay), else the trained weights under "model"; with `raw` (--raw-weights) the
    trained weights whatever the run kept."""
    return state["ema"] if isinstance(state.get("ema"), dict) and not raw else state["model"]


# Where other scripts' checkpoints keep the weights (the first found wins): this trainer's and torchvision's
# reference scripts' `model`, timm's and Lightning's `state_dict`, and the names common in tutorials
WEIGHT_KEYS = ("model", "state_dict", "model_state_dict", "model_state", "net")
# What wrappers put before every name: DDP's and DataParallel's `module.`, torch.compile's `_orig_mod.`
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def load_weights(path: Path, what_to_do: str) -> tuple[dict, list[str]]:
    """A model's weights, on the CPU, from a checkpoint of this trainer (the weights it evaluated: with
    --ema-decay, the average) or of another script (the weights under one of WEIGHT_KEYS, nested or not),
    or a bare state_dict (torchvision's .pth files); names without a wrapper's prefix. Also says how they
    were found (e.g. "under 'state_dict'")."""
    with torch.serialization.safe_globals([argparse.Namespace]):  # torchvision's and timm's scripts save their flags as one
        state = _read(path, torch.device("cpu"), what_to_do, mmap=True)
    found = []
    if isinstance(state, dict) and _is_state_dict(state.get("ema")):  # --ema-decay: what the run evaluated,
        state, found = state["ema"], ["the average under 'ema'"]  # as --test-only, predict and export take
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
    refusal = UsageError(f"cannot load {path}: {why}; "
                         f"{what_to_do or 'restore it from a copy you trust or move it away to start afresh'}")
    refusal.why = why  # (for to_resume's line)
    return refusal
