"""One job per run directory: rank 0 holds `RUN/run.lock` while the job runs, and a second job started
on the same --out-dir is refused (exit 2) before it writes anything.

The lock file names its holder (host, process, job) and rank 0 refreshes its time every few seconds.
A lock whose holder is gone does not block a restart. Telling a dead holder from a live one on a
shared filesystem:
- on the holder's own host (same host name, boot and process namespace), at once: the process is alive
  when /proc holds it with the start time the lock recorded (a reused process number does not count);
- from another host, by the refresh: a lock not refreshed for STALE_S seconds, measured on the
  filesystem's own clock (a probe file's time, so the hosts' clocks need not agree), is a dead host's.
  A fresher one is watched until it is refreshed (alive: refused) or goes stale (taken over).
- the job's own restarts keep it: a Slurm requeue (the same job and step), a torchrun restart (the same
  --rdzv-id) and a Horovod Elastic worker that becomes rank 0 (the same rendezvous) take the lock over
  from their own job at once, unless (outside Horovod Elastic) its holder still runs on this host: two
  runs started from one interactive allocation's shell share a job id.
"""
import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path

from train.errors import UsageError

LOCK_NAME = "run.lock"
REFRESH_S = 5.0  # rank 0 refreshes the lock's time this often
STALE_S = 30.0  # a lock not refreshed for this long on another host is a dead host's


def job_identity() -> str | None:
    """What stays the same across one job's restarts and differs between jobs, where the launcher
    says: Slurm's job and step, torchrun's rendezvous id, Horovod's rendezvous server."""
    env = os.environ
    if env.get("SLURM_JOB_ID"):
        return f"slurm {env['SLURM_JOB_ID']}" + (f".{env['SLURM_STEP_ID']}" if env.get("SLURM_STEP_ID") else "")
    if env.get("TORCHELASTIC_RUN_ID", "none") not in ("", "none"):
        return f"torchrun {env['TORCHELASTIC_RUN_ID']}"
    if env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR") and env.get("HOROVOD_GLOO_RENDEZVOUS_PORT"):
        return f"horovodrun {env['HOROVOD_GLOO_RENDEZVOUS_ADDR']}:{env['HOROVOD_GLOO_RENDEZVOUS_PORT']}"
    return None


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _this_machine() -> dict:
    """Where a process number means this process: the host name, its boot, its process namespace."""
    def read(path, how):
        try:
            return how(path)
        except OSError:
            return ""
    return {"host": socket.gethostname(),
            "boot_id": read("/proc/sys/kernel/random/boot_id", lambda p: Path(p).read_text().strip()),
            "pid_ns": read("/proc/self/ns/pid", os.readlink)}


def _read(path: Path) -> dict | None:
    """The holder a lock file names; {} for a file cut short (its writer died between create and write),
    None when there is no lock."""
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _fs_now(folder: Path) -> float:
    """The filesystem's clock: the time of a probe file just made there (removed at once)."""
    probe = folder / f".{LOCK_NAME}.probe.{os.getpid()}"
    fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        return os.fstat(fd).st_mtime
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


def describe(record: dict) -> str:
    if not record:
        return "an unknown process (its lock file is empty)"
    job = f", job {record['job']}" if record.get("job") else ""
    return f"process {record.get('pid')} on {record.get('host')}{job}, since {record.get('since')}"


def holder_alive(path: Path, record: dict, say=print, elastic: bool = False) -> bool:
    """Whether another job, or another live run of this one, holds the lock (see the module's docstring).
    May watch a lock on another host for up to STALE_S seconds. `elastic`: this process is a worker of
    a Horovod Elastic job, whose rank 0 may hold the lock alive: our own job's lock is never another's."""
    alive_here = _alive_here(record)
    if record.get("job") is not None and record.get("job") == job_identity() and (elastic or not alive_here):
        return False  # our own job's earlier incarnation (a requeue, a restart, a new rank 0)
    if alive_here is not None:  # (two runs of one interactive allocation on one node: the live one keeps it)
        return alive_here
    refreshed, age = _age(path)
    if age >= STALE_S:
        return False
    say(f"{path.parent}: the lock of {describe(record)} was refreshed {age:.0f} s ago; waiting up to "
        f"{STALE_S - age:.0f} s to see whether its host still answers")
    deadline = time.monotonic() + STALE_S - age
    while time.monotonic() < deadline:  # refreshed meanwhile: its holder answers; not: a dead host's
        time.sleep(min(1.0, REFRESH_S / 4))
        try:
            if path.stat().st_mtime != refreshed:
                return True
        except FileNotFoundError:
            return False
    return False


def running(out_dir: Path) -> dict | None:
    """The holder of a run directory's lock when it looks alive now, without watching (the scorer's
    question): alive on its own host, or refreshed within STALE_S seconds on another."""
    path = Path(out_dir) / LOCK_NAME
    record = _read(path)
    if not record:
        return None
    alive_here = _alive_here(record)
    if alive_here is not None:
        return record if alive_here else None
    return record if _age(path)[1] < STALE_S else None


def _alive_here(record: dict) -> bool | None:
    """Whether the lock's holder runs, where this host can tell (its host, boot and process namespace
    are ours: its process is alive with the start time it recorded); None where it cannot."""
    here = _this_machine()
    if not record or any(record.get(key) != here[key] for key in here):
        return None
    return _process_start(int(record.get("pid", -1))) == record.get("started")


def _age(path: Path) -> tuple[float, float]:
    """(time of the lock's last refresh, seconds since), on the filesystem's clock (this host's where
    the folder cannot be written); a lock gone meanwhile is infinitely old."""
    try:
        refreshed = path.stat().st_mtime
    except FileNotFoundError:
        return 0.0, float("inf")
    try:
        return refreshed, _fs_now(path.parent) - refreshed
    except OSError:
        return refreshed, time.time() - refreshed


def refusal(out_dir: Path, record: dict) -> UsageError:
    return UsageError(f"{out_dir} is in use by another job ({describe(record)}); wait for it to end, stop it, "
                      "or choose another --out-dir")


def check(out_dir: Path, say=print, elastic: bool = False) -> None:
    """Start-up's read-only check: refused when a live job of another holds the run directory."""
    path = Path(out_dir) / LOCK_NAME
    record = _read(path)
    if record is not None and holder_alive(path, record, say, elastic):
        raise refusal(Path(out_dir), record)


class RunLock:
    """The lock rank 0 holds: made whole, and only where there is none (one of two jobs started at once
    gets it), refreshed by a thread, removed by `release` only while it is still this process's."""

    def __init__(self, path: Path, record: dict):
        self.path, self.record = path, record
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, name="run-lock", daemon=True)
        self._thread.start()

    @classmethod
    def acquire(cls, out_dir: Path, say=print, elastic: bool = False) -> "RunLock":
        path = Path(out_dir) / LOCK_NAME
        record = {**_this_machine(), "pid": os.getpid(), "started": _process_start(os.getpid()),
                  "job": job_identity(), "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "token": uuid.uuid4().hex}
        for _ in range(5):
            try:
                _create_whole(path, json.dumps(record) + "\n")
            except FileExistsError:
                holder = _read(path)
                if holder is not None and holder_alive(path, holder, say, elastic):
                    raise refusal(Path(out_dir), holder)
                _remove_dead(path, holder)
                continue
            return cls(path, record)
        raise UsageError(f"{out_dir}: could not take its lock {path} (other jobs keep taking it); start one job at a time")

    def mine(self) -> bool:
        return (_read(self.path) or {}).get("token") == self.record["token"]

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_S):
            try:
                if not self.mine():  # taken over (a new rank 0 of this job): no longer ours to refresh
                    return
                os.utime(self.path)
            except OSError:  # a filesystem that hiccups: the next refresh tries again
                pass

    def hand_over(self) -> None:
        """Stop refreshing, leave the file: this process is no longer rank 0, the new one takes it over."""
        self._stop.set()

    def release(self) -> None:
        """The job ends: the lock goes, if it is still ours."""
        self._stop.set()
        try:
            if self.mine():
                self.path.unlink(missing_ok=True)
        except OSError:
            pass


def _create_whole(path: Path, text: str) -> None:
    """`path` made with `text` in it, or FileExistsError: written aside, then hard-linked into place
    (which, like O_EXCL, fails where the name exists), so that nobody reads it empty. A reader who did
    (another job's start-up check, a Horovod Elastic worker's) would take it for an unknown live job's."""
    aside = path.with_name(f".{LOCK_NAME}.{uuid.uuid4().hex}.new")  # (not the pid: hosts sharing the folder reuse them)
    with open(aside, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(aside, path)
    except FileExistsError:
        raise
    except OSError:  # a filesystem without hard links: created and written in two steps
        with open(path, "x") as f:
            f.write(text)
    finally:
        aside.unlink(missing_ok=True)


def _remove_dead(path: Path, holder: dict | None) -> None:
    """Moves a dead holder's lock aside and removes it; if the file moved was not the one judged dead
    (another job took the lock in between), it is put back."""
    if holder is None:
        return
    aside = path.with_name(f".{LOCK_NAME}.{os.getpid()}.dead")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    moved = _read(aside) or {}
    if moved.get("token") != holder.get("token"):
        try:
            os.link(aside, path)
        except FileExistsError:
            pass
    aside.unlink(missing_ok=True)
